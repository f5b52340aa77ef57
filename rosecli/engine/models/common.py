"""Pieces shared by the model files: norms, fused residual/bias/activation steps, rotary embedding,
weight-loading helpers.

With ``fused`` (`AttentionMetadata.fused_ops`: CUDA-graph decode) the residual add, a deferred
linear bias and the following norm run as one Triton kernel (`rosecli.kernels.norm`), and the MLP
activations as one (`rosecli.kernels.activation`): fewer kernels per layer is what bounds a small
decode batch. Wherever Triton runs, the Llama family's q/k rotation and KV store are one kernel too
(`rosecli.kernels.rotary`, given `RotaryEmbedding.for_step`'s whole tables). Otherwise the same steps run as plain torch ops, in the order of the unfused code,
so CPU results are unchanged bit for bit.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from rosecli.engine.errors import ModelLoadError
from rosecli.kernels import activation, norm, skinny_gemm
from rosecli.kernels.launch_table import (fold_copy, fold_norm, kv_in_gemm, logits_launch, stats_fold,
                                          stats_pair)
from rosecli.kernels.rotary import apply_rotary  # noqa: F401 (the models' import)


# --- the output layer's rows, padded -----------------------------------------------------------
#
# The logits GEMM writes [N, vocab] rows; a vocabulary that is not a multiple of 8 (GPT-2's 50,257)
# makes every row of the output misaligned for 16-byte vector stores, and cuBLAS falls back to an
# alignment-1 kernel (on the H100: an sm75 tensor-op kernel, 105 us of a 708 us GPT-2 step at B=64,
# four times its read floor). Built inside `vocab_padding(m)`, a model keeps its output layer's
# rows in one [vocab rounded up to m, width] tensor (`padded_output_rows`): the parameter the
# checkpoint loads into (the token embedding when tied, else ``lm_head.weight``) is a view of its
# first ``vocab`` rows, so the weights are allocated once, the embedding looks up real rows only,
# and the rows past the vocabulary stay zero. Only the logits GEMM reads the padded tensor
# (`output_logits`), and it slices the logits back to the real rows before anything else sees
# them: samplers, logprobs, grammars and argmaxes get the same [N, vocab] float32 tensor as before.
# A padded model must be built on its device in its dtype (as the loader does): ``model.to()``
# would copy the parameters away from the padded tensor.

_vocab_multiple = 1


@contextmanager
def vocab_padding(multiple: int):
    """Models built inside pad their output layer's rows to a multiple of ``multiple`` (1: none)."""
    global _vocab_multiple
    if multiple < 1:
        raise ValueError(f"vocab padding multiple must be at least 1, got {multiple}")
    saved, _vocab_multiple = _vocab_multiple, multiple
    try:
        yield
    finally:
        _vocab_multiple = saved


