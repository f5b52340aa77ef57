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
_DEFAULTS["mistral"] = dict(_DEFAULTS["llama"], max_position_embeddings=32768, rms_norm_eps=1e-6)
_DEFAULTS["qwen2"] = dict(_DEFAULTS["llama"], rope_theta=1000000.0, max_position_embeddings=32768,
                          attention_bias=True)


def model_config(raw: dict) -> SimpleNamespace:
    kind = raw.get("model_type")
    if kind not in _DEFAULTS:
        raise ModelLoadError(f"model type {kind!r} is not supported; supported: {', '.join(sorted(_DEFAULTS))}")
    cfg = SimpleNamespace(**{**_DEFAULTS[kind], **raw})
    if kind != "gpt2" and cfg.num_key_value_heads is None:
        cfg.num_key_value_heads = cfg.num_attention_heads
    return cfg
