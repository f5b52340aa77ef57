"""The engine's host time per decode step, with the model's forward taken out: W1's shape (64
requests, GPT-2's vocabulary and tokenizer, every request greedy, no stop on EOS) run through
`LLMEngine.generate` on the CPU, where the decode forward is replaced by a lookup of random ids
(varied, so the detokenizer sees real tokens). What is left is everything the host does per step:
scheduling, staging the inputs, sampling's bookkeeping, reading the ids back, stop checks and the
detokenizer's fan-out onto the requests' queues. On a GPU this work runs beside the device's step
(overlap scheduling); once it is longer than the step, the host bounds throughput, and it is the
slack a grammar's mask needs (docs/performance.md, "The host's time per decode step").

    python scripts/bench_host_step.py [--rows 64] [--tokens 256] [--repeats 5] [--stop-strings]

Prints the host microseconds of a decode step (the median step of each run; the best run) and the
median of each stage in the last run. For before/after figures, run it from both trees alternately
(``PYTHONPATH=/path/to/other/tree python scripts/bench_host_step.py``).
"""

import argparse
import os
import random
import statistics

import torch

from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.llm import LLMEngine
from rosecli.engine.stages import Stages


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stop-strings", action="store_true", help="each request has a stop string (never met)")
    ap.add_argument("--model", default="gpt2")
    args = ap.parse_args()

    stages = Stages(timing=True)
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", device="cpu", dummy_layers=1,
                                    show_progress=False, enable_prefix_cache=False, max_batch_size=args.rows,
                                    prefill_max_tokens=args.rows * args.prompt_tokens,
                                    num_gpu_blocks=args.rows * (-(-(args.prompt_tokens + args.tokens) // 16) + 1),
                                    cache_dir=os.environ.get("ROSE_CACHE_DIR", os.path.expanduser("~/.cache/rosecli"))),
                       stages=stages)
    runner = engine.runner
    vocab = runner.sampler.vocab_size
    rng = torch.Generator().manual_seed(0)
    table = torch.randint(256, min(vocab, 50000), (97, args.rows), generator=rng)  # ids past the single bytes
    logits = torch.zeros(args.rows, vocab)
    count = [0]

    def forward(batch, meta):
        count[0] += 1
        greedy = table[count[0] % table.shape[0], :batch]
        runner.dev_staging.tokens[:batch].copy_(greedy)
        return logits[:batch], greedy, None

    runner._decode_forward = forward
    rnd = random.Random(0)
    prompts = [[rnd.randrange(256, 50000) for _ in range(args.prompt_tokens)] for _ in range(args.rows)]
    params = SamplingParams(max_new_tokens=args.tokens, stop_on_eos=False,
                            stop=["\x00never\x00"] if args.stop_strings else [])
    engine.generate(prompts[:8], params)  # warm-up
    per_step = []
    for _ in range(args.repeats):
        stages.samples.clear()
        engine.generate(prompts, params)
        # one loop iteration: the scheduler's step, then the fan-out of its tokens (the first is the prefill)
        loop = [sum(x) for x in zip(*(stages.samples[n] for n in ("scheduler_step", "detokenize_fanout",
                                                                   "stream_flush")))][1:]
        per_step.append(statistics.median(loop) / 1e3)
    print(f"{args.rows} rows x {args.tokens} tokens: host time per decode step {min(per_step):.1f} us "
          f"(median step of each run, best of {args.repeats}: {', '.join(f'{x:.1f}' for x in per_step)})")
    for name, xs in sorted(stages.samples.items(), key=lambda kv: -sum(kv[1])):
        if name not in ("scheduler_step", "prefill_forward", "prefill_admission"):
            print(f"  {name:20s} {len(xs):5d} x {statistics.median(xs) / 1e3:8.1f} us (median)")
    engine.close()


if __name__ == "__main__":
    main()
