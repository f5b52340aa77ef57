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
    goodput_requests: float = float("nan")  # requests meeting every --goodput SLO / wall (req/s)
    goodput_share: float = float("nan")  # requests meeting every SLO / requests (failed ones included)
    roofline: Optional[object] = None  # bench.roofline.DecodeRoofline of the run (a GPU engine), else None
    gc: Optional[object] = None  # engine.gc_pauses.GcInterval: this process's collections during the run

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


def attached_figures(m) -> dict[str, float]:
    """A run's figures measured beside its requests: the distance to the floor (`bench.roofline.FIGURES`, a GPU
    engine) and the garbage collector's pauses (`gc_pauses.GcInterval.figures`), those that were measured."""
    out = {}
    for part in (m.roofline, m.gc):
        if part is not None:
            out.update(part.figures())
    return out


def flatten(r: RunMetrics) -> dict[str, float]:
    """One stream run's figures under flat keys (the names result files and compare use):
    throughput_completion, throughput_total (tokens/s), wall_s, submit_wall_s (s), and
    ``<figure>_p50|p95|p99|mean`` for each of STREAM_FIGURES (s)."""
    out = {"throughput_completion": r.throughput_completion, "throughput_total": r.throughput_total,
           "wall_s": r.wall_s, "submit_wall_s": r.submit_wall_s}
    if not math.isnan(r.goodput_requests):
        out.update(throughput_goodput=r.goodput_requests, goodput_share=r.goodput_share)
    out.update(attached_figures(r))
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
    roofline: Optional[object] = None  # bench.roofline.DecodeRoofline of the run (a GPU engine), else None
    gc: Optional[object] = None  # engine.gc_pauses.GcInterval: this process's collections during the run


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
    """One sched run's figures under flat keys (SCHED_FIGURES), absent ones left out, then the
    roofline's (bench.roofline.FIGURES) and the collector's when measured (`attached_figures`)."""
    out = {k: getattr(m, k) for k in SCHED_FIGURES if getattr(m, k) is not None}
    out.update(attached_figures(m))
    return out


def summarize_sched_runs(runs: Sequence[SchedRunMetrics]) -> dict[str, tuple[float, float]]:
    """For each figure of SCHED_FIGURES: (p50, mean) over the measured runs; figures absent
    in every run (latency figures offline) are left out."""
    out = {}
    for name in SCHED_FIGURES:
        vals = [getattr(r, name) for r in runs if getattr(r, name) is not None]
        if vals:
            out[name] = (percentile(vals, 50), float(np.mean(vals)))
    attached = [attached_figures(r) for r in runs]
    for name in dict.fromkeys(k for f in attached for k in f):
        vals = [f[name] for f in attached if name in f and not math.isnan(f[name])]
        if vals:
            out[name] = (percentile(vals, 50), float(np.mean(vals)))
    return out


# --- goodput (`--goodput`, as vLLM's benchmark defines it) ---------------------------------------

GOODPUT_NAMES = ("ttft", "tpot", "e2el")


def parse_goodput(items: Optional[Sequence[str]], flag: str = "--goodput") -> dict[str, float]:
    """``["ttft:500 tpot:50", "e2el:2000"]`` -> {"ttft": 0.5, "tpot": 0.05, "e2el": 2.0} (seconds).
    Pairs may be given in one value (space or comma separated) or one per --goodput."""
    from rosecli.engine.errors import ConfigError

    out: dict[str, float] = {}
    for item in items or ():
        for pair in item.replace(",", " ").split():
            name, sep, value = pair.partition(":")
            name = name.strip().lower()
            if not sep or name not in GOODPUT_NAMES:
                raise ConfigError(f"{flag} takes NAME:MILLISECONDS pairs with NAME one of "
                                  f"{', '.join(GOODPUT_NAMES)} (e.g. {flag} 'ttft:500 tpot:50'), got {pair!r}")
            try:
                ms = float(value)
            except ValueError:
                ms = float("nan")
            if not 0 <= ms < math.inf:
                raise ConfigError(f"{flag} {name}: the SLO must be a number of milliseconds >= 0, got {value!r}")
            out[name] = ms / 1e3
    return out


