"""Benchmark figures from raw per-request timestamps.

All times are ``time.perf_counter()`` seconds internally; reports show milliseconds.

Percentiles use linear interpolation between closest ranks (numpy's default ``linear`` method,
as vLLM's benchmark does): for sorted values v[0..n-1], pXX is taken at rank (n-1)*XX/100.
With one sample every percentile is that sample; with none the figure is absent (NaN).

Per request (see `RequestTiming`):
- submit lag = submit - scheduled submit (how late the submitter was)
- add_request latency = add_request returned - submit
- tokenize = tokenized - submit (0 with --pretok)
- queue wait = admitted - tokenized (or - submit): waiting for the scheduler to take it
- prefill->first token = first token - admitted
- TTFT = first token received - submit
- TPOT = (finish - first token) / (output tokens - 1); requests with one output token have no
  TPOT and are left out of it
- ITL = every gap between consecutive pieces of text the client received, pooled over all
  requests. With --stream-interval N a piece carries up to N tokens, so ITL is per piece.
- latency (end to end) = finish - submit
Per run: wall = last finish - first submit; throughput (completion) = output tokens / wall;
throughput (total) = (prompt + output tokens) / wall.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np

PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks; NaN for no values."""
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method="linear"))


@dataclass
class RequestTiming:
    request_id: int
    prompt_tokens: int
    output_tokens: int
    scheduled_submit: Optional[float]
    submit: float
    add_request_done: Optional[float]
    tokenized: Optional[float]
    admitted: Optional[float]
    first_token: Optional[float]
    token_times: list[float] = field(default_factory=list)  # receive time of each piece
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each piece (when known)
    finish: Optional[float] = None
    finish_reason: Optional[str] = None


@dataclass
class Dist:
    """p50/p95/p99 and mean of one figure, in seconds (count = samples)."""

    p50: float
    p95: float
    p99: float
    mean: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Dist":
        vals = [v for v in values if v is not None and not math.isnan(v)]
        return cls(*(percentile(vals, q) for q in PERCENTILES),
                   float(np.mean(vals)) if vals else float("nan"), len(vals))


STREAM_FIGURES = ("submit_lag", "add_request", "tokenize", "queue_wait", "prefill_first_token", "ttft", "tpot",
                  "itl", "latency")
FIGURE_LABELS = {
    "submit_lag": "Submit lag", "add_request": "add_request latency", "tokenize": "Tokenize",
    "queue_wait": "Queue wait", "prefill_first_token": "Prefill->first token", "ttft": "TTFT",
    "tpot": "TPOT", "itl": "ITL", "latency": "Latency",
}


@dataclass
class RunMetrics:
    requests: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    submit_wall_s: float
    throughput_completion: float
    throughput_total: float
    dists: dict[str, Dist]
    errors: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dists"] = {k: asdict(v) for k, v in self.dists.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RunMetrics":
        d = dict(d)
        d["dists"] = {k: Dist(**v) for k, v in d["dists"].items()}
        return cls(**d)


def _diff(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def summarize_run(timings: Sequence[RequestTiming], wall_start: float, wall_end: float, submit_wall: float,
                  errors: int = 0) -> RunMetrics:
    figures: dict[str, list[float]] = {k: [] for k in STREAM_FIGURES}
    for t in timings:
        figures["submit_lag"].append(_diff(t.submit, t.scheduled_submit))
        figures["add_request"].append(_diff(t.add_request_done, t.submit))
        tokenized = t.tokenized if t.tokenized is not None else t.submit
        figures["tokenize"].append(tokenized - t.submit)
        figures["queue_wait"].append(_diff(t.admitted, tokenized))
        figures["prefill_first_token"].append(_diff(t.first_token, t.admitted))
        figures["ttft"].append(_diff(t.first_token, t.submit))
        if t.output_tokens >= 2 and t.first_token is not None and t.finish is not None:
            figures["tpot"].append((t.finish - t.first_token) / (t.output_tokens - 1))
        figures["itl"].extend(b - a for a, b in zip(t.token_times, t.token_times[1:]))
        figures["latency"].append(_diff(t.finish, t.submit))
    wall = max(wall_end - wall_start, 1e-12)
    completion = sum(t.output_tokens for t in timings)
    prompt = sum(t.prompt_tokens for t in timings)
    return RunMetrics(len(timings), prompt, completion, wall, submit_wall, completion / wall,
                      (prompt + completion) / wall, {k: Dist.of(v) for k, v in figures.items()}, errors)


@dataclass
class SchedRunMetrics:
    """`bench sched`: one run's times (s) and rates (tokens/s); latency figures online only."""

    mode: str
    decode_s: float
    total_s: float
    prefill_s: float
    completion_tokens: int
    throughput_decode: float  # completion tokens / decode time (the posts' "(completion,decode)")
    throughput_total: float  # completion tokens / total time
    ttft_p50: Optional[float] = None
    tpot_p50: Optional[float] = None
    latency_p50: Optional[float] = None


def summarize_sched_run(run) -> SchedRunMetrics:
    """``run`` is a `drivers.SchedRun`."""
    m = SchedRunMetrics(run.mode, run.decode_s, run.total_s, run.prefill_s, run.completion_tokens,
                        run.completion_tokens / max(run.decode_s, 1e-12), run.completion_tokens / max(run.total_s, 1e-12))
    if run.mode == "online" and run.timings:
        s = summarize_run(run.timings, 0.0, run.total_s, 0.0)
        m.ttft_p50, m.tpot_p50, m.latency_p50 = s.dists["ttft"].p50, s.dists["tpot"].p50, s.dists["latency"].p50
    return m


SCHED_FIGURES = ("decode_s", "total_s", "throughput_decode", "throughput_total", "ttft_p50", "tpot_p50",
                 "latency_p50")


def summarize_sched_runs(runs: Sequence[SchedRunMetrics]) -> dict[str, tuple[float, float]]:
    """For each figure: (p50, mean) over the measured runs (figures absent offline are left out)."""
    out = {}
    for name in SCHED_FIGURES:
        vals = [getattr(r, name) for r in runs if getattr(r, name) is not None]
        if vals:
            out[name] = (percentile(vals, 50), float(np.mean(vals)))
    return out


def median_run(runs: Sequence[RunMetrics]) -> dict[str, float]:
    """Summary over measured runs: the median of each run's figure (flat keys like ``ttft_p99``)."""
    flat: dict[str, list[float]] = {}
    for r in runs:
        for k, v in flatten(r).items():
            flat.setdefault(k, []).append(v)
    return {k: percentile(v, 50) for k, v in flat.items()}


def flatten(r: RunMetrics) -> dict[str, float]:
    """One run's figures as flat keys: throughput_completion, ttft_p50, ... (times in seconds)."""
    out = {"throughput_completion": r.throughput_completion, "throughput_total": r.throughput_total,
           "wall_s": r.wall_s, "submit_wall_s": r.submit_wall_s}
    for name, d in r.dists.items():
        for q in PERCENTILES:
            out[f"{name}_p{q}"] = getattr(d, f"p{q}")
    return out
