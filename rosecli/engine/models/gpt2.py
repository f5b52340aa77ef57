"""GPT-2, loading Hugging Face weight names (`transformer.h.N...`, Conv1D weights transposed)."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from rosecli.engine.attention import Attention, AttentionMetadata
from rosecli.engine.models.common import (add_norm, check_all_loaded, copy_weight, linear_residual, logits_gemm,
                                           norm_linear, norm_qkv, output_embedding_module, output_logits,
                                           padded_output_rows, plain_table)


class GPT2Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, heads = cfg.n_embd, cfg.n_head
        inner = cfg.n_inner or 4 * d
        self.head_dim = d // heads
        self.ln_1 = nn.LayerNorm(d, eps=cfg.layer_norm_epsilon)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d, eps=cfg.layer_norm_epsilon)
        self.c_fc = nn.Linear(d, inner)
        self.mlp_proj = nn.Linear(inner, d)
        self.attn = Attention(heads, heads, self.head_dim, self.head_dim ** -0.5)
        self.d = d

    def forward(self, x: torch.Tensor, residual: torch.Tensor, x_bias: Optional[torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """x (+ x_bias) is the last sublayer's output, not yet added to the residual stream (or, fused at a few
        rows, `common.linear_residual`'s statistics of the stream it added it to)."""
        fused = meta.fused_ops
        qkv, residual, stored = norm_qkv(self.ln_1, self.c_attn, x, residual, fused, x_bias, self.attn, meta)
        q, k, v = qkv.split(self.d, dim=-1)
        attn = self.attn(q, k, v, meta, kv_stored=stored, after_gemm=stored)
        a, residual, a_bias = linear_residual(self.attn_proj, attn, residual, fused, self.ln_2, self.c_fc)
        g, residual = norm_linear(self.ln_2, self.c_fc, a, residual, fused, a_bias, gelu=True)
        # (the next block's ln_1 and c_attn are of this one's kind)
        return linear_residual(self.mlp_proj, g, residual, fused, self.ln_1, self.c_attn)


class GPT2ForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        # the logits GEMM's weight: wte's rows padded (`common.vocab_padding`), or None (wte itself)
        self.logits_weight = padded_output_rows(cfg.vocab_size, cfg.n_embd)
        self.wte = output_embedding_module(cfg.vocab_size, cfg.n_embd, self.logits_weight)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.num_layers = cfg.n_layer
        self.num_kv_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.vocab_size = cfg.vocab_size
        self.max_position = cfg.n_positions
        self.lm_head = None  # tied to wte (`prepare_cpu_weights` may set a copy in another representation)

    def attention_layers(self) -> list[Attention]:
        return [blk.attn for blk in self.h]

    def decode_embeddings(self) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(token table, position table) for a decode step's `kernels.embed.gather_embed`, or None (not plain)."""
        w, p = plain_table(self.wte), plain_table(self.wpe)
        return None if w is None or p is None else (w, p)

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, meta: AttentionMetadata,
                embedded: Optional[tuple] = None) -> torch.Tensor:
        """``embedded``: the rows' (token, position) embeddings already gathered (`decode_embeddings`), in place
        of looking up ``input_ids`` and ``positions``."""
        x, residual = embedded if embedded is not None else (self.wte(input_ids), self.wpe(positions))
        x_bias = None  # ln_1 adds the two
        for blk in self.h:
            x, residual, x_bias = blk(x, residual, x_bias, meta)
        return add_norm(self.ln_f, x, residual, meta.fused_ops, x_bias)[0]

    def output_embedding(self) -> torch.Tensor:
        return self.wte.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return output_logits(hidden, self.wte.weight, self.logits_weight)
        return self.lm_head(hidden).float()

    def logits_gemm(self, hidden: torch.Tensor, fused: bool = False) -> Optional[torch.Tensor]:
        """The logits GEMM's raw output, [N, >= vocab] in the weights' dtype (the columns past the
        vocabulary are the padding's, `common.vocab_padding`): `compute_logits` is its first vocab
        columns in float32. None when the output layer is not a plain matrix (CPU weights). ``fused``: a decode
        step's fused ops (`common.logits_gemm`)."""
        return None if self.lm_head is not None else logits_gemm(hidden, self.wte.weight, self.logits_weight, fused)

    # Hugging Face name (after the optional "transformer." prefix) -> (our name, transpose?)
    _RENAMES = {"attn.c_attn": "c_attn", "attn.c_proj": "attn_proj", "mlp.c_fc": "c_fc",
                "mlp.c_proj": "mlp_proj"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
                continue  # causal-mask buffers; lm_head is tied to wte
            transpose = False
            for hf, ours in self._RENAMES.items():
                if f".{hf}." in name:
                    name = name.replace(f".{hf}.", f".{ours}.")
                    transpose = name.endswith(".weight")
            if name not in params:
                continue
            copy_weight(params[name], tensor.t() if transpose else tensor, name)
            loaded.add(name)
        check_all_loaded(self, loaded)
