"""The KV block pool: one allocation for all layers, bound into each attention layer as views."""

from __future__ import annotations

import torch


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * elem


def allocate_kv_cache(model, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """``[layers, 2, num_blocks, kv_heads, block_size, head_dim]`` (see `rosecli.kernels`); layer i's attention
    gets [i, 0] and [i, 1]."""
    pool = torch.zeros(model.num_layers, 2, num_blocks, model.num_kv_heads, block_size, model.head_dim,
                       dtype=dtype, device=device)
    for i, attn in enumerate(model.attention_layers()):
        attn.k_cache = pool[i, 0]
        attn.v_cache = pool[i, 1]
    return pool
