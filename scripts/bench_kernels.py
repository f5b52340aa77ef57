"""Paged decode attention on the GPU: time per call, achieved bandwidth against the copy
ceiling, and SDPA on the same data laid out contiguously.

    python scripts/bench_kernels.py [--out kernels.json]

Bytes counted per call: K and V of every context token (read once), q read, out written.
Time: triton.testing.do_bench median over fresh inputs (several input sets rotated).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from rosecli.kernels.paged_decode import decode_launch, paged_decode_attention
from rosecli.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from rosecli.kernels.store_kv import store_kv_cache, store_kv_cache_ref

CEILING_GBS = 2975.0


def copy_ceiling() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.float16, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() * 2 / (ms * 1e-3) / 1e9


def bench_decode(batch, ctx, heads, kv_heads, head_dim=64, block_size=16, dtype=torch.float16):
    nblk = batch * (ctx // block_size + 1)
    k_cache = torch.randn(nblk, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(nblk, device="cuda", dtype=torch.int32)[:batch * (ctx // block_size + 1)]
    tables = tables.view(batch, -1).contiguous()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype) for _ in range(4)]
    it = iter(range(10**9))
    ms = triton.testing.do_bench(
        lambda: paged_decode_attention(qs[next(it) % 4], k_cache, v_cache, tables, lens, 0.125, ctx),
        warmup=25, rep=200, return_mode="median")
    nbytes = 2 * batch * ctx * kv_heads * head_dim * 2 + 2 * batch * heads * head_dim * 2
    # SDPA on contiguous [B, H, L, D] (heads expanded for GQA, as SDPA's fast kernels want)
    kc = torch.randn(batch, heads, ctx, head_dim, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    q4 = qs[0].unsqueeze(2)
    sdpa_ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q4, kc, vc), warmup=25, rep=200,
                                      return_mode="median")
    splits = decode_launch(batch, kv_heads, ctx, block_size)[0]
    return {"batch": batch, "context": ctx, "heads": heads, "kv_heads": kv_heads, "splits": splits, "ms": ms,
            "GB/s": nbytes / (ms * 1e-3) / 1e9, "sdpa_ms": sdpa_ms}


def sweep() -> None:
    """Try launch settings per shape and print the fastest (to fill the launch table)."""
    for heads, kv in ((12, 12), (9, 3)):
        for batch, ctx in ((1, 1024), (1, 4096), (8, 1024), (64, 1024), (64, 4096), (256, 1024)):
            nblk = batch * (ctx // 16 + 1)
            kc = torch.randn(nblk, 16, kv, 64, device="cuda", dtype=torch.float16)
            vc = torch.randn_like(kc)
            tables = torch.randperm(nblk, device="cuda", dtype=torch.int32).view(batch, -1).contiguous()
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, heads, 64, device="cuda", dtype=torch.float16)
            nbytes = 2 * batch * ctx * kv * 64 * 2
            res = []
            for use_dot in (False, True):
                for tile in (32, 64, 128):
                    for warps in (2, 4, 8):
                        for target in (264, 528, 1056):
                            try:
                                ms = triton.testing.do_bench(
                                    lambda: paged_decode_attention(q, kc, vc, tables, lens, 0.125, ctx, tile, warps,
                                                                   use_dot, target),
                                    warmup=10, rep=40, return_mode="median")
                            except Exception as e:  # a config that does not compile is skipped
                                print("skip", use_dot, tile, warps, target, type(e).__name__)
                                continue
                            res.append((ms, use_dot, tile, warps, target))
            res.sort()
            best = res[0]
            print(f"H={heads}/{kv} B={batch} ctx={ctx}: best {best[0] * 1e3:.1f} us "
                  f"({nbytes / (best[0] * 1e-3) / 1e9:.0f} GB/s) dot={best[1]} tile={best[2]} warps={best[3]} "
                  f"target={best[4]}; next {[(round(r[0] * 1e3, 1),) + r[1:] for r in res[1:4]]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    if args.sweep:
        sweep()
        return
    ceiling = copy_ceiling()
    print(f"copy ceiling measured: {ceiling:.0f} GB/s (reference {CEILING_GBS:.0f})")
    rows = []
    for heads, kv in ((12, 12), (9, 3)):
        for batch in (1, 8, 64, 256):
            for ctx in (128, 1024, 4096):
                r = bench_decode(batch, ctx, heads, kv)
                r["pct_ceiling"] = 100 * r["GB/s"] / CEILING_GBS
                rows.append(r)
                print(f"H={heads:2d}/{kv:2d} B={batch:4d} ctx={ctx:5d} splits={r['splits']:3d} "
                      f"{r['ms'] * 1e3:8.1f} us {r['GB/s']:7.0f} GB/s ({r['pct_ceiling']:5.1f}%)  "
                      f"SDPA {r['sdpa_ms'] * 1e3:8.1f} us  ratio {r['sdpa_ms'] / r['ms']:5.2f}x", flush=True)
    # prefill and store on a representative shape
    lens, bs, heads, kv, d = [512] * 8, 16, 12, 12, 64
    nblk = sum(n // bs for n in lens)
    kc = torch.randn(nblk, bs, kv, d, device="cuda", dtype=torch.float16)
    vc = torch.randn_like(kc)
    tables = torch.arange(nblk, device="cuda", dtype=torch.int32).view(len(lens), -1)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens), heads, d, device="cuda", dtype=torch.float16)
    tri = triton.testing.do_bench(lambda: paged_prefill_attention(q, kc, vc, tables, cu, ctx, 512, 512, 0.125),
                                  return_mode="median")
    ref = triton.testing.do_bench(lambda: paged_prefill_attention_ref(q, kc, vc, tables, cu, ctx, 512, 512, 0.125),
                                  return_mode="median")
    print(f"prefill 8x512 tokens: triton {tri * 1e3:.1f} us, gather+SDPA reference {ref * 1e3:.1f} us")
    key = torch.randn(4096, kv, d, device="cuda", dtype=torch.float16)
    slots = torch.randperm(nblk * bs, device="cuda")[:4096]
    st = triton.testing.do_bench(lambda: store_kv_cache(key, key, kc, vc, slots), return_mode="median")
    sr = triton.testing.do_bench(lambda: store_kv_cache_ref(key, key, kc, vc, slots), return_mode="median")
    print(f"store 4096 tokens: triton {st * 1e3:.1f} us, index_copy reference {sr * 1e3:.1f} us")
    rows.append({"prefill_triton_ms": tri, "prefill_ref_ms": ref, "store_triton_ms": st, "store_ref_ms": sr,
                 "copy_ceiling_GBs": ceiling})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
