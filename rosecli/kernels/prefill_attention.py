"""Prefill attention: new query tokens against cached prefix blocks plus themselves (causal).

Triton kernel (flash attention over the paged cache): the grid is (query tile, sequence, kv head).
A program's BLOCK_M rows are BLOCK_M // GROUP consecutive query tokens times the GROUP query heads
of one kv head, so each K/V tile, gathered through the block table, is loaded once for the group.
It walks the keys up to its last query's position with an online softmax in float32 (exp2); with a
sliding window, from its first query's window start.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rosecli.kernels import launch_table
from rosecli.kernels.paged_decode import LOG2E, NO_WINDOW, gather_kv


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, max_seqlen_q: int, max_context_len: int,
                                scale: float, window: Optional[int] = None) -> torch.Tensor:
    """q: [total_q, heads, head_dim], the new tokens of B sequences packed back to back
    (``cu_seqlens_q`` [B+1]). Their K/V are already stored in the cache; sequence i attends to
    its first ``context_lens[i]`` cached tokens, causally: query j of a sequence with ``n`` new
    tokens sits at position ``context_lens[i] - n + j``. ``window`` (sliding window attention): a
    query attends to its last ``window`` positions only, itself included.
    """
    heads = q.shape[1]
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        n = e - s
        if n == 0:
            continue
        L = ctx[i]
        nblk = math.ceil(L / block_size)
        k = gather_kv(k_cache, block_tables[i:i + 1], nblk)[0, :, :L]  # [kvh, L, D]
        v = gather_kv(v_cache, block_tables[i:i + 1], nblk)[0, :, :L]
        qi = q[s:e].transpose(0, 1)  # [H, n, D]
        qpos = torch.arange(L - n, L, device=q.device)
        kpos = torch.arange(L, device=q.device)[None, :]
        mask = qpos[:, None] >= kpos
        if window is not None:
            mask &= kpos > qpos[:, None] - window
        o = F.scaled_dot_product_attention(qi, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                           enable_gqa=heads != kv_heads)
        out[s:e] = o.transpose(0, 1)
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
                    qk_scale, q_stride_n, q_stride_h, out_stride_n, out_stride_h, bt_stride, window,
                    KV_HEADS: tl.constexpr,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    QUERIES: tl.constexpr = BLOCK_M // GROUP  # query tokens per program; rows are (token, head of the group)
    mb = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    n = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if mb * QUERIES >= n:
        return
    ctx = tl.load(context_lens_ptr + b)
    r = tl.arange(0, BLOCK_M)
    qi = mb * QUERIES + r // GROUP
    heads = kvh * GROUP + r % GROUP
    rmask = (r < QUERIES * GROUP) & (qi < n)
    qpos = ctx - n + qi  # absolute position of each row's query token
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + qi)[:, None] * q_stride_n + heads[:, None] * q_stride_h + d[None, :],
                mask=rmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    t = tl.arange(0, BLOCK_N)
    last = tl.minimum(ctx, ctx - n + (mb + 1) * QUERIES)  # keys past this program's last query are masked
    # keys before the first query's sliding window are skipped (window: longer than any context when none)
    first = tl.maximum(ctx - n + mb * QUERIES - window + 1, 0)
    for tok0 in range((first // BLOCK_N) * BLOCK_N, last, BLOCK_N):
        tok = tok0 + t
        tmask = tok < last
        block = tl.load(block_tables_ptr + b * bt_stride + tok // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        off = ((block * KV_HEADS + kvh) * BLOCK_SIZE + tok % BLOCK_SIZE) * HEAD_DIM
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        allowed = (tok[None, :] <= qpos[:, None]) & (tok[None, :] > qpos[:, None] - window) & tmask[None, :]
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no allowed key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + qi)[:, None] * out_stride_n + heads[:, None] * out_stride_h + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def prefill_launch(max_seqlen_q: int, group: int) -> dict:
    """The fixed launch parameters for a shape (see `launch_table`)."""
    block_m, block_n, num_warps, num_stages = launch_table.lookup(launch_table.PREFILL, max_seqlen_q)
    block_m = max(block_m, triton.next_power_of_2(group))  # at least one query token per program
    return {"block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                            max_context_len, scale, out=None, *, window: Optional[int] = None, **launch):
    """Same contract as `paged_prefill_attention_ref`; ``out`` (optional) receives the result.

    ``launch`` overrides keys of `prefill_launch` (used by the benchmark's sweep only).
    """
    total, heads, head_dim = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    group = heads // kv_heads
    if out is None:
        out = torch.empty_like(q)
    batch = cu_seqlens_q.shape[0] - 1
    if total == 0 or batch == 0:
        return out
    cfg = prefill_launch(max_seqlen_q, group)
    cfg.update(launch)
    grid = (triton.cdiv(max_seqlen_q, cfg["block_m"] // group), batch, kv_heads)
    _prefill_kernel[grid](q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens, scale * LOG2E,
                          q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
                          window or NO_WINDOW, KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                          BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
                          DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
