"""Engine and sampling configuration: validated once, at construction.

Every `rose` subcommand builds one `EngineConfig` from the same options
(`rosecli/commands/options.py`); nothing deeper reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from rosecli.engine.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "dummy")
CPU_WEIGHTS = ("auto", "blocks", "int4", "float16", "int8", "float")  # rosecli/engine/models/quant.py

DEFAULT_MODEL = "smollm2-135m"


def cache_root(config: "EngineConfig"):
    """Where converted models are cached: ``--cache-dir``, else ``$XDG_CACHE_HOME/rosecli``, else
    ``~/.cache/rosecli`` (here, not in the loader, so the CLI checks it without importing torch)."""
    from pathlib import Path

    if config.cache_dir:
        return Path(config.cache_dir).expanduser()
    # The platform's convention for the default location, read here like $HOME is.
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "rosecli"


def default_threads() -> int:
    """The CPUs this process may run on (its affinity set: taskset and container limits count), less
    those other programs keep busy right now (runnable tasks in /proc/loadavg), at least one.

    Why not simply all of them: torch's threads meet at a barrier after every operation, hundreds of
    times a token, so one thread that loses its core to another program stalls all of them. Measured
    on 2 cores with other work running: 163 ms a token with 2 threads, 17 ms with 1.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus - _busy_cpus())


