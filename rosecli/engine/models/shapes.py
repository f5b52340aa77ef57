"""Named model shapes for ``--load-format dummy``: the config.json numbers of the published models.

Written from the models' public config.json files (sizes, heads, vocabulary, RoPE, tying, context,
dtype, special ids); no weights and no download. The parameter counts of the models built from
them equal the published ones (tests/test_dummy_shapes.py). ``mistral-7b`` is Mistral-7B-v0.1,
the one with a 4096-token sliding window (v0.3 has none, a 32768 vocabulary and theta 1e6).
"""

from __future__ import annotations

_LLAMA3 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
           "rope_theta": 500000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
           "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
           "attention_bias": False, "hidden_act": "silu"}
_QWEN = {"vocab_size": 151936, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
         "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "use_sliding_window": False,
         "sliding_window": 32768, "hidden_act": "silu"}
_QWEN25 = dict(_QWEN, model_type="qwen2", architectures=["Qwen2ForCausalLM"])
_QWEN3 = dict(_QWEN, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=128,
              max_position_embeddings=40960, attention_bias=False)


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


NAMED_SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_scaling=_llama3_rope(32.0)),
    "llama-3.2-3b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         rope_scaling=_llama3_rope(32.0)),
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                         rope_scaling=_llama3_rope(8.0)),
    "qwen2.5-0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         max_window_layers=21),
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                         max_window_layers=21),
    "qwen2.5-7b": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, vocab_size=152064,
                       max_window_layers=28),
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True, max_window_layers=28),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, max_window_layers=36),
    "mistral-7b": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 32000,
                   "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 10000.0,
                   "max_position_embeddings": 32768, "sliding_window": 4096, "rms_norm_eps": 1e-5,
                   "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
                   "hidden_act": "silu"},
}
