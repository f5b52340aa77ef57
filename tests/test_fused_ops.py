"""Fused residual-add + norm and activation kernels against their torch references (CPU under
TRITON_INTERPRET, and on the GPU), and whole models on CUDA (which use them) against Hugging Face."""

import pytest
import torch

from engine_utils import rel_err
from rosecli.kernels.activation import bias_gelu, bias_gelu_ref, silu_mul, silu_mul_ref
from rosecli.kernels.norm import add_norm, add_norm_ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows,dim", [(1, 64), (5, 96), (3, 768), (2, 576)])
def test_add_norm_matches_reference(device, dtype, tol, rows, dim):
    g = torch.Generator().manual_seed(rows * dim)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 2).to(device, dtype)

    x, residual, w, b, xb = rand(rows, dim), rand(rows, dim), rand(dim), rand(dim), rand(dim)
    for rms in (False, True):
        for res in (None, residual):
            for x_bias in (None, xb):
                normed, total = add_norm(x, res, w, None if rms else b, 1e-5, x_bias, rms)
                want_normed, want_total = add_norm_ref(x, res, w, None if rms else b, 1e-5, x_bias, rms)
                assert normed.dtype == dtype and total.shape == (rows, dim)
                assert rel_err(total, want_total) < tol and rel_err(normed, want_normed) < 4 * tol, (rms, res is None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("rows,width", [(1, 3072), (7, 100), (4, 1536)])
def test_activations_match_reference(device, dtype, tol, rows, width):
    g = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=g) * 3).to(device, dtype)
    bias = torch.randn(width, generator=g).to(device, dtype)
    assert rel_err(bias_gelu(x, bias), bias_gelu_ref(x, bias)) < tol
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 3).to(device, dtype)
    out = silu_mul(gate_up)
    assert out.shape == (rows, width) and rel_err(out, silu_mul_ref(gate_up)) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "qwen3", "mistral"])
def test_fused_model_on_cuda_matches_hugging_face(kind):
    """A whole forward with the fused kernels (as CUDA-graph decode runs them) against Hugging Face."""
    from engine_utils import our_model, tiny_hf_model
    from rosecli.engine.attention import AttentionMetadata

    hf = tiny_hf_model(kind, seed=4) if kind == "gpt2" else _tiny_family(kind, seed=4)
    model = our_model(hf).cuda()
    n = 23
    ids = torch.randint(2, 250, (n,), generator=torch.Generator().manual_seed(1))
    for attn in model.attention_layers():
        attn.k_cache = torch.zeros(4, attn.num_kv_heads, 16, attn.head_dim, device="cuda")
        attn.v_cache = torch.zeros_like(attn.k_cache)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n, device="cuda"),
                             block_tables=torch.arange(2, dtype=torch.int32, device="cuda")[None],
                             context_lens=torch.tensor([n], dtype=torch.int32, device="cuda"), max_context_len=n,
                             use_triton=True, fused_ops=True,
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device="cuda"), max_seqlen_q=n)
    with torch.inference_mode():
        ours = model.compute_logits(model(ids.cuda(), torch.arange(n, device="cuda"), meta)).cpu()
        want = hf(ids[None]).logits[0].float()
    assert rel_err(ours, want) < 1e-3


# ---- rotary + KV store (one kernel per Llama-family layer) -----------------------------------------------

