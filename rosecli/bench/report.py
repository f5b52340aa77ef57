"""Benchmark output with Rich: live run table, summaries, start-up figures, compare table.

In a terminal: a `RunTable` live table (one row per warm-up and per measured run; warm-ups
dim and marked), then Rich summary tables. When stdout is not a terminal, or with
``plain=True``, the same rows as plain text with no escape codes, in the reference posts'
format so they grep the same::

    === run 1/3 ===
    TTFT p50/p95/p99: 31.81/34.16/34.44 ms
    Throughput (completion,total): 11991.59 tokens/s
    === online summary ===
    TTFT p50/mean: 2.73/2.73 ms

A warm-up run prints one ``warmup (not measured): ...`` line instead, so a grep for
``TTFT p50/p95/p99`` finds measured runs only.

Use::

    print_startup(console, engine.startup_times)
    with RunTable(console, "stream", "streaming benchmark") as table:
        table.start_run("warmup 1/1", warmup=True)
        table.update(finished, total, tokens, elapsed)      # from the driver, ~10 Hz at most
        table.finish_run("warmup 1/1", run_metrics)         # or finish_run(run_metrics)
    print_stream_summary(console, measured, metrics.median_run(measured))
    print_sched_summary(console, "online", warmups, metrics.summarize_sched_runs(measured), len(measured))
    print_compare(console, files, compare.compare_results(docs), compare.config_differences(docs))

The live table is redrawn only inside these calls, on the caller's thread, at most every
``refresh_s`` (no Rich refresh thread competing with the engine for the GIL while a run is
measured), and nothing here is per token.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Callable, Optional, Sequence, Union

from rich import box
from rich.console import Console
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from rosecli.bench.compare import CompareRow
from rosecli.bench.metrics import (FIGURE_LABELS, SERVE_FIGURES, SERVE_LABELS, STREAM_FIGURES, Dist, RunMetrics,
                                   SchedRunMetrics, ServeRunMetrics, pct_key)
from rosecli.bench.roofline import line as roofline_line
from rosecli.engine.gc_pauses import gc_line

_PLAIN_LABELS = dict(FIGURE_LABELS, queue_wait="Queue wait (post-tok)")
_VERDICT_STYLE = {"better": "green", "worse": "red", "noise": "dim", "same": "dim", "n/a": "dim", "missing": "dim"}


def _absent(v: Optional[float]) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _ms(v: Optional[float]) -> str:
    return "-" if _absent(v) else f"{v * 1e3:.2f}"


def _triple(d: Dist) -> str:
    return f"{_ms(d.p50)}/{_ms(d.p95)}/{_ms(d.p99)}"


def _emit(console: Console, line: str) -> None:
    """One plain line: no markup, highlighting or wrapping (long lines stay one grep-able line)."""
    console.print(line, highlight=False, markup=False, emoji=False, soft_wrap=True)


def _is_plain(console: Console, plain: Optional[bool]) -> bool:
    return (not console.is_terminal) if plain is None else plain


def header_lines(info: dict) -> list[str]:
    """``Key: value`` lines (the posts' header: Model, Device, Paged attention, ...)."""
    return [f"{k}: {v}" for k, v in info.items()]


_STARTUP_NAMES = {"model_load_s": "model load", "compile_s": "kernel compile", "graph_capture_s": "graph capture",
                  "gemm_warmup_s": "GEMM warm-up", "prefill_graph_capture_s": "prefill graph capture"}


def sampling_line(params, dummy_weights: bool) -> str:
    """How the benchmark's requests pick tokens: ``greedy``, or the sampling parameters that are set. With dummy
    weights and top-p, a note: random weights give near-uniform logits, so top-p keeps most of the vocabulary (a
    trained model's nucleus is tens to hundreds of tokens), and what the sampler does for a row depends on it."""
    if params.greedy:
        return "greedy"
    parts = [f"temperature {params.temperature:g}"]
    for name, label, off in (("top_p", "top-p", 1.0), ("top_k", "top-k", 0), ("min_p", "min-p", 0.0),
                             ("seed", "seed", None)):
        value = getattr(params, name)
        if value is not None and value != off:
            parts.append(f"{label} {value:g}")
    line = ", ".join(parts)
    if dummy_weights and params.top_p < 1:
        line += (" (dummy weights: near-uniform logits keep most of the vocabulary in top-p; a trained model's "
                 "nucleus is tens to hundreds of tokens)")
    return line


def startup_line(startup: dict) -> str:
    """``Startup (not in any run): model load 1.23 s, kernel compile 4.56 s, graph capture 0.78 s``."""
    parts = [f"{_STARTUP_NAMES.get(k, k.removesuffix('_s').replace('_', ' '))} {v:.2f} s"
             for k, v in startup.items() if not _absent(v)]
    return "Startup (not in any run): " + (", ".join(parts) if parts else "-")


def print_startup(console: Console, startup: dict, plain: Optional[bool] = None) -> None:
    """The start-up figures on their own: they are never inside a run's figures."""
    if _is_plain(console, plain):
        _emit(console, startup_line(startup))
        return
    table = Table(title="Startup (not in any run)", title_justify="left")
    table.add_column("stage")
    table.add_column("s", justify="right")
    for k, v in startup.items():
        table.add_row(_STARTUP_NAMES.get(k, k), "-" if _absent(v) else f"{v:.2f}")
    console.print(table)


def stream_lines(m: RunMetrics) -> list[str]:
    """One measured stream run in the posts' format; figures with no samples are left out."""
    lines = [f"Requests: {m.requests}", f"Prompt tokens (total): {m.prompt_tokens}",
             f"Completion tokens (total): {m.completion_tokens}"]
    if not _absent(m.submit_wall_s):
        lines.append(f"Submit wall: {m.submit_wall_s:.6f} s")
    for k in STREAM_FIGURES:
        d = m.dists[k]
        if d.count == 0:
            continue
        line = f"{_PLAIN_LABELS[k]} p50/p95/p99: {_triple(d)}{' ms/token' if k == 'tpot' else ' ms'}"
        if k == "tpot" and m.tpot_left_out:
            line += f" ({m.tpot_left_out} one-token request{'s' if m.tpot_left_out != 1 else ''} left out)"
        if k == "itl" and not _absent(m.mean_chunk_tokens) and m.mean_chunk_tokens > 1.0:
            line += f" (per chunk, {m.mean_chunk_tokens:.1f} tokens/chunk)"
        lines.append(line)
    lines.append(f"Throughput (completion,total): {m.throughput_completion:.2f} tokens/s")
    lines.append(f"Throughput (prompt+completion,total): {m.throughput_total:.2f} tokens/s")
    lines.append(f"Wall: {m.wall_s:.6f} s")
    if m.errors:
        lines.append(f"Errors: {m.errors}")
    return lines + attached_lines(m)


def attached_lines(m) -> list[str]:
    """The figures measured beside a run's requests (`metrics.attached_figures`), a line each: its distance to the
    floor (`bench.roofline`; none on CPU or from another server), then this process's garbage collections during
    the run (`gc_pauses.gc_line`; none for `bench serve`, whose server counts its own)."""
    r = getattr(m, "roofline", None)
    c = getattr(m, "gc", None)
    lines = [roofline_line(r.figures(), r.ceiling_gbs) if r is not None else None,
             gc_line(c.figures()) if c is not None else None]
    return [line for line in lines if line]


def failure_kinds(failures: Sequence[tuple[str, str]]) -> str:
    """Failed requests (kind, message) as a count per kind of error, each with its first message."""
    counts = Counter(kind for kind, _ in failures)
    first: dict[str, str] = {}
    for kind, message in failures:
        first.setdefault(kind, message)
    return "; ".join(f"{n} {kind} (first: {first[kind]})" for kind, n in counts.most_common())


def sched_lines(m: SchedRunMetrics) -> list[str]:
    """One measured sched run (figures as the posts' summary names them)."""
    lines = [f"Decode time: {m.decode_s:.6f} s", f"Prefill time: {m.prefill_s:.6f} s", f"Total time: {m.total_s:.6f} s",
             f"Throughput(completion,decode): {m.throughput_decode:.2f} tokens/s",
             f"Throughput(completion,total): {m.throughput_total:.2f} tokens/s"]
    for name, label, unit in (("ttft", "TTFT", "ms"), ("tpot", "TPOT", "ms/token"), ("latency", "Latency", "ms")):
        p50, p99 = getattr(m, f"{name}_p50"), getattr(m, f"{name}_p99")
        if p50 is not None:
            lines.append(f"{label} p50/p99: {_ms(p50)}/{_ms(p99)} {unit}")
    return lines + attached_lines(m)


def warmup_line(m: Union[RunMetrics, SchedRunMetrics]) -> str:
    """A warm-up run in one line, worded so that greps for measured figures do not match it."""
    if isinstance(m, ServeRunMetrics):
        return serve_warmup_line(m)
    if isinstance(m, RunMetrics):
        return (f"warmup (not measured): {m.completion_tokens} tokens in {m.wall_s:.3f} s, "
                f"{m.throughput_completion:.2f} tokens/s, TTFT p50 {_ms(m.dists['ttft'].p50)} ms, "
                f"TTFT p99 {_ms(m.dists['ttft'].p99)} ms, TPOT p50 {_ms(m.dists['tpot'].p50)} ms/token")
    return (f"warmup (not measured): {m.completion_tokens} tokens, total {m.total_s:.3f} s, "
            f"decode {m.throughput_decode:.2f} tokens/s")


class LiveTable:
    """A Rich ``Live`` table on a terminal (nothing is drawn in plain mode), redrawn at most every
    ``refresh_s`` unless forced. Subclasses set ``console``, ``plain``, ``refresh_s`` and define
    ``table()`` (what to draw) and, if they must, ``closing()`` (state to clear before the last draw)."""

    _live: Optional[Live] = None
    _next_draw = 0.0

    def table(self):
        raise NotImplementedError

    def closing(self) -> None:
        pass

    def __enter__(self):
        if not self.plain:
            self._live = Live(self.table(), console=self.console, auto_refresh=False, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        if self._live is not None:
            self.closing()
            self._live.update(self.table(), refresh=True)
            self._live.__exit__(*exc)
            self._live = None
        return False

    def _draw(self, force: bool = False, now: Optional[float] = None) -> None:
        if self._live is None:
            return
        now = time.perf_counter() if now is None else now
        if force or now >= self._next_draw:
            self._live.update(self.table(), refresh=True)
            self._next_draw = now + self.refresh_s

    def progress_text(self, finished: int, total: int, tokens: int, rate: float, elapsed: float) -> str:
        raise NotImplementedError

    def update(self, finished: int, total: int, tokens: int, elapsed: float) -> None:
        """Progress of the run in progress: requests finished of total, output tokens so far
        (counted as they are generated), seconds since the run started. Cheap to call often;
        redraws at most every refresh_s."""
        if self.plain:
            return
        now = time.perf_counter()
        if now < self._next_draw:
            return
        rate = tokens / elapsed if elapsed > 0 else 0.0
        self.progress = self.progress_text(finished, total, tokens, rate, elapsed)
        self._draw(force=True, now=now)


class RunTable(LiveTable):
    """Rows of runs: a live Rich table in a terminal, plain post-format lines otherwise
    (or with ``plain=True``). A context manager; ``kind`` is "stream", "sched" or "serve".

    The live table fits the console: percentiles as ``p50/p95/p99`` in one line per run where
    that fits, else ``p50/p99``, else two lines per run (p50 over p99); the plain lines and the
    result file always hold every figure. The run in progress shows, below the table, requests
    done, tokens generated so far (counted as they stream) and tokens/s."""

    LAYOUTS = ("p50/p95/p99", "p50/p99", "two-line")  # sched and serve: p50 and p99 (top) in the first two

    def __init__(self, console: Console, kind: str, title: str = "", plain: Optional[bool] = None,
                 refresh_s: float = 0.25):
        if kind not in ("stream", "sched", "serve"):
            raise ValueError(f"RunTable kind must be stream, sched or serve, got {kind!r}")
        self.console = console
        self.kind = kind
        self.title = title
        self.plain = _is_plain(console, plain)
        self.refresh_s = refresh_s
        self.rows: list[list] = []  # [label, warmup, metrics or None]
        self.progress = ""

    def table(self) -> Table:
        return self.render()

    def closing(self) -> None:
        self.progress = ""

    def start_run(self, label: str, warmup: bool) -> None:
        self.rows.append([label, bool(warmup), None])
        self.progress = f"{label}: starting"
        if self.plain:
            _emit(self.console, f"=== {label} ===")
        else:
            self._draw(force=True)

    def progress_text(self, finished: int, total: int, tokens: int, rate: float, elapsed: float) -> str:
        label = self.rows[-1][0] if self.rows else "run"
        return f"{label}: {finished}/{total} requests done, {tokens:,} tokens, {rate:,.0f} tok/s, {elapsed:.1f} s"

    def finish_run(self, label: Union[str, RunMetrics, SchedRunMetrics],
                   metrics: Union[RunMetrics, SchedRunMetrics, None] = None) -> None:
        """``finish_run(label, metrics)``, or ``finish_run(metrics)`` for the run last started."""
        if metrics is None:
            label, metrics = None, label
        row = next((r for r in reversed(self.rows) if label is None or r[0] == label), None)
        if row is None:
            row = [label, False, None]
            self.rows.append(row)
        row[2] = metrics
        self.progress = ""
        if self.plain:
            if row[1]:
                _emit(self.console, warmup_line(metrics))
            else:
                lines = {"stream": stream_lines, "sched": sched_lines, "serve": serve_lines}[self.kind]
                for line in lines(metrics):
                    _emit(self.console, line)
        else:
            self._draw(force=True)

    def render(self, width: Optional[int] = None) -> Table:
        """The table in the first layout whose natural width fits ``width`` (default: the console's)."""
        width = self.console.width if width is None else width
        options = self.console.options.update_width(10_000)  # the natural width, not clamped to the console
        for layout in self.LAYOUTS:
            table = self._render(layout)
            if Measurement.get(self.console, options, table).maximum <= width:
                return table
        return table

    def _columns(self, layout: str) -> list[tuple[str, Callable]]:
        """(header, cell(metrics) -> str) for this kind in ``layout``."""
        if self.kind == "stream":
            get, qs = (lambda m, k, q: getattr(m.dists[k], q)), ("p50", "p95", "p99")
        elif self.kind == "serve":  # its percentiles are --metric-percentiles: p50 and the highest asked
            top = next((pct_key(max(m.percentiles)) for _, _, m in self.rows if m is not None), "p99")
            get, qs = (lambda m, k, q: _p(m.dists[k], q)), ("p50", top)
        else:  # sched runs keep p50 and p99
            get, qs = (lambda m, k, q: getattr(m, f"{k}_{q}")), ("p50", "p99")
        if layout != "p50/p95/p99":
            qs = (qs[0], qs[-1])
        two = layout == "two-line"

        def dist(name: str, key: str) -> tuple[str, Callable]:
            if two:
                return f"{name} ms\n{qs[0]}\n{qs[1]}", lambda m: "\n".join(_ms(get(m, key, q)) for q in qs)
            return f"{name} {'/'.join(qs)} ms", lambda m: "/".join(_ms(get(m, key, q)) for q in qs)

        if self.kind == "stream":
            return [("tok/s" if two else "tok/s (compl)", lambda m: f"{m.throughput_completion:,.0f}"),
                    *[dist(n, k) for n, k in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"),
                                              ("Latency", "latency"))]]
        if self.kind == "serve":
            return [("ok/failed", lambda m: f"{m.completed}/{m.failed}"),
                    ("req/s", lambda m: f"{m.throughput_requests:,.2f}"),
                    ("tok/s" if two else "tok/s (out)", lambda m: f"{m.throughput_completion:,.0f}"),
                    *[dist(n, k) for n, k in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"),
                                              ("E2EL", "latency"))]]
        return [("decode s", lambda m: f"{m.decode_s:.3f}"), ("total s", lambda m: f"{m.total_s:.3f}"),
                ("tok/s\ndecode" if two else "tok/s (compl,decode)", lambda m: f"{m.throughput_decode:,.0f}"),
                ("tok/s\ntotal" if two else "tok/s (compl,total)", lambda m: f"{m.throughput_total:,.0f}"),
                dist("TTFT", "ttft"), dist("TPOT", "tpot")]

    def _render(self, layout: str) -> Table:
        table = Table(title=self.title or None, title_justify="left", caption=self.progress or None,
                      caption_justify="left", box=box.SIMPLE_HEAD if layout == "two-line" else box.HEAVY_HEAD)
        cols = self._columns(layout) + self._roofline_columns()
        table.add_column("run", justify="left", no_wrap=True)
        for header, _ in cols:
            table.add_column(header, justify="right", no_wrap=True)
        for label, warmup, m in self.rows:
            name = label if (not warmup or "warmup" in label) else f"{label} (warmup)"
            style = "dim" if warmup else None
            if m is None:
                table.add_row(name, *["…"] + [""] * (len(cols) - 1), style=style)
            else:
                table.add_row(name, *[cell(m) for _, cell in cols], style=style)
        return table

    def _roofline_columns(self) -> list[tuple[str, Callable]]:
        """Each run's decode read rate and its share of the device's read ceiling, when a run has them."""
        if not any(getattr(m, "roofline", None) is not None for _, _, m in self.rows):
            return []

        def cell(m) -> str:
            r = getattr(m, "roofline", None)
            return "-" if r is None or not math.isfinite(r.share) else f"{r.gbs:,.0f} ({r.share * 100:.0f}%)"

        return [("GB/s (% ceil)", cell)]


