"""Benchmark figures from raw per-request timestamps.

All times are ``time.perf_counter()`` seconds here; the report shows milliseconds.

Percentiles (`percentile`) interpolate linearly between closest ranks: numpy's default
``linear`` method, the one vLLM's and SGLang's benchmarks use. For sorted values
v[0..n-1], pQ is read at rank h = (n-1)*Q/100: v[floor h] + (h - floor h) * (v[floor h + 1] -
v[floor h]). One sample: every percentile is that sample. No samples: NaN, and the report
shows the figure as absent.

Per request (`RequestTiming`; a stage that was not recorded leaves its figure out):

- submit lag = submit - scheduled submit (how late the submitter called add_request)
- add_request latency = add_request returned - submit
- tokenize = tokenized - submit (about 0 with ``--pretok``)
- queue wait = admitted - tokenized (admitted - submit when there is no tokenize stage)
- prefill->first token = first token received - admitted
- TTFT = first token received - submit
- TPOT = (finish - first token) / (output tokens - 1). Requests with one output token have no
  TPOT and are left out of it (as in vLLM); the report says how many were left out.
- ITL = every gap between consecutive chunks one client received, pooled over all requests
  of the run. With ``--stream-interval N`` a chunk carries up to N tokens and ITL is the gap
  per chunk (as vLLM's benchmark counts it; SGLang's divides a multi-token chunk's gap by its
  tokens). So ITL grows with N while TPOT does not; ``RunMetrics.mean_chunk_tokens`` says
  how many tokens a chunk carried on average.
- latency (end to end) = finish - submit, where finish = the last chunk received.

Per run (`summarize_run`):

- wall = wall_end - wall_start: from the first submit to the last finish (the drivers pass
  the first ``submit`` and the moment the last stream ended).
- throughput (completion) = output tokens of all requests / wall. This is the one number
  the reference posts print as ``Throughput (completion,total)``: completion tokens over the
  total wall time.
- throughput (prompt+completion) = (prompt + output tokens) / wall.
- submit wall = time from the run's start until the last add_request returned.

Over the measured runs of ``bench stream`` (`median_run`): the median of each run's figure.

``bench sched`` (`summarize_sched_run`, `summarize_sched_runs`), per run: decode time (the
time spent in decode steps), prefill time (in prefill steps), total time (wall from first
submit to last finish: prefill + decode + the host work between steps), throughput
(completion, decode) = output tokens / decode time, throughput (completion, total) = output
tokens / total time, and in online mode TTFT / TPOT / latency percentiles as above. Over
the measured runs: the p50 and the mean of each per-run figure, as the posts print them
(``TTFT p50/mean`` = median and mean over runs of each run's TTFT p50).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks (numpy
    ``method="linear"``, as vLLM). One value: that value. No values: NaN."""
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method="linear"))


@dataclass
class RequestTiming:
    """Timestamps of one request, ``time.perf_counter()`` seconds; None where the stage did
    not happen or was not recorded.

    ``token_times`` holds the time the client RECEIVED each chunk (the first included);
    ``chunk_tokens[i]`` is how many tokens chunk i carried (1 each without
    ``--stream-interval``; may be empty when unknown)."""

    request_id: int
    prompt_tokens: int
    output_tokens: int
    scheduled_submit: Optional[float]  # when the schedule said to submit
    submit: float  # when the caller called add_request
    add_request_done: Optional[float] = None  # add_request returned
    tokenized: Optional[float] = None  # prompt tokenized (None: no tokenize stage recorded)
    admitted: Optional[float] = None  # the scheduler admitted it (prefill started)
    first_token: Optional[float] = None  # first chunk received
    token_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finish: Optional[float] = None  # last chunk received
    finish_reason: Optional[str] = None


@dataclass
class Dist:
    """p50/p95/p99 and mean of one figure in seconds; ``count`` samples (0: all NaN)."""

    p50: float
    p95: float
    p99: float
    mean: float
    count: int

    @classmethod
    def of(cls, values: Sequence[Optional[float]]) -> "Dist":
        vals = [v for v in values if v is not None and not math.isnan(v)]
        return cls(*(percentile(vals, q) for q in PERCENTILES), float(np.mean(vals)) if vals else float("nan"),
                   len(vals))



