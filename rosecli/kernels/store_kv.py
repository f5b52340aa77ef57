"""Store the new tokens' K and V into their cache slots."""

import torch
import triton
import triton.language as tl


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


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, key_stride, value_stride,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + i + offs * 0).to(tl.int64)  # broadcast: padding rows (slot < 0) store nothing
    mask = (offs < ROW) & (slot >= 0)
    k = tl.load(key_ptr + i * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + i * value_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """One program per token copies its K and V rows (kv_heads*head_dim contiguous elements)."""
    n, kv_heads, head_dim = key.shape
    assert key.stride(2) == 1 and key.stride(1) == head_dim and value.stride(2) == 1 and value.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if n == 0:
        return
    row = kv_heads * head_dim
    _store_kv_kernel[(n,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
                           ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=1 if row <= 256 else 4)
