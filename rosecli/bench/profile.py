"""`rose profile`: run a short streaming workload after start-up and warm-up, and measure
where each step's host time goes. The measured window is bracketed by cudaProfilerStart/Stop
(``nsys --capture-range=cudaProfilerApi`` records just it) and optionally traced with the torch
profiler, whose ranges carry the same stage names as the NVTX ranges; on CUDA the trace's device
operations also give where the device sat idle in the window (`device_idle`).

`rose profile --decode-step` (`profile_decode_step`) looks at the device instead: for each batch
size, the device time of one decode step (CUDA events around back-to-back replays of the step's
CUDA graph, so no host work is counted) and the kernels of one eager step (torch profiler: count
and device time by kernel name, and one layer's kernels in launch order: `layer_program`)."""

from __future__ import annotations

import os
import re
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from rosecli.bench.drivers import StreamRun, run_stream
from rosecli.bench.workload import WorkloadSpec, build_workload
from rosecli.engine.config import SamplingParams
from rosecli.engine.errors import ConfigError
from rosecli.engine.stages import stage_table
from rosecli.engine.streaming import StreamingManager


@dataclass
class DeviceIdle:
    """Where the device sat idle in a traced window (`device_idle`)."""
    span_us: float  # the first device operation's start to the last one's end
    busy_us: float  # time covered by at least one operation (kernels that overlap, as PDL's do, counted once)
    gaps: list[tuple[float, str, str]]  # (us, the operation that ended, the one that started) for each idle gap

    @property
    def idle_us(self) -> float:
        return self.span_us - self.busy_us

    def between(self, top: int = 5) -> list[tuple[str, str, int, float]]:
        """The ``top`` pairs of (ended, started) operations by idle time around them: (ended, started, gaps, us)."""
        pairs: dict[tuple[str, str], list] = {}
        for us, before, after in self.gaps:
            p = pairs.setdefault((before, after), [0, 0.0])
            p[0] += 1
            p[1] += us
        return sorted(((b, a, n, us) for (b, a), (n, us) in pairs.items()), key=lambda r: -r[3])[:top]


def device_events(prof) -> list:
    """The torch profiler's events that ran on the device (kernels, copies, memsets), in the order it lists them; not
    the ``record_function`` ranges (the engine's stages) it mirrors on the device's timeline, which span idle time."""
    return [ev for ev in prof.events()
            if ev.device_type == torch.autograd.DeviceType.CUDA and not getattr(ev, "is_user_annotation", False)]


def device_idle(ops: list[tuple[float, float, str]]) -> Optional[DeviceIdle]:
    """``ops``: the device operations of a window as (start us, end us, name), in any order. The gaps when none ran,
    each with the operation that ended last before it and the first to start after it; None without operations."""
    if not ops:
        return None
    ops = sorted(ops)
    busy, gaps = 0.0, []
    start, end, last = ops[0][0], ops[0][1], ops[0][2]
    for s, e, name in ops[1:]:
        if s > end:  # nothing ran between end and s
            busy += end - start
            gaps.append((s - end, last, name))
            start = s
        if e >= end:
            end, last = e, name
    busy += end - start
    return DeviceIdle(end - ops[0][0], busy, gaps)


@dataclass
class ProfileResult:
    rows: list[dict]
    run: StreamRun
    window_s: float
    trace_path: Optional[str]
    device: Optional[DeviceIdle] = None  # with a torch trace on CUDA: the device's idle gaps in the window


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
        device = None
        if prof is not None and cuda:
            device = device_idle([(ev.time_range.start, ev.time_range.end, ev.name) for ev in device_events(prof)])
        return ProfileResult(stage_table(stages.samples), run, window, trace_path, device)
    finally:
        manager.close()


DECODE_STEP_REPLAYS = 200  # back-to-back runs of the step whose device time is averaged
DEFAULT_DECODE_CONTEXT = 128
# Positions past each prompt that the profiled step may reach: the prefill's token, the decode step read and the one
# in flight that is replayed (two), with room to spare.
DECODE_STEP_HEADROOM = 4


