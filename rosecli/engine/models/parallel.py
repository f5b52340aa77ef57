"""Megatron-style tensor parallelism for the GPT-2 and Llama-family models.

Each rank holds a shard of every large matrix and runs the unchanged model code on it:

- attention: the q/k/v projection is column-parallel by heads (each rank owns ``heads / tp``
  query heads and their KV heads; with fewer KV heads than ranks, each KV head is replicated on
  ``tp / kv_heads`` ranks), so the kernels see fewer heads and the KV pool of each rank holds
  only its heads; the output projection is row-parallel and ends in one all-reduce;
- MLP: gate/up (GPT-2's c_fc) column-parallel, down (mlp c_proj) row-parallel, one all-reduce;
- the embedding and the output layer are vocabulary-parallel (``ceil(vocab / tp)`` rows per rank,
  the last rank's padded with zero rows): the embedding masks ids outside its rows and
  all-reduces, the output layer all-gathers its logits before sampling, so every rank samples
  from the same full logits.

A row-parallel layer's bias is added once, after the all-reduce. Norms, rotary tables and GPT-2's
position embedding are replicated.

Weights go straight into the shard: a Hugging Face checkpoint is read through safetensors'
slices (only this rank's rows or columns leave the file), and dummy weights draw each full
tensor with the same generator sequence as one rank would, one tensor at a time, and keep the
shard, so a dummy model says the same at any ``--tensor-parallel-size``.

`TensorParallel` is process state (set once by `rosecli.engine.distributed` when the process
joins its group), like ``torch.distributed``'s own default group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rosecli.engine.errors import ConfigError
from rosecli.engine.models.common import init_dummy


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: Any = None  # the process group the model's collectives run on (None: the default group)


_STATE: Optional[TensorParallel] = None


def set_tensor_parallel(tp: Optional[TensorParallel]) -> None:
    global _STATE
    _STATE = tp


def tensor_parallel() -> Optional[TensorParallel]:
    """This process's rank and group, or None when the model is not sharded."""
    return _STATE if _STATE is not None and _STATE.size > 1 else None


# --- sizes ------------------------------------------------------------------------------------

def _heads(cfg) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a model config."""
    if cfg.model_type == "gpt2":
        return cfg.n_head, cfg.n_head, cfg.n_embd // cfg.n_head
    heads = cfg.num_attention_heads
    kv = cfg.num_key_value_heads or heads
    return heads, kv, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


def check_divides(cfg, size: int) -> None:
    """A one-line ConfigError unless ``size`` ranks can split this model's heads and MLP."""
    if size == 1:
        return
    heads, kv, _ = _heads(cfg)
    inner = (cfg.n_inner or 4 * cfg.n_embd) if cfg.model_type == "gpt2" else cfg.intermediate_size
    flag = f"--tensor-parallel-size {size}"
    if heads % size:
        raise ConfigError(f"{flag} does not divide the model's {heads} attention heads: pass a divisor of {heads}")
    if kv % size and size % kv:
        raise ConfigError(f"{flag} and the model's {kv} KV heads do not divide one another: pass a divisor or a "
                          f"multiple of {kv} that divides {heads}")
    if inner % size:
        raise ConfigError(f"{flag} does not divide the model's MLP width {inner}")


def vocab_shard(vocab: int, size: int) -> int:
    return math.ceil(vocab / size)


