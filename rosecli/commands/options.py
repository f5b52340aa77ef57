"""Every engine, sampling and workload option, defined once: flag, help, panel and bounds here,
the default read from the config dataclasses (`EngineConfig`, `SamplingParams`, `WorkloadSpec`).

A command adds option groups, not copies::

    @with_options(engine_options(), sampling_options(exclude=("stop",)))
    def cmd(config: EngineConfig, params: SamplingParams, save_result: SaveResult = None): ...

The groups' options take the place of the command's ``config`` / ``params`` / ``spec`` parameter
in the signature Typer reads (so `--help` lists them there, in their panels), and the command is
called with the built, validated object. A command that also wants an option's raw value names
it as a parameter (``warmup_runs``). Per-command defaults: ``with_options(..., defaults={...})``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import pathlib
import re
import sys
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Optional

import typer

from rosecli.bench.workload import SCHEDULES, WorkloadSpec
from rosecli.engine.config import (CPU_WEIGHTS, DEVICES, DTYPES, LOAD_FORMATS, MAX_INT32, MAX_SEED, EngineConfig,
                                   SamplingParams, default_threads)
from rosecli.engine.errors import ConfigError, RequestError, RoseError

ENGINE = "Engine"
SAMPLING = "Sampling"
WORKLOAD = "Workload"
CUDA = "CUDA"  # options that apply on a CUDA device only: their own panel, their help starts "(CUDA)"
# Upper bounds checked as the command line is parsed, so a huge number is refused naming its flag
# before it reaches a fixed-width integer (the engine's MAX_INT32 and MAX_SEED) or sizes a list.
MAX_REQUESTS = 100_000
MAX_RUNS = 1000

_FROM_CONFIG = object()  # an option's default is its dataclass field's


@dataclass(frozen=True)
class Opt:
    """One command-line option. ``field``: the dataclass field it sets when that is not its own
    name; ``default``: given only for options that set no field (or whose flag means something
    else when left out, as --temperature)."""

    flags: str
    type: Any
    help: str
    panel: str
    max: Optional[float] = None
    envvar: Optional[str] = None
    field: Optional[str] = None
    default: Any = _FROM_CONFIG
    choices: tuple[str, ...] = ()  # shown in --help as auto|cpu|cuda (the config checks the value)
    metavar: Optional[str] = None  # what to type after the flag, where no default or choices say it

    @property
    def full_help(self) -> str:
        return f"({CUDA}) {self.help}" if self.panel == CUDA else self.help

    def annotation(self):
        extra = {k: v for k, v in (("max", self.max), ("envvar", self.envvar)) if v is not None}
        metavar = "|".join(self.choices) if self.choices else self.metavar
        if metavar:
            extra["metavar"] = metavar
        return Annotated[self.type, typer.Option(*self.flags.split(), help=self.full_help, rich_help_panel=self.panel,
                                                 **extra)]


def _field_defaults(cls) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


ENGINE_OPTIONS: dict[str, Opt] = {
    "model": Opt("--model -m", str, "smollm2-135m (default), gpt2 (with --load-format dummy), a local Hugging Face "
                 "directory, a .gguf file, or a hub id.", ENGINE),
    "cache_dir": Opt("--cache-dir", Optional[str], "Where converted models are cached (default ~/.cache/rosecli).",
                     ENGINE, envvar="ROSE_CACHE_DIR", metavar="DIR"),
    "cpu_weights": Opt("--cpu-weights", str, "(CPU) What the linear layers read: auto (a Q4 GGUF's own 4-bit and 8-bit "
                       "blocks through rose's C++ kernels, built once with g++ on an AVX-512 VNNI CPU; any layer "
                       "not in such blocks float16; without the kernels, gate/up as torch int4 and the rest "
                       "float16), blocks (every layer 4-bit blocks, quantizing if need be), or all int4, float16, "
                       "int8, or float (as loaded, the reference). docs/cpu.md has each one's speed and agreement.", ENGINE, choices=CPU_WEIGHTS),
    "threads": Opt("--threads", Optional[int], "(CPU) Threads for the model's math. Default: the CPUs this process "
                   "may use less those other programs keep busy at start "
                   f"({default_threads()} now).", ENGINE, metavar="N"),
    "load_format": Opt("--load-format", str, "auto: real weights; dummy: random seeded weights of the named shape, "
                       "no files needed.", ENGINE, choices=LOAD_FORMATS),
    "device": Opt("--device", str, "Where the model runs; auto: CUDA when torch sees a GPU, else CPU.", ENGINE,
                  choices=DEVICES),
    "dtype": Opt("--dtype", str, "auto: float32 on CPU; on CUDA the checkpoint's dtype (float16 for float32 "
                 "ones).", ENGINE, choices=DTYPES),
    "dummy_layers": Opt("--dummy-layers", Optional[int], "With --load-format dummy: build only the first N layers "
                        "of the shape (quick runs of a big model's shape).", ENGINE, max=1024, metavar="N"),
    "seed": Opt("--seed", int, "Seed for dummy weights and sampling.", ENGINE, max=MAX_SEED),
    "max_model_len": Opt("--max-model-len", Optional[int], "Context length (default: the model's).", ENGINE,
                         max=MAX_INT32, metavar="N"),
    "block_size": Opt("--block-size", int, "Tokens per KV block.", ENGINE),
    "num_gpu_blocks": Opt("--num-gpu-blocks", Optional[int], "KV blocks in the pool (default: sized from "
                          "--gpu-memory-utilization on CUDA, 8192 tokens' worth on CPU).", ENGINE, max=MAX_INT32,
                          metavar="N"),
    "gpu_memory_utilization": Opt("--gpu-memory-utilization", float, "Share of GPU memory for weights, activations "
                                  "and KV cache.", CUDA),
    "prefix_cache": Opt("--prefix-cache/--no-prefix-cache", bool, "Share KV blocks of identical prompt prefixes.",
                        ENGINE, field="enable_prefix_cache"),
    "max_batch_size": Opt("--max-batch-size", int, "Most sequences in one decode step.", ENGINE),
    "prefill_max_batch_size": Opt("--prefill-max-batch-size", int, "Most sequences in one prefill step.", ENGINE),
    "prefill_max_tokens": Opt("--prefill-max-tokens", int, "Most prompt tokens in one prefill step; longer prompts "
                              "are prefilled in chunks.", ENGINE, max=MAX_INT32),
    "max_active_requests": Opt("--max-active-requests", Optional[int], "Most admitted (prefilling or decoding) "
                               "requests; default --max-batch-size.", ENGINE, max=MAX_INT32, metavar="N"),
    "paged_attn": Opt("--paged-attn/--no-paged-attn", Optional[bool], "Triton paged-attention kernels (default on "
                      "CUDA) or gather + SDPA.", CUDA),
    "cuda_graph": Opt("--cuda-graph/--no-cuda-graph", Optional[bool], "Replay captured CUDA graphs for decode "
                      "(default on CUDA).", CUDA),
    "overlap_schedule": Opt("--overlap-schedule/--no-overlap-schedule", Optional[bool], "Prepare and launch decode "
                            "step N+1 while the device runs step N (default on CUDA).", ENGINE),
    "tensor_parallel_size": Opt("--tensor-parallel-size -tp", int, "Shard the model over N processes (GPUs on "
                                "CUDA, gloo on CPU), one rank each.", ENGINE, max=64, metavar="N"),
    "nvtx": Opt("--nvtx", bool, "NVTX ranges over engine stages (for Nsight Systems).", CUDA),
    "stream_interval": Opt("--stream-interval", int, "Flush streamed text every N tokens (and at finish).", ENGINE,
                           max=MAX_INT32),
    "tokenize_workers": Opt("--tokenize-workers", int, "Threads that tokenize prompts off the engine thread (0: "
                            "tokenize on the caller's thread).", ENGINE),
    "max_inflight_requests": Opt("--max-inflight-requests", Optional[int], "Most requests submitted and not "
                                 "finished; beyond it admission waits or is refused.", ENGINE, max=MAX_INT32,
                                 metavar="N"),
}

SAMPLING_OPTIONS: dict[str, Opt] = {
    "max_new_tokens": Opt("--max-new-tokens -n", int, "Most tokens to generate per request.", SAMPLING,
                          max=MAX_INT32),
    "temperature": Opt("--temperature", Optional[float], "Sampling temperature; 0 is greedy. Default: 0, or 1.0 "
                       "with --do-sample.", SAMPLING, default=None, metavar="X"),
    "top_k": Opt("--top-k", int, "Keep the k most likely tokens (0: all).", SAMPLING, max=MAX_INT32),
    "top_p": Opt("--top-p", float, "Keep the smallest set of tokens whose mass reaches p.", SAMPLING),
    "min_p": Opt("--min-p", float, "Drop tokens less likely than min-p times the most likely one (0: off).",
                 SAMPLING),
    "presence_penalty": Opt("--presence-penalty", float, "Subtract this from the logit of every token already "
                            "generated, -2..2 (0: off; OpenAI's).", SAMPLING),
    "frequency_penalty": Opt("--frequency-penalty", float, "Subtract this times its count so far from each "
                             "generated token's logit, -2..2 (0: off; OpenAI's).", SAMPLING),
    "repetition_penalty": Opt("--repetition-penalty", float, "Divide positive logits (multiply negative ones) of "
                              "tokens in the prompt or the output by this (1: off; vLLM's and HF's).", SAMPLING),
    "min_tokens": Opt("--min-tokens", int, "Generate at least this many tokens before EOS, a stop token or a stop "
                      "string may end a request.", SAMPLING, max=MAX_INT32),
    "do_sample": Opt("--do-sample", bool, "Sample instead of greedy decoding.", SAMPLING, default=False),
    "stop_on_eos": Opt("--stop-on-eos/--no-stop-on-eos", bool, "Stop at the model's EOS token.", SAMPLING),
    "stop": Opt("--stop", Optional[list[str]], "Stop string (repeatable); not included in the output.", SAMPLING,
                default=None, metavar="TEXT"),
    "json_schema": Opt("--json-schema", Optional[str], "Constrain the output to JSON valid against the JSON schema "
                       "in FILE (needs rosecli[structured]).", SAMPLING, default=None, metavar="FILE"),
    "regex": Opt("--regex", Optional[str], "Constrain the output to a full match of this regular expression (needs "
                 "rosecli[structured]).", SAMPLING, default=None, metavar="REGEX"),
}

WORKLOAD_OPTIONS: dict[str, Opt] = {
    "prompt": Opt("--prompt", str, "Prompt text of every request.", WORKLOAD),
    "prompt_repeats": Opt("--prompt-repeats", int, "Repeat the prompt N times (longer prompts).", WORKLOAD,
                          max=MAX_REQUESTS),
    "unique_prompts": Opt("--unique-prompts", bool, "Prefix each prompt with its index so no two share a prefix.",
                          WORKLOAD),
    "pretok": Opt("--pretok", bool, "Tokenize prompts before the run; the engine gets ids.", WORKLOAD),
    "num_requests": Opt("--num-requests", int, "Requests per run.", WORKLOAD, max=MAX_REQUESTS),
    "input_len": Opt("--input-len", Optional[int], "Random-token prompts of this many tokens (replaces --prompt).",
                     WORKLOAD, max=MAX_INT32, metavar="N"),
    "output_len": Opt("--output-len", Optional[int], "New tokens per request (replaces --max-new-tokens; varies "
                      "with --range-ratio).", WORKLOAD, max=MAX_INT32, metavar="N"),
    "range_ratio": Opt("--range-ratio", float, "--input-len/--output-len vary uniformly within +- this fraction.",
                       WORKLOAD),
    "submit_interval_ms": Opt("--submit-interval-ms", float, "Gap between submits (0: all at once).", WORKLOAD),
    "submit_schedule": Opt("--submit-schedule", str, "absolute: request i is due at i*interval; relative: wait the "
                           "interval after each submit returns.", WORKLOAD, choices=SCHEDULES),
    "request_rate": Opt("--request-rate", Optional[float], "Poisson arrivals at this many requests/s (seeded by "
                        "--seed).", WORKLOAD, metavar="RATE"),
    "warmup_runs": Opt("--warmup-runs", int, "Runs before measuring (not counted).", WORKLOAD, max=MAX_RUNS,
                       default=0),
    "repeat_runs": Opt("--repeat-runs", int, "Measured runs; the summary is their median.", WORKLOAD, max=MAX_RUNS,
                       default=1),
}

_DATACLASS_OF = {id(ENGINE_OPTIONS): EngineConfig, id(SAMPLING_OPTIONS): SamplingParams,
                 id(WORKLOAD_OPTIONS): WorkloadSpec}


def option_default(table: dict[str, Opt], name: str) -> Any:
    """An option's default when a command does not override it: its dataclass field's, unless the
    option sets no field (or means something else when left out)."""
    opt = table[name]
    if opt.default is not _FROM_CONFIG:
        return opt.default
    return _field_defaults(_DATACLASS_OF[id(table)])[opt.field or name]


# ---- building the configs from the options' values ----------------------------------------------


def _fields(table: dict[str, Opt], cls, values: dict) -> dict:
    """The keyword arguments of ``cls`` among ``values``: each option by its field's name. Fields of
    ``cls`` that another group defines (a workload's seed and max_new_tokens) are taken too."""
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for name, value in values.items():
        opt = table.get(name)
        field = (opt.field if opt is not None else None) or name
        if field in names:
            out[field] = value
    return out


def build_engine_config(values: dict) -> EngineConfig:
    """``values``: option name -> value; options left out keep the dataclass defaults."""
    with flag_names():
        config = EngineConfig(**_fields(ENGINE_OPTIONS, EngineConfig, values))
    _check_nvtx(config)
    _check_cache_dir(config)
    return config


def build_sampling_params(values: dict) -> SamplingParams:
    """Greedy unless --do-sample or a positive --temperature is given (as vLLM: temperature > 0
    samples). --seed seeds the engine, not each request: the parameters carry no seed."""
    kwargs = _fields(SAMPLING_OPTIONS, SamplingParams, values)
    kwargs.pop("seed", None)
    if kwargs.get("temperature") is None:
        kwargs["temperature"] = 1.0 if values.get("do_sample") else 0.0
    stop = kwargs.pop("stop", None) or []
    for s in stop:
        check_text("--stop", s)
    structured = _grammar(values.get("json_schema"), values.get("regex"))
    with flag_names():
        return SamplingParams(**kwargs, stop=list(stop), structured=structured)


def _grammar(schema_file: Optional[str], regex: Optional[str]):
    """--json-schema FILE / --regex as the grammar the output must match (None: neither given)."""
    if schema_file is None and regex is None:
        return None
    if schema_file is not None and regex is not None:
        raise ConfigError("--json-schema and --regex both constrain the output: give one of them")
    from rosecli.engine import structured

    flag = "--json-schema" if schema_file is not None else "--regex"
    if not structured.available():
        raise ConfigError(f"{flag} needs the xgrammar library: install rosecli[structured] (pip install xgrammar)")
    if regex is not None:
        if not regex:
            raise ConfigError("--regex must not be empty")
        return structured.GrammarSpec("regex", regex, "--regex")
    try:
        text = pathlib.Path(schema_file).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--json-schema: cannot read {schema_file}: {getattr(e, 'strerror', None) or e}") from None
    try:
        return structured.GrammarSpec.json_schema(text, "--json-schema")
    except RequestError as e:
        raise ConfigError(f"{e} (in {schema_file})") from None


def build_workload_spec(values: dict) -> WorkloadSpec:
    check_text("--prompt", values.get("prompt", ""))
    kwargs = _fields(WORKLOAD_OPTIONS, WorkloadSpec, values)
    if kwargs.get("request_rate") is not None:
        kwargs["request_rate"] = float(kwargs["request_rate"])
    return WorkloadSpec(**kwargs)


@dataclass(frozen=True)
class Group:
    param: str  # the command's parameter that receives the built object
    table: dict[str, Opt]
    names: tuple[str, ...]
    build: Callable[[dict], Any]


def _group(param, table, build, exclude) -> Group:
    unknown = set(exclude) - set(table)
    if unknown:
        raise ValueError(f"no such option to exclude: {sorted(unknown)}")
    return Group(param, table, tuple(n for n in table if n not in exclude), build)


def engine_options(exclude=()) -> Group:
    """The engine options, built into an `EngineConfig` passed as ``config``."""
    return _group("config", ENGINE_OPTIONS, build_engine_config, exclude)


def sampling_options(exclude=()) -> Group:
    """The sampling options, built into a `SamplingParams` passed as ``params``."""
    return _group("params", SAMPLING_OPTIONS, build_sampling_params, exclude)


def workload_options(exclude=()) -> Group:
    """The workload options, built into a `WorkloadSpec` passed as ``spec`` (its seed and
    max_new_tokens come from --seed and --max-new-tokens)."""
    return _group("spec", WORKLOAD_OPTIONS, build_workload_spec, exclude)


_BUILD_ORDER = ("spec", "params", "config")  # cheap checks first; the config checks the cache directory


def with_options(*groups: Group, defaults: Optional[dict[str, Any]] = None):
    """Add option groups to a command (see the module's docstring). ``defaults``: this command's
    own default for some options, where it differs from the dataclass's."""
    defaults = dict(defaults or {})

    def decorate(fn):
        sig = inspect.signature(fn, eval_str=True)
        takes = set(sig.parameters)
        by_param = {g.param: g for g in groups}
        missing = set(by_param) - takes
        if missing:
            raise TypeError(f"{fn.__name__} adds option groups it does not take: {sorted(missing)}")
        option_names = [n for g in groups for n in g.names]
        unknown = set(defaults) - set(option_names)
        if unknown:
            raise TypeError(f"{fn.__name__}: defaults for options it does not have: {sorted(unknown)}")
        params = []
        for p in sig.parameters.values():
            if p.name in by_param:
                g = by_param[p.name]
                for name in g.names:
                    default = defaults[name] if name in defaults else option_default(g.table, name)
                    params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                                    annotation=g.table[name].annotation()))
            elif p.name not in option_names:
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
        exposed = inspect.Signature(params)
        passed_through = [n for n in option_names if n in takes]

        @functools.wraps(fn)
        def wrapper(**kwargs):
            values = {n: kwargs.pop(n) for n in option_names if n in kwargs}
            if "warmup_runs" in values or "repeat_runs" in values:
                check_runs(values.get("warmup_runs", 0), values.get("repeat_runs", 1))
            for param in sorted(by_param, key=_BUILD_ORDER.index):
                kwargs[param] = by_param[param].build(values)
            kwargs.update({n: values[n] for n in passed_through if n in values})
            return fn(**kwargs)

        wrapper.__signature__ = exposed
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