def meets_slo(slo: dict[str, float], ttft: float, tpot: float, e2el: float) -> bool:
    """vLLM's rule: a request is good when each given SLO >= its figure; a one-token request's
    TPOT counts as 0 (pass ``tpot=0.0`` for it)."""
    got = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    return all(limit >= got[name] for name, limit in slo.items())


def stream_goodput(timings: Sequence[RequestTiming], slo: dict[str, float], wall_s: float,
                   failed: int = 0) -> tuple[float, float]:
    """(good requests / wall, good requests / all requests) of a `bench stream` run."""
    good = 0
    for t in timings:
        if t.first_token is None or t.finish is None:
            continue
        tpot = (t.finish - t.first_token) / (t.output_tokens - 1) if t.output_tokens > 1 else 0.0
        good += meets_slo(slo, t.first_token - t.submit, tpot, t.finish - t.submit)
    total = len(timings) + failed
    return (good / wall_s if wall_s > 0 else float("nan")), (good / total if total else float("nan"))


# --- `bench serve`: per-request figures of an HTTP/SSE client ------------------------------------
#
# The definitions are vllm/benchmarks/serve.py's (`vllm bench serve`), so the numbers can be laid
# side by side:
#
# - start = just before the request is sent, after any --max-concurrency wait (that wait is
#   "client queue" = start - dispatched, reported on its own).
# - TTFT = first SSE event carrying a choice (even with empty text, e.g. a chat role chunk)
#   - start.
# - E2EL = last SSE event carrying a choice - start (the trailing usage event and [DONE] do not
#   count).
# - TPOT = (E2EL - TTFT) / (output tokens - 1), output tokens from the server's ``usage``;
#   requests with one output token are left out (and count as TPOT 0 for goodput).
# - ITL = every gap between consecutive choice events, pooled over the run.
# - duration = run start (before the first request is due) -> the last request ended;
#   request throughput = completed / duration; output throughput = output tokens / duration;
#   total token throughput = (prompt + output tokens) / duration; goodput = requests meeting
#   every SLO / duration.
# - peak output tok/s: choice events (one per token on servers that stream each token) in
#   1 s buckets from the first start; the fullest bucket. Peak concurrency: the most requests
#   between start and end at one time.
# - dispatch lag = dispatched - scheduled (how late the client got to a request: the client's
#   own bottleneck, as bench stream's submit lag).

DEFAULT_METRIC_PERCENTILES = (50.0, 95.0, 99.0)
SERVE_FIGURES = ("ttft", "tpot", "itl", "latency", "client_queue", "dispatch_lag")
SERVE_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "latency": "E2EL", "client_queue": "Client queue",
                "dispatch_lag": "Dispatch lag"}


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,95,99"`` -> (50.0, 90.0, 95.0, 99.0); each in (0, 100]."""
    from rosecli.engine.errors import ConfigError

    out = []
    for part in text.split(","):
        try:
            q = float(part)
        except ValueError:
            q = float("nan")
        if not 0 < q <= 100:
            raise ConfigError(f"--metric-percentiles takes comma-separated numbers in (0, 100], e.g. 50,90,99; "
                              f"got {part.strip()!r}")
        if q not in out:
            out.append(q)
    return tuple(out)


def pct_key(q: float) -> str:
    """50 -> "p50", 99.9 -> "p99.9" (vLLM's naming)."""
    return f"p{int(q)}" if float(q).is_integer() else f"p{q:g}"