def _runs(n: int) -> str:
    return f"{n} measured run{'s' if n != 1 else ''}"


def stream_summary_lines(summary: dict, measured_runs: int) -> list[str]:
    """The median over measured runs (``summary`` = `metrics.median_run`), posts' format."""
    lines = [f"=== summary: median of {_runs(measured_runs)} ===", f"Measured runs: {measured_runs}"]
    for k in STREAM_FIGURES:
        vals = [summary.get(f"{k}_p{q}") for q in (50, 95, 99)]
        if all(_absent(v) for v in vals):
            continue
        lines.append(f"{_PLAIN_LABELS[k]} p50/p95/p99: {'/'.join(_ms(v) for v in vals)}"
                     f"{' ms/token' if k == 'tpot' else ' ms'}")
    lines.append(f"Throughput (completion,total): {summary['throughput_completion']:.2f} tokens/s")
    lines.append(f"Throughput (prompt+completion,total): {summary['throughput_total']:.2f} tokens/s")
    return lines


def against_direct_line(summary: dict) -> Optional[str]:
    """With `bench stream --against-direct`: the streaming manager's overhead on throughput."""
    direct, managed = summary.get("throughput_direct"), summary.get("throughput_completion")
    if _absent(direct) or _absent(managed) or not managed:
        return None
    return (f"Against the scheduler directly: {direct:.2f} tokens/s direct, {managed:.2f} through the streaming "
            f"manager, overhead {(direct / managed - 1) * 100:.1f}%")


