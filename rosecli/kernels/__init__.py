"""Triton kernels over the paged KV cache, each with a plain-torch reference beside it.

KV cache layout, per layer and for K and V alike: ``[num_blocks, num_kv_heads, block_size, head_dim]``:
each (block, kv head) is one contiguous run of ``block_size`` rows, so a kernel reading one kv head
streams whole runs (measured 1-6% faster for paged decode at large batch than the token-major
``[num_blocks, block_size, num_kv_heads, head_dim]``; docs/kernels.md). A token's *slot* is
``block_id * block_size + offset``; `slot_rows` maps slots to rows of the cache seen as
``[-1, head_dim]``. Block tables are int32 ``[batch, max_blocks]``; entries past a sequence's last block
are ignored (any value).
"""

import torch


def slot_rows(slots: torch.Tensor, kv_heads: int, block_size: int) -> torch.Tensor:
    """[...] slots -> [..., kv_heads]: the row of each (slot, kv head) in a cache viewed as ``[-1, head_dim]``."""
    slots = slots.long()
    heads = torch.arange(kv_heads, device=slots.device)
    return ((slots // block_size).unsqueeze(-1) * kv_heads + heads) * block_size + (slots % block_size).unsqueeze(-1)