@dataclass
class HttpTiming:
    """One HTTP request of `bench serve`, ``time.perf_counter()`` seconds."""

    index: int
    prompt_tokens: int  # the server's usage.prompt_tokens, else the client's count
    output_tokens: int  # the server's usage.completion_tokens (else choice events with text)
    asked_tokens: int  # max_tokens sent
    scheduled: float  # when the arrival schedule said to send it
    dispatched: float  # when the client got to it (before any --max-concurrency wait)
    start: Optional[float] = None  # just before the request was sent
    event_times: list[float] = field(default_factory=list)  # each SSE event carrying a choice
    success: bool = False
    error_kind: Optional[str] = None
    error: Optional[str] = None
    usage_reported: bool = False

    @property
    def ttft(self) -> Optional[float]:
        return self.event_times[0] - self.start if self.event_times and self.start is not None else None

    @property
    def e2el(self) -> Optional[float]:
        return self.event_times[-1] - self.start if self.event_times and self.start is not None else None

    @property
    def tpot(self) -> Optional[float]:
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


@dataclass
class PDist:
    """mean, std (population, as numpy/vLLM) and the chosen percentiles of one figure, seconds."""

    mean: float
    std: float
    count: int
    pcts: dict[str, float]

    @classmethod
    def of(cls, values: Sequence[float], percentiles: Sequence[float]) -> "PDist":
        vals = [v for v in values if v is not None and not math.isnan(v)]
        arr = np.asarray(vals, dtype=np.float64)
        nan = float("nan")
        return cls(float(arr.mean()) if vals else nan, float(arr.std()) if vals else nan, len(vals),
                   {pct_key(q): percentile(vals, q) for q in percentiles})


@dataclass
class ServeRunMetrics:
    """One `bench serve` run. Times in s, rates per s."""

    requests: int
    completed: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float  # duration: run start -> last request ended
    throughput_requests: float
    throughput_completion: float  # output tokens / duration
    throughput_total: float  # (prompt + output tokens) / duration
    peak_output: float  # output tok/s in the fullest 1 s bucket
    peak_concurrency: int
    dists: dict[str, PDist]  # SERVE_FIGURES -> PDist
    percentiles: tuple[float, ...] = DEFAULT_METRIC_PERCENTILES
    goodput_requests: float = float("nan")  # good requests / duration (NaN without --goodput)
    goodput_share: float = float("nan")  # good requests / requests
    target_rate: float = float("inf")  # --request-rate
    achieved_rate: float = float("nan")  # requests / (last dispatch - run start)
    short_outputs: int = 0  # completed with fewer output tokens than asked while ignore_eos was sent
    usage_missing: int = 0  # completed without a usage event (output tokens estimated)
    client_cpu: float = float("nan")  # the client process's CPU time / duration (1.0 = one core busy throughout);
    # several client processes: the busiest one's
    client_cpu_total: float = float("nan")  # several client processes: all their CPU time / duration
    failure_kinds: dict[str, int] = field(default_factory=dict)
    roofline: Optional[object] = None  # bench.roofline.DecodeRoofline read from a rose server, else None

    @property
    def tpot_left_out(self) -> int:
        return self.completed - self.dists["tpot"].count


