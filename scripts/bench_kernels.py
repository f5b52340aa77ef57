"""Kernel benchmarks on the GPU: paged decode attention against the copy ceiling and SDPA, plus the
prefill and store kernels against their torch references.

    python scripts/bench_kernels.py [--out kernels.json]       # the table (about 2 minutes on an H100)
    python scripts/bench_kernels.py --decode-only --launch-json sweep.json   # decode rows, swept launches
    python scripts/bench_kernels.py --quick-sweep [--out sweep.json]  # decode launch rows (< 4 min on an H100)
    python scripts/bench_kernels.py --sweep [--out sweep.json]        # two passes, no time limit, then prefill

Decode is timed two ways, ours and SDPA alike; the verdict column and the summary use the first.
- graph: N >= 20 back-to-back calls captured in one CUDA graph, replayed, time / N. The engine runs
  decode attention inside a graph, so no host launch work is timed (do_bench times it whenever Python
  falls behind the GPU, which happens at small shapes). As in the engine, the calls share one block
  table, lengths and q (hot in L2, like one step's metadata across layers) and each reads its own K/V
  cache (like one layer's); the calls rotate over at least ROTATE_BYTES of K/V, several times the
  H100's 50 MB L2, so K/V come from DRAM.
- do_bench: `triton.testing.do_bench` medians (L2 flushed before each call), rotating over up to 8
  of the same input sets.
SDPA runs on the same bytes laid out contiguously, [B, H, L, D]; for GQA the faster of enable_gqa and
K/V expanded to every query head counts. The verdict is against SDPA's default backend (on the H100 with
torch 2.11 that is cuDNN's attention for these shapes: forcing CUDNN_ATTENTION gives the same times); the
FA2 column holds SDPA to FlashAttention-2. The header also gives a plain streaming read's GB/s measured
on the spot, a read-only ceiling beside the copy one. Decode bytes per call: K and V of every context token
(read once) + q read + out written. The floor columns time `paged_kv_read_floor`: the same launch reading the
same paged K/V with the same loads, but summing them instead of attending and with no merge, so ours minus
floor is what the attention math and the merge cost, and a floor at or above SDPA means the scattered reads
alone are slower than SDPA's whole call on contiguous data. The in-order column is ours/SDPA with each
sequence's blocks consecutive in the pool (as a fresh pool hands them out) instead of shuffled. The table ends
with the worst ours/SDPA ratio and where, and the % of the copy ceiling at B=64 ctx 1024.

The sweeps search decode launches per batch x kv heads (the launch table's key) over the table's points
of that key, scoring a launch by its worst and mean ours/SDPA ratio (graph), starting from the table,
and print rows to paste into `rosecli/kernels/launch_table.py`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rosecli.kernels import launch_table  # noqa: E402
from rosecli.kernels.launch_table import DecodeLaunch  # noqa: E402
from rosecli.kernels.paged_decode import (decode_launch, paged_decode_attention,  # noqa: E402
                                          paged_decode_attention_ref, paged_kv_read_floor)
from rosecli.kernels.prefill_attention import (paged_prefill_attention, paged_prefill_attention_ref,  # noqa: E402
                                               prefill_launch)
from rosecli.kernels.store_kv import store_kv_cache, store_kv_cache_ref  # noqa: E402
from rosecli.kernels.stream_read import stream_read_sum  # noqa: E402

CEILING_GBS = 2975.0  # H100 device-to-device copy, bytes read + written (BENCHMARKS.md)
SHAPES = {"gpt2": (12, 12), "smollm2": (9, 3)}  # heads, kv heads; head_dim 64
BATCHES, CONTEXTS = (1, 8, 64, 256), (128, 1024, 4096)
HEAD_DIM, BLOCK_SIZE, DTYPE, SCALE, DEVICE = 64, 16, torch.float16, 0.125, "cuda"
ROTATE_BYTES = 160 << 20  # K/V bytes the graph's calls rotate over (H100 L2: 50 MB)
MAX_SETS = 1024  # input sets (graph calls) at most; the smallest shape then rotates over 100 MB
GRAPH_CALLS = 20  # calls per graph at least
SWEEP_SPACE = {"splits": (1, 2, 4, 8, 16, 32, 64, 128), "min_split_tokens": (64, 128, 256, 512),
               "tile": (32, 64, 128, 256), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3, 4),
               "head_major": (False, True), "use_dot": (True, False)}
SWEEP_MAX_PROGRAMS = 4096  # split counts giving more programs than this are not tried
SWEEP_GAIN = 0.01  # a launch replaces the best so far only when it scores this much better
BOUND = 0  # --bound: the host-side context bound the launches get (0: each point's context, as eager decode)


def launch_bound(ctx: int) -> int:
    """The context bound a launch gets: the point's own, or --bound (a model's CUDA graphs pass max_model_len,
    so their split count is never capped by the real context, which is dealt to the splits on the device)."""
    return max(ctx, BOUND)


def bench(fn, warmup=25, rep=100) -> float:
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def rotating(fns):
    """One callable that runs the next of ``fns`` on each call."""
    it = itertools.cycle(fns)
    return lambda: next(it)()


def do_bench_us(fns) -> float:
    return bench(rotating(fns[:8])) * 1e3


def graph_us(fns, rounds=5, round_ms=10.0) -> float:
    """Per-call time of max(GRAPH_CALLS, len(fns)) calls (cycling over ``fns``) captured in one CUDA graph."""
    calls = max(GRAPH_CALLS, len(fns))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and warms the allocator outside the capture
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()  # the first replay uploads the graph
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(1, math.ceil(round_ms / start.elapsed_time(end)))
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (replays * calls))
    return statistics.median(times) * 1e3


def decode_bytes(batch, ctx, heads, kv_heads):
    elem = torch.finfo(DTYPE).bits // 8
    return 2 * batch * ctx * kv_heads * HEAD_DIM * elem + 2 * batch * heads * HEAD_DIM * elem


def n_sets(nbytes):
    return max(1, min(MAX_SETS, -(-ROTATE_BYTES // nbytes)))


def decode_sets(batch, ctx, heads, kv_heads, sets):
    """``sets`` K/V caches (one per call, like layers) behind one shuffled block table, lengths = ctx and q."""
    per_seq = math.ceil(ctx / BLOCK_SIZE)
    nblk = batch * (per_seq + 1)  # a spare block per sequence, so the table is not the identity
    kv = torch.randn(2, sets, nblk, kv_heads, BLOCK_SIZE, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    tables = torch.randperm(nblk, device=DEVICE)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, heads, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    return [(q, kv[0, i], kv[1, i], tables, lens) for i in range(sets)]


def ours_fns(sets, ctx, **launch):
    return [lambda s=s: paged_decode_attention(*s, SCALE, launch_bound(ctx), **launch) for s in sets]


def time_sdpa(batch, ctx, heads, kv_heads, sets, with_do_bench=True, rounds=5, flash=False) -> dict:
    """{layout: (graph us, do_bench us or None)} for SDPA over contiguous [B, H, L, D] copies; with ``flash``,
    also {"flash " + layout: (graph us, None)} with SDPA held to its FlashAttention-2 backend (on the H100 the
    default picks cuDNN's attention for these shapes)."""
    q = torch.randn(batch, heads, 1, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    layouts = {"mha": (kv_heads, False)} if heads == kv_heads else {"enable_gqa": (kv_heads, True),
                                                                     "expanded": (heads, False)}
    res = {}
    for name, (kvh, gqa) in layouts.items():
        k = torch.randn(sets, batch, kvh, ctx, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        v = torch.randn_like(k)
        fns = [lambda i=i, g=gqa: F.scaled_dot_product_attention(q, k[i], v[i], scale=SCALE, enable_gqa=g)
               for i in range(sets)]
        try:
            res[name] = (graph_us(fns, rounds=rounds), do_bench_us(fns) if with_do_bench else None)
        except RuntimeError:  # some SDPA backends refuse enable_gqa
            pass
        if flash:
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    res["flash " + name] = (graph_us(fns, rounds=rounds), None)
            except RuntimeError:
                pass
        del fns, k, v
    return res


def bench_decode(shape, batch, ctx, heads, kv_heads) -> dict:
    nbytes = decode_bytes(batch, ctx, heads, kv_heads)
    sets = decode_sets(batch, ctx, heads, kv_heads, n_sets(nbytes))
    fns = ours_fns(sets, ctx)
    us, bench_us_ = graph_us(fns), do_bench_us(fns)
    floor_us = graph_us([lambda s=s: paged_kv_read_floor(s[1], s[2], s[3], s[4], heads, ctx) for s in sets])
    in_order = torch.arange(sets[0][3].numel(), device=DEVICE, dtype=torch.int32).view_as(sets[0][3])
    in_order_us = graph_us(ours_fns([(q, k, v, in_order, lens) for q, k, v, _, lens in sets], ctx))
    del fns, sets
    sdpa = time_sdpa(batch, ctx, heads, kv_heads, n_sets(nbytes), flash=True)
    flash_us = min((t for k, (t, _) in sdpa.items() if k.startswith("flash ")), default=math.nan)
    sdpa = {k: v for k, v in sdpa.items() if not k.startswith("flash ")}
    layout = min(sdpa, key=lambda k: sdpa[k][0])
    sdpa_us, sdpa_bench_us = sdpa[layout]
    gbs = nbytes / (us * 1e-6) / 1e9
    return {"kernel": "paged_decode", "shape": shape, "batch": batch, "context": ctx, "heads": heads,
            "kv_heads": kv_heads,
            "launch": decode_launch(batch, heads, kv_heads, HEAD_DIM, BLOCK_SIZE, launch_bound(ctx)),
            "us": us, "GB/s": gbs, "pct_ceiling": 100 * gbs / CEILING_GBS, "sdpa_us": sdpa_us,
            "ours_over_sdpa": us / sdpa_us, "sdpa_layout": layout, "do_bench_us": bench_us_,
            "sdpa_do_bench_us": sdpa_bench_us, "sdpa_all": sdpa, "flash_us": flash_us, "floor_us": floor_us,
            "in_order_us": in_order_us}


def read_ceiling_gbs(nbytes=768 << 20, programs=768, block=4096) -> float:
    """A second, read-only ceiling: a plain Triton kernel streaming contiguous fp16 (each program 1 MB); the
    kernel `rose bench` measures each device's read ceiling with (rosecli.kernels.stream_read)."""
    n_per = nbytes // 2 // programs // block * block
    x = torch.empty(2, programs * n_per, device=DEVICE, dtype=DTYPE).normal_()
    out = torch.empty(programs, device=DEVICE)
    us = graph_us([lambda i=i: stream_read_sum(x[i], out, block=block) for i in range(2)])
    del x
    return programs * n_per * DTYPE.itemsize / us / 1e3


def prefill_inputs(new, prefix, heads, kv_heads):
    lens = [n + p for n, p in zip(new, prefix)]
    per_seq = [math.ceil(n / BLOCK_SIZE) for n in lens]
    nblk = sum(per_seq)
    k_cache = torch.randn(nblk, kv_heads, BLOCK_SIZE, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(nblk, device=DEVICE).to(torch.int32)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device=DEVICE)
    pos = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = perm[pos:pos + nb]
        pos += nb
    cu = torch.tensor([0] + list(itertools.accumulate(new)), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(new), heads, HEAD_DIM, device=DEVICE, dtype=DTYPE)
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
    k_cache = torch.randn(nblk, kv_heads, BLOCK_SIZE, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    key = torch.randn(n_tokens, kv_heads, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    value = torch.randn_like(key)
    slots = torch.randperm(nblk * BLOCK_SIZE, device=DEVICE)[:n_tokens]
    ms = bench(lambda: store_kv_cache(key, value, k_cache, v_cache, slots))
    ref_ms = bench(lambda: store_kv_cache_ref(key, value, k_cache, v_cache, slots))
    nbytes = 4 * key.numel() * key.element_size() + slots.numel() * slots.element_size()
    return {"kernel": "store_kv", "tokens": n_tokens, "kv_heads": kv_heads, "us": ms * 1e3, "ref_us": ref_ms * 1e3,
            "GB/s": nbytes / (ms * 1e-3) / 1e9}


def pct_ceiling(r, us_key) -> float:
    return 100 * decode_bytes(r["batch"], r["context"], r["heads"], r["kv_heads"]) / (r[us_key] * 1e3) / CEILING_GBS


def ceiling_at_64_1024(rows, us_key) -> str:
    return ", ".join(f"{r['shape']} {pct_ceiling(r, us_key):.1f}%" for r in rows
                     if r["batch"] == 64 and r["context"] == 1024)


def summary_line(rows, us_key, label) -> str:
    ratio = {id(r): r[us_key] / r["sdpa_us"] for r in rows}
    worst = max(rows, key=lambda r: ratio[id(r)])
    slower = sum(v > 1 for v in ratio.values())
    return (f"summary ({label}, graph): worst ours/SDPA {ratio[id(worst)]:.2f}x at {worst['shape']} B={worst['batch']} "
            f"ctx {worst['context']} ({slower} of {len(rows)} slower); B=64 ctx 1024: "
            f"{ceiling_at_64_1024(rows, us_key)} of the {CEILING_GBS:.0f} GB/s ceiling")


def run_table(decode_only: bool) -> list[dict]:
    rows = []
    read_gbs = read_ceiling_gbs()
    print(f"paged decode, fp16, head_dim {HEAD_DIM}, block {BLOCK_SIZE}; SDPA (default backend) and SDPA held to "
          f"FlashAttention-2 (FA2) on contiguous [B, H, L, D]; % of the {CEILING_GBS:.0f} GB/s copy ceiling; "
          f"plain streaming read measured now: {read_gbs:.0f} GB/s; verdict by CUDA-graph time against SDPA")
    print(f"{'shape':>8} {'B':>4} {'ctx':>5} {'spl':>3} | {'graph us':>8} {'GB/s':>6} {'%ceil':>6} {'SDPA us':>8} "
          f"{'ours/SDPA':>9} {'FA2 us':>8} {'ours/FA2':>8} | {'floor us':>8} {'fl/SDPA':>7} {'in-order':>8} | "
          f"{'do_bench':>8} {'SDPA':>8} | verdict")
    for name, (heads, kv) in SHAPES.items():
        for batch in BATCHES:
            for ctx in CONTEXTS:
                r = bench_decode(name, batch, ctx, heads, kv)
                rows.append(r)
                print(f"{name:>8} {batch:4d} {ctx:5d} {r['launch']['splits']:3d} | {r['us']:8.1f} {r['GB/s']:6.0f} "
                      f"{r['pct_ceiling']:5.1f}% {r['sdpa_us']:8.1f} {r['ours_over_sdpa']:8.2f}x "
                      f"{r['flash_us']:8.1f} {r['us'] / r['flash_us']:7.2f}x | "
                      f"{r['floor_us']:8.1f} {r['floor_us'] / r['sdpa_us']:6.2f}x "
                      f"{r['in_order_us'] / r['sdpa_us']:7.2f}x | "
                      f"{r['do_bench_us']:8.1f} {r['sdpa_do_bench_us']:8.1f} | "
                      f"{'ok' if r['ours_over_sdpa'] <= 1 else 'SLOWER'} ({r['sdpa_layout']})", flush=True)
                torch.cuda.empty_cache()
    print(summary_line(rows, "us", "table launches"))
    slower = [r for r in rows if r["ours_over_sdpa"] > 1]
    print(f"read floor (the same launch and paged loads, no attention math, no merge): at "
          f"{sum(r['floor_us'] >= r['sdpa_us'] for r in slower)} of the {len(slower)} slower points the reads alone "
          f"take as long as SDPA's whole call or longer; "
          + "; ".join(f"{r['shape']} B={r['batch']} ctx {r['context']}: floor {r['floor_us'] / r['sdpa_us']:.2f}x, "
                      f"ours {r['ours_over_sdpa']:.2f}x" for r in slower), flush=True)
    print(f"read ceiling: a plain Triton streaming read reaches {read_gbs:.0f} GB/s; at B=64 ctx 1024 ours reads at "
          + ", ".join(f"{r['shape']} {r['GB/s'] / read_gbs * 100:.1f}%" for r in rows
                      if r["batch"] == 64 and r["context"] == 1024) + " of it; ours/FA2 worst "
          f"{max(r['us'] / r['flash_us'] for r in rows):.2f}x", flush=True)
    rows.append({"kernel": "read_ceiling", "GB/s": read_gbs})
    if decode_only:
        return rows
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


def decode_points() -> dict:
    """The table's decode points grouped by batch x kv heads, the launch table's key."""
    groups = {}
    for shape, (heads, kv) in SHAPES.items():
        for batch in BATCHES:
            for ctx in CONTEXTS:
                groups.setdefault(batch * kv, []).append((shape, batch, ctx, heads, kv))
    return dict(sorted(groups.items()))


def sweep_candidates(best: DecodeLaunch, knob: str, key: int):
    if knob == "splits":  # with min_split_tokens: both only set the split count at each context
        return [best._replace(splits=s, min_split_tokens=m)
                for s, m in itertools.product(SWEEP_SPACE["splits"], SWEEP_SPACE["min_split_tokens"])
                if s == 1 or s * key <= SWEEP_MAX_PROGRAMS]
    return [best._replace(**{knob: v}) for v in SWEEP_SPACE[knob]]


def fmt_launch(row: DecodeLaunch) -> str:
    return f"DecodeLaunch({', '.join(str(v) for v in row)})"


def sweep_decode(passes: int, budget_s: float) -> tuple[list, list]:
    """Coordinate descent per launch-table key; returns (per-point rows, launch-table rows)."""
    deadline = time.monotonic() + budget_s
    groups = decode_points()
    points_out, table = [], []
    print(f"decode launch sweep, graph timing, scored by (worst + mean) ours/SDPA over each key's points; "
          f"budget {budget_s:.0f} s; rows: {', '.join(DecodeLaunch._fields)}", flush=True)
    for n, (key, points) in enumerate(groups.items()):
        t0 = time.monotonic()
        key_deadline = t0 + max(0.0, deadline - t0) / (len(groups) - n)
        data = []
        for shape, batch, ctx, heads, kv in points:
            nbytes = decode_bytes(batch, ctx, heads, kv)
            sdpa = time_sdpa(batch, ctx, heads, kv, n_sets(nbytes), with_do_bench=False, rounds=3)
            data.append(((shape, batch, ctx, heads, kv), decode_sets(batch, ctx, heads, kv, n_sets(nbytes)),
                         min(g for g, _ in sdpa.values()), nbytes))
        cache = {}

        def times_of(row: DecodeLaunch) -> list[float]:
            out = []
            for i, ((_, _, ctx, _, _), sets, _, _) in enumerate(data):
                launch = launch_table.row_launch(row, launch_bound(ctx), BLOCK_SIZE)
                ck = (i, tuple(launch.values()))
                if ck not in cache:
                    try:
                        cache[ck] = graph_us(ours_fns(sets, ctx, **launch), rounds=3, round_ms=5.0)
                    except Exception as e:  # a launch that does not compile or fit is skipped
                        print(f"    skip {launch}: {type(e).__name__}", flush=True)
                        cache[ck] = math.inf
                out.append(cache[ck])
            return out

        def score(times):
            ratios = [t / d[2] for t, d in zip(times, data)]
            return 0.5 * max(ratios) + 0.5 * statistics.fmean(ratios)

        start = launch_table.lookup(launch_table.DECODE, key)
        best, best_times = start, times_of(start)
        start_times, best_score, out_of_time = best_times, score(best_times), False
        for _ in range(passes):
            for knob in ("splits", "tile", "num_warps", "num_stages", "head_major", "use_dot"):
                for cand in sweep_candidates(best, knob, key):
                    if time.monotonic() > key_deadline:
                        out_of_time = True
                        break
                    cand_times = times_of(cand)
                    if score(cand_times) < best_score * (1 - SWEEP_GAIN):
                        best, best_times, best_score = cand, cand_times, score(cand_times)
        ok, check = check_launch(best, data)
        if not ok:  # never paste a launch that computes the wrong thing
            best, best_times = start, start_times
        first = points[0]
        print(f"key {key} ({first[0]} B={first[1]}{', ...' if len(points) > 3 else ''}): {fmt_launch(start)} -> "
              f"{fmt_launch(best)}; {len(cache)} timings, {time.monotonic() - t0:.0f} s"
              f"{', stopped by the budget' if out_of_time else ''}; {check}", flush=True)
        for (pt, _, sdpa_us, nbytes), t_start, t_best in zip(data, start_times, best_times):
            shape, batch, ctx, heads, kv = pt
            points_out.append({"kernel": "paged_decode", "shape": shape, "batch": batch, "context": ctx,
                               "heads": heads, "kv_heads": kv, "key": key, "table": list(start),
                               "table_us": t_start, "best": list(best), "us": t_best, "sdpa_us": sdpa_us})
            print(f"  {shape:>8} B={batch:<3d} ctx {ctx:4d}: table {t_start:8.1f} us, best {t_best:8.1f} us, "
                  f"SDPA {sdpa_us:8.1f} us: best/SDPA {t_best / sdpa_us:.2f}x, "
                  f"{100 * nbytes / (t_best * 1e-6) / 1e9 / CEILING_GBS:.1f}% of ceiling", flush=True)
        table.append((key, best, f"{first[0]} B={first[1]}"))
        del data, cache
        torch.cuda.empty_cache()
    print("paste into rosecli/kernels/launch_table.py:")
    print(f"#           batch*kv_heads   {', '.join(DecodeLaunch._fields)}")
    for i, (key, row, where) in enumerate(table):
        bound = "math.inf" if i == len(table) - 1 else str(key)
        print(f"{'DECODE = (' if i == 0 else '          '}({bound}, {fmt_launch(row)})"
              f"{')' if i == len(table) - 1 else ','}  # {key}: {where}")
    print(summary_line(points_out, "us", "swept launches"))
    table = [(math.inf if i == len(table) - 1 else key, list(row)) for i, (key, row, _) in enumerate(table)]
    return points_out, table


def check_launch(row: DecodeLaunch, data) -> tuple[bool, str]:
    """The swept launch against the torch reference on the key's longest point."""
    (_, _, ctx, _, _), sets, _, _ = max(data, key=lambda d: d[0][2])
    q, k_cache, v_cache, tables, lens = sets[0]
    launch = launch_table.row_launch(row, launch_bound(ctx), BLOCK_SIZE)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, SCALE, launch_bound(ctx), **launch).float()
    ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, lens, SCALE, ctx)
    err = ((out - ref).norm() / ref.norm()).item()
    if err < 5e-3:
        return True, f"matches the reference (rel. err. {err:.0e})"
    return False, f"MISMATCH: {fmt_launch(row)} rel. err. {err:.1e} at ctx {ctx}; the table's row is kept"


def sweep_prefill() -> list[dict]:
    rows = []
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
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick-sweep", action="store_true", help="search decode launches, one pass, time-boxed")
    mode.add_argument("--sweep", action="store_true", help="search decode launches (two passes), then prefill")
    ap.add_argument("--budget-s", type=float, default=200.0, help="--quick-sweep: seconds for the decode search")
    ap.add_argument("--decode-only", action="store_true", help="table: skip the prefill and store rows")
    ap.add_argument("--launch-json", help="table: decode launch rows from a sweep's --out instead of launch_table.py")
    ap.add_argument("--shapes", nargs="+", metavar="NAME=HEADS:KV_HEADS",
                    help="attention shapes instead of GPT-2's and SmolLM2's, e.g. llama8b=32:8 qwen7b=28:4")
    ap.add_argument("--head-dim", type=int, default=64, help="head_dim of every shape (64: GPT-2, SmolLM2)")
    ap.add_argument("--bound", type=int, default=0, help="context bound of every launch (a model's max_model_len: "
                    "what its CUDA graphs pass); default each point's context")
    args = ap.parse_args()
    global SHAPES, HEAD_DIM, SCALE, BOUND
    BOUND = args.bound
    if args.shapes:
        try:
            SHAPES = {name: tuple(int(x) for x in dims.split(":")) for name, dims in
                      (spec.split("=") for spec in args.shapes)}
        except ValueError:
            sys.exit("--shapes takes NAME=HEADS:KV_HEADS, e.g. llama8b=32:8")
    HEAD_DIM, SCALE = args.head_dim, args.head_dim ** -0.5
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    if args.launch_json:
        rows = json.loads(Path(args.launch_json).read_text())["decode_table"]
        launch_table.DECODE = tuple((bound, DecodeLaunch(*row)) for bound, row in rows)
        print(f"decode launches from {args.launch_json}", flush=True)
    decode_table = [(bound, list(row)) for bound, row in launch_table.DECODE]
    if args.quick_sweep or args.sweep:
        rows, decode_table = sweep_decode(passes=2 if args.sweep else 1,
                                          budget_s=math.inf if args.sweep else args.budget_s)
        if args.sweep:
            rows += sweep_prefill()
    else:
        rows = run_table(args.decode_only)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "mode": "sweep" if args.quick_sweep or args.sweep else "table",
                       "decode_table": decode_table, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
