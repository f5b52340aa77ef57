"""`rotary.rotary_kv` on the GPU: each launch (heads per program, warps) for the Llama-family shapes at decode's
row counts, timed as a CUDA graph of one call per copy of the projection's output. Prints the launch
`launch_table.rotary_launch` gives and the best found; group 1 is one program per head (the form before).

    python scripts/bench_rotary.py [--tokens 1 16 64 256] [--models smollm2 llama1b qwen1.5b llama8b]
"""

import argparse
import itertools
import math

import torch
from bench_skinny import graph_time_us  # (scripts/ is the path's first entry)

from rosecli.kernels.launch_table import rotary_launch
from rosecli.kernels.rotary import rotary_kv

# name -> (q heads, kv heads, head_dim)
SHAPES = {"smollm2": (9, 3, 64), "llama1b": (32, 8, 64), "qwen1.5b": (12, 2, 128), "llama8b": (32, 8, 128)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--models", nargs="+", default=list(SHAPES))
    a = ap.parse_args()
    dev, dtype, copies, bs = torch.device("cuda"), torch.bfloat16, 16, 16
    for model in a.models:
        heads, kvh, hd = SHAPES[model]
        pos_table = torch.arange(4096, device=dev, dtype=torch.float32)[:, None] * 1e-3 + torch.arange(hd, device=dev)
        cos, sin = pos_table.cos(), pos_table.sin()
        for n in a.tokens:
            qkvs = [torch.randn(n, (heads + 2 * kvh) * hd, device=dev, dtype=dtype) for _ in range(copies)]
            blocks = 4 + n // bs
            kc = torch.zeros(blocks, kvh, bs, hd, device=dev, dtype=dtype)
            vc = torch.zeros_like(kc)
            pos = torch.randint(0, 4096, (n,), device=dev)
            slots = torch.randperm(blocks * bs, device=dev)[:n]

            def t_of(group, warps):
                try:
                    return graph_time_us([lambda q=q: rotary_kv(q, pos, cos, sin, kc, vc, slots, heads, kvh, group=group,
                                                                num_warps=warps) for q in qkvs], reps=50)
                except Exception:  # noqa: BLE001 - a launch that does not compile is not a candidate
                    torch.cuda.synchronize()
                    return math.inf

            table = rotary_launch(n, hd)
            t_table = t_of(*table)
            t_one = t_of(1, 1 if hd <= 128 else 2)
            found = sorted((t_of(g, w), (g, w)) for g, w in itertools.product((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8))
                           if g <= 1 << (heads + kvh - 1).bit_length())
            tb, cb = found[0]
            print(f"{model:9s} tokens={n:<4d} one head/program {t_one:6.2f} us | table {table} {t_table:6.2f} us | "
                  f"best {cb} {tb:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
