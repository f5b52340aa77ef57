"""Linear layers for decode's few rows: ``y = x @ W^T (+ bias) (-> gelu_tanh | silu(gate) * up)``
in one kernel.

A decode step multiplies 1-64 rows by each weight matrix. cuBLAS picks split-K kernels plus a
reduce kernel for some of these shapes, and an epilogue (bias + GELU, SiLU(gate) * up) is another
elementwise kernel;
at GPT-2's and SmolLM2's sizes each kernel is a few microseconds, mostly fixed cost, so a step's time
follows its kernel count. Here each output tile is one program that streams its rows of ``W`` once
(the weights are what a decode step reads) and applies the epilogue before the store:

- one row (``M == 1``): vector products (no tensor cores), ``BLOCK_N`` output columns per program;
- several rows: ``tl.dot`` on tiles of ``BLOCK_M`` rows (16 at least; padding rows are masked); for the 1B-8B
  layers (`launch_table.tma_launch`, on a `tma_device`), the same tiles loaded by the TMA unit from descriptors of
  W and x, with the weights as the product's wide side (`SkinnyLaunch.tma`, `_tma_product`).
  ``ROSE_TMA_GEMM=0`` leaves those layers to cuBLAS.
- ``SPLIT_K`` > 1 (few output columns, long rows): the programs of one tile each take a share of ``K``
  and write float32 partials; the last of them to finish (an atomic ticket) adds the partials in
  split order, so the result does not depend on which finished first, and re-arms the ticket.

The float arithmetic is float32; the product is rounded to the output dtype once with the bias
added (as cuBLAS's bias epilogue does), and before the GELU as `activation.bias_gelu` after an
unbiased GEMM does; SiLU(gate) * up rounds as `activation.silu_mul` after the GEMM does.
``skinny_linear_ref`` is the torch reference. The models take this path in CUDA-graph decode steps only
(`models.common.fused_linear`), where a Triton launch's host time is not paid per replay; set
``ROSE_SKINNY_GEMM=0`` to keep cuBLAS there (before/after measurements). Launch choices are plain lookups
(`launch_table.skinny_launch`), measured on the H100 with ``scripts/bench_skinny.py``.

Two steps around a layer can run inside the kernel too (at one row, where `launch_table.fold_norm` and
`kv_in_gemm` say): `skinny_norm_linear` takes the residual add and LayerNorm/RMSNorm before the layer as
its prologue (`NormIn`: `norm.add_norm`'s arithmetic; the sum, the new residual stream, is written out,
the normed rows are not), and ``kv`` (`KVOut`) stores a q/k/v projection's K and V columns into the paged
cache in the epilogue. ``ROSE_NORM_FOLD=0`` keeps the add_norm kernel.

At 2-64 rows (`launch_table.stats_fold`) the add_norm between two layers is split between their kernels
instead: `skinny_linear_add` (the layer before) adds its deferred bias and the residual and writes each
column tile's statistics of the sum's rows (`StreamStats`); `skinny_stats_norm_linear` (the layer after) reads
the raw sum with the norm's scale folded into a copy of its weights (`NormFold`) and makes the product the
normed rows' in its epilogue from each row's mean and 1/std. Normalising each K tile as it is read cost more
than the add_norm kernel it saved (64 rows x K of float32 arithmetic per program). At one row (the 1.5B-8B
widths, `launch_table.stats_pair`) the layer before also writes the sum times the norm's scale, which the layer after
reads with its own weights (`NormFold.scale`): no copy. ``ROSE_NORM_STATS=0`` keeps the add_norm kernel.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from rosecli.kernels import activation
from rosecli.kernels.activation import gelu_tanh, silu
from rosecli.kernels.launch_table import SkinnyLaunch, prefetch_lines, skinny_launch
from rosecli.kernels.norm import add_norm_ref
from rosecli.kernels.pdl import LINE_BYTES, l2_prefetch, use_pdl, use_prefetch
from rosecli.kernels.rotary import rotate_pair

MAX_ROWS = 64  # the most rows this path takes (a decode step's batch); more go to cuBLAS


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                      gelu: bool = False, swiglu: bool = False) -> torch.Tensor:
    """x: [M, K], weight: [N, K], bias: [N] -> [M, N] in x's dtype: ``linear`` then GELU (tanh), or
    ``silu(gate) * up`` of a fused [2F, K] gate/up weight (``swiglu``, [M, F])."""
    if swiglu:
        return activation.silu_mul_ref(F.linear(x, weight))
    if gelu:
        y = F.linear(x, weight)
        return F.gelu(y if bias is None else y + bias, approximate="tanh")
    return F.linear(x, weight, bias)

LAYER_NORM, RMS_NORM = 1, 2  # the kernel's NORM prologues (0: none)


@triton.jit
def _norm_sum(x_ptr, xb_ptr, r_ptr, rm, kk, mmask, K, stride_xm, stride_rm, HAS_XB: tl.constexpr,
              HAS_RES: tl.constexpr):
    """``x (+ x_bias) (+ residual)`` of rows ``rm`` at columns ``kk``, rounded to x's dtype (as `norm.add_norm`
    stores it), in float32; 0 outside."""
    mask = mmask[:, None] & (kk < K)[None, :]
    s = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_XB:
        s += tl.load(xb_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        s += tl.load(r_ptr + rm[:, None] * stride_rm + kk[None, :], mask=mask, other=0.0).to(tl.float32)
    return s.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _tile_stats(sv, kk, K, eps, NORM: tl.constexpr):
    """(mean, 1/std) of rows whose whole sum ``sv`` is in this tile: LayerNorm's (two passes over the
    tile, as `norm.add_norm`) or RMSNorm's (mean 0)."""
    if NORM == 1:
        mean = tl.sum(sv, axis=1) / K
        d = tl.where((kk < K)[None, :], sv - mean[:, None], 0.0)
        return mean, tl.rsqrt(tl.sum(d * d, axis=1) / K + eps)
    return tl.sum(sv, axis=1) * 0.0, tl.rsqrt(tl.sum(sv * sv, axis=1) / K + eps)


