"""Named stages of an engine step: NVTX ranges, torch-profiler ranges and host timing.

``stages.range("decode_forward", n)`` returns one shared no-op context when all three are off:
no string is formatted, nothing is allocated and NVTX is never called. When NVTX is on, the
count goes into the range name (``decode_forward n=64``); host time is taken with
``perf_counter_ns`` and kept per stage.

Where each stage runs: ``scheduler_step`` encloses ``prefill_admission``, ``prepare_inputs``,
``h2d_copy``, ``prefill_forward`` / ``decode_forward``, ``sampling`` and ``d2h_copy`` (the last
waits for the GPU, so it holds the device time the host did not overlap; with overlap scheduling
a decode step's ``d2h_copy`` waits for the step launched before it; on a GPU a decode step queues no copy,
`kernels.stage_inputs`, so its ``h2d_copy`` is the host handing the step's inputs over). The streaming manager's
``detokenize_fanout`` and ``stream_flush`` follow each step.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Optional

INSIDE_STEP = ("prefill_admission", "prepare_inputs", "h2d_copy", "prefill_forward", "decode_forward",
               "sampling", "d2h_copy")

_NULL = nullcontext()


class _Range:
    __slots__ = ("stages", "name", "label", "t0", "rf")

    def __init__(self, stages: "Stages", name: str, label: Optional[str]):
        self.stages = stages
        self.name = name
        self.label = label
        self.rf = None

    def __enter__(self):
        st = self.stages
        if st.nvtx:
            st._nvtx.range_push(self.label)
        if st.torch_trace:
            self.rf = st._record_function(self.name)
            self.rf.__enter__()
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        dt = time.perf_counter_ns() - self.t0
        st = self.stages
        if self.rf is not None:
            self.rf.__exit__(None, None, None)
        if st.nvtx:
            st._nvtx.range_pop()
        if st.timing:
            st.samples.setdefault(self.name, []).append(dt)
        return False


class Stages:
    def __init__(self, nvtx: bool = False, timing: bool = False, torch_trace: bool = False):
        self.nvtx = nvtx
        self.timing = timing
        self.torch_trace = torch_trace
        self.samples: dict[str, list[int]] = {}
        self._nvtx = None
        self._record_function = None
        if nvtx:
            import torch.cuda.nvtx as _nvtx  # imported only when asked for

            self._nvtx = _nvtx
        if torch_trace:
            self.enable_torch_trace(True)

    def enable_torch_trace(self, on: bool) -> None:
        """Also open a torch-profiler range (same names) per stage, while a trace is recorded."""
        if on and self._record_function is None:
            from torch.profiler import record_function

            self._record_function = record_function
        self.torch_trace = on

    def range(self, name: str, count: Optional[int] = None):
        if not (self.nvtx or self.timing or self.torch_trace):
            return _NULL
        label = None
        if self.nvtx:
            label = name if count is None else f"{name} n={count}"
        return _Range(self, name, label)

    def reset(self) -> None:
        self.samples = {}


def stage_table(samples: dict[str, list[int]]) -> list[dict]:
    """Rows of (stage, count, total ms, mean us, p99 us, share of loop time).

    Loop time = scheduler_step + detokenize_fanout + stream_flush. Stages nested in the step are
    listed with the step's own remainder as ``scheduler (other)``, so the shares add up to 100%.
    """
    import numpy as np

    def row(name, values):
        arr = np.asarray(values, dtype=np.float64) / 1e3  # us
        return {"stage": name, "count": int(arr.size), "total_ms": float(arr.sum() / 1e3),
                "mean_us": float(arr.mean()) if arr.size else 0.0,
                "p99_us": float(np.percentile(arr, 99)) if arr.size else 0.0}

    rows = [row(n, samples.get(n, [])) for n in INSIDE_STEP]
    step_total = sum(samples.get("scheduler_step", [])) / 1e6
    inner = sum(r["total_ms"] for r in rows)
    other = row("scheduler (other)", [])
    other["total_ms"] = max(0.0, step_total - inner)
    other["count"] = len(samples.get("scheduler_step", []))
    other["mean_us"] = other["total_ms"] * 1e3 / other["count"] if other["count"] else 0.0
    rows.append(other)
    rows += [row(n, samples.get(n, [])) for n in ("detokenize_fanout", "stream_flush")]
    loop = sum(r["total_ms"] for r in rows)
    for r in rows:
        r["share"] = r["total_ms"] / loop if loop else 0.0
    return rows