def padded_output_rows(rows: int, width: int) -> Optional[torch.Tensor]:
    """A [rows rounded up to the `vocab_padding` multiple, width] tensor (default device and dtype)
    whose rows past ``rows`` are zero; None when no padding is asked or ``rows`` is a multiple."""
    m = _vocab_multiple
    if m <= 1 or rows % m == 0:
        return None
    full = torch.empty(-(-rows // m) * m, width)
    with torch.no_grad():
        full[rows:].zero_()
    return full


def output_embedding_module(rows: int, width: int, padded: Optional[torch.Tensor]) -> nn.Embedding:
    """``nn.Embedding(rows, width)``, its weight a view of ``padded``'s first rows when given."""
    if padded is None:
        return nn.Embedding(rows, width)
    return nn.Embedding(rows, width, _weight=padded[:rows])


def plain_table(module: nn.Module) -> Optional[torch.Tensor]:
    """The weight of ``module`` when it is a plain ``nn.Embedding`` of floating-point rows (what
    `kernels.embed.gather_embed` reads in its place), else None (a tensor-parallel or CPU-quantized table)."""
    w = getattr(module, "weight", None)
    if type(module) is not nn.Embedding or not isinstance(w, torch.Tensor) or not w.is_floating_point():
        return None
    return w if w.stride(1) == 1 else None


def output_linear(width: int, rows: int, padded: Optional[torch.Tensor]) -> nn.Linear:
    """``nn.Linear(width, rows, bias=False)``, its weight a view of ``padded``'s first rows when given."""
    if padded is None:
        return nn.Linear(width, rows, bias=False)
    linear = nn.Linear(width, rows, bias=False, device="meta")  # nothing allocated for the weight it replaces
    linear.weight = nn.Parameter(padded[:rows])
    return linear


def logits_gemm(hidden: torch.Tensor, weight: torch.Tensor, padded: Optional[torch.Tensor],
                fused: bool = False) -> torch.Tensor:
    """The logits GEMM alone: ``hidden @ W^T`` in the weights' dtype, W = ``padded`` (the tensor
    ``weight`` is the first rows of) when given, else ``weight``: [N, rows of W], the columns past
    ``weight``'s rows zero. ``fused`` (a decode step's fused ops), one row: on `skinny_gemm` where
    `launch_table.logits_launch` gives one, else cuBLAS."""
    w = weight if padded is None else padded
    launch = logits_launch(hidden.shape[0]) if fused and SKINNY_GEMM else None
    if launch is not None and _skinny_device(hidden) and skinny_gemm.supported(hidden, w):
        return skinny_gemm.skinny_linear(hidden, w, launch=launch)
    return F.linear(hidden, w)


def output_logits(hidden: torch.Tensor, weight: torch.Tensor, padded: Optional[torch.Tensor]) -> torch.Tensor:
    """float32 ``hidden @ weight^T``, [N, rows of ``weight``]: `logits_gemm`, sliced back to the
    real rows when padded. The slice is consumed by the float32 conversion the logits need anyway
    (one kernel, as without padding); float32 weights (CPU) copy it once to keep it contiguous."""
    if padded is None:
        return F.linear(hidden, weight).float()
    out = logits_gemm(hidden, weight, padded)[..., :weight.shape[0]]
    return out.float() if out.dtype != torch.float32 else out.contiguous()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op, the same arithmetic as below (tests/test_cpu_fast_path.py checks bit equality)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def add_norm(layer: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor], fused: bool,
             x_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x (+ x_bias) (+ residual)``; returns ``(layer(s), s)`` for an `RMSNorm` or ``nn.LayerNorm``.
    ``x`` may be the `skinny_gemm.StreamStats` of `linear_residual`: ``residual`` is then the sum already."""
    if isinstance(x, skinny_gemm.StreamStats):
        assert x_bias is None
        x, residual = residual, None
    if fused:
        rms = isinstance(layer, RMSNorm)
        return norm.add_norm(x, residual, layer.weight, None if rms else layer.bias, layer.eps, x_bias, rms)
    s = x if x_bias is None else x + x_bias
    if residual is not None:
        s = s + residual
    return layer(s), s


SKINNY_GEMM = os.environ.get("ROSE_SKINNY_GEMM", "1") != "0"  # decode's few rows through `skinny_gemm`


def _skinny_device(x: torch.Tensor) -> bool:
    return x.is_cuda  # (the CPU has its own paths; tests interpret the kernel on CPU tensors)


def _skinny_takes(linear: nn.Module, x: torch.Tensor, fused: bool) -> bool:
    """Whether ``linear`` of ``x`` may run on `skinny_gemm` (``fused``: a decode step with the fused ops, which
    CUDA graphs replay without a Triton launch's host time; on CUDA, a plain ``nn.Linear``, at most 64 rows)."""
    return (fused and SKINNY_GEMM and _skinny_device(x) and type(linear) is nn.Linear
            and skinny_gemm.supported(x, linear.weight))


def _skinny(linear: nn.Module, x: torch.Tensor, fused: bool, bias: bool = False, gelu: bool = False,
            swiglu: bool = False, norm: Optional[nn.Module] = None, residual: Optional[torch.Tensor] = None,
            x_bias: Optional[torch.Tensor] = None, kv: Optional[skinny_gemm.KVOut] = None,
            stats: Optional[skinny_gemm.StreamStats] = None):
    """`skinny_gemm.skinny_linear` of a plain ``nn.Linear`` where `_skinny_takes` it and the launch table
    gives the shape to it, or None: the caller runs its cuBLAS path. With ``norm`` (an `RMSNorm` or
    ``nn.LayerNorm``), `add_norm` is folded into the kernel's prologue (where the table says so) and the
    result is ``(y, sum)``; with ``norm`` and ``stats`` (``x`` is then the sum `linear_residual` wrote), the
    kernel reads that sum with the norm folded into a copy of the weights (`_norm_fold`) and the result is
    ``y``. ``kv``: the epilogue also stores the K and V columns (`skinny_gemm.KVOut`)."""
    if not _skinny_takes(linear, x, fused):
        return None
    n = linear.weight.shape[0] // 2 if swiglu else linear.weight.shape[0]
    b = linear.bias if bias else None
    rms = isinstance(norm, RMSNorm)
    if stats is not None:
        launch = stats_fold(x.shape[0], n, x.shape[1], swiglu)
        if launch is None or not _norm_foldable(norm, x, None) or stats.rms != rms:
            return None
        fold = _norm_fold(norm, linear, fold_copy(x.shape[0]))
        return skinny_gemm.skinny_stats_norm_linear(x, stats, fold, b, gelu, launch, swiglu, kv)
    if norm is None:
        launch = skinny_gemm.table_launch(x, n, swiglu)
        return None if launch is None else skinny_gemm.skinny_linear(x, linear.weight, b, gelu, launch, swiglu, kv)
    launch = fold_norm(x.shape[0], n, x.shape[1]) if NORM_FOLD else None
    if launch is None or not _norm_foldable(norm, x, residual):
        return None
    normin = skinny_gemm.NormIn(residual, x_bias, norm.weight, None if rms else norm.bias, norm.eps, rms)
    return skinny_gemm.skinny_norm_linear(x, normin, linear.weight, b, gelu, launch, swiglu, kv)


def _norm_fold(norm: nn.Module, linear: nn.Module, copy: bool) -> skinny_gemm.NormFold:
    """``norm`` folded into ``linear`` (`skinny_gemm.fold_norm_weights`), made on first use (in a decode graph's
    warm-up step, outside its capture) and kept on the layer; made again if either's weights change. With
    ``copy`` (`launch_table.fold_copy`), a second copy of the layer's weight, for the small layers the launch
    table gives 2-64 rows to (GPT-2: 100 MB, SmolLM2-135M: 140 MB in fp16); without, [N] vectors only."""
    rms = isinstance(norm, RMSNorm)
    tensors = (norm.weight, linear.weight) + (() if rms else (norm.bias,))
    key = tuple((t.data_ptr(), t._version) for t in tensors)
    attr = "_rose_norm_fold" if copy else "_rose_norm_scale"
    cached = linear.__dict__.get(attr)
    if cached is not None and cached[0] == key:
        return cached[1]
    if linear.weight.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a norm fold would be made inside a CUDA graph capture: run the step once before")
    fold = skinny_gemm.fold_norm_weights(linear.weight.detach(), norm.weight.detach(),
                                         None if rms else norm.bias.detach(), norm.eps, rms, copy)
    linear.__dict__[attr] = (key, fold)
    return fold


NORM_FOLD = os.environ.get("ROSE_NORM_FOLD", "1") != "0"  # add_norm into the next skinny GEMM's prologue
ROPE_IN_GEMM = os.environ.get("ROSE_ROPE_IN_GEMM", "1") != "0"  # `norm_qkv`'s rotation in the q/k/v GEMM


def _norm_foldable(norm: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor]) -> bool:
    if isinstance(norm, RMSNorm):
        ok = True
    else:
        ok = type(norm) is nn.LayerNorm and norm.elementwise_affine and norm.bias is not None
    return (ok and norm.weight.dtype == x.dtype and norm.weight.shape == x.shape[1:]
            and (residual is None or (residual.shape == x.shape and residual.stride(1) == 1)))


def norm_linear(norm: nn.Module, linear: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor],
                fused: bool, x_bias: Optional[torch.Tensor] = None, gelu: bool = False,
                swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_norm` then the linear layer, ``(linear(norm(sum)), sum)``: `fused_linear`, `linear_gelu`
    (``gelu``) or `gate_up_silu` (``swiglu``). Fused, at a decode step's few rows, one kernel: the norm
    in the GEMM's prologue (the normed rows never stored) where the launch table says it is faster."""
    return _norm_linear(norm, linear, x, residual, fused, x_bias, gelu, swiglu, None)[:2]


def norm_qkv(norm: nn.Module, linear: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor],
             fused: bool, x_bias: Optional[torch.Tensor], attn: nn.Module,
             meta, rope: Optional["Rope"] = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`norm_linear` of a [q; k; v] projection, ``(qkv, sum, stored)``; with the decode step's Triton
    attention, where the norm is folded into the GEMM, its epilogue also stores k and v into ``attn``'s
    cache (``stored``: `Attention.forward` is then called with ``kv_stored``) where the launch table says so.
    ``rope`` (a `Rope` of whole tables and positions): q and k are rotated first, in the epilogue too (stored
    or not, the caller knows from ``stored``; `ROPE_IN_GEMM`)."""
    kv = None
    rows = residual.shape[0] if isinstance(x, skinny_gemm.StreamStats) else x.shape[0]
    if fused and meta.use_triton and not meta.is_prefill and attn.k_cache is not None and kv_in_gemm(rows):
        if rope is None:
            kv = skinny_gemm.KVOut(attn.k_cache, attn.v_cache, meta.slot_mapping)
        elif ROPE_IN_GEMM and rope.positions is not None:
            kv = skinny_gemm.KVOut(attn.k_cache, attn.v_cache, meta.slot_mapping,
                                   (rope.positions, rope.cos, rope.sin))
    return _norm_linear(norm, linear, x, residual, fused, x_bias, False, False, kv)


def _norm_linear(norm, linear, x, residual, fused, x_bias, gelu, swiglu, kv):
    """`norm_linear`/`norm_qkv`: ``(y, sum, whether the kernel stored k and v)``; one skinny kernel where the
    table folds the norm, else `add_norm` and the layer's own path. ``x`` may be `linear_residual`'s
    `skinny_gemm.StreamStats` (``residual`` the sum): the norm then runs in the GEMM's epilogue, or (a layer
    the table leaves to cuBLAS) in `add_norm` of the sum alone."""
    if isinstance(x, skinny_gemm.StreamStats):
        y = _skinny(linear, residual, fused, bias=not swiglu, gelu=gelu, swiglu=swiglu, norm=norm, kv=kv, stats=x)
        if y is not None:
            return y, residual, kv is not None
        x, residual = residual, None  # the sum alone, normed below as any layer's input
    folded = _skinny(linear, x, fused, bias=not swiglu, gelu=gelu, swiglu=swiglu, norm=norm,
                     residual=residual, x_bias=x_bias, kv=kv) if (not swiglu or linear.bias is None) else None
    if folded is not None:
        return folded[0], folded[1], kv is not None
    h, residual = add_norm(norm, x, residual, fused, x_bias)
    if gelu:
        return linear_gelu(linear, h, fused), residual, False
    if swiglu:
        return gate_up_silu(linear, h, fused), residual, False
    return fused_linear(linear, h, fused), residual, False


def fused_linear(layer: nn.Module, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``layer(x)``; fused, a decode step's rows in one `skinny_gemm` kernel where it is faster than cuBLAS."""
    y = _skinny(layer, x, fused, bias=True)
    return layer(x) if y is None else y


def linear_deferring_bias(linear: nn.Module, x: torch.Tensor,
                          fused: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Fused: ``(x @ W^T, bias)``, the bias left for the next `add_norm`; else ``(linear(x), None)``."""
    if fused and isinstance(linear, nn.Linear) and linear.bias is not None:
        y = _skinny(linear, x, fused)
        return F.linear(x, linear.weight) if y is None else y, linear.bias
    return fused_linear(linear, x, fused), None


NORM_STATS = os.environ.get("ROSE_NORM_STATS", "1") != "0"  # `linear_residual`'s kernel pair at 2-64 rows


def linear_residual(linear: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor], fused: bool,
                    norm: nn.Module, after: nn.Module, swiglu: bool = False) -> tuple:
    """A linear layer whose output is added to the residual stream and normed next, by a norm of ``norm``'s kind
    for a linear layer of ``after``'s kind (a fused gate/up one with ``swiglu``): ``(x, residual, x_bias)`` for
    the `norm_linear`, `norm_qkv` or `add_norm` after it. Fused, where `launch_table.stats_pair` says so (2-64
    rows; one row at the 1.5B-8B widths) and `stats_fold` gives both layers a launch, one skinny kernel also adds
    the bias and ``residual`` and writes the statistics of the sum's rows (and, where `launch_table.fold_copy`
    says no copy, the sum times the norm's scale), which the next layer's kernel turns into the norm (no add_norm
    kernel between): ``(StreamStats, sum, None)``. Otherwise `linear_deferring_bias`: ``(y, residual, bias)``."""
    if NORM_STATS and residual is not None and _skinny_takes(linear, x, fused):  # (a plain nn.Linear: .weight)
        rows, width = x.shape[0], linear.weight.shape[0]
        launch = stats_fold(rows, width, x.shape[1], before=True) if stats_pair(rows, width) else None
        if (launch is not None and _norm_foldable(norm, residual, None) and residual.dtype == x.dtype
                and residual.shape == (rows, width) and residual.stride(1) == 1 and type(after) is nn.Linear
                and after.weight.shape[1] == width and (not swiglu or after.bias is None)
                and stats_fold(rows, after.weight.shape[0] // (2 if swiglu else 1), width, swiglu) is not None):
            scale = None if fold_copy(rows) else norm.weight  # (no copy: this kernel also writes sum * scale)
            total, stats = skinny_gemm.skinny_linear_add(x, linear.weight, linear.bias, residual,
                                                         isinstance(norm, RMSNorm), launch, scale)
            return stats, total, None
    y, bias = linear_deferring_bias(linear, x, fused)
    return y, residual, bias


def linear_gelu(linear: nn.Module, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``gelu_tanh(linear(x))``; fused, the bias is added inside the activation kernel (or the GEMM's)."""
    if fused and isinstance(linear, nn.Linear) and linear.bias is not None:
        y = _skinny(linear, x, fused, bias=True, gelu=True)
        return activation.bias_gelu(F.linear(x, linear.weight), linear.bias) if y is None else y
    return F.gelu(linear(x), approximate="tanh")


def silu_mul(gate_up: torch.Tensor, fused: bool) -> torch.Tensor:
    """``silu(gate) * up`` of a fused [N, 2F] gate/up projection."""
    return activation.silu_mul(gate_up) if fused else activation.silu_mul_ref(gate_up)


def gate_up_silu(gate_up_proj: nn.Module, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up_proj(x)``; fused, in the GEMM's epilogue where that is faster."""
    y = _skinny(gate_up_proj, x, fused, swiglu=True) if gate_up_proj.bias is None else None
    return silu_mul(gate_up_proj(x), fused) if y is None else y


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), as Hugging Face's Llama applies it.

    The tables are stored full width so one rotation is two multiplies and an add:
    ``cos`` = [cos, cos] and ``sin`` = [-sin, sin] per position, and
    ``rotate(x) = x * cos + swap_halves(x) * sin`` - the same float operations, term for term,
    as ``(x1*cos - x2*sin, x2*cos + x1*sin)``.
    """

    def __init__(self, head_dim: int, max_position: int, base: float = 10000.0,
                 angles: Optional[torch.Tensor] = None, scale: float = 1.0):
        """Plain RoPE of ``base``, or the given ``angles`` ([max_position, head_dim // 2], float64;
        `rope.rotary_angles`) with cos/sin multiplied by ``scale`` (YaRN's attention factor)."""
        super().__init__()
        if angles is None:
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
            angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos", torch.cat((cos, cos), -1).float(), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1).float(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of each position, ``[N, 1, head_dim]``: looked up once per forward, shared by all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def for_step(self, positions: torch.Tensor, fused: bool) -> "Rope":
        """What a forward's layers rotate with: this step's rows of the tables, or (``fused``: the
        kernel looks them up itself, `rosecli.kernels.rotary`) the whole tables and the positions."""
        if fused:
            return Rope(self.cos, self.sin, positions)
        return Rope(*self.tables(positions), None)


class Rope(NamedTuple):
    """A forward's rotary tables: with ``positions`` None, ``cos``/``sin`` are this step's rows
    (`RotaryEmbedding.tables`, for `apply_rotary`); else the whole ``[max_position, head_dim]``
    tables, for `rosecli.kernels.rotary.rotary_kv` to index by ``positions``."""
    cos: torch.Tensor
    sin: torch.Tensor
    positions: Optional[torch.Tensor]


def init_dummy(model: nn.Module, seed: int, device: torch.device,
               draw_matrix: Optional[Callable[[str, torch.Tensor, torch.Generator], None]] = None) -> None:
    """Like Hugging Face's init: normal(0, 0.02) matrices, norm weights 1, biases 0.

    Drawn on the target device in the target dtype with a generator seeded by ``seed``: the same
    seed gives the same weights on the same kind of device and dtype. CPU and CUDA draw different
    numbers; drawing on the CPU and copying would make them equal but costs about 1 s for 124M
    parameters, half the start-up budget of a dummy GPT-2 on a GPU. ``draw_matrix(name, param,
    generator)``, when given, fills each matrix instead (a tensor-parallel rank draws the whole
    matrix and keeps its shard: `parallel.init_dummy_shard`).
    """
    if device.type == "meta":  # shapes only (tests count parameters of the full-size shapes this way)
        return
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # norm weights
                p.fill_(1.0)
            elif draw_matrix is None:
                p.normal_(0.0, 0.02, generator=g)
            else:
                draw_matrix(name, p, g)


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ModelLoadError(
            f"weight {name} has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}: "
            "the weights do not match the model's config")
    with torch.no_grad():
        param.copy_(loaded)  # converts to the parameter's dtype on its device (no host copy in that dtype)


def check_all_loaded(model: nn.Module, loaded: set[str], tied: Iterable[str] = ()) -> None:
    missing = [n for n, _ in model.named_parameters() if n not in loaded and n not in set(tied)]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} weights the model needs ({shown}): "
                             "the weight files are incomplete or for another architecture")
