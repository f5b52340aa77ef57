"""Rotary position embeddings and their context-extension variants, as Hugging Face configs name them.

The config says which one in ``rope_scaling`` (config.json files written before transformers 5) or
``rope_parameters`` (transformers 5), key ``rope_type`` (older files: ``type``):

- ``default``: plain RoPE, ``inv_freq[i] = theta ** (-2i / dim)``.
- ``linear`` (position interpolation): every frequency divided by ``factor``.
- ``llama3`` (Llama 3.1 / 3.2): low frequencies divided by ``factor``, high ones kept, a smooth
  ramp between (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
- ``yarn`` (Qwen2.5 / Qwen3 long-context configs): per-dimension blend of interpolated and
  original frequencies (``beta_fast``, ``beta_slow``) and cos/sin scaled by an attention factor.
- ``dynamic`` (dynamic NTK): the base grows with the sequence length past
  ``max_position_embeddings``. Transformers recomputes the frequencies for the length of each
  forward, so a cached key keeps the rotation of the step that wrote it; here position ``p`` is
  rotated with the frequencies of length ``max(p + 1, max_position_embeddings)``, which is what
  transformers computes when it decodes token by token (prompts up to ``max_position_embeddings``
  are unaffected). A prompt longer than that, prefilled at once by transformers, rotates its
  earlier tokens with the whole prompt's length instead; we do not copy that (it makes a token's
  rotation depend on how the prompt was batched).

The formulas follow transformers' ``modeling_rope_utils`` term for term, computed in float64 and
stored as float32 tables (tests/test_families.py compares logits with transformers').
"""

from __future__ import annotations

import math

import torch

from rosecli.engine.errors import ModelLoadError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def rope_parameters(cfg) -> dict:
    """The config's RoPE settings in one dict (``rope_type``, ``rope_theta`` and the type's keys)."""
    merged = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = getattr(cfg, key, None)
        if isinstance(value, dict):
            merged.update(value)
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"RoPE type {kind!r} (the config's rope_scaling) is not supported; supported: "
                             f"{', '.join(ROPE_TYPES)}")
    merged["rope_type"] = kind
    merged["rope_theta"] = float(merged.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)
    partial = merged.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"partial_rotary_factor {partial} is not supported: only full-width RoPE loads")
    if kind != "default":
        factor = merged.get("factor")
        if kind != "yarn" and not (isinstance(factor, (int, float)) and factor > 0):
            raise ModelLoadError(f"RoPE type {kind!r} needs a positive 'factor' in rope_scaling, got {factor!r}")
    if kind in ("llama3", "yarn"):
        merged.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if not isinstance(merged.get(key), (int, float)):
                raise ModelLoadError(f"RoPE type 'llama3' needs {key!r} in rope_scaling")
    return merged


def context_length(cfg) -> int:
    """The positions the model may use: ``max_position_embeddings``, extended by ``factor`` for the
    scalings that extrapolate past it (linear, dynamic; yarn from its original length), as vLLM does.
    Llama 3's config already states the extended length."""
    max_pos = int(cfg.max_position_embeddings)
    params = rope_parameters(cfg)
    kind, factor = params["rope_type"], params.get("factor")
    if kind in ("linear", "dynamic"):
        return max(max_pos, int(max_pos * factor))
    if kind == "yarn" and factor:
        return max(max_pos, int(params["original_max_position_embeddings"] * factor))
    return max_pos


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # share of the original frequency per dimension
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rotary_angles(cfg, head_dim: int, positions: int) -> tuple[torch.Tensor, float]:
    """``([positions, head_dim // 2] angles in float64, cos/sin scale)`` of the config's RoPE."""
    p = rope_parameters(cfg)
    kind, theta = p["rope_type"], p["rope_theta"]
    t = torch.arange(positions, dtype=torch.float64)
    scale = 1.0
    if kind == "dynamic":
        max_pos, factor = cfg.max_position_embeddings, p["factor"]
        seq_len = torch.clamp(t + 1, min=max_pos)  # the length transformers recomputes for, decoding position t
        base = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
        exps = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return t[:, None] / base[:, None] ** exps[None, :], scale
    inv_freq = _base_inv_freq(theta, head_dim)
    if kind == "linear":
        inv_freq = inv_freq / p["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, p)
    elif kind == "yarn":
        inv_freq, scale = _yarn(theta, head_dim, p, cfg.max_position_embeddings)
    return torch.outer(t, inv_freq), scale