def print_stream_summary(console: Console, measured: Sequence[RunMetrics], summary: dict,
                         plain: Optional[bool] = None) -> None:
    """Median over the measured runs of each figure (``summary`` from `metrics.median_run`)."""
    n = len(measured)
    if _is_plain(console, plain):
        for line in stream_summary_lines(summary, n):
            _emit(console, line)
        return
    table = Table(title=f"Summary: median of {_runs(n)}", title_justify="left")
    for c in ("figure", "p50", "p95", "p99", "unit"):
        table.add_column(c, justify="left" if c in ("figure", "unit") else "right")
    for k in STREAM_FIGURES:
        vals = [summary.get(f"{k}_p{q}") for q in (50, 95, 99)]
        if not all(_absent(v) for v in vals):
            table.add_row(FIGURE_LABELS[k], *[_ms(v) for v in vals], "ms/token" if k == "tpot" else "ms")
    console.print(table)
    console.print(Text(f"Throughput (completion,total): {summary['throughput_completion']:,.2f} tokens/s\n"
                       f"Throughput (prompt+completion,total): {summary['throughput_total']:,.2f} tokens/s",
                       style="bold"))


_SCHED_NAMES = {"decode_s": ("Decode time", "s"), "prefill_s": ("Prefill time", "s"), "total_s": ("Total time", "s"),
                "throughput_decode": ("Throughput(completion,decode)", "tokens/s"),
                "throughput_total": ("Throughput(completion,total)", "tokens/s"),
                "ttft_p50": ("TTFT", "ms"), "tpot_p50": ("TPOT", "ms/token"), "latency_p50": ("Latency", "ms"),
                "ttft_p99": ("TTFT p99", "ms"), "tpot_p99": ("TPOT p99", "ms/token"),
                "latency_p99": ("Latency p99", "ms")}
