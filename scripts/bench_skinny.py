"""Decode's linear layers on the GPU: cuBLAS (as the models call it today) against `kernels.skinny_gemm`.

For each layer shape of the named models and each row count, times a CUDA graph of one call per copy
of the weights (enough copies to read past the L2 cache, as a decode step's layers do), so the time
per call includes the gaps between kernels in a graph. Prints, per shape: cuBLAS (with its epilogue
kernel where the model has one), the current launch table's choice, and the best config found by a
sweep, in `launch_table.SkinnyLaunch` form.

    python scripts/bench_skinny.py [--rows 1 64] [--models gpt2 smollm2 llama1b qwen1.5b llama8b] [--layers qkv o]
                                   [--sweep]

At 2-64 rows the sweep also tries the TMA-loaded tiles (`SkinnyLaunch.tma`, the last field of a launch); ``--tma``
sweeps those only (16-128 columns, 64/128-wide K steps, split 1-6, then 2-8 warps and 2-6 stages for the best two).

``--pairs`` times instead each add_norm between two of a model's layers, as the decode graphs run it without
the pair: at 2-64 rows the GEMM before (its bias deferred), `norm.add_norm` and the GEMM after; at one row the
GEMM before and the one after with the norm in its prologue (`launch_table.fold_norm`, else add_norm). Against
it the pair `launch_table.stats_fold` gives (`skinny_gemm.skinny_linear_add`, then `skinny_stats_norm_linear`)
on norm-folded copies of the weights and on the weights themselves, the GEMM before also writing the stream times
the norm's scale for the one after ("scaled"); with
``--sweep`` each kernel's launches too.

    python scripts/bench_skinny.py --pairs [--rows 1 16 64] [--models gpt2 smollm2 llama1b qwen1.5b llama8b] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from rosecli.kernels import activation, norm
from rosecli.kernels.launch_table import SkinnyLaunch, fold_norm, skinny_launch, stats_fold
from rosecli.kernels.skinny_gemm import (NormIn, fold_norm_weights, skinny_linear, skinny_linear_add,
                                         skinny_linear_ref, skinny_norm_linear, skinny_stats_norm_linear)

# name -> dtype, [(layer, N, K, bias, activation: True = GELU (tanh), "swiglu" = silu(gate) * up)]
SHAPES = {
    "gpt2": (torch.float16, [("c_attn", 2304, 768, True, False), ("attn_proj", 768, 768, False, False),
                             ("c_fc", 3072, 768, True, True), ("mlp_proj", 768, 3072, False, False)]),
    "smollm2": (torch.float16, [("qkv", 960, 576, False, False), ("o", 576, 576, False, False),
                                ("gate_up", 3072, 576, False, "swiglu"), ("down", 576, 1536, False, False)]),
    "llama1b": (torch.bfloat16, [("qkv", 3072, 2048, False, False), ("o", 2048, 2048, False, False),
                                 ("gate_up", 16384, 2048, False, "swiglu"), ("down", 2048, 8192, False, False)]),
    "qwen1.5b": (torch.bfloat16, [("qkv", 2048, 1536, True, False), ("o", 1536, 1536, False, False),
                                  ("gate_up", 17920, 1536, False, "swiglu"), ("down", 1536, 8960, False, False)]),
    "llama8b": (torch.bfloat16, [("qkv", 6144, 4096, False, False), ("o", 4096, 4096, False, False),
                                 ("gate_up", 28672, 4096, False, "swiglu"), ("down", 4096, 14336, False, False)]),
}


def graph_time_us(fns, reps: int = 30) -> float:
    """Per call: a CUDA graph of ``fns`` (one call each) replayed ``reps`` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(3):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps / len(fns))
    return best


# model -> [(the layer before the norm, the layer after)], and whether its norms are RMSNorms
_LLAMA_PAIRS = ([("o", "gate_up"), ("down", "qkv")], True)
PAIRS = {"gpt2": ([("attn_proj", "c_fc"), ("mlp_proj", "c_attn")], False), "smollm2": _LLAMA_PAIRS,
         "llama1b": _LLAMA_PAIRS, "qwen1.5b": _LLAMA_PAIRS, "llama8b": _LLAMA_PAIRS}


