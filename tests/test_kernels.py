"""Each Triton kernel against its torch reference on random inputs (TRITON_INTERPRET=1 on CPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from rosecli.kernels.paged_decode import decode_launch, paged_decode_attention, paged_decode_attention_ref  # noqa
from rosecli.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402
from rosecli.kernels.store_kv import store_kv_cache, store_kv_cache_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _paged(lens, kv_heads, head_dim, block_size, dtype, seed, spare=3):
    """Random caches and shuffled (non-contiguous) block tables for sequences of ``lens`` tokens."""
    g = torch.Generator().manual_seed(seed)
    nblk = [max(1, -(-n // block_size)) for n in lens]
    total = sum(nblk) + spare
    k_cache = torch.randn(total, block_size, kv_heads, head_dim, generator=g).to(DEV, dtype)
    v_cache = torch.randn(total, block_size, kv_heads, head_dim, generator=g).to(DEV, dtype)
    perm = torch.randperm(total, generator=g)
    width = max(nblk) + 2
    tables = torch.full((len(lens), width), -7, dtype=torch.int32)  # junk past each sequence's blocks
    pos = 0
    for i, nb in enumerate(nblk):
        tables[i, :nb] = perm[pos:pos + nb].int()
        pos += nb
    return k_cache, v_cache, tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEV == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("lens,block_size", [([1, 5, 16, 17, 33], 16), ([8, 7, 9, 1], 8), ([130], 16)])
def test_paged_decode_matches_reference(dtype, heads, kv_heads, lens, block_size):
    head_dim = 32
    k_cache, v_cache, tables, ctx = _paged(lens, kv_heads, head_dim, block_size, dtype, seed=len(lens) + heads)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    scale = head_dim ** -0.5
    ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, ctx, scale, max(lens))
    for use_dot in (False, True):  # both inner products: vector (MHA default) and tensor cores (GQA default)
        out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, max(lens), use_dot=use_dot)
        assert not torch.isnan(out).any()
        assert _rel(out, ref) < TOL[dtype] * (3 if use_dot and dtype == torch.float32 else 1)  # tf32 on GPU


def test_paged_decode_split_path_and_loose_bound():
    """A few long sequences: several splits, merged; the bound (as under a CUDA graph) exceeds every length."""
    lens = [300, 7, 129]
    k_cache, v_cache, tables, ctx = _paged(lens, 2, 32, 16, torch.float32, seed=5)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(2)).to(DEV)
    bound = 1024
    assert decode_launch(3, 2, bound, 16)[0] > 1
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.2, max(lens))
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, bound)
    assert _rel(out, ref) < TOL[torch.float32]


def test_paged_decode_padding_row_with_zero_context():
    k_cache, v_cache, tables, ctx = _paged([5, 3], 2, 32, 16, torch.float32, seed=6)
    ctx[1] = 0
    q = torch.randn(2, 2, 32).to(DEV)
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, 16)
    ref = paged_decode_attention_ref(q[:1], k_cache, v_cache, tables[:1], ctx[:1], 0.2, 5)
    assert torch.isfinite(out).all() and _rel(out[:1], ref) < 2e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_matches_reference_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(3)
    n, kv_heads, head_dim = 11, 3, 16
    qkv = torch.randn(n, 5 * kv_heads * head_dim, generator=g).to(DEV, dtype)  # strided views, as the models pass
    key = qkv[:, kv_heads * head_dim * 3:kv_heads * head_dim * 4].view(n, kv_heads, head_dim)
    value = qkv[:, kv_heads * head_dim * 4:].view(n, kv_heads, head_dim)
    slots = torch.randperm(40, generator=g)[:n].to(DEV)
    slots[3] = -1
    caches = [torch.randn(5, 8, kv_heads, head_dim, generator=g).to(DEV, dtype) for _ in range(2)]
    ref = [c.clone() for c in caches]
    store_kv_cache(key, value, caches[0], caches[1], slots)
    store_kv_cache_ref(key, value, ref[0], ref[1], slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("new,prefix", [([5, 17, 1], [0, 0, 0]), ([3, 20, 16], [16, 5, 33]), ([70], [0])])
def test_prefill_matches_reference(dtype, heads, kv_heads, new, prefix):
    head_dim, block_size = 32, 16
    lens = [n + p for n, p in zip(new, prefix)]
    k_cache, v_cache, tables, ctx = _paged(lens, kv_heads, head_dim, block_size, dtype, seed=sum(lens))
    total = sum(new)
    q = torch.randn(total, heads, head_dim, generator=torch.Generator().manual_seed(4)).to(DEV, dtype)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(new), 0)), dtype=torch.int32, device=DEV)
    ref = paged_prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, cu, ctx, max(new),
                                      max(lens), head_dim ** -0.5)
    out = torch.full_like(q, float("nan"))
    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, max(new), max(lens), head_dim ** -0.5)
    assert not torch.isnan(out).any()
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,context", [(1, 4000), (64, 1024), (7, 333)])
def test_decode_gpu_realistic_shapes(batch, context):
    lens = [max(1, context - 13 * i) for i in range(batch)]
    for heads, kv_heads in ((12, 12), (9, 3)):
        k_cache, v_cache, tables, ctx = _paged(lens, kv_heads, 64, 16, torch.float16, seed=batch)
        q = torch.randn(batch, heads, 64, device=DEV, dtype=torch.float16)
        ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, ctx, 0.125, context)
        out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, 8192)
        assert _rel(out, ref) < 1e-2
