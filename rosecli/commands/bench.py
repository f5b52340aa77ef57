"""`rose bench stream | sched | compare`: Typer wiring over rosecli.bench."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Optional

import typer
from rich.console import Console

from rosecli.bench.workload import WorkloadSpec
from rosecli.commands import options as o
from rosecli.commands.progress import startup_progress
from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.errors import ConfigError

# bench sched drives the scheduler directly: no streaming manager options, every request at once
SCHED_EXCLUDES = ("stream_interval", "tokenize_workers", "max_inflight_requests")
SCHED_WORKLOAD_EXCLUDES = ("submit_interval_ms", "submit_schedule", "request_rate")

FIGURES_HELP = ("Figures (per run, p50/p95/p99): TTFT = first token received - submit; TPOT = (finish - first "
                "token) / (tokens - 1), one-token outputs left out; ITL = every gap between consecutive pieces a "
                "client receives; latency = finish - submit; queue wait = admitted - tokenized; submit lag = submit "
                "- scheduled time. Throughput = tokens / (last finish - first submit). Percentiles interpolate "
                "linearly between closest ranks. The summary is the median over measured runs; start-up is "
                "reported on its own, never inside a run.")

SaveResult = Annotated[Optional[str], typer.Option("--save-result", help="Write configuration, environment, "
                                                   "per-run figures and raw timestamps to this JSON file "
                                                   "(schema rosecli.bench/1).")]
AgainstDirect = Annotated[bool, typer.Option("--against-direct", help="After each run, drive the same workload "
                                              "through the scheduler directly (as bench sched --mode offline, in "
                                              "this process) and report the streaming manager's throughput "
                                              "overhead against it. Needs every request at once.")]
Mode = Annotated[str, typer.Option("--mode", help="offline: run all requests to completion; online: also "
                                   "timestamp each request's submit, first token and finish.")]


def _start(config, console_err: Console):
    from rosecli.engine.llm import LLMEngine

    with startup_progress(console_err) as progress:
        return LLMEngine(config, progress=progress)


def _header(engine, spec, config) -> dict:
    return {"Model": engine.model_name, "Device": engine.device.type, "Dtype": str(engine.dtype).removeprefix("torch."),
            "Paged attention": engine.runner.use_triton, "CUDA Graph": bool(engine.runner.graphs),
            "NVTX": config.nvtx, "Prefix cache": config.enable_prefix_cache, "Requests": spec.num_requests,
            "Max new tokens": spec.max_new_tokens if spec.output_len is None else f"~{spec.output_len}"}


def report_failures(console: Console, failures: list, submitted: int, runs: str = "measured runs") -> None:
    """Say how many requests failed and why; every one failing is an error (exit code 1).
    ``failures``: (kind, message) pairs as the bench drivers record them."""
    from rosecli.bench import report

    if not failures:
        return
    kinds = report.failure_kinds(failures)
    if len(failures) >= submitted:
        o.fail(f"all {submitted} requests of the {runs} failed, nothing was measured: {kinds}", code=1)
    console.print(f"Failed requests: {len(failures)} of {submitted} in the {runs}: {kinds}", highlight=False,
                  markup=False, soft_wrap=True)


def _config_dict(config, spec, params, **extra) -> dict:
    return {**dataclasses.asdict(config), **dataclasses.asdict(spec), **dataclasses.asdict(params), **extra}


@o.user_errors
@o.with_options(o.engine_options(), o.workload_options(), o.sampling_options(exclude=("stop",)))
def stream(
    config: EngineConfig, spec: WorkloadSpec, params: SamplingParams, save_result: SaveResult = None,
    against_direct: AgainstDirect = False, *, warmup_runs: int, repeat_runs: int,
) -> None:
    """Streaming benchmark through the streaming manager: TTFT / TPOT / ITL per run."""
    from rosecli.bench import report, results
    from rosecli.bench.run import bench_stream

    o.check_runs(warmup_runs, repeat_runs)
    if save_result is not None:
        results.check_result_path(save_result)
    if against_direct and (spec.request_rate is not None or spec.submit_interval_ms > 0):
        raise ConfigError("--against-direct compares runs that submit every request at once: leave out "
                          "--request-rate and --submit-interval-ms")
    console, err = Console(), Console(stderr=True)
    engine = _start(config, err)
    try:
        header = _header(engine, spec, config)
        header.update({"Pretok": spec.pretok, "Tokenize workers": config.tokenize_workers,
                       "Stream interval": config.stream_interval})
        if spec.request_rate is not None:
            header["Arrivals"] = f"Poisson {spec.request_rate} req/s (seed {spec.seed})"
        else:
            header["Submit interval/schedule"] = f"{spec.submit_interval_ms:.3f} ms / {spec.submit_schedule}"
        console.print("=== streaming benchmark ===", highlight=False)
        for line in report.header_lines(header):
            console.print(line, highlight=False)
        console.print(report.startup_line(engine.startup_times), highlight=False)
        with report.RunTable(console, "stream", "streaming benchmark") as table:
            out = bench_stream(engine, spec, params, warmup_runs, repeat_runs, table, against_direct)
        report.print_stream_summary(console, out["measured"], out["summary"])
        if against_direct and (line := report.against_direct_line(out["summary"])):
            console.print(line, highlight=False)
        if save_result is not None:
            results.save_result(save_result, "stream", _config_dict(config, spec, params), engine.startup_times,
                                out["runs"], out["summary"], out["requests"])
            console.print(f"saved {save_result}", highlight=False)
        report_failures(console, out["failures"], out["submitted"])
    finally:
        engine.close()


@o.user_errors
@o.with_options(o.engine_options(exclude=SCHED_EXCLUDES), o.workload_options(exclude=SCHED_WORKLOAD_EXCLUDES),
                o.sampling_options(exclude=("stop",)))
def sched(
    config: EngineConfig, mode: Mode = "online", *, spec: WorkloadSpec, params: SamplingParams,
    save_result: SaveResult = None, warmup_runs: int, repeat_runs: int,
) -> None:
    """Scheduler benchmark, driving the scheduler directly: decode and total time, throughput."""
    from rosecli.bench import report, results
    from rosecli.bench.run import bench_sched

    o.check_runs(warmup_runs, repeat_runs)
    if save_result is not None:
        results.check_result_path(save_result)
    if mode not in ("offline", "online"):
        raise ConfigError(f"--mode must be offline or online, got {mode!r}")
    console, err = Console(), Console(stderr=True)
    engine = _start(config, err)
    try:
        console.print("=== scheduler benchmark ===", highlight=False)
        for line in report.header_lines({**_header(engine, spec, config), "Mode": mode}):
            console.print(line, highlight=False)
        console.print(report.startup_line(engine.startup_times), highlight=False)
        with report.RunTable(console, "sched", f"scheduler benchmark ({mode})") as table:
            out = bench_sched(engine, spec, params, mode, warmup_runs, repeat_runs, table)
        report.print_sched_summary(console, mode, warmup_runs, out["pairs"], len(out["measured"]))
        if save_result is not None:
            results.save_result(save_result, "sched", _config_dict(config, spec, params, mode=mode),
                                engine.startup_times, out["runs"], out["summary"])
            console.print(f"saved {save_result}", highlight=False)
        report_failures(console, out["failures"], out["submitted"])
    finally:
        engine.close()


@o.user_errors
def compare(files: Annotated[list[str], typer.Argument(help="Result files from --save-result; the first is the "
                                                       "baseline.")]) -> None:
    """Compare saved results figure by figure; changes within the spread of repeat runs are marked noise."""
    from rosecli.bench import compare as cmp
    from rosecli.bench import report, results

    if len(files) < 2:
        raise ConfigError("give at least two result files: the baseline first")
    docs = [results.load_result(f) for f in files]
    kinds = {d["kind"] for d in docs}
    if len(kinds) > 1:
        raise ConfigError(f"cannot compare results of different benchmarks ({', '.join(sorted(kinds))})")
    report.print_compare(Console(), files, cmp.compare_results(docs), cmp.config_differences(docs))


stream.__doc__ = f"{stream.__doc__}\n\n{FIGURES_HELP}"