def pairs(models, rows_list, sweep: bool) -> None:
    """The ``--pairs`` figures: us per (GEMM, add_norm, GEMM) against the statistics pair, weights past L2."""
    dev = torch.device("cuda")
    for model in models:
        dtype, layers = SHAPES[model]
        shapes = {name: (N, K, bias, act) for name, N, K, bias, act in layers}
        names, rms = PAIRS[model]
        for before, after in names:
            D, Kp, p_bias, _ = shapes[before]
            N2, _, c_bias, act = shapes[after]
            gelu, swiglu = act is True, act == "swiglu"
            copies = max(2, min(24, math.ceil(160e6 / ((D * Kp + N2 * D) * 2))))
            wps = [torch.randn(D, Kp, device=dev, dtype=dtype) / Kp ** 0.5 for _ in range(copies)]
            wcs = [torch.randn(N2, D, device=dev, dtype=dtype) / D ** 0.5 for _ in range(copies)]
            bp = torch.randn(D, device=dev, dtype=dtype) if p_bias or not rms else None
            bc = torch.randn(N2, device=dev, dtype=dtype) if c_bias else None
            nw = torch.rand(D, device=dev, dtype=dtype) + 0.5
            nb = None if rms else torch.randn(D, device=dev, dtype=dtype)
            folds = [fold_norm_weights(w, nw, nb, 1e-5, rms) for w in wcs]
            scaled = [fold_norm_weights(w, nw, nb, 1e-5, rms, copy=False) for w in wcs]
            n2 = N2 // 2 if swiglu else N2
            for M in rows_list:
                x, res = torch.randn(M, Kp, device=dev, dtype=dtype), torch.randn(M, D, device=dev, dtype=dtype)
                pl, cl = skinny_launch(M, D, Kp), skinny_launch(M, n2, D, swiglu)
                prologue = fold_norm(M, n2, D)  # (one row: the norm in the next GEMM's prologue, as without the pair)

                def plain(wp, wc):
                    if prologue is not None:
                        y, bias = skinny_linear(x, wp, None, launch=pl), bp
                        return skinny_norm_linear(y, NormIn(res, bias, nw, nb, 1e-5, rms), wc, bc, gelu, prologue,
                                                  swiglu)[0]
                    h = norm.add_norm(skinny_linear(x, wp, None, launch=pl), res, nw, nb, 1e-5, bp, rms)[0]
                    return skinny_linear(h, wc, bc, gelu, cl, swiglu)

                def pair(wp, fold, p_cfg, c_cfg):
                    total, st = skinny_linear_add(x, wp, bp, res, rms, p_cfg, fold.scale)
                    return skinny_stats_norm_linear(total, st, fold, bc, gelu, c_cfg, swiglu)

                def t_of(p_cfg, c_cfg, fs=folds):
                    try:
                        fns = [lambda wp=wp, f=f: pair(wp, f, p_cfg, c_cfg) for wp, f in zip(wps, fs)]
                        return graph_time_us(fns)
                    except Exception:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
                        torch.cuda.synchronize()
                        return math.inf

                t_plain = graph_time_us([lambda wp=wp, wc=wc: plain(wp, wc) for wp, wc in zip(wps, wcs)])
                table = stats_fold(M, D, Kp, before=True)
                t_pair = t_of(table, stats_fold(M, n2, D, swiglu))
                t_scaled = t_of(table, stats_fold(M, n2, D, swiglu), scaled)
                line = (f"{model:8s} {before}+norm+{after} M={M:<3d} without the pair {t_plain:6.2f} us | pair "
                        f"{t_pair:6.2f} us ({t_plain / t_pair:4.2f}x) | scaled {t_scaled:6.2f} us "
                        f"({t_plain / t_scaled:4.2f}x) {tuple(table) if table else None}")
                if sweep:
                    cands = [SkinnyLaunch(bn, bk, sp, 4, st) for bn, bk, sp, st
                             in itertools.product((16, 32, 64), (128, 256), (1, 4), (3, 4))]
                    if M == 1:  # vector products: columns per program, K step, warps, stages
                        cands = [SkinnyLaunch(bn, bk, 1, nw, st) for bn, bk, nw, st
                                 in itertools.product((4, 8, 16), (256, 512, 1024), (2, 4), (3, 4, 5))]
                    fs = folds if M > 1 else scaled  # (the fold the table gives these rows)
                    best_p = min(cands, key=lambda c: t_of(c, stats_fold(M, n2, D, swiglu), fs))
                    best_c = min([c for c in cands if c.split_k == 1], key=lambda c: t_of(best_p, c, fs))
                    line += (f" | best {t_of(best_p, best_c, fs):6.2f} us before {tuple(best_p)} "
                             f"after {tuple(best_c)}")
                print(line, flush=True)
            del wps, wcs, folds, scaled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--models", nargs="+", default=list(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also search launch configs")
    ap.add_argument("--pairs", action="store_true", help="the add_norm between two layers (see above)")
    ap.add_argument("--tma", action="store_true", help="at 2-64 rows, sweep the TMA-loaded tiles' launches only")
    ap.add_argument("--layers", nargs="+", help="only these layers (names as printed: qkv, o, gate_up, down, ...)")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if a.pairs:
        return pairs([m for m in a.models if m in PAIRS], a.rows, a.sweep)
    for model in a.models:
        dtype, layers = SHAPES[model]
        for name, N, K, has_bias, act in layers:
            if a.layers and name not in a.layers:
                continue
            gelu, swiglu = act is True, act == "swiglu"
            copies = max(2, min(24, math.ceil(160e6 / (N * K * 2))))
            ws = [torch.randn(N, K, device=dev, dtype=dtype) / K ** 0.5 for _ in range(copies)]
            b = torch.randn(N, device=dev, dtype=dtype) if has_bias else None
            for M in a.rows:
                x = torch.randn(M, K, device=dev, dtype=dtype)
                if swiglu:
                    ref_fns = [lambda w=w: activation.silu_mul(torch.nn.functional.linear(x, w)) for w in ws]
                elif gelu:
                    ref_fns = [lambda w=w: activation.bias_gelu(torch.nn.functional.linear(x, w), b) for w in ws]
                else:
                    ref_fns = [lambda w=w: torch.nn.functional.linear(x, w, b) for w in ws]
                t_ref = graph_time_us(ref_fns)
                ref = skinny_linear_ref(x.double(), ws[0].double(), None if b is None else b.double(), gelu, swiglu)
                err = (skinny_linear(x, ws[0], b, gelu, swiglu=swiglu).double() - ref).abs().max().item()

                def t_of(cfg):
                    try:
                        return graph_time_us([lambda w=w: skinny_linear(x, w, b, gelu, cfg, swiglu) for w in ws])
                    except Exception:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
                        torch.cuda.synchronize()
                        return math.inf

                cfg0 = skinny_launch(M, N // 2 if swiglu else N, K, swiglu)  # (None: the table keeps cuBLAS)
                t0 = t_of(cfg0) if cfg0 is not None else t_ref
                line = (f"{model:9s} {name:9s} M={M:<3d} N={N:<6d} K={K:<6d} cublas {t_ref:7.2f} us | table {t0:7.2f} us "
                        f"({t_ref / t0:4.2f}x) {tuple(cfg0) if cfg0 is not None else 'cuBLAS'} err {err:.1e} | "
                        f"floor {N * K * 2 / 3.05e6:6.2f} us")
                if a.sweep or (a.tma and M > 1):
                    bns = (4, 8, 16, 32) if M == 1 else (16, 32, 64)
                    bks = (128, 256, 512) if M == 1 else (64, 128, 256)
                    found = []
                    for bn, bk, sp in itertools.product(bns, bks, (1, 2, 4, 8)) if not a.tma else ():
                        if sp > 1 and K // sp < bk:
                            continue
                        cfg = SkinnyLaunch(bn, bk, sp, 4, 3)
                        found.append((t_of(cfg), cfg))
                    if M > 1:  # the TMA-loaded tiles (`SkinnyLaunch.tma`), 4 stages; 16-32 columns: more programs
                        # stream a small layer's weights (the 1B's 64-row o runs 32 programs of 64)
                        for bn, bk, sp in itertools.product((16, 32, 64, 128), (64, 128), (1, 2, 4, 6)):
                            if not (sp > 1 and K // sp < 2 * bk):
                                cfg = SkinnyLaunch(bn, bk, sp, 4, 4, True)
                                found.append((t_of(cfg), cfg))
                    found.sort()
                    for _, c in found[:2]:
                        for nw, ns in itertools.product((2, 4, 8), (2, 3, 4, 5, 6)):
                            cfg = c._replace(num_warps=nw, num_stages=ns)
                            found.append((t_of(cfg), cfg))
                    found.sort()
                    tb, cb = found[0]
                    line += f" | best {tb:7.2f} us ({t_ref / tb:4.2f}x) {tuple(cb)}"
                print(line, flush=True)
            del ws


if __name__ == "__main__":
    main()
