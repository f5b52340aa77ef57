"""Prefill attention: new query tokens against cached prefix blocks plus themselves (causal)."""

import math

import torch
import torch.nn.functional as F

from rosecli.kernels.paged_decode import gather_kv


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, max_seqlen_q: int, max_context_len: int,
                                scale: float) -> torch.Tensor:
    """q: [total_q, heads, head_dim], the new tokens of B sequences packed back to back
    (``cu_seqlens_q`` [B+1]). Their K/V are already stored in the cache; sequence i attends to
    its first ``context_lens[i]`` cached tokens, causally: query j of a sequence with ``n`` new
    tokens sits at position ``context_lens[i] - n + j``.
    """
    heads = q.shape[1]
    kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    block_size = k_cache.shape[1]
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        n = e - s
        if n == 0:
            continue
        L = ctx[i]
        nblk = math.ceil(L / block_size)
        k = gather_kv(k_cache, block_tables[i:i + 1], nblk)[0, :L].transpose(0, 1)  # [kvh, L, D]
        v = gather_kv(v_cache, block_tables[i:i + 1], nblk)[0, :L].transpose(0, 1)
        qi = q[s:e].transpose(0, 1)  # [H, n, D]
        qpos = torch.arange(L - n, L, device=q.device)
        mask = qpos[:, None] >= torch.arange(L, device=q.device)[None, :]
        o = F.scaled_dot_product_attention(qi, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                           enable_gqa=heads != kv_heads)
        out[s:e] = o.transpose(0, 1)
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                            max_seqlen_q, max_context_len, scale):
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                       max_seqlen_q, max_context_len, scale)
