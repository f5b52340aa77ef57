"""Every CLI option, spelled once. Subcommands reuse these annotated types and build the one
`EngineConfig` / `SamplingParams` through `engine_config()` / `sampling_params()`."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import pathlib
import re
import sys
from typing import Annotated, Optional

import typer

from rosecli.engine.config import MAX_INT32, MAX_SEED, EngineConfig, SamplingParams, default_threads
from rosecli.engine.errors import ConfigError, RoseError

ENGINE = "Engine"
SAMPLING = "Sampling"
# Upper bounds checked as the command line is parsed, so a huge number is refused naming its flag
# before it reaches a fixed-width integer (the engine's MAX_INT32 and MAX_SEED) or sizes a list.
MAX_REQUESTS = 100_000
MAX_RUNS = 1000

Model = Annotated[str, typer.Option("--model", help="smollm2-135m (default), gpt2 (with --load-format dummy), "
                                    "a local Hugging Face directory, a .gguf file, or a hub id.",
                                    rich_help_panel=ENGINE)]
LoadFormat = Annotated[str, typer.Option("--load-format", help="auto: real weights; dummy: random seeded weights "
                                         "of the named shape, no files needed.", rich_help_panel=ENGINE)]
Device = Annotated[str, typer.Option("--device", help="auto | cpu | cuda.", rich_help_panel=ENGINE)]
Dtype = Annotated[str, typer.Option("--dtype", help="auto (float32 on CPU; on CUDA the checkpoint's dtype, "
                                    "float16 for float32 ones) | float32 | float16 | bfloat16.", rich_help_panel=ENGINE)]
Seed = Annotated[int, typer.Option("--seed", help="Seed for dummy weights and sampling.", max=MAX_SEED,
                                    rich_help_panel=ENGINE)]
MaxModelLen = Annotated[Optional[int], typer.Option("--max-model-len", help="Context length (default: the "
                                                    "model's).", max=MAX_INT32, rich_help_panel=ENGINE)]
BlockSize = Annotated[int, typer.Option("--block-size", help="Tokens per KV block.", rich_help_panel=ENGINE)]
NumGpuBlocks = Annotated[Optional[int], typer.Option("--num-gpu-blocks", help="KV blocks in the pool (default: "
                                                     "sized from --gpu-memory-utilization on CUDA, 8192 tokens' "
                                                     "worth on CPU).", max=MAX_INT32, rich_help_panel=ENGINE)]
GpuMemUtil = Annotated[float, typer.Option("--gpu-memory-utilization", help="Share of GPU memory for weights, "
                                           "activations and KV cache.", rich_help_panel=ENGINE)]
PrefixCache = Annotated[bool, typer.Option("--prefix-cache/--no-prefix-cache", help="Share KV blocks of "
                                           "identical prompt prefixes.", rich_help_panel=ENGINE)]
MaxBatchSize = Annotated[int, typer.Option("--max-batch-size", help="Most sequences in one decode step.",
                                           rich_help_panel=ENGINE)]
PrefillMaxBatchSize = Annotated[int, typer.Option("--prefill-max-batch-size", help="Most sequences in one "
                                                  "prefill step.", rich_help_panel=ENGINE)]
PrefillMaxTokens = Annotated[int, typer.Option("--prefill-max-tokens", help="Most prompt tokens in one prefill "
                                               "step; longer prompts are prefilled in chunks.",
                                               max=MAX_INT32, rich_help_panel=ENGINE)]
MaxActive = Annotated[Optional[int], typer.Option("--max-active-requests", help="Most admitted (prefilling or "
                                                  "decoding) requests; default --max-batch-size.",
                                                  max=MAX_INT32, rich_help_panel=ENGINE)]
PagedAttn = Annotated[Optional[bool], typer.Option("--paged-attn/--no-paged-attn", help="Triton paged-attention "
                                                   "kernels (default on CUDA) or gather + SDPA.",
                                                   rich_help_panel=ENGINE)]
CudaGraph = Annotated[Optional[bool], typer.Option("--cuda-graph/--no-cuda-graph", help="Replay captured CUDA "
                                                   "graphs for decode (default on CUDA).", rich_help_panel=ENGINE)]
OverlapSchedule = Annotated[Optional[bool], typer.Option("--overlap-schedule/--no-overlap-schedule", help="Prepare "
                                                         "and launch decode step N+1 while the GPU runs step N "
                                                         "(default on CUDA).", rich_help_panel=ENGINE)]
Nvtx = Annotated[bool, typer.Option("--nvtx", help="NVTX ranges over engine stages (for Nsight Systems).",
                                    rich_help_panel=ENGINE)]
StreamInterval = Annotated[int, typer.Option("--stream-interval", help="Flush streamed text every N tokens "
                                             "(and at finish).", max=MAX_INT32, rich_help_panel=ENGINE)]
TokenizeWorkers = Annotated[int, typer.Option("--tokenize-workers", help="Threads that tokenize prompts off "
                                              "the engine thread (0: tokenize on the caller's thread).",
                                              rich_help_panel=ENGINE)]
CpuWeights = Annotated[str, typer.Option("--cpu-weights", help="On CPU, what the linear layers read: auto "
                                         "(gate/up as their own 4-bit codes where the weights are 4-bit, as in a "
                                         "Q4 GGUF; the rest float16) | int4 | float16 | int8 | float (as loaded, "
                                         "the reference). docs/cpu.md has each one's speed and agreement.",
                                         rich_help_panel=ENGINE)]
Threads = Annotated[Optional[int], typer.Option("--threads", help="CPU threads for the model's math. Default: "
                                                "the CPUs this process may use less those other programs keep "
                                                f"busy at start ({default_threads()} now).",
                                                rich_help_panel=ENGINE)]
CacheDir = Annotated[Optional[str], typer.Option("--cache-dir", envvar="ROSE_CACHE_DIR", help="Where converted "
                                                 "models are cached (default ~/.cache/rosecli).",
                                                 rich_help_panel=ENGINE)]
MaxInflight = Annotated[Optional[int], typer.Option("--max-inflight-requests", help="Most requests submitted "
                                                    "and not finished; beyond it admission waits or is "
                                                    "refused.", max=MAX_INT32, rich_help_panel=ENGINE)]

MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="Most tokens to generate per request.",
                                           max=MAX_INT32, rich_help_panel=SAMPLING)]
Temperature = Annotated[Optional[float], typer.Option("--temperature", help="Sampling temperature; 0 is greedy. "
                                                      "Default: 0, or 1.0 with --do-sample.",
                                                      rich_help_panel=SAMPLING)]
TopK = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0: all).",
                                   max=MAX_INT32, rich_help_panel=SAMPLING)]
TopP = Annotated[float, typer.Option("--top-p", help="Keep the smallest set of tokens whose mass reaches p.",
                                     rich_help_panel=SAMPLING)]
DoSample = Annotated[bool, typer.Option("--do-sample", help="Sample instead of greedy decoding.",
                                        rich_help_panel=SAMPLING)]
StopOnEos = Annotated[bool, typer.Option("--stop-on-eos/--no-stop-on-eos", help="Stop at the model's EOS token.",
                                         rich_help_panel=SAMPLING)]
Stop = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable); not included in "
                                                   "the output.", rich_help_panel=SAMPLING)]


def engine_config(*, model: str, load_format: str, device: str, dtype: str, seed: int,
                  max_model_len: Optional[int] = None, block_size: int = 16,
                  num_gpu_blocks: Optional[int] = None, gpu_memory_utilization: float = 0.9,
                  prefix_cache: bool = True, max_batch_size: int = 64, prefill_max_batch_size: int = 64,
                  prefill_max_tokens: int = 2048, max_active_requests: Optional[int] = None,
                  paged_attn: Optional[bool] = None, cuda_graph: Optional[bool] = None,
                  overlap_schedule: Optional[bool] = None, nvtx: bool = False,
                  stream_interval: int = 1, tokenize_workers: int = 0,
                  max_inflight_requests: Optional[int] = None, cache_dir: Optional[str] = None,
                  cpu_weights: str = "auto", threads: Optional[int] = None,
                  show_progress: bool = True) -> EngineConfig:
    with flag_names():
        config = EngineConfig(
            model=model, load_format=load_format, device=device, dtype=dtype, seed=seed,
            max_model_len=max_model_len, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
            gpu_memory_utilization=gpu_memory_utilization, enable_prefix_cache=prefix_cache,
            max_batch_size=max_batch_size, prefill_max_batch_size=prefill_max_batch_size,
            prefill_max_tokens=prefill_max_tokens, max_active_requests=max_active_requests,
            paged_attn=paged_attn, cuda_graph=cuda_graph, overlap_schedule=overlap_schedule, nvtx=nvtx,
            stream_interval=stream_interval,
            tokenize_workers=tokenize_workers, max_inflight_requests=max_inflight_requests, cache_dir=cache_dir,
            cpu_weights=cpu_weights, threads=threads, show_progress=show_progress)
    _check_nvtx(config)
    _check_cache_dir(config)
    return config


def sampling_params(*, max_new_tokens: int, temperature: Optional[float], top_k: int, top_p: float,
                    do_sample: bool, stop_on_eos: bool, stop: Optional[list[str]] = None,
                    seed: Optional[int] = None) -> SamplingParams:
    """Greedy unless --do-sample or a positive --temperature is given (as vLLM: temperature > 0 samples)."""
    if temperature is None:
        temperature = 1.0 if do_sample else 0.0
    for s in stop or []:
        check_text("--stop", s)
    with flag_names():
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              stop_on_eos=stop_on_eos, stop=list(stop or []), seed=seed)


# Engine parameters whose name is not the flag a user typed; every other name maps by turning
# "_" into "-" (max_new_tokens -> --max-new-tokens).
_FLAG_OF = {"enable_prefix_cache": "--prefix-cache"}
_PARAM_NAMES = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_on_eos", "stop",
                "enable_prefix_cache")
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
    from rosecli.engine.loader import cache_root

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


WORKLOAD = "Workload"
Prompt = Annotated[str, typer.Option("--prompt", help="Prompt text of every request.", rich_help_panel=WORKLOAD)]
PromptRepeats = Annotated[int, typer.Option("--prompt-repeats", help="Repeat the prompt N times (longer prompts).",
                                            max=MAX_REQUESTS, rich_help_panel=WORKLOAD)]
UniquePrompts = Annotated[bool, typer.Option("--unique-prompts", help="Prefix each prompt with its index so no two "
                                             "share a prefix.", rich_help_panel=WORKLOAD)]
Pretok = Annotated[bool, typer.Option("--pretok", help="Tokenize prompts before the run; the engine gets ids.",
                                      rich_help_panel=WORKLOAD)]
NumRequests = Annotated[int, typer.Option("--num-requests", help="Requests per run.", max=MAX_REQUESTS,
                                          rich_help_panel=WORKLOAD)]
InputLen = Annotated[Optional[int], typer.Option("--input-len", help="Random-token prompts of this many tokens "
                                                 "(replaces --prompt).", max=MAX_INT32, rich_help_panel=WORKLOAD)]
OutputLen = Annotated[Optional[int], typer.Option("--output-len", help="New tokens per request (replaces "
                                                  "--max-new-tokens; varies with --range-ratio).",
                                                  max=MAX_INT32, rich_help_panel=WORKLOAD)]
RangeRatio = Annotated[float, typer.Option("--range-ratio", help="--input-len/--output-len vary uniformly within "
                                           "+- this fraction.", rich_help_panel=WORKLOAD)]
SubmitIntervalMs = Annotated[float, typer.Option("--submit-interval-ms", help="Gap between submits (0: all at "
                                                 "once).", rich_help_panel=WORKLOAD)]
SubmitSchedule = Annotated[str, typer.Option("--submit-schedule", help="absolute: request i is due at i*interval; "
                                             "relative: wait the interval after each submit returns.",
                                             rich_help_panel=WORKLOAD)]
RequestRate = Annotated[Optional[float], typer.Option("--request-rate", help="Poisson arrivals at this many "
                                                      "requests/s (seeded by --seed).", rich_help_panel=WORKLOAD)]
WarmupRuns = Annotated[int, typer.Option("--warmup-runs", help="Runs before measuring (not counted).",
                                         max=MAX_RUNS, rich_help_panel=WORKLOAD)]
RepeatRuns = Annotated[int, typer.Option("--repeat-runs", help="Measured runs; the summary is their median.",
                                         max=MAX_RUNS, rich_help_panel=WORKLOAD)]


def workload_spec(*, prompt: str, prompt_repeats: int, unique_prompts: bool, pretok: bool, num_requests: int,
                  max_new_tokens: int, input_len: Optional[int], output_len: Optional[int], range_ratio: float,
                  submit_interval_ms: float, submit_schedule: str, request_rate: Optional[float], seed: int):
    from rosecli.bench.workload import WorkloadSpec

    check_text("--prompt", prompt)
    return WorkloadSpec(prompt=prompt, prompt_repeats=prompt_repeats, unique_prompts=unique_prompts,
                        num_requests=num_requests, max_new_tokens=max_new_tokens, input_len=input_len,
                        output_len=output_len, range_ratio=range_ratio, submit_interval_ms=submit_interval_ms,
                        submit_schedule=submit_schedule,
                        request_rate=None if request_rate is None else float(request_rate), seed=seed,
                        pretok=pretok)


def check_runs(warmup_runs: int, repeat_runs: int) -> None:
    from rosecli.engine.errors import ConfigError

    if warmup_runs < 0:
        raise ConfigError(f"--warmup-runs must be >= 0, got {warmup_runs}")
    if repeat_runs < 1:
        raise ConfigError(f"--repeat-runs must be >= 1, got {repeat_runs}")


def from_params(builder, values: dict, **overrides):
    """Call ``builder`` (engine_config, sampling_params or workload_spec) with every argument it
    takes, read by name from a command's parameters (``locals()``), so each option is passed
    through in one place."""
    kwargs = {name: values[name] for name in inspect.signature(builder).parameters if name in values}
    kwargs.update(overrides)
    return builder(**kwargs)
