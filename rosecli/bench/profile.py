"""`rose profile`: run a short streaming workload after start-up and warm-up, and measure
where each step's host time goes. The measured window is bracketed by cudaProfilerStart/Stop
(``nsys --capture-range=cudaProfilerApi`` records just it) and optionally traced with the torch
profiler, whose ranges carry the same stage names as the NVTX ranges."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from rosecli.bench.drivers import StreamRun, run_stream
from rosecli.bench.workload import WorkloadSpec, build_workload
from rosecli.engine.config import SamplingParams
from rosecli.engine.stages import stage_table
from rosecli.engine.streaming import StreamingManager


@dataclass
class ProfileResult:
    rows: list[dict]
    run: StreamRun
    window_s: float
    trace_path: Optional[str]


def run_profile(engine, spec: WorkloadSpec, params: SamplingParams, warmup_runs: int = 1,
                torch_trace_dir: Optional[str] = None, progress=None) -> ProfileResult:
    manager = StreamingManager(engine)
    stages = engine.stages
    cuda = engine.device.type == "cuda"
    try:
        workload = build_workload(spec, engine.tokenizer, engine.loaded.model.vocab_size, engine.max_model_len)
        for _ in range(warmup_runs):
            run_stream(manager, workload, params, progress)
            engine.scheduler.reset_prefix_cache()
        prof = None
        if torch_trace_dir:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            prof = profile(activities=activities)
            stages.enable_torch_trace(True)
        stages.reset()
        stages.timing = True
        if prof is not None:
            manager.call_on_worker(prof.start)  # the profiler records the thread that starts it
        if cuda:
            torch.cuda.synchronize(engine.device)
            torch.cuda.profiler.start()
        t0 = time.perf_counter()
        run = run_stream(manager, workload, params, progress)
        if cuda:
            torch.cuda.synchronize(engine.device)
            torch.cuda.profiler.stop()
        window = time.perf_counter() - t0
        stages.timing = False
        trace_path = None
        if prof is not None:
            manager.call_on_worker(prof.stop)
            stages.enable_torch_trace(False)
            os.makedirs(torch_trace_dir, exist_ok=True)
            trace_path = os.path.join(torch_trace_dir, f"rose-profile-{int(time.time())}.json")
            prof.export_chrome_trace(trace_path)
        return ProfileResult(stage_table(stages.samples), run, window, trace_path)
    finally:
        manager.close()
