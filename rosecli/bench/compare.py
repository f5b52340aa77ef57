"""Compare result documents (`results.load_result`) figure by figure: ``rose bench compare``.

    rows = compare_results([baseline_doc, other_doc, ...], percentiles=None, confidence=0.95)
    diffs = config_differences([baseline_doc, other_doc, ...])

For each summary figure (the median over measured runs) a `CompareRow` holds the baseline
value and, per other document, a `CompareCell`: value, change (other - baseline), percent
(change / baseline * 100), a confidence interval of the change and a verdict read from it:

- the interval (``ci_low``, ``ci_high``; ``ci_method`` says how it was made), a percentile
  bootstrap (`bootstrap_diff`, numpy only, seeded: the same files give the same interval):
  - ``requests``: per-request figures (TTFT, TPOT, ITL, latency/E2EL, waits) are recomputed
    from the raw per-request samples both files store, pooled over their measured runs; the
    requests (ITL: the gaps) are resampled with replacement on each side and the figure's
    statistic (the percentile, mean or std) is taken of each resample; the interval is the
    central ``confidence`` share of the differences;
  - ``runs``: other figures (throughput, wall, goodput) and files without raw samples: the
    measured runs' values are resampled on each side (the statistic: their mean); needs two
    or more measured runs in each file.
- ``noise``: the interval contains 0: the change is not told apart from run-to-run noise.
- ``better`` / ``worse``: the interval lies on one side of 0, by the figure's direction:
  throughput up is better, every time figure (TTFT, TPOT, ITL, latency, waits, wall) down is better;
  of the distance to the floor (`bench.roofline`), read rate and share of the ceiling up, bytes and
  step time per decode step down.
- ``n/a``: no interval (no raw samples and fewer than two measured runs in a file);
  ``same``: no change; ``missing``: the figure is absent (null) in one of the two.

No fixed percentage decides: a 3% change is a change with enough samples and noise with few.
``percentiles`` (``--percentiles 50,90,99``) adds those percentiles of each per-request figure,
computed from the raw samples, when the summary does not hold them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from rosecli.bench.metrics import FIGURE_LABELS, SERVE_LABELS, pct_key
from rosecli.engine.errors import ConfigError

# The first figures, in this order; the others follow in the baseline's order.
_FIRST = ("throughput_completion", "throughput_total", "throughput_decode", "decode_s", "total_s", "ttft_p50",
          "ttft_p95", "ttft_p99", "tpot_p50", "tpot_p95", "tpot_p99", "itl_p50", "itl_p95", "itl_p99",
          "latency_p50", "latency_p95", "latency_p99")
_RATE_LABELS = {"throughput_completion": "Throughput (completion)", "throughput_total": "Throughput (total)",
                "throughput_decode": "Throughput (completion,decode)",
                "throughput_direct": "Throughput (scheduler directly)"}
_SECONDS_LABELS = {"wall_s": "Wall", "submit_wall_s": "Submit wall", "decode_s": "Decode time",
                   "total_s": "Total time", "prefill_s": "Prefill time"}


# Kinds whose figures mean the same things and may be compared: bench stream (in process) and
# bench serve (over HTTP) both report TTFT, TPOT, ITL, latency and token throughput.
COMPARABLE = ({"stream", "serve"},)
_REQUEST_RATES = {"throughput_requests": "Request throughput", "throughput_goodput": "Request goodput",
                  "throughput_achieved_rate": "Request rate achieved"}


def comparable(kinds: set) -> bool:
    return len(kinds) <= 1 or any(kinds <= group for group in COMPARABLE)


# the distance to the floor (rosecli.bench.roofline): label, unit
_ROOFLINE = {"decode_bytes_per_step": ("Decode bytes per step", "MB"),
             "decode_kv_bytes_per_step": ("Decode KV bytes per step", "MB"),
             "decode_step_time": ("Decode step time", "ms"), "decode_read_gbs": ("Decode read rate", "GB/s"),
             "roofline_share": ("Share of the read ceiling", "share")}

# this process's garbage collections during a run (rosecli.engine.gc_pauses.GcInterval): label, unit
_GC = {"gc_collections": ("GC collections", "count"), "gc_full_collections": ("GC full collections", "count"),
       "gc_pause_s": ("GC pauses, in all", "ms"), "gc_longest_pause_s": ("GC longest pause", "ms")}


def higher_is_better(figure: str) -> bool:
    return figure.startswith("throughput") or figure in ("goodput_share", "decode_read_gbs", "roofline_share")


def unit_of(figure: str) -> str:
    """Display unit: "tokens/s" for rates, "s" for whole-run times, "ms" for per-request times."""
    if figure in _REQUEST_RATES:
        return "req/s"
    if figure in _ROOFLINE:
        return _ROOFLINE[figure][1]
    if figure in _GC:
        return _GC[figure][1]
    if figure == "goodput_share":
        return "share"
    if higher_is_better(figure):
        return "tokens/s"
    return "s" if figure in _SECONDS_LABELS else "ms"


def label_of(figure: str) -> str:
    """``ttft_p99`` -> ``TTFT p99``; ``throughput_total`` -> ``Throughput (total)``."""
    if figure in _RATE_LABELS:
        return _RATE_LABELS[figure]
    if figure in _ROOFLINE:
        return _ROOFLINE[figure][0]
    if figure in _GC:
        return _GC[figure][0]
    if figure in _REQUEST_RATES:
        return _REQUEST_RATES[figure]
    if figure == "throughput_peak_output":
        return "Peak output throughput (1 s)"
    if figure == "goodput_share":
        return "Requests meeting every SLO"
    if figure in _SECONDS_LABELS:
        return _SECONDS_LABELS[figure]
    name, _, stat = figure.rpartition("_")
    return f"{FIGURE_LABELS.get(name, SERVE_LABELS.get(name, name))} {stat}" if name else figure


@dataclass
class CompareCell:
    value: Optional[float]
    change: Optional[float]  # value - baseline
    percent: Optional[float]  # change / baseline * 100 (None when the baseline is 0 or absent)
    ci_low: Optional[float] = None  # the confidence interval of the change (None: none could be made)
    ci_high: Optional[float] = None
    ci_method: Optional[str] = None  # "requests" | "runs" | None
    verdict: str = "n/a"  # "better" | "worse" | "noise" | "same" | "n/a" | "missing"


@dataclass
class CompareRow:
    figure: str  # flat key, e.g. "ttft_p99"; values in seconds or tokens/s
    label: str  # "TTFT p99"
    unit: str  # display unit: "ms" | "s" | "tokens/s"
    higher_is_better: bool
    base: Optional[float]
    cells: list[CompareCell] = field(default_factory=list)  # one per other document, in order


def _num(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


# --- the bootstrap ---------------------------------------------------------------------------------

BOOTSTRAP_RESAMPLES = 1000
_CHUNK = 4_000_000  # values resampled at once (memory: 8 bytes each, twice)


def _stat(stat: str) -> Callable[[np.ndarray], np.ndarray]:
    """Row-wise statistic of a 2-D array: "p99" | "p99.9" | "mean" | "std"."""
    if stat == "mean":
        return lambda x: x.mean(axis=1)
    if stat == "std":
        return lambda x: x.std(axis=1)
    q = float(stat[1:])
    return lambda x: np.percentile(x, q, axis=1, method="linear")


def bootstrap_diff(a: Sequence[float], b: Sequence[float], stat: str = "mean", confidence: float = 0.95,
                   resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of stat(b) - stat(a): each side resampled with replacement
    ``resamples`` times; the central ``confidence`` share of the differences."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) == 0 or len(b) == 0:
        raise ValueError("bootstrap_diff needs samples on both sides")
    fn = _stat(stat)
    rng = np.random.default_rng(seed)
    diffs = np.empty(resamples)
    step = max(1, _CHUNK // max(len(a), len(b)))
    for i in range(0, resamples, step):
        k = min(step, resamples - i)
        diffs[i:i + k] = fn(b[rng.integers(0, len(b), (k, len(b)))]) - fn(a[rng.integers(0, len(a), (k, len(a)))])
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(diffs, [tail, 100 - tail])
    return float(lo), float(hi)


# --- raw per-request samples of a result file --------------------------------------------------------


def _gaps(times) -> list[float]:
    return [times[i + 1] - times[i] for i in range(len(times) - 1)]


def _stream_samples(rec: dict) -> dict[str, list]:
    """One `bench stream` request record -> figure -> its samples (a request gives ITL several)."""
    out: dict[str, list] = {}
    sub, first, fin, n = rec.get("submit"), rec.get("first_token"), rec.get("finish"), rec.get("output_tokens") or 0
    if sub is not None and first is not None:
        out["ttft"] = [first - sub]
    if sub is not None and fin is not None:
        out["latency"] = [fin - sub]
    if first is not None and fin is not None and n >= 2:
        out["tpot"] = [(fin - first) / (n - 1)]
    out["itl"] = _gaps(rec.get("token_times") or [])
    if rec.get("admitted") is not None:
        start = rec.get("tokenized") if rec.get("tokenized") is not None else sub
        if start is not None:
            out["queue_wait"] = [rec["admitted"] - start]
        if first is not None:
            out["prefill_first_token"] = [first - rec["admitted"]]
    if sub is not None and rec.get("scheduled_submit") is not None:
        out["submit_lag"] = [sub - rec["scheduled_submit"]]
    return out


def _serve_samples(rec: dict) -> dict[str, list]:
    """One `bench serve` request record (successful ones only count, as in its figures)."""
    ev, start = rec.get("event_times") or [], rec.get("start")
    out: dict[str, list] = {}
    if rec.get("dispatched") is not None and rec.get("scheduled") is not None:
        out["dispatch_lag"] = [rec["dispatched"] - rec["scheduled"]]
    if not rec.get("success") or not ev or start is None:
        return out
    ttft, e2el, n = ev[0] - start, ev[-1] - start, rec.get("output_tokens") or 0
    out.update(ttft=[ttft], latency=[e2el], itl=_gaps(ev))
    if n >= 2:
        out["tpot"] = [(e2el - ttft) / (n - 1)]
    if rec.get("dispatched") is not None:
        out["client_queue"] = [start - rec["dispatched"]]
    return out


def request_samples(doc: dict) -> dict[str, list[float]]:
    """Figure name (ttft, tpot, itl, latency, ...) -> its samples over every measured run's raw
    requests, pooled; {} when the file holds no raw requests (bench sched, or hand-made)."""
    per = _serve_samples if doc.get("kind") == "serve" else _stream_samples
    out: dict[str, list[float]] = {}
    for run in doc.get("requests") or []:
        for rec in run if isinstance(run, list) else []:
            if isinstance(rec, dict):
                for k, v in per(rec).items():
                    out.setdefault(k, []).extend(x for x in v if x is not None and math.isfinite(x))
    return out


def _split(figure: str) -> tuple[str, str]:
    """"ttft_p99" -> ("ttft", "p99"); "throughput_total" -> ("throughput", "total")."""
    name, _, stat = figure.rpartition("_")
    return name, stat


def _is_stat(stat: str) -> bool:
    if stat in ("mean", "std"):
        return True
    try:
        return stat.startswith("p") and 0 < float(stat[1:]) <= 100
    except ValueError:
        return False


def _run_values(doc: dict, figure: str) -> list[float]:
    vals = [_num(r.get("figures", {}).get(figure)) for r in doc["runs"] if not r.get("warmup")]
    return [v for v in vals if v is not None]


def _pooled(samples: dict, figure: str) -> Optional[list[float]]:
    name, stat = _split(figure)
    if not _is_stat(stat):
        return None
    vals = samples.get(name)
    return vals if vals else None


def _value(doc: dict, samples: dict, figure: str) -> Optional[float]:
    """The summary's figure; one the summary lacks (an extra --percentiles) from the raw samples."""
    v = _num(doc["summary"].get(figure))
    if v is None and figure not in doc["summary"]:
        vals = _pooled(samples, figure)
        if vals:
            v = float(_stat(_split(figure)[1])(np.asarray([vals], dtype=np.float64))[0])
    return v


