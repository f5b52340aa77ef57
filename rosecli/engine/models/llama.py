"""The Llama family: Llama 2/3.x (RoPE scalings in `rope`), SmolLM2, Mistral (sliding window),
Qwen2/2.5 (q/k/v biases), Qwen3 dense (per-head q/k RMSNorm).

Hugging Face weight names; q/k/v and gate/up are fused into one matrix each at load time.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from rosecli.engine.attention import Attention, AttentionMetadata
from rosecli.engine.models.common import (RMSNorm, Rope, RotaryEmbedding, add_norm, apply_rotary, check_all_loaded,
                                           copy_weight, linear_residual, logits_gemm, norm_linear, norm_qkv,
                                           output_embedding_module, output_linear, output_logits, padded_output_rows,
                                           plain_table)
from rosecli.engine.models.rope import context_length, rotary_angles
from rosecli.kernels.launch_table import rope_in_decode
from rosecli.kernels import rotary


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def layer_windows(cfg) -> list[Optional[int]]:
    """Each layer's sliding attention window (tokens, the current one included), None for full attention.

    Mistral: ``sliding_window`` on every layer (null: none). Qwen2/Qwen3: only with
    ``use_sliding_window``, on the layers ``layer_types`` marks ``sliding_attention`` (else from
    ``max_window_layers`` on), as transformers' configs decide. Llama: none.
    """
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    kind = getattr(cfg, "model_type", None)
    if not window or kind not in ("mistral", "qwen2", "qwen3"):
        return [None] * n
    if kind == "mistral":
        return [int(window)] * n
    if not getattr(cfg, "use_sliding_window", False):
        return [None] * n
    types = getattr(cfg, "layer_types", None)
    if types:
        return [int(window) if t == "sliding_attention" else None for t in types]
    first = getattr(cfg, "max_window_layers", n)
    return [int(window) if i >= first else None for i in range(n)]


def fused_rotary(meta: AttentionMetadata) -> bool:
    """Whether the layers rotate q/k and store K/V in one Triton kernel (`rosecli.kernels.rotary`):
    wherever Triton runs (paged attention, or the fused decode ops). It replaces a Triton store and
    about six torch kernels, so it saves launches in eager prefill too."""
    return meta.use_triton or meta.fused_ops


class LlamaLayer(nn.Module):
    def __init__(self, cfg, qkv_bias: bool, qk_norm: bool = False, sliding_window: Optional[int] = None):
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or self.heads
        self.head_dim = _head_dim(cfg)
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(d, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        # Qwen3: RMSNorm over each head's q and k before the rotation
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.o_proj = nn.Linear(self.q_size, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.intermediate = cfg.intermediate_size
        self.attn = Attention(self.heads, self.kv_heads, self.head_dim, self.head_dim ** -0.5, sliding_window)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], rope: Rope, meta: AttentionMetadata,
                x_bias: Optional[torch.Tensor] = None) -> tuple:
        """x (+ x_bias) is the last sublayer's output, not yet added to ``residual`` (None before the first
        layer), or, fused at a few rows, `common.linear_residual`'s statistics of the stream it added it to;
        rope: `RotaryEmbedding.for_step` of this step's positions. Returns the same three for the next layer."""
        qk_size = self.q_size + self.kv_size
        fused = meta.fused_ops
        # at one row the q/k/v GEMM may also rotate q and k and store k and v (`norm_qkv`; not with Qwen3's q/k norms)
        qkv, residual, in_gemm = norm_qkv(self.input_layernorm, self.qkv_proj, x, residual, fused, x_bias, self.attn,
                                          meta, rope if self.q_norm is None else None)
        n = qkv.shape[0]
        positioned = rope.positions is not None  # (the Triton paths: `rotary.rotary_kv`'s positions)
        # a decode step's rotation and K/V store in the attention kernel (`launch_table.rope_in_decode`)
        in_decode = (positioned and not in_gemm and self.q_norm is None and meta.use_triton and not meta.is_prefill
                     and rope_in_decode())
        stored = in_gemm or (positioned and not in_decode)
        if in_gemm or in_decode:
            q, k = qkv[:, :self.q_size], qkv[:, self.q_size:qk_size]
        elif stored:
            # one kernel: (q/k norm,) rotation of q and k in place in qkv, k and v into this layer's cache
            norms = (None, None, 0.0) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight,
                                                                    self.q_norm.eps)
            rotary.rotary_kv(qkv, rope.positions, rope.cos, rope.sin, self.attn.k_cache, self.attn.v_cache,
                             meta.slot_mapping, self.heads, self.kv_heads, *norms)
            q, k = qkv[:, :self.q_size], qkv[:, self.q_size:qk_size]
        elif self.q_norm is None:
            # q and k sit side by side in qkv: one rotation covers both
            qk = apply_rotary(qkv[:, :qk_size].view(n, self.heads + self.kv_heads, self.head_dim), rope.cos, rope.sin)
            q, k = qk.view(n, qk_size)[:, :self.q_size], qk.view(n, qk_size)[:, self.q_size:]
        else:
            q = self.q_norm(qkv[:, :self.q_size].reshape(n, self.heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:qk_size].reshape(n, self.kv_heads, self.head_dim))
            q = apply_rotary(q, rope.cos, rope.sin).reshape(n, self.q_size)
            k = apply_rotary(k, rope.cos, rope.sin).reshape(n, self.kv_size)
        attn = self.attn(q, k, qkv[:, qk_size:], meta, kv_stored=stored, after_gemm=in_gemm,
                         rope=(rope.positions, rope.cos, rope.sin) if in_decode else None)
        o, residual, o_bias = linear_residual(self.o_proj, attn, residual, fused, self.post_attention_layernorm,
                                              self.gate_up_proj, swiglu=True)
        g, residual = norm_linear(self.post_attention_layernorm, self.gate_up_proj, o, residual, fused, o_bias,
                                  swiglu=True)
        # (the next layer's input norm and q/k/v projection are of this one's kind)
        return linear_residual(self.down_proj, g, residual, fused, self.input_layernorm, self.qkv_proj)


