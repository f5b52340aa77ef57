"""What a kernel pays when its code is not in L2 (CUDA): a decode step streams more bytes of weights than the
L2 holds between two launches of the same kernel (a 1B layer reads ~150 MB; the H200's L2 is 50 MB), so each
launch may fetch its instructions from device memory.

For each kernel, CUDA graphs of ``--launches`` launches, each after a streaming read of ``--flush-mb`` (256 MB:
nothing from before it stays in L2; `kernels.stream_read`): the kernel alone after each read (its code, weights
and inputs all cold), and the same kernel first on another weight copy and input, then on its own (its code warm,
its weights and inputs still cold). Per launch, each minus the graph without the kernel in question:

    cold everything  = (read, f) - (read)
    warm code        = (read, g, f) - (read, g)        g: the same kernel on other data
    code's cost      = cold everything - warm code

The weights rotate over copies past the L2 in every graph. Run with ``ROSE_PDL=0``: with PDL the kernel after g
would start during g's tail, and the difference would hold that overlap too. Kernels: the skinny GEMM at the
launch table's choice for each layer of ``--models`` (bench_skinny's shapes) at ``--rows``; `norm.add_norm` on
rows of the model's width.

    ROSE_PDL=0 python scripts/bench_cold_code.py [--models llama1b gpt2] [--rows 1 64] [--launches 24]

First run (H200, with PDL, only the "cold everything" figure against a 2 MB read between launches): the one-row
GEMMs of Llama-3.2-1B and GPT-2 within -0.85..+0.58 us of warm, so at one row their code costs nothing
measurable; at 64 rows +0.3..+1.5 us, which cold inputs (64 rows of x, 100-260 KB) could explain as well
(docs/performance.md).
"""

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_skinny import SHAPES, graph_time_us  # noqa: E402

from rosecli.kernels import norm  # noqa: E402
from rosecli.kernels.launch_table import skinny_launch  # noqa: E402
from rosecli.kernels.skinny_gemm import skinny_linear  # noqa: E402
from rosecli.kernels.stream_read import stream_read_sum  # noqa: E402


def graph_us(fns) -> float:
    """Per replay: a CUDA graph of ``fns`` (bench_skinny's timing, which gives it per call)."""
    return graph_time_us(fns) * len(fns)


class Reader:
    """A streaming read of ``mb`` megabytes (its own buffer), as a launch to interleave."""

    def __init__(self, mb: int, dev):
        self.x = torch.ones(mb << 19, dtype=torch.float16, device=dev)  # (2 bytes an element)
        self.out = torch.empty(max(1, min(1024, self.x.numel() // 4096)), dtype=torch.float32, device=dev)

    def __call__(self):
        stream_read_sum(self.x, self.out)


def cold_cost(fs, gs, flush: Reader) -> tuple[float, float, float]:
    """fs, gs: launches of one kernel on different data. -> (us a launch with its code warm, with everything
    cold, the difference)."""
    n = len(fs)
    t_flush = graph_us([flush] * n)
    t_g = graph_us([h for g in gs for h in (flush, g)])
    cold = (graph_us([h for f in fs for h in (flush, f)]) - t_flush) / n
    warm = (graph_us([h for g, f in zip(gs, fs) for h in (flush, g, f)]) - t_g) / n
    return warm, cold, cold - warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama1b"], choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--launches", type=int, default=24)
    ap.add_argument("--flush-mb", type=int, default=256)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    flush = Reader(a.flush_mb, dev)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, f"read between launches: {a.flush_mb} MB, "
          f"PDL {'off' if os.environ.get('ROSE_PDL') == '0' else 'on (set ROSE_PDL=0)'}", flush=True)

    def line(what, warm, cold, extra):
        print(f"{what}: code warm {warm:7.2f} us, all cold {cold:7.2f} us: code +{extra:5.2f} us a launch", flush=True)

    for model in a.models:
        dtype, layers = SHAPES[model]
        for name, N, K, has_bias, act in layers:
            swiglu, gelu = act == "swiglu", act is True
            copies = max(3, min(a.launches + 1, math.ceil(160e6 / (N * K * 2))))
            ws = [torch.randn(N, K, device=dev, dtype=dtype) / K ** 0.5 for _ in range(copies)]
            b = torch.randn(N, device=dev, dtype=dtype) if has_bias else None
            for M in a.rows:
                launch = skinny_launch(M, N // 2 if swiglu else N, K, swiglu)
                if launch is None:
                    continue  # (cuBLAS's at these rows)
                x, x2 = (torch.randn(M, K, device=dev, dtype=dtype) for _ in range(2))
                fs = [lambda w=ws[i % copies]: skinny_linear(x, w, b, gelu, launch, swiglu) for i in range(a.launches)]
                gs = [lambda w=ws[(i + 1) % copies]: skinny_linear(x2, w, b, gelu, launch, swiglu)
                      for i in range(a.launches)]
                line(f"{model:9s} {name:8s} rows {M:<3d} {tuple(launch)}", *cold_cost(fs, gs, flush))
            del ws
        width = layers[1][2]
        for M in a.rows:
            x, r, x2, r2 = (torch.randn(M, width, device=dev, dtype=dtype) for _ in range(4))
            w = torch.ones(width, device=dev, dtype=dtype)
            fs = [lambda: norm.add_norm(x, r, w, None, 1e-5, rms=True)] * a.launches
            gs = [lambda: norm.add_norm(x2, r2, w, None, 1e-5, rms=True)] * a.launches
            line(f"{model:9s} add_norm rows {M:<3d}", *cold_cost(fs, gs, flush))
    t = graph_us([flush] * 8) / 8
    print(f"the read alone: {a.flush_mb} MB in {t:.2f} us ({a.flush_mb * 1.048576e6 / t / 1e3:.0f} GB/s)")

if __name__ == "__main__":
    main()