# ---- flag names in errors, text checks, exits ----------------------------------------------------


# Engine parameters whose name is not the flag a user typed; every other name maps by turning
# "_" into "-" (max_new_tokens -> --max-new-tokens).
_FLAG_OF = {"enable_prefix_cache": "--prefix-cache"}
_PARAM_NAMES = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_on_eos", "stop",
                "enable_prefix_cache", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "min_tokens")
_PARAM_RE = re.compile(r"(?<![\w-])(" + "|".join(_PARAM_NAMES) + r")(?![\w-])")


@contextlib.contextmanager
def flag_names():
    """The one place where a validation error from EngineConfig / SamplingParams, which name
    their Python fields (``max_new_tokens``), is re-worded with the flag the user typed
    (``--max-new-tokens``)."""
    try:
        yield
    except ConfigError as e:
        message = _PARAM_RE.sub(lambda m: _FLAG_OF.get(m[1], "--" + m[1].replace("_", "-")), str(e))
        raise ConfigError(message) from None


def check_text(what: str, text: str) -> None:
    """Text from the command line goes to the tokenizer as UTF-8; bytes that are not UTF-8 reach
    Python as lone surrogates (surrogateescape) and are refused here, naming where they were."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) - 0xDC00 if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else None
        what_byte = f"byte 0x{byte:02x}" if byte is not None else f"character U+{ord(text[e.start]):04X}"
        raise ConfigError(f"{what} is not valid UTF-8 ({what_byte} at character {e.start}): pass UTF-8 text "
                          "(check the terminal's or the script's encoding)") from None


def _check_nvtx(config: EngineConfig) -> None:
    if not config.nvtx:
        return
    import torch

    if config.device == "cpu" or not torch.cuda.is_available():
        where = "--device cpu" if config.device == "cpu" else "this machine has no CUDA GPU"
        raise ConfigError(f"--nvtx marks CUDA ranges for Nsight Systems and needs a CUDA GPU ({where}): "
                          "leave out --nvtx (rose profile without it still prints host time per stage)")


def _check_cache_dir(config: EngineConfig) -> None:
    from rosecli.engine.config import cache_root  # not the loader: it imports torch (seconds)

    root = cache_root(config)
    check_writable_dir(f"--cache-dir {root}" if config.cache_dir else
                       f"the model cache {root} (default; set with --cache-dir)", root)


def check_writable_dir(name: str, path) -> None:
    """Refuse a directory that cannot be created or written (``name``: the flag and its value, for
    the message) before anything is loaded or run."""
    path = pathlib.Path(path).expanduser().absolute()
    existing = path
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        what = "a file" if existing.exists() else "a broken link"
        where = "" if existing == path else f" ({existing} is {what})"
        raise ConfigError(f"{name} is not a directory{where}: pass a directory (it is created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({existing} is not writable)"
        raise ConfigError(f"{name} is not writable{where}: pass a directory you can write to")


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def user_errors(fn):
    """Turn a user's mistake (RoseError) into one line on stderr and a non-zero exit, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RoseError as e:
            fail(str(e))
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


def check_runs(warmup_runs: int, repeat_runs: int) -> None:
    if warmup_runs < 0:
        raise ConfigError(f"--warmup-runs must be >= 0, got {warmup_runs}")
    if repeat_runs < 1:
        raise ConfigError(f"--repeat-runs must be >= 1, got {repeat_runs}")