class LlamaForCausalLM(nn.Module):
    qkv_bias_default = False
    qk_norm = False

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        qkv_bias = bool(getattr(cfg, "attention_bias", self.qkv_bias_default)) or self.qkv_bias_default
        self.max_position = context_length(cfg)
        angles, scale = rotary_angles(cfg, _head_dim(cfg), self.max_position)
        self.rotary = RotaryEmbedding(_head_dim(cfg), self.max_position, angles=angles, scale=scale)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # the logits GEMM's weight: the output layer's rows padded (`common.vocab_padding`), or None
        self.logits_weight = padded_output_rows(cfg.vocab_size, cfg.hidden_size)
        tied_padded = self.logits_weight if self.tie_word_embeddings else None
        self.embed_tokens = output_embedding_module(cfg.vocab_size, cfg.hidden_size, tied_padded)
        self.layers = nn.ModuleList(LlamaLayer(cfg, qkv_bias, self.qk_norm, window)
                                    for window in layer_windows(cfg))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # None when tied to the embedding (`prepare_cpu_weights` may set a copy in another representation)
        self.lm_head = (None if self.tie_word_embeddings
                        else output_linear(cfg.hidden_size, cfg.vocab_size, self.logits_weight))
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = _head_dim(cfg)
        self.vocab_size = cfg.vocab_size

    def attention_layers(self) -> list[Attention]:
        return [layer.attn for layer in self.layers]

    def native_decode(self):
        """The whole-step CPU decode kernel (`rosecli.engine.native.LlamaDecode`) when this model can
        use it (rose's block kernels loaded, every linear layer 4-bit blocks), else None."""
        from rosecli.engine import native

        if native.loaded() is None or self.embed_tokens.weight.device.type != "cpu":
            return None
        k0 = self.layers[0].attn.k_cache
        cached = self.__dict__.get("_native_decode")
        if cached is None or cached[0] is not k0:
            cached = (k0, native.LlamaDecode.build(self) if k0 is not None else None)
            self.__dict__["_native_decode"] = cached
        return cached[1]

    def decode_embeddings(self) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(token table, None) for a decode step's `kernels.embed.gather_embed`, or None (not a plain table)."""
        w = plain_table(self.embed_tokens)
        return None if w is None else (w, None)

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, meta: AttentionMetadata,
                embedded: Optional[tuple] = None) -> torch.Tensor:
        """``embedded``: the rows' token embeddings already gathered (`decode_embeddings`; (x, None)), in place of
        looking up ``input_ids``."""
        if not meta.is_prefill and not meta.use_triton and embedded is None:
            fast = self.native_decode()
            if fast is not None:
                return fast(input_ids, positions, meta)
        x, residual, x_bias = self.embed_tokens(input_ids) if embedded is None else embedded[0], None, None
        rope = self.rotary.for_step(positions, fused_rotary(meta))
        for layer in self.layers:
            x, residual, x_bias = layer(x, residual, rope, meta, x_bias)
        return add_norm(self.norm, x, residual, meta.fused_ops, x_bias)[0]

    def output_embedding(self) -> torch.Tensor:
        return self.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return output_logits(hidden, self.embed_tokens.weight, self.logits_weight)
        if self.logits_weight is not None and isinstance(self.lm_head, nn.Linear):  # its weight: padded rows
            return output_logits(hidden, self.lm_head.weight, self.logits_weight)
        return self.lm_head(hidden).float()

    def logits_gemm(self, hidden: torch.Tensor, fused: bool = False) -> Optional[torch.Tensor]:
        """The logits GEMM's raw output, [N, >= vocab] in the weights' dtype (the columns past the
        vocabulary are the padding's, `common.vocab_padding`): `compute_logits` is its first vocab
        columns in float32. None when the output layer is not a plain matrix (CPU weights). ``fused``: a decode
        step's fused ops (`common.logits_gemm`)."""
        if self.lm_head is None:
            return logits_gemm(hidden, self.embed_tokens.weight, self.logits_weight, fused)
        if type(self.lm_head) is nn.Linear and self.lm_head.bias is None:
            return logits_gemm(hidden, self.lm_head.weight, self.logits_weight, fused)
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            target, shard = name, None
            for proj, fused, idx in (("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1),
                                     ("v_proj", "qkv_proj", 2), ("gate_proj", "gate_up_proj", 0),
                                     ("up_proj", "gate_up_proj", 1)):
                if f".{proj}." in name:
                    target, shard = name.replace(f"self_attn.{proj}", fused).replace(f"mlp.{proj}", fused), idx
            target = target.replace("self_attn.o_proj", "o_proj").replace("mlp.down_proj", "down_proj")
            target = target.replace("self_attn.q_norm", "q_norm").replace("self_attn.k_norm", "k_norm")
            if target not in params:
                continue
            param = params[target]
            if shard is not None:
                layer = self.layers[int(target.split(".")[1])]
                if "qkv" in target:
                    sizes = [layer.q_size, layer.kv_size, layer.kv_size]
                else:
                    sizes = [layer.intermediate, layer.intermediate]
                start = sum(sizes[:shard])
                copy_weight(param.data.narrow(0, start, sizes[shard]), tensor, name)
                loaded.add(f"{target}#{shard}")
                if all(f"{target}#{i}" in loaded for i in range(len(sizes))):
                    loaded.add(target)
            else:
                copy_weight(param, tensor, name)
                loaded.add(target)
        check_all_loaded(self, loaded)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense: Llama plus RMSNorm over each head's q and k; no q/k/v biases unless the config asks."""
    qk_norm = True