def _rotary_case(tokens, heads, kv_heads, head_dim, dtype, qk_norm, block_size=4, seed=0, device="cpu"):
    """`rotary_kv`'s arguments, and the two caches with a guard block in front of them (where a padding
    row's slot -1 would land if it were stored)."""
    from rosecli.engine.models.common import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(tokens, width, generator=g) * 2).to(device, dtype)
    rot = RotaryEmbedding(head_dim, 64, base=500.0).to(device)
    positions = torch.randint(0, 64, (tokens,), generator=g).to(device)
    nblk = 2 + tokens // block_size
    slots = torch.randperm(nblk * block_size, generator=g)[:tokens]
    slots[1::3] = -1  # padding rows: stored nowhere
    guarded = [torch.randn(1 + nblk, kv_heads, block_size, head_dim, generator=g).to(device, dtype) for _ in "kv"]
    norms = [(1 + torch.randn(head_dim, generator=g) / 4).to(device, dtype) for _ in "qk"] + [1e-6] if qk_norm else []
    args = (qkv, positions, rot.cos, rot.sin, guarded[0][1:], guarded[1][1:], slots.to(device), heads, kv_heads,
            *norms)
    return args, guarded


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,qk_norm", [
    (5, 6, 2, 64, False),  # GQA, head_dim 64
    (4, 2, 2, 128, False),  # MHA, head_dim 128
    (3, 4, 1, 128, True),  # Qwen3: per-head q/k RMSNorm first
    (2, 3, 3, 64, True),
])
def test_rotary_kv_matches_rotation_and_store(device, dtype, tokens, heads, kv_heads, head_dim, qk_norm):
    """The fused kernel (interpreted on CPU) against `apply_rotary` + `store_kv_cache_ref`: q and k rotated
    in place in the projection's output, k and v in the cache at their slots, nothing stored for padding."""
    from rosecli.kernels.rotary import rotary_kv, rotary_kv_ref

    case, guarded = _rotary_case(tokens, heads, kv_heads, head_dim, dtype, qk_norm, seed=tokens * head_dim,
                                 device=device)
    qkv = case[0]
    want = [t.clone() for t in (qkv, *guarded)]
    rotary_kv_ref(want[0], *case[1:4], want[1][1:], want[2][1:], *case[6:])
    before = [t.clone() for t in (qkv, *guarded)]
    rotary_kv(*case)
    for got, ref, old in zip((qkv, *guarded), want, before):
        if dtype == torch.bfloat16 and qk_norm:
            # the norm's value is rounded to bfloat16 before the rotation: a last-bit difference in its
            # float32 statistics moves it one bfloat16 step (and the interpreter truncates to bfloat16
            # where the GPU rounds to nearest), which the rotation's cancellations magnify elementwise
            assert rel_err(got, ref) < 1e-2
        else:
            torch.testing.assert_close(got, ref)
        assert not torch.equal(got, old)  # the step really changed it (rotated / stored)
    # nothing but the real rows' slots changed: padding rows (slot -1) stored nowhere, not even in the guard
    slots = case[6].cpu()
    untouched = torch.ones(guarded[0].shape[0] * guarded[0].shape[2], dtype=torch.bool)
    untouched[slots[slots >= 0] + guarded[0].shape[2]] = False  # slot s is row s + block_size of the guarded cache
    for got, old in zip(guarded, before[1:]):
        rows = [c.cpu().transpose(1, 2).reshape(-1, kv_heads, head_dim)[untouched] for c in (got, old)]
        assert torch.equal(*rows)


@pytest.mark.parametrize("group", [1, 2, 4, 16])
@pytest.mark.parametrize("heads,kv_heads,qk_norm", [(6, 3, False), (5, 1, True)])
def test_rotary_kv_any_heads_per_program(group, heads, kv_heads, qk_norm):
    """Every grouping of heads into programs (`launch_table.rotary_launch`'s choice), including groups that hold
    q and k heads both, end past the last head, or hold one head, rotates and stores as the reference does."""
    from rosecli.kernels.rotary import rotary_kv, rotary_kv_ref

    case, guarded = _rotary_case(3, heads, kv_heads, 64, torch.float32, qk_norm, seed=group)
    want = [t.clone() for t in (case[0], *guarded)]
    rotary_kv_ref(want[0], *case[1:4], want[1][1:], want[2][1:], *case[6:])
    rotary_kv(*case, group=group)
    for got, ref in zip((case[0], *guarded), want):
        torch.testing.assert_close(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,qk_norm", [
    (64, 9, 3, 64, False),  # SmolLM2-135M, decode B=64
    (1, 32, 8, 64, False),  # Llama-3.2-1B, B=1
    (300, 32, 8, 128, False),  # Llama-3-8B, a prefill chunk
    (64, 16, 8, 128, True),  # Qwen3-0.6B-like
])
def test_rotary_kv_gpu_realistic_shapes(dtype, tokens, heads, kv_heads, head_dim, qk_norm):
    from rosecli.kernels.rotary import rotary_kv, rotary_kv_ref

    case, guarded = _rotary_case(tokens, heads, kv_heads, head_dim, dtype, qk_norm, block_size=16, seed=tokens,
                                 device="cuda")
    want = [t.clone() for t in (case[0], *guarded)]
    rotary_kv_ref(want[0], *case[1:4], want[1][1:], want[2][1:], *case[6:])
    rotary_kv(*case)
    for got, ref in zip((case[0], *guarded), want):
        if qk_norm:  # the norm's float32 sums add up in another order
            assert rel_err(got, ref) < 1e-2
        else:  # the same float32 operations, rounded the same way (no fused multiply-add)
            assert torch.equal(got, ref)


def test_rotary_kv_refuses_a_projection_of_another_width():
    from rosecli.kernels.rotary import rotary_kv

    case = list(_rotary_case(2, 4, 2, 64, torch.float32, False)[0])
    case[0] = case[0][:, :-64]
    with pytest.raises(ValueError, match="is not \\[tokens"):
        rotary_kv(*case)


def _tiny_family(kind, seed=11):
    """A tiny transformers model of the family: Llama (GQA), Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm,
    head_dim 32), Mistral (sliding window 6)."""
    import transformers as tf

    from engine_utils import tiny_hf_model

    if kind in ("llama", "qwen2"):
        return tiny_hf_model(kind, seed=seed)
    torch.manual_seed(seed)
    tiny = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    if kind == "qwen3":
        hf = tf.Qwen3ForCausalLM(tf.Qwen3Config(**tiny, head_dim=32)).eval()
        with torch.no_grad():  # norms of 1 would hide a q/k norm the fused kernel skipped
            for layer in hf.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
        return hf
    return tf.MistralForCausalLM(tf.MistralConfig(**tiny, sliding_window=6)).eval()


