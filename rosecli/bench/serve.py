"""Warm-up and measured runs of `rose bench serve` over one HTTP client, and their results."""

from __future__ import annotations

import asyncio
from typing import Optional

from rosecli.bench import metrics
from rosecli.bench.datasets import ServeRequest
from rosecli.bench.http_client import ProcessClients, Target, make_client, resolve_client_processes, run_serve


def _labels(warmups: int, repeats: int):
    """As bench stream's run labels (no import of its engine-side runner: this is client only)."""
    for i in range(warmups):
        yield f"warmup {i + 1}/{warmups}", True
    for i in range(repeats):
        yield f"run {i + 1}/{repeats}", False


def serve_request_records(timings, t0: float) -> list[dict]:
    """Raw per-request figures of one run, times relative to ``t0`` (the run's start)."""
    rel = (lambda x: None if x is None else x - t0)
    return [{"request_id": t.index, "prompt_tokens": t.prompt_tokens, "output_tokens": t.output_tokens,
             "asked_tokens": t.asked_tokens, "success": t.success, "error_kind": t.error_kind, "error": t.error,
             "usage_reported": t.usage_reported, "scheduled": rel(t.scheduled), "dispatched": rel(t.dispatched),
             "start": rel(t.start), "event_times": [x - t0 for x in t.event_times]} for t in timings]


def bench_serve(target: Target, requests: list[ServeRequest], offsets: list[float], warmups: int, repeats: int,
                table, *, max_concurrency: Optional[int] = None, percentiles=metrics.DEFAULT_METRIC_PERCENTILES,
                goodput: Optional[dict] = None, request_rate: Optional[float] = None, roofline: bool = True,
                client_processes=1) -> dict:
    """Every run sends the same requests on the same schedule over one client (connections kept
    between runs, as a long-lived client would). ``client_processes`` (a count or "auto"): more than
    one, the requests are split round-robin over that many client processes, started once here and
    reused by every run (`http_client.ProcessClients`); their timings are merged and summarized as
    one client's, ``client_cpu_share`` being the busiest process's. Returns {"runs", "summary", "requests",
    "measured": [ServeRunMetrics], "failures": [(kind, message)] of the measured runs,
    "submitted", "roofline": the server's ``GET /roofline`` before the first run, or None}.
    ``roofline``: when the server is rose on a GPU (it answers ``GET /roofline``), its decode
    counts are read before and after each run for the run's `roofline.DecodeRoofline`."""
    from rosecli.bench import roofline as roof

    stats = roof.server_stats(target.base_url, target.headers()) if roofline else None

    processes = resolve_client_processes(client_processes, len(requests), max_concurrency)

    async def main() -> dict:
        runs, raw, measured, failures = [], [], [], []
        if processes > 1:
            client = ProcessClients(target, requests, offsets, processes, max_concurrency)
            send = client.run
        else:
            client = make_client(target, max_concurrency)
            send = (lambda progress: run_serve(client, target, requests, offsets, max_concurrency, progress))
        async with client:
            for label, warmup in _labels(warmups, repeats):
                table.start_run(label, warmup)
                before = roof.server_stats(target.base_url, target.headers()) if stats is not None else None
                run = await send(table.update)
                m = metrics.summarize_serve_run(run.timings, run.wall_start, run.wall_end, percentiles, goodput,
                                                request_rate, expect_full_outputs=target.ignore_eos,
                                                client_cpu_s=run.cpu_s, client_cpu_total_s=run.cpu_total_s)
                if before is not None:
                    m.roofline = roof.server_between(before, roof.server_stats(target.base_url, target.headers()))
                table.finish_run(m)
                errors = [t.error for t in run.timings if not t.success]
                runs.append({"label": label, "warmup": warmup, "figures": metrics.serve_flatten(m),
                             "counts": {"requests": m.requests, "completed": m.completed, "failed": m.failed,
                                        "prompt_tokens": m.prompt_tokens, "completion_tokens": m.completion_tokens,
                                        "short_outputs": m.short_outputs, "usage_missing": m.usage_missing,
                                        "peak_concurrency": m.peak_concurrency, "failure_kinds": m.failure_kinds},
                             "errors": errors})
                if not warmup:
                    measured.append(m)
                    raw.append(serve_request_records(run.timings, run.wall_start))
                    failures += [(t.error_kind, t.error) for t in run.timings if not t.success]
        from rosecli.bench.metrics import median_figures

        return {"runs": runs, "summary": median_figures([r["figures"] for r in runs if not r["warmup"]]), "requests": raw, "measured": measured,
                "failures": failures, "submitted": len(requests) * repeats, "roofline": stats}

    return asyncio.run(main())
