"""The device's argmax work in a decode step whose grammar rows are greedy (issue 22), as the engine did it before
and does it now, timed as CUDA graphs of 20 calls (us per call; each form twice, interleaved):

- before: the step's split argmax writes the float32 logits, and the masked argmax reads them;
- now: the split argmax writes nothing, and the masked argmax reads the logits GEMM's raw output (half precision,
  padded columns), which holds the same values.

Both forms' ids are checked equal first. Shapes: GPT-2's vocabulary (fp16, 50,257 padded to 50,304) and Llama 3's
(bf16, 128,256), at 1, 16 and 64 rows.

    python scripts/bench_grammar_argmax.py [--rows 1 16 64]
"""

import argparse

import torch
from bench_skinny import graph_time_us  # (scripts/ is the path's first entry)

from rosecli.kernels.argmax import logits_argmax, masked_argmax

SHAPES = {"gpt2": (50257, 50304, torch.float16), "llama3": (128256, 128256, torch.bfloat16)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    a = ap.parse_args()
    dev = torch.device("cuda")
    for name, (V, width, dtype) in SHAPES.items():
        for B in a.rows:
            raw = torch.randn(B, width, device=dev).to(dtype)
            bits = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), dtype=torch.int32, device=dev)
            on, off = torch.ones(1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
            out = torch.empty(B, dtype=torch.long, device=dev)
            logits, _ = logits_argmax(raw, V, store_flag=on)
            if not torch.equal(masked_argmax(raw, bits, V), masked_argmax(logits, bits)):
                raise SystemExit(f"{name} B={B}: the two forms' ids differ")

            def before():
                masked_argmax(logits_argmax(raw, V, store_flag=on)[0], bits, out=out)

            def now():
                logits_argmax(raw, V, store_flag=off)
                masked_argmax(raw, bits, V, out=out)

            t = [graph_time_us([f] * 20) for f in (before, now, before, now)]
            print(f"{name:6s} B={B:<3d} before {t[0]:6.2f} {t[2]:6.2f} us | now {t[1]:6.2f} {t[3]:6.2f} us | "
                  f"{(t[1] + t[3]) / (t[0] + t[2]) - 1:+.1%}", flush=True)


if __name__ == "__main__":
    main()
