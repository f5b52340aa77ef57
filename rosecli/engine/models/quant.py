"""CPU weight representations: what the linear layers read on each decode step.

CPU decode is bound by reading the weights once per token, so the representation sets the speed;
it must not change what the model says. `--cpu-weights`:

- ``auto`` (default): with rose's own CPU kernels (`rosecli.engine.native`, built once with the
  system C++ compiler; AVX-512 VNNI), what ``blocks`` does for the layers whose weights are exactly
  4-bit blocks (every group of 32 input weights ``d * q + m`` with ``q`` in 0..15 and float16 ``d``,
  ``m``: a Q4_0/Q4_1 GGUF's) and an output layer that is exactly 8-bit blocks (Q8_0); every other
  layer `Float16Linear`, so no weight is rounded beyond the checkpoint's. Without those kernels: each
  MLP input layer (gate/up, GPT-2's c_fc) that is exactly 4-bit runs as `Int4Linear` (torch's int4
  kernel, bfloat16 activations); the layers where bfloat16 activations cost accuracy
  (`FLOAT16_LAYERS`), every other layer and the output layer as `Float16Linear`.
- ``blocks``: every linear layer (input width a multiple of 64) as `Q4Linear` and the output layer
  as `Q8Linear`, rose's kernels reading 4-bit / 8-bit codes with a float16 scale per block of 32 and
  activations rounded to 16-bit integers per block (far finer than bfloat16); exact codes for a Q4
  GGUF, quantized (min/max, absmax per block) otherwise. Needs rose's kernels.
- ``int4``: every layer (input width a multiple of 32) as `Int4Linear`, quantizing float weights
  (min/max per group of 32) where they are not 4-bit already; the output layer float16.
- ``float16``: every linear layer and the output layer as `Float16Linear`.
- ``int8``: int8 weights with one scale per output channel (`Int8Linear`), bfloat16 activations:
  measurably degrades a model that was already 4-bit (docs/cpu.md has the figures).
- ``float``: the weights as loaded: the reference every other choice is tested against.

Each representation's activations: `Int4Linear` and `Int8Linear` compute in bfloat16 (torch's CPU
kernels for them take bfloat16; float32 activations have no fast path), `Float16Linear` in float16,
`Q4Linear` and `Q8Linear` in 16-bit integers per block of 32 with exact int32 block sums. A model
whose linear layers are all `Q4Linear` decodes each step in one native call (`native.LlamaDecode`).
The residual stream, norms, rotary, attention and KV cache keep the model's dtype; logits are float32.
tests/test_cpu_fast_path.py bounds each against the float model; tests/test_default_model.py checks
the greedy and teacher-forced agreement of the real default model.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

CPU_WEIGHTS = ("auto", "blocks", "int4", "float16", "int8", "float")

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


def q4_blocks(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """`int4_groups` with float16 ``d`` and ``lo`` (what rose's kernel reads; a Q4_1 GGUF stores them
    so): ``(q int32 [out, in], d, lo float16 [out, in // group], exact)``, where exact means
    ``q * d + lo`` (float32) is ``weight`` bit for bit."""
    out_f, in_f = weight.shape
    w = weight.detach().float().reshape(out_f, in_f // group, group)
    _, d, lo = int4_groups(weight, group)
    d16, lo16 = d.half(), lo.half()
    d32, lo32 = d16.float()[..., None], lo16.float()[..., None]
    safe = torch.where(d32 > 0, d32, torch.ones_like(d32))
    q = torch.round((w - lo32) / safe).clamp_(0, 15)
    exact = torch.equal(q * d32 + lo32, w)
    return q.to(torch.int32).reshape(out_f, in_f), d16, lo16, exact


def q8_blocks(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Symmetric 8-bit blocks along the input dimension: ``weight ~= q * d`` per group of 32.

    ``(q int8 [out, in], d float16 [out, in // group], exact)``. A weight dequantized from Q8_0
    (``d * q`` with a float16 ``d`` and ``|q| <= 127``, the group's largest value usually at 127)
    comes back exactly: each group's ``d`` is found among ``amax / k`` for k = 127, 126, ..., 120;
    other groups are quantized with ``amax / 127``.
    """
    out_f, in_f = weight.shape
    w = weight.detach().float().reshape(out_f, in_f // group, group)
    amax = w.abs().amax(-1)
    best = (amax / 127).half().float()
    found = amax == 0
    for k in range(127, 119, -1):
        if found.all():  # every group's d found (a Q8_0 weight: usually all at k = 127); the rest change nothing
            break
        d = (amax / k).half().float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round(w / safe[..., None])
        ok = (q.abs() <= 127).all(-1) & (q * d[..., None] == w).all(-1) & ~found
        best = torch.where(ok, d, best)
        found |= ok
    safe = torch.where(best > 0, best, torch.ones_like(best))
    q = torch.round(w / safe[..., None]).clamp_(-127, 127)
    exact = torch.equal(q * best[..., None], w)
    return q.to(torch.int8).reshape(out_f, in_f), best.half(), exact


class _BlocksLinear(nn.Module):
    """Shared by `Q4Linear` and `Q8Linear`: ``y = x @ W.T + bias`` by rose's own kernel
    (`rosecli.engine.native`), which reads the blocks' codes and rounds the activations to 16-bit
    integers per block of 32 (float32 in, float32 out). Inputs of more than `ROWS` rows (prefill)
    multiply the dequantized float32 weights with torch instead: the same weights, float32 activations.
    """

    KIND = 0
    ROWS = 4

    def _derive(self) -> None:
        self.out_features = self.scales.shape[0]
        self.in_features = self.codes.shape[1] * (2 if self.KIND == 4 else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from rosecli.engine import native

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        if x2.shape[0] <= self.ROWS:
            y = native.matmul(self.KIND, x2, self.codes, self.scales, self.bias, self.out_features)
        else:
            w = native.dequant(self.KIND, self.codes, self.scales, self.out_features, self.in_features)
            y = torch.nn.functional.linear(x2, w, None if self.bias is None else self.bias.float())
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


class Q4Linear(_BlocksLinear):
    """4-bit codes with a float16 scale and offset per group of 32 (``w = d * q + m``: Q4_1, exactly)."""

    KIND = 4

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        out_f, in_f = weight.shape
        q, d, lo, _ = q4_blocks(weight)
        q = q.to(torch.uint8).reshape(out_f, in_f // 64, 2, 2, 16)  # [pair, block, half, 16]
        codes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(out_f, in_f // 2)
        pairs = in_f // 64
        dm = torch.cat([d.reshape(out_f, pairs, 2), lo.reshape(out_f, pairs, 2)], -1)
        _set_state(self, {"codes": codes.contiguous(), "scales": dm.contiguous(),
                          "bias": None if bias is None else bias.float()})

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit blocks of 32, 16-bit activations"


class Q8Linear(_BlocksLinear):
    """8-bit codes with a float16 scale per group of 32 (``w = d * q``: Q8_0, exactly)."""

    KIND = 8

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        out_f, in_f = weight.shape
        q, d, _ = q8_blocks(weight)
        codes = q.reshape(out_f, in_f // 64, 2, 2, 16).transpose(2, 3).reshape(out_f, in_f)
        _set_state(self, {"codes": codes.contiguous(), "scales": d.contiguous(),
                          "bias": None if bias is None else bias.float()})

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 8-bit blocks of 32, 16-bit activations"


BLOCKS_MULTIPLE = 64  # the kernel takes blocks in pairs
BLOCKS_LAYOUT = 1  # how `Q4Linear` / `Q8Linear` lay out their tensors (prepared-weights caches key on it)


LAYER_KINDS: dict[str, type[nn.Module]] = {"int4": Int4Linear, "float16": Float16Linear, "int8": Int8Linear,
                                           "q4": Q4Linear, "q8": Q8Linear}


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


def _layer_maker(kind: str, blocks: bool) -> Maker:
    """How ``kind`` turns one linear layer (its name, weight and bias) into a module (None: keep it);
    ``blocks``: rose's block kernels are there (what ``auto`` picks depends on it)."""
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

    def blocks_auto(name, w, b):
        if w.shape[1] % BLOCKS_MULTIPLE == 0 and q4_blocks(w)[3]:
            return Q4Linear(w, b)
        return Float16Linear(w, b)

    def all_blocks(name, w, b):
        return Q4Linear(w, b) if w.shape[1] % BLOCKS_MULTIPLE == 0 else Float16Linear(w, b)

    if kind == "auto" and blocks:
        return blocks_auto
    return {"auto": auto, "int4": int4, "float16": float16, "int8": int8, "blocks": all_blocks}[kind]


def blocks_available() -> bool:
    """Whether rose's own block kernels are loaded in this process (`rosecli.engine.native.load`)."""
    from rosecli.engine import native

    return native.loaded() is not None


def resolved_kind(kind: str) -> str:
    """What ``kind`` prepares in this process: ``auto`` means one thing with rose's block kernels
    loaded and another without (the prepared-weights cache keys on this)."""
    if kind in ("auto", "blocks") and blocks_available():
        return f"{kind}+blocks-v{BLOCKS_LAYOUT}"
    return kind


def prepare_cpu_weights(model: nn.Module, kind: str, blocks: Optional[bool] = None) -> nn.Module:
    """Swap ``model``'s linear layers (and its output layer) for the representation ``kind`` names
    (one of `CPU_WEIGHTS`). In place; returns ``model``. Call once, after the weights are loaded.

    A model whose output layer is tied to its embedding gets its own copy for the output layer
    (the embedding itself stays as loaded, for lookups).
    """
    if kind == "float":
        return model
    if blocks is None:
        blocks = blocks_available()
    if kind in ("auto", "int4") and not blocks and not int4_linear_supported():
        raise RuntimeError(f"this torch build has no int4 CPU matmul: use --cpu-weights float16 "
                           f"(torch {torch.__version__})")
    if kind == "int8" and not int8_linear_supported():
        raise RuntimeError("this torch build has no torch._weight_int8pack_mm: use --cpu-weights float16")
    if kind == "blocks" and not blocks_available():  # (their forward needs them loaded)
        from rosecli.engine import native

        raise RuntimeError(f"--cpu-weights blocks needs rose's block kernels, which are unavailable here "
                           f"({native.unavailable or 'not loaded'}): use --cpu-weights auto")
    make = _layer_maker(kind, blocks)
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
    elif kind in ("auto", "blocks") and blocks and weight.shape[1] % BLOCKS_MULTIPLE == 0 \
            and (kind == "blocks" or q8_blocks(weight)[2]):
        # the output layer's own 8-bit codes (a Q8_0 GGUF's, exactly) with 16-bit activations: half
        # float16's bytes, and nothing rounded that the checkpoint did not round
        model.lm_head = Q8Linear(weight, bias)
    else:
        model.lm_head = Float16Linear(weight, bias)
    return model
