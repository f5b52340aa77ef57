"""Charts of result files: latency against throughput (one series per file), and a run's step timeline.

- `terminal_chart`: text, drawn with plotext (``rose bench plot``, the end of a sweep).
- `write_png`: a PNG with matplotlib (``--plot FILE.png``).

Both need ``pip install 'rosecli[plot]'``; without it they raise one ConfigError line saying so
(`require`). Reading and printing a result file never needs them.

A series is one result file: each sweep point (or the one run of a single-run file) gives
output throughput (tokens/s) on x and TTFT / TPOT p50 and p99 (ms) on y, in order of throughput.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

from rosecli.engine.errors import ConfigError

FIGURES = (("ttft", "TTFT"), ("tpot", "TPOT"))
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
STATS = ("p50", "p99")


def require(module: str):
    """Import ``module`` (plotext / matplotlib) or raise the one-line install hint."""
    try:
        return __import__(module)
    except ImportError:
        raise ConfigError(f"charts need {module}: pip install 'rosecli[plot]'") from None


def _fresh(plt) -> None:
    """A blank plotext figure: its state is global, and clearing the active subplot leaves the others."""
    plt.main()
    plt.clear_figure()


@dataclass
class Series:
    name: str
    labels: list[str] = field(default_factory=list)  # the point of each x
    x: list[float] = field(default_factory=list)  # output throughput, tokens/s
    y: dict[str, list[Optional[float]]] = field(default_factory=dict)  # "ttft_p99" -> ms per point


def _ms(v) -> Optional[float]:
    return v * 1e3 if isinstance(v, (int, float)) and v is not None and math.isfinite(v) else None


def series_of(doc: dict, name: str) -> Series:
    """The latency-throughput series of one result document (a sweep, or a single run)."""
    from rosecli.bench.sweep import point_figures

    pts = []
    for label, _, summary in point_figures(doc):
        x = summary.get("throughput_completion")
        if isinstance(x, (int, float)) and math.isfinite(x):
            pts.append((x, label, summary))
    pts.sort(key=lambda p: p[0])
    s = Series(name)
    for x, label, summary in pts:
        s.x.append(x)
        s.labels.append(label)
        for fig, _ in FIGURES:
            for stat in STATS:
                s.y.setdefault(f"{fig}_{stat}", []).append(_ms(summary.get(f"{fig}_{stat}")))
    return s


def series_names(paths: Sequence[str]) -> list[str]:
    """File names without .json; the parent directory too where two names collide."""
    names = [os.path.basename(p).removesuffix(".json") for p in paths]
    if len(set(names)) < len(names):
        names = [os.path.join(os.path.basename(os.path.dirname(os.path.abspath(p))), n) for p, n in zip(paths, names)]
    return names


def _xy(s: Series, key: str) -> tuple[list, list]:
    pairs = [(x, y) for x, y in zip(s.x, s.y.get(key, [])) if y is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _panels(rows: int, width: int, height: int, color: bool):
    """plotext, reset, sized ``width`` x ``height`` with ``rows`` panels one above the other."""
    plt = require("plotext")
    _fresh(plt)
    plt.plotsize(width, height)
    if not color:
        plt.theme("clear")
    plt.subplots(rows, 1)
    return plt


def terminal_chart(series: Sequence[Series], width: int = 80, height: int = 36, color: bool = False) -> str:
    """TTFT and TPOT (p50 and p99, ms) against output throughput (tokens/s), one chart above the
    other, ``width`` columns wide; returned as text."""
    plt = _panels(len(FIGURES), width, height, color)
    for i, (fig, title) in enumerate(FIGURES, start=1):
        plt.subplot(i, 1)
        for s in series:
            for stat in STATS:
                xs, ys = _xy(s, f"{fig}_{stat}")
                if xs:
                    plt.plot(xs, ys, label=f"{s.name} {stat}"[:30], marker="dot" if stat == "p50" else "x")
        plt.title(f"{title} p50/p99 (ms) vs output throughput (tokens/s)")
    out = plt.build()
    _fresh(plt)
    return out if color else _ANSI.sub("", out)


def write_png(series: Sequence[Series], path: str) -> list[str]:
    """Two panels (TTFT, TPOT) of p50 (solid) and p99 (dashed) against throughput; returns the
    legend's labels, one per drawn line."""
    _check_png_path(path)
    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FIGURES), figsize=(12, 4.5))
    labels = []
    for ax, (name, title) in zip(axes, FIGURES):
        for i, s in enumerate(series):
            color = f"C{i % 10}"
            for stat, style in zip(STATS, ("-", "--")):
                xs, ys = _xy(s, f"{name}_{stat}")
                if xs:
                    label = f"{s.name} {stat}"
                    ax.plot(xs, ys, style, marker="o", color=color, label=label)
                    if ax is axes[0]:
                        labels.append(label)
        ax.set_title(f"{title} vs output throughput")
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise ConfigError(f"--plot {path}: cannot write it: {e.strerror}") from None
    finally:
        plt.close(fig)
    return labels


def _check_png_path(path: str) -> None:
    if not path.lower().endswith(".png"):
        raise ConfigError(f"--plot writes a PNG: give a file name ending in .png, got {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"--plot {path}: the directory {parent} does not exist")


# --- a run's step timeline (--timeline) -------------------------------------------------------------

TIMELINE_PANELS = (("running", "decode batch (sequences)"), ("tokens_in_flight", "tokens in flight"),
                   ("step_ms", "step time (ms)"), ("kv_blocks_used", "KV blocks used"),
                   ("preemptions", "preemptions"))


def timelines_of(doc: dict) -> list[tuple[str, dict]]:
    """(name, columns) of every recorded timeline in a result document."""
    out = []
    for i, tl in enumerate(doc.get("timelines") or []):
        out.append((f"run {i + 1}", tl))
    for p in doc.get("points") or []:
        for i, tl in enumerate(p.get("timeline") or []):
            out.append((f"{p.get('label', 'point')} run {i + 1}", tl))
    return [(n, tl) for n, tl in out if isinstance(tl, dict) and tl.get("t")]


def timeline_chart(cols: dict, width: int = 80, height: int = 60, color: bool = False) -> str:
    plt = _panels(len(TIMELINE_PANELS), width, height, color)
    for i, (key, title) in enumerate(TIMELINE_PANELS, start=1):
        plt.subplot(i, 1)
        plt.plot(cols["t"], cols[key], marker="braille")
        plt.title(f"{title} over time (s)")
    out = plt.build()
    _fresh(plt)
    return out if color else _ANSI.sub("", out)


def write_timeline_png(timelines: Sequence[tuple[str, dict]], path: str) -> list[str]:
    _check_png_path(path)
    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(TIMELINE_PANELS), 1, figsize=(10, 2.2 * len(TIMELINE_PANELS)), sharex=True)
    for ax, (key, title) in zip(axes, TIMELINE_PANELS):
        for name, cols in timelines:
            ax.plot(cols["t"], cols[key], label=name, linewidth=0.8)
        ax.set_ylabel(title, fontsize="small")
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("time since the run's first submit (s)")
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise ConfigError(f"--plot {path}: cannot write it: {e.strerror}") from None
    finally:
        plt.close(fig)
    return [name for name, _ in timelines]
