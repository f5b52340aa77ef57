"""Kernel benchmarks on the GPU: paged decode attention against the copy ceiling and SDPA, plus the
prefill and store kernels against their torch references.

    python scripts/bench_kernels.py [--out kernels.json]     # the table (about 1-2 minutes on an H100)
    python scripts/bench_kernels.py --sweep [--out sweep.json]  # launch configs per shape, for launch_table.py

Decode bytes per call: K and V of every context token (read once) + q read + out written.
Times are `triton.testing.do_bench` medians (it flushes L2 before each call); small shapes also
rotate over several freshly drawn input sets.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rosecli.kernels import launch_table  # noqa: E402
from rosecli.kernels.paged_decode import decode_launch, paged_decode_attention  # noqa: E402
from rosecli.kernels.prefill_attention import (paged_prefill_attention, paged_prefill_attention_ref,  # noqa: E402
                                               prefill_launch)
from rosecli.kernels.store_kv import store_kv_cache, store_kv_cache_ref  # noqa: E402

CEILING_GBS = 2975.0  # H100 device-to-device copy, bytes read + written (BENCHMARKS.md)
SHAPES = {"gpt2": (12, 12), "smollm2": (9, 3)}  # heads, kv heads; head_dim 64
HEAD_DIM, BLOCK_SIZE, DTYPE, SCALE = 64, 16, torch.float16, 0.125
ROTATE_BYTES = 256 << 20  # rotate input sets until this many bytes are in play (at most 8 sets)


def bench(fn, warmup=25, rep=100) -> float:
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def rotating(fns):
    """One callable that runs the next of ``fns`` on each call."""
    it = itertools.cycle(fns)
    return lambda: next(it)()


def decode_inputs(batch, ctx, heads, kv_heads):
    """Shuffled block tables over a pool with one spare block per sequence; every length = ctx."""
    blocks_per_seq = math.ceil(ctx / BLOCK_SIZE)
    nblk = batch * (blocks_per_seq + 1)
    k_cache = torch.randn(nblk, BLOCK_SIZE, kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(nblk, device="cuda")[:batch * blocks_per_seq].view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    return q, k_cache, v_cache, tables, lens


def decode_bytes(batch, ctx, heads, kv_heads):
    elem = torch.finfo(DTYPE).bits // 8
    return 2 * batch * ctx * kv_heads * HEAD_DIM * elem + 2 * batch * heads * HEAD_DIM * elem


def n_sets(nbytes):
    return max(1, min(8, ROTATE_BYTES // max(1, nbytes)))


def bench_decode(batch, ctx, heads, kv_heads) -> dict:
    nbytes = decode_bytes(batch, ctx, heads, kv_heads)
    sets = [decode_inputs(batch, ctx, heads, kv_heads) for _ in range(n_sets(nbytes))]
    ms = bench(rotating([lambda s=s: paged_decode_attention(*s, SCALE, ctx) for s in sets]))
    del sets
    # SDPA on the same data laid out contiguously, [B, H, L, D]. For GQA both ways are timed and the
    # faster kept: enable_gqa (same bytes; some SDPA backends refuse it) and K/V expanded to every query head.
    sdpa_sets = []
    for _ in range(n_sets(nbytes)):
        q = torch.randn(batch, heads, 1, HEAD_DIM, device="cuda", dtype=DTYPE)
        k = torch.randn(batch, kv_heads, ctx, HEAD_DIM, device="cuda", dtype=DTYPE)
        sdpa_sets.append((q, k, torch.randn_like(k)))
    sdpa = {}
    if heads == kv_heads:
        sdpa["mha"] = bench(rotating([lambda s=s: F.scaled_dot_product_attention(*s, scale=SCALE)
                                      for s in sdpa_sets]))
    else:
        try:
            sdpa["enable_gqa"] = bench(rotating([lambda s=s: F.scaled_dot_product_attention(*s, scale=SCALE,
                                                                                              enable_gqa=True)
                                                 for s in sdpa_sets]))
        except RuntimeError:
            pass
        group = heads // kv_heads
        sdpa_sets = [(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) for q, k, v in sdpa_sets]
        sdpa["expanded"] = bench(rotating([lambda s=s: F.scaled_dot_product_attention(*s, scale=SCALE)
                                           for s in sdpa_sets]))
    del sdpa_sets
    sdpa_how = min(sdpa, key=sdpa.get)
    sdpa_ms = sdpa[sdpa_how]
    gbs = nbytes / (ms * 1e-3) / 1e9
    cfg = decode_launch(batch, heads, kv_heads, HEAD_DIM, BLOCK_SIZE, ctx)
    return {"kernel": "paged_decode", "batch": batch, "context": ctx, "heads": heads, "kv_heads": kv_heads,
            "launch": cfg, "us": ms * 1e3, "GB/s": gbs, "pct_ceiling": 100 * gbs / CEILING_GBS,
            "sdpa_us": sdpa_ms * 1e3, "sdpa_over_ours": sdpa_ms / ms, "sdpa_layout": sdpa_how}


def prefill_inputs(new, prefix, heads, kv_heads):
    lens = [n + p for n, p in zip(new, prefix)]
    per_seq = [math.ceil(n / BLOCK_SIZE) for n in lens]
    nblk = sum(per_seq)
    k_cache = torch.randn(nblk, BLOCK_SIZE, kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(nblk, device="cuda").to(torch.int32)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device="cuda")
    pos = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = perm[pos:pos + nb]
        pos += nb
    cu = torch.tensor([0] + list(itertools.accumulate(new)), dtype=torch.int32, device="cuda")
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(new), heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    return (q, k_cache, v_cache, tables, cu, ctx, max(new), max(lens), SCALE)


def prefill_flops(new, prefix, heads):
    # causal: query j of a run of n new tokens after p cached ones sees p + j + 1 keys; 2 matmuls x 2 flops
    keys = sum(n * p + n * (n + 1) // 2 for n, p in zip(new, prefix))
    return 4 * keys * heads * HEAD_DIM


PREFILL_CASES = {"8 prompts x 512 new": ([512] * 8, [0] * 8),
                 "4 chunks of 256 after 1024 cached": ([256] * 4, [1024] * 4)}


def bench_prefill(name, new, prefix, heads, kv_heads) -> dict:
    args = prefill_inputs(new, prefix, heads, kv_heads)
    ms = bench(lambda: paged_prefill_attention(*args))
    ref_ms = bench(lambda: paged_prefill_attention_ref(*args))
    return {"kernel": "paged_prefill", "case": name, "heads": heads, "kv_heads": kv_heads, "us": ms * 1e3,
            "TFLOP/s": prefill_flops(new, prefix, heads) / (ms * 1e-3) / 1e12, "ref_us": ref_ms * 1e3,
            "launch": prefill_launch(max(new), heads // kv_heads)}


def bench_store(n_tokens, kv_heads) -> dict:
    nblk = 4 * n_tokens // BLOCK_SIZE + 1
    k_cache = torch.randn(nblk, BLOCK_SIZE, kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    key = torch.randn(n_tokens, kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    value = torch.randn_like(key)
    slots = torch.randperm(nblk * BLOCK_SIZE, device="cuda")[:n_tokens]
    ms = bench(lambda: store_kv_cache(key, value, k_cache, v_cache, slots))
    ref_ms = bench(lambda: store_kv_cache_ref(key, value, k_cache, v_cache, slots))
    nbytes = 4 * key.numel() * key.element_size() + slots.numel() * slots.element_size()
    return {"kernel": "store_kv", "tokens": n_tokens, "kv_heads": kv_heads, "us": ms * 1e3, "ref_us": ref_ms * 1e3,
            "GB/s": nbytes / (ms * 1e-3) / 1e9}


def run_table() -> list[dict]:
    rows = []
    print(f"paged decode, fp16, head_dim {HEAD_DIM}, block {BLOCK_SIZE}; % of the {CEILING_GBS:.0f} GB/s copy ceiling; "
          f"SDPA on contiguous [B, H, L, D]")
    print(f"{'shape':>8} {'B':>4} {'ctx':>5} {'splits':>6} {'us':>8} {'GB/s':>7} {'%ceil':>6} {'SDPA us':>8} "
          f"{'SDPA/ours':>9}")
    for name, (heads, kv) in SHAPES.items():
        for batch in (1, 8, 64, 256):
            for ctx in (128, 1024, 4096):
                r = bench_decode(batch, ctx, heads, kv)
                r["shape"] = name
                rows.append(r)
                print(f"{name:>8} {batch:4d} {ctx:5d} {r['launch']['splits']:6d} {r['us']:8.1f} {r['GB/s']:7.0f} "
                      f"{r['pct_ceiling']:5.1f}% {r['sdpa_us']:8.1f} {r['sdpa_over_ours']:8.2f}x {r['sdpa_layout']}",
                      flush=True)
                torch.cuda.empty_cache()
    for name, (heads, kv) in SHAPES.items():
        for case, (new, prefix) in PREFILL_CASES.items():
            r = bench_prefill(case, new, prefix, heads, kv)
            r["shape"] = name
            rows.append(r)
            print(f"prefill {name} {case}: triton {r['us']:.1f} us ({r['TFLOP/s']:.0f} TFLOP/s), "
                  f"gather+SDPA reference {r['ref_us']:.1f} us ({r['ref_us'] / r['us']:.1f}x)", flush=True)
        for n in (64, 4096):
            r = bench_store(n, kv)
            r["shape"] = name
            rows.append(r)
            print(f"store {name} {n} tokens: triton {r['us']:.1f} us ({r['GB/s']:.0f} GB/s), "
                  f"index_copy reference {r['ref_us']:.1f} us ({r['ref_us'] / r['us']:.1f}x)", flush=True)
    return rows


def descend(measure, start: dict, space: dict, passes: int = 2) -> tuple[float, dict]:
    """Coordinate descent over a launch space from the table's config; configs that fail are skipped."""
    cache = {}

    def cost(cfg):
        key = tuple(sorted(cfg.items()))
        if key not in cache:
            try:
                cache[key] = measure(cfg)
            except Exception as e:  # a config that does not compile or fit is skipped
                print(f"    skip {cfg}: {type(e).__name__}", flush=True)
                cache[key] = math.inf
        return cache[key]

    best = dict(start)
    best_ms = cost(best)
    for _ in range(passes):
        for knob, values in space.items():
            for v in values:
                cfg = dict(best, **{knob: v})
                ms = cost(cfg)
                if ms < best_ms:
                    best, best_ms = cfg, ms
    return best_ms, best


