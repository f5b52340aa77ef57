"""Run one benchmark pass: through the streaming manager (`bench stream`) or the scheduler
directly (`bench sched`), returning raw per-request timestamps for `metrics` to summarise."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from rosecli.bench.metrics import RequestTiming
from rosecli.bench.workload import Workload
from rosecli.engine.config import SamplingParams
from rosecli.engine.errors import RoseError
from rosecli.engine.streaming import END, StreamingManager

Progress = Callable[[int, int, int, float], None]  # (finished requests, total, output tokens, elapsed s)


Failure = tuple[str, str]  # (kind: the error's class name, "request i: message")


def _failure(request: int, error: BaseException) -> Failure:
    return type(error).__name__, f"request {request}: {error}"


@dataclass
class StreamRun:
    timings: list[RequestTiming]
    wall_start: float
    wall_end: float
    submit_wall: float
    failures: list[Failure] = field(default_factory=list)

    @property
    def errors(self) -> list[str]:
        return [message for _, message in self.failures]


def _sleep_until(target: float) -> None:
    while True:
        left = target - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left if left > 0.002 else 0)  # sleep coarse, then yield until due


def run_stream(manager: StreamingManager, workload: Workload, params: SamplingParams,
               progress: Optional[Progress] = None, progress_every_s: float = 0.1) -> StreamRun:
    """Submit the workload on its schedule from a submitter thread and read every stream on
    this thread (one shared queue: client receive times are taken as pieces are read)."""
    n = len(workload.prompts)
    sink: queue.SimpleQueue = queue.SimpleQueue()
    scheduled = [0.0] * n
    submitted = [0.0] * n
    returned = [0.0] * n
    index_of: dict[int, int] = {}
    failures: list[Failure] = []
    per_params = [dataclasses.replace(params, max_new_tokens=m, min_tokens=min(params.min_tokens, m))
                  for m in workload.max_new_tokens]
    start = time.perf_counter()
    submit_end = [start]

    def submitter() -> None:
        prev = start
        for i in range(n):
            target = (prev + workload.offsets_s[i]) if workload.relative else start + workload.offsets_s[i]
            _sleep_until(target)
            scheduled[i] = target
            t = time.perf_counter()
            try:
                rid = manager.add_request(workload.prompts[i], per_params[i], sink=sink)
            except Exception as e:  # a refused request is a reported error, not a crash
                failures.append(_failure(i, e))
                sink.put((-1 - i, END))
                continue
            prev = returned[i] = time.perf_counter()
            submitted[i] = t
            index_of[rid] = i
        submit_end[0] = time.perf_counter()

    thread = threading.Thread(target=submitter, name="rose-bench-submit", daemon=True)
    thread.start()
    recv: dict[int, list[float]] = {}
    outputs = {}
    finished = tokens = 0
    tokens_before = manager.generated_tokens  # the live count: tokens as the engine makes them
    next_progress = start
    while finished < n:
        try:
            rid, item = sink.get(timeout=progress_every_s)
        except queue.Empty:
            rid = None
        now = time.perf_counter()
        if rid is not None:
            if item is END:
                finished += 1
                if rid >= 0:
                    try:
                        out = outputs[rid] = manager.take_output(rid)
                        tokens += out.output_tokens
                    except Exception as e:
                        failures.append(_failure(index_of.get(rid, rid), e))
            else:
                recv.setdefault(rid, []).append(now)
        if progress and now >= next_progress:
            progress(finished, n, max(tokens, manager.generated_tokens - tokens_before), now - start)
            next_progress = now + progress_every_s
    wall_end = time.perf_counter()
    thread.join()
    timings = []
    for rid, out in outputs.items():
        i = index_of[rid]
        times = recv.get(rid, [])
        ts = out.timestamps
        timings.append(RequestTiming(
            request_id=rid, prompt_tokens=out.prompt_tokens, output_tokens=out.output_tokens,
            scheduled_submit=scheduled[i], submit=submitted[i], add_request_done=returned[i],
            tokenized=ts.tokenized, admitted=ts.admitted, first_token=times[0] if times else None,
            token_times=times, chunk_tokens=list(ts.flush_tokens[:len(times)]), finish=times[-1] if times else None,
            finish_reason=out.finish_reason))
    if progress:
        progress(finished, n, tokens, wall_end - start)
    first_submit = min((t.submit for t in timings), default=start)
    return StreamRun(timings, first_submit, wall_end, submit_end[0] - start, failures)


@dataclass
class SchedRun:
    mode: str
    timings: list[RequestTiming]
    prefill_s: float  # time in prefill steps
    decode_s: float  # time in decode steps
    total_s: float  # first submit to last finish
    completion_tokens: int
    prompt_tokens: int
    failures: list[Failure] = field(default_factory=list)


def run_sched(scheduler, workload: Workload, params: SamplingParams, mode: str,
              progress: Optional[Progress] = None, *, inputs) -> SchedRun:
    """Offline: every request is added, then steps run to completion. Online: the same, but
    each request's submit, first token and finish (by finished event) are timestamped. Prompts
    are tokenized and checked by ``inputs`` (the engine's input processor) as they are added."""
    n = len(workload.prompts)
    per_params = [dataclasses.replace(params, max_new_tokens=m, min_tokens=min(params.min_tokens, m))
                  for m in workload.max_new_tokens]
    online = mode == "online"
    start = time.perf_counter()
    ids, submit = [], {}
    failures: list[Failure] = []
    for i, (prompt, p) in enumerate(zip(workload.prompts, per_params)):
        t = time.perf_counter()
        try:
            rid = scheduler.add_request(inputs.process(prompt, p), p)
        except RoseError as e:  # a request the engine refuses (too long ...) is reported, not a crash
            failures.append(_failure(i, e))
            continue
        submit[rid] = t
        ids.append(rid)
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    prefill_s = decode_s = 0.0
    tokens = 0
    next_progress = start
    while scheduler.has_unfinished():
        t0 = time.perf_counter()
        out = scheduler.step()
        t1 = time.perf_counter()
        if scheduler.last_step_kind == "prefill":
            prefill_s += t1 - t0
        else:
            decode_s += t1 - t0
        tokens += len(out)
        if online:
            for rid in out:
                first.setdefault(rid, t1)
            for rid in scheduler.pop_finished_ids():
                finish[rid] = t1
        if progress and t1 >= next_progress:
            progress(len(finish), n, tokens, t1 - start)
            next_progress = t1 + 0.1
    end = time.perf_counter()
    scheduler.pop_finished_ids()
    timings = []
    completion = prompt_tokens = 0
    for rid in ids:
        seq = scheduler.pop_request(rid)
        completion += seq.num_output_tokens
        prompt_tokens += seq.num_prompt_tokens
        if online:
            timings.append(RequestTiming(
                request_id=rid, prompt_tokens=seq.num_prompt_tokens, output_tokens=seq.num_output_tokens,
                scheduled_submit=submit[rid], submit=submit[rid], add_request_done=submit[rid],
                tokenized=None, admitted=seq.admitted_at, first_token=first.get(rid), token_times=[],
                chunk_tokens=[], finish=finish.get(rid, end),
                finish_reason=seq.finish_reason.value if seq.finish_reason else None))
    if progress:
        progress(n, n, tokens, end - start)
    return SchedRun(mode, timings, prefill_s, decode_s, end - start, completion, prompt_tokens, failures)
