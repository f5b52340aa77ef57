"""Residual add fused with the following LayerNorm or RMSNorm: one pass instead of two or three.

``add_norm(x, residual, weight, bias, eps, x_bias=..., rms=...)`` returns ``(normed, sum)`` where
``sum = x + x_bias + residual`` (the new residual stream) and ``normed`` is its norm. ``x_bias``
lets a linear layer run without its bias (one GEMM kernel, no bias epilogue or copy at batch 1)
and have the bias added here. The sum is rounded to the stream's dtype before it is normalised,
as the unfused torch code does; the arithmetic is float32.
"""

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rosecli.kernels.pdl import pdl_begin, use_pdl


def add_norm_ref(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 bias: Optional[torch.Tensor], eps: float, x_bias: Optional[torch.Tensor] = None,
                 rms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [N, D]; weight, bias, x_bias: [D]. RMSNorm (``rms``) has no ``bias``."""
    s = x if x_bias is None else x + x_bias
    if residual is not None:
        s = s + residual
    if rms:
        sf = s.float()
        normed = weight * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    else:
        normed = F.layer_norm(s, s.shape[-1:], weight, bias, eps)
    return normed, s


@triton.jit
def _add_norm_kernel(x_ptr, xb_ptr, r_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, D, eps, x_stride, r_stride,
                     HAS_XB: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, RMS: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    # the parameters, which no kernel writes, before the wait: a kernel launched early has them when the one before ends
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_XB:
        xb = tl.load(xb_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        nb = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_begin(PDL)  # (`kernels.pdl`: the next kernel, a linear layer's, fetches its weights meanwhile)
    s = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_XB:
        s = s + xb
    if HAS_RES:
        s = s + tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = s.to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * D + cols, s, mask=mask)
    s = s.to(tl.float32)
    if RMS:
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / D + eps)
        y = (s * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    else:
        mean = tl.sum(s, axis=0) / D
        d = tl.where(mask, s - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(d * d, axis=0) / D + eps)
        y = d * rstd * w
        if HAS_BIAS:
            y = y + nb
    tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
             bias: Optional[torch.Tensor], eps: float, x_bias: Optional[torch.Tensor] = None,
             rms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `add_norm_ref`, one kernel launch (one program per row)."""
    n, d = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    total = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n == 0:
        return out, total
    block = triton.next_power_of_2(d)
    pdl = use_pdl(x.device, "norm")
    _add_norm_kernel[(n,)](
        x, x if x_bias is None else x_bias, x if residual is None else residual, weight,
        weight if bias is None else bias, out, total, d, eps, x.stride(0),
        0 if residual is None else residual.stride(0), HAS_XB=x_bias is not None, HAS_RES=residual is not None,
        HAS_BIAS=bias is not None, RMS=rms, BLOCK=block, PDL=pdl,
        num_warps=4 if block >= 1024 else (2 if block >= 256 else 1), launch_pdl=pdl)
    return out, total
