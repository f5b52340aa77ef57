"""Host and device time of a small prefill on CUDA (docs/performance.md, "A prefill is bound by the host's
launches" and "Small prefills as CUDA graphs"): W1's burst (64 prompts of 2-3 tokens, GPT-2 shape, dummy
weights) through `LLMEngine.generate` with 2 new tokens, 3 warm-up rounds, then the median host time of each
engine stage over 5 rounds, and the torch profiler's table of one round (self CPU time per op, and the
device time of all its kernels).

    python scripts/probe_prefill.py [--model gpt2] [--prompts 64]      # ROSE_PREFILL_GRAPHS=0 to compare
"""

import argparse
import os
import statistics

from torch.profiler import ProfilerActivity, profile

from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.llm import LLMEngine
from rosecli.engine.stages import Stages


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--prompts", type=int, default=64)
    args = ap.parse_args()
    stages = Stages(timing=True)
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", device="cuda", show_progress=False,
                                    max_batch_size=args.prompts, enable_prefix_cache=False,
                                    cache_dir=os.environ.get("ROSE_CACHE_DIR")), stages=stages)
    prompts = [f"{i} Hello" for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=2, stop_on_eos=False)
    try:
        for _ in range(3):
            engine.generate(prompts, params)
        stages.samples.clear()
        for _ in range(5):
            engine.generate(prompts, params)
        for name in ("prefill_admission", "prepare_inputs", "h2d_copy", "prefill_forward", "sampling", "d2h_copy"):
            xs = stages.samples.get(name, [])
            median = statistics.median(xs) / 1e3 if xs else 0.0
            print(f"{name:18s} {len(xs):3d} x {median:9.1f} us (median host time)")
        print("prefill graphs:", "on" if engine.runner.prefill_graphs is not None else "off")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        print(f"device events: {len(kernels)}, device time {sum(e.device_time for e in kernels):.1f} us")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
