"""Warm-up and measured runs of `bench stream` / `bench sched`, and their result documents."""

from __future__ import annotations

from rosecli.bench import metrics, results
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
    """Returns {"runs": [...], "summary": {...}, "requests": [...], "measured": [RunMetrics],
    "failures": [(kind, message)] of the measured runs, "submitted": requests in the measured runs}."""
    workload = build_workload(spec, engine.tokenizer, engine.loaded.model.vocab_size, engine.max_model_len)
    manager = StreamingManager(engine, record_timestamps=True)
    runs, raw, measured, failures = [], [], [], []
    try:
        for label, warmup in _labels(warmups, repeats):
            engine.scheduler.reset_prefix_cache()  # every run starts from the same cache state
            table.start_run(label, warmup)
            run = run_stream(manager, workload, params, table.update)
            m = metrics.summarize_run(run.timings, run.wall_start, run.wall_end, run.submit_wall, len(run.failures))
            table.finish_run(m)
            runs.append({"label": label, "warmup": warmup, "figures": metrics.flatten(m), "errors": run.errors})
            if not warmup:
                measured.append(m)
                raw.append(results.request_records(run.timings, run.wall_start))
                failures += run.failures
    finally:
        manager.close()
    return {"runs": runs, "summary": metrics.median_run(measured), "requests": raw, "measured": measured,
            "failures": failures, "submitted": spec.num_requests * repeats}


def bench_sched(engine, spec: WorkloadSpec, params: SamplingParams, mode: str, warmups: int, repeats: int,
                table) -> dict:
    workload = build_workload(spec, engine.tokenizer, engine.loaded.model.vocab_size, engine.max_model_len)
    runs, measured, failures = [], [], []
    for label, warmup in _labels(warmups, repeats):
        engine.scheduler.reset_prefix_cache()
        table.start_run(label, warmup)
        run = run_sched(engine.scheduler, workload, params, mode, table.update, inputs=engine.inputs)
        m = metrics.summarize_sched_run(run)
        table.finish_run(m)
        runs.append({"label": label, "warmup": warmup, "figures": metrics.sched_figures(m),
                     "errors": [message for _, message in run.failures]})
        if not warmup:
            measured.append(m)
            failures += run.failures
    summary = metrics.summarize_sched_runs(measured)
    return {"runs": runs, "summary": {k: v[0] for k, v in summary.items()}, "pairs": summary, "measured": measured,
            "failures": failures, "submitted": spec.num_requests * repeats}
