"""Warm-up and measured runs of `bench stream` / `bench sched`, and their result documents."""

from __future__ import annotations

from rosecli.bench import metrics
from rosecli.bench.drivers import run_sched, run_stream
from rosecli.bench.workload import WorkloadSpec, build_workload
from rosecli.engine.config import SamplingParams
from rosecli.engine.streaming import StreamingManager


def _labels(warmups: int, repeats: int):
    for i in range(warmups):
        yield f"warmup {i + 1}/{warmups}", True
    for i in range(repeats):
        yield f"run {i + 1}/{repeats}", False


def bench_stream(engine, spec: WorkloadSpec, params: SamplingParams, warmups: int, repeats: int, table) -> dict:
    """Returns {"runs": [...], "summary": {...}, "requests": [...], "measured": [RunMetrics]}."""
    workload = build_workload(spec, engine.tokenizer, engine.loaded.model.vocab_size)
    manager = StreamingManager(engine, record_timestamps=True)
    runs, raw, measured = [], [], []
    try:
        for label, warmup in _labels(warmups, repeats):
            engine.scheduler.reset_prefix_cache()  # every run starts from the same cache state
            table.start_run(label, warmup)
            run = run_stream(manager, workload, params, table.update)
            m = metrics.summarize_run(run.timings, run.wall_start, run.wall_end, run.submit_wall, len(run.errors))
            table.finish_run(m)
            runs.append({"label": label, "warmup": warmup, "figures": metrics.flatten(m), "errors": run.errors})
            if not warmup:
                measured.append(m)
                t0 = run.wall_start
                raw.append([{"prompt_tokens": t.prompt_tokens, "output_tokens": t.output_tokens,
                             "submit": t.submit - t0,
                             "first_token": None if t.first_token is None else t.first_token - t0,
                             "finish": None if t.finish is None else t.finish - t0,
                             "token_times": [x - t0 for x in t.token_times]} for t in run.timings])
    finally:
        manager.close()
    return {"runs": runs, "summary": metrics.median_run(measured), "requests": raw, "measured": measured}


def bench_sched(engine, spec: WorkloadSpec, params: SamplingParams, mode: str, warmups: int, repeats: int,
                table) -> dict:
    workload = build_workload(spec, engine.tokenizer, engine.loaded.model.vocab_size)
    runs, measured = [], []
    for label, warmup in _labels(warmups, repeats):
        engine.scheduler.reset_prefix_cache()
        table.start_run(label, warmup)
        run = run_sched(engine.scheduler, workload, params, mode, table.update)
        m = metrics.summarize_sched_run(run)
        table.finish_run(m)
        figures = {k: getattr(m, k) for k in metrics.SCHED_FIGURES if getattr(m, k) is not None}
        runs.append({"label": label, "warmup": warmup, "figures": figures})
        if not warmup:
            measured.append(m)
    summary = metrics.summarize_sched_runs(measured)
    return {"runs": runs, "summary": {k: v[0] for k, v in summary.items()}, "pairs": summary, "measured": measured}