_SCHED_ORDER = ("decode_s", "total_s", "throughput_decode", "throughput_total", "ttft_p50", "tpot_p50", "latency_p50",
                "prefill_s", "ttft_p99", "tpot_p99", "latency_p99")  # the posts' order, then the additions


def _sched_value(unit: str, v: float) -> str:
    if unit == "s":
        return f"{v:.6f}"
    return f"{v * 1e3:.2f}" if unit.startswith("ms") else f"{v:.2f}"


def sched_summary_lines(mode: str, warmups: int, summary: dict[str, tuple[float, float]],
                        measured_runs: Optional[int] = None) -> list[str]:
    """The posts' ``=== online summary ===`` block: ``<figure> p50/mean: a/b unit`` over
    measured runs (``summary`` from `metrics.summarize_sched_runs`)."""
    lines = [f"=== {mode} summary ===", f"Warmup runs: {warmups}"]
    if measured_runs is not None:
        lines.append(f"Measured runs: {measured_runs}")
    for key in _SCHED_ORDER:
        if key not in summary:
            continue
        label, unit = _SCHED_NAMES[key]
        p50, mean = summary[key]
        lines.append(f"{label} p50/mean: {_sched_value(unit, p50)}/{_sched_value(unit, mean)} {unit}")
    return lines


