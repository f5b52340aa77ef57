"""Store the new tokens' K and V into their cache slots."""

import torch
import triton
import triton.language as tl

from rosecli.kernels import launch_table, slot_rows
from rosecli.kernels.pdl import pdl_begin, use_pdl


def check_cache(cache: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    """A clear error for a cache that is not ``[num_blocks, kv_heads, block_size, head_dim]`` for these K/V."""
    if cache.dim() != 4 or cache.shape[1] != kv_heads or cache.shape[3] != head_dim:
        raise ValueError(f"KV cache of shape {tuple(cache.shape)} is not [num_blocks, {kv_heads} kv heads, block_size, "
                         f"{head_dim}] for K/V of {kv_heads} kv heads x {head_dim}")


def store_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [N, kv_heads, head_dim]; slot_mapping: [N]; a negative slot is skipped (padding).

    No host sync and no data-dependent shape, so it can be captured in a CUDA graph: a padding
    row repeats the first real row (same slot, same values), so no slot is written two different
    values; when every row is padding, each rewrites slot 0 with what it already holds.
    """
    check_cache(k_cache, key.shape[1], key.shape[2])
    _, kv_heads, block_size, head_dim = k_cache.shape
    slots = slot_mapping.long()
    keep = slots >= 0
    first = keep.to(torch.uint8).argmax()  # 0 when no row is real
    rows = torch.where(keep, torch.arange(slots.shape[0], device=slots.device), first)
    idx = slot_rows(slots.index_select(0, rows).clamp_(min=0), kv_heads, block_size).view(-1)
    any_real = keep.any()
    for src, cache in ((key, k_cache), (value, v_cache)):
        flat = cache.view(-1, head_dim)
        new = src.index_select(0, rows).to(cache.dtype).reshape(-1, head_dim)
        flat.index_copy_(0, idx, torch.where(any_real, new, flat.index_select(0, idx)))


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, key_stride, value_stride,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_begin(PDL)
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + i + offs * 0).to(tl.int64)  # broadcast: padding rows (slot < 0) store nothing
    mask = (offs < KV_HEADS * HEAD_DIM) & (slot >= 0)
    k = tl.load(key_ptr + i * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + i * value_stride + offs, mask=mask)
    # each kv head's row goes to its own run of the block (`slot_rows`)
    dst = (((slot // BLOCK_SIZE) * KV_HEADS + offs // HEAD_DIM) * BLOCK_SIZE + slot % BLOCK_SIZE) * HEAD_DIM \
        + offs % HEAD_DIM
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """One program per token copies its K and V rows (kv_heads rows of head_dim, one into each head's run)."""
    n, kv_heads, head_dim = key.shape
    check_cache(k_cache, kv_heads, head_dim)
    assert key.stride(2) == 1 and key.stride(1) == head_dim and value.stride(2) == 1 and value.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if n == 0:
        return
    row = kv_heads * head_dim
    pdl = use_pdl(key.device, "store")
    _store_kv_kernel[(n,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
                           KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[2],
                           BLOCK=triton.next_power_of_2(row), PDL=pdl,
                           num_warps=launch_table.lookup(launch_table.STORE_WARPS, row), launch_pdl=pdl)
