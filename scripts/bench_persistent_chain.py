"""Experiment (issue 21), measured and not kept: does a persistent kernel that waits on counters between layers
beat one kernel a layer?

At one row each decode layer is ~6 dependent kernels, and every boundary costs ~2 us beyond the kernel's bytes even
with PDL (the tail of the kernel before, the grid's completion, the ramp of the next). A persistent kernel (one
launch for many layers) replaces the boundary with a counter: its programs take work items (one layer's column tile)
from an atomic ticket in layer order; a program waits until the layer before is complete (a counter of its finished
tiles) and reads that layer's output from L2. This script measures only that: a chain of L one-row GEMVs (y_l+1 =
W_l y_l, rounded to the weights' dtype each layer), as the engine runs them today (one `skinny_gemm` launch a layer,
PDL, a CUDA graph) and as one persistent launch, us per chain.

Tickets never go back: launch e takes tickets [e * (items + P), (e + 1) * (items + P)) (P programs, each ending on
one ticket past the items), and a layer's counter reaches (e + 1) * tiles when it is done in launch e, so a CUDA
graph replays it with no reset. A program only waits on items taken before its own, by programs that are running, so
it cannot deadlock whatever the residency; under the interpreter the first program takes every item in order.

Variants: the counter polled with an atomic read-modify-write or a plain `ld.acquire` (POLL), the counters 128 bytes
apart (STRIDE), a nanosleep back-off (SLEEP), the tile's weights asked for in L2 while it waits (PF_LINES), static
items (STATIC: program p takes items p, p + P, ...; one atomic a program, for the launch's number; it deadlocks
unless every program is resident, so the timings use it only at 4 programs a SM of 2 warps and 512-wide K steps,
where it ran), a control with no waits at all (NODEP: every layer reads x), the chain's streaming rate alone, and
`_chain_db_kernel`, which holds the next ticket's whole tile in registers while it waits on the current one.

Result on an H200 (docs/performance.md, "Tried and not kept: one persistent launch for a chain of one-row layers"):
no persistent form beat one launch a layer (0.67-0.96x for each chain's best), and the control without waits
streamed the square chains only 1.18-1.19x faster than one launch a layer (the 1B's MLP shapes 0.80x), which bounds
what any counter scheme could gain. Each layer's k and offsets are rounded to multiples of 16 in the kernels so
Triton can prove the rows 16-byte aligned: without that it loaded the weights two bytes at a time, which the first
measurements of this script took for the persistent form's own cost.

    python scripts/bench_persistent_chain.py             # on a GPU: the timings
    python scripts/bench_persistent_chain.py --check     # on any machine (TRITON_INTERPRET=1 on a CPU): correctness
"""

import argparse
import math
import os
import sys

import torch
import triton
import triton.language as tl

from rosecli.kernels.pdl import l2_prefetch


@triton.jit
def _counter(cptr, POLL: tl.constexpr):
    """A completion counter's value, with acquire semantics: a plain `ld.acquire` (POLL) or a read-modify-write."""
    if POLL:
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b64 $0, [$1];", "=l,l", [cptr], dtype=tl.int64,
                                         is_pure=False, pack=1)
    return tl.atomic_add(cptr, 0, sem="acquire")


