"""Paged decode attention: one query token per sequence against its cached blocks.

Triton kernel (flash-decoding): one program per (sequence, kv head, split), launched either
sequence-major or with the kv heads of one sequence side by side (``head_major``: they read
neighbouring runs of the same cache blocks). Each program takes all query heads that
share one kv head (a GQA group), so each K/V tile is read once for the group, walks its share of
the context ``TILE`` tokens at a time (several blocks per tile, gathered through the block table)
with an online softmax in float32, and writes either the output (one split) or a partial result
and its log-sum-exp; a second kernel merges the splits. On Hopper that merge kernel is launched with
programmatic dependent launch: it starts while the decode kernel runs and waits on the device for its end,
which saves most of the launch gap between the two (0.6-0.9 us per call at most split shapes, measured).

The launch comes from the launch table by batch x kv heads (the split count capped by the context
bound); each sequence's real length is divided among the splits on the device, tile by tile in
turn. So the launch depends on host-side shapes only (CUDA-graph capturable, no sync), and under a
graph, where the bound is the model's maximum, a short context still spreads over the splits
instead of landing in the first. kv heads and group size are runtime arguments, so shapes that
differ only there share one compiled kernel. So is the sliding window (Mistral): the tiles wholly
before a sequence's window are skipped and the rest masked to it.

`paged_kv_read_floor` is the benchmark's companion: the same launch and the same tile loads (`_kv_tile`), summing
the K/V instead of attending, so its time is the floor the paged reads alone set.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from rosecli.kernels import launch_table
from rosecli.kernels.pdl import pdl_begin, use_pdl
from rosecli.kernels.rotary import rotate_pair

LOG2E = 1.4426950408889634
NO_WINDOW = 2 ** 30  # the window argument of a model without sliding window: longer than any context


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[B, kv_heads, num_blocks*block_size, head_dim]: each sequence's first blocks, in order."""
    _, kv_heads, block_size, head_dim = cache.shape
    bt = block_tables[:, :num_blocks].long().clamp_(min=0)
    return cache[bt].transpose(1, 2).reshape(bt.shape[0], kv_heads, num_blocks * block_size, head_dim)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, max_context_len: int, window: Optional[int] = None) -> torch.Tensor:
    """q: [B, heads, head_dim] -> [B, heads, head_dim].

    Gathers each sequence's blocks into a contiguous tensor, then runs SDPA with a length mask.
    ``max_context_len`` is a host-side upper bound of ``context_lens``. ``window`` (sliding window
    attention): the query attends to its last ``window`` tokens only, itself included.
    """
    batch, heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    nblk = max(1, math.ceil(max_context_len / block_size))
    k = gather_kv(k_cache, block_tables, nblk)  # [B, kvh, L, D]
    v = gather_kv(v_cache, block_tables, nblk)
    pos = torch.arange(k.shape[2], device=q.device)
    mask = pos[None, :] < context_lens[:, None].to(pos.dtype)
    if window is not None:
        mask &= pos[None, :] >= context_lens[:, None].to(pos.dtype) - window
    mask = mask[:, None, None, :]  # [B,1,1,L]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                         scale=scale, enable_gqa=heads != kv_heads)
    return out.squeeze(2)


def decode_launch(batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                  max_context_len: int) -> dict:
    """The fixed launch parameters for a shape (see `launch_table`)."""
    return launch_table.row_launch(launch_table.decode_row(batch, heads, kv_heads), max_context_len, block_size)


@triton.jit
def _program_coords(HEAD_MAJOR: tl.constexpr):
    """(sequence, kv head, split) of this program in either launch order."""
    if HEAD_MAJOR:
        return tl.program_id(2), tl.program_id(0), tl.program_id(1)
    else:
        return tl.program_id(0), tl.program_id(1), tl.program_id(2)