def _interval(base_doc, base_s, doc, s, figure: str, confidence: float, resamples: int):
    a, b = _pooled(base_s, figure), _pooled(s, figure)
    if a is not None and b is not None:
        return (*bootstrap_diff(a, b, _split(figure)[1], confidence, resamples), "requests")
    a, b = _run_values(base_doc, figure), _run_values(doc, figure)
    if len(a) >= 2 and len(b) >= 2:
        return (*bootstrap_diff(a, b, "mean", confidence, resamples), "runs")
    return None, None, None


def _cell(base_doc: dict, base_s: dict, doc: dict, s: dict, figure: str, base: Optional[float],
          confidence: float, resamples: int) -> CompareCell:
    value = _value(doc, s, figure)
    if base is None or value is None:
        return CompareCell(value, None, None, verdict="missing")
    change = value - base
    percent = 100.0 * change / base if base != 0 else None
    lo, hi, method = _interval(base_doc, base_s, doc, s, figure, confidence, resamples)
    if change == 0:
        verdict = "same"
    elif lo is None:
        verdict = "n/a"
    elif lo <= 0 <= hi:
        verdict = "noise"
    else:
        verdict = "better" if (lo > 0) == higher_is_better(figure) else "worse"
    return CompareCell(value, change, percent, lo, hi, method, verdict)