def _paths_scheduler(hf, **paths):
    """A CPU engine (scheduler + runner, block size 4) whose config turns on the given CUDA execution paths:
    ``paged_attn`` runs the Triton kernels (interpreted), ``cuda_graph`` the fused decode ops (no graph is
    captured on CPU, so decode runs them eagerly)."""
    import dataclasses

    from engine_utils import our_model
    from rosecli.engine.config import EngineConfig
    from rosecli.engine.runner import ModelRunner
    from rosecli.engine.scheduler import Scheduler

    config = dataclasses.replace(EngineConfig(device="cpu", block_size=4).resolved("cpu"), **paths)
    max_len = hf.config.max_position_embeddings
    runner = ModelRunner(config, our_model(hf), max_len, torch.device("cpu"), torch.float32)
    return Scheduler(config, runner, [1], max_len)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_llama_family_greedy_output_unchanged_by_the_fused_rotary(kind, monkeypatch):
    """Greedy continuations through the engine with CUDA-graph decode's paths forced on are the same with
    the rotary + KV store kernel on and off, and the same as transformers'."""
    from engine_utils import hf_greedy
    from rosecli.engine.config import SamplingParams
    from rosecli.engine.models import llama

    hf = _tiny_family(kind)
    prompts = [torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 6)]
    params = SamplingParams(max_new_tokens=4, stop_on_eos=False)
    want = [hf_greedy(hf, p, 4) for p in prompts]
    for on in (True, False):
        with monkeypatch.context() as m:
            m.setattr(llama, "fused_rotary", lambda meta: on)
            sched = _paths_scheduler(hf, paged_attn=True, cuda_graph=True)
            assert [s.output_token_ids for s in sched.run_to_completion(prompts, params)] == want, on


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_decode_steps_gather_their_ids_and_embeddings_in_one_kernel_and_stay_greedy(kind, monkeypatch):
    """With CUDA-graph decode's paths and the overlap schedule on (interpreted), each decode step takes its rows'
    ids from the token pool and their embeddings (GPT-2: and positions') in `gather_embed`, the ids being those
    the argmax wrote into the pool the step before (the host has not read them yet): the continuations of a batch
    of three are transformers' greedy ones."""
    from engine_utils import hf_greedy, tiny_hf_model
    from rosecli.engine import runner
    from rosecli.engine.config import SamplingParams
    from rosecli.kernels.embed import gather_embed

    hf = tiny_hf_model(kind, seed=5)
    prompts = [torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 6, 4)]
    want = [hf_greedy(hf, p, 5) for p in prompts]
    calls = []

    def counted(*args):
        calls.append(args[1].shape[0])
        return gather_embed(*args)

    monkeypatch.setattr(runner, "gather_embed", counted)
    sched = _paths_scheduler(hf, paged_attn=True, cuda_graph=True, overlap_schedule=True)
    params = SamplingParams(max_new_tokens=5, stop_on_eos=False)
    assert [s.output_token_ids for s in sched.run_to_completion(prompts, params)] == want
    assert len(calls) >= 4 and max(calls) >= 2  # every decode step, some with several rows


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_llama_family_logits_and_cache_unchanged_by_the_fused_rotary(kind, monkeypatch):
    """A prefill of 7 tokens and a decode step (with a padding row) on the Triton paths: logits and every
    layer's K/V cache agree to float32 rounding with the rotary + KV store kernel on and off; and the
    off path (apply_rotary + store) is what the torch path computes."""
    from engine_utils import our_model
    from rosecli.engine.attention import AttentionMetadata
    from rosecli.engine.kv_cache import allocate_kv_cache
    from rosecli.engine.models import llama

    model = our_model(_tiny_family(kind))
    ids = torch.randint(2, 256, (8,), generator=torch.Generator().manual_seed(8))

    def run(on, use_triton=True):
        allocate_kv_cache(model, 4, 4, torch.float32, torch.device("cpu"))
        pre = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(7),
                                block_tables=torch.arange(2, dtype=torch.int32)[None],
                                context_lens=torch.tensor([7], dtype=torch.int32), max_context_len=7,
                                use_triton=use_triton, cu_seqlens_q=torch.tensor([0, 7], dtype=torch.int32),
                                max_seqlen_q=7)
        dec = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([7, -1]),  # a padding row
                                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                                context_lens=torch.tensor([8, 1], dtype=torch.int32), max_context_len=8,
                                use_triton=use_triton, fused_ops=use_triton)
        with monkeypatch.context() as m, torch.no_grad():
            m.setattr(llama, "fused_rotary", lambda meta: on)
            out = [model.compute_logits(model(ids[:7], torch.arange(7), pre)),
                   model.compute_logits(model(ids[7:].repeat(2), torch.tensor([7, 0]), dec))[:1]]
        return out + [t.clone() for a in model.attention_layers() for t in (a.k_cache, a.v_cache)]

    fused = run(True)
    for got, ref in zip(fused, run(False)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for got, ref in zip(fused, run(False, use_triton=False)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
