"""What the first requests after start-up pay that later ones do not (CUDA; BENCHMARKS.md's W1-cold): W1's burst
(64 prompts "i Hello", GPT-2 shape, dummy weights) through `LLMEngine.generate` right after start-up, then again;
each round's host time per engine stage (every sample of the first round, the median of the second), the Triton
variants met after start-up (a disk-cache load costs milliseconds), and with --profile the torch profiler's table
of the first round (self CPU time per op: a kernel whose module CUDA loads lazily shows as a slow launch).

    python scripts/probe_cold_start.py [--model gpt2] [--prompts 64] [--profile]
"""

import argparse
import os
import statistics
import time

from triton import knobs

from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.llm import LLMEngine
from rosecli.engine.stages import INSIDE_STEP, Stages


def _round(engine, stages, prompts, params, label, every):
    stages.samples.clear()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    wall = (time.perf_counter() - t0) * 1e3
    print(f"{label}: {wall:.2f} ms in all")
    for name in INSIDE_STEP:
        xs = [x / 1e3 for x in stages.samples.get(name, [])]
        if not xs:
            continue
        shown = ", ".join(f"{x:.0f}" for x in xs[:8]) + (" ..." if len(xs) > 8 else "")
        print(f"  {name:18s} {len(xs):3d} x median {statistics.median(xs):8.1f} us" + (f"  [{shown}]" if every else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    stages = Stages(timing=True)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", device="cuda", show_progress=False,
                                    max_batch_size=args.prompts, enable_prefix_cache=False,
                                    cache_dir=os.environ.get("ROSE_CACHE_DIR")), stages=stages)
    print(f"start-up {time.perf_counter() - t0:.1f} s")
    met = []

    def hook(*a, **kw):
        fn = kw.get("fn")
        met.append(f"{getattr(getattr(fn, 'fn', fn), '__name__', fn)} {kw.get('repr', '')[:160]}")
        return False

    knobs.runtime.jit_cache_hook = hook
    prompts = [f"{i} Hello" for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=4, stop_on_eos=False)
    try:
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _round(engine, stages, prompts, params, "first round (profiled)", True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        else:
            _round(engine, stages, prompts, params, "first round", True)
        print("Triton variants met after start-up:", met or "none")
        met.clear()
        _round(engine, stages, prompts, params, "second round", True)
        print("Triton variants met in the second round:", met or "none")
    finally:
        knobs.runtime.jit_cache_hook = None
        engine.close()


if __name__ == "__main__":
    main()