@dataclass
class DecodeStepProfile:
    batch: int
    context_len: int  # tokens in each sequence's KV cache
    graph: bool  # the step replayed its CUDA graph (False: no graph for this size, run eagerly)
    step_us: float  # device time of one step
    kernels: list[tuple[str, int, float]]  # one eager step: (kernel name, launches, device us), most time first
    step_bytes: Optional[int] = None  # what the step reads (weights + KV, `rosecli.engine.roofline`)
    layer: Optional["LayerProgram"] = None  # one layer's kernels in launch order (`layer_program`)

    @property
    def kernel_launches(self) -> int:
        return sum(n for _, n, _ in self.kernels)

    @property
    def kernel_us(self) -> float:
        return sum(us for _, _, us in self.kernels)

    def shares(self) -> dict[str, float]:
        """Each `KERNEL_CATEGORIES` kind's share of the step's time, and ``gaps``: the step time no
        kernel of the eager step accounts for (launch gaps; 0 when the kernels add up to more). The
        shares are of the larger of the step time and the kernels' sum, so they add up to 1."""
        per = dict.fromkeys(("gemm", "attention", "norm/rotary/activation", "sampling", "other"), 0.0)
        for name, _, us in self.kernels:
            per[kernel_category(name)] += us
        whole = max(self.step_us, self.kernel_us)
        if whole <= 0:
            return {}
        per["gaps"] = whole - self.kernel_us
        return {k: v / whole for k, v in per.items()}


# kernel name patterns by kind, tried in this order (the first match counts); the rest is "other"
KERNEL_CATEGORIES = {
    "sampling": r"argmax|arg_max|ArgMax|sampl|topk|top_k|_pass1_kernel|_pivot_kernel|_compact_kernel|_finish_kernel",
    "attention": r"attention|attn|_decode_kernel|_merge_kernel|_prefill_kernel|flash|fmha|_store_kv|sdpa",
    "gemm": r"gemm|gemv|_skinny_kernel|xmma|cutlass|cublas|nvjet|matmul|splitK|wgmma|Kernel2\b",
    # torch's elementwise kernels (the unfused rotary's multiplies and adds, casts) count here
    "norm/rotary/activation": r"norm|rotary|rope|silu|gelu|elementwise|roll",
}
_CATEGORY_RES = [(kind, re.compile(pattern, re.I)) for kind, pattern in KERNEL_CATEGORIES.items()]


def kernel_category(name: str) -> str:
    """The kind of a kernel by its name (`KERNEL_CATEGORIES`): "other" when none matches (copies,
    embedding lookups, casts)."""
    for kind, pattern in _CATEGORY_RES:
        if pattern.search(name):
            return kind
    return "other"


@dataclass
class LayerProgram:
    """A step's kernels split into what runs before its layers, one layer's kernels (each the mean over the
    layers), and what runs after them; each entry (kernel name, device us)."""
    layers: int
    before: list[tuple[str, float]]
    layer: list[tuple[str, float]]
    after: list[tuple[str, float]]


