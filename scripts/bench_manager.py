"""The streaming manager's overhead: one workload driven through the scheduler directly and
through the manager, in one process on one engine, alternating, warm-ups first.

Workload: N requests at once (default 64), distinct pre-tokenized prompts of 4 token ids,
512 new tokens, no EOS stop, no prefix cache, max batch size N, stream interval 1. Modes:

- ``direct``: every request added to ``engine.scheduler``, then ``step()`` until nothing is
  unfinished (like ``rose bench sched`` offline): the floor the manager is measured against;
- ``sink``: ``StreamingManager``, all requests read on one consumer thread from one shared
  queue (like ``rose bench stream``);
- ``streams``: ``StreamingManager``, one consumer thread per request iterating its own
  ``manager.stream(rid)`` (the HTTP server's pattern).

Figures per run: output tokens/s from the first submit to the last finish the consumer saw
(``tok_s``); decode tokens/s over the steps after the first (``decode_tok_s``); the median
duration of ``scheduler.step()`` and the median loop period (start of one step to the start
of the next: the step plus whatever the driver does between steps). The overhead is
``direct / mode - 1`` on the medians of the measured runs. After the measured runs, one more
run per mode with ``Stages`` host timing on gives the per-step host microseconds of
``scheduler_step`` (and the stages inside it) and of the manager's ``detokenize_fanout`` and
``stream_flush``; those runs are not part of the throughput figures.

    python scripts/bench_manager.py                       # GPT-2 124M shape, dummy weights, CUDA
    python scripts/bench_manager.py --model tiny-gpt2 --device cpu --num-requests 8 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rosecli.engine.config import EngineConfig, SamplingParams  # noqa: E402
from rosecli.engine.stages import stage_table  # noqa: E402
from rosecli.engine.streaming import END, StreamingManager  # noqa: E402

MODES = ("direct", "sink", "streams")


class StepClock:
    """Wraps ``scheduler.step`` (an instance attribute shadowing the method) to record when each
    step started and ended and how many tokens it returned: a few list appends per step, the
    same in every mode."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.inner = scheduler.step
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.tokens: list[int] = []

    def __call__(self):
        t0 = time.perf_counter()
        out = self.inner()
        t1 = time.perf_counter()
        self.starts.append(t0)
        self.ends.append(t1)
        self.tokens.append(len(out))
        return out

    def __enter__(self) -> "StepClock":
        self.scheduler.step = self
        return self

    def __exit__(self, *exc) -> None:
        del self.scheduler.step

    def figures(self) -> dict:
        idx = [i for i, n in enumerate(self.tokens) if n]  # steps that produced tokens
        durations = [self.ends[i] - self.starts[i] for i in idx]
        periods = [b - a for a, b in zip(self.starts, self.starts[1:])]
        decode_tokens = sum(self.tokens[i] for i in idx[1:])
        window = self.ends[idx[-1]] - self.ends[idx[0]] if len(idx) > 1 else 0.0
        return {"steps": len(self.tokens),
                "step_median_us": statistics.median(durations) * 1e6 if durations else None,
                "period_median_us": statistics.median(periods) * 1e6 if periods else None,
                "decode_tok_s": decode_tokens / window if window > 0 else None}


def run_direct(engine, prompts, params) -> tuple[float, int, dict[int, int]]:
    sched = engine.scheduler
    start = time.perf_counter()
    ids = [sched.add_request(p, params) for p in prompts]
    tokens = 0
    while sched.has_unfinished():
        tokens += len(sched.step())
        sched.pop_finished_ids()
    end = time.perf_counter()
    sched.pop_finished_ids()
    counts = {}
    for rid in ids:
        seq = sched.get(rid)
        counts[rid] = seq.num_output_tokens if seq is not None else -1
        sched.discard_request(rid)  # forget the finished request
    return end - start, tokens, counts


def run_sink(engine, prompts, params) -> tuple[float, int, dict[int, int]]:
    manager = StreamingManager(engine)
    try:
        sink: queue.SimpleQueue = queue.SimpleQueue()
        start = time.perf_counter()
        for p in prompts:
            manager.add_request(p, params, sink=sink)
        counts = {}
        while len(counts) < len(prompts):
            rid, item = sink.get()
            if item is END:
                counts[rid] = manager.take_output(rid).output_tokens
        end = time.perf_counter()
    finally:
        manager.close()
    return end - start, sum(counts.values()), counts


