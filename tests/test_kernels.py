"""Each Triton kernel against its torch reference on random inputs (TRITON_INTERPRET=1 on CPU).

Outputs are poisoned with NaN before each call, so an element the kernel forgets to write fails.
The CPU interpreter covers float32 and float16 (its tl.dot mishandles bfloat16); bfloat16 and the
larger shapes run in the `gpu` tests.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from rosecli.kernels import launch_table  # noqa: E402
from rosecli.kernels.paged_decode import (decode_launch, gather_kv, paged_decode_attention,  # noqa: E402
                                          paged_decode_attention_ref, paged_kv_read_floor)
from rosecli.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402
from rosecli.kernels.store_kv import store_kv_cache, store_kv_cache_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # relative Frobenius error vs fp32 reference


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _paged(lens, kv_heads, head_dim, block_size, dtype, seed, spare=3):
    """Random caches and shuffled (non-contiguous) block tables for sequences of ``lens`` tokens."""
    g = torch.Generator().manual_seed(seed)
    nblk = [max(1, -(-n // block_size)) for n in lens]
    total = sum(nblk) + spare
    k_cache = torch.randn(total, kv_heads, block_size, head_dim, generator=g).to(DEV, dtype)
    v_cache = torch.randn(total, kv_heads, block_size, head_dim, generator=g).to(DEV, dtype)
    perm = torch.randperm(total, generator=g)
    tables = torch.full((len(lens), max(nblk) + 2), -7, dtype=torch.int32)  # junk past each sequence's blocks
    pos = 0
    for i, nb in enumerate(nblk):
        tables[i, :nb] = perm[pos:pos + nb].int()
        pos += nb
    return k_cache, v_cache, tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


def _splits(batch, kv_heads, bound, block_size=16):
    """The split count the table gives a decode launch (GQA group 3, head_dim 64)."""
    return decode_launch(batch, 3 * kv_heads, kv_heads, 64, block_size, bound)["splits"]


def _decode_case(lens, heads, kv_heads, head_dim, block_size, dtype, seed, bound=None, **launch):
    k_cache, v_cache, tables, ctx = _paged(lens, kv_heads, head_dim, block_size, dtype, seed)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(DEV, dtype)
    scale = head_dim ** -0.5
    live = ctx > 0  # the reference has no notion of an empty row
    ref = paged_decode_attention_ref(q[live].float(), k_cache.float(), v_cache.float(), tables[live], ctx[live],
                                     scale, max(lens))
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, bound or max(lens), out=out, **launch)
    assert res is out and torch.isfinite(out).all(), "every output element is written"
    return out[live], ref


# block_size 16: single token, block boundaries k*16-1, k*16, k*16+1, several blocks; block_size 8 and 1 too
RAGGED = [([1, 15, 16, 17, 47, 48, 49], 16), ([8, 7, 9, 1, 24], 8), ([5, 1, 3], 1)]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("lens,block_size", RAGGED)
def test_paged_decode_matches_reference(dtype, heads, kv_heads, lens, block_size):
    out, ref = _decode_case(lens, heads, kv_heads, 32, block_size, dtype, seed=len(lens) + heads)
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_paged_decode_both_inner_product_paths(use_dot, heads, kv_heads):
    """Vector path (the MHA default) and tensor-core path (the GQA default) on either head layout."""
    out, ref = _decode_case([33, 2, 16], heads, kv_heads, 32, 16, torch.float32, seed=7, use_dot=use_dot)
    assert _rel(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("splits", [2, 5])
def test_paged_decode_split_and_merge_over_many_blocks(splits):
    """A context spanning many blocks divided among splits (uneven, some splits empty) and merged."""
    out, ref = _decode_case([700, 3, 129], 9, 3, 32, 16, torch.float32, seed=11, splits=splits, tile=32)
    assert _rel(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("block_size", [1, 8, 32, 64])
def test_paged_decode_tile_narrower_than_a_block(block_size):
    """A launch's tile below the block size is widened to whole blocks (one block-table read per block)."""
    out, ref = _decode_case([1, 31, 32, 33, 100], 4, 2, 32, block_size, torch.float32, seed=block_size, splits=2,
                            tile=16)
    assert _rel(out, ref) < TOL[torch.float32]


