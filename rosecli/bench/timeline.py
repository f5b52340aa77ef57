"""A per-step timeline of one run (`--timeline`): what each scheduler step did, over time.

Recorded only when asked: `StepTimeline.attach(scheduler)` puts a recording wrapper on that
scheduler object's ``step`` (an instance attribute, found before the class's method) and
`detach()` removes it. Without ``--timeline`` nothing is attached, so the engine's step path
is exactly the one it always runs: no flag is tested per step, nothing is allocated.

Per step (columns of equal length; `columns()` returns them, times relative to ``t0``):

- ``t``: when the step returned (s); ``step_ms``: how long ``step()`` took
- ``kind``: "prefill" | "decode" | "idle" (`Scheduler.last_step_kind`)
- ``tokens``: tokens the step returned to requests
- ``running`` (the decoding batch), ``prefilling``, ``waiting``: sequences in each state after it
- ``tokens_in_flight``: tokens whose KV the admitted (running + prefilling) sequences hold
- ``kv_blocks_used`` of ``kv_blocks_total`` in the pool
- ``preemptions``: preemptions during this step

With overlap scheduling a decode step's tokens come back from the next ``step()`` call, so
``tokens`` lags ``running`` by one decode step; step_ms is the host's time in the call either way.
"""

from __future__ import annotations

import time
from typing import Optional

COLUMNS = ("t", "step_ms", "kind", "tokens", "running", "prefilling", "waiting", "tokens_in_flight",
           "kv_blocks_used", "preemptions")


class StepTimeline:
    """Recorder of one scheduler's steps while attached. A context manager::

        with StepTimeline(engine.scheduler) as tl:
            ...run...
        doc["timeline"] = tl.columns()
    """

    def __init__(self, scheduler, t0: Optional[float] = None):
        self.scheduler = scheduler
        self.t0 = time.perf_counter() if t0 is None else t0
        self.rows: list[tuple] = []
        self._attached = False

    def attach(self) -> "StepTimeline":
        if self._attached:
            return self
        sched = self.scheduler
        if "step" in vars(sched):
            raise RuntimeError("a step timeline is already recording this scheduler")
        step = type(sched).step.__get__(sched)  # the class's method, bound: what runs without a timeline
        bm = sched.block_manager
        rows = self.rows
        clock = time.perf_counter

        def recording_step():
            before = sched.num_preemptions
            t = clock()
            out = step()
            end = clock()
            admitted = sched.running + sched.prefilling
            rows.append((end, end - t, sched.last_step_kind, len(out), len(sched.running), len(sched.prefilling),
                         len(sched.waiting), sum(s.num_computed_tokens for s in admitted), bm.num_used_blocks,
                         sched.num_preemptions - before))
            return out

        sched.step = recording_step
        self._attached = True
        return self

    def detach(self) -> None:
        if self._attached:
            vars(self.scheduler).pop("step", None)
            self._attached = False

    def __enter__(self) -> "StepTimeline":
        return self.attach()

    def __exit__(self, *exc) -> bool:
        self.detach()
        return False

    def columns(self) -> dict:
        """The recorded steps as columns (see the module's docstring), plus ``kv_blocks_total``."""
        cols: dict = {name: [] for name in COLUMNS}
        for end, dt, kind, tokens, running, prefilling, waiting, inflight, used, pre in self.rows:
            cols["t"].append(end - self.t0)
            cols["step_ms"].append(dt * 1e3)
            cols["kind"].append(kind)
            cols["tokens"].append(tokens)
            cols["running"].append(running)
            cols["prefilling"].append(prefilling)
            cols["waiting"].append(waiting)
            cols["tokens_in_flight"].append(inflight)
            cols["kv_blocks_used"].append(used)
            cols["preemptions"].append(pre)
        cols["kv_blocks_total"] = self.scheduler.block_manager.num_blocks
        return cols


def summary_line(cols: dict) -> str:
    """One line over a recorded timeline: steps, their kinds, mean/max batch, KV use, preemptions."""
    n = len(cols.get("t", []))
    if not n:
        return "Timeline: no steps recorded"
    decode = [b for b, k in zip(cols["running"], cols["kind"]) if k == "decode"]
    ms = sorted(cols["step_ms"])
    mean_batch = sum(decode) / len(decode) if decode else 0.0
    return (f"Timeline: {n} steps ({len(decode)} decode, {cols['kind'].count('prefill')} prefill), "
            f"decode batch mean {mean_batch:.1f} max {max(decode, default=0)}, step p50 {ms[n // 2]:.2f} ms, "
            f"KV blocks used max {max(cols['kv_blocks_used'])} of {cols['kv_blocks_total']}, "
            f"preemptions {sum(cols['preemptions'])}")