def run_streams(engine, prompts, params) -> tuple[float, int, dict[int, int]]:
    manager = StreamingManager(engine)
    go = threading.Event()
    counts: dict[int, int] = {}
    finish = [0.0] * len(prompts)
    errors: list[BaseException] = []

    def consumer(i: int) -> None:
        go.wait()
        try:
            rid = manager.add_request(prompts[i], params)
            stream = manager.stream(rid)
            for _ in stream:
                pass
            finish[i] = time.perf_counter()
            counts[rid] = stream.output.output_tokens
        except BaseException as e:  # reported after the run
            errors.append(e)

    threads = [threading.Thread(target=consumer, args=(i,), daemon=True) for i in range(len(prompts))]
    try:
        for t in threads:
            t.start()
        start = time.perf_counter()
        go.set()
        for t in threads:
            t.join()
    finally:
        manager.close()
    if errors:
        raise errors[0]
    return max(finish) - start, sum(counts.values()), counts


RUNNERS = {"direct": run_direct, "sink": run_sink, "streams": run_streams}


def one_run(engine, mode, prompts, params) -> dict:
    with StepClock(engine.scheduler) as clock:
        wall, tokens, counts = RUNNERS[mode](engine, prompts, params)
    want = params.max_new_tokens
    bad = {rid: n for rid, n in counts.items() if n != want}
    if len(counts) != len(prompts) or bad or tokens != want * len(prompts):
        raise SystemExit(f"{mode}: {len(counts)} of {len(prompts)} requests finished, {tokens} tokens in all; "
                         f"wrong output token counts (want {want} each): {dict(list(bad.items())[:8])}")
    sched = engine.scheduler
    used = sched.block_manager.num_used_blocks
    if used or sched.has_unfinished():
        raise SystemExit(f"{mode}: after the run {used} KV blocks are still in use "
                         f"(unfinished: {sched.has_unfinished()})")
    return {"mode": mode, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, **clock.figures()}


