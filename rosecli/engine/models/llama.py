"""The Llama family: Llama, SmolLM2, Mistral (full attention), Qwen2 (q/k/v biases).

Hugging Face weight names; q/k/v and gate/up are fused into one matrix each at load time.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from rosecli.engine.attention import Attention, AttentionMetadata
from rosecli.engine.errors import ModelLoadError
from rosecli.engine.models.common import (RMSNorm, RotaryEmbedding, add_norm, apply_rotary, check_all_loaded,
                                           copy_weight, silu_mul)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    scaling = getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ModelLoadError(f"RoPE scaling {kind!r} is not supported yet; only plain RoPE models load")
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


class LlamaLayer(nn.Module):
    def __init__(self, cfg, qkv_bias: bool):
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or self.heads
        self.head_dim = _head_dim(cfg)
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(d, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.intermediate = cfg.intermediate_size
        self.attn = Attention(self.heads, self.kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the last sublayer's output, not yet added to ``residual`` (None before the first layer);
        rope: `RotaryEmbedding.tables` of this step's positions."""
        n = x.shape[0]
        qk_size = self.q_size + self.kv_size
        fused = meta.fused_ops
        h, residual = add_norm(self.input_layernorm, x, residual, fused)
        qkv = self.qkv_proj(h)
        # q and k sit side by side in qkv: one rotation covers both
        qk = apply_rotary(qkv[:, :qk_size].view(n, self.heads + self.kv_heads, self.head_dim), *rope).view(n, qk_size)
        o = self.o_proj(self.attn(qk[:, :self.q_size], qk[:, self.q_size:], qkv[:, qk_size:], meta))
        h, residual = add_norm(self.post_attention_layernorm, o, residual, fused)
        return self.down_proj(silu_mul(self.gate_up_proj(h), fused)), residual


class LlamaForCausalLM(nn.Module):
    qkv_bias_default = False

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        qkv_bias = bool(getattr(cfg, "attention_bias", self.qkv_bias_default)) or self.qkv_bias_default
        self.max_position = cfg.max_position_embeddings
        self.rotary = RotaryEmbedding(_head_dim(cfg), self.max_position, _rope_theta(cfg))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(cfg, qkv_bias) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # None when tied to the embedding (`prepare_cpu_weights` may set a copy in another representation)
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = _head_dim(cfg)
        self.vocab_size = cfg.vocab_size

    def attention_layers(self) -> list[Attention]:
        return [layer.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.tables(positions)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        return add_norm(self.norm, x, residual, meta.fused_ops)[0]

    def output_embedding(self) -> torch.Tensor:
        return self.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

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
