"""Paged decode attention: one query token per sequence against its cached blocks."""

import math

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[B, num_blocks*block_size, kv_heads, head_dim] view of each sequence's first blocks."""
    _, block_size, kv_heads, head_dim = cache.shape
    bt = block_tables[:, :num_blocks].long().clamp_(min=0)
    return cache[bt].reshape(bt.shape[0], num_blocks * block_size, kv_heads, head_dim)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, max_context_len: int) -> torch.Tensor:
    """q: [B, heads, head_dim] -> [B, heads, head_dim].

    Gathers each sequence's blocks into a contiguous tensor, then runs SDPA with a length mask.
    ``max_context_len`` is a host-side upper bound of ``context_lens``.
    """
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    nblk = max(1, math.ceil(max_context_len / block_size))
    k = gather_kv(k_cache, block_tables, nblk).transpose(1, 2)  # [B, kvh, L, D]
    v = gather_kv(v_cache, block_tables, nblk).transpose(1, 2)
    pos = torch.arange(k.shape[2], device=q.device)
    mask = (pos[None, :] < context_lens[:, None].to(pos.dtype))[:, None, None, :]  # [B,1,1,L]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                         scale=scale, enable_gqa=heads != kv_heads)
    return out.squeeze(2)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len):
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len)
