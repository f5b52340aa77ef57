"""Convert a Llama-architecture GGUF file into a Hugging Face model directory.

Weights are dequantized (Q4_x/Q8_0/F16/...) with the `gguf` package and stored as float32
safetensors, so every later start is a plain safetensors load. Why float32 and not bfloat16:
a dequantized Q4_1 weight is ``d * q + m`` with float16 ``d`` and ``m``, which bfloat16's 8-bit
mantissa cannot hold, so a bfloat16 cache would round every weight a second time and a float32
run would no longer match llama.cpp or transformers' GGUF loader: measured on SmolLM2-135M,
float32 logits differ from transformers' by 1.6e-6 (relative norm) with a float32 cache and by
6e-3 with a bfloat16 one (tests/test_loader.py checks the former). The cost is disk (540 MB instead of 270 MB for
SmolLM2-135M); the model is cast to the run's dtype while loading either way. llama.cpp stores the Q and K
projections with rows permuted for its RoPE layout; they are permuted back here. The
tokenizer (with its chat template) is built by transformers from the same file. The result is
written to a temporary directory and renamed into place, so an interrupted conversion never
leaves a half-written cache.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from rosecli.engine import cache_files
from rosecli.engine.errors import ModelLoadError

CONVERTER_VERSION = 2  # 2: the marker lists each file's size and checksum
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


def _corrupt(path: str, e: Exception, fix: str) -> ModelLoadError:
    return ModelLoadError(f"cannot read GGUF file {path} ({type(e).__name__}: {e}): the file is corrupt or "
                          f"incomplete; {fix}")


def read_gguf(path: str, fix: str = "download it again or pass another --model"):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # truncated or not a GGUF file
        raise _corrupt(path, e, fix) from None


def _float32_repr(x) -> float:
    """1e-05 rather than 9.999999747378752e-06 for a float32 field."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def convert_gguf(path: str, out_dir: Path, progress: Optional[Callable[[str, int, int], None]] = None,
                 fix: str = "download it again or pass another --model") -> Path:
    """Convert ``path`` into ``out_dir`` (replaced atomically). ``fix`` ends corrupt-file errors.

    ``progress(stage, done, total)`` is called with stage "convert"; the tokenizer, about a third
    of the time, counts as a third of the steps.
    """
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    if progress:
        progress("convert", 0, 1)
    reader = read_gguf(path, fix)
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
        "rms_norm_eps": _float32_repr(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_repr(_field(reader, p + "rope.freq_base", 10000.0)),
        "vocab_size": vocab, "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": None if bos is None else int(bos), "eos_token_id": None if eos is None else int(eos),
        "hidden_act": "silu", "torch_dtype": "float32", "attention_bias": False,
    }
    out_dir = Path(out_dir)
    try:
        with cache_files.writing_dir(out_dir) as tmp:
            tensors = {}
            n = len(reader.tensors)
            tok_steps = max(1, n // 2)
            total = n + tok_steps + 1
            for i, t in enumerate(reader.tensors):
                try:
                    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
                except Exception as e:
                    raise _corrupt(path, e, fix) from None
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
                    progress("convert", i + 1, total)
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            del tensors
            (tmp / "config.json").write_text(json.dumps(config, indent=1))
            if progress:
                progress("convert", n + 1, total)
            try:
                tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                    gguf_file=os.path.basename(path))
            except Exception as e:
                first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise ModelLoadError(f"cannot build a tokenizer from {path} ({type(e).__name__}: {first_line}): the "
                                     "GGUF file's tokenizer is missing or of a kind transformers cannot convert; "
                                     f"{fix}") from None
            tok.save_pretrained(str(tmp))
            (tmp / "generation_config.json").write_text(json.dumps(
                {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))
            st = os.stat(path)
            files = cache_files.manifest(tmp, sorted(f.name for f in tmp.iterdir()))
            (tmp / MARKER).write_text(json.dumps({"converter_version": CONVERTER_VERSION,
                                                  "source": os.path.abspath(path), "size": st.st_size,
                                                  "mtime": int(st.st_mtime), "files": files}))
            if progress:
                progress("convert", total, total)
    except OSError:
        if not is_converted(out_dir, path):  # else another process finished the same conversion first
            raise
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


def check_converted(out_dir: Path) -> None:
    """Raise a `ModelLoadError` naming the damage if a converted cache's files are not as written
    (cut short, changed, missing); a directory we did not convert is left alone."""
    marker = Path(out_dir) / MARKER
    if not marker.is_file():
        return
    try:
        wrong = cache_files.first_mismatch(out_dir, json.loads(marker.read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        wrong = f"{MARKER} cannot be read ({type(e).__name__})"
    if wrong:
        raise ModelLoadError(f"the converted model cache {out_dir} is corrupt: {wrong}. Delete that directory; "
                             "the next start converts the model again")
