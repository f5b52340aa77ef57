"""Where a decode step's device time goes: graph-replay time per batch size (CUDA events over
back-to-back replays, so host work is not counted) and the kernels of one eager step (torch
profiler: count and device time by kernel name).

    python scripts/profile_decode_step.py [--model gpt2] [--batch-sizes 1 64] [--context 128]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rosecli.engine.config import EngineConfig, SamplingParams  # noqa: E402
from rosecli.engine.llm import LLMEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=128, help="tokens already in each sequence's cache")
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_decode_step.py needs a CUDA GPU")
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", device="cuda", show_progress=False,
                                    cache_dir=os.environ.get("ROSE_CACHE_DIR"),
                                    max_batch_size=max(args.batch_sizes), enable_prefix_cache=False))
    sched, runner = engine.scheduler, engine.runner
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, model {args.model}, context {args.context}")
    for batch in args.batch_sizes:
        for i in range(batch):
            sched.add_request([100 + i] * args.context, SamplingParams(max_new_tokens=4 * args.replays,
                                                                       stop_on_eos=False))
        while sched.last_step_kind != "decode" or sched.prefilling or sched.waiting:
            sched.step()
        seqs = list(sched.running)
        graph = runner.graphs.get(runner.padded_batch(batch))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.replays):
            graph.graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_us = start.elapsed_time(end) * 1e3 / args.replays
        # one eager step under the profiler: which kernels, how many, how long
        meta = runner._meta_for(batch, max(len(s.token_ids) for s in seqs))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with torch.inference_mode():
                runner._decode_forward(batch, meta)
            torch.cuda.synchronize()
        kernels = collections.defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                k = kernels[ev.name[:70]]
                k[0] += 1
                k[1] += ev.device_time
        total_n = sum(k[0] for k in kernels.values())
        total_us = sum(k[1] for k in kernels.values())
        print(f"B={batch}: graph replay {replay_us:.1f} us/step ({batch / replay_us * 1e6:,.0f} tok/s device-bound); "
              f"eager step: {total_n} kernels, {total_us:.1f} us of kernel time")
        for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:14]:
            print(f"   {n:4d} x {us / n:6.2f} us  {name}")
        for s in seqs:
            sched.discard_request(s.request_id)
        while sched.has_unfinished():
            sched.step()
    engine.close()


if __name__ == "__main__":
    main()
