"""Warm-up and measured runs of `bench stream` / `bench sched`, and their result documents."""

from __future__ import annotations

from rosecli.bench import metrics, results
from rosecli.bench.drivers import run_sched, run_stream
from rosecli.bench.timeline import StepTimeline
from rosecli.bench.workload import WorkloadSpec, build_workload
from rosecli.engine.config import SamplingParams
from rosecli.engine.gc_pauses import GcPauses
from rosecli.engine.streaming import StreamingManager


def _labels(warmups: int, repeats: int):
    for i in range(warmups):
        yield f"warmup {i + 1}/{warmups}", True
    for i in range(repeats):
        yield f"run {i + 1}/{repeats}", False


def _direct_throughput(engine, manager: StreamingManager, workload, params: SamplingParams) -> float:
    """The same workload driven through the scheduler directly, every request at once (as `bench
    sched --mode offline`): completion tokens / (first submit to last finish). It runs on the
    manager's worker thread, the thread that steps the engine in a streaming run, so nothing else
    steps the scheduler meanwhile."""
    def direct():
        engine.scheduler.reset_prefix_cache()
        run = run_sched(engine.scheduler, workload, params, "offline", inputs=engine.inputs)
        return run.completion_tokens / run.total_s if run.total_s > 0 else float("nan")

    return manager.call_on_worker(direct)


def bench_stream(engine, spec: WorkloadSpec, params: SamplingParams, warmups: int, repeats: int, table,
                 against_direct: bool = False, goodput: dict | None = None, timeline: bool = False,
                 roofline=None) -> dict:
    """Returns {"runs": [...], "summary": {...}, "requests": [...], "measured": [RunMetrics],
    "failures": [(kind, message)] of the measured runs, "submitted": requests in the measured runs}.
    ``against_direct``: after each run, the same workload through the scheduler directly; its
    throughput is each run's and the summary's ``throughput_direct`` (the manager's overhead is
    throughput_direct / throughput_completion - 1). ``timeline``: record each measured run's
    scheduler steps (`timeline.StepTimeline`); the result's "timelines" holds one per measured run.
    ``roofline``: a `roofline.EngineProbe` (GPU engines): each run's decode bytes, GB/s and share
    of the read ceiling go into its metrics and figures. Every run's garbage collections (this process's: the
    engine's threads and the client's) go into its metrics too (`gc_pauses.GcInterval`)."""
    workload = build_workload(spec, engine.tokenizer, engine.loaded.model.vocab_size, engine.max_model_len)
    manager = StreamingManager(engine, record_timestamps=True)
    runs, raw, measured, failures, timelines = [], [], [], [], []
    collections = GcPauses(warn_ms=float("inf"))  # counted and shown, not logged over the live table
    try:
        for label, warmup in _labels(warmups, repeats):
            engine.scheduler.reset_prefix_cache()  # every run starts from the same cache state
            table.start_run(label, warmup)
            recorder = StepTimeline(engine.scheduler).attach() if timeline and not warmup else None
            before = roofline.snapshot(manager) if roofline is not None else None
            collections.take()
            try:
                run = run_stream(manager, workload, params, table.update)
            finally:
                if recorder is not None:
                    recorder.detach()
            gc_run = collections.take()
            if recorder is not None:
                recorder.t0 = run.wall_start
                timelines.append(recorder.columns())
            m = metrics.summarize_run(run.timings, run.wall_start, run.wall_end, run.submit_wall, len(run.failures))
            m.gc = gc_run
            if roofline is not None:
                m.roofline = roofline.between(before, roofline.snapshot(manager))
            if goodput:  # --goodput: the requests meeting every SLO, as vLLM (metrics.meets_slo)
                m.goodput_requests, m.goodput_share = metrics.stream_goodput(run.timings, goodput, m.wall_s,
                                                                             len(run.failures))
            table.finish_run(m)
            figures = metrics.flatten(m)
            if against_direct:
                figures["throughput_direct"] = _direct_throughput(engine, manager, workload, params)
            runs.append({"label": label, "warmup": warmup, "figures": figures, "errors": run.errors})
            if not warmup:
                measured.append(m)
                raw.append(results.request_records(run.timings, run.wall_start))
                failures += run.failures
    finally:
        collections.close()
        manager.close()
    summary = metrics.median_run(measured)
    if against_direct:
        summary["throughput_direct"] = metrics.percentile(
            [r["figures"]["throughput_direct"] for r in runs if not r["warmup"]], 50)
    return {"runs": runs, "summary": summary, "requests": raw, "measured": measured,
            "failures": failures, "submitted": spec.num_requests * repeats,
            "timelines": timelines if timeline else None}


def bench_sched(engine, spec: WorkloadSpec, params: SamplingParams, mode: str, warmups: int, repeats: int,
                table, roofline=None) -> dict:
    """``roofline``: as `bench_stream`'s; the decode time is the run's decode_s. Each run's garbage collections
    as `bench_stream`'s."""
    workload = build_workload(spec, engine.tokenizer, engine.loaded.model.vocab_size, engine.max_model_len)
    runs, measured, failures = [], [], []
    collections = GcPauses(warn_ms=float("inf"))
    try:
        for label, warmup in _labels(warmups, repeats):
            engine.scheduler.reset_prefix_cache()
            table.start_run(label, warmup)
            before = roofline.snapshot() if roofline is not None else None
            collections.take()
            run = run_sched(engine.scheduler, workload, params, mode, table.update, inputs=engine.inputs)
            m = metrics.summarize_sched_run(run)
            m.gc = collections.take()
            if roofline is not None:
                m.roofline = roofline.between(before, roofline.snapshot(), run.decode_s)
            table.finish_run(m)
            runs.append({"label": label, "warmup": warmup, "figures": metrics.sched_figures(m),
                         "errors": [message for _, message in run.failures]})
            if not warmup:
                measured.append(m)
                failures += run.failures
    finally:
        collections.close()
    summary = metrics.summarize_sched_runs(measured)
    return {"runs": runs, "summary": {k: v[0] for k, v in summary.items()}, "pairs": summary, "measured": measured,
            "failures": failures, "submitted": spec.num_requests * repeats}