def print_sched_summary(console: Console, mode: str, warmups: int, summary: dict[str, tuple[float, float]],
                        measured_runs: Optional[int] = None, plain: Optional[bool] = None) -> None:
    if _is_plain(console, plain):
        for line in sched_summary_lines(mode, warmups, summary, measured_runs):
            _emit(console, line)
        return
    runs = "" if measured_runs is None else f", {_runs(measured_runs)}"
    table = Table(title=f"{mode} summary ({warmups} warmup{'s' if warmups != 1 else ''}{runs})",
                  title_justify="left")
    for c in ("figure", "p50", "mean", "unit"):
        table.add_column(c, justify="left" if c in ("figure", "unit") else "right")
    for key in _SCHED_ORDER:
        if key in summary:
            label, unit = _SCHED_NAMES[key]
            table.add_row(label, *[_sched_value(unit, v) for v in summary[key]], unit)
    console.print(table)


def _fmt(unit: str, v: Optional[float], signed: bool = False) -> str:
    if _absent(v):
        return "-"
    scale = 1e3 if unit == "ms" else 1e-6 if unit == "MB" else 1.0
    digits = 6 if unit == "s" else 2
    return f"{v * scale:{'+' if signed else ''},.{digits}f}"


def _change(row: CompareRow, cell) -> str:
    if cell.change is None:
        return "-"
    pct = "" if cell.percent is None else f", {cell.percent:+.1f}%"
    return f"{_fmt(row.unit, cell.change, signed=True)}{pct}"


