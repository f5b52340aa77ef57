"""`rose profile`: where every step's time goes (NVTX for Nsight Systems, torch trace, host table);
with --decode-step, where a decode step's device time goes (graph replay time, kernels)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from rosecli.bench.workload import WorkloadSpec
from rosecli.commands import options as o
from rosecli.commands.bench import report_failures
from rosecli.commands.progress import start_engine
from rosecli.engine.config import EngineConfig, SamplingParams

# A short workload: a profile needs a few steps of each kind, not a benchmark's run
PROFILE_DEFAULTS = {"num_requests": 8, "max_new_tokens": 32, "warmup_runs": 1}


@o.user_errors
@o.with_options(o.engine_options(), o.workload_options(exclude=("repeat_runs",)),
                o.sampling_options(exclude=("stop",)), defaults=PROFILE_DEFAULTS)
def profile(
    torch_trace: Annotated[Optional[str], typer.Option("--torch-trace", metavar="DIR", help="Also record the measured window "
                                                       "with the torch profiler into this directory (Chrome/"
                                                       "Perfetto JSON).")] = None,
    decode_step: Annotated[bool, typer.Option("--decode-step", rich_help_panel=o.CUDA, help="(CUDA) Instead of "
                                              "the workload: the device time of "
                                              "one decode step (CUDA graph replays) and the kernels of one eager "
                                              "step, for each of --decode-batch-sizes, every sequence holding "
                                              "--input-len tokens (default 128; or each of --decode-contexts). "
                                              "Needs a CUDA GPU.")] = False,
    decode_batch_sizes: Annotated[Optional[str], typer.Option("--decode-batch-sizes", metavar="N,N,...",
                                                              rich_help_panel=o.CUDA, help="(CUDA) "
                                                              "Comma-separated batch "
                                                              "sizes for --decode-step (default: 1 and "
                                                              "--max-batch-size).")] = None,
    decode_contexts: Annotated[Optional[str], typer.Option("--decode-contexts", metavar="N,N,...",
                                                           rich_help_panel=o.CUDA, help="(CUDA) Comma-separated "
                                                           "context lengths for --decode-step, each timed at every "
                                                           "batch size in one start-up (default: --input-len, else "
                                                           "128).")] = None,
    *, config: EngineConfig, spec: WorkloadSpec, params: SamplingParams, warmup_runs: int,
) -> None:
    """Run a short workload after start-up and warm-up; print host time per engine stage.

    With --nvtx, every stage is an NVTX range (batch size / token count in its name) and the
    measured window is bracketed by cudaProfilerStart/Stop, e.g.
    `nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi -o rose rose profile --nvtx`.
    """
    if decode_step or decode_batch_sizes is not None or decode_contexts is not None:
        return _decode_step(decode_step, decode_batch_sizes, decode_contexts, spec.input_len, config)
    o.check_runs(warmup_runs, 1)
    if torch_trace is not None:
        if not torch_trace.strip():
            o.fail("--torch-trace needs a directory name, got an empty one: pass e.g. --torch-trace traces")
        o.check_writable_dir(f"--torch-trace {torch_trace}", torch_trace)
    console = Console()
    engine = start_engine(config, Console(stderr=True))
    from rosecli.bench.profile import run_profile

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
    if result.device is not None:
        _print_device_idle(console, result.device)
    if result.trace_path:
        console.print(f"torch trace: {result.trace_path}")


def _print_device_idle(console, d) -> None:
    """The traced window's device time: busy, idle, and the operations the longest idle stretches lie between."""
    mean = d.idle_us / len(d.gaps) if d.gaps else 0.0
    console.print(f"Device (torch trace): busy {d.busy_us / 1e3:.2f} ms of {d.span_us / 1e3:.2f} ms "
                  f"({d.busy_us / d.span_us * 100 if d.span_us else 0:.1f}%), idle in {len(d.gaps):,} gaps of "
                  f"{mean:.2f} us on average; most idle time between:", highlight=False, markup=False, soft_wrap=True)
    for before, after, n, us in d.between():
        console.print(f"   {us / 1e3:8.3f} ms  {n:6,d} x {us / n:6.2f} us  {before[:50]} -> {after[:50]}",
                      highlight=False, markup=False, soft_wrap=True)


