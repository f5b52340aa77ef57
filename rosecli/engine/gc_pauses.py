"""Python's cyclic garbage collector in a long-running engine: freeze what start-up made, and say
when a collection stalls the process.

A full (generation 2) collection walks every tracked object; after start-up that is hundreds of
thousands (torch, the tokenizer's vocabulary, compiled kernels' metadata) and a walk takes tens of
milliseconds, during which no step is launched and no token streamed. `freeze_startup` moves the
objects alive at the end of start-up to the permanent generation, so later collections walk only
what serving itself made (vLLM and SGLang do the same). `GcPauses` times every collection through
``gc.callbacks`` (two clock reads per collection) and logs the ones over a threshold; its
counts are what ``/metrics`` reports.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger("rosecli.gc")

DEFAULT_WARN_MS = 20.0


def freeze_startup() -> int:
    """Collect once, then freeze every surviving object (never walked again). Returns how many
    objects were frozen. ``ROSE_GC_FREEZE=0`` leaves the collector as it is (returns 0).

    The process unfreezes them at exit (`atexit`): frozen objects are never collected, not even by the
    interpreter's last collection, so one that became garbage (in a cycle) was never finalized, and
    the native libraries' objects among them were reported as leaked (nanobind printed some 27 lines
    of "leaked ..." for Triton's when the server stopped)."""
    if os.environ.get("ROSE_GC_FREEZE", "1").strip() == "0":
        return 0
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # (once, however often start-up froze)
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


@dataclass(frozen=True)
class GcInterval:
    """The collections between two `GcPauses.take` calls: how many (all generations), how many full (generation
    2: the ones that walk every tracked object), and the time they held the process, in all and the longest."""

    collections: int
    full: int
    paused_s: float
    longest_s: float

    @classmethod
    def together(cls, intervals) -> "GcInterval":
        """Several intervals as one: their counts and pause times summed, the longest pause of all."""
        xs = list(intervals)
        return cls(sum(x.collections for x in xs), sum(x.full for x in xs), sum(x.paused_s for x in xs),
                   max((x.longest_s for x in xs), default=0.0))

    def figures(self) -> dict[str, float]:
        """Flat figures for result files (times in seconds, as every other figure)."""
        return {"gc_collections": self.collections, "gc_full_collections": self.full, "gc_pause_s": self.paused_s,
                "gc_longest_pause_s": self.longest_s}


def gc_line(figures: dict, what: str = "GC pauses") -> Optional[str]:
    """``GC pauses: 14 collections (1 full), 9.84 ms in all, longest 9.10 ms`` from `GcInterval.figures`; None
    when the figures are absent."""
    try:
        n, full = figures["gc_collections"], figures["gc_full_collections"]
        paused, longest = figures["gc_pause_s"], figures["gc_longest_pause_s"]
    except KeyError:
        return None
    return (f"{what}: {n:g} collection{'' if n == 1 else 's'} ({full:g} full), {paused * 1e3:.2f} ms in all, "
            f"longest {longest * 1e3:.2f} ms")


class GcPauses:
    """Times each collection of this process. ``on_pause(generation, seconds, collected)`` is called
    after every collection (from whichever thread triggered it: keep it cheap); pauses of at least
    ``warn_ms`` are logged. Install once; `close` removes the hook."""

    def __init__(self, warn_ms: float = DEFAULT_WARN_MS,
                 on_pause: Optional[Callable[[int, float, int], None]] = None):
        self.warn_s = warn_ms / 1000
        self.on_pause = on_pause
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_s = 0.0
        self._t0 = threading.local()
        self._taken = (0, 0, 0.0)  # collections, full ones, seconds at the last take()
        self._longest_since = 0.0
        gc.callbacks.append(self._hook)

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0.t = time.perf_counter()
            return
        t0 = getattr(self._t0, "t", None)
        if t0 is None:
            return
        dt = time.perf_counter() - t0
        self._t0.t = None
        g = min(2, int(info.get("generation", 0)))
        self.count[g] += 1
        self.seconds[g] += dt
        self.longest_s = max(self.longest_s, dt)
        self._longest_since = max(self._longest_since, dt)
        if self.on_pause is not None:
            self.on_pause(g, dt, int(info.get("collected", 0)))
        if dt >= self.warn_s:
            log.warning("garbage collection (generation %d) paused the process for %.0f ms (%d objects freed)",
                        g, dt * 1000, int(info.get("collected", 0)))

    def take(self) -> GcInterval:
        """The collections since the last call (or since this watch was installed)."""
        now = (sum(self.count), self.count[2], sum(self.seconds))
        out = GcInterval(now[0] - self._taken[0], now[1] - self._taken[1], now[2] - self._taken[2],
                         self._longest_since)
        self._taken, self._longest_since = now, 0.0
        return out

    def close(self) -> None:
        if self._hook in gc.callbacks:
            gc.callbacks.remove(self._hook)