def compare_results(docs: Sequence[dict], percentiles: Optional[Sequence[float]] = None, confidence: float = 0.95,
                    resamples: int = BOOTSTRAP_RESAMPLES) -> list[CompareRow]:
    """One row per figure of the baseline ``docs[0]``'s summary (and, with ``percentiles``,
    those percentiles of each per-request figure); all documents must be comparable kinds
    (ConfigError otherwise)."""
    if len(docs) < 2:
        raise ConfigError("compare needs at least two result files: the baseline first")
    if not 0 < confidence < 1:
        raise ConfigError(f"--confidence must be between 0 and 1 (e.g. 0.95), got {confidence}")
    kinds = {d["kind"] for d in docs}
    if not comparable(kinds):
        raise ConfigError(f"cannot compare results of different benchmarks ({', '.join(sorted(kinds))})")
    base_doc = docs[0]
    samples = [request_samples(d) for d in docs]
    names = list(base_doc["summary"])
    if percentiles:
        wanted = [pct_key(q) for q in percentiles]
        per_request = [n for n in (FIGURE_LABELS | SERVE_LABELS) if n in samples[0]]
        keep = [f for f in names if not (_split(f)[0] in per_request and _split(f)[1].startswith("p"))]
        names = keep + [f"{n}_{k}" for n in per_request for k in wanted]
    order = [f for f in _FIRST if f in names] + [f for f in names if f not in _FIRST]
    rows = []
    for fig in order:
        base = _value(base_doc, samples[0], fig)
        rows.append(CompareRow(fig, label_of(fig), unit_of(fig), higher_is_better(fig), base,
                               [_cell(base_doc, samples[0], d, s, fig, base, confidence, resamples)
                                for d, s in zip(docs[1:], samples[1:])]))
    return rows


