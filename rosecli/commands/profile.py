"""`rose profile`: where every step's time goes (NVTX for Nsight Systems, torch trace, host table)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from rosecli.bench.workload import WorkloadSpec
from rosecli.commands import options as o
from rosecli.commands.bench import report_failures
from rosecli.commands.progress import startup_progress
from rosecli.engine.config import EngineConfig, SamplingParams

# A short workload: a profile needs a few steps of each kind, not a benchmark's run
PROFILE_DEFAULTS = {"num_requests": 8, "max_new_tokens": 32, "warmup_runs": 1}


@o.user_errors
@o.with_options(o.engine_options(), o.workload_options(exclude=("repeat_runs",)),
                o.sampling_options(exclude=("stop",)), defaults=PROFILE_DEFAULTS)
def profile(
    torch_trace: Annotated[Optional[str], typer.Option("--torch-trace", help="Also record the measured window "
                                                       "with the torch profiler into this directory (Chrome/"
                                                       "Perfetto JSON).")] = None,
    *, config: EngineConfig, spec: WorkloadSpec, params: SamplingParams, warmup_runs: int,
) -> None:
    """Run a short workload after start-up and warm-up; print host time per engine stage.

    With --nvtx, every stage is an NVTX range (batch size / token count in its name) and the
    measured window is bracketed by cudaProfilerStart/Stop, e.g.
    `nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi -o rose rose profile --nvtx`.
    """
    from rosecli.bench.profile import run_profile
    from rosecli.engine.llm import LLMEngine

    o.check_runs(warmup_runs, 1)
    if torch_trace is not None:
        if not torch_trace.strip():
            o.fail("--torch-trace needs a directory name, got an empty one: pass e.g. --torch-trace traces")
        o.check_writable_dir(f"--torch-trace {torch_trace}", torch_trace)
    console = Console()
    err = Console(stderr=True)
    with startup_progress(err) as progress:
        engine = LLMEngine(config, progress=progress)
    try:
        result = run_profile(engine, spec, params, warmup_runs=warmup_runs, torch_trace_dir=torch_trace)
    finally:
        engine.close()
    run = result.run
    report_failures(console, run.failures, spec.num_requests, runs="measured window")
    tokens = sum(t.output_tokens for t in run.timings)
    table = Table(title=f"Host time per stage: {engine.model_name} on {engine.device.type}, {spec.num_requests} "
                        f"requests, {tokens} tokens in {result.window_s:.3f} s (measured window)")
    for col in ("stage", "count", "total ms", "mean us", "p99 us", "share"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for r in result.rows:
        table.add_row(r["stage"], str(r["count"]), f"{r['total_ms']:.2f}", f"{r['mean_us']:.1f}",
                      f"{r['p99_us']:.1f}", f"{100 * r['share']:.1f}%")
    table.add_row("total", "", f"{sum(r['total_ms'] for r in result.rows):.2f}", "", "", "100.0%")
    console.print(table)
    if result.trace_path:
        console.print(f"torch trace: {result.trace_path}")