def host_timing(engine, mode, prompts, params) -> dict:
    """One run with Stages host timing on: per-step microseconds of each stage."""
    stages = engine.stages
    stages.reset()
    stages.timing = True
    try:
        one_run(engine, mode, prompts, params)
    finally:
        stages.timing = False
    samples = stages.samples
    out = {}
    step = samples.get("scheduler_step", [])
    if step:
        out["scheduler_step"] = {"count": len(step), "mean_us": statistics.fmean(step) / 1e3,
                                 "median_us": statistics.median(step) / 1e3}
    for row in stage_table(samples):  # the stages inside the step, its remainder, then the manager's
        if row["count"]:
            vals = samples.get(row["stage"])
            out[row["stage"]] = {"count": row["count"], "mean_us": row["mean_us"],
                                 "median_us": statistics.median(vals) / 1e3 if vals else None}
    fan = [a + b for a, b in zip(samples.get("detokenize_fanout", []), samples.get("stream_flush", []))]
    if fan:
        out["fanout_total"] = {"count": len(fan), "mean_us": statistics.fmean(fan) / 1e3,
                               "median_us": statistics.median(fan) / 1e3}
    stages.reset()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--max-batch-size", type=int, default=None, help="default: --num-requests")
    ap.add_argument("--num-gpu-blocks", type=int, default=None)
    ap.add_argument("--stream-interval", type=int, default=1)
    ap.add_argument("--paged-attn", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, default=None,
                    help="default: on with CUDA")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--warmup-runs", type=int, default=1)
    ap.add_argument("--repeat-runs", type=int, default=3)
    ap.add_argument("--no-host-timing", action="store_true", help="skip the extra Stages-timed run per mode")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; modes: {', '.join(MODES)}")

    from rosecli.bench.results import environment
    from rosecli.engine.llm import LLMEngine

    n = args.num_requests
    batch = args.max_batch_size or n
    config = EngineConfig(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                          seed=args.seed, num_gpu_blocks=args.num_gpu_blocks, enable_prefix_cache=False,
                          max_batch_size=batch, prefill_max_batch_size=batch, paged_attn=args.paged_attn,
                          cuda_graph=args.cuda_graph, overlap_schedule=args.overlap_schedule,
                          stream_interval=args.stream_interval, show_progress=False,
                          cache_dir=os.environ.get("ROSE_CACHE_DIR"))  # as the CLI's --cache-dir
    engine = LLMEngine(config)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_on_eos=False)
    # distinct prompts of ordinary (non-special) token ids
    prompts = [[1000 + (i * args.prompt_len + j) % 20000 for j in range(args.prompt_len)] for i in range(n)]

    runs = []
    for r in range(args.warmup_runs + args.repeat_runs):
        warmup = r < args.warmup_runs
        for mode in modes:
            rec = one_run(engine, mode, prompts, params)
            rec["warmup"] = warmup
            runs.append(rec)
            print(f"{'warmup' if warmup else 'run   '} {r + 1:2d} {mode:8s} {rec['tok_s']:10.0f} tok/s  "
                  f"step {rec['step_median_us']:8.1f} us  period {rec['period_median_us']:8.1f} us", flush=True)

    keys = ("tok_s", "decode_tok_s", "step_median_us", "period_median_us", "wall_s")
    summary = {}
    for mode in modes:
        measured = [x for x in runs if x["mode"] == mode and not x["warmup"]]
        summary[mode] = {k: statistics.median(x[k] for x in measured) for k in keys
                         if all(x[k] is not None for x in measured) and measured}
    base = summary.get("direct")
    if base:
        for mode in modes:
            s = summary[mode]
            s["overhead_pct"] = (base["tok_s"] / s["tok_s"] - 1) * 100
            if "decode_tok_s" in s and "decode_tok_s" in base:
                s["decode_overhead_pct"] = (base["decode_tok_s"] / s["decode_tok_s"] - 1) * 100
            s["period_extra_us"] = s["period_median_us"] - base["period_median_us"]

    timing = {}
    if not args.no_host_timing:
        for mode in modes:
            timing[mode] = host_timing(engine, mode, prompts, params)

    env = environment()
    overlap = getattr(engine.scheduler, "overlap", None)
    print(f"\n{engine.model_name} on {env['gpu'] or 'cpu'}, torch {env['torch']}, {n} requests x "
          f"{args.max_new_tokens} new tokens, {args.prompt_len}-token prompts, overlap "
          f"{ {True: 'on', False: 'off'}.get(overlap, '?')}, median of {args.repeat_runs} runs "
          f"(after {args.warmup_runs} warm-up)")
    print(f"{'mode':8s} {'tok/s':>10s} {'decode tok/s':>13s} {'overhead':>9s} {'step us':>9s} {'period us':>10s} "
          f"{'extra us':>9s}")
    for mode in modes:
        s = summary[mode]
        ov = f"{s['overhead_pct']:8.1f}%" if "overhead_pct" in s else f"{'-':>9s}"
        extra = f"{s['period_extra_us']:9.1f}" if "period_extra_us" in s else f"{'-':>9s}"
        dec = f"{s['decode_tok_s']:13.0f}" if "decode_tok_s" in s else f"{'-':>13s}"
        print(f"{mode:8s} {s['tok_s']:10.0f} {dec} {ov} {s['step_median_us']:9.1f} {s['period_median_us']:10.1f} "
              f"{extra}")
    if timing:
        print("\nhost time per step (one extra run per mode with Stages timing on), median / mean us:")
        names = list(dict.fromkeys(k for t in timing.values() for k in t))
        print(f"{'stage':22s} " + " ".join(f"{m:>17s}" for m in modes))
        for name in names:
            cells = []
            for mode in modes:
                v = timing[mode].get(name)
                med = f"{'-':>8s}" if v is None or v["median_us"] is None else f"{v['median_us']:8.1f}"
                cells.append(f"{'-':>17s}" if v is None else f"{med} /{v['mean_us']:7.1f}")
            print(f"{name:22s} " + " ".join(cells))
    if args.out:
        doc = {"command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])), "config": vars(args),
               "environment": env, "overlap_schedule": overlap, "startup": engine.startup_times, "runs": runs,
               "summary": summary, "host_timing_us": timing}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nwrote {args.out}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
