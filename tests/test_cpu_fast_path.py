"""The CPU fast paths against their references: each --cpu-weights representation against the
float model, the per-step attention plan against the per-layer torch references, and the
rewritten norm and rotary against the formulas they replace. (The real default model's
agreement bars are in tests/test_default_model.py.)"""

import copy

import pytest
import torch
import torch.nn.functional as F

from engine_utils import VOCAB, our_model, tiny_hf_model
from rosecli.engine.attention import Attention, AttentionMetadata, with_decode_gather
from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.errors import ConfigError
from rosecli.engine.kv_cache import allocate_kv_cache
from rosecli.engine.models.common import RMSNorm, RotaryEmbedding, apply_rotary
from rosecli.engine.models.quant import (Float16Linear, Int4Linear, Int8Linear, int4_groups, int4_is_exact,
                                         int4_linear_supported, int8_linear_supported, prepare_cpu_weights)
from rosecli.engine.runner import ModelRunner
from rosecli.engine.scheduler import Scheduler
from rosecli.kernels.paged_decode import paged_decode_attention_ref
from rosecli.kernels.store_kv import store_kv_cache_ref

KINDS = ["llama", "gpt2", "qwen2"]
needs_int8 = pytest.mark.skipif(not int8_linear_supported(), reason="torch has no _weight_int8pack_mm")
needs_int4 = pytest.mark.skipif(not int4_linear_supported(), reason="torch has no int4 CPU matmul")
# relative Frobenius error of the logits against float, per representation, on random tiny models
# (int4 quantizes these float weights to 16 levels per group: lossy here, exact on a Q4 GGUF)
LOGITS_TOL = {"int8": 2e-2, "int4": 0.12, "float16": 2e-3, "auto": 2e-3}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _prefill_logits(model, ids):
    n = len(ids)
    allocate_kv_cache(model, 64, 4, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n),
                             block_tables=torch.arange(64, dtype=torch.int32)[None],
                             context_lens=torch.tensor([n], dtype=torch.int32), max_context_len=n,
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), max_seqlen_q=n)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta))


def _greedy(model, prompts, n=24):
    config = EngineConfig(device="cpu", block_size=4).resolved("cpu")
    runner = ModelRunner(config, model, 256, torch.device("cpu"), torch.float32)
    sched = Scheduler(config, runner, [1], 256)
    return [s.output_token_ids for s in sched.run_to_completion(prompts, SamplingParams(max_new_tokens=n,
                                                                                        stop_on_eos=False))]


@needs_int8
@needs_int4
@pytest.mark.parametrize("cpu_weights", ["int8", "int4", "float16", "auto"])
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_weights_logits_close_to_float(kind, cpu_weights):
    ref_model = our_model(tiny_hf_model(kind, seed=11))
    model = prepare_cpu_weights(copy.deepcopy(ref_model), cpu_weights)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    head = {"int8": Int8Linear}.get(cpu_weights, Float16Linear)
    assert isinstance(model.lm_head, head)
    ids = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(12)).tolist()
    ref, out = _prefill_logits(ref_model, ids), _prefill_logits(model, ids)
    assert out.dtype == torch.float32
    assert _rel(out, ref) < LOGITS_TOL[cpu_weights]


@needs_int8
@needs_int4
@pytest.mark.parametrize("cpu_weights", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_quantized_greedy_tokens_mostly_agree_with_float(kind, cpu_weights):
    ref_model = our_model(tiny_hf_model(kind, seed=13))
    model = prepare_cpu_weights(copy.deepcopy(ref_model), cpu_weights)
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 7, 12, 20, 31, 5, 9, 16)]
    ref, out = _greedy(ref_model, prompts), _greedy(model, prompts)
    first = sum(a[0] == b[0] for a, b in zip(out, ref))
    same = sum(x == y for a, b in zip(out, ref) for x, y in zip(a, b))
    assert first >= len(prompts) - 1  # a near-tie may flip one
    assert same >= 0.6 * sum(len(r) for r in ref)  # after a flip a continuation diverges


@needs_int8
def test_int8_linear_matches_dequantized_weights():
    g = torch.Generator().manual_seed(15)
    lin = torch.nn.Linear(96, 40)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(40, generator=g))
    q = Int8Linear(lin.weight, lin.bias)
    x = torch.randn(5, 96, generator=g)
    deq = q.weight.float() * q.scales.float()[:, None]
    assert (deq - lin.weight).abs().max() <= q.scales.float().max() / 2 + 1e-6  # rounding only
    ref = F.linear(x.bfloat16().float(), deq) + lin.bias
    assert _rel(q(x), ref) < 1e-2  # bfloat16 accumulation and output rounding
    assert _rel(q(x), lin(x)) < 2e-2