@triton.jit
def _normed(sv, s_ptr, g_ptr, nb_ptr, rm, kk, kmask, sum_rows, K, mean, rstd, NORM: tl.constexpr,
            HAS_NB: tl.constexpr):
    """The GEMM's input tile from the sum ``sv`` (float32, rounded to the stream's dtype): its norm with
    `norm.add_norm`'s arithmetic and roundings, in the sum's dtype; also writes the sum (the new residual
    stream, [M, K]) of ``sum_rows`` at these columns."""
    dt = s_ptr.dtype.element_ty
    tl.store(s_ptr + rm[:, None] * K + kk[None, :], sv.to(dt), mask=sum_rows[:, None] & kmask[None, :])
    g = tl.load(g_ptr + kk, mask=kmask, other=0.0).to(tl.float32)[None, :]
    if NORM == 2:
        h = (sv * rstd[:, None]).to(dt).to(tl.float32) * g
    else:
        h = tl.where(kmask[None, :], sv - mean[:, None], 0.0) * rstd[:, None] * g
        if HAS_NB:
            h += tl.load(nb_ptr + kk, mask=kmask, other=0.0).to(tl.float32)[None, :]
    return h.to(dt)


@triton.jit
def _store_partials(st_ptr, y, rm, rn, store_rows, nmask, pid_n, tiles, count, NORM: tl.constexpr):
    """This column tile's share of each row's statistics of ``y`` (float32 [BLOCK_M, BLOCK_N], ``count`` real
    columns) into ``st_ptr`` [M, tiles, 2]: LayerNorm's (tile mean, sum of squared deviations from it),
    RMSNorm's (sum of squares, 0)."""
    yv = tl.where(nmask[None, :], y, 0.0)
    if NORM == 1:
        a = tl.sum(yv, axis=1) / count
        d = tl.where(nmask[None, :], y - a[:, None], 0.0)
        b = tl.sum(d * d, axis=1)
    else:
        a = tl.sum(yv * yv, axis=1)
        b = a * 0.0
    p = st_ptr + (rm * tiles + pid_n) * 2
    tl.store(p, a, mask=store_rows)
    tl.store(p + 1, b, mask=store_rows)


@triton.jit
def _stats_load(st_ptr, rm, mmask, tiles, TILES_PAD: tl.constexpr, NORM: tl.constexpr):
    """The partials `_store_partials` wrote for rows ``rm``: ([BLOCK_M, TILES_PAD] x 2, 0 past the tiles; RMSNorm's
    second, all 0, not read)."""
    t = tl.arange(0, TILES_PAD)
    mask = mmask[:, None] & (t < tiles)[None, :]
    p = st_ptr + (rm[:, None] * tiles + t[None, :]) * 2
    a = tl.load(p, mask=mask, other=0.0)
    if NORM == 1:
        b = tl.load(p + 1, mask=mask, other=0.0)
    else:
        b = a * 0.0
    return a, b


@triton.jit
def _stream_stats(a, b, tiles, width, K, eps, NORM: tl.constexpr, TILES_PAD: tl.constexpr):
    """Each row's (mean, 1/std) from `_stats_load`'s partials over the ``K`` columns (``tiles`` tiles of
    ``width``), combined in tile order: the same in every program and run."""
    if NORM == 1:  # Chan et al.'s combination of the tiles' (mean, sum of squared deviations)
        t = tl.arange(0, TILES_PAD)
        cnt = tl.where(t < tiles, tl.minimum(width, K - t * width), 0).to(tl.float32)[None, :]
        mean = tl.sum(a * cnt, axis=1) / K
        d = a - mean[:, None]
        m2 = tl.sum(b + cnt * d * d, axis=1)
    else:
        mean = tl.sum(a, axis=1) * 0.0
        m2 = tl.sum(a, axis=1)
    return mean, tl.rsqrt(m2 / K + eps)