@triton.jit
def _split_tiles(ctx, lo, s, num_splits, TILE: tl.constexpr):
    """How many tiles split ``s`` takes: tiles first + s, first + s + num_splits, ... of this sequence's own
    length (not the host bound), so any length spreads evenly (the blocks are scattered anyway); ``first``
    is the tile holding token ``lo``, the first the query attends to (0, or the sliding window's start)."""
    return tl.cdiv(tl.maximum(tl.cdiv(ctx, TILE) - lo // TILE - s, 0), num_splits)


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, j, ctx, lo, kv_heads, kvh, TILE: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """K and V [TILE, HEAD_DIM] of tile ``j`` of one sequence's kv head (zeros outside tokens lo..ctx-1) and which
    rows are attended tokens. One block-table entry per block of the tile (TILE covers whole blocks), spread over
    its tokens."""
    t = tl.arange(0, TILE)
    d = tl.arange(0, HEAD_DIM)
    NB: tl.constexpr = TILE // BLOCK_SIZE
    nb = j * NB + tl.arange(0, NB)
    blocks = tl.load(bt_row + nb, mask=(nb * BLOCK_SIZE < ctx) & ((nb + 1) * BLOCK_SIZE > lo), other=0).to(tl.int64)
    block = tl.reshape(tl.broadcast_to(blocks[:, None], [NB, BLOCK_SIZE]), [TILE])
    off = ((block * kv_heads + kvh) * BLOCK_SIZE + t % BLOCK_SIZE) * HEAD_DIM
    tmask = (j * TILE + t < ctx) & (j * TILE + t >= lo)
    k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
    return k, v, tmask


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, mid_o_ptr,
                   mid_lse_ptr, kn_ptr, vn_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr, qk_scale, q_stride_b,
                   q_stride_h, bt_stride, out_stride_b, out_stride_h, kn_stride, vn_stride, rope_stride, kv_heads,
                   group, num_splits, window, STORE: tl.constexpr, ROPE: tl.constexpr, M: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   TILE: tl.constexpr, SPLIT: tl.constexpr, HEAD_MAJOR: tl.constexpr, USE_DOT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    # Before the wait (`kernels.pdl`) only what no kernel of the step writes, which a kernel launched early then has
    # in registers when the kernel before it ends: the sequence's length, position and slot (copied by the host
    # before the step) and the rotary tables
    b, kvh, s = _program_coords(HEAD_MAJOR)
    ctx = tl.load(context_lens_ptr + b)
    if HAS_WINDOW:  # the first token attended: tiles wholly before it are not read
        lo = tl.maximum(ctx - window, 0)
    else:  # a constant: a model without a window compiles the kernel it had before windows existed
        lo = 0
    n_tiles = _split_tiles(ctx, lo, s, num_splits, TILE)
    g = tl.arange(0, M)
    d = tl.arange(0, HEAD_DIM)
    if ROPE:  # q and the new k rotated here (`rotary.rotate_pair`, as `rotary_kv`: rounded to the row's dtype)
        partner = (d + HEAD_DIM // 2) % HEAD_DIM  # the other half's element (the rotation swaps the halves)
        pos = tl.maximum(tl.load(pos_ptr + b).to(tl.int64), 0)
        rc = tl.load(cos_ptr + pos * rope_stride + d).to(tl.float32)
        rs = tl.load(sin_ptr + pos * rope_stride + d).to(tl.float32)
    if STORE:
        last = d * 0 + ctx - 1  # (in vectors: the interpreter takes no mask made of scalars)
        slot = tl.load(slot_ptr + b + d * 0).to(tl.int64)  # (a padding row's slot is negative)
    pdl_begin(PDL)  # (the next kernel, the merge or the output projection's, may launch now)
    if STORE:  # this step's K and V (the sequence's last token) into its cache slot first, as `store_kv` would, by
        # the program whose tiles hold that token; its loads below then read them back (after the barrier)
        own = (slot >= 0) & (last >= 0) & ((last // TILE - lo // TILE) % num_splits == s)
        dst = (((slot // BLOCK_SIZE) * kv_heads + kvh) * BLOCK_SIZE + slot % BLOCK_SIZE) * HEAD_DIM + d
        kn = tl.load(kn_ptr + b * kn_stride + kvh * HEAD_DIM + d, mask=own)
        if ROPE:
            kns = tl.load(kn_ptr + b * kn_stride + kvh * HEAD_DIM + partner, mask=own)
            kn = rotate_pair(kn, kns, rc, rs).to(kn_ptr.dtype.element_ty)
        vn = tl.load(vn_ptr + b * vn_stride + kvh * HEAD_DIM + d, mask=own)
        tl.store(k_cache_ptr + dst, kn.to(k_cache_ptr.dtype.element_ty), mask=own)
        tl.store(v_cache_ptr + dst, vn.to(v_cache_ptr.dtype.element_ty), mask=own)
        tl.debug_barrier()
    heads = kvh * group + g
    gmask = g < group
    q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + d[None, :], mask=gmask[:, None], other=0.0)
    if ROPE:
        qs = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + partner[None, :], mask=gmask[:, None],
                     other=0.0)
        q = rotate_pair(q, qs, rc[None, :], rs[None, :]).to(q_ptr.dtype.element_ty)
    if not USE_DOT:
        q = q.to(tl.float32) * qk_scale
    # Scores are kept in log2 units (qk_scale folds in log2(e)) so the softmax uses exp2.
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + b * bt_stride
    for i in range(0, n_tiles):
        k, v, tmask = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, lo // TILE + s + i * num_splits, ctx, lo, kv_heads,
                               kvh, TILE, BLOCK_SIZE, HEAD_DIM)
        if USE_DOT:  # [M, TILE] on tensor cores; the group is padded to M >= 16 rows
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        else:
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        scores = tl.where(tmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every tile read holds an attended token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new
    # An empty split (or a padding row with context 0) writes zeros and a log-sum-exp of -inf.
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + b * out_stride_b + heads[:, None] * out_stride_h + d[None, :]
    if SPLIT:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        first = (b * kv_heads * group + heads) * num_splits
        tl.store(mid_o_ptr + (first + s)[:, None] * HEAD_DIM + d[None, :], o, mask=gmask[:, None])
        tl.store(mid_lse_ptr + first + s, lse, mask=gmask)
    else:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, out_stride_b, out_stride_h, num_splits, HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched early (see `use_pdl`): wait until the decode kernel has ended and its writes are visible
        gdc_wait()
        gdc_launch_dependents()  # (and the next kernel, the output projection's, may fetch its weights)
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    base = (b * HEADS + h) * num_splits
    smask = sp < num_splits
    lse = tl.load(mid_lse_ptr + base + sp, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(smask, tl.exp2(lse - m), 0.0)
    o = tl.load(mid_o_ptr + (base + sp)[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * out_stride_b + h * out_stride_h + d, res.to(out_ptr.dtype.element_ty))


def _resolved_launch(batch, heads, kv_heads, head_dim, block_size, max_context_len, overrides):
    """The launch for a shape (`decode_launch` with ``overrides``, the tile widened to whole blocks) and its grid."""
    cfg = decode_launch(batch, heads, kv_heads, head_dim, block_size, max_context_len)
    cfg.update(overrides)
    cfg["tile"] = max(cfg["tile"], block_size)
    return cfg, (kv_heads, cfg["splits"], batch) if cfg["head_major"] else (batch, kv_heads, cfg["splits"])


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, out=None, *,
                           window: Optional[int] = None, early: bool = True, store: Optional[tuple] = None,
                           rope: Optional[tuple] = None, **launch):
    """Same contract as `paged_decode_attention_ref`; ``out`` (optional) receives the result.

    ``early``: launched with PDL (`kernels.pdl`) where the device has it. Not after a long GEMM: the decode programs
    waiting on the device crowd its last ones (on the H100 GPT-2's one-row step, after the q/k/v GEMM that also
    stores K and V, took 294.6 us with it against 289.5 without; after the KV store kernel at 64 rows 523 against
    540 us).

    ``store``: ``(key, value, slot_mapping)`` of this step's tokens ([B, kv_heads, head_dim] each), stored into the
    cache by the kernel itself before it reads (in place of `store_kv.store_kv_cache` before the call; each sequence's
    token must be its last, as in a decode step). ``rope``: ``(positions, cos, sin)`` (`rotary.rotary_kv`'s
    full-width tables): q and the stored k are given unrotated and rotated by the kernel, as `rotary.rotary_kv` would
    (up to float32 contraction of its multiply-adds, which that kernel does not do); needs ``store``.

    ``launch`` overrides keys of `decode_launch` (used by the tests and the benchmark's sweep only).
    """
    batch, heads, head_dim = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    group = heads // kv_heads
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    cfg, grid = _resolved_launch(batch, heads, kv_heads, head_dim, block_size, max_context_len, launch)
    splits, tile = cfg["splits"], cfg["tile"]
    m = max(16, triton.next_power_of_2(group)) if cfg["use_dot"] else triton.next_power_of_2(group)
    if splits > 1:
        mid_o = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out
    pdl = splits > 1 and use_pdl(q.device, "merge")  # the merge launched early
    early = early and use_pdl(q.device, "decode")  # ... and this kernel
    if store is not None:
        key, value, slots = store
        assert key.shape == value.shape == (batch, kv_heads, head_dim) and slots.shape == (batch,)
        assert key.stride(2) == value.stride(2) == 1 and key.stride(1) == value.stride(1) == head_dim
        kn, vn, kn_stride, vn_stride = key, value, key.stride(0), value.stride(0)
    else:
        kn = vn = slots = q
        kn_stride = vn_stride = 0
    if rope is not None:
        positions, cos, sin = rope
        assert store is not None and cos.shape[1] == head_dim and cos.stride() == sin.stride() and cos.stride(1) == 1
        assert positions.shape == (batch,)
    else:
        positions = cos = sin = q
    _decode_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, out, mid_o, mid_lse, kn, vn, slots, positions, cos, sin,
        scale * LOG2E, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), kn_stride,
        vn_stride, cos.stride(0) if rope is not None else 0, kv_heads, group, splits, window or NO_WINDOW,
        STORE=store is not None, ROPE=rope is not None, M=m,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE=tile, SPLIT=splits > 1, HEAD_MAJOR=bool(cfg["head_major"]),
        USE_DOT=bool(cfg["use_dot"]), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PDL=early or pdl, HAS_WINDOW=window is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        launch_pdl=early)
    if splits > 1:
        _merge_kernel[(batch, heads)](mid_o, mid_lse, out, out.stride(0), out.stride(1), splits, HEADS=heads,
                                      HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(splits), PDL=pdl,
                                      num_warps=1, launch_pdl=pdl)
    return out


@triton.jit
def _read_floor_kernel(k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, sums_ptr, bt_stride, kv_heads,
                       num_splits, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                       HEAD_MAJOR: tl.constexpr):
    b, kvh, s = _program_coords(HEAD_MAJOR)
    ctx = tl.load(context_lens_ptr + b)
    n_tiles = _split_tiles(ctx, 0, s, num_splits, TILE)
    acc = tl.zeros([TILE, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + b * bt_stride
    for i in range(0, n_tiles):
        k, v, tmask = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, s + i * num_splits, ctx, 0, kv_heads, kvh, TILE,
                               BLOCK_SIZE, HEAD_DIM)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(sums_ptr + (b * kv_heads + kvh) * num_splits + s, tl.sum(acc))


def paged_kv_read_floor(k_cache, v_cache, block_tables, context_lens, heads, max_context_len, **launch):
    """[B, kv_heads, splits]: per program, the sum of the K and V elements it reads. The reads are a decode call's:
    the same launch (grid, splits, tiles, warps, stages) and loads, but no attention and no merge, and one kernel
    only. For the benchmark: its time is the floor the paged reads alone set, to which the math and the merge add."""
    batch = context_lens.shape[0]
    _, kv_heads, block_size, head_dim = k_cache.shape
    cfg, grid = _resolved_launch(batch, heads, kv_heads, head_dim, block_size, max_context_len, launch)
    sums = torch.empty((batch, kv_heads, cfg["splits"]), dtype=torch.float32, device=k_cache.device)
    _read_floor_kernel[grid](k_cache, v_cache, block_tables, context_lens, sums, block_tables.stride(0), kv_heads,
                             cfg["splits"], HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE=cfg["tile"],
                             HEAD_MAJOR=bool(cfg["head_major"]), num_warps=cfg["num_warps"],
                             num_stages=cfg["num_stages"])
    return sums