@triton.jit
def _chain_kernel(x_ptr, w_ptr, y_ptr, ticket_ptr, done_ptr, meta_ptr, lof_ptr, L, items, P,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                  PF_LINES: tl.constexpr = 0, LINE: tl.constexpr = 64, SLEEP: tl.constexpr = 0,
                  POLL: tl.constexpr = 0, STRIDE: tl.constexpr = 1, STATIC: tl.constexpr = 0,
                  NODEP: tl.constexpr = 0):
    """meta_ptr: int64 [L + 1, 5] rows (first tile, n, k, weight offset, output offset) per layer, the last row's
    first tile = items; layer l reads x (l = 0) or the output of layer l - 1 (y at row l - 1's offset)."""
    span = items + P
    rk = tl.arange(0, BLOCK_K)
    if STATIC:  # (items pid, pid + P, ...: one atomic a program, for the launch's epoch)
        epoch = tl.atomic_add(ticket_ptr, 1) // P
        i = epoch * span + tl.program_id(0)
    else:
        i = tl.atomic_add(ticket_ptr, 1)
    while i % span < items:
        local = i % span
        epoch = i // span
        l = tl.load(lof_ptr + local)  # (each item's layer, from a table: no search)
        t0 = tl.load(meta_ptr + l * 5)
        n = tl.load(meta_ptr + l * 5 + 1)
        # (k and the offsets rounded to multiples of 16, as every n and k is: Triton then knows the rows 16-byte
        # aligned and loads 16 bytes at a time, as the skinny kernel does with its K argument; else 2 bytes)
        k = tl.load(meta_ptr + l * 5 + 2) // 16 * 16
        w_off = tl.load(meta_ptr + l * 5 + 3) // 16 * 16
        y_off = tl.load(meta_ptr + l * 5 + 4) // 16 * 16
        rn = (local - t0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < n
        w_ptrs = w_ptr + w_off + rn[:, None].to(tl.int64) * k + rk[None, :]
        kmask = rk < k
        w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)  # (no layer writes weights: before
        # the wait, as the PDL launches fetch their first tile)
        if PF_LINES > 0:  # the rest of the tile's weights asked for in L2 meanwhile (`pdl.l2_prefetch`; not in the
            # interpreter), up to PF_LINES lines (of LINE elements) a row
            pk = tl.minimum(BLOCK_K + tl.arange(0, PF_LINES) * LINE, k - 1)
            l2_prefetch(w_ptr + w_off + tl.minimum(rn, n - 1)[:, None].to(tl.int64) * k + pk[None, :])
        if NODEP:  # (control: every layer reads x, no waits; the chain's streaming rate alone)
            in_ptrs = x_ptr + rk
        elif l > 0:  # the layer before complete in this launch: every one of its tiles counted
            prev_tiles = t0 - tl.load(meta_ptr + (l - 1) * 5)
            target = (epoch + 1) * prev_tiles
            cptr = done_ptr + (l - 1) * STRIDE
            seen = _counter(cptr, POLL)
            while seen < target:
                if SLEEP > 0:  # (back off: fewer reads of the counter while its layer's last tiles run)
                    tl.inline_asm_elementwise(f"nanosleep.u32 {SLEEP}; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                              is_pure=False, pack=1)
                seen = _counter(cptr, POLL)
            in_ptrs = y_ptr + tl.load(meta_ptr + (l - 1) * 5 + 4) // 16 * 16 + rk
        else:
            in_ptrs = x_ptr + rk
        tl.debug_barrier()  # (every thread past the wait before any reads the layer before's output)
        x = tl.load(in_ptrs, mask=kmask, other=0.0, cache_modifier=".cg")  # (L2: the output another SM wrote)
        acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
        for k0 in tl.range(BLOCK_K, k, BLOCK_K, num_stages=NUM_STAGES):
            kk = k0 + rk
            kmask = kk < k
            x = tl.load(in_ptrs + k0, mask=kmask, other=0.0, cache_modifier=".cg")
            w = tl.load(w_ptrs + k0, mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        tl.store(y_ptr + y_off + rn, y.to(y_ptr.dtype.element_ty), mask=nmask)
        tl.debug_barrier()  # every thread's store before the tile is counted
        tl.atomic_add(done_ptr + l * STRIDE, 1, sem="release")
        if STATIC:
            i += P
            if i % span >= items:
                i = epoch * span + items  # (past the items: the loop ends)
        else:
            i = tl.atomic_add(ticket_ptr, 1)


@triton.jit
def _item(w_ptr, meta_ptr, lof_ptr, i, span, items, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Ticket ``i``'s whole weight tile (zeros past the launch's items) and its layer, first tile, n, k."""
    local = i % span
    l = tl.load(lof_ptr + tl.minimum(local, items - 1))
    t0 = tl.load(meta_ptr + l * 5)
    n = tl.load(meta_ptr + l * 5 + 1)
    k = tl.load(meta_ptr + l * 5 + 2) // 16 * 16  # (multiples of 16: see `_chain_kernel`)
    w_off = tl.load(meta_ptr + l * 5 + 3) // 16 * 16
    rn = (local - t0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + w_off + rn[:, None].to(tl.int64) * k + rk[None, :],
                mask=(rn < tl.where(local < items, n, 0))[:, None] & (rk < k)[None, :], other=0.0)  # (past the
    # items: nothing)
    return w, l, t0, n, k


@triton.jit
def _chain_db_kernel(x_ptr, w_ptr, y_ptr, ticket_ptr, done_ptr, meta_ptr, lof_ptr, items, P,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STRIDE: tl.constexpr = 16,
                     NODEP: tl.constexpr = 0, POLL: tl.constexpr = 1):
    """The chain with its loads across items: a program holds the next ticket's whole weight tile (BLOCK_K >= every
    layer's k), asked for before it waits on the current one's layer before, so a program's loads are in flight
    while it waits and sums. Taking the next ticket early keeps it free of deadlock: the smallest unfinished ticket
    is always the one a program is working on."""
    span = items + P
    rk = tl.arange(0, BLOCK_K)
    i = tl.atomic_add(ticket_ptr, 1)
    w, l, t0, n, k = _item(w_ptr, meta_ptr, lof_ptr, i, span, items, BLOCK_N, BLOCK_K)
    while i % span < items:
        i_next = tl.atomic_add(ticket_ptr, 1)
        w_next, l_next, t0_next, n_next, k_next = _item(w_ptr, meta_ptr, lof_ptr, i_next, span, items, BLOCK_N,
                                                        BLOCK_K)
        epoch = i // span
        if NODEP:
            in_ptrs = x_ptr + rk
        elif l > 0:
            target = (epoch + 1) * (t0 - tl.load(meta_ptr + (l - 1) * 5))
            cptr = done_ptr + (l - 1) * STRIDE
            seen = _counter(cptr, POLL)
            while seen < target:
                seen = _counter(cptr, POLL)
            in_ptrs = y_ptr + tl.load(meta_ptr + (l - 1) * 5 + 4) // 16 * 16 + rk
        else:
            in_ptrs = x_ptr + rk
        tl.debug_barrier()
        x = tl.load(in_ptrs, mask=rk < k, other=0.0, cache_modifier=".cg")
        y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        rn = (i % span - t0) * BLOCK_N + tl.arange(0, BLOCK_N)
        y_off = tl.load(meta_ptr + l * 5 + 4) // 16 * 16
        tl.store(y_ptr + y_off + rn, y.to(y_ptr.dtype.element_ty), mask=rn < n)
        tl.debug_barrier()
        tl.atomic_add(done_ptr + l * STRIDE, 1, sem="release")
        i, w, l, t0, n, k = i_next, w_next, l_next, t0_next, n_next, k_next


class Chain:
    """A chain of one-row linear layers, ``shapes`` [(n, k)] with k of each the n of the one before, weights
    ``ws`` (each [n, k], one dtype), run as one persistent launch of ``programs`` programs."""

    def __init__(self, ws, programs: int, block_n: int = 4, block_k: int = 512, num_warps: int = 2,
                 num_stages: int = 3, pf_lines: int = 0, sleep_ns: int = 0, poll: int = 0, stride: int = 1,
                 static: int = 0, nodep: int = 0, db: bool = False):
        dev, dt = ws[0].device, ws[0].dtype
        assert all(w.shape[1] == p.shape[0] for p, w in zip(ws, ws[1:]))
        assert all(w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0 for w in ws), "the kernels' alignment hints"
        self.w = torch.cat([w.reshape(-1) for w in ws])
        self.y = torch.empty(sum(w.shape[0] for w in ws), device=dev, dtype=dt)
        rows, tile, w_off, y_off = [], 0, 0, 0
        for w in ws:
            rows.append((tile, w.shape[0], w.shape[1], w_off, y_off))
            tile += triton.cdiv(w.shape[0], block_n)
            w_off += w.numel()
            y_off += w.shape[0]
        rows.append((tile, 0, 0, 0, 0))
        self.meta = torch.tensor(rows, dtype=torch.int64, device=dev)
        self.lof = torch.tensor([l for l, r in enumerate(rows[:-1]) for _ in range(rows[l + 1][0] - r[0])],
                                dtype=torch.int32, device=dev)
        self.items, self.layers, self.programs = tile, len(ws), programs
        self.ticket = torch.zeros(1, dtype=torch.int64, device=dev)
        self.done = torch.zeros(len(ws) * stride, dtype=torch.int64, device=dev)
        self.cfg = dict(BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages, num_warps=num_warps,
                        PF_LINES=pf_lines, LINE=128 // ws[0].element_size(), SLEEP=sleep_ns, POLL=poll,
                        STRIDE=stride, STATIC=static, NODEP=nodep)
        self.outs = [self.y[r[4]:r[4] + r[1]] for r in rows[:-1]]
        self.db = db
        if db:  # (the whole row of every layer in one tile)
            self.cfg = dict(BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(max(w.shape[1] for w in ws)),
                            STRIDE=stride, NODEP=nodep, POLL=poll, num_warps=num_warps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.db:
            _chain_db_kernel[(self.programs,)](x, self.w, self.y, self.ticket, self.done, self.meta, self.lof,
                                               self.items, self.programs, **self.cfg)
            return self.outs[-1]
        _chain_kernel[(self.programs,)](x, self.w, self.y, self.ticket, self.done, self.meta, self.lof,
                                        self.layers, self.items, self.programs, **self.cfg)
        return self.outs[-1]


def chain_ref(x: torch.Tensor, ws) -> list:
    """Each layer's output: float32 products of the rounded input, rounded to the dtype (as `skinny_linear`)."""
    outs = []
    for w in ws:
        x = (w.float() @ x.float()).to(w.dtype)
        outs.append(x)
    return outs


def check() -> int:
    """The persistent chain against `chain_ref` on alternating shapes, twice in a row (the counters carry over);
    on a GPU also with the polling load, padded counters and static items (which need every program resident, so
    not under the interpreter, where programs run one after another)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    shapes = [(96, 64), (64, 96), (208, 64), (64, 208)]
    ws = [(torch.randn(n, k, generator=g) / k ** 0.5).half().to(dev) for n, k in shapes]
    variants = [dict(), dict(db=True)]
    if dev.type == "cuda":
        variants += [dict(poll=1), dict(poll=1, stride=16), dict(poll=1, stride=16, static=1),
                     dict(db=True, poll=1, stride=16)]
    bad = 0
    for v in variants:
        chain = Chain(ws, programs=3, block_n=4, block_k=64, **v)
        for rep in range(2):
            x = torch.randn(64, generator=g).half().to(dev)
            chain(x)
            for l, (got, want) in enumerate(zip(chain.outs, chain_ref(x, ws))):
                err = (got.float() - want.float()).abs().max().item()
                ok = err <= 2e-3 * max(1.0, want.float().abs().max().item())
                bad += not ok
                print(f"{v} launch {rep} layer {l}: max error {err:.2e} {'ok' if ok else 'WRONG'}")
        want_t = 2 * chain.programs if v.get("static") else 2 * (chain.items + chain.programs)
        print(v, "tickets", int(chain.ticket.item()), "expected", want_t, "done", chain.done.tolist())
        bad += int(chain.ticket.item()) != want_t
    return 1 if bad else 0


def graph_us(fn) -> float:
    """us per call of ``fn``: `bench_skinny.graph_time_us`'s CUDA graph of one call, replayed."""
    from bench_skinny import graph_time_us  # (scripts/ is on the path when this script runs)

    return graph_time_us([fn], reps=20)


def bench(layers: int) -> None:
    from rosecli.kernels.launch_table import skinny_launch
    from rosecli.kernels.skinny_gemm import skinny_linear

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    chains = {"square 2048 (1B's o)": [(2048, 2048)] * layers,
              "square 1536 (Qwen's o)": [(1536, 1536)] * layers,
              "up/down 2048x8192 (1B's down, gate-sized up)": [(8192, 2048), (2048, 8192)] * (layers // 2),
              "square 4096 (8B's o)": [(4096, 4096)] * layers}
    for name, shapes in chains.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for n, k in shapes]
        x = torch.randn(shapes[0][1], device=dev, dtype=torch.bfloat16)
        floor = sum(w.numel() * 2 for w in ws) / 4.4e6  # (us at ~4.4 TB/s, the H200's measured read ceiling)

        def per_layer():
            h = x[None, :]
            for w in ws:
                h = skinny_linear(h, w, launch=skinny_launch(1, w.shape[0], w.shape[1]))
            return h

        t_sep = graph_us(per_layer)
        ref = per_layer()[0]
        line = f"{name}, {len(ws)} layers: one launch a layer {t_sep:8.1f} us ({floor:.1f} us of reads)"
        kmax = max(k for _, k in shapes)
        pf = triton.next_power_of_2(kmax // 64)
        best = dict(poll=1, stride=16, static=1, pf_lines=pf, sleep_ns=100)
        xbig = torch.randn(kmax, device=dev, dtype=torch.bfloat16)
        dyn = dict(poll=1, stride=16, pf_lines=pf, sleep_ns=100)  # (static items deadlock unless every program
        # is resident: only at the launch measured resident, 4 a SM of 2 warps and 512-wide K; `db` takes tickets)
        print(line, flush=True)
        line = ""
        dbw = max(4, min(16, triton.next_power_of_2(kmax) // 512))  # (warps for a whole row: 4 x 512 a warp)
        for per_sm, bk, nw, bn, v in ((4, 512, 2, 4, dict()), (4, 512, 2, 4, best), (4, 512, 2, 4, dyn),
                                      (4, 1024, 4, 4, dyn), (4, 1024, 4, 4, dict(dyn, nodep=1)),
                                      (1, 0, dbw, 4, dict(db=True, poll=1, stride=16)),
                                      (2, 0, dbw, 4, dict(db=True, poll=1, stride=16)),
                                      (4, 0, dbw, 4, dict(db=True, poll=1, stride=16)),
                                      (2, 0, dbw // 2, 4, dict(db=True, poll=1, stride=16)),
                                      (2, 0, dbw, 4, dict(db=True, poll=1, stride=16, nodep=1))):
            chain = Chain(ws, programs=sms * per_sm, block_n=bn, block_k=bk, num_warps=nw, **v)
            xin = xbig if v.get("nodep") else x
            t = graph_us(lambda: chain(xin))
            err = math.nan if v.get("nodep") else (chain(x).float() - ref.float()).abs().max().item()
            print(f"   persistent {per_sm}/SM N{bn} K{bk} {nw}w {v}: {t:8.1f} us ({t_sep / t:4.2f}x, err {err:.1e})",
                  flush=True)
        del ws


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="correctness only (any machine)")
    ap.add_argument("--layers", type=int, default=16)
    a = ap.parse_args()
    if a.check or not torch.cuda.is_available():
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("no CUDA GPU: run the check with TRITON_INTERPRET=1")
        sys.exit(check())
    bench(a.layers)


if __name__ == "__main__":
    main()
