"""Benchmark output: a Rich live table while runs are in progress (a row per warm-up and per
measured run), a summary over measured runs, and, when stdout is not a terminal, plain text
in the reference posts' format (``TTFT p50/p95/p99: a/b/c ms``) with no escape codes."""

from __future__ import annotations

from typing import Optional

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from rosecli.bench.metrics import FIGURE_LABELS, STREAM_FIGURES, RunMetrics, SchedRunMetrics

_PLAIN_LABELS = dict(FIGURE_LABELS, queue_wait="Queue wait (post-tok)")


def _ms(v: float) -> str:
    return "-" if v != v else f"{v * 1e3:.2f}"


def _triple(d) -> str:
    return f"{_ms(d.p50)}/{_ms(d.p95)}/{_ms(d.p99)}"


def header_lines(info: dict) -> list[str]:
    return [f"{k}: {v}" for k, v in info.items()]


def startup_line(startup: dict) -> str:
    parts = [f"{k.removesuffix('_s').replace('_', ' ')} {v:.2f} s" for k, v in startup.items()]
    return "Start-up (not in any run): " + (", ".join(parts) if parts else "-")


class RunTable:
    """Rows of runs; live in a terminal, plain lines otherwise. Use as a context manager."""

    def __init__(self, console: Console, kind: str, title: str):
        self.console = console
        self.kind = kind  # "stream" | "sched"
        self.plain = not console.is_terminal
        self.title = title
        self.rows: list[tuple[str, bool, Optional[object]]] = []
        self.progress: Optional[str] = None
        self.live: Optional[Live] = None

    def __enter__(self):
        if not self.plain:
            self.live = Live(self._render(), console=self.console, refresh_per_second=8, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.progress = None
            self.live.update(self._render())
            self.live.__exit__(*exc)
        return False

    def start_run(self, label: str, warmup: bool) -> None:
        self.rows.append((label, warmup, None))
        self.progress = "starting"
        if self.plain:
            self.console.print(f"=== {label} ===", highlight=False)
        else:
            self.live.update(self._render())

    def update(self, finished: int, total: int, tokens: int, elapsed: float) -> None:
        if self.plain:
            return
        rate = tokens / elapsed if elapsed > 0 else 0.0
        self.progress = f"{finished}/{total} done, {tokens} tokens, {rate:,.0f} tok/s, {elapsed:.1f} s"
        self.live.update(self._render())

    def finish_run(self, metrics) -> None:
        label, warmup, _ = self.rows[-1]
        self.rows[-1] = (label, warmup, metrics)
        self.progress = None
        if self.plain:
            lines = stream_lines(metrics) if self.kind == "stream" else sched_lines(metrics)
            for line in lines:
                self.console.print(line, highlight=False)
        else:
            self.live.update(self._render())

    def _render(self):
        table = Table(title=self.title, title_justify="left")
        if self.kind == "stream":
            cols = ["run", "tok/s (compl)", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms",
                    "Latency p50/p99 ms"]
        else:
            cols = ["run", "decode s", "total s", "tok/s (compl,decode)", "tok/s (compl,total)", "TTFT p50 ms",
                    "TPOT p50 ms"]
        for c in cols:
            table.add_column(c, justify="left" if c == "run" else "right")
        for label, warmup, m in self.rows:
            name = f"{label} (warmup)" if warmup else label
            style = "dim" if warmup else None
            if m is None:
                table.add_row(name, self.progress or "", *[""] * (len(cols) - 2), style=style)
            elif self.kind == "stream":
                d = m.dists
                table.add_row(name, f"{m.throughput_completion:,.0f}",
                              *[f"{_ms(d[k].p50)}/{_ms(d[k].p99)}" for k in ("ttft", "tpot", "itl", "latency")],
                              style=style)
            else:
                table.add_row(name, f"{m.decode_s:.3f}", f"{m.total_s:.3f}", f"{m.throughput_decode:,.0f}",
                              f"{m.throughput_total:,.0f}", _ms(m.ttft_p50 if m.ttft_p50 is not None else float("nan")),
                              _ms(m.tpot_p50 if m.tpot_p50 is not None else float("nan")), style=style)
        return Group(table)


def stream_lines(m: RunMetrics) -> list[str]:
    lines = [f"Requests: {m.requests}", f"Prompt tokens (total): {m.prompt_tokens}",
             f"Completion tokens (total): {m.completion_tokens}", f"Submit wall: {m.submit_wall_s:.6f} s"]
    for k in STREAM_FIGURES:
        unit = " ms/token" if k == "tpot" else " ms"
        lines.append(f"{_PLAIN_LABELS[k]} p50/p95/p99: {_triple(m.dists[k])}{unit}")
    lines.append(f"Throughput (completion,total): {m.throughput_completion:.2f}/{m.throughput_total:.2f} tokens/s")
    if m.errors:
        lines.append(f"Errors: {m.errors}")
    return lines


def sched_lines(m: SchedRunMetrics) -> list[str]:
    lines = [f"Decode time: {m.decode_s:.6f} s", f"Total time: {m.total_s:.6f} s",
             f"Throughput(completion,decode): {m.throughput_decode:.2f} tokens/s",
             f"Throughput(completion,total): {m.throughput_total:.2f} tokens/s"]
    if m.ttft_p50 is not None:
        lines += [f"TTFT p50: {_ms(m.ttft_p50)} ms", f"TPOT p50: {_ms(m.tpot_p50)} ms/token",
                  f"Latency p50: {_ms(m.latency_p50)} ms"]
    return lines


def print_stream_summary(console: Console, measured: list[RunMetrics], summary: dict) -> None:
    """Median over measured runs of each figure (and the spread between runs)."""
    n = len(measured)
    if not console.is_terminal:
        console.print(f"=== summary: median of {n} measured run{'s' if n != 1 else ''} ===", highlight=False)
        for k in STREAM_FIGURES:
            vals = "/".join(_ms(summary[f"{k}_p{q}"]) for q in (50, 95, 99))
            unit = " ms/token" if k == "tpot" else " ms"
            console.print(f"{_PLAIN_LABELS[k]} p50/p95/p99: {vals}{unit}", highlight=False)
        console.print(f"Throughput (completion,total): {summary['throughput_completion']:.2f}/"
                      f"{summary['throughput_total']:.2f} tokens/s", highlight=False)
        return
    table = Table(title=f"Summary: median of {n} measured run{'s' if n != 1 else ''}", title_justify="left")
    for c in ("figure", "p50 ms", "p95 ms", "p99 ms"):
        table.add_column(c, justify="left" if c == "figure" else "right")
    for k in STREAM_FIGURES:
        table.add_row(FIGURE_LABELS[k], *[_ms(summary[f"{k}_p{q}"]) for q in (50, 95, 99)])
    console.print(table)
    console.print(f"Throughput (completion, total): {summary['throughput_completion']:,.2f} / "
                  f"{summary['throughput_total']:,.2f} tokens/s")


def print_sched_summary(console: Console, mode: str, warmups: int, summary: dict[str, tuple[float, float]]) -> None:
    names = {"decode_s": ("Decode time", "s", 1.0), "total_s": ("Total time", "s", 1.0),
             "throughput_decode": ("Throughput(completion,decode)", "tokens/s", 1.0),
             "throughput_total": ("Throughput(completion,total)", "tokens/s", 1.0),
             "ttft_p50": ("TTFT", "ms", 1e3), "tpot_p50": ("TPOT", "ms/token", 1e3),
             "latency_p50": ("Latency", "ms", 1e3)}
    console.print(f"=== {mode} summary ===", highlight=False)
    console.print(f"Warmup runs: {warmups}", highlight=False)
    for key, (p50, mean) in summary.items():
        label, unit, scale = names[key]
        digits = 6 if unit == "s" else 2
        console.print(f"{label} p50/mean: {p50 * scale:.{digits}f}/{mean * scale:.{digits}f} {unit}", highlight=False)


def print_compare(console: Console, names: list[str], rows_per_file: list[list]) -> None:
    table = Table(title=f"Compared with {names[0]}", title_justify="left")
    table.add_column("figure")
    table.add_column(names[0], justify="right")
    for n in names[1:]:
        table.add_column(n, justify="right")
        table.add_column("change", justify="right")
    figures = [r.figure for r in rows_per_file[0]] if rows_per_file else []
    for i, fig in enumerate(figures):
        scale = 1.0 if fig.startswith("throughput") else 1e3
        fmt = (lambda v: f"{v * scale:,.2f}")
        cells = [fmt(rows_per_file[0][i].base)]
        for rows in rows_per_file:
            r = next((x for x in rows if x.figure == fig), None)
            if r is None:
                cells += ["-", "-"]
                continue
            cells += [fmt(r.other), f"{r.percent:+.1f}% {r.verdict}"]
        unit = "tok/s" if scale == 1.0 else "ms"
        table.add_row(f"{fig} ({unit})", *cells)
    console.print(table)