def test_paged_decode_loose_bound_as_under_a_cuda_graph():
    """The bound (the model's maximum under a graph) far exceeds every length, and picks several splits."""
    bound = 2048
    assert _splits(4, 2, bound) > 1
    out, ref = _decode_case([300, 7, 64, 65], 4, 2, 32, 16, torch.float32, seed=5, bound=bound)
    assert _rel(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_padding_rows_with_zero_context(splits):
    out, ref = _decode_case([5, 0, 40, 0], 9, 3, 32, 16, torch.float32, seed=6, bound=64, splits=splits)
    assert _rel(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("launch,window", [
    (dict(splits=1, tile=64), None),  # GPT-2's B=64 row: one program per (sequence, kv head)
    (dict(splits=4, tile=16), None),  # the token in any split (lengths 1..200 land in each)
    (dict(splits=3, tile=32, head_major=False), 24),  # a sliding window: the splits count from its first tile
])
def test_decode_kernel_stores_this_steps_kv_as_the_store_kernel_does(dtype, launch, window):
    """`paged_decode_attention`'s ``store``: the decode kernel puts each sequence's new K and V into its slot before it
    reads (the program whose tiles hold that token), in place of `store_kv.store_kv_cache` before the call. The caches
    and the output are bit for bit those of the two kernels; a padding row (slot -1, context 0) stores nothing."""
    lens = [1, 16, 17, 40, 0, 97, 170, 200]  # (170: under the window, a wrong owner would store after the reader)
    kv_heads, heads, head_dim, bs = 2, 6, 32, 16
    k_cache, v_cache, tables, ctx = _paged(lens, kv_heads, head_dim, bs, dtype, seed=9, spare=4)
    g = torch.Generator().manual_seed(10)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=g).to(DEV, dtype)
    q = qkv[:, :heads * head_dim].view(-1, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(-1, kv_heads, head_dim)
    tab = tables.long().cpu()
    slots = torch.tensor([int(tab[i, (n - 1) // bs]) * bs + (n - 1) % bs if n else -1 for i, n in enumerate(lens)],
                         dtype=torch.int64, device=DEV)
    kc, vc = k_cache.clone(), v_cache.clone()
    store_kv_cache(k, v, kc, vc, slots)
    want = paged_decode_attention(q, kc, vc, tables, ctx, head_dim ** -0.5, 256, window=window, **launch)
    got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, head_dim ** -0.5, 256, window=window,
                                 store=(k, v, slots), **launch)
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
    assert torch.equal(got[ctx > 0], want[ctx > 0])
    ref = paged_decode_attention_ref(q[ctx > 0].float(), kc.float(), vc.float(), tables[ctx > 0], ctx[ctx > 0],
                                     head_dim ** -0.5, max(lens), window)
    assert _rel(got[ctx > 0], ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("launch", [dict(splits=1, tile=64), dict(splits=4, tile=16, head_major=False)])
def test_decode_kernel_rotates_and_stores_as_rotary_kv_does(dtype, launch):
    """`paged_decode_attention`'s ``rope``: given q and k unrotated, the decode kernel rotates q and the new k as
    `rotary.rotary_kv` does and stores k and v: the caches agree with that kernel's to one rounding (exactly under the
    interpreter, which does not contract the multiply-adds) and so does the output; a padding row stores nothing."""
    from rosecli.kernels.rotary import rotary_kv

    lens = [1, 17, 0, 64, 130]
    kv_heads, heads, head_dim, bs = 2, 6, 32, 16
    k_cache, v_cache, tables, ctx = _paged(lens, kv_heads, head_dim, bs, dtype, seed=11, spare=4)
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=g).to(DEV, dtype)
    angles = torch.rand(256, head_dim // 2, generator=g) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], 1).to(DEV)
    sin = torch.cat([-angles.sin(), angles.sin()], 1).to(DEV)
    positions = torch.tensor([max(n - 1, 0) for n in lens], device=DEV)
    tab = tables.long().cpu()
    slots = torch.tensor([int(tab[i, (n - 1) // bs]) * bs + (n - 1) % bs if n else -1 for i, n in enumerate(lens)],
                         dtype=torch.int64, device=DEV)
    split = [heads * head_dim, (heads + kv_heads) * head_dim]
    kc, vc, rotated = k_cache.clone(), v_cache.clone(), qkv.clone()
    rotary_kv(rotated, positions, cos, sin, kc, vc, slots, heads, kv_heads)
    want = paged_decode_attention(rotated[:, :split[0]].view(-1, heads, head_dim), kc, vc, tables, ctx,
                                  head_dim ** -0.5, 256, **launch)
    q = qkv[:, :split[0]].view(-1, heads, head_dim)
    k = qkv[:, split[0]:split[1]].view(-1, kv_heads, head_dim)
    v = qkv[:, split[1]:].view(-1, kv_heads, head_dim)
    got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, head_dim ** -0.5, 256, store=(k, v, slots),
                                 rope=(positions, cos, sin), **launch)
    ulp = 2 ** -10 if dtype == torch.float16 else 2 ** -22
    assert torch.equal(v_cache, vc)
    assert ((k_cache.float() - kc.float()).abs() <= ulp * kc.float().abs().clamp_min(1)).all()
    if DEV == "cpu":
        assert torch.equal(k_cache, kc) and torch.equal(got[ctx > 0], want[ctx > 0])
    assert _rel(got[ctx > 0], want[ctx > 0]) < TOL[dtype] / 4
    assert torch.equal(qkv[:, :split[0]], q.reshape(len(lens), -1))  # (q is read, not rotated in place)


# Launches the table or the sweep may pick: either grid order, more splits than a context has tiles,
# tiles longer than a context, one split; all on ragged lengths (an empty row, a single token, block
# and tile edges, many blocks).
LAUNCH_VARIANTS = [dict(head_major=True, splits=1, tile=16),
                   dict(head_major=True, splits=4, tile=32, num_warps=2),
                   dict(head_major=False, splits=7, tile=16),
                   dict(head_major=True, splits=3, tile=128, num_warps=8, num_stages=2)]


@pytest.mark.parametrize("launch", LAUNCH_VARIANTS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_paged_decode_launch_variants(launch, heads, kv_heads):
    out, ref = _decode_case([1, 16, 0, 33, 130, 257], heads, kv_heads, 32, 16, torch.float32, seed=heads, **launch)
    assert _rel(out, ref) < TOL[torch.float32]


def test_paged_decode_head_major_float16_with_splits():
    out, ref = _decode_case([200, 17, 64], 9, 3, 32, 16, torch.float16, seed=4, bound=1024, head_major=True)
    assert _rel(out, ref) < TOL[torch.float16]


@pytest.mark.parametrize("launch", LAUNCH_VARIANTS[:3])
def test_read_floor_reads_exactly_what_decode_reads(launch):
    """The benchmark's read floor touches each real K/V element of every sequence once (none past its length),
    with the decode launches' grids and splits."""
    lens = [1, 16, 0, 33, 130]
    k_cache, v_cache, tables, ctx = _paged(lens, 3, 32, 16, torch.float32, seed=9)
    sums = paged_kv_read_floor(k_cache, v_cache, tables, ctx, 9, max(lens), **launch).sum(-1)
    nblk = tables.shape[1]
    kv = gather_kv(k_cache, tables, nblk) + gather_kv(v_cache, tables, nblk)  # [B, kv, L, D]
    real = torch.arange(kv.shape[2], device=DEV)[None, :] < ctx[:, None]
    want = (kv * real[:, None, :, None]).sum((2, 3))
    torch.testing.assert_close(sums, want, rtol=1e-4, atol=1e-3)


def test_decode_split_table():
    assert _splits(1, 12, 4096) > _splits(64, 12, 4096) == 1
    assert _splits(1, 12, 10) == 1  # a short bound never asks for empty splits
    narrow = launch_table.DecodeLaunch(8, 16, 32, 2, 2, False, True)  # tiles widen to 128-token blocks
    assert launch_table.capped_splits(narrow, 256, block_size=128) == 2  # so 256 tokens make two splits, not 8
    assert all(_splits(b, 3, 8192) >= 1 for b in (1, 7, 64, 1000))


def test_decode_launch_gives_gqa_groups_of_four_more_warps_where_measured():
    """Llama's group of 4 at 32-64 rows (batch x kv heads 256-512) takes 4 warps; MHA and a group of 3 keep the row's
    2 (GPT-2 lost with 4), and rows of other tiles or splits are left as the table has them."""
    warps = lambda batch, heads, kv: decode_launch(batch, heads, kv, 64, 16, 2048)["num_warps"]  # noqa: E731
    assert warps(64, 32, 8) == warps(32, 32, 8) == warps(64, 28, 4) == 4
    assert warps(64, 12, 12) == warps(256, 9, 3) == 2
    assert warps(16, 32, 8) == launch_table.lookup(launch_table.DECODE, 16 * 8).num_warps
    assert warps(1, 32, 8) == launch_table.DECODE[0][1].num_warps


def test_decode_launch_table_rows_are_launchable():
    bounds = [bound for bound, _ in launch_table.DECODE]
    assert bounds == sorted(bounds) and bounds[-1] == float("inf")
    for _, row in launch_table.DECODE:
        assert row.splits >= 1 and row.min_split_tokens >= 1 and row.num_stages >= 1
        assert row.tile >= 16 and row.tile & (row.tile - 1) == 0 and row.num_warps in (1, 2, 4, 8, 16)
        assert launch_table.capped_splits(row, row.tile) == 1  # a bound of one tile is never split


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_matches_reference_and_skips_padding(dtype, slot_dtype):
    g = torch.Generator().manual_seed(3)
    n, kv_heads, head_dim = 11, 3, 16
    qkv = torch.randn(n, 5 * kv_heads * head_dim, generator=g).to(DEV, dtype)  # strided views, as the models pass
    key = qkv[:, kv_heads * head_dim * 3:kv_heads * head_dim * 4].view(n, kv_heads, head_dim)
    value = qkv[:, kv_heads * head_dim * 4:].view(n, kv_heads, head_dim)
    slots = torch.randperm(40, generator=g)[:n].to(DEV, slot_dtype)
    slots[3] = -1
    slots[7] = -5
    caches = [torch.randn(5, kv_heads, 8, head_dim, generator=g).to(DEV, dtype) for _ in range(2)]
    before = [c.clone() for c in caches]
    ref = [c.clone() for c in caches]
    store_kv_cache(key, value, caches[0], caches[1], slots)
    store_kv_cache_ref(key, value, ref[0], ref[1], slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])

    def by_slot(c):  # [slots, kv_heads, head_dim]: token-major, written out by hand from the layout
        return c.permute(0, 2, 1, 3).reshape(-1, kv_heads, head_dim)
    for cache, src in zip(caches, (key, value)):
        for i in range(n):
            if slots[i] >= 0:
                assert torch.equal(by_slot(cache)[slots[i].long()], src[i])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots[slots >= 0].long().cpu()] = False
    assert torch.equal(by_slot(caches[0])[untouched.to(DEV)], by_slot(before[0])[untouched.to(DEV)])


def test_store_rejects_a_cache_of_another_layout():
    key = torch.randn(2, 3, 16).to(DEV)
    token_major = torch.zeros(4, 8, 3, 16, device=DEV)  # [blocks, block_size, kv_heads, head_dim]: not ours
    for store in (store_kv_cache, store_kv_cache_ref):
        with pytest.raises(ValueError, match=r"not \[num_blocks, 3 kv heads, block_size, 16\]"):
            store(key, key, token_major, token_major, torch.tensor([0, 1], device=DEV))
    assert not token_major.any()  # nothing written


PREFILL_CASES = [
    ([5, 17, 1], [0, 0, 0]),  # fresh prompts, ragged, one single-token prompt
    ([3, 20, 16, 1], [16, 5, 33, 47]),  # prefix caching / chunked prefill: prefix ends mid-block and on a boundary
    ([0, 9], [12, 7]),  # a sequence with no new tokens this step
]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("new,prefix", PREFILL_CASES)
def test_prefill_matches_reference(dtype, heads, kv_heads, new, prefix):
    out, ref = _prefill_case(new, prefix, heads, kv_heads, 32, 16, dtype, seed=sum(new) + sum(prefix))
    assert _rel(out, ref) < TOL[dtype]


def test_prefill_long_chunk_spans_several_query_tiles():
    out, ref = _prefill_case([70, 2], [30, 0], 6, 2, 32, 8, torch.float32, seed=9, block_m=16, block_n=16)
    assert _rel(out, ref) < TOL[torch.float32]


def _prefill_case(new, prefix, heads, kv_heads, head_dim, block_size, dtype, seed, **launch):
    lens = [n + p for n, p in zip(new, prefix)]
    k_cache, v_cache, tables, ctx = _paged(lens, kv_heads, head_dim, block_size, dtype, seed)
    q = torch.randn(sum(new), heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(DEV, dtype)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    scale = head_dim ** -0.5
    ref = paged_prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, cu, ctx, max(new),
                                      max(lens), scale)
    out = torch.full_like(q, float("nan"))
    res = paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, max(new), max(lens), scale, out=out,
                                  **launch)
    assert res is out and torch.isfinite(out).all(), "every output element is written"
    return out, ref


GPU_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("batch,context,bound", [(1, 4000, 8192), (64, 1024, 1024), (7, 333, 8192), (256, 129, 1024)])
def test_decode_gpu_realistic_shapes(dtype, batch, context, bound):
    lens = [max(1, context - 13 * i) for i in range(batch)]
    for heads, kv_heads in ((12, 12), (9, 3), (16, 4)):  # (16, 4): `launch_table.decode_row`'s 4 warps at 64 rows
        out, ref = _decode_case(lens, heads, kv_heads, 64, 16, dtype, seed=batch, bound=bound)
        assert _rel(out, ref) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("launch", [dict(head_major=True, splits=8, min_split_tokens=64, tile=64, num_warps=4,
                                         num_stages=2),
                                    dict(head_major=False, splits=2, tile=256, num_warps=8, num_stages=2),
                                    dict(head_major=True, splits=1, tile=32, num_warps=2, num_stages=4),
                                    dict(splits=3, use_dot=False, tile=64, num_warps=4)])
def test_decode_gpu_launch_variants(launch):
    """Compiled launches the sweep may pick, on realistic fp16 shapes with ragged lengths."""
    lens = [max(1, 1500 - 97 * i) for i in range(16)]
    for heads, kv_heads in ((12, 12), (9, 3)):
        out, ref = _decode_case(lens, heads, kv_heads, 64, 16, torch.float16, seed=3, bound=4096, **launch)
        assert _rel(out, ref) < TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_prefill_and_store_gpu_realistic_shapes(dtype):
    for heads, kv_heads in ((12, 12), (9, 3)):
        out, ref = _prefill_case([512, 37, 1, 200], [0, 300, 999, 64], heads, kv_heads, 64, 16, dtype, seed=1)
        assert _rel(out, ref) < TOL[dtype]
        g = torch.Generator().manual_seed(2)
        key, value = (torch.randn(300, kv_heads, 64, generator=g).to(DEV, dtype) for _ in range(2))
        slots = torch.randperm(64 * 16, generator=g)[:300].to(DEV)
        slots[::7] = -1
        caches = [torch.randn(64, kv_heads, 16, 64, generator=g).to(DEV, dtype) for _ in range(2)]
        ref_caches = [c.clone() for c in caches]
        store_kv_cache(key, value, *caches, slots)
        store_kv_cache_ref(key, value, *ref_caches, slots)
        assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches))