def _q4_1_weight(out_f, in_f, seed):
    """A weight as llama.cpp's Q4_1 stores and dequantizes it: per block of 32, float16 ``d`` and ``m``
    from the block's min and max, codes 0..15, ``w = d * q + m``."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(out_f, in_f // 32, 32, generator=g) * 0.05)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = ((hi - lo) / 15)
    q = torch.clamp(((x - lo) / d + 0.5).floor(), 0, 15)
    return (q * d.half().float() + lo.half().float()).reshape(out_f, in_f)


@needs_int4
def test_int4_reads_q4_1_weights_back_exactly():
    w = _q4_1_weight(40, 96, 20)
    assert int4_is_exact(w)
    q, d, lo = int4_groups(w)
    assert torch.equal((q.view(40, 3, 32).float() * d[..., None] + lo[..., None]).view(40, 96), w)
    assert not int4_is_exact(w + 1e-4 * torch.randn(40, 96, generator=torch.Generator().manual_seed(21)))
    assert not int4_is_exact(torch.randn(8, 48))  # width not a multiple of the group


@needs_int4
def test_int4_linear_is_the_dequantized_matmul_in_bfloat16():
    """The kernel's only roundings: bfloat16 activations, scales/offsets and output."""
    w = _q4_1_weight(64, 128, 22)
    g = torch.Generator().manual_seed(23)
    bias = torch.randn(64, generator=g)
    lin = Int4Linear(w, bias)
    x = torch.randn(5, 128, generator=g)
    ref = F.linear(x, w) + bias
    assert _rel(lin(x), ref) < 1e-2
    assert _rel(lin(x), F.linear(x.bfloat16().float(), w) + bias) < 6e-3


def test_float16_linear_rounds_weights_once():
    g = torch.Generator().manual_seed(24)
    w, bias, x = torch.randn(48, 80, generator=g) * 0.05, torch.randn(48, generator=g), torch.randn(3, 80, generator=g)
    lin = Float16Linear(w, bias)
    assert lin.weight.dtype == torch.float16 and lin(x).dtype == torch.float32
    assert _rel(lin(x), F.linear(x, w) + bias) < 2e-3


@needs_int4
def test_auto_reads_4bit_mlp_layers_as_int4_and_the_rest_as_float16():
    model = our_model(tiny_hf_model("llama", seed=25))
    layer = model.layers[0]
    with torch.no_grad():
        for lin in (layer.gate_up_proj, layer.qkv_proj, layer.down_proj):
            lin.weight.copy_(_q4_1_weight(*lin.weight.shape, 26))
    prepare_cpu_weights(model, "auto", blocks=False)  # without rose's own kernels (test_native_blocks.py: with)
    assert isinstance(model.layers[0].gate_up_proj, Int4Linear)
    assert isinstance(model.layers[0].qkv_proj, Float16Linear)  # 4-bit, but an attention projection
    assert isinstance(model.layers[0].down_proj, Float16Linear)  # 4-bit, but its input is widest
    assert isinstance(model.layers[1].gate_up_proj, Float16Linear)  # random float weights: not 4-bit
    assert isinstance(model.lm_head, Float16Linear)


def _engine_tokens(tiny_engine_factory, cpu_weights):
    engine = tiny_engine_factory("tiny-llama", cpu_weights=cpu_weights, seed=3)
    prompts = [[5, 6, 7, 8], list(range(20, 45))]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=16, stop_on_eos=False))
    return engine, [out.token_ids for out in outs], prompts


def test_cpu_weights_float_is_the_loaded_model_unchanged(tiny_engine_factory):
    engine, tokens, prompts = _engine_tokens(tiny_engine_factory, "float")
    assert not any(isinstance(m, (Int8Linear, Int4Linear, Float16Linear)) for m in engine.loaded.model.modules())
    # the same weights driven without the engine: bit-identical logits give identical tokens
    model = copy.deepcopy(engine.loaded.model)
    assert _greedy(model, prompts, 16) == tokens


@needs_int4
def test_cpu_weights_auto_is_the_default_on_cpu(tiny_engine_factory):
    assert EngineConfig().cpu_weights == "auto"
    engine, _, _ = _engine_tokens(tiny_engine_factory, "auto")
    # random dummy weights are not 4-bit: every layer float16
    assert isinstance(engine.loaded.model.lm_head, Float16Linear)
    assert not any(type(m) is torch.nn.Linear for m in engine.loaded.model.modules())