def layer_program(launches: list[tuple[str, float]], layers: int) -> Optional[LayerProgram]:
    """Where ``launches`` (one step's kernels in launch order: name, device us) hold ``layers`` runs of the same
    kernel names back to back, the longest such run's kernels (so a layer's whole set) each averaged over the
    layers; the earliest place it fits wins (the first layer's first kernel, where the layers launch alike; else a
    rotation of a layer's order). None when the names repeat no such way (e.g. one layer launching a kernel the
    others do not)."""
    names = [name for name, _ in launches]
    n = len(names)
    if layers < 2:
        return None
    for period in range(n // layers, 0, -1):
        span = period * layers
        for start in range(n - span + 1):
            if all(names[i] == names[i + period] for i in range(start, start + span - period)):
                layer = [(names[start + j], sum(launches[start + j + period * i][1] for i in range(layers)) / layers)
                         for j in range(period)]
                return LayerProgram(layers, launches[:start], layer, launches[start + span:])
    return None


def _whole_numbers(text: str, flag: str, example: str) -> list[int]:
    """A comma-separated list of whole numbers given to ``flag``, or a ConfigError showing ``example``."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated whole numbers, e.g. {example}; got {text!r}") from None


def decode_batch_sizes(text: Optional[str], max_batch_size: int) -> list[int]:
    """``--decode-batch-sizes`` (comma-separated; None: 1 and ``max_batch_size``), checked."""
    if text is None:
        return sorted({1, max_batch_size})
    sizes = _whole_numbers(text, "--decode-batch-sizes", "1,16,64")
    for size in sizes:
        if not 1 <= size <= max_batch_size:
            raise ConfigError(f"--decode-batch-sizes: {size} is outside 1..--max-batch-size ({max_batch_size}): "
                              "raise --max-batch-size or pick smaller batches")
    return sizes


def decode_contexts(text: Optional[str], input_len: Optional[int]) -> list[int]:
    """``--decode-contexts`` (comma-separated; None: ``--input-len``, else `DEFAULT_DECODE_CONTEXT`), each at least
    one token (what the model holds is checked once it is loaded: `check_decode_context`)."""
    if text is None:
        return [input_len if input_len is not None else DEFAULT_DECODE_CONTEXT]
    if input_len is not None:
        raise ConfigError("--decode-step takes its context from --input-len or --decode-contexts, not both")
    contexts = _whole_numbers(text, "--decode-contexts", "128,1024,4096")
    for n in contexts:
        if n < 1:
            raise ConfigError(f"--decode-contexts: {n} is not a context; each is at least 1 token")
    return contexts


def check_decode_context(engine, batch_sizes: list[int], context_len: int, flag: str = "--input-len") -> None:
    """A ConfigError unless every sequence of the largest batch holds ``context_len`` tokens and the steps after them
    (`DECODE_STEP_HEADROOM`) within the model's context and, all together, within the KV cache. (The profile queues
    its prompts on the scheduler itself, past the checks a request's prompt gets: a prompt past a learned position
    table would index outside it on the device.) ``flag`` names where the context came from."""
    limit = engine.max_model_len - DECODE_STEP_HEADROOM
    if not 1 <= context_len <= limit:
        raise ConfigError(f"{flag} {context_len}: the profiled decode step runs up to {DECODE_STEP_HEADROOM} "
                          f"tokens past each prompt, so {engine.model_name}'s context of {engine.max_model_len} "
                          f"tokens allows {flag} 1..{limit}")
    bm = engine.scheduler.block_manager
    batch = max(batch_sizes)
    need = batch * bm.blocks_needed(context_len + DECODE_STEP_HEADROOM)
    if need > bm.num_blocks:
        raise ConfigError(f"{flag} {context_len} at B={batch}: {need} KV blocks of {bm.block_size} tokens, but the "
                          f"KV cache has {bm.num_blocks}: lower {flag} or --decode-batch-sizes, or raise "
                          "--num-gpu-blocks")


def profile_decode_step(engine, batch_sizes: list[int], context_len: int = DEFAULT_DECODE_CONTEXT,
                        replays: int = DECODE_STEP_REPLAYS) -> list[DecodeStepProfile]:
    """For each batch size: admit that many requests of ``context_len`` tokens, step until the
    last step launched decodes all of them, then time and profile that step again (its inputs
    stay staged) and discard the requests. Needs CUDA."""
    check_decode_context(engine, batch_sizes, context_len)
    if engine.device.type != "cuda":
        raise ConfigError("--decode-step times CUDA graph replays and CUDA kernels: it needs a CUDA GPU")
    sched, runner = engine.scheduler, engine.runner
    vocab = engine.loaded.model.vocab_size
    limit = min(sched.max_active, engine.config.max_batch_size)
    if max(batch_sizes) > limit:
        raise ConfigError(f"--decode-batch-sizes: {max(batch_sizes)} is more than the engine decodes at once "
                          f"({limit}, --max-batch-size / --max-active-requests)")
    params = SamplingParams(max_new_tokens=engine.max_model_len, stop_on_eos=False)  # greedy: see rerun_decode
    from rosecli.engine.roofline import decode_bytes

    weights = decode_bytes(engine.loaded.model, engine.dtype)
    out = []
    for batch in batch_sizes:
        # distinct prompts, so no request reads another's KV blocks from the prefix cache
        ids = [sched.add_request([(1 + i + 7 * j) % vocab for j in range(context_len)], params)
               for i in range(batch)]
        while sched.waiting or sched.prefilling or sched.last_step_kind != "decode":
            sched.step()
        before = runner.decode_counts()
        sched.step()  # a decode step of all of them, launched after the last prefill
        after = runner.decode_counts()
        step_bytes = (weights.total(*(a - b for a, b in zip(after, before))) if after[0] - before[0] == 1
                      else None)
        max_context = max(len(sched.get(rid).token_ids) for rid in ids)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(engine.device)
        start.record()
        for _ in range(replays):
            graph = runner.rerun_decode(batch, max_context)
        end.record()
        torch.cuda.synchronize(engine.device)
        step_us = start.elapsed_time(end) * 1e3 / replays
        from torch.profiler import ProfilerActivity, profile

        kernels: dict[str, list] = {}
        launches = []
        with warnings.catch_warnings():  # torch warns that a profile without a schedule is one cycle: it is
            warnings.filterwarnings("ignore", message=".*Profiler clears events")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.rerun_decode(batch, max_context, eager=True)
                torch.cuda.synchronize(engine.device)
            for ev in device_events(prof):
                k = kernels.setdefault(ev.name, [0, 0.0])
                k[0] += 1
                k[1] += ev.device_time
                launches.append((ev.time_range.start, ev.name, ev.device_time))
        rows = sorted(((name, n, us) for name, (n, us) in kernels.items()), key=lambda r: -r[2])
        layer = layer_program([(name, us) for _, name, us in sorted(launches, key=lambda e: e[0])],
                              engine.loaded.model.num_layers)
        out.append(DecodeStepProfile(batch, context_len, graph, step_us, rows, step_bytes, layer))
        for rid in ids:
            sched.discard_request(rid)
        while sched.has_unfinished():
            sched.step()
        sched.pop_finished_ids()
    return out
