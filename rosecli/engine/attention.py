"""Attention over the paged KV cache, shared by every model.

The model runner builds one `AttentionMetadata` per step and passes it into `forward`
explicitly; each `Attention` layer holds views of its own layer's K and V cache, bound once
after the pool is allocated (so captured CUDA graphs see stable addresses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rosecli.kernels import paged_decode, prefill_attention, store_kv


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step's batch.

    The flat token dimension N holds the new tokens of all sequences back to back.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [N] cache slot of each new token; negative = padding, not stored
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, tokens in the cache for each sequence after this step
    max_context_len: int  # host-side upper bound of context_lens
    use_triton: bool = False  # Triton kernels (CUDA) or the torch references (gather + SDPA)
    # Prefill only
    cu_seqlens_q: Optional[torch.Tensor] = None  # [B+1] int32
    max_seqlen_q: int = 0
    has_prefix: bool = False  # some sequence attends to tokens cached before this step


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [N, heads*head_dim], k/v: [N, kv_heads*head_dim] -> [N, heads*head_dim]."""
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if meta.use_triton:
            store_kv.store_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        else:
            store_kv.store_kv_cache_ref(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if not meta.is_prefill:
            fn = paged_decode.paged_decode_attention if meta.use_triton else paged_decode.paged_decode_attention_ref
            out = fn(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens, self.scale,
                     meta.max_context_len)
        elif meta.use_triton:
            out = prefill_attention.paged_prefill_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                meta.max_seqlen_q, meta.max_context_len, self.scale)
        elif meta.has_prefix:
            out = prefill_attention.paged_prefill_attention_ref(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                meta.max_seqlen_q, meta.max_context_len, self.scale)
        else:
            out = self._prefill_fresh(q, k, v, meta)
        return out.reshape(n, self.num_heads * self.head_dim)

    def _prefill_fresh(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention over the new tokens alone (no cached prefix): no gather needed."""
        cu = meta.cu_seqlens_q.tolist()
        gqa = self.num_heads != self.num_kv_heads
        if len(cu) == 2:
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=True, scale=self.scale, enable_gqa=gqa)
            return o.transpose(0, 1)
        out = torch.empty_like(q)
        for i in range(len(cu) - 1):
            s, e = cu[i], cu[i + 1]
            if e == s:
                continue
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                               v[s:e].transpose(0, 1), is_causal=True, scale=self.scale,
                                               enable_gqa=gqa)
            out[s:e] = o.transpose(0, 1)
        return out
