"""Model configs as plain attribute namespaces read from config.json.

Our models read a handful of attributes; importing transformers' config classes for them
costs about two seconds of start-up, so missing keys get the same defaults here instead.
"""

from __future__ import annotations

from types import SimpleNamespace

from rosecli.engine.errors import ModelLoadError

_DEFAULTS = {
    "gpt2": {"n_inner": None, "layer_norm_epsilon": 1e-5, "n_positions": 1024, "vocab_size": 50257,
             "n_embd": 768, "n_head": 12, "n_layer": 12, "eos_token_id": 50256, "tie_word_embeddings": True},
    "llama": {"num_key_value_heads": None, "head_dim": None, "rope_theta": 10000.0, "rope_scaling": None,
              "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": False,
              "max_position_embeddings": 2048, "eos_token_id": None},
}
# transformers' defaults for keys a config.json may leave out (Mistral's window: 4096, as its config class says)
_DEFAULTS["mistral"] = dict(_DEFAULTS["llama"], max_position_embeddings=32768, rms_norm_eps=1e-6,
                            sliding_window=4096)
_DEFAULTS["qwen2"] = dict(_DEFAULTS["llama"], rope_theta=1000000.0, max_position_embeddings=32768,
                          attention_bias=True, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                          layer_types=None)
_DEFAULTS["qwen3"] = dict(_DEFAULTS["qwen2"], attention_bias=False, head_dim=128, rope_theta=10000.0)


def model_config(raw: dict) -> SimpleNamespace:
    kind = raw.get("model_type")
    if kind not in _DEFAULTS:
        arch = ", ".join(raw.get("architectures") or []) or "unnamed"
        raise ModelLoadError(f"model type {kind!r} is not supported (architecture {arch}); supported model types: "
                             f"{', '.join(sorted(_DEFAULTS))} (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 dense, "
                             "GPT-2, SmolLM2)")
    cfg = SimpleNamespace(**{**_DEFAULTS[kind], **raw})
    if kind != "gpt2" and cfg.num_key_value_heads is None:
        cfg.num_key_value_heads = cfg.num_attention_heads
    check_sizes(cfg)
    return cfg


def check_sizes(cfg) -> None:
    """Refuse a config whose attention sizes do not divide (heads into the width, kv heads into the heads)."""
    if cfg.model_type == "gpt2":
        sizes = {"n_embd": cfg.n_embd, "n_head": cfg.n_head, "n_layer": cfg.n_layer, "vocab_size": cfg.vocab_size}
    else:
        sizes = {k: getattr(cfg, k, None) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                      "num_hidden_layers", "intermediate_size", "vocab_size")}
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelLoadError(f"the model's config has {key} = {value!r}: it must be a positive integer")
    if cfg.model_type == "gpt2":
        if cfg.n_embd % cfg.n_head:
            raise ModelLoadError(f"the model's config does not divide: n_embd {cfg.n_embd} is not a multiple of "
                                 f"n_head {cfg.n_head}")
        return
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is None and cfg.hidden_size % heads:
        raise ModelLoadError(f"the model's config does not divide: hidden_size {cfg.hidden_size} is not a multiple "
                             f"of num_attention_heads {heads} (and no head_dim is given)")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2):
        raise ModelLoadError(f"the model's config has head_dim = {head_dim!r}: it must be an even positive integer")
    if heads % kv_heads:
        raise ModelLoadError(f"the model's config does not divide: num_attention_heads {heads} is not a multiple "
                             f"of num_key_value_heads {kv_heads}")