def run_sweep() -> list[dict]:
    rows = []
    print("decode: best launch per shape (bound = context); table default first")
    for name, (heads, kv) in SHAPES.items():
        for batch in (1, 8, 64, 256):
            for ctx in (1024, 4096):
                s = decode_inputs(batch, ctx, heads, kv)
                nbytes = decode_bytes(batch, ctx, heads, kv)
                start = decode_launch(batch, heads, kv, HEAD_DIM, BLOCK_SIZE, ctx)
                splits = sorted({max(1, start["splits"] * f // 4) for f in (1, 2, 4, 8, 16)})
                space = {"splits": splits, "tile": [32, 64, 128], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3, 4],
                         "use_dot": [True, False], "min_split_tokens": [64, 128, 256]}
                table_ms = bench(lambda: paged_decode_attention(*s, SCALE, ctx), 10, 40)
                best_ms, best = descend(lambda c: bench(lambda: paged_decode_attention(*s, SCALE, ctx, **c), 10, 40),
                                        start, space)
                rows.append({"kernel": "paged_decode", "shape": name, "batch": batch, "context": ctx,
                             "batch_x_kv_heads": batch * kv, "table": start, "table_us": table_ms * 1e3,
                             "best": best, "best_us": best_ms * 1e3})
                print(f"  {name} B={batch} ctx={ctx} batch*kv_heads={batch * kv}: table {table_ms * 1e3:.1f} us, "
                      f"best {best_ms * 1e3:.1f} us ({nbytes / (best_ms * 1e-3) / 1e9:.0f} GB/s) {best}", flush=True)
                del s
                torch.cuda.empty_cache()
    print("summary by batch*kv_heads (paste the consensus into DECODE_SPLITS / DECODE_TILE in launch_table.py):")
    for r in sorted(rows, key=lambda r: (r["batch_x_kv_heads"], r["context"])):
        b = r["best"]
        print(f"  {r['batch_x_kv_heads']:5d} ctx {r['context']:5d} ({r['best_us']:7.1f} us): splits {b['splits']}, "
              f"({b['tile']}, {b['num_warps']}, {b['num_stages']}), use_dot {b['use_dot']}, "
              f"min_split_tokens {b['min_split_tokens']}")
    print("prefill:")
    for name, (heads, kv) in SHAPES.items():
        for case, (new, prefix) in PREFILL_CASES.items():
            args = prefill_inputs(new, prefix, heads, kv)
            start = prefill_launch(max(new), heads // kv)
            space = {"block_m": [32, 64, 128], "block_n": [32, 64, 128], "num_warps": [4, 8],
                     "num_stages": [1, 2, 3]}
            table_ms = bench(lambda: paged_prefill_attention(*args), 10, 40)
            best_ms, best = descend(lambda c: bench(lambda: paged_prefill_attention(*args, **c), 10, 40), start, space)
            rows.append({"kernel": "paged_prefill", "shape": name, "case": case, "table": start,
                         "table_us": table_ms * 1e3, "best": best, "best_us": best_ms * 1e3})
            print(f"  {name} {case}: table {table_ms * 1e3:.1f} us, best {best_ms * 1e3:.1f} us {best}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--sweep", action="store_true", help="search launch configs per shape instead of the table")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows = run_sweep() if args.sweep else run_table()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "mode": "sweep" if args.sweep else "table",
                       "decode_splits": launch_table.DECODE_SPLITS[:-1], "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
