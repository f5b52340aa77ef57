"""Rotary embedding of q and k fused with the KV store: one kernel per Llama-family layer.

The layer's fused q/k/v projection gives one row per token, ``[q heads | k heads | v heads]`` of
``head_dim`` each. `rotary_kv` rotates the q and k heads in place in that row (neox style, float32
math, written back in the row's dtype; with Qwen3's per-head RMSNorm first), and stores the rotated
k and the v heads into the layer's paged cache at ``slot_mapping`` (a negative slot stores nothing).
Attention then reads q from the row and K/V from the cache. The torch path does the same in about
six elementwise kernels and a store (`apply_rotary` + `store_kv_cache`); inside a captured decode
graph each costs ~1.5-3 us whatever its size, so this saves ~6 launches per layer.

The tables are `RotaryEmbedding`'s full-width ones, ``cos = [cos, cos]`` and ``sin = [-sin, sin]`` per
position (float32, as the loader keeps them; read as float32 whatever their dtype), looked up by
position inside the kernel: ``rotate(x) = x * cos + swap_halves(x) * sin``.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from rosecli.kernels import launch_table
from rosecli.kernels.pdl import pdl_begin, use_pdl
from rosecli.kernels.store_kv import check_cache, store_kv_cache_ref


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim] (any strides) rotated by ``cos``/``sin`` ([N, 1, head_dim] float32 rows of the
    full-width tables), in float32, returned in x's dtype."""
    xf = x if x.dtype == cos.dtype else x.float()
    out = xf * cos + torch.roll(xf, x.shape[-1] // 2, dims=-1) * sin  # roll by half = swap the halves
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm` of the models: float32 statistics, the normalised value rounded to x's dtype, times the weight."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary_kv_ref(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, heads: int,
                  kv_heads: int, q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
                  eps: float = 0.0) -> None:
    """The torch steps `rotary_kv` fuses, with its contract: ``qkv`` [N, (heads + 2 * kv_heads) * head_dim]
    has its q and k heads rotated in place; k and v go into the caches; ``cos``/``sin`` are the whole
    [max_position, head_dim] tables; ``q_norm``/``k_norm``: per-head RMSNorm weights applied first."""
    n = qkv.shape[0]
    head_dim = cos.shape[-1]
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q = qkv[:, :q_size].view(n, heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(n, kv_heads, head_dim)
    if q_norm is not None:
        q, k = _rms_norm_ref(q, q_norm, eps), _rms_norm_ref(k, k_norm, eps)
    q, k = apply_rotary(q, c, s), apply_rotary(k, c, s)
    qkv[:, :q_size] = q.reshape(n, q_size)
    qkv[:, q_size:q_size + kv_size] = k.reshape(n, kv_size)
    v = qkv[:, q_size + kv_size:].view(n, kv_heads, head_dim)
    store_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)


@triton.jit
def rotate_pair(x, xs, c, s):
    """One rotation in float32: ``x * cos + swap_halves(x) * sin``, ``xs`` being ``x``'s elements swapped between
    its halves and ``c``/``s`` the full-width tables' entries. The arithmetic of `rotary_kv`, shared with the decode
    kernel's rotation (`paged_decode.paged_decode_attention`'s ``rope``); the caller rounds to its dtype."""
    return x.to(tl.float32) * c + xs.to(tl.float32) * s


@triton.jit
def _rotary_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                      qkv_stride, table_stride, eps, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                      GROUP: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    i = tl.program_id(0).to(tl.int64)  # token
    h = tl.program_id(1) * GROUP + tl.arange(0, GROUP)  # this program's heads: q heads, then k heads
    d = tl.arange(0, BLOCK_D)
    hmask = h < HEADS + KV_HEADS
    mask = hmask[:, None] & (d < HEAD_DIM)[None, :]
    partner = (d + HEAD_DIM // 2) % HEAD_DIM  # the other half's element (the rotation swaps the halves)
    row = qkv_ptr + i * qkv_stride
    at = row + h[:, None] * HEAD_DIM
    x = tl.load(at + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xs = tl.load(at + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # Qwen3: RMSNorm over each head, rounded to the row's dtype, times the weight, rounded again
        is_q = (h < HEADS)[:, None]
        dm = d < HEAD_DIM
        w = tl.where(is_q, tl.load(qw_ptr + d, mask=dm, other=0.0).to(tl.float32)[None, :],
                     tl.load(kw_ptr + d, mask=dm, other=0.0).to(tl.float32)[None, :])
        ws = tl.where(is_q, tl.load(qw_ptr + partner, mask=dm, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + partner, mask=dm, other=0.0).to(tl.float32)[None, :])
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        x = ((x * rstd).to(qkv_ptr.dtype.element_ty).to(tl.float32) * w).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        xs = ((xs * rstd).to(qkv_ptr.dtype.element_ty).to(tl.float32) * ws).to(qkv_ptr.dtype.element_ty)
        xs = xs.to(tl.float32)
    pos = tl.load(pos_ptr + i).to(tl.int64)
    c = tl.load(cos_ptr + pos * table_stride + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * table_stride + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
    y = (x * c + xs * s).to(qkv_ptr.dtype.element_ty)
    tl.store(at + d[None, :], y, mask=mask)
    if tl.program_id(1) * GROUP + GROUP > HEADS:  # k heads here: they and their v heads go into the cache
        kh = (h - HEADS)[:, None]
        slot = tl.load(slot_ptr + i + h * 0).to(tl.int64)[:, None]  # (broadcast: a scalar mask is refused)
        smask = mask & (kh >= 0) & (slot >= 0)  # padding rows (slot < 0) store nothing
        dst = (((slot // BLOCK_SIZE) * KV_HEADS + kh) * BLOCK_SIZE + slot % BLOCK_SIZE) * HEAD_DIM + d[None, :]
        v = tl.load(at + KV_HEADS * HEAD_DIM + d[None, :], mask=smask)
        tl.store(k_cache_ptr + dst, y.to(k_cache_ptr.dtype.element_ty), mask=smask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=smask)


def rotary_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, heads: int, kv_heads: int,
              q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
              eps: float = 0.0, group: Optional[int] = None, num_warps: Optional[int] = None) -> None:
    """Same contract as `rotary_kv_ref`, one launch: a program per token and group of ``group`` heads (q heads,
    then k heads; a power of two). ``group`` and ``num_warps`` default to `launch_table.rotary_launch`'s."""
    n = qkv.shape[0]
    head_dim = cos.shape[-1]
    check_cache(k_cache, kv_heads, head_dim)
    if qkv.dim() != 2 or qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv of shape {tuple(qkv.shape)} is not [tokens, ({heads} + 2 x {kv_heads}) heads x "
                         f"{head_dim}] with unit stride along a row")
    assert cos.stride() == sin.stride() and cos.stride(1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and head_dim % 2 == 0
    assert (q_norm is None) == (k_norm is None)
    if n == 0:
        return
    launch = launch_table.rotary_launch(n, head_dim)
    group, num_warps = group or launch[0], num_warps or launch[1]
    pdl = use_pdl(qkv.device, "rotary")
    _rotary_kv_kernel[(n, triton.cdiv(heads + kv_heads, group))](
        qkv, positions, cos, sin, qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm,
        k_cache, v_cache, slot_mapping, qkv.stride(0), cos.stride(0), eps, HEADS=heads, KV_HEADS=kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[2], BLOCK_D=triton.next_power_of_2(head_dim), GROUP=group,
        QK_NORM=q_norm is not None, PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
        enable_fp_fusion=False)  # x * cos + x' * sin rounded as torch's separate multiplies and add round it
