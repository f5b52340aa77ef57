"""Model loading: dummy shapes, local Hugging Face directories, GGUF conversion, and the errors
a user sees when a model cannot be found or read."""

import json
import os
import shutil

import pytest
import torch

from engine_utils import VOCAB, tiny_hf_model
from rosecli.engine import loader
from rosecli.engine.config import EngineConfig
from rosecli.engine.errors import ConfigError, ModelLoadError
from rosecli.engine.loader import load_model, resolve_hf_config
from test_models import _prefill_logits

CPU = torch.device("cpu")


def _config(cache_dir, model, **kw):
    kw.setdefault("cpu_weights", "float")  # the weights as loaded (tests/test_cpu_fast_path.py covers the rest)
    return EngineConfig(model=model, cache_dir=cache_dir, show_progress=False, **kw)


def _load(cache_dir, model, dtype=torch.float32, **kw):
    return load_model(_config(cache_dir, model, **kw), CPU, dtype)


def _dummy(cache_dir, model, seed=0, dtype=torch.float32, **kw):
    return _load(cache_dir, model, dtype, load_format="dummy", seed=seed, **kw)


def _state(loaded):
    return {k: v.clone() for k, v in loaded.model.state_dict().items()}


# ---- dummy weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_dummy_weights_are_seeded(cache_dir, name):
    a, b, c = _dummy(cache_dir, name, 7), _dummy(cache_dir, name, 7), _dummy(cache_dir, name, 8)
    sa, sb, sc = _state(a), _state(b), _state(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa if sa[k].dim() == 2)
    weights = [v for k, v in sa.items() if v.dim() == 2]
    std = torch.cat([w.flatten() for w in weights]).std().item()
    assert abs(std - 0.02) < 0.002
    assert a.source == "dummy (seed 7)" and a.max_model_len == 512 and not a.is_instruct


@pytest.mark.parametrize("name, params, layers, context", [("gpt2", 124_439_808, 12, 1024),
                                                           ("smollm2-135m", 134_515_008, 30, 8192)])
def test_dummy_full_size_shapes(cache_dir, name, params, layers, context):
    loaded = _dummy(cache_dir, name)
    assert sum(p.numel() for p in loaded.model.parameters()) == params
    assert loaded.model.num_layers == layers and loaded.max_model_len == context


def test_dummy_builds_in_the_requested_dtype(cache_dir):
    loaded = _dummy(cache_dir, "tiny-llama", dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.rotary.cos.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32


def test_dummy_gpt2_ids_past_the_tokenizer_decode_to_nothing(cache_dir):
    loaded = _dummy(cache_dir, "tiny-llama")
    tok = loaded.tokenizer
    assert loaded.eos_token_ids == [2]
    assert len(tok) == 49152
    ids = tok.encode("Hello world")
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids + [50256, 49152]) == "Hello world"  # gpt2 dummy's logits reach 50,256


def test_max_model_len(cache_dir):
    assert _dummy(cache_dir, "tiny-llama", max_model_len=100).max_model_len == 100
    with pytest.raises(ConfigError, match="larger than tiny-llama's context"):
        _dummy(cache_dir, "tiny-llama", max_model_len=513)


# ---- local Hugging Face directories -------------------------------------------------------------


