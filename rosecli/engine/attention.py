"""Attention over the paged KV cache, shared by every model.

The model runner builds one `AttentionMetadata` per step and passes it into `forward`
explicitly; each `Attention` layer holds views of its own layer's K and V cache, bound once
after the pool is allocated (so captured CUDA graphs see stable addresses).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rosecli.kernels import paged_decode, prefill_attention, slot_rows, store_kv
from rosecli.kernels.launch_table import kv_in_decode


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
    # Fused residual-add/norm and activation kernels (`models.common`): set for decode on CUDA, where a
    # graph replays them and the kernel count bounds the step; eager prefill keeps torch's ops, whose
    # launches cost the host less than Triton's
    fused_ops: bool = False
    # Prefill only
    cu_seqlens_q: Optional[torch.Tensor] = None  # [B+1] int32
    max_seqlen_q: int = 0
    has_prefix: bool = False  # some sequence attends to tokens cached before this step
    # Torch decode path only, built once per step by `with_decode_gather` and shared by all layers
    kv_index: Optional[torch.Tensor] = None  # [B, kv_heads, L] cache row (`slot_rows`) of each first L tokens' head
    kv_mask: Optional[torch.Tensor] = None  # [B, 1, 1, L] additive: 0 in the context, -inf past it
    store_rows: Optional[torch.Tensor] = None  # [B] row of the new K/V to store (padding: the first real row)
    store_index: Optional[torch.Tensor] = None  # [B * kv_heads] the cache rows those rows' heads go to


def with_decode_gather(meta: AttentionMetadata, block_size: int, kv_heads: int,
                       dtype: torch.dtype) -> AttentionMetadata:
    """``meta`` plus what the torch decode path needs, computed once per step instead of once
    per layer: gather indices and length mask (L = the blocks covering ``max_context_len``,
    times ``block_size``; the mask is additive in ``dtype``, which SDPA takes faster than a
    boolean one on CPU) and the store plan. Device ops only (no host sync), so a CUDA graph
    may capture it.

    The store plan sends a padding row (negative slot) to the slot of the first real row with
    that row's K/V, so one ``index_copy_`` writes each slot a single value (the result of
    `store_kv_cache_ref`). A step with no real row at all (only the dummy batch of CUDA-graph
    capture, before any request holds a block) writes row 0's K/V into slot 0.
    """
    slots = meta.slot_mapping.long()
    keep = slots >= 0
    rows = torch.where(keep, torch.arange(slots.shape[0], device=slots.device), keep.to(torch.uint8).argmax())
    store_index = slot_rows(slots.index_select(0, rows).clamp_(min=0), kv_heads, block_size).view(-1)
    batch = meta.block_tables.shape[0]
    nblk = max(1, -(-meta.max_context_len // block_size))
    blocks = meta.block_tables[:, :nblk].long().clamp(min=0)
    pos_slots = (blocks.unsqueeze(-1) * block_size + torch.arange(block_size, device=blocks.device))
    kv_index = slot_rows(pos_slots.view(batch, nblk * block_size), kv_heads, block_size).transpose(1, 2)
    pos = torch.arange(nblk * block_size, device=blocks.device)
    past_end = pos >= meta.context_lens.unsqueeze(1)
    kv_mask = torch.zeros(past_end.shape, dtype=dtype, device=pos.device).masked_fill_(past_end, float("-inf"))
    kv_mask = kv_mask[:, None, None, :]
    return dataclasses.replace(meta, kv_index=kv_index, kv_mask=kv_mask, store_rows=rows, store_index=store_index)


class Attention(nn.Module):
    """``sliding_window``: each query attends to its last ``sliding_window`` positions only, itself
    included (Mistral; transformers' ``kv_idx > q_idx - sliding_window``); None: all of them. The
    cache still holds every token; the kernels skip the blocks before the window."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, kv_stored: bool = False, after_gemm: bool = False,
                rope: Optional[tuple] = None) -> torch.Tensor:
        """q: [N, heads*head_dim], k/v: [N, kv_heads*head_dim] -> [N, heads*head_dim].
        ``kv_stored``: the caller has put k and v into this layer's cache already (`rosecli.kernels.rotary`,
        `models.common.norm_qkv`); ``after_gemm``: the kernel before this one is the q/k/v GEMM itself (the
        decode kernel is then not launched early: `paged_decode.paged_decode_attention`'s ``early``); ``rope``
        (a Triton decode step where `launch_table.rope_in_decode` says, `rotary.rotary_kv`'s positions and tables):
        q and k are unrotated, and the decode kernel rotates them and stores k and v."""
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        store = None  # (K and V stored by the decode kernel itself: `launch_table.kv_in_decode`)
        if kv_stored:
            pass  # the Llama family's rotary kernel (`rosecli.kernels.rotary`) or GPT-2's q/k/v GEMM stored them
        elif meta.use_triton and not meta.is_prefill and (kv_in_decode() or rope is not None):
            store = (k, v, meta.slot_mapping)
        elif meta.use_triton:
            store_kv.store_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        elif meta.store_index is not None:
            for src, cache in ((k, self.k_cache), (v, self.v_cache)):
                rows = src.index_select(0, meta.store_rows).to(cache.dtype).reshape(-1, self.head_dim)
                cache.view(-1, self.head_dim).index_copy_(0, meta.store_index, rows)
        else:
            store_kv.store_kv_cache_ref(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if not meta.is_prefill:
            if meta.kv_index is not None and not meta.use_triton:
                out = self._decode_gathered(q, meta)
            elif meta.use_triton:
                out = paged_decode.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                                          meta.context_lens, self.scale, meta.max_context_len,
                                                          window=self.sliding_window, early=not after_gemm,
                                                          store=store, rope=rope)
            else:
                out = paged_decode.paged_decode_attention_ref(q, self.k_cache, self.v_cache, meta.block_tables,
                                                              meta.context_lens, self.scale, meta.max_context_len,
                                                              self.sliding_window)
        elif meta.use_triton:
            out = prefill_attention.paged_prefill_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                meta.max_seqlen_q, meta.max_context_len, self.scale, window=self.sliding_window)
        elif meta.has_prefix or (self.sliding_window is not None and meta.max_seqlen_q > self.sliding_window):
            out = prefill_attention.paged_prefill_attention_ref(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                meta.max_seqlen_q, meta.max_context_len, self.scale, self.sliding_window)
        else:
            out = self._prefill_fresh(q, k, v, meta)
        return out.reshape(n, self.num_heads * self.head_dim)

    def _decode_gathered(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`paged_decode_attention_ref` with the step's precomputed gather (`with_decode_gather`)."""
        idx = meta.kv_index.reshape(-1)
        kv_shape = meta.kv_index.shape + (self.head_dim,)  # [B, kv_heads, L, head_dim]
        k = self.k_cache.view(-1, self.head_dim).index_select(0, idx).view(kv_shape)
        v = self.v_cache.view(-1, self.head_dim).index_select(0, idx).view(kv_shape)
        mask = meta.kv_mask
        if self.sliding_window is not None and meta.max_context_len > self.sliding_window:
            # positions before each sequence's window are masked too (the step's mask covers its length only)
            pos = torch.arange(mask.shape[-1], device=mask.device)
            before = pos < (meta.context_lens.unsqueeze(1) - self.sliding_window)
            mask = mask.masked_fill(before[:, None, None, :], float("-inf"))
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        if mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.squeeze(2)

    def _prefill_fresh(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention over the new tokens alone (no cached prefix): no gather needed."""
        cu = meta.cu_seqlens_q.tolist()
        gqa = self.num_heads != self.num_kv_heads
        # [1, heads, tokens, head_dim]: torch's CPU flash kernel takes 4-d inputs only; 3-d ones fall back to
        # the math path, which builds the causal mask and is about 7x slower on a 2,048-token prompt
        if len(cu) == 2:
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True, scale=self.scale,
                                               enable_gqa=gqa)
            return o[0].transpose(0, 1)
        out = torch.empty_like(q)
        for i in range(len(cu) - 1):
            s, e = cu[i], cu[i + 1]
            if e == s:
                continue
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
                                               v[s:e].transpose(0, 1)[None], is_causal=True, scale=self.scale,
                                               enable_gqa=gqa)
            out[s:e] = o[0].transpose(0, 1)
        return out