def _ci(row: CompareRow, cell) -> str:
    """The change's confidence interval, ``[-1.20, +0.40]`` in the row's unit."""
    if cell.ci_low is None:
        return "-"
    return f"[{_fmt(row.unit, cell.ci_low, signed=True)}, {_fmt(row.unit, cell.ci_high, signed=True)}]"


def _compare_note(confidence: float) -> str:
    return (f"interval: {confidence:.0%} bootstrap interval of the change (per-request figures from the raw "
            "samples, others from the repeat runs); noise: it contains 0; n/a: no raw samples and one measured "
            "run, not judged")


def print_compare(console: Console, names: Sequence[str], rows: Sequence[CompareRow],
                  differences: Optional[dict[str, list]] = None, plain: Optional[bool] = None,
                  confidence: float = 0.95) -> None:
    """``rows`` from `compare.compare_results`; ``names[0]`` is the baseline. ``differences``
    (`compare.config_differences`) are listed first: they make a comparison not like for like."""
    plain = _is_plain(console, plain)
    differences = differences or {}
    if plain:
        _emit(console, f"=== compare: baseline {names[0]}; {', '.join(names[1:])} ===")
        for k, vals in differences.items():
            _emit(console, f"Differs: {k}: {' | '.join(str(v) for v in vals)}")
        for r in rows:
            parts = [f"{_fmt(r.unit, c.value)} ({_change(r, c)}, {_ci(r, c)}, {c.verdict})" for c in r.cells]
            _emit(console, f"{r.label}: {_fmt(r.unit, r.base)} -> {' | '.join(parts)} {r.unit}")
        _emit(console, _compare_note(confidence))
        return
    if differences:
        diff = Table(title="Not like for like: these differ", title_justify="left")
        diff.add_column("option")
        for n in names:
            diff.add_column(n)
        for k, vals in differences.items():
            diff.add_row(k, *[str(v) for v in vals])
        console.print(diff)
    table = Table(title=f"Compared with {names[0]} (median of measured runs)", title_justify="left")
    table.add_column("figure")
    table.add_column("unit")
    table.add_column(names[0], justify="right")
    for n in names[1:]:
        table.add_column(n, justify="right")
        table.add_column("change", justify="right")
        table.add_column(f"{confidence:.0%} interval", justify="right")
        table.add_column("", justify="left")
    for r in rows:
        cells = []
        for c in r.cells:
            cells += [_fmt(r.unit, c.value), _change(r, c), _ci(r, c),
                      Text(c.verdict, style=_VERDICT_STYLE.get(c.verdict, ""))]
        table.add_row(r.label, r.unit, _fmt(r.unit, r.base), *cells)
    console.print(table)
    console.print(Text(_compare_note(confidence), style="dim"))