STREAM_FIGURES = ("submit_lag", "add_request", "tokenize", "queue_wait", "prefill_first_token", "ttft", "tpot",
                  "itl", "latency")
FIGURE_LABELS = {
    "submit_lag": "Submit lag", "add_request": "add_request latency", "tokenize": "Tokenize",
    "queue_wait": "Queue wait", "prefill_first_token": "Prefill->first token", "ttft": "TTFT",
    "tpot": "TPOT", "itl": "ITL", "latency": "Latency",
}


@dataclass
class RunMetrics:
    """One `bench stream` run. Times in seconds, rates in tokens/s."""

    requests: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float  # first submit -> last finish
    submit_wall_s: float  # run start -> last add_request returned
    throughput_completion: float  # completion tokens / wall
    throughput_total: float  # (prompt + completion tokens) / wall
    dists: dict[str, Dist]  # STREAM_FIGURES -> Dist
    errors: int = 0  # requests refused or failed (not in any figure)
    chunks: int = 0  # chunks received, all requests
    mean_chunk_tokens: float = float("nan")  # tokens per received chunk

    @property
    def tpot_left_out(self) -> int:
        """Requests without a TPOT (one output token, or no finish)."""
        return self.requests - self.dists["tpot"].count


def _diff(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def summarize_run(timings: Sequence[RequestTiming], wall_start: Optional[float] = None,
                  wall_end: Optional[float] = None, submit_wall: Optional[float] = None,
                  errors: int = 0) -> RunMetrics:
    """Figures of one run. ``wall_start`` / ``wall_end`` default to the first ``submit`` and
    the last ``finish`` of ``timings``; ``submit_wall`` (run start -> last add_request
    returned) defaults to the last ``add_request_done`` minus ``wall_start``."""
    figures: dict[str, list[Optional[float]]] = {k: [] for k in STREAM_FIGURES}
    chunks = chunk_token_sum = chunks_with_counts = 0
    for t in timings:
        figures["submit_lag"].append(_diff(t.submit, t.scheduled_submit))
        figures["add_request"].append(_diff(t.add_request_done, t.submit))
        figures["tokenize"].append(_diff(t.tokenized, t.submit))
        figures["queue_wait"].append(_diff(t.admitted, t.tokenized if t.tokenized is not None else t.submit))
        figures["prefill_first_token"].append(_diff(t.first_token, t.admitted))
        figures["ttft"].append(_diff(t.first_token, t.submit))
        if t.output_tokens >= 2 and t.first_token is not None and t.finish is not None:
            figures["tpot"].append((t.finish - t.first_token) / (t.output_tokens - 1))
        times = t.token_times
        figures["itl"].extend(times[i + 1] - times[i] for i in range(len(times) - 1))
        figures["latency"].append(_diff(t.finish, t.submit))
        chunks += len(times)
        if t.chunk_tokens:
            chunk_token_sum += sum(t.chunk_tokens)
            chunks_with_counts += len(t.chunk_tokens)
    if wall_start is None:
        wall_start = min((t.submit for t in timings), default=0.0)
    if wall_end is None:
        wall_end = max((t.finish for t in timings if t.finish is not None), default=wall_start)
    if submit_wall is None:
        done = [t.add_request_done for t in timings if t.add_request_done is not None]
        submit_wall = max(done) - wall_start if done else float("nan")
    wall = wall_end - wall_start
    completion = sum(t.output_tokens for t in timings)
    prompt = sum(t.prompt_tokens for t in timings)
    rate = (lambda n: n / wall) if wall > 0 else (lambda n: float("nan"))
    mean_chunk = chunk_token_sum / chunks_with_counts if chunks_with_counts else float("nan")
    return RunMetrics(len(timings), prompt, completion, wall, submit_wall, rate(completion), rate(prompt + completion),
                      {k: Dist.of(v) for k, v in figures.items()}, errors, chunks, mean_chunk)


def flatten(r: RunMetrics) -> dict[str, float]:
    """One stream run's figures under flat keys (the names result files and compare use):
    throughput_completion, throughput_total (tokens/s), wall_s, submit_wall_s (s), and
    ``<figure>_p50|p95|p99|mean`` for each of STREAM_FIGURES (s)."""
    out = {"throughput_completion": r.throughput_completion, "throughput_total": r.throughput_total,
           "wall_s": r.wall_s, "submit_wall_s": r.submit_wall_s}
    for name, d in r.dists.items():
        for q in PERCENTILES:
            out[f"{name}_p{q}"] = getattr(d, f"p{q}")
        out[f"{name}_mean"] = d.mean
    return out


def median_run(runs: Sequence[RunMetrics]) -> dict[str, float]:
    """Summary over measured stream runs: the median of each flat figure (see `flatten`)."""
    return median_figures([flatten(r) for r in runs])


def median_figures(runs: Sequence[dict]) -> dict[str, float]:
    """The median of each figure over runs given as flat figure dicts (a result file's
    ``figures``); runs where a figure is absent (NaN or null) do not count for it."""
    vals: dict[str, list[float]] = {}
    for figures in runs:
        for k, v in figures.items():
            vals.setdefault(k, [])
            if isinstance(v, (int, float)) and not math.isnan(v):
                vals[k].append(v)
    return {k: percentile(v, 50) for k, v in vals.items()}


@dataclass
class SchedRunMetrics:
    """One `bench sched` run: times in s, rates in tokens/s; latency figures (online mode
    only, else None) in s."""

    mode: str
    decode_s: float  # time in decode steps
    total_s: float  # first submit -> last finish (prefill + decode + host work between steps)
    prefill_s: float  # time in prefill steps
    completion_tokens: int
    throughput_decode: float  # completion tokens / decode time: the posts' "(completion,decode)"
    throughput_total: float  # completion tokens / total time: the posts' "(completion,total)"
    ttft_p50: Optional[float] = None
    ttft_p99: Optional[float] = None
    tpot_p50: Optional[float] = None
    tpot_p99: Optional[float] = None
    latency_p50: Optional[float] = None
    latency_p99: Optional[float] = None


SCHED_FIGURES = ("decode_s", "total_s", "prefill_s", "throughput_decode", "throughput_total", "ttft_p50", "ttft_p99",
                 "tpot_p50", "tpot_p99", "latency_p50", "latency_p99")


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("nan")


def sched_metrics(mode: str, prefill_s: float, decode_s: float, total_s: float, completion_tokens: int,
                  timings: Sequence[RequestTiming] = ()) -> SchedRunMetrics:
    """One sched run's figures from its step times and (online) per-request timestamps."""
    m = SchedRunMetrics(mode, decode_s, total_s, prefill_s, completion_tokens, _rate(completion_tokens, decode_s),
                        _rate(completion_tokens, total_s))
    if mode == "online" and timings:
        s = summarize_run(timings)
        for name in ("ttft", "tpot", "latency"):
            d = s.dists[name]
            if d.count:
                setattr(m, f"{name}_p50", d.p50)
                setattr(m, f"{name}_p99", d.p99)
    return m


def summarize_sched_run(run) -> SchedRunMetrics:
    """``run``: a `drivers.SchedRun` (mode, prefill_s, decode_s, total_s, completion_tokens, timings)."""
    return sched_metrics(run.mode, run.prefill_s, run.decode_s, run.total_s, run.completion_tokens, run.timings)


def sched_figures(m: SchedRunMetrics) -> dict[str, float]:
    """One sched run's figures under flat keys (SCHED_FIGURES), absent ones left out."""
    return {k: getattr(m, k) for k in SCHED_FIGURES if getattr(m, k) is not None}


def summarize_sched_runs(runs: Sequence[SchedRunMetrics]) -> dict[str, tuple[float, float]]:
    """For each figure of SCHED_FIGURES: (p50, mean) over the measured runs; figures absent
    in every run (latency figures offline) are left out."""
    out = {}
    for name in SCHED_FIGURES:
        vals = [getattr(r, name) for r in runs if getattr(r, name) is not None]
        if vals:
            out[name] = (percentile(vals, 50), float(np.mean(vals)))
    return out