def summarize_serve_run(timings: Sequence[HttpTiming], wall_start: float, wall_end: float,
                        percentiles: Sequence[float] = DEFAULT_METRIC_PERCENTILES,
                        goodput: Optional[dict[str, float]] = None, request_rate: Optional[float] = None,
                        expect_full_outputs: bool = False, client_cpu_s: float = float("nan"),
                        client_cpu_total_s: float = float("nan")) -> ServeRunMetrics:
    """Figures of one `bench serve` run (definitions above). ``expect_full_outputs``: ignore_eos
    was sent, so a completed request with fewer tokens than asked counts in ``short_outputs``.
    ``client_cpu_s``: the client's CPU time over the run (``client_cpu`` = it / duration); with several
    client processes the busiest one's, and ``client_cpu_total_s`` all of theirs."""
    pcts = tuple(sorted(set(percentiles) | {50.0}))
    ok = [t for t in timings if t.success]
    failed = [t for t in timings if not t.success]
    figs: dict[str, list[float]] = {k: [] for k in SERVE_FIGURES}
    good = 0
    for t in ok:
        figs["ttft"].append(t.ttft)
        figs["latency"].append(t.e2el)
        if t.tpot is not None:
            figs["tpot"].append(t.tpot)
        ev = t.event_times
        figs["itl"].extend(ev[i + 1] - ev[i] for i in range(len(ev) - 1))
        figs["client_queue"].append(t.start - t.dispatched)
        if goodput:
            good += meets_slo(goodput, t.ttft, t.tpot if t.tpot is not None else 0.0, t.e2el)
    figs["dispatch_lag"] = [t.dispatched - t.scheduled for t in timings]
    wall = wall_end - wall_start
    per_s = (lambda n: n / wall) if wall > 0 else (lambda n: float("nan"))
    prompt = sum(t.prompt_tokens for t in ok)
    completion = sum(t.output_tokens for t in ok)
    peak, concurrency = 0.0, 0
    if ok:
        t0 = min(t.start for t in ok)
        buckets: dict[int, int] = {}
        for t in ok:
            for x in t.event_times:
                b = int(x - t0)
                buckets[b] = buckets.get(b, 0) + 1
        peak = float(max(buckets.values(), default=0))
        events = sorted([(t.start, 1) for t in ok] + [(t.start + t.e2el, -1) for t in ok])
        live = 0
        for _, d in events:
            live += d
            concurrency = max(concurrency, live)
    kinds: dict[str, int] = {}
    for t in failed:
        kinds[t.error_kind or "error"] = kinds.get(t.error_kind or "error", 0) + 1
    m = ServeRunMetrics(
        len(timings), len(ok), len(failed), prompt, completion, wall, per_s(len(ok)), per_s(completion),
        per_s(prompt + completion), peak, concurrency, {k: PDist.of(v, pcts) for k, v in figs.items()}, pcts,
        failure_kinds=kinds, short_outputs=sum(expect_full_outputs and t.output_tokens < t.asked_tokens for t in ok),
        usage_missing=sum(not t.usage_reported for t in ok), client_cpu=client_cpu_s / wall if wall > 0 else float("nan"))
    if wall > 0:
        m.client_cpu_total = client_cpu_total_s / wall
    if goodput:
        m.goodput_requests = per_s(good)
        m.goodput_share = good / len(timings) if timings else float("nan")
    if request_rate is not None and math.isfinite(request_rate):
        m.target_rate = request_rate
        last = max((t.dispatched for t in timings), default=wall_start)
        m.achieved_rate = len(timings) / (last - wall_start) if last > wall_start else float("nan")
    return m


def serve_flatten(m: ServeRunMetrics) -> dict[str, float]:
    """One serve run's figures under flat keys, named as `flatten`'s where the figure is the same
    kind of number, so `rose bench compare` can lay a serve file beside a stream file:
    throughput_completion / throughput_total (tokens/s), throughput_requests (req/s),
    throughput_peak_output (tokens/s), throughput_goodput (req/s) and goodput_share (with
    --goodput), wall_s, and ``<figure>_<pXX>|mean|std`` for SERVE_FIGURES (latency = E2EL)."""
    out = {"throughput_completion": m.throughput_completion, "throughput_total": m.throughput_total,
           "throughput_requests": m.throughput_requests, "throughput_peak_output": m.peak_output, "wall_s": m.wall_s}
    if not math.isnan(m.goodput_requests):
        out.update(throughput_goodput=m.goodput_requests, goodput_share=m.goodput_share)
    if not math.isnan(m.achieved_rate):
        out["throughput_achieved_rate"] = m.achieved_rate
    if not math.isnan(m.client_cpu):
        out["client_cpu_share"] = m.client_cpu
    if not math.isnan(m.client_cpu_total):
        out["client_cpu_total_share"] = m.client_cpu_total
    if m.roofline is not None:
        out.update(m.roofline.figures())
    for name, d in m.dists.items():
        for k, v in d.pcts.items():
            out[f"{name}_{k}"] = v
        out[f"{name}_mean"] = d.mean
        out[f"{name}_std"] = d.std
    return out
