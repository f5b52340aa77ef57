"""`rose bench sweep`: one workload over a grid of loads, and the highest load that meets an SLO.

Axes (one or two; `parse_axis`, `grid`): ``request_rate`` (req/s, ``inf`` = all at once),
``max_concurrency`` (serve only), ``max_batch_size`` (stream only: the engine is rebuilt for
each value), ``input_len``, ``output_len``. Each point is a full benchmark (its warm-up runs,
then its measured runs) through the same code as ``bench stream`` / ``bench serve``; a caller
gives `run_points` one function that runs a point and returns a `Point`.

SLO search (`slo_search`, ``--slo ttft:MS tpot:MS --goodput-target 0.99``): over request rate
or concurrency, the highest load whose goodput share (requests meeting every SLO / requests,
the median over a point's measured runs) reaches the target. Assumes the share falls as load
rises. The grid's values are tried from the lowest up, stopping at the first that misses; when
the highest passes, the load is doubled until one misses, and when the lowest misses, it is halved
until one passes (each at most ``max_expand`` times). Then
the interval between the last passing and the first missing load is bisected ``max_steps``
times (rates: until it is within ``rel_tol`` of the passing load; concurrency: until the two
are neighbours). The answer lies within the final interval: the true knee is at most one
bisection step above it.

The result document (kind ``sweep``, schema rosecli.bench/1; `build_sweep_result`): the usual
``command``, ``config``, ``environment``, ``startup``, an empty ``runs`` list and ``summary``, and

- ``sweep``: ``mode`` ("stream" | "serve"), ``axes`` (name -> values), ``slo_ms`` (name -> ms or
  null), ``goodput_target``, ``search`` (with --slo: ``axis``, ``best`` (null: no load met it),
  ``first_miss``, ``bracketed``, ``tried``: [[load, share], ...] in order)
- ``points``: one per load tried, in the order run: ``label``, ``params`` (axis -> value),
  ``runs``, ``summary``, ``requests`` (raw per-request records of each measured run, as the
  single-run files hold them), ``timeline`` (with --timeline: one `timeline.StepTimeline`
  column set per measured run; stream only), ``search`` (true when the SLO search chose it).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from rosecli.engine.errors import ConfigError

AXES = {  # name -> (flag, type, mode it needs or None)
    "request_rate": ("--request-rates", float, None),
    "max_concurrency": ("--max-concurrency", int, "serve"),
    "max_batch_size": ("--max-batch-size", int, "stream"),
    "input_len": ("--input-len", int, None),
    "output_len": ("--output-len", int, None),
}
SEARCH_AXES = ("request_rate", "max_concurrency")
MAX_POINTS = 256


def parse_axis(name: str, text: Optional[str]) -> list:
    """``"1,2,4,inf"`` -> [1.0, 2.0, 4.0, inf] for the axis ``name``; None or empty -> []."""
    if text is None or not text.strip():
        return []
    flag, kind, _ = AXES[name]
    out = []
    for part in text.split(","):
        s = part.strip()
        try:
            v = kind(float(s)) if kind is float else int(s)
        except (ValueError, OverflowError):
            v = None
        ok = v is not None and (v > 0 if kind is float else v >= 1) and not (kind is float and math.isnan(v))
        if not ok or (kind is int and v > 2**31 - 1):
            what = "numbers > 0 (inf: all at once)" if kind is float else "whole numbers >= 1"
            raise ConfigError(f"{flag} takes comma-separated {what}, e.g. {'1,2,4,inf' if kind is float else '1,8,32'};"
                              f" got {s!r}")
        if v not in out:
            out.append(v)
    return out


def grid(axes: dict[str, list], mode: str) -> list[dict]:
    """Every combination of the axes' values (the first axis outermost); at most two axes with
    more than one value, and only axes the mode has."""
    for name, values in axes.items():
        need = AXES[name][2]
        if values and need is not None and need != mode:
            why = ("the server's batch size is its own: restart it to change it" if name == "max_batch_size" else
                   "the in-process driver submits on the workload's schedule only")
            raise ConfigError(f"{AXES[name][0]} with several values needs `rose bench sweep {need}` ({why})"
                              if len(values) > 1 else f"{AXES[name][0]} is not an option of bench sweep {mode}")
    swept = [n for n, v in axes.items() if len(v) > 1]
    if len(swept) > 2:
        raise ConfigError(f"a sweep has at most two axes with several values, got {len(swept)} "
                          f"({', '.join(AXES[n][0] for n in swept)}): fix all but two to one value")
    names = [n for n, v in axes.items() if v]
    points = [dict(zip(names, combo)) for combo in itertools.product(*(axes[n] for n in names))]
    if len(points) > MAX_POINTS:
        raise ConfigError(f"the sweep has {len(points)} points; at most {MAX_POINTS}: give fewer values")
    return points or [{}]


def point_label(params: dict) -> str:
    short = {"request_rate": "rate", "max_concurrency": "conc", "max_batch_size": "batch", "input_len": "in",
             "output_len": "out"}
    return " ".join(f"{short[k]} {fmt_value(v)}" for k, v in params.items()) or "point"


def fmt_value(v) -> str:
    if v is None or (isinstance(v, float) and math.isinf(v)):
        return "inf"
    return f"{v:g}" if isinstance(v, float) else str(v)


@dataclass
class Point:
    params: dict
    runs: list
    summary: dict
    requests: list = field(default_factory=list)
    timelines: Optional[list] = None
    measured: list = field(default_factory=list)  # the drivers' per-run metrics (not saved)
    failures: list = field(default_factory=list)
    submitted: int = 0
    search: bool = False

    @property
    def label(self) -> str:
        return point_label(self.params)

    @property
    def goodput_share(self) -> float:
        v = self.summary.get("goodput_share")
        return float(v) if isinstance(v, (int, float)) and v is not None else float("nan")

    def record(self) -> dict:
        out = {"label": self.label, "params": self.params, "runs": self.runs, "summary": self.summary,
               "requests": self.requests, "search": self.search}
        if self.timelines is not None:
            out["timeline"] = self.timelines
        return out


# --- the SLO search --------------------------------------------------------------------------------


@dataclass
class SearchResult:
    axis: str
    target: float
    best: Optional[float]  # the highest load that met the target (None: none did)
    first_miss: Optional[float]  # the lowest load that missed (None: none did)
    tried: list[tuple[float, float]]  # (load, goodput share) in the order measured
    bracketed: bool  # a miss above the best was found: the knee lies between best and first_miss

    def record(self) -> dict:
        return {"axis": self.axis, "target": self.target, "best": self.best, "first_miss": self.first_miss,
                "best_label": "none" if self.best is None else fmt_value(self.best),
                "bracketed": self.bracketed, "tried": [list(t) for t in self.tried]}


def slo_search(measure: Callable[[float], float], start: Sequence[float], target: float, *, integer: bool = False,
               max_steps: int = 4, rel_tol: float = 0.05, max_expand: int = 4, axis: str = "request_rate") -> SearchResult:
    """The highest load with ``measure(load) >= target`` (see the module's docstring).
    ``measure`` runs one point at that load and returns its goodput share (NaN counts as a miss)."""
    if not start:
        raise ConfigError("the SLO search needs at least one starting load")
    tried: list[tuple[float, float]] = []

    def ok(load) -> bool:
        share = measure(load)
        tried.append((load, share))
        return share >= target  # NaN: False

    lo = hi = None
    for load in sorted(start):
        if ok(load):
            lo = load
        else:
            hi = load
            break
    if lo is None:  # the lowest load already misses: halve it until one passes
        probe = hi
        for _ in range(max_expand):
            probe = probe // 2 if integer else probe / 2
            if math.isinf(probe) or probe < (1 if integer else 1e-9):
                break
            if ok(probe):
                lo = probe
                break
            hi = probe
        if lo is None:
            return SearchResult(axis, target, None, hi, tried, False)
    if hi is None:
        if math.isinf(lo):
            return SearchResult(axis, target, lo, None, tried, False)
        probe = lo
        for _ in range(max_expand):
            probe = probe * 2
            if ok(probe):
                lo = probe
            else:
                hi = probe
                break
        if hi is None:
            return SearchResult(axis, target, lo, None, tried, False)
    for _ in range(max_steps):
        if math.isinf(hi):
            mid = lo * 2
        elif integer:
            if hi - lo <= 1:
                break
            mid = (lo + hi) // 2
        else:
            if hi - lo <= rel_tol * lo:
                break
            mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(axis, target, lo, hi, tried, True)


# --- running and saving ------------------------------------------------------------------------------


def build_sweep_result(mode: str, config: dict, startup: dict, axes: dict, points: Sequence[Point],
                       slo: Optional[dict] = None, goodput_target: Optional[float] = None,
                       search: Optional[SearchResult] = None, env: Optional[dict] = None) -> dict:
    from rosecli.bench import results

    doc = results.build_result("sweep", {**config, "sweep_mode": mode}, startup, [], {}, None, env=env)
    doc["sweep"] = results._finite({"mode": mode, "axes": axes,
                                    "slo_ms": {k: v * 1e3 for k, v in (slo or {}).items()} or None,
                                    "goodput_target": goodput_target,
                                    "search": search.record() if search else None})
    doc["points"] = results._finite([p.record() for p in points])
    return doc


def save_sweep_result(path: str, doc: dict) -> None:
    from rosecli.bench import results

    results.write_document(path, doc)


def point_figures(doc: dict) -> list[tuple[str, dict, dict]]:
    """(label, params, summary) of each point of a result document; a single-run file is one point."""
    if doc.get("kind") == "sweep":
        return [(p.get("label") or point_label(p.get("params", {})), p.get("params", {}), p.get("summary", {}))
                for p in doc.get("points", []) if isinstance(p, dict)]
    return [("run", {}, doc.get("summary", {}))]


def run_grid(params_list: Sequence[dict], run_point: Callable[[dict], Point], table) -> list[Point]:
    """Run every point in order; each appears in ``table`` (`SweepTable`) as it finishes."""
    points = []
    for params in params_list:
        table.start_point(point_label(params))
        p = run_point(params)
        table.finish_point(p)
        points.append(p)
    return points


def run_search(axis: str, fixed: dict, start: Sequence[float], run_point: Callable[[dict], Point], table,
               target: float, max_steps: int) -> tuple[list[Point], SearchResult]:
    """`slo_search` over ``axis`` with the other axes at ``fixed``; every point it ran, in order."""
    points: list[Point] = []

    def measure(load) -> float:
        params = {**fixed, axis: load}
        table.start_point(point_label(params))
        p = run_point(params)
        table.finish_point(p)
        points.append(p)
        return p.goodput_share

    result = slo_search(measure, start, target, integer=axis == "max_concurrency", max_steps=max_steps, axis=axis)
    for p in points:
        p.search = True
    return points, result


def search_line(result: SearchResult, slo: dict, points: Sequence[Point]) -> str:
    """The answer of the SLO search in one line, with the chosen point's figures."""
    slos = ", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in slo.items())
    what = "request rate" if result.axis == "request_rate" else "concurrency"
    unit = " req/s" if result.axis == "request_rate" else ""
    head = f"SLO search ({slos}; goodput >= {result.target:.1%} of requests): "
    if result.best is None:
        return head + (f"no load met it; the lowest tried, {what} {fmt_value(result.first_miss)}{unit}, missed "
                       f"({_share(points, result.axis, result.first_miss)})")
    best = next((p for p in reversed(points) if p.params.get(result.axis) == result.best), None)
    figures = ""
    if best is not None:
        s = best.summary
        figures = (f": {s.get('throughput_completion', float('nan')):.1f} tokens/s, "
                   f"TTFT p99 {_ms(s.get('ttft_p99'))} ms, TPOT p99 {_ms(s.get('tpot_p99'))} ms, "
                   f"{_share(points, result.axis, result.best)}")
    if result.bracketed:
        tail = f"; {fmt_value(result.first_miss)}{unit} missed"
    else:
        tail = "; the highest tried: the limit may be higher"
    return head + f"highest {what} meeting it {fmt_value(result.best)}{unit}{figures}{tail}"


def _ms(v) -> str:
    return "-" if not isinstance(v, (int, float)) or v is None or not math.isfinite(v) else f"{v * 1e3:.2f}"


def _share(points: Sequence[Point], axis: str, load) -> str:
    p = next((p for p in reversed(points) if p.params.get(axis) == load), None)
    share = p.goodput_share if p is not None else float("nan")
    return "goodput -" if math.isnan(share) else f"{share:.1%} of requests met every SLO"