def _save_hf_dir(hf_model, path, cache_dir, bin_weights=False):
    if bin_weights:
        path.mkdir(parents=True)
        hf_model.config.save_pretrained(str(path))
        torch.save(hf_model.state_dict(), str(path / "pytorch_model.bin"))
    else:
        hf_model.save_pretrained(str(path))
    loader.dummy_tokenizer(EngineConfig(cache_dir=cache_dir)).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_local_hf_directory_matches_transformers(cache_dir, tmp_path, kind):
    hf = tiny_hf_model(kind, seed=11)
    path = _save_hf_dir(hf, tmp_path / f"tiny-{kind}", cache_dir)
    loaded = _load(cache_dir, str(path))
    assert (loaded.name, loaded.source) == (f"tiny-{kind}", str(path))
    assert loaded.is_instruct and 1 in loaded.eos_token_ids and loaded.max_model_len == 256
    ids = torch.randint(0, VOCAB, (17,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    out = _prefill_logits(loaded.model, ids)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-4


def test_local_directory_with_pytorch_bin(cache_dir, tmp_path):
    hf = tiny_hf_model("llama", seed=12)
    path = _save_hf_dir(hf, tmp_path / "bin-llama", cache_dir, bin_weights=True)
    loaded = _load(cache_dir, str(path), dtype=torch.bfloat16)
    ours = loaded.model.embed_tokens.weight
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, hf.model.embed_tokens.weight.to(torch.bfloat16))
    assert resolve_hf_config(_config(cache_dir, str(path))).num_hidden_layers == 2


# ---- errors a user can fix ---------------------------------------------------------------------


def _load_error(cache_dir, model, **kw):
    with pytest.raises(ModelLoadError) as e:
        _load(cache_dir, model, **kw)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_unknown_name(cache_dir):
    message = _load_error(cache_dir, "no-such-model")
    assert "unknown model 'no-such-model'" in message and "gpt2" in message and "smollm2-135m" in message


def test_dummy_only_name_without_dummy_format(cache_dir):
    assert "--load-format dummy" in _load_error(cache_dir, "gpt2")


def test_unknown_dummy_shape(cache_dir):
    assert "tiny-llama" in _load_error(cache_dir, "llama-7b", load_format="dummy")


def test_missing_directory(cache_dir, tmp_path):
    assert "does not exist" in _load_error(cache_dir, str(tmp_path / "nowhere"))


def test_directory_without_config(cache_dir, tmp_path):
    assert "no config.json" in _load_error(cache_dir, str(tmp_path))


def test_directory_without_weights(cache_dir, tmp_path):
    hf = tiny_hf_model("llama")
    hf.config.save_pretrained(str(tmp_path))
    assert "no weight files" in _load_error(cache_dir, str(tmp_path))


def test_corrupt_safetensors(cache_dir, tmp_path):
    path = _save_hf_dir(tiny_hf_model("llama"), tmp_path / "m", cache_dir)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    message = _load_error(cache_dir, str(path))
    assert "model.safetensors" in message and "corrupt or incomplete" in message


def test_unsupported_architecture(cache_dir, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "'bert' is not supported" in _load_error(cache_dir, str(tmp_path))


def test_hub_id_offline(cache_dir, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)  # the same answer with or without a network
    message = _load_error(cache_dir, "some-org/some-model")
    assert "hub is not reachable" in message and "local" in message


def test_hub_id_without_huggingface_hub(cache_dir, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "huggingface_hub", None)
    message = _load_error(cache_dir, "some-org/some-model")
    assert "hub cannot be reached" in message and "local directory" in message


@pytest.mark.parametrize("keep", [0.9, 0.001])
def test_truncated_gguf(cache_dir, tmp_path, smollm2_gguf_path, keep):
    size = os.path.getsize(smollm2_gguf_path)
    with open(smollm2_gguf_path, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(int(size * keep)))
    message = _load_error(cache_dir, str(tmp_path / "cut.gguf"))
    assert "cut.gguf" in message and "corrupt or incomplete" in message
    models = os.path.join(cache_dir, "models")
    assert not [d for d in (os.listdir(models) if os.path.isdir(models) else []) if d.startswith("gguf-cut")]


# ---- GGUF conversion ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(cache_dir):
    return _load(cache_dir, "smollm2-135m")


@pytest.mark.slow
def test_converted_smollm2_matches_transformers_gguf_loader(smollm2, smollm2_transformers_gguf):
    """Our GGUF conversion + forward against transformers' own GGUF loading of the same file (the
    one comparison of the two; every other default-model test builds on it)."""
    tok = smollm2.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        ref = smollm2_transformers_gguf(torch.tensor([ids])).logits[0]
    out = _prefill_logits(smollm2.model, ids)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-4
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_converted_smollm2_cache_layout(smollm2, cache_dir):
    path = os.path.join(cache_dir, "models", "smollm2-135m")
    assert smollm2.source == path and smollm2.name == "smollm2-135m"
    assert smollm2.is_instruct and smollm2.eos_token_ids == [2] and smollm2.max_model_len == 8192
    config = json.loads(open(os.path.join(path, "config.json")).read())
    assert config["tie_word_embeddings"] and config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    assert sorted(os.listdir(os.path.join(cache_dir, "models"))) == ["smollm2-135m"]  # no temp dirs left


@pytest.mark.slow
def test_second_start_loads_from_the_cache(smollm2, cache_dir, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "convert_gguf", fail)
    again = _load(cache_dir, "smollm2-135m")
    assert torch.equal(again.model.embed_tokens.weight, smollm2.model.embed_tokens.weight)


@pytest.mark.slow
def test_gguf_path_interrupted_conversion_leaves_no_cache(tmp_path, smollm2_gguf_path, monkeypatch):
    import gguf

    cache = str(tmp_path / "cache")
    calls = []

    def interrupted(data, qtype):
        calls.append(1)
        if len(calls) == 50:
            raise KeyboardInterrupt
        return real(data, qtype)

    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _load(cache, smollm2_gguf_path)
    assert os.listdir(os.path.join(cache, "models")) == []


@pytest.mark.slow
def test_gguf_path_converts_like_the_default(smollm2, tmp_path, smollm2_gguf_path):
    link = tmp_path / "my-model.gguf"
    shutil.copyfile(smollm2_gguf_path, link)
    cache = str(tmp_path / "cache")
    loaded = _load(cache, str(link))
    assert loaded.name == "my-model" and loaded.source.startswith(os.path.join(cache, "models", "gguf-my-model-"))
    ours, ref = loaded.model.state_dict(), smollm2.model.state_dict()
    assert all(torch.equal(ours[k], ref[k]) for k in ref)


def test_prepared_cpu_weights_are_cached_checked_and_never_used_damaged(cache_dir, tmp_path, monkeypatch):
    """--cpu-weights other than float: prepared once, loaded from the cache after (same logits, nothing
    re-prepared); a cached file changed on disk is named in an error and not loaded."""
    from rosecli.engine import cpu_cache
    from rosecli.engine.models import quant

    path = _save_hf_dir(tiny_hf_model("llama"), tmp_path / "m", cache_dir)
    first = _load(cache_dir, str(path), cpu_weights="float16")
    ids = [5, 9, 200, 7, 31]
    ref = _prefill_logits(first.model, ids)
    monkeypatch.setattr(quant, "prepare_cpu_weights", lambda *a: pytest.fail("prepared again"))
    again = _load(cache_dir, str(path), cpu_weights="float16")
    assert isinstance(again.model.layers[0].qkv_proj, quant.Float16Linear)
    assert torch.equal(_prefill_logits(again.model, ids), ref)
    key = cpu_cache.cache_key([path / "model.safetensors"], "float16")
    weights = loader.cache_root(_config(cache_dir, str(path))) / "cpu-weights" / key / cpu_cache.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    weights.write_bytes(bytes(data))
    message = _load_error(cache_dir, str(path), cpu_weights="float16")
    assert str(weights.parent) in message and "checksum mismatch" in message and "Delete that directory" in message
    weights.write_bytes(bytes(data[:100]))
    assert "bytes" in _load_error(cache_dir, str(path), cpu_weights="float16")


def test_converted_cache_damage_is_named(tmp_path):
    """A converted GGUF cache lists its files' sizes and checksums; a changed one is refused by name."""
    from rosecli.engine import cache_files
    from rosecli.engine.gguf_convert import MARKER, check_converted

    (tmp_path / "model.safetensors").write_bytes(b"weights" * 1000)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / MARKER).write_text(json.dumps({"files": cache_files.manifest(tmp_path, ["model.safetensors",
                                                                                      "config.json"])}))
    check_converted(tmp_path)  # as written: no error
    (tmp_path / "model.safetensors").write_bytes(b"weightz" * 1000)
    with pytest.raises(ModelLoadError, match=r"converted model cache .* is corrupt: model.safetensors has changed"):
        check_converted(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"weights" * 1000)
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        check_converted(tmp_path)