def _decode_step(decode_step: bool, batch_sizes: Optional[str], contexts_text: Optional[str],
                 input_len: Optional[int], config) -> None:
    import torch

    from rosecli.bench.profile import check_decode_context, decode_batch_sizes, decode_contexts, profile_decode_step
    from rosecli.engine.errors import ConfigError

    if not decode_step:
        given = "--decode-batch-sizes" if batch_sizes is not None else "--decode-contexts"
        raise ConfigError(f"{given} applies only with --decode-step")
    sizes = decode_batch_sizes(batch_sizes, config.max_batch_size)
    contexts = decode_contexts(contexts_text, input_len)
    if config.device == "cpu" or not torch.cuda.is_available():
        where = "--device cpu" if config.device == "cpu" else "this machine has no CUDA GPU"
        raise ConfigError(f"--decode-step times CUDA graph replays and CUDA kernels and needs a CUDA GPU ({where}): "
                          "leave out --decode-step (rose profile without it prints host time per stage)")
    console, err = Console(), Console(stderr=True)
    engine = start_engine(config, err)
    try:
        flag = "--input-len" if contexts_text is None else "--decode-contexts"
        for context in contexts:  # every one refused before any is timed
            check_decode_context(engine, sizes, context, flag)
        rows = [profile_decode_step(engine, sizes, context) for context in contexts]
        from rosecli.bench.roofline import engine_probe

        probe = engine_probe(engine, lambda msg: err.print(msg, highlight=False, markup=False))
    finally:
        engine.close()
    console.print(f"{torch.cuda.get_device_name(engine.device)}, torch {torch.__version__}, model "
                  f"{engine.model_name}, {engine.dtype}, {' / '.join(map(str, contexts))} tokens of context per "
                  f"sequence{', in turn' if len(contexts) > 1 else ''}", highlight=False, soft_wrap=True)
    for context, group in zip(contexts, rows):
        if len(contexts) > 1:
            console.print(f"at {context} tokens:", highlight=False)
        _print_decode_rows(console, group, probe)


def _print_decode_rows(console, rows, probe) -> None:
    """`profile_decode_step`'s rows of one context: the replayed step against the floor, the eager step's kernels."""
    for r in rows:
        how = "graph replay" if r.graph else "eager step (no CUDA graph)"
        console.print(f"B={r.batch}: {how} {r.step_us:.1f} us/step ({r.batch / r.step_us * 1e6:,.0f} tok/s "
                      f"device-bound); eager step: {r.kernel_launches} kernels, {r.kernel_us:.1f} us of kernel time",
                      highlight=False, soft_wrap=True)
        if r.step_bytes is not None and probe is not None:
            floor_us = r.step_bytes / (probe.ceiling_gbs * 1e3)
            console.print(f"   floor: {r.step_bytes / 1e6:.1f} MB read at the {probe.ceiling_gbs:.0f} GB/s read "
                          f"ceiling = {floor_us:.1f} us; this step {r.step_bytes / r.step_us / 1e3:.0f} GB/s, "
                          f"{floor_us / r.step_us * 100:.1f}% of the ceiling", highlight=False, soft_wrap=True)
        shares = r.shares()
        if shares:
            console.print("   time: " + ", ".join(f"{k} {v * 100:.1f}%" for k, v in shares.items()), highlight=False,
                          markup=False, soft_wrap=True)
        for name, n, us in r.kernels[:14]:
            console.print(f"   {n:4d} x {us / n:7.2f} us  {name[:90]}", highlight=False, markup=False, soft_wrap=True)
        if r.layer is not None:
            _print_layer_program(console, r.layer, r.kernel_us)


def _print_layer_program(console, prog, kernel_us: float) -> None:
    """One layer's kernels in launch order (`rosecli.bench.profile.layer_program`), each with its share of the eager
    step's kernel time over all the layers, and what runs around them."""
    def items(launches):
        return ", ".join(f"{name[:48]} {us:.2f}" for name, us in launches) or "none"

    console.print(f"   one layer of {prog.layers}, in launch order (us, the mean over the layers; "
                  f"{sum(us for _, us in prog.layer):.2f} a layer):", highlight=False, markup=False, soft_wrap=True)
    for i, (name, us) in enumerate(prog.layer, 1):
        share = us * prog.layers / kernel_us * 100 if kernel_us > 0 else 0.0
        console.print(f"   {i:4d}. {us:7.2f} us {share:5.1f}%  {name[:90]}", highlight=False, markup=False,
                      soft_wrap=True)
    console.print(f"   before the layers: {items(prog.before)}; after: {items(prog.after)}", highlight=False,
                  markup=False, soft_wrap=True)
