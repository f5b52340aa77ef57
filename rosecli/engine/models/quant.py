"""CPU fast path: int8 weight-only linear layers with bfloat16 activations.

CPU decode is bound by reading the weights once per token. torch's int8 weight-only kernel
(``torch._weight_int8pack_mm``: int8 weights, one bfloat16 scale per output channel,
bfloat16 activations) reads a quarter of the float32 bytes and runs the SmolLM2 layer
matrices about twice as fast as float32 ``F.linear``. Everything else (embedding, norms,
residual stream, rotary, attention, KV cache) keeps the model's dtype; logits stay float32.
The float model is the reference: tests/test_cpu_fast_path.py bounds the difference.
"""

from __future__ import annotations

import torch
from torch import nn


def int8_linear_supported() -> bool:
    """Whether this torch has the int8 weight-only matmul (a private op; CPU is what we use it for)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


# torch's CPU kernel reads the reduction dimension 16 values at a time: other widths crash or
# give wrong results (measured on torch 2.13), so such layers stay float
IN_FEATURES_MULTIPLE = 16


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``weight ~= q * scale[:, None]``.

    The scale is rounded to bfloat16 (what the kernel takes) before quantizing, so the only
    error is rounding each weight to its channel's grid.
    """
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """``y = x @ (q * scale).T + bias``; activations go through bfloat16, ``y`` has x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        q, scale = quantize_weight(weight)
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scales", scale.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in_features] (contiguous rows, as the models pass them)."""
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight, self.scales).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, bf16 scales"


def quantize_for_cpu(model: nn.Module) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (whose input width is a multiple of
    `IN_FEATURES_MULTIPLE`) for an `Int8Linear`, and give a model whose output
    layer is tied to its embedding an int8 copy of it (the embedding itself stays float for
    lookups). In place; returns ``model``. Call once, after the weights are loaded."""
    if not int8_linear_supported():
        raise RuntimeError("this torch build has no torch._weight_int8pack_mm: use cpu_weights='float'")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % IN_FEATURES_MULTIPLE == 0:
                setattr(module, name, Int8Linear.from_linear(child))
    if getattr(model, "lm_head", None) is None and model.output_embedding().shape[1] % IN_FEATURES_MULTIPLE == 0:
        model.lm_head = Int8Linear(model.output_embedding())
    return model
