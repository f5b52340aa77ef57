"""Pieces shared by the model files: norms, rotary embedding, weight-loading helpers."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from rosecli.engine.errors import ModelLoadError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), as Hugging Face's Llama applies it."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [N, heads, D], k: [N, kv_heads, D] -> rotated (same dtype)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ModelLoadError(
            f"weight {name} has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}: "
            "the weights do not match the model's config")
    with torch.no_grad():
        param.copy_(loaded.to(param.dtype))


def check_all_loaded(model: nn.Module, loaded: set[str], tied: Iterable[str] = ()) -> None:
    missing = [n for n, _ in model.named_parameters() if n not in loaded and n not in set(tied)]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} weights the model needs ({shown}): "
                             "the weight files are incomplete or for another architecture")