# --- `bench serve` ------------------------------------------------------------------------------

def _p(d, q: str) -> Optional[float]:
    return d.pcts.get(q)


def serve_warmup_line(m: ServeRunMetrics) -> str:
    return (f"warmup (not measured): {m.completed} ok, {m.failed} failed, {m.completion_tokens} tokens in "
            f"{m.wall_s:.3f} s, {m.throughput_completion:.2f} tokens/s, TTFT p50 {_ms(_p(m.dists['ttft'], 'p50'))} ms, "
            f"TPOT p50 {_ms(_p(m.dists['tpot'], 'p50'))} ms/token")


def _serve_dist_line(name: str, pcts: Sequence[str], vals: Sequence[Optional[float]], mean, std) -> str:
    unit = " ms/token" if name == "tpot" else " ms"
    return (f"{SERVE_LABELS[name]} {'/'.join(pcts)}: {'/'.join(_ms(v) for v in vals)}{unit} "
            f"(mean {_ms(mean)}, std {_ms(std)})")


def serve_lines(m: ServeRunMetrics) -> list[str]:
    """One measured serve run, in the stream runs' line format (figures with no samples left out)."""
    keys = [pct_key(q) for q in m.percentiles]
    lines = [f"Requests: {m.requests} ({m.completed} completed, {m.failed} failed)",
             f"Prompt tokens (total): {m.prompt_tokens}", f"Completion tokens (total): {m.completion_tokens}"]
    for k in SERVE_FIGURES:
        d = m.dists[k]
        if d.count == 0 or (k == "client_queue" and not d.mean > 0):
            continue
        line = _serve_dist_line(k, keys, [d.pcts[q] for q in keys], d.mean, d.std)
        if k == "tpot" and m.tpot_left_out:
            line += f" ({m.tpot_left_out} one-token request{'s' if m.tpot_left_out != 1 else ''} left out)"
        lines.append(line)
    lines.append(f"Request throughput: {m.throughput_requests:.2f} req/s")
    if not _absent(m.goodput_requests):
        lines.append(f"Request goodput: {m.goodput_requests:.2f} req/s ({100 * m.goodput_share:.1f}% of requests "
                     "met every SLO)")
    lines.append(f"Throughput (completion,total): {m.throughput_completion:.2f} tokens/s")
    lines.append(f"Throughput (prompt+completion,total): {m.throughput_total:.2f} tokens/s")
    lines.append(f"Peak output throughput (1 s window): {m.peak_output:.2f} tokens/s; peak concurrent requests: "
                 f"{m.peak_concurrency}")
    if not _absent(m.achieved_rate):
        lines.append(f"Request rate: target {m.target_rate:.2f}, achieved {m.achieved_rate:.2f} req/s")
    lines.append(f"Wall: {m.wall_s:.6f} s")
    lines += serve_warnings(m)
    return lines + attached_lines(m)


CLIENT_BUSY = 0.9  # client CPU time / duration from which a run warns that the client may be the bottleneck


def serve_warnings(m: ServeRunMetrics) -> list[str]:
    out = []
    if m.short_outputs:
        out.append(f"Short outputs: {m.short_outputs} of {m.completed} completed requests returned fewer tokens than "
                   "asked although ignore_eos/min_tokens were sent (the server ignored them)")
    if m.usage_missing:
        out.append(f"No usage: {m.usage_missing} requests ended without a usage event; their output tokens are "
                   "counted as events with text (an estimate)")
    if m.client_cpu >= CLIENT_BUSY:
        out.append(f"Client busy: this client used {100 * m.client_cpu:.0f}% of a core over the run; it may be what "
                   "limits these figures (--client-processes N, fewer concurrent streams, or a less loaded machine)")
    return out


def _row(label: str, value) -> str:
    return f"{label:<40} {value}"


