"""Named stages of an engine step: NVTX ranges and host timing, free when off.

``stages.range("decode")`` returns a shared no-op context when neither NVTX nor timing is on:
no string is formatted, nothing is allocated and NVTX is never called. Counts in range names
(``decode bs=64``) are formatted only when NVTX is on.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Optional

STAGE_NAMES = (
    "scheduler_step",
    "prefill_admission",
    "prepare_inputs",
    "h2d_copy",
    "prefill_forward",
    "decode_forward",
    "sampling",
    "d2h_copy",
    "detokenize_fanout",
    "stream_flush",
)

_NULL = nullcontext()


class _Range:
    __slots__ = ("stages", "name", "label", "t0")

    def __init__(self, stages: "Stages", name: str, label: Optional[str]):
        self.stages = stages
        self.name = name
        self.label = label

    def __enter__(self):
        if self.label is not None:
            self.stages._nvtx.range_push(self.label)
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        dt = time.perf_counter_ns() - self.t0
        if self.label is not None:
            self.stages._nvtx.range_pop()
        if self.stages.timing:
            self.stages.record(self.name, dt)
        return False


class Stages:
    def __init__(self, nvtx: bool = False, timing: bool = False):
        self.nvtx = nvtx
        self.timing = timing
        self.samples: dict[str, list[int]] = {}
        self._nvtx = None
        if nvtx:
            import torch.cuda.nvtx as _nvtx  # imported only when asked for
            self._nvtx = _nvtx

    @property
    def enabled(self) -> bool:
        return self.nvtx or self.timing

    def range(self, name: str, count: Optional[int] = None):
        if not (self.nvtx or self.timing):
            return _NULL
        label = None
        if self.nvtx:
            label = name if count is None else f"{name} n={count}"
        return _Range(self, name, label)

    def record(self, name: str, duration_ns: int) -> None:
        self.samples.setdefault(name, []).append(duration_ns)

    def reset(self) -> None:
        self.samples = {}