def config_differences(docs: Sequence[dict]) -> dict[str, list]:
    """Environment entries (GPU, clocks, temperature, versions, commit, dirty tree) and options
    whose values differ between the documents, environment first: key -> one value per document.
    A comparison across these is not like for like."""
    out: dict[str, list] = {}
    for section, skip in (("environment", ("time", "platform")), ("config", ())):
        keys: list[str] = []
        for d in docs:
            keys += [k for k in d.get(section, {}) if k not in keys and k not in skip]
        for k in keys:
            vals = [d.get(section, {}).get(k) for d in docs]
            if any(v != vals[0] for v in vals[1:]):
                out[k if section == "config" else f"{section}.{k}"] = vals
    return out


def sweep_point_docs(docs: Sequence[dict]) -> list[tuple[str, list[dict]]]:
    """Sweep result files point by point: (label, one single-run-like document per file) for each
    point of the baseline that every file has (matched by label, e.g. "rate 4")."""
    out = []
    by_label = [{p.get("label"): p for p in d.get("points", []) if isinstance(p, dict)} for d in docs]
    for label in by_label[0]:
        if all(label in b for b in by_label[1:]):
            out.append((label, [{"kind": d.get("sweep", {}).get("mode", "stream"), "runs": b[label].get("runs", []),
                                 "summary": b[label].get("summary", {}), "requests": b[label].get("requests", []),
                                 "config": {}, "environment": {}} for d, b in zip(docs, by_label)]))
    if not out:
        raise ConfigError("these sweeps share no point (compared by load, e.g. rate 4): sweep the same loads")
    return out