def _busy_cpus() -> int:
    """Tasks other than this one that are running or waiting for a CPU at this moment (Linux; else 0)."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, running - 1)  # the reading thread counts itself


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _check_int(name: str, value: int, lo: int, hi: Optional[int] = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo
    if hi is not None:
        ok = ok and value <= hi
    rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
    _check(ok, f"{name} must be an integer {rng}, got {value!r}")


@dataclass
class EngineConfig:
    """Everything that decides how the engine runs. Option names match the CLI flags."""

    model: str = DEFAULT_MODEL
    load_format: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    # On CPU only: what the linear layers read per token (rosecli/engine/models/quant.py). "auto":
    # 4-bit groups where the weights are exactly 4-bit (a Q4 GGUF), float16 elsewhere; "float": the
    # weights as loaded (the reference)
    cpu_weights: str = "auto"
    # torch's intra-op threads for the model's math on CPU (None: `default_threads()`)
    threads: Optional[int] = None
    seed: int = 0
    max_model_len: Optional[int] = None
    # --load-format dummy only: build this many layers instead of the shape's (CI runs real widths shallow)
    dummy_layers: Optional[int] = None
    # KV cache
    block_size: int = 16
    num_gpu_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_cache: bool = True
    # Scheduling
    max_batch_size: int = 64
    prefill_max_batch_size: int = 64
    prefill_max_tokens: int = 2048
    max_active_requests: Optional[int] = None
    # Execution paths (None = on when the device is CUDA; `resolved()` decides them once)
    paged_attn: Optional[bool] = None
    cuda_graph: Optional[bool] = None
    overlap_schedule: Optional[bool] = None  # launch decode step N+1 before reading step N's tokens
    nvtx: bool = False
    # Streaming manager
    stream_interval: int = 1
    tokenize_workers: int = 0
    max_inflight_requests: Optional[int] = None
    # Tensor parallelism: ranks, one process each (rosecli/engine/distributed.py)
    tensor_parallel_size: int = 1
    # Where converted models are cached (None = ~/.cache/rosecli)
    cache_dir: Optional[str] = None
    show_progress: bool = True

    def __post_init__(self) -> None:
        _check(bool(self.model), "--model must name a model")
        _check(self.load_format in LOAD_FORMATS,
               f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        _check(self.device in DEVICES,
               f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        _check(self.dtype in DTYPES,
               f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check(self.cpu_weights in CPU_WEIGHTS,
               f"--cpu-weights must be one of {', '.join(CPU_WEIGHTS)}, got {self.cpu_weights!r}")
        if self.threads is not None:
            _check_int("--threads", self.threads, 1, 1024)
        _check_int("--seed", self.seed, 0)
        if self.max_model_len is not None:
            _check_int("--max-model-len", self.max_model_len, 1)
        if self.dummy_layers is not None:
            _check_int("--dummy-layers", self.dummy_layers, 1, 1024)
            _check(self.load_format == "dummy", "--dummy-layers applies to --load-format dummy only")
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
               f"--block-size must be a power of two from 1 to 128, got {self.block_size!r}")
        if self.num_gpu_blocks is not None:
            _check_int("--num-gpu-blocks", self.num_gpu_blocks, 1)
        _check(isinstance(self.gpu_memory_utilization, (int, float))
               and 0.0 < self.gpu_memory_utilization <= 1.0,
               f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check_int("--max-batch-size", self.max_batch_size, 1, 1024)
        _check_int("--prefill-max-batch-size", self.prefill_max_batch_size, 1, 1024)
        _check_int("--prefill-max-tokens", self.prefill_max_tokens, 1)
        if self.max_active_requests is not None:
            _check_int("--max-active-requests", self.max_active_requests, 1)
        _check_int("--stream-interval", self.stream_interval, 1)
        _check_int("--tokenize-workers", self.tokenize_workers, 0, 64)
        if self.max_inflight_requests is not None:
            _check_int("--max-inflight-requests", self.max_inflight_requests, 1)
        _check_int("--tensor-parallel-size", self.tensor_parallel_size, 1, 64)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def resolved(self, device: str) -> "EngineConfig":
        """This config for ``device`` ("cpu" or "cuda", as resolved from --device): the "auto"
        execution paths (None) become plain booleans, on for CUDA. The runner and the scheduler
        read only a resolved config. A path that cannot run on ``device`` is refused, naming its
        flag, never silently dropped."""
        cuda = device == "cuda"
        if not cuda:
            for flag, value, what in (("--paged-attn", self.paged_attn, "its Triton kernels run on CUDA; the CPU "
                                       "uses gather + SDPA"),
                                      ("--cuda-graph", self.cuda_graph, "CUDA graphs replay on a CUDA GPU")):
                _check(not value, f"{flag} needs a CUDA GPU ({what}; the engine runs on {device}): leave out {flag} "
                                  "or run with --device cuda on a machine with a CUDA GPU")

        def on(value: Optional[bool]) -> bool:
            return cuda if value is None else bool(value)

        return dataclasses.replace(self, device=device, paged_attn=on(self.paged_attn),
                                   cuda_graph=on(self.cuda_graph), overlap_schedule=on(self.overlap_schedule))

    def ignored_on(self, device: str) -> list[str]:
        """One line for each option given that has no effect on ``device`` (the caller shows them)."""
        notes = []
        if device != "cpu":
            if self.cpu_weights != "auto":
                notes.append(f"--cpu-weights {self.cpu_weights} applies on CPU only; on {device} the linear layers "
                             "read the weights as loaded")
            if self.threads is not None:
                notes.append(f"--threads {self.threads} applies on CPU only; on {device} the model's math runs on "
                             "the GPU")
        return notes


# What one request may ask for: the engine's tensors hold top_k, token ids and lengths as int32, a
# per-request seed as torch.Generator's uint64. Anything outside fails at construction with a
# ConfigError naming the field, never later on the engine's worker thread.
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**64 - 1
# OpenAI allows 0..2; a larger temperature is allowed (as vLLM does) up to a bound where the
# distribution is already flat. Below GREEDY_TEMPERATURE dividing logits overflows float32, so
# such a temperature means greedy (as vLLM's sampling epsilon).
MAX_TEMPERATURE = 100.0
GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters; each token looks for every stop string near the text's end
MAX_STOP_TOKEN_IDS = 1024
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty: OpenAI's -2..2
# repetition_penalty divides positive logits (multiplies negative ones): 1 is off. A tiny one would
# blow a logit past float32, so it has a floor; past 100 every seen token is as good as banned.
MIN_REPETITION_PENALTY = 1e-6
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0  # each bias within -100..100, as OpenAI's
MAX_LOGPROBS = 20  # top logprobs a position may ask for (OpenAI's top_logprobs bound)
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on logit_bias entries (also the sampler's)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request samples and stops.

    temperature == 0 means greedy decoding (so does one below 1e-5); top_k == 0, top_p == 1,
    min_p == 0, penalties 0 (presence, frequency) or 1 (repetition) disable those. Ranges:
    max_new_tokens 1..2**31-1, temperature 0..100, top_k 0..2**31-1, top_p (0, 1], min_p [0, 1],
    presence_penalty and frequency_penalty -2..2, repetition_penalty 1e-6..100, min_tokens
    0..max_new_tokens, logit_bias at most 300 entries {token id: bias in -100..100}, seed
    0..2**64-1, at most 16 stop strings of 1..256 characters, at most 1024 stop token ids in
    0..2**31-1, allowed_token_ids (vLLM's) at least one id in 0..2**31-1. Token ids of logit_bias and
    allowed_token_ids are checked against the vocabulary by the input processor.
    ``logprobs`` / ``prompt_logprobs`` (None: off; 0..20: the chosen token's logprob and that many
    most likely tokens, for each output / prompt position; `rosecli.engine.logprobs` says which).

    Semantics are vLLM's: penalties apply to greedy rows too; presence and frequency penalties
    count output tokens, repetition_penalty prompt and output tokens; until ``min_tokens`` tokens
    were generated, EOS and ``stop_token_ids`` cannot be sampled and stop strings do not end the
    request; ``logit_bias`` is added to the logits before the penalties; with ``allowed_token_ids`` every other
    token is at -inf before anything else (greedy and sampled rows; logprobs are the model's own); a stop string
    that ends the output is left out of its text unless ``include_stop_str_in_output``; special tokens (end of
    turn, tool-call markers) are left out of the text unless ``skip_special_tokens`` is False.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_on_eos: bool = True
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: Optional[list[int]] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    # structured output: a rosecli.engine.structured.GrammarSpec the output must match (None: free)
    structured: Optional[object] = None

    @property
    def greedy(self) -> bool:
        """The argmax picks the token: temperature 0 (or below 1e-5), or top_k 1."""
        return self.temperature == 0.0 or self.top_k == 1

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, 1, MAX_INT32)
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,  # NaN fails too
               f"temperature must be >= 0 and <= {MAX_TEMPERATURE:g}, got {self.temperature!r}")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        _check_int("top_k", self.top_k, 0, MAX_INT32)
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        _check(isinstance(self.stop_on_eos, bool), f"stop_on_eos must be true or false, got {self.stop_on_eos!r}")
        for flag in ("include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, flag), bool), f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.stop, (list, tuple)), f"stop must be a list of strings, got {self.stop!r}")
        self.stop = list(self.stop)
        _check(len(self.stop) <= MAX_STOP_STRINGS,
               f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        longest = max(map(len, self.stop), default=0)
        _check(longest <= MAX_STOP_LENGTH,
               f"stop strings must have at most {MAX_STOP_LENGTH} characters, got one of {longest}")
        _check(isinstance(self.stop_token_ids, (list, tuple)),
               f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
               f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, MAX_INT32)
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                   f"{name} must be between {-MAX_PENALTY:g} and {MAX_PENALTY:g} (0: off), got {value!r}")
        _check(_is_number(self.repetition_penalty)
               and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
               f"repetition_penalty must be between {MIN_REPETITION_PENALTY:g} and {MAX_REPETITION_PENALTY:g} "
               f"(1: off), got {self.repetition_penalty!r}")
        _check_int("min_tokens", self.min_tokens, 0)
        _check(self.min_tokens <= self.max_new_tokens,
               f"min_tokens must be at most max_new_tokens ({self.max_new_tokens}), got {self.min_tokens}")
        _check(isinstance(self.logit_bias, dict),
               f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES,
               f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
        for t, bias in self.logit_bias.items():
            _check_int("logit_bias token id", t, 0, MAX_INT32)
            _check(_is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                   f"logit_bias of token {t} must be between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, "
                   f"got {bias!r}")
        self.logit_bias = {t: float(bias) for t, bias in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            _check(isinstance(self.allowed_token_ids, (list, tuple)) and len(self.allowed_token_ids) > 0,
                   f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, 0, MAX_INT32)
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        if self.structured is not None:
            from rosecli.engine.structured import GrammarSpec

            _check(isinstance(self.structured, GrammarSpec),
                   f"structured must be a GrammarSpec, got {type(self.structured).__name__}")
            # the output ends where the grammar does, on EOS: nothing may hold EOS back or ignore it
            _check(self.stop_on_eos, "stop_on_eos cannot be off with structured output (ignore_eos, --no-stop-on-eos): "
                                     "the output ends with EOS where the grammar ends")
            _check(self.min_tokens == 0, "min_tokens cannot be used with structured output (it would hold back the "
                                         "EOS that ends a complete output)")

