"""Triton kernels over the paged KV cache, each with a plain-torch reference beside it.

KV cache layout, per layer and for K and V alike: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A token's *slot* is ``block_id * block_size + offset``. Block tables are int32 ``[batch, max_blocks]``;
entries past a sequence's last block are ignored (any value).
"""