@triton.jit
def _unfold_norm(acc, mean, rstd, c_ptr, d_ptr, cols, cmask, NORM: tl.constexpr, HAS_NB: tl.constexpr):
    """The product of the raw stream with a norm-folded weight (`NormFold`) made the product of the normed rows:
    ``rstd * (acc - mean * colsum) + shift`` (LayerNorm), ``rstd * acc`` (RMSNorm)."""
    if NORM == 1:
        c = tl.load(c_ptr + cols, mask=cmask, other=0.0)
        acc = rstd[:, None] * (acc - mean[:, None] * c[None, :])
        if HAS_NB:
            acc += tl.load(d_ptr + cols, mask=cmask, other=0.0)[None, :]
        return acc
    return rstd[:, None] * acc


@triton.jit
def _tma_product(w_desc, x_desc, n0, m0, k_lo, k_hi, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    """(`SkinnyLaunch.tma`) The product's [BLOCK_M, BLOCK_N] tiles (and the up projection's, ``SWIGLU``) over K in
    [k_lo, k_hi), the weight and x tiles loaded by the TMA unit (the descriptors zero what lies past the tensors: x's
    padding rows, K's end), the weights as the wide side of the product (W x^T, transposed once at the end: 16-32 rows
    are too few for the other side of a Hopper tensor-core product). No tile is loaded before the loop, as the plain
    loads' first weight tile is (ahead of the wait on the kernel before): at 64 rows that took the gate/up + SiLU of
    Qwen2.5-1.5B from 18.5 to 28.6 us (the loop's first wait then holds every stage's loads)."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PDL:  # launched early: x is read only once the kernel before has ended
        gdc_wait()
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        x = x_desc.load([m0, k])
        acc = tl.dot(w_desc.load([n0, k]), tl.trans(x), acc)
        if SWIGLU:  # the up rows follow the N gate rows
            acc_u = tl.dot(w_desc.load([N + n0, k]), tl.trans(x), acc_u)
    return tl.trans(acc), tl.trans(acc_u)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, ticket_ptr, xb_ptr, r_ptr, g_ptr, nb_ptr, s_ptr,
                   kc_ptr, vc_ptr, slot_ptr, st_ptr, sc_ptr, pos_ptr, cos_ptr, sin_ptr, w_desc, x_desc, M, N, K,
                   stride_xm, stride_wn, stride_ym, stride_rm, k_per_split, eps, kv_first, kv_size, kv_heads, st_tiles,
                   st_width, rope_stride,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                   SWIGLU: tl.constexpr, NORM: tl.constexpr, HAS_XB: tl.constexpr, HAS_RES: tl.constexpr,
                   HAS_NB: tl.constexpr, KV_STORE: tl.constexpr, KV_HEAD_DIM: tl.constexpr,
                   KV_BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr, FROM_STATS: tl.constexpr,
                   RES_OUT: tl.constexpr, STATS_PAD: tl.constexpr, SCALED_OUT: tl.constexpr, ROPE: tl.constexpr,
                   PF_LINES: tl.constexpr, LINE: tl.constexpr, TMA: tl.constexpr):
    if PDL:  # the next kernel may launch now (it waits on the device for this one's end before its reads)
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    if ROPE:  # (`KVOut.rope`) the q and k columns (before kv_first + kv_size) taken in rotation pairs: output columns
        # 2j and 2j + 1 of this launch are columns d and d + head_dim / 2 of one head, side by side in the epilogue
        half: tl.constexpr = KV_HEAD_DIM // 2
        rot = rn < kv_first + kv_size
        j = rn // 2
        rn = tl.where(rot, (j // half) * KV_HEAD_DIM + j % half + (rn % 2) * half, rn)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # Epilogue operands that no kernel writes, read before the wait (`kernels.pdl`): the bias, and the rows' positions
    # and cache slots, which the host copied before the step. A kernel launched early then has them when the kernel
    # before ends, not after its own loop. Not the rotary tables' entries (a load that waits on the position's, which
    # put the wait and x's loads behind a round trip: Llama-3.1-8B's one-row step 2% slower) nor the next norm's scale
    # (Llama-3.1-8B's one-row step 5% slower; compiled on the CPU, its 4-warp GEMM before each norm then fits 3
    # programs on an SM instead of 2).
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    if ROPE:
        pos = tl.load(pos_ptr + rm, mask=mmask, other=0).to(tl.int64)
    if KV_STORE:
        slot = tl.load(slot_ptr + rm, mask=mmask, other=-1).to(tl.int64)  # a negative slot stores nothing
    if TMA:  # (plain tensor-core tiles only: no prologue, no ROPE)
        acc, acc_u = _tma_product(w_desc, x_desc, pid_n * BLOCK_N, pid_m * BLOCK_M, k_lo, k_hi, N, BLOCK_M, BLOCK_N,
                                  BLOCK_K, SWIGLU, NUM_STAGES, PDL)
    else:
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
        up_off = N.to(tl.int64) * stride_wn  # SWIGLU: the up rows follow the N gate rows
        x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :]
        # USE_DOT: [BLOCK_M, BLOCK_N] tiles; one row: [BLOCK_N, BLOCK_K] products summed after the loop
        if USE_DOT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        # the first K tile of the weights, which no kernel before writes: with PDL, fetched while that kernel ends
        kmask = (k_lo + rk) < k_hi
        wmask = nmask[:, None] & kmask[None, :]
        w = tl.load(w_ptrs, mask=wmask, other=0.0)
        if SWIGLU:
            wu = tl.load(w_ptrs + up_off, mask=wmask, other=0.0)
        if PF_LINES > 0:  # (`pdl.l2_prefetch`) the rest of this program's weights, a line (LINE elements) at a time,
            # asked for now: after the wait the loop reads them from L2 instead of waiting on memory
            pk = tl.minimum(k_lo + BLOCK_K + tl.arange(0, PF_LINES) * LINE, k_hi - 1)
            pw = w_ptr + tl.minimum(rn, N - 1)[:, None].to(tl.int64) * stride_wn + pk[None, :]
            l2_prefetch(pw)
            if SWIGLU:
                l2_prefetch(pw + up_off)
        if PDL:  # launched early: x (the kernel before's output) is read only once that kernel has ended
            gdc_wait()
        if FROM_STATS:  # x is the residual stream (with norm-folded weights) or the stream times the norm's scale (with
            # the layer's own), as the GEMM before wrote it; its rows' statistics (written by that GEMM too) are
            # loaded beside its first tile and combined in the epilogue
            x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            st_a, st_b = _stats_load(st_ptr, rm, mmask, st_tiles, STATS_PAD, NORM)
        elif NORM:  # the add_norm before, folded in: the whole rows are this one K tile (`_launch` makes sure), read
            # once for the statistics and the product; the first column tile's programs store the sum
            sum_rows = mmask & (tl.zeros_like(rm) + pid_n == 0)
            sv = _norm_sum(x_ptr, xb_ptr, r_ptr, rm, rk, mmask, K, stride_xm, stride_rm, HAS_XB, HAS_RES)
            mean, rstd = _tile_stats(sv, rk, K, eps, NORM)
            x = _normed(sv, s_ptr, g_ptr, nb_ptr, rm, rk, kmask, sum_rows, K, mean, rstd, NORM, HAS_NB)
        else:
            x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w))
            if SWIGLU:
                acc_u += tl.dot(x, tl.trans(wu))
        else:
            acc += w.to(tl.float32) * x.to(tl.float32)
            if SWIGLU:
                acc_u += wu.to(tl.float32) * x.to(tl.float32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        for k in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            kmask = (k + rk) < k_hi
            wmask = nmask[:, None] & kmask[None, :]
            x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)  # (whole-row NORM: no second tile)
            w = tl.load(w_ptrs, mask=wmask, other=0.0)
            if USE_DOT:
                acc += tl.dot(x, tl.trans(w))
            else:
                acc += w.to(tl.float32) * x.to(tl.float32)  # x: [1, BLOCK_K] broadcast over the rows of w
            if SWIGLU:
                wu = tl.load(w_ptrs + up_off, mask=wmask, other=0.0)
                if USE_DOT:
                    acc_u += tl.dot(x, tl.trans(wu))
                else:
                    acc_u += wu.to(tl.float32) * x.to(tl.float32)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    if not USE_DOT:
        acc = tl.reshape(tl.sum(acc, axis=1), (1, BLOCK_N))
        acc_u = tl.reshape(tl.sum(acc_u, axis=1), (1, BLOCK_N))
    out_mask = mmask[:, None] & nmask[None, :]
    store_rows = mmask  # (RES_OUT: the rows whose statistics this program writes)
    if SPLIT_K > 1:
        # float32 partials [SPLIT_K (x2 with SWIGLU), M, N]; the tile's last program adds them in split order
        tile = pid_m * tl.num_programs(0) + pid_n
        p_ptrs = part_ptr + rm[:, None] * N + rn[None, :]
        tl.store(p_ptrs + split * M * N, acc, mask=out_mask)
        if SWIGLU:
            tl.store(p_ptrs + (SPLIT_K + split) * M * N, acc_u, mask=out_mask)
        tl.debug_barrier()  # every thread's partial written before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")
        last = ticket == SPLIT_K - 1
        out_mask = out_mask & (tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32) + ticket == SPLIT_K - 1)
        store_rows = store_rows & (tl.zeros_like(rm) + ticket == SPLIT_K - 1)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(SPLIT_K):
            acc += tl.load(p_ptrs + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if SWIGLU:
                acc_u += tl.load(p_ptrs + (SPLIT_K + s) * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.store(ticket_ptr + tile, 0, mask=last)  # re-armed for the next launch (graphs replay the buffer)
    if FROM_STATS:  # (g_ptr, nb_ptr: the fold's colsum and shift, [N] or, SWIGLU, [2N])
        mean, rstd = _stream_stats(st_a, st_b, st_tiles, st_width, K, eps, NORM, STATS_PAD)
        acc = _unfold_norm(acc, mean, rstd, g_ptr, nb_ptr, rn, nmask, NORM, HAS_NB)
        if SWIGLU:
            acc_u = _unfold_norm(acc_u, mean, rstd, g_ptr, nb_ptr, N + rn, nmask, NORM, HAS_NB)
    dt = y_ptr.dtype.element_ty
    if RES_OUT:  # the residual add of the add_norm after (the bias, too, after the product is rounded, as it
        # adds a deferred one), and this tile's share of the sum's statistics for the norm
        y = acc.to(dt).to(tl.float32)
        if HAS_BIAS:
            y += bias[None, :]
        y += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=out_mask, other=0.0).to(tl.float32)
        y = y.to(dt).to(tl.float32)
        count = tl.minimum(N - pid_n * BLOCK_N, BLOCK_N).to(tl.float32)
        _store_partials(st_ptr, y, rm, rn, store_rows, nmask, pid_n, tl.num_programs(0), count, RES_OUT)
        if SCALED_OUT:  # also the sum times the next norm's scale (g_ptr), the next GEMM's input: [M, N]
            g = tl.load(g_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
            tl.store(sc_ptr + rm[:, None] * N + rn[None, :], (y * g[None, :]).to(dt), mask=out_mask)
    else:
        if HAS_BIAS:
            if GELU:
                acc = acc.to(dt).to(tl.float32) + bias[None, :]
            else:
                acc = acc + bias[None, :]
        y = acc.to(dt).to(tl.float32)
        if GELU:
            y = gelu_tanh(y)
        if SWIGLU:  # silu(gate) rounded, times up rounded (`activation.silu_mul` after the GEMM)
            y = silu(y).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)
        if ROPE:  # q and k rotated as `rotary.rotary_kv` rotates them in the GEMM's rounded output: each pair's two
            # columns swapped for the partner term, the full-width tables read at each column's place in its head
            at = pos[:, None] * rope_stride + (rn % KV_HEAD_DIM)[None, :]
            c = tl.load(cos_ptr + at, mask=out_mask, other=0.0).to(tl.float32)  # (float32 whatever the tables')
            s = tl.load(sin_ptr + at, mask=out_mask, other=0.0).to(tl.float32)
            first, second = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
            partner = tl.reshape(tl.join(second, first), (BLOCK_M, BLOCK_N))
            y = tl.where(rot[None, :], rotate_pair(y, partner, c, s).to(dt).to(tl.float32), y)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(dt), mask=out_mask)
    if KV_STORE:  # columns kv_first.. are K then V: also into their cache slots (`store_kv.store_kv_cache`)
        c = rn - kv_first
        is_v = c >= kv_size
        c = tl.where(is_v, c - kv_size, c)
        row = ((slot // KV_BLOCK) * kv_heads)[:, None] + (c // KV_HEAD_DIM)[None, :]
        dst = (row * KV_BLOCK + (slot % KV_BLOCK)[:, None]) * KV_HEAD_DIM + (c % KV_HEAD_DIM)[None, :]
        kv_mask = out_mask & (slot >= 0)[:, None] & (rn >= kv_first)[None, :]
        tl.store(kc_ptr + dst, y.to(kc_ptr.dtype.element_ty), mask=kv_mask & ~is_v[None, :])
        tl.store(vc_ptr + dst, y.to(vc_ptr.dtype.element_ty), mask=kv_mask & is_v[None, :])


_tickets: dict[torch.device, torch.Tensor] = {}


def _ticket_buffer(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-device int32 tickets for split-K (zero between launches; made once, never shrunk, so a
    captured graph keeps pointing at a live buffer)."""
    buf = _tickets.get(device)
    if buf is None or buf.numel() < tiles:
        if buf is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K ticket buffer grown during graph capture")
        buf = torch.zeros(max(tiles, 65536), dtype=torch.int32, device=device)
        _tickets[device] = buf
    return buf


@functools.lru_cache(maxsize=None)
def tma_device(device: torch.device) -> bool:
    """Whether ``device`` takes the launch table's TMA launches (`SkinnyLaunch.tma`): compute capability 9.x or 10.x
    (Hopper, the data-centre Blackwells: a TMA unit, and 227 KB of shared memory a program, which the table's 6-stage
    tiles at 64 rows need, 192 KB), or the interpreter's CPU. Elsewhere the models keep cuBLAS for those layers."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] in (9, 10)


def table_launch(x: torch.Tensor, n: int, swiglu: bool = False) -> Optional[SkinnyLaunch]:
    """`launch_table.skinny_launch` for ``x``'s rows times an [n, K] weight (a [2n, K] gate/up with ``swiglu``) on
    ``x``'s device, or None (cuBLAS): also where the table gives the TMA tiles and the device is not a `tma_device`."""
    launch = skinny_launch(x.shape[0], n, x.shape[1], swiglu)
    return None if launch is None or (launch.tma and not tma_device(x.device)) else launch


def _tma_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the TMA unit can load ``x``'s and ``weight``'s tiles (`SkinnyLaunch.tma`): a `tma_device`, both start
    and row stride on 16 bytes. Else the launch takes the same tiles with plain loads."""
    if not tma_device(x.device):
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, weight))


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear` takes these operands (else use `skinny_linear_ref`/cuBLAS)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(1) == 1
            and x.stride(1) == 1 and x.shape[1] == weight.shape[1])


class NormIn(NamedTuple):
    """A `norm.add_norm` folded into the GEMM's prologue: the GEMM's input is
    ``norm(x (+ x_bias) (+ residual))`` and the sum (the new residual stream) is written out too."""
    residual: Optional[torch.Tensor]  # [M, K] (None: the sum is x (+ x_bias))
    x_bias: Optional[torch.Tensor]  # [K]: the bias a linear layer before left out
    weight: torch.Tensor  # [K] the norm's scale
    bias: Optional[torch.Tensor]  # [K] LayerNorm's shift (RMSNorm: None)
    eps: float
    rms: bool  # RMSNorm, else LayerNorm


class KVOut(NamedTuple):
    """A q/k/v projection's K and V columns also stored into a layer's paged cache by the GEMM's
    epilogue (as `store_kv.store_kv_cache` after it would): the last ``2 * kv_heads * head_dim`` output
    columns are K then V; a row whose slot is negative stores nothing. With ``rope`` (positions [M] and the
    full-width float32 cos/sin tables of `rotary.rotary_kv`), the q and k heads (all columns before V) are
    rotated first, in the output and in the cache: `rotary.rotary_kv` in the epilogue (the launch's columns
    taken in rotation pairs; up to float32 contraction of its multiply-adds, which that kernel does not do)."""
    k_cache: torch.Tensor  # [num_blocks, kv_heads, block_size, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [M]
    rope: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # (positions, cos, sin)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  gelu: bool = False, launch: Optional[SkinnyLaunch] = None, swiglu: bool = False,
                  kv: Optional[KVOut] = None) -> torch.Tensor:
    """`skinny_linear_ref` in one launch for ``x`` of at most `MAX_ROWS` rows (`supported`). ``swiglu``:
    ``weight`` is a fused [2F, K] gate/up projection and the result is ``silu(gate) * up``, [M, F].
    ``kv``: the K and V columns also stored into the cache (`KVOut`)."""
    return _launch(x, weight, bias, gelu, launch, swiglu, None, kv)[0]


def skinny_norm_linear(x: torch.Tensor, norm: NormIn, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       gelu: bool = False, launch: Optional[SkinnyLaunch] = None, swiglu: bool = False,
                       kv: Optional[KVOut] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`skinny_norm_linear_ref` in one launch: ``(linear(norm(sum)), sum)``, ``sum = x (+ x_bias) (+ residual)``,
    without the normed rows ever stored; ``kv`` as `skinny_linear`'s."""
    assert norm.residual is None or (norm.residual.shape == x.shape and norm.residual.stride(1) == 1)
    return _launch(x, weight, bias, gelu, launch, swiglu, norm, kv)


def skinny_norm_linear_ref(x: torch.Tensor, norm: NormIn, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                           gelu: bool = False, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm.add_norm_ref` then `skinny_linear_ref`."""
    h, total = add_norm_ref(x, norm.residual, norm.weight, norm.bias, norm.eps, norm.x_bias, norm.rms)
    return skinny_linear_ref(h, weight, bias, gelu, swiglu), total


class StreamStats(NamedTuple):
    """Each row's statistics of a residual stream, for the norm after it, as the epilogue of `skinny_linear_add`
    wrote them: partials per column tile of ``width`` ([M, tiles, 2] float32; LayerNorm's tile mean and sum of
    squared deviations, or RMSNorm's sum of squares), combined by the next GEMM's prologue
    (`skinny_stats_norm_linear`); and, if it was asked to, the stream times the norm's scale (``scaled``)."""
    partials: torch.Tensor
    width: int
    rms: bool
    scaled: Optional[torch.Tensor] = None  # [M, N] in the stream's dtype


def skinny_linear_add(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                      rms: bool, launch: Optional[SkinnyLaunch] = None,
                      scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, StreamStats]:
    """A linear layer and the residual add after it in one launch: ``sum = x @ W^T (+ bias) + residual`` with
    `norm.add_norm`'s arithmetic (the product rounded, then the bias and the residual added in float32 and
    rounded once: the bias deferred to the add, as `common.linear_deferring_bias` does), and the statistics of
    the sum's rows for the ``rms`` (else LayerNorm) norm after it: ``(sum, StreamStats)``. ``scale`` (the norm's
    scale): the statistics also carry ``sum * scale``, rounded, the input of a `NormFold` without a copy."""
    assert residual.shape == (x.shape[0], weight.shape[0]) and residual.stride(1) == 1
    return _launch(x, weight, bias, False, launch, False, None, None, res_out=(residual, rms, scale))


class NormFold(NamedTuple):
    """A norm folded into the linear layer after it (`fold_norm_weights`), for `skinny_stats_norm_linear`:
    ``linear(norm(s)) = rstd * (s @ weight^T - mean * colsum) + shift`` per row of mean ``mean`` and 1/std
    ``rstd`` (RMSNorm: ``rstd * s @ weight^T``), where ``weight`` is the layer's with the norm's scale
    multiplied into its columns, so the GEMM reads the raw residual stream and the norm is two per-row numbers
    in its epilogue. With ``scale``, ``weight`` is the layer's own (no copy) and the GEMM reads the stream times
    ``scale``, which the GEMM before wrote beside the stream (`skinny_linear_add`'s ``scale``)."""
    weight: torch.Tensor  # the weights the GEMM reads: norm-folded (in the weight's dtype), or with `scale` its own
    colsum: Optional[torch.Tensor]  # [rows of weight] float32: each output's sum of the folded weights (LayerNorm)
    shift: Optional[torch.Tensor]  # [rows of weight] float32: the norm's shift through the layer (LayerNorm's bias)
    eps: float
    rms: bool
    scale: Optional[torch.Tensor] = None  # [K] the norm's scale, for the GEMM before to apply (no copy)


def fold_norm_weights(weight: torch.Tensor, norm_weight: torch.Tensor, norm_bias: Optional[torch.Tensor],
                      eps: float, rms: bool, copy: bool = True) -> NormFold:
    """`NormFold` of a LayerNorm (``rms``: RMSNorm) of scale ``norm_weight`` and shift ``norm_bias`` into a linear
    layer of ``weight`` ([N, K], or a fused gate/up [2N, K]): with ``copy``, a new weight tensor of the same size;
    without, the norm's scale is kept for the GEMM before to apply to the stream, and only [N] vectors are made."""
    if copy:
        folded = (weight.float() * norm_weight.float()[None, :]).to(weight.dtype)
        colsum = None if rms else folded.float().sum(1)
    else:
        folded = weight
        colsum = None if rms else weight.float() @ norm_weight.float()
    shift = None if rms or norm_bias is None else weight.float() @ norm_bias.float()
    return NormFold(folded, colsum, shift, eps, rms, None if copy else norm_weight)


def skinny_stats_norm_linear(total: torch.Tensor, stats: StreamStats, fold: NormFold,
                             bias: Optional[torch.Tensor] = None, gelu: bool = False,
                             launch: Optional[SkinnyLaunch] = None, swiglu: bool = False,
                             kv: Optional[KVOut] = None) -> torch.Tensor:
    """``linear(norm(total))`` in one launch, ``total`` the residual stream `skinny_linear_add` wrote with
    ``stats``, the norm folded into the layer's weights (``fold``): a plain product of the stream (or, for a fold
    without a copy, of ``stats.scaled``), made the normed rows' product in the epilogue. The normed rows are never
    formed, so the result is not rounded as `norm.add_norm` then the GEMM round it: the same to fp16's rounding of
    the product, not bit for bit."""
    assert fold.rms == stats.rms
    if fold.scale is not None:
        if stats.scaled is None:
            raise ValueError("a norm fold without a copy needs the stream times the norm's scale: "
                             "give skinny_linear_add the scale")
        total = stats.scaled
    return _launch(total, fold.weight, bias, gelu, launch, swiglu, None, kv, stats=(stats, fold))[0]


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], gelu: bool,
            launch: Optional[SkinnyLaunch], swiglu: bool, norm: Optional[NormIn], kv: Optional[KVOut],
            stats: Optional[tuple[StreamStats, NormFold]] = None,
            res_out: Optional[tuple[torch.Tensor, bool, Optional[torch.Tensor]]] = None):
    M, K = x.shape
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    assert not (swiglu and (gelu or bias is not None)), "swiglu takes no bias or gelu"
    assert res_out is None or not (gelu or swiglu or norm is not None or kv is not None)
    if kv is not None:
        _, kv_heads, kv_block, head_dim = kv.k_cache.shape
        assert not (swiglu or gelu) and kv.k_cache.is_contiguous() and kv.v_cache.is_contiguous()
        assert kv.v_cache.shape == kv.k_cache.shape and kv.slot_mapping.shape == (M,) and N >= 2 * kv_heads * head_dim
        if kv.rope is not None:
            pos, cos, sin = kv.rope
            assert pos.shape == (M,) and cos.shape[1] == head_dim and cos.stride() == sin.stride()
            assert cos.stride(1) == 1 and cos.dtype == sin.dtype
            assert (N - kv_heads * head_dim) % 2 == 0 and head_dim % 2 == 0
    else:
        kv_heads = kv_block = head_dim = 1
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    total = torch.empty((M, K), dtype=x.dtype, device=x.device) if norm is not None else None
    if norm is not None:  # the norm prologue reads the whole rows as one K tile, unsplit
        cfg = launch or SkinnyLaunch(4 if M == 1 else 16, max(16, triton.next_power_of_2(K)), 1, 4, 1)
        if cfg.block_k < K or cfg.split_k != 1:
            raise ValueError(f"the norm prologue needs the whole K ({K}) in one tile, unsplit; got {cfg}")
    else:
        cfg = launch or table_launch(x, N, swiglu) or SkinnyLaunch(16, 128, 1, 4, 3)
    rope = kv.rope if kv is not None else None
    if rope is not None and cfg.block_n < 2:
        cfg = cfg._replace(block_n=2)  # (rotation pairs: at least one pair per program; block_n is a power of two)
    use_dot = M > 1
    block_m = 1 if not use_dot else max(16, min(triton.next_power_of_2(M), MAX_ROWS))
    split = max(1, min(cfg.split_k, triton.cdiv(K, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per_split)
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, block_m), split)
    if split > 1 and _tickets.get(x.device) is None and x.is_cuda and torch.cuda.is_current_stream_capturing():
        split, k_per_split = 1, K  # (no ticket buffer yet, and none can be made while a graph is captured)
        grid = grid[:2] + (1,)
    pdl = use_pdl(x.device, "skinny")  # (`kernels.pdl`)
    line = LINE_BYTES // weight.element_size()
    tma = (cfg.tma and use_dot and norm is None and stats is None and res_out is None and kv is None
           and _tma_takes(x, weight))
    pf_lines = (prefetch_lines(M, k_per_split - cfg.block_k, line)
                if use_prefetch(x.device, "skinny") and not tma else 0)
    descs = ((TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]),
              TensorDescriptor.from_tensor(x, [block_m, cfg.block_k])) if tma else (None, None))
    if split > 1:
        part = torch.empty((2 * split if swiglu else split, M, N), dtype=torch.float32, device=x.device)
        ticket = _ticket_buffer(x.device, grid[0] * grid[1])
    else:
        part = ticket = y
    n = norm or NormIn(None, None, y, None, 0.0, False)  # (unused pointers stand in for those absent)
    if stats is not None:  # the fold's colsum and shift take the norm's scale and shift pointers
        fold = stats[1]
        n = NormIn(None, None, fold.colsum if fold.colsum is not None else y, fold.shift, fold.eps, fold.rms)
    scaled = None
    residual = n.residual if res_out is None else res_out[0]
    out_stats = None
    if res_out is not None:  # this kernel writes the statistics
        scale = res_out[2]
        if scale is not None:  # (the norm's scale takes the prologue's scale pointer; the product its own output)
            assert scale.shape == (N,)
            n = NormIn(None, None, scale, None, 0.0, False)
            scaled = torch.empty((M, N), dtype=x.dtype, device=x.device)
        out_stats = StreamStats(torch.empty((M, grid[0], 2), dtype=torch.float32, device=x.device), cfg.block_n,
                                res_out[1], scaled)
        st, tiles, width = out_stats.partials, grid[0], cfg.block_n
    elif stats is not None:  # ... or reads them
        st, tiles, width = stats[0].partials, stats[0].partials.shape[1], stats[0].width
        if st.shape[0] != M or triton.cdiv(K, width) != tiles:
            raise ValueError(f"statistics of {st.shape[0]} rows in {tiles} tiles of {width} do not "
                             f"cover a [{M}, {K}] input")
    else:
        st, tiles, width = y, 1, 1
    _skinny_kernel[grid](x, weight, bias if bias is not None else y, y, part, ticket,
                         n.x_bias if n.x_bias is not None else y, residual if residual is not None else y,
                         n.weight, n.bias if n.bias is not None else y, total if total is not None else y,
                         *((kv.k_cache, kv.v_cache, kv.slot_mapping) if kv is not None else (y, y, y)), st,
                         scaled if scaled is not None else y, *(rope if rope is not None else (y, y, y)), *descs,
                         M, N, K, x.stride(0), weight.stride(0),
                         y.stride(0), residual.stride(0) if residual is not None else 0, k_per_split, n.eps,
                         N - 2 * kv_heads * head_dim, kv_heads * head_dim, kv_heads, tiles, width,
                         rope[1].stride(0) if rope is not None else 0,
                         BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, USE_DOT=use_dot,
                         HAS_BIAS=bias is not None, GELU=gelu, SWIGLU=swiglu,
                         NORM=0 if norm is None and stats is None else (RMS_NORM if n.rms else LAYER_NORM),
                         HAS_XB=n.x_bias is not None, HAS_RES=n.residual is not None, HAS_NB=n.bias is not None,
                         KV_STORE=kv is not None,
                         KV_HEAD_DIM=head_dim, KV_BLOCK=kv_block, NUM_STAGES=cfg.num_stages, PDL=pdl,
                         FROM_STATS=stats is not None,
                         RES_OUT=0 if res_out is None else (RMS_NORM if res_out[1] else LAYER_NORM),
                         STATS_PAD=max(16, triton.next_power_of_2(tiles)), SCALED_OUT=scaled is not None,
                         ROPE=rope is not None, PF_LINES=pf_lines, LINE=line, TMA=tma, num_warps=cfg.num_warps,
                         launch_pdl=pdl)
    if out_stats is not None:
        return y, out_stats
    return y, total
