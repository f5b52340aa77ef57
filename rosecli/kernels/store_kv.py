"""Store the new tokens' K and V into their cache slots."""

import torch


def store_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [N, kv_heads, head_dim]; slot_mapping: [N]; a negative slot is skipped (padding)."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    k_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def store_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    store_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping)
