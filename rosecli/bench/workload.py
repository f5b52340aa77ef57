"""Benchmark workloads: which prompts, how many new tokens, and when each request is submitted.

Arrival schedules:
- ``--submit-interval-ms X --submit-schedule absolute``: request i is due at ``start + i*X``;
  a late submit does not delay the ones after it (submit lag measures how late each was).
- ``--submit-schedule relative``: wait X after each submit returns (lateness accumulates).
- ``--request-rate R``: Poisson arrivals, exponential gaps of mean 1/R seconds from ``--seed``,
  on an absolute schedule (as vLLM's benchmark does). ``inf`` or 0 interval: all at once.

Prompts: ``--prompt`` (repeated ``--prompt-repeats`` times), made distinct per request with
``--unique-prompts`` (a numeric prefix, so prefix caching cannot share them), or
``--input-len N``: random token ids, N tokens each (uniform in N*(1 +- --range-ratio)), which
are always pre-tokenized. ``--output-len M`` sets each request's new tokens likewise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from rosecli.engine.errors import ConfigError

SCHEDULES = ("absolute", "relative")


@dataclass
class WorkloadSpec:
    prompt: str = "Hello"
    prompt_repeats: int = 1
    unique_prompts: bool = False
    num_requests: int = 16
    max_new_tokens: int = 128
    input_len: Optional[int] = None
    output_len: Optional[int] = None
    range_ratio: float = 0.0
    submit_interval_ms: float = 0.0
    submit_schedule: str = "absolute"
    request_rate: Optional[float] = None
    seed: int = 0
    pretok: bool = False

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ConfigError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.prompt_repeats < 1:
            raise ConfigError(f"--prompt-repeats must be >= 1, got {self.prompt_repeats}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.submit_schedule not in SCHEDULES:
            raise ConfigError(f"--submit-schedule must be one of {', '.join(SCHEDULES)}, "
                              f"got {self.submit_schedule!r}")
        if not 0 <= self.submit_interval_ms < math.inf:
            raise ConfigError(f"--submit-interval-ms must be a finite number >= 0, got {self.submit_interval_ms}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ConfigError(f"--request-rate must be > 0 requests/s (inf for all at once), got {self.request_rate}")
        if self.request_rate is not None and self.submit_interval_ms > 0:
            raise ConfigError("--request-rate and --submit-interval-ms both set the arrival times: give one")
        for name, v in (("--input-len", self.input_len), ("--output-len", self.output_len)):
            if v is not None and v < 1:
                raise ConfigError(f"{name} must be >= 1, got {v}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ConfigError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if not self.prompt and self.input_len is None:
            raise ConfigError("--prompt must not be empty (or give --input-len)")


@dataclass
class Workload:
    prompts: list[Union[str, list[int]]]  # text, or token ids when pre-tokenized
    max_new_tokens: list[int]
    offsets_s: list[float]  # intended submit time of each request after the run's start
    relative: bool  # True: offsets are waits after the previous submit returned


def _lengths(mean: int, ratio: float, n: int, rng) -> list[int]:
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)] if hi > lo else [mean] * n


def build_workload(spec: WorkloadSpec, tokenizer, vocab_size: int, max_model_len: Optional[int] = None) -> Workload:
    """``max_model_len``: the model's context; an --input-len that cannot fit is refused before any
    prompt is made (a prompt of that many ids would only be refused by the engine, and a huge one
    would not fit in memory)."""
    if max_model_len is not None and spec.input_len is not None and spec.input_len >= max_model_len:
        raise ConfigError(f"--input-len {spec.input_len} does not fit the model's context of {max_model_len} "
                          f"tokens (one must be left to generate): pass at most {max_model_len - 1}")
    import numpy as np  # here, not at import: the CLI reads WorkloadSpec's defaults as it parses

    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    if spec.input_len is not None:
        # Random ids from the tokenizer's ordinary range (skip the first few special tokens).
        hi = min(vocab_size, len(tokenizer)) if tokenizer is not None else vocab_size
        prompts: list = [rng.integers(16, hi, size=length).tolist()
                         for length in _lengths(spec.input_len, spec.range_ratio, n, rng)]
    else:
        base = " ".join([spec.prompt] * spec.prompt_repeats)
        prompts = [f"{i} {base}" if spec.unique_prompts else base for i in range(n)]
        if spec.pretok:
            prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    if spec.output_len is not None:
        new_tokens = _lengths(spec.output_len, spec.range_ratio, n, rng)
    else:
        new_tokens = [spec.max_new_tokens] * n
    if spec.request_rate is not None and math.isfinite(spec.request_rate):
        gaps = rng.exponential(1.0 / spec.request_rate, size=n)
        gaps[0] = 0.0
        offsets = np.cumsum(gaps).tolist()
        relative = False
    else:
        interval = spec.submit_interval_ms / 1e3 if spec.request_rate is None else 0.0
        relative = spec.submit_schedule == "relative"
        offsets = [interval] * n if relative else [i * interval for i in range(n)]
        if relative:
            offsets[0] = 0.0
    return Workload(prompts, new_tokens, offsets, relative)
