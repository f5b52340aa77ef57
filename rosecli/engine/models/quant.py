"""CPU weight representations: what the linear layers read on each decode step.

CPU decode is bound by reading the weights once per token, so the representation sets the speed;
it must not change what the model says. `--cpu-weights`:

- ``auto`` (default): each MLP input layer (gate/up, GPT-2's c_fc) whose weights are exactly 4-bit
  groups (every group of 32 input weights is ``d * q + m`` with ``q`` in 0..15, as a Q4_0/Q4_1 GGUF
  dequantizes) runs as `Int4Linear`, which reads those 4-bit codes and reproduces the weights bit
  for bit; the layers where bfloat16 activations cost accuracy (`FLOAT16_LAYERS`), every other
  layer and the output layer run as `Float16Linear`. No weight is rounded a second time beyond
  float16, so the default adds no quantization of its own to the checkpoint's.
- ``int4``: every layer (input width a multiple of 32) as `Int4Linear`, quantizing float weights
  (min/max per group of 32) where they are not 4-bit already; the output layer float16.
- ``float16``: every linear layer and the output layer as `Float16Linear`.
- ``int8``: int8 weights with one scale per output channel (`Int8Linear`), bfloat16 activations:
  measurably degrades a model that was already 4-bit (docs/cpu.md has the figures).
- ``float``: the weights as loaded: the reference every other choice is tested against.

Each representation's activations: `Int4Linear` and `Int8Linear` compute in bfloat16 (torch's CPU
kernels for them take bfloat16; float32 activations have no fast path), `Float16Linear` in float16.
The residual stream, norms, rotary, attention and KV cache keep the model's dtype; logits are float32.
tests/test_cpu_fast_path.py bounds each against the float model; tests/test_default_model.py checks
the greedy and teacher-forced agreement of the real default model.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

CPU_WEIGHTS = ("auto", "int4", "float16", "int8", "float")

# torch's int8 kernel reads the reduction dimension 16 values at a time: other widths crash or
# give wrong results (measured on torch 2.13), so such layers stay float
IN_FEATURES_MULTIPLE = 16
# Q4_0 / Q4_1 / Q4_K blocks hold 32 weights; torch's int4 CPU kernel takes groups of 32 and up
INT4_GROUP = 32


def int8_linear_supported() -> bool:
    """Whether this torch has the int8 weight-only matmul (a private op; CPU is what we use it for)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int4_linear_supported() -> bool:
    """Whether this torch has the int4 group-wise CPU matmul (private ops, in torch >= 2.6)."""
    return all(hasattr(torch.ops.aten, op) for op in ("_weight_int4pack_mm_for_cpu",
                                                        "_convert_weight_to_int4pack_for_cpu"))


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``weight ~= q * scale[:, None]``.

    The scale is rounded to bfloat16 (what the kernel takes) before quantizing, so the only
    error is rounding each weight to its channel's grid.
    """
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, scale


def int4_groups(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups along the input dimension: ``weight ~= q * d + lo`` per group.

    ``q`` [out, in] int32 in 0..15, ``d`` and ``lo`` [out, in // group] float32. A weight that was
    dequantized from Q4_1 (``d * q + m``, with the group's minimum at q = 0 and maximum at q = 15,
    as llama.cpp quantizes) comes back exactly: ``lo`` is the minimum and ``d`` (max - min) / 15.
    """
    out_f, in_f = weight.shape
    w = weight.detach().float().reshape(out_f, in_f // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    d = (hi - lo) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((w - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.int32)
    return q.reshape(out_f, in_f), d, lo


def int4_is_exact(weight: torch.Tensor, group: int = INT4_GROUP) -> bool:
    """Whether ``weight`` is exactly 4-bit groups (reconstructs bit for bit from `int4_groups`)."""
    if weight.dim() != 2 or weight.shape[1] % group:
        return False
    q, d, lo = int4_groups(weight, group)
    out_f, in_f = weight.shape
    back = (q.reshape(out_f, in_f // group, group).float() * d[..., None] + lo[..., None]).reshape(out_f, in_f)
    return torch.equal(back, weight.detach().float())


def _set_state(module: nn.Module, tensors: dict[str, Optional[torch.Tensor]]) -> None:
    """Give a layer its tensors (a bias as a parameter, the rest as buffers) and derive its sizes: how a
    layer is built from a weight and how it is restored from a saved state (`restore`) share this."""
    for name, t in tensors.items():
        if name == "bias":
            module.bias = None if t is None else nn.Parameter(t.detach().clone(), requires_grad=False)
        else:
            module.register_buffer(name, t)
    module._derive()


class Int4Linear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` held as 4-bit codes, a scale and an offset per group of 32.

    torch's kernel computes ``(q - 8) * scale + zero`` per weight, so ``zero = lo + 8 * d``. It takes
    bfloat16 activations, scales and offsets: the codes are exact, the scales and offsets round to
    bfloat16, and the output is bfloat16 before it is cast back to x's dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, group: int = INT4_GROUP):
        super().__init__()
        q, d, lo = int4_groups(weight, group)
        zeros = lo + 8 * d
        _set_state(self, {"weight": torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1),
                          "scales_and_zeros": torch.stack([d, zeros], -1).transpose(0, 1).contiguous()
                          .to(torch.bfloat16), "bias": bias})

    def _derive(self) -> None:
        groups, self.out_features = self.scales_and_zeros.shape[:2]
        self.in_features = self.weight.shape[1] * 2  # two codes a byte
        self.group = self.in_features // groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in_features] (contiguous rows, as the models pass them)."""
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.weight, self.group,
                                                        self.scales_and_zeros).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, 4-bit groups of "
                f"{self.group}, bf16 scales")


class Float16Linear(nn.Module):
    """``y = x @ W.T + bias`` with W and x in float16 (float32 accumulation), y back in x's dtype.

    float16 keeps 11 significant bits: a Q4_1 or Q8_0 weight (a float16 scale times a 4- or 8-bit
    code) rounds by at most one part in 2,048, where bfloat16 (8 bits) rounds by one in 256.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        _set_state(self, {"weight": weight.detach().to(torch.float16).contiguous(), "bias": bias})

    def _derive(self) -> None:
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x.to(torch.float16), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float16"


class Int8Linear(nn.Module):
    """``y = x @ (q * scale).T + bias``; activations go through bfloat16, ``y`` has x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        q, scale = quantize_weight(weight)
        _set_state(self, {"weight": q.contiguous(), "scales": scale.contiguous(), "bias": bias})

    def _derive(self) -> None:
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in_features] (contiguous rows, as the models pass them)."""
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight, self.scales).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, bf16 scales"


LAYER_KINDS: dict[str, type[nn.Module]] = {"int4": Int4Linear, "float16": Float16Linear, "int8": Int8Linear}


def layout(model: nn.Module) -> dict[str, str]:
    """Which layers of a prepared model are in which representation: ``{module path: kind}``."""
    kinds = {cls: kind for kind, cls in LAYER_KINDS.items()}
    return {name: kinds[type(m)] for name, m in model.named_modules() if type(m) in kinds}


def restore(model: nn.Module, layers: dict[str, str], state: dict[str, torch.Tensor]) -> nn.Module:
    """Rebuild a prepared model from its `layout` and saved state (``model`` freshly built, its
    weights not loaded), with no quantizing: the saved tensors are used as they are."""
    for path, kind in layers.items():
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        layer = LAYER_KINDS[kind].__new__(LAYER_KINDS[kind])
        nn.Module.__init__(layer)
        prefix = path + "."
        _set_state(layer, {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
                   | ({} if prefix + "bias" in state else {"bias": None}))
        setattr(parent, name, layer)
    model.load_state_dict(state, strict=True, assign=True)
    return model


Maker = Callable[[str, torch.Tensor, Optional[torch.Tensor]], Optional[nn.Module]]

# Layers `auto` keeps in float16 even when their weights are 4-bit: the attention projections and the
# MLP's output projection (Llama's and GPT-2's names). The int4 kernel computes in bfloat16, and
# where its input is rounded to bfloat16 matters: measured on SmolLM2-135M against float32, 4-bit
# codes in every layer flip 1.7% of teacher-forced top-1 tokens and change 2 of 8 greedy answers;
# in the MLP only, 0.9% and 3 of 8 ("Hello! How can I" became "Hello! I'sh": the down projection's
# input, silu(gate) * up, has the widest range); in the gate/up projection only (the layer's
# largest matrix, 46% of its weights), 1.0% and 1 of 8 (docs/cpu.md).
FLOAT16_LAYERS = ("qkv_proj", "o_proj", "down_proj", "c_attn", "attn_proj", "mlp_proj")


def _layer_maker(kind: str) -> Maker:
    """How ``kind`` turns one linear layer (its name, weight and bias) into a module (None: keep it)."""
    def auto(name, w, b):
        if name not in FLOAT16_LAYERS and int4_is_exact(w):
            return Int4Linear(w, b)
        return Float16Linear(w, b)

    def int4(name, w, b):
        return Int4Linear(w, b) if w.shape[1] % INT4_GROUP == 0 else Float16Linear(w, b)

    def int8(name, w, b):
        return Int8Linear(w, b) if w.shape[1] % IN_FEATURES_MULTIPLE == 0 else None

    def float16(name, w, b):
        return Float16Linear(w, b)

    return {"auto": auto, "int4": int4, "float16": float16, "int8": int8}[kind]


def prepare_cpu_weights(model: nn.Module, kind: str) -> nn.Module:
    """Swap ``model``'s linear layers (and its output layer) for the representation ``kind`` names
    (one of `CPU_WEIGHTS`). In place; returns ``model``. Call once, after the weights are loaded.

    A model whose output layer is tied to its embedding gets its own copy for the output layer
    (the embedding itself stays as loaded, for lookups).
    """
    if kind == "float":
        return model
    if kind in ("auto", "int4") and not int4_linear_supported():
        raise RuntimeError(f"this torch build has no int4 CPU matmul: use --cpu-weights float16 "
                           f"(torch {torch.__version__})")
    if kind == "int8" and not int8_linear_supported():
        raise RuntimeError("this torch build has no torch._weight_int8pack_mm: use --cpu-weights float16")
    make = _layer_maker(kind)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                new = make(name, child.weight, child.bias)
                if new is not None:
                    setattr(module, name, new)
    # The output layer's rounding decides the top token directly: float16 keeps a Q8_0 or float16
    # embedding's values, where int4/bfloat16 measurably flip greedy choices (docs/cpu.md)
    head = getattr(model, "lm_head", None)
    weight = model.output_embedding() if head is None else head.weight
    bias = None if head is None else head.bias
    if kind == "int8":
        if weight.shape[1] % IN_FEATURES_MULTIPLE == 0:
            model.lm_head = Int8Linear(weight, bias)
    else:
        model.lm_head = Float16Linear(weight, bias)
    return model
