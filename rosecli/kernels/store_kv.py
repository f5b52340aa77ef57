"""Store the new tokens' K and V into their cache slots."""

import torch
import triton
import triton.language as tl

from rosecli.kernels import launch_table


def store_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [N, kv_heads, head_dim]; slot_mapping: [N]; a negative slot is skipped (padding).

    No host sync and no data-dependent shape, so it can be captured in a CUDA graph: a padding
    row repeats the first real row (same slot, same values), so no slot is written two different
    values; when every row is padding, each rewrites slot 0 with what it already holds.
    """
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    keep = slots >= 0
    first = keep.to(torch.uint8).argmax()  # 0 when no row is real
    rows = torch.where(keep, torch.arange(slots.shape[0], device=slots.device), first)
    idx = slots.index_select(0, rows).clamp_(min=0)
    any_real = keep.any()
    for src, cache in ((key, k_cache), (value, v_cache)):
        flat = cache.view(num_blocks * block_size, kv_heads, head_dim)
        new = torch.where(any_real, src.index_select(0, rows).to(cache.dtype), flat.index_select(0, idx))
        flat.index_copy_(0, idx, new)


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
                           ROW=row, BLOCK=triton.next_power_of_2(row),
                           num_warps=launch_table.lookup(launch_table.STORE_WARPS, row))
