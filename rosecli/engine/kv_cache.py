"""The KV block pool: one allocation for all layers, bound into each attention layer as views."""

from __future__ import annotations

import mmap

import torch


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * elem


def allocate_kv_cache(model, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """``[layers, 2, num_blocks, kv_heads, block_size, head_dim]`` (see `rosecli.kernels`); layer i's attention
    gets [i, 0] and [i, 1]."""
    shape = (model.num_layers, 2, num_blocks, model.num_kv_heads, block_size, model.head_dim)
    if torch.device(device).type == "cpu":
        # anonymous mmap: the kernel hands out zeroed pages as they are first written, so start-up
        # does not touch the whole pool (~0.1 s for SmolLM2's 8192 tokens) and memory grows with
        # use; all-zero bytes are 0.0 in every float dtype. Not numpy's zeros: numpy advises huge
        # pages for large arrays, and faulting in a 2 MB page (compacting memory for it) took 12 ms
        # per layer's first KV store, 0.7 s of the first prefill.
        nbytes = kv_bytes_per_block(model, block_size, dtype) * num_blocks
        pool = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)
    else:
        pool = torch.zeros(shape, dtype=dtype, device=device)
    for i, attn in enumerate(model.attention_layers()):
        attn.k_cache = pool[i, 0]
        attn.v_cache = pool[i, 1]
    return pool