def shard_config(cfg, size: int) -> SimpleNamespace:
    """A Llama-family config whose model *is* one rank's shard: fewer heads, a narrower MLP and
    vocabulary (GPT-2's block is changed after construction instead, `_shard_gpt2_blocks`)."""
    heads, kv, head_dim = _heads(cfg)
    out = SimpleNamespace(**vars(cfg))
    out.vocab_size = vocab_shard(cfg.vocab_size, size)
    if cfg.model_type == "gpt2":
        return out
    out.num_attention_heads = heads // size
    out.num_key_value_heads = max(1, kv // size)
    out.head_dim = head_dim
    out.intermediate_size = cfg.intermediate_size // size
    return out


# --- which part of each tensor a rank keeps ---------------------------------------------------

class ShardPlan:
    """Which rows or columns of each weight rank ``rank`` of ``size`` keeps.

    ``spec(name)`` -> None (replicated) or ``(dim, pieces, padded)``: the shard is the
    concatenation along ``dim`` of the ``(start, end)`` pieces, zero-padded to ``padded`` rows
    (the vocabulary's last shard) or None. Names are ours (`spec`) or Hugging Face's (`hf_spec`).
    """

    def __init__(self, cfg, rank: int, size: int):
        self.cfg, self.rank, self.size = cfg, rank, size
        self.heads, self.kv_heads, self.head_dim = _heads(cfg)
        self.gpt2 = cfg.model_type == "gpt2"
        self.width = cfg.n_embd if self.gpt2 else cfg.hidden_size
        self.inner = (cfg.n_inner or 4 * cfg.n_embd) if self.gpt2 else cfg.intermediate_size
        self.vocab = cfg.vocab_size

    def _even(self, n: int, offset: int = 0) -> tuple[int, int]:
        s = n // self.size
        return offset + self.rank * s, offset + (self.rank + 1) * s

    def _q(self, offset: int = 0) -> tuple[int, int]:
        return self._even(self.heads * self.head_dim, offset)

    def _kv(self, offset: int = 0) -> tuple[int, int]:
        if self.kv_heads >= self.size:
            return self._even(self.kv_heads * self.head_dim, offset)
        head = self.rank * self.kv_heads // self.size  # replicated: tp / kv_heads ranks share each head
        return offset + head * self.head_dim, offset + (head + 1) * self.head_dim

    def _vocab(self):
        n = vocab_shard(self.vocab, self.size)
        start = min(self.rank * n, self.vocab)
        return 0, [(start, min(start + n, self.vocab))], n

    def spec(self, name: str):
        """Our parameter names (nn.Linear layout: [out, in])."""
        parts = name.split(".")
        module, kind = parts[-2], parts[-1]
        if module in ("embed_tokens", "lm_head", "wte"):
            return self._vocab()
        if self.gpt2:
            d = self.width
            if module == "c_attn":
                return 0, [self._even(d, j * d) for j in range(3)], None
            if module == "c_fc":
                return 0, [self._even(self.inner)], None
            if module in ("attn_proj", "mlp_proj"):
                return None if kind == "bias" else (1, [self._even(d if module == "attn_proj" else self.inner)], None)
            return None
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if module == "qkv_proj":
            return 0, [self._q(), self._kv(q), self._kv(q + kv)], None
        if module == "gate_up_proj":
            return 0, [self._even(self.inner), self._even(self.inner, self.inner)], None
        if module == "o_proj":
            return 1, [self._q()], None
        if module == "down_proj":
            return 1, [self._even(self.inner)], None
        return None

    def hf_spec(self, name: str):
        """Hugging Face checkpoint names (GPT-2's Conv1D weights are [in, out])."""
        parts = name.split(".")
        if len(parts) < 2:
            return None
        module, kind = parts[-2], parts[-1]
        if module in ("embed_tokens", "lm_head", "wte"):
            return self._vocab()
        if self.gpt2:
            d, w = self.width, kind == "weight"
            if module == "c_attn":
                return (1 if w else 0), [self._even(d, j * d) for j in range(3)], None
            if module == "c_fc":
                return (1 if w else 0), [self._even(self.inner)], None
            if module == "c_proj":
                n = d if ".attn." in name else self.inner
                return (0, [self._even(n)], None) if w else None
            return None
        if module == "q_proj":
            return 0, [self._q()], None
        if module in ("k_proj", "v_proj"):
            return 0, [self._kv()], None
        if module in ("gate_proj", "up_proj"):
            return 0, [self._even(self.inner)], None
        if module == "o_proj":
            return 1, [self._q()], None
        if module == "down_proj":
            return 1, [self._even(self.inner)], None
        return None


def take_shard(read: Callable[[int, int, int], torch.Tensor], shape, spec) -> torch.Tensor:
    """The shard ``spec`` names of a tensor of ``shape``; ``read(dim, start, end)`` reads one slice."""
    dim, pieces, padded = spec
    parts = [read(dim, s, e) for s, e in pieces]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    if padded is not None and out.shape[dim] < padded:
        pad_shape = list(out.shape)
        pad_shape[dim] = padded - out.shape[dim]
        out = torch.cat([out, out.new_zeros(pad_shape)], dim)
    return out


# --- layers -----------------------------------------------------------------------------------

class RowParallelLinear(nn.Module):
    """``x`` holds this rank's share of the input features; the partial products are summed over
    the ranks (one all-reduce), then the bias is added once. Not an ``nn.Linear``, so nothing
    defers its bias or swaps it for another representation past the all-reduce."""

    def __init__(self, linear: nn.Linear, tp: TensorParallel):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.group = tp.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, start + rows)`` of the embedding; ids outside them give zeros, summed over ranks."""

    def __init__(self, embedding: nn.Embedding, start: int, tp: TensorParallel):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = embedding.weight
        self.start = start
        self.group = tp.group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


def _gathered_logits(compute_logits, vocab: int, tp: TensorParallel):
    def gathered(hidden: torch.Tensor) -> torch.Tensor:
        local = compute_logits(hidden).contiguous()
        parts = [torch.empty_like(local) for _ in range(tp.size)]
        dist.all_gather(parts, local, group=tp.group)
        return torch.cat(parts, dim=-1)[..., :vocab]
    return gathered


def _shard_gpt2_blocks(model: nn.Module, size: int) -> None:
    """GPT-2's block sizes its projections from ``n_embd``: swap them for their shards."""
    from rosecli.engine.attention import Attention

    for blk in model.h:
        d, inner = blk.c_attn.in_features, blk.c_fc.out_features
        heads = d // blk.head_dim // size
        blk.c_attn = nn.Linear(d, 3 * d // size)
        blk.attn_proj = nn.Linear(d // size, d)
        blk.c_fc = nn.Linear(d, inner // size)
        blk.mlp_proj = nn.Linear(inner // size, d)
        blk.attn = Attention(heads, heads, blk.head_dim, blk.head_dim ** -0.5)
        blk.d = d // size
    model.num_kv_heads = model.num_kv_heads // size


def build_sharded(cls, cfg, tp: TensorParallel) -> nn.Module:
    """This rank's shard of ``cls(cfg)`` (call under the target device and dtype, weights unset)."""
    check_divides(cfg, tp.size)
    model = cls(shard_config(cfg, tp.size))
    model.config = cfg
    model.vocab_size = cfg.vocab_size
    rows = vocab_shard(cfg.vocab_size, tp.size)
    if cfg.model_type == "gpt2":
        _shard_gpt2_blocks(model, tp.size)
        model.wte = VocabParallelEmbedding(model.wte, tp.rank * rows, tp)
        for blk in model.h:
            blk.attn_proj = RowParallelLinear(blk.attn_proj, tp)
            blk.mlp_proj = RowParallelLinear(blk.mlp_proj, tp)
    else:
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, tp.rank * rows, tp)
        for layer in model.layers:
            layer.o_proj = RowParallelLinear(layer.o_proj, tp)
            layer.down_proj = RowParallelLinear(layer.down_proj, tp)
    model.compute_logits = _gathered_logits(model.compute_logits, cfg.vocab_size, tp)
    model.logits_gemm = lambda hidden: None  # a shard's GEMM is not the logits: they need the gather
    return model


def init_dummy_shard(model: nn.Module, cls, cfg, tp: TensorParallel, seed: int, device: torch.device) -> None:
    """The loader's dummy init (normal(0, 0.02) matrices, norms 1, biases 0) as one rank would
    draw it, each full matrix drawn in turn and only this rank's shard kept."""
    with torch.device("meta"):
        full = dict(cls(cfg).named_parameters())
    plan = ShardPlan(cfg, tp.rank, tp.size)

    def draw(name: str, p: torch.Tensor, g: torch.Generator) -> None:
        whole = torch.empty(full[name].shape, dtype=p.dtype, device=device).normal_(0.0, 0.02, generator=g)
        spec = plan.spec(name)
        p.copy_(whole if spec is None else take_shard(lambda d, s, e: whole.narrow(d, s, e - s), whole.shape, spec))

    init_dummy(model, seed, device, draw)


def sharded_weights(weights: Iterable[tuple[str, Any]], cfg, tp: TensorParallel):
    """(name, shard) of each checkpoint tensor; ``weights`` yields (name, lazy slice) pairs: a
    safetensors slice (``get_slice``) or a tensor."""
    plan = ShardPlan(cfg, tp.rank, tp.size)
    prefix_free = ("transformer.", "model.")
    for name, lazy in weights:
        short = name
        for p in prefix_free:
            short = short.removeprefix(p)
        spec = plan.hf_spec(short)
        if spec is None:
            yield name, lazy[:] if not isinstance(lazy, torch.Tensor) else lazy
            continue
        shape = lazy.get_shape() if hasattr(lazy, "get_shape") else lazy.shape

        def read(dim, s, e, lazy=lazy):
            return lazy[s:e] if dim == 0 else lazy[:, s:e]
        yield name, take_shard(read, shape, spec)
