"""Activations fused with what surrounds them: bias + GELU (tanh) for GPT-2's MLP, SiLU(gate) * up
for Llama's. One elementwise kernel instead of two or three; each rounds its intermediate to the
tensor's dtype where the unfused torch code does, and computes in float32."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rosecli.kernels.pdl import pdl_begin, use_pdl

BLOCK = 1024


def bias_gelu_ref(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x: [N, F], bias: [F] -> gelu_tanh(x + bias)."""
    return F.gelu(x + bias, approximate="tanh")


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2F] (gate then up) -> silu(gate) * up, [N, F]."""
    f = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :f]) * gate_up[:, f:]


@triton.jit
def _tanh(u):
    e = tl.exp(-2.0 * tl.abs(u))  # never overflows
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u < 0, -t, t)


@triton.jit
def gelu_tanh(v):
    """GELU (tanh approximation) of float32 ``v`` (shared with `skinny_gemm`'s epilogue)."""
    return 0.5 * v * (1.0 + _tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))


@triton.jit
def silu(g):
    """SiLU of float32 ``g``: the sigmoid without overflow (shared with `skinny_gemm`'s epilogue)."""
    e = tl.exp(-tl.abs(g))
    return g * tl.where(g < 0, e / (1.0 + e), 1.0 / (1.0 + e))


@triton.jit
def _bias_gelu_kernel(x_ptr, b_ptr, out_ptr, numel, F_DIM, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = v + tl.load(b_ptr + offs % F_DIM, mask=mask, other=0.0).to(tl.float32)
    v = v.to(out_ptr.dtype.element_ty).to(tl.float32)
    y = gelu_tanh(v)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, numel, F_DIM, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    row = offs // F_DIM
    col = offs % F_DIM
    g = tl.load(gu_ptr + row * 2 * F_DIM + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * F_DIM + F_DIM + col, mask=mask, other=0.0).to(tl.float32)
    s = silu(g).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    assert x.is_contiguous()
    out = torch.empty_like(x)
    numel = x.numel()
    if numel:
        pdl = use_pdl(x.device, "activation")
        _bias_gelu_kernel[(triton.cdiv(numel, BLOCK),)](x, bias, out, numel, x.shape[1], BLOCK=BLOCK, PDL=pdl,
                                                        num_warps=4, launch_pdl=pdl)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    assert gate_up.is_contiguous()
    n, f2 = gate_up.shape
    out = torch.empty((n, f2 // 2), dtype=gate_up.dtype, device=gate_up.device)
    numel = out.numel()
    if numel:
        pdl = use_pdl(gate_up.device, "activation")
        _silu_mul_kernel[(triton.cdiv(numel, BLOCK),)](gate_up, out, numel, f2 // 2, BLOCK=BLOCK, PDL=pdl,
                                                       num_warps=4, launch_pdl=pdl)
    return out
