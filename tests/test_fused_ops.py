"""Fused residual-add + norm and activation kernels against their torch references (CPU under
TRITON_INTERPRET, and on the GPU), and whole models on CUDA (which use them) against Hugging Face."""

import pytest
import torch

from rosecli.kernels.activation import bias_gelu, bias_gelu_ref, silu_mul, silu_mul_ref
from rosecli.kernels.norm import add_norm, add_norm_ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


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
                assert _rel(total, want_total) < tol and _rel(normed, want_normed) < 4 * tol, (rms, res is None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("rows,width", [(1, 3072), (7, 100), (4, 1536)])
def test_activations_match_reference(device, dtype, tol, rows, width):
    g = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=g) * 3).to(device, dtype)
    bias = torch.randn(width, generator=g).to(device, dtype)
    assert _rel(bias_gelu(x, bias), bias_gelu_ref(x, bias)) < tol
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 3).to(device, dtype)
    out = silu_mul(gate_up)
    assert out.shape == (rows, width) and _rel(out, silu_mul_ref(gate_up)) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_fused_model_on_cuda_matches_hugging_face(kind):
    """A whole forward with the fused kernels (as CUDA-graph decode runs them) against Hugging Face."""
    from engine_utils import our_model, tiny_hf_model
    from rosecli.engine.attention import AttentionMetadata

    hf = tiny_hf_model(kind, seed=4)
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
    assert _rel(ours, want) < 1e-3