def test_cpu_weights_and_threads_are_validated():
    with pytest.raises(ConfigError, match="--cpu-weights must be one of auto, blocks, int4, float16, int8, float"):
        EngineConfig(cpu_weights="int2")
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ConfigError, match="--threads must be an integer between 1 and 1024"):
            EngineConfig(threads=bad)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("pad", [0, 2])
def test_decode_plan_matches_references(heads, kv_heads, pad):
    """with_decode_gather + Attention's torch decode path == store_kv_cache_ref + paged_decode_attention_ref,
    ragged lengths, GQA, blocks out of order, padding rows (negative slots) as a captured graph has."""
    g = torch.Generator().manual_seed(16)
    head_dim, block_size, num_blocks = 16, 4, 40
    lens = [1, 6, 13, 4]
    batch = len(lens) + pad
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(batch, 8, dtype=torch.int32)
    slots, start = [], 0
    for i, n in enumerate(lens):
        blocks = perm[start:start + -(-n // block_size)]
        start += len(blocks)
        tables[i, :len(blocks)] = torch.tensor(blocks)
        slots.append(blocks[(n - 1) // block_size] * block_size + (n - 1) % block_size)
    slots += [-1] * pad
    ctx = torch.tensor(lens + [1] * pad, dtype=torch.int32)
    q = torch.randn(batch, heads * head_dim, generator=g)
    k = torch.randn(batch, kv_heads * head_dim, generator=g)
    v = torch.randn(batch, kv_heads * head_dim, generator=g)
    caches = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, generator=g)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor(slots), block_tables=tables,
                             context_lens=ctx, max_context_len=max(lens))
    attn = Attention(heads, kv_heads, head_dim, head_dim ** -0.5)
    attn.k_cache, attn.v_cache = caches[0].clone(), caches[1].clone()
    out = attn(q, k, v, with_decode_gather(meta, block_size, kv_heads, torch.float32))
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    store_kv_cache_ref(k.view(batch, kv_heads, head_dim), v.view(batch, kv_heads, head_dim), ref_k, ref_v,
                       meta.slot_mapping)
    assert torch.equal(attn.k_cache, ref_k) and torch.equal(attn.v_cache, ref_v)
    ref = paged_decode_attention_ref(q.view(batch, heads, head_dim), ref_k, ref_v, tables, ctx, head_dim ** -0.5,
                                     max(lens))
    n = len(lens)
    assert torch.allclose(out.view(batch, heads, head_dim)[:n], ref[:n], atol=1e-5, rtol=1e-5)


def test_store_ref_skips_padding_rows_without_host_sync():
    g = torch.Generator().manual_seed(17)
    key = torch.randn(3, 2, 8, generator=g)
    cache = torch.randn(2, 5, 2, 4, 8, generator=g)  # [K/V, blocks, kv_heads, block_size, head_dim]
    for slots in ([-1, -1, -1], [0, -1, 7], [-1, 0, -1]):
        k_cache, v_cache = cache[0].clone(), cache[1].clone()
        store_kv_cache_ref(key, key * 2, k_cache, v_cache, torch.tensor(slots))
        want_k, want_v = cache[0].clone(), cache[1].clone()
        for row, s in enumerate(slots):
            if s >= 0:
                want_k[s // 4, :, s % 4], want_v[s // 4, :, s % 4] = key[row], key[row] * 2
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_rms_norm_float32_path_is_the_formula_bit_for_bit():
    g = torch.Generator().manual_seed(18)
    for d in (64, 576, 1000):
        norm = RMSNorm(d, 1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(d, generator=g))
        x = torch.randn(7, d, generator=g) * 3
        ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
        assert torch.equal(norm(x), ref)


def test_rotary_is_the_rotate_half_formula_bit_for_bit():
    g = torch.Generator().manual_seed(19)
    head_dim = 64
    rope = RotaryEmbedding(head_dim, 128, 100000.0)
    positions = torch.tensor([0, 5, 77, 127])
    x = torch.randn(4, 3, head_dim, generator=g)
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(positions.double(), inv_freq)
    cos, sin = freqs.cos().float().unsqueeze(1), freqs.sin().float().unsqueeze(1)
    x1, x2 = x[..., :head_dim // 2], x[..., head_dim // 2:]
    ref = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    assert torch.equal(apply_rotary(x, *rope.tables(positions)), ref)
