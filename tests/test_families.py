"""Model families against transformers on tiny random configs (CPU, float32): Llama 3.x RoPE
scalings past the original context, Qwen3 dense, Mistral's sliding window (torch paths and the
Triton kernels under TRITON_INTERPRET=1), and the refusals of configs we cannot run."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,  # noqa: E402
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from engine_utils import hf_greedy, our_model, tiny_scheduler  # noqa: E402
from rosecli.engine.attention import AttentionMetadata  # noqa: E402
from rosecli.engine.config import SamplingParams  # noqa: E402
from rosecli.engine.errors import ModelLoadError  # noqa: E402
from rosecli.engine.kv_cache import allocate_kv_cache  # noqa: E402
from rosecli.engine.models.config import model_config  # noqa: E402
from rosecli.engine.models.rope import context_length  # noqa: E402
from rosecli.kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from rosecli.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402

VOCAB = 256
TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)


def _hf(cls, cfg_cls, seed=0, **kw):
    torch.manual_seed(seed)
    return cls(cfg_cls(**{**TINY, **kw})).eval()


def _ids(n, seed=4):
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _prefill_logits(model, ids, block_size=4, use_triton=False):
    n = len(ids)
    blocks = -(-n // block_size) + 1
    allocate_kv_cache(model, blocks, block_size, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n),
                             block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                             context_lens=torch.tensor([n], dtype=torch.int32), max_context_len=n,
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), max_seqlen_q=n,
                             use_triton=use_triton)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta))


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _hf_stepwise_logits(hf, ids):
    """transformers decoding one token at a time with its cache (what `generate` does past the prompt)."""
    from transformers import DynamicCache

    cache, rows = DynamicCache(config=hf.config), []
    with torch.no_grad():
        for i, t in enumerate(ids):
            out = hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True, position_ids=torch.tensor([[i]]))
            rows.append(out.logits[0, -1])
    return torch.stack(rows)


ROPE_CASES = {
    # Llama 3.1's scaling with a small original context: positions 32..99 lie past it
    "llama3": (LlamaForCausalLM, LlamaConfig,
               dict(max_position_embeddings=128, rope_parameters={
                   "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "linear": (LlamaForCausalLM, LlamaConfig,
               dict(max_position_embeddings=64, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                 "factor": 2.0})),
    # Qwen2.5's long-context setting, scaled down: 4x past a 32-token original context
    "yarn": (Qwen2ForCausalLM, Qwen2Config,
             dict(max_position_embeddings=32, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                               "factor": 4.0,
                                                               "original_max_position_embeddings": 32})),
}


@pytest.mark.parametrize("kind", sorted(ROPE_CASES))
def test_rope_scaled_logits_match_transformers_past_the_original_context(kind):
    cls, cfg_cls, kw = ROPE_CASES[kind]
    hf = _hf(cls, cfg_cls, seed=3, **kw)
    ours = our_model(hf)
    ids = _ids(100)
    assert _rel(_prefill_logits(ours, ids), _hf_logits(hf, ids)) < 1e-4


def test_dynamic_ntk_matches_transformers_decoding_token_by_token():
    hf = _hf(LlamaForCausalLM, LlamaConfig, seed=5, max_position_embeddings=24,
             rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    ours = our_model(hf)
    ids = _ids(32)  # 8 positions past max_position_embeddings, each with its own grown base
    assert _rel(_prefill_logits(ours, ids), _hf_stepwise_logits(hf, ids)) < 1e-4


def test_scaled_context_lengths():
    base = dict(TINY, model_type="llama", max_position_embeddings=4096)
    assert context_length(model_config(base)) == 4096
    linear = dict(base, rope_scaling={"type": "linear", "factor": 4.0})  # the older config.json key
    assert context_length(model_config(linear)) == 16384
    yarn = dict(base, model_type="qwen2", max_position_embeddings=32768,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert context_length(model_config(yarn)) == 131072
    llama3 = dict(base, max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    assert context_length(model_config(llama3)) == 131072


def _qwen3(seed=3):
    return _hf(Qwen3ForCausalLM, Qwen3Config, seed=seed, head_dim=32, max_position_embeddings=256,
               tie_word_embeddings=True)


def test_qwen3_logits_match_transformers():
    hf = _qwen3()
    with torch.no_grad():  # norms of 1 would hide a missing q/k norm
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    ours = our_model(hf)
    ids = _ids(33)
    assert _rel(_prefill_logits(ours, ids), _hf_logits(hf, ids)) < 1e-4


def test_qwen3_greedy_continuations_match_transformers():
    hf = _qwen3(seed=6)
    prompts = [_ids(n, seed=n) for n in (3, 17)]
    sched = tiny_scheduler(hf, block_size=4, prefill_max_tokens=24)
    outs = sched.run_to_completion(prompts, SamplingParams(max_new_tokens=8, stop_on_eos=False))
    assert [s.output_token_ids for s in outs] == [hf_greedy(hf, p, 8) for p in prompts]


WINDOW = 8


def _mistral(seed=3):
    return _hf(MistralForCausalLM, MistralConfig, seed=seed, sliding_window=WINDOW, max_position_embeddings=256)


@pytest.mark.parametrize("use_triton", [False, True])
def test_mistral_prefill_past_the_sliding_window_matches_transformers(use_triton):
    hf = _mistral()
    ours = our_model(hf)
    ids = _ids(29)  # 3.6 windows
    ref = _hf_logits(hf, ids)
    assert _rel(_prefill_logits(ours, ids, use_triton=use_triton), ref) < 1e-4
    # a full-attention model would differ: the window is really applied
    for layer in ours.layers:
        layer.attn.sliding_window = None
    assert _rel(_prefill_logits(ours, ids), ref) > 1e-3


def test_mistral_greedy_continuations_past_the_window_match_transformers():
    """Prefill (fresh and with a cached prefix: chunks of 12 tokens) and torch decode, far past the window."""
    hf = _mistral(seed=7)
    prompts = [_ids(n, seed=n) for n in (5, 30)]
    sched = tiny_scheduler(hf, block_size=4, prefill_max_tokens=12)
    outs = sched.run_to_completion(prompts, SamplingParams(max_new_tokens=20, stop_on_eos=False))
    assert [s.output_token_ids for s in outs] == [hf_greedy(hf, p, 20) for p in prompts]


def test_mistral_paged_decode_kernel_step_matches_transformers():
    """One decode step through the Triton kernel (interpreted on CPU) at context 26, window 8."""
    hf = _mistral(seed=8)
    ours = our_model(hf)
    ids = _ids(26)
    block_size, n = 4, 25
    _prefill_logits(ours, ids[:n], block_size=block_size)  # fills blocks 0..7 with the first 25 tokens
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([n]),
                             block_tables=torch.arange(8, dtype=torch.int32)[None],
                             context_lens=torch.tensor([n + 1], dtype=torch.int32), max_context_len=n + 1,
                             use_triton=True)
    with torch.no_grad():
        out = ours.compute_logits(ours(torch.tensor(ids[n:]), torch.tensor([n]), meta))[0]
    assert _rel(out, _hf_logits(hf, ids)[-1]) < 1e-4


def _paged(lens, kv_heads, head_dim, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // block_size) for n in lens]
    total = sum(nblk) + 2
    k = torch.randn(total, kv_heads, block_size, head_dim, generator=g)
    v = torch.randn(total, kv_heads, block_size, head_dim, generator=g)
    perm = torch.randperm(total, generator=g)
    tables = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    pos = 0
    for i, nb in enumerate(nblk):
        tables[i, :nb] = perm[pos:pos + nb].int()
        pos += nb
    return k, v, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("window", [1, 5, 40, 1000])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_kernel_sliding_window(window, splits):
    lens = [1, 7, 37, 100]
    k, v, tables, ctx = _paged(lens, 2, 32, 4, seed=window)
    q = torch.randn(len(lens), 6, 32, generator=torch.Generator().manual_seed(1))
    ref = paged_decode_attention_ref(q, k, v, tables, ctx, 0.2, max(lens), window)
    out = paged_decode_attention(q, k, v, tables, ctx, 0.2, max(lens), window=window, splits=splits, tile=8)
    assert _rel(out, ref) < 1e-5
    if window < max(lens):  # the reference really masks
        assert _rel(paged_decode_attention_ref(q, k, v, tables, ctx, 0.2, max(lens)), ref) > 1e-3


@pytest.mark.parametrize("window", [3, 16])
def test_paged_prefill_kernel_sliding_window(window):
    new, lens = [5, 20, 1], [9, 45, 30]  # new tokens after cached prefixes of 4, 25 and 29
    k, v, tables, ctx = _paged(lens, 2, 32, 4, seed=window)
    cu = torch.tensor([0, 5, 25, 26], dtype=torch.int32)
    q = torch.randn(26, 6, 32, generator=torch.Generator().manual_seed(2))
    ref = paged_prefill_attention_ref(q, k, v, tables, cu, ctx, max(new), max(lens), 0.2, window)
    out = paged_prefill_attention(q, k, v, tables, cu, ctx, max(new), max(lens), 0.2, window=window,
                                  block_m=8, block_n=8)
    assert _rel(out, ref) < 1e-5


# ---- refusals --------------------------------------------------------------------------------

def test_unknown_architecture_is_refused_naming_it_and_the_supported_list():
    with pytest.raises(ModelLoadError) as e:
        model_config({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]})
    msg = str(e.value)
    assert "Qwen3MoeForCausalLM" in msg and "'qwen3_moe'" in msg
    assert all(k in msg for k in ("llama", "mistral", "qwen2", "qwen3"))


def test_unknown_rope_type_is_refused_naming_it_and_the_supported_list():
    cfg = model_config(dict(TINY, model_type="llama", rope_scaling={"rope_type": "longrope", "factor": 2.0}))
    from rosecli.engine.models import model_class

    with pytest.raises(ModelLoadError) as e:
        model_class(cfg)(cfg)
    msg = str(e.value)
    assert "'longrope'" in msg and all(k in msg for k in ("llama3", "linear", "dynamic", "yarn"))


@pytest.mark.parametrize("change,named", [
    (dict(hidden_size=60, num_attention_heads=8), "hidden_size 60"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads 3"),
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(head_dim=15), "head_dim"),
])
def test_config_whose_sizes_do_not_divide_is_refused(change, named):
    with pytest.raises(ModelLoadError) as e:
        model_config(dict(TINY, model_type="qwen2", **change))
    assert named in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [100, 4096])
def test_sliding_window_kernels_at_mistral_shape_on_the_gpu(dtype, window):
    """head_dim 128, 32 heads on 8 kv heads, contexts past the window, against the float32 references."""
    lens = [1, 500, 3000, 5000]
    k, v, tables, ctx = (t.cuda() for t in _paged(lens, 8, 128, 16, seed=window))
    k, v = k.to(dtype), v.to(dtype)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(lens), 32, 128, generator=g).cuda().to(dtype)
    scale = 128 ** -0.5
    ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, ctx, scale, max(lens), window)
    for bound in (max(lens), 32768):  # the real bound, and a CUDA graph's (the model's maximum)
        out = paged_decode_attention(q, k, v, tables, ctx, scale, bound, window=window)
        assert _rel(out.float(), ref) < 2e-2
    new = [1, 200, 700, 64]
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32).cuda()
    qp = torch.randn(sum(new), 32, 128, generator=g).cuda().to(dtype)
    ref = paged_prefill_attention_ref(qp.float(), k.float(), v.float(), tables, cu, ctx, max(new), max(lens), scale,
                                      window)
    out = paged_prefill_attention(qp, k, v, tables, cu, ctx, max(new), max(lens), scale, window=window)
    assert _rel(out.float(), ref) < 2e-2


@pytest.mark.parametrize("name,scaling", [
    ("llama-3.1-8b", None), ("llama-3.2-1b", None),
    ("qwen2.5-7b", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),  # its README's
    ("qwen3-8b", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    ("mistral-7b", {"type": "linear", "factor": 2.0}),
])
def test_rope_of_published_configs_matches_transformers(name, scaling):
    """The real configs' frequencies (theta 5e5/1e6, factors 8/32, YaRN 4x) against transformers' own."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from rosecli.engine.models.rope import rotary_angles
    from rosecli.engine.models.shapes import NAMED_SHAPES

    raw = dict(NAMED_SHAPES[name])
    if scaling:
        raw["rope_scaling"] = scaling
    ours_cfg = model_config(raw)
    kind = raw.pop("model_type")
    for key in ("architectures", "torch_dtype"):
        raw.pop(key)
    hf_cfg = AutoConfig.for_model(kind, **raw)
    rope_type = hf_cfg.rope_parameters["rope_type"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    if rope_type == "default":
        inv_freq = 1.0 / (hf_cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        factor = 1.0
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, torch.device("cpu"))
    positions = context_length(ours_cfg)
    angles, scale = rotary_angles(ours_cfg, head_dim, positions)
    assert scale == pytest.approx(factor)
    assert positions == {"llama-3.1-8b": 131072, "llama-3.2-1b": 131072, "qwen2.5-7b": 131072, "qwen3-8b": 131072,
                         "mistral-7b": 65536}[name]
    p = positions - 1
    assert torch.allclose(angles[p] / p, inv_freq.double(), rtol=1e-6, atol=0)
