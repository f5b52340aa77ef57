"""The live table of `rose bench sweep`: one row per point, added as each point finishes.

It takes the run-level calls the bench drivers make (`start_run`, `update`, `finish_run`, as
`report.RunTable`) and shows only the run in progress on the last line; a finished point's
row holds its summary (the median over its measured runs). In a terminal a Rich Live table
redrawn on the caller's thread at most every ``refresh_s``; otherwise (or ``plain=True``) one
plain line per finished point::

    Point rate 2: 1234.5 tokens/s, 2.00 req/s, TTFT p50/p99 12.30/45.60 ms, TPOT p50/p99 5.10/6.20 ms, goodput 100.0%
"""

from __future__ import annotations

import math
from typing import Optional

from rich.console import Console
from rich.table import Table

from rosecli.bench.report import LiveTable

COLUMNS = ("point", "tok/s (out)", "req/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms", "goodput")


def _ms(v) -> str:
    return "-" if not isinstance(v, (int, float)) or v is None or not math.isfinite(v) else f"{v * 1e3:.2f}"


def _num(v, fmt: str = ",.1f") -> str:
    return "-" if not isinstance(v, (int, float)) or v is None or not math.isfinite(v) else format(v, fmt)


def point_cells(summary: dict) -> list[str]:
    share = summary.get("goodput_share")
    return [_num(summary.get("throughput_completion")), _num(summary.get("throughput_requests"), ".2f"),
            *[f"{_ms(summary.get(f'{k}_p50'))}/{_ms(summary.get(f'{k}_p99'))}" for k in ("ttft", "tpot", "itl")],
            "-" if not isinstance(share, (int, float)) or share is None else f"{share:.1%}"]


def point_line(label: str, summary: dict) -> str:
    c = point_cells(summary)
    return (f"Point {label}: {c[0]} tokens/s, {c[1]} req/s, TTFT p50/p99 {c[2]} ms, TPOT p50/p99 {c[3]} ms, "
            f"ITL p50/p99 {c[4]} ms, goodput {c[5]}")


class SweepTable(LiveTable):
    def __init__(self, console: Console, title: str = "", plain: Optional[bool] = None, refresh_s: float = 0.25):
        self.console = console
        self.title = title
        self.plain = (not console.is_terminal) if plain is None else plain
        self.refresh_s = refresh_s
        self.rows: list[tuple[str, dict]] = []
        self.current: Optional[str] = None  # the point running
        self.run_label = ""
        self.progress = ""

    def table(self) -> Table:
        return self._render()

    def closing(self) -> None:
        self.current = None

    # --- points -------------------------------------------------------------------------------
    def start_point(self, label: str) -> None:
        self.current, self.run_label, self.progress = label, "", "starting"
        if self.plain:
            self.console.print(f"=== point {label} ===", highlight=False, markup=False, soft_wrap=True)
        self._draw(force=True)

    def finish_point(self, point) -> None:
        self.rows.append((point.label, point.summary))
        self.current = None
        if self.plain:
            self.console.print(point_line(point.label, point.summary), highlight=False, markup=False, soft_wrap=True)
        self._draw(force=True)

    # --- runs (the drivers' calls) --------------------------------------------------------------
    def start_run(self, label: str, warmup: bool) -> None:
        self.run_label, self.progress = label, "starting"
        self._draw(force=True)

    def progress_text(self, finished: int, total: int, tokens: int, rate: float, elapsed: float) -> str:
        return f"{finished}/{total} done, {rate:,.0f} tok/s, {elapsed:.1f} s"

    def finish_run(self, *args) -> None:
        self.progress = "done"
        self._draw(force=True)

    def _render(self) -> Table:
        table = Table(title=self.title or None, title_justify="left")
        for c in COLUMNS:
            table.add_column(c, justify="left" if c == "point" else "right")
        for label, summary in self.rows:
            table.add_row(label, *point_cells(summary))
        if self.current is not None:
            table.add_row(self.current, f"{self.run_label}: {self.progress}", *[""] * (len(COLUMNS) - 2), style="dim")
        return table