def serve_summary_lines(measured: Sequence[ServeRunMetrics], summary: dict, info: dict) -> list[str]:
    """vLLM's result block (``vllm bench serve`` prints the same names), over the measured runs:
    counts are totals, figures the median of the runs' figures. ``info``: max_concurrency,
    request_rate."""
    n = len(measured)
    pcts = measured[0].percentiles if measured else ()
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _row("Measured runs (figures: their median):", n)]
    lines.append(_row("Successful requests:", sum(m.completed for m in measured)))
    lines.append(_row("Failed requests:", sum(m.failed for m in measured)))
    if info.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", info["max_concurrency"]))
    rate = info.get("request_rate")
    if rate is not None and math.isfinite(rate):
        lines.append(_row("Request rate configured (RPS):", f"{rate:.2f}"))
        lines.append(_row("Request rate achieved (RPS):", _num(summary.get("throughput_achieved_rate"))))
    lines.append(_row("Benchmark duration (s):", _num(summary.get("wall_s"))))
    lines.append(_row("Total input tokens:", sum(m.prompt_tokens for m in measured)))
    lines.append(_row("Total generated tokens:", sum(m.completion_tokens for m in measured)))
    lines.append(_row("Request throughput (req/s):", _num(summary.get("throughput_requests"))))
    if "throughput_goodput" in summary:
        lines.append(_row("Request goodput (req/s):", _num(summary.get("throughput_goodput"))))
        lines.append(_row("Requests meeting every SLO (%):", _num(100 * summary["goodput_share"]
                                                                   if not _absent(summary.get("goodput_share"))
                                                                   else None)))
    lines.append(_row("Output token throughput (tok/s):", _num(summary.get("throughput_completion"))))
    lines.append(_row("Peak output token throughput (tok/s):", _num(summary.get("throughput_peak_output"))))
    lines.append(_row("Peak concurrent requests:", max((m.peak_concurrency for m in measured), default=0)))
    lines.append(_row("Total token throughput (tok/s):", _num(summary.get("throughput_total"))))
    if not _absent(summary.get("client_cpu_share")):
        lines.append(_row("Client CPU busy (% of one core):", _num(100 * summary["client_cpu_share"])))
    if not _absent(summary.get("client_cpu_total_share")):
        lines.append(_row("Client CPU, all processes (% of a core):", _num(100 * summary["client_cpu_total_share"])))
    headers = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
               "itl": "Inter-token Latency", "latency": "End-to-end Latency", "client_queue": "Client-side Queueing",
               "dispatch_lag": "Client dispatch lag (late vs schedule)"}
    for k in SERVE_FIGURES:
        if _absent(summary.get(f"{k}_mean")):
            continue
        if k == "client_queue" and info.get("max_concurrency") is None:
            continue
        name = SERVE_LABELS[k]
        lines.append("{s:{c}^{n}}".format(s=headers[k], n=50, c="-"))
        lines.append(_row(f"Mean {name} (ms):", _ms(summary.get(f"{k}_mean"))))
        lines.append(_row(f"Median {name} (ms):", _ms(summary.get(f"{k}_p50"))))
        lines.append(_row(f"Std {name} (ms):", _ms(summary.get(f"{k}_std"))))
        for q in pcts:
            key = pct_key(q)
            lines.append(_row(f"{key.upper()} {name} (ms):", _ms(summary.get(f"{k}_{key}"))))
    lines.append("=" * 50)
    for m in measured:
        for w in serve_warnings(m):
            if w not in lines:
                lines.append(w)
    return lines


def _num(v) -> str:
    return "-" if _absent(v) else f"{v:.2f}"


def print_serve_summary(console: Console, measured: Sequence[ServeRunMetrics], summary: dict, info: dict) -> None:
    """The same block in a terminal and in a pipe: it is what users grep and paste beside vLLM's."""
    for line in serve_summary_lines(measured, summary, info):
        _emit(console, line)


def print_goodput(console: Console, summary: dict, slo: dict) -> None:
    """`bench stream --goodput`: one line, median over the measured runs."""
    slos = ", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in slo.items())
    share = summary.get("goodput_share")
    _emit(console, f"Request goodput ({slos}): {summary.get('throughput_goodput', float('nan')):.2f} req/s, "
                   f"{'-' if _absent(share) else f'{100 * share:.1f}%'} of requests met every SLO")
