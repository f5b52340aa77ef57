"""Decode's linear layers in one kernel (`kernels.skinny_gemm`) against float64 products: every epilogue
(bias, GELU, SiLU(gate) * up), one row and several, split-K; the launch table; the models' wiring; and
on the GPU whole fp16 models with the kernel against the same models on cuBLAS."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_utils import rel_err, same_greedy
from rosecli.kernels import skinny_gemm
from rosecli.kernels.launch_table import SkinnyLaunch, logits_launch, skinny_launch, stats_fold
from rosecli.kernels.skinny_gemm import skinny_linear, skinny_linear_ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MODES = ["plain", "bias", "gelu", "swiglu"]


def _case(rows, n, k, mode, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    w = (torch.randn(2 * n if mode == "swiglu" else n, k, generator=g) / k ** 0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if mode in ("bias", "gelu") else None
    return x, w, b


def _err(got, x, w, b, mode):
    """Largest error against the float64 reference, and the torch path's own (rounded to the dtype)."""
    kw = dict(gelu=mode == "gelu", swiglu=mode == "swiglu")
    exact = skinny_linear_ref(x.double(), w.double(), None if b is None else b.double(), **kw)
    torch_path = skinny_linear_ref(x.float(), w.float(), None if b is None else b.float(), **kw).to(x.dtype)
    return (got.double() - exact).abs().max().item(), (torch_path.double() - exact).abs().max().item()


SHAPES = [
    (1, 96, 576, None),  # the table's one-row launch (K steps past the end of K)
    (1, 40, 1000, SkinnyLaunch(4, 128, 3, 2, 2)),  # one row, split-K, uneven K
    (5, 80, 160, None),  # tensor-core tiles, padding rows
    (17, 64, 768, SkinnyLaunch(16, 64, 4, 4, 2)),  # a 32-row tile, split-K
    (64, 48, 512, SkinnyLaunch(32, 128, 1, 4, 3)),  # a column tile past N
    (5, 80, 160, SkinnyLaunch(64, 64, 1, 4, 2, True)),  # TMA tiles: padding rows, a column tile past N, K's end
    (17, 64, 768, SkinnyLaunch(32, 128, 3, 4, 2, True)),  # TMA tiles, split-K
]
# (the Triton interpreter's tl.dot misreads bfloat16 operands: bfloat16 tiles are checked on the GPU)
CASES = [(device, dtype, *shape) for device in DEVICES for dtype in (torch.float16, torch.bfloat16)
         for shape in SHAPES if device == "cuda" or dtype == torch.float16 or shape[0] == 1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("device,dtype,rows,n,k,launch", CASES)
def test_skinny_linear_matches_float64(device, dtype, mode, rows, n, k, launch):
    x, w, b = _case(rows, n, k, mode, dtype, device, seed=rows * n + k)
    got = skinny_linear(x, w, b, mode == "gelu", launch, swiglu=mode == "swiglu")
    assert got.shape == (rows, n) and got.dtype == dtype
    err, torch_err = _err(got, x, w, b, mode)
    # float32 sums in another order, then the same roundings as the torch path: its error, give or take an ulp
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    assert err <= 2 * torch_err + 4 * ulp, (err, torch_err)


NORM_SHAPES = [
    (1, 96, 576, None),  # one row, the default launch (the tile runs past the end of K)
    (1, 24, 576, SkinnyLaunch(4, 1024, 1, 2, 1)),  # the table's launch for GPT-2's and SmolLM2's widths
    (1, 40, 1000, SkinnyLaunch(4, 1024, 1, 4, 1)),  # uneven K
    (5, 80, 160, None),  # tensor-core tiles, padding rows, several column tiles
    (17, 64, 768, SkinnyLaunch(16, 1024, 1, 4, 1)),  # a 32-row tile
]


@pytest.mark.parametrize("norm_kind", ["layer", "rms"])
@pytest.mark.parametrize("inputs", ["x", "x+bias+residual"])  # (x+residual: Llama, the tests below)
@pytest.mark.parametrize("rows,n,k,launch", NORM_SHAPES)
def test_norm_prologue_matches_add_norm_then_the_gemm(norm_kind, inputs, rows, n, k, launch):
    """The add_norm folded into the GEMM: its sum (the residual stream) bit for bit what `norm.add_norm`
    writes, and the product within the unfused path's own error of the float64 one. Norm scales far from 1
    and a shifted mean, so a wrong statistic (a mean left in an RMSNorm, a variance over padding, a
    missing bias) shows."""
    from rosecli.kernels import norm as norm_kernels

    g = torch.Generator().manual_seed(rows * 1000 + k)
    half = torch.float16
    x = (torch.randn(rows, k, generator=g) + 0.5).to(half)
    res = torch.randn(rows, k, generator=g).to(half) if "residual" in inputs else None
    xb = (torch.randn(k, generator=g) * 0.3).to(half) if "bias" in inputs else None
    nw = (torch.rand(k, generator=g) * 2 + 0.2).to(half)
    nb = (torch.randn(k, generator=g) * 0.5).to(half) if norm_kind == "layer" else None
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(half)
    b = torch.randn(n, generator=g).to(half)
    normin = skinny_gemm.NormIn(res, xb, nw, nb, 1e-5, norm_kind == "rms")
    y, total = skinny_gemm.skinny_norm_linear(x, normin, w, b, launch=launch)
    h_ref, total_ref = norm_kernels.add_norm(x, res, nw, nb, 1e-5, xb, norm_kind == "rms")
    assert torch.equal(total, total_ref)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    exact = skinny_gemm.skinny_norm_linear_ref(d(x), skinny_gemm.NormIn(d(res), d(xb), d(nw), d(nb), 1e-5,
                                                                        norm_kind == "rms"), d(w), d(b))[0]
    unfused = skinny_linear(h_ref, w, b, launch=launch)  # add_norm's fp16 rows, then the GEMM
    err = (y.double() - exact).abs().max().item()
    unfused_err = (unfused.double() - exact).abs().max().item()
    assert err <= 2 * unfused_err + 4 * 2 ** -10, (err, unfused_err)
    assert (y.double() - unfused.double()).abs().max().item() <= 2 * unfused_err + 4 * 2 ** -10


def test_norm_prologue_refuses_a_launch_that_steps_or_splits_k():
    """The prologue takes its statistics from the one K tile it reads: a launch with K in steps or split
    is a clear error, not a norm over part of the row."""
    x, w = torch.randn(2, 512, dtype=torch.float16), torch.randn(32, 512, dtype=torch.float16)
    normin = skinny_gemm.NormIn(None, None, torch.ones(512, dtype=torch.float16), None, 1e-6, True)
    for launch in (SkinnyLaunch(16, 256, 1, 4, 1), SkinnyLaunch(16, 512, 2, 4, 1)):
        with pytest.raises(ValueError, match="whole K"):
            skinny_gemm.skinny_norm_linear(x, normin, w, launch=launch)


@pytest.mark.parametrize("epilogue", ["gelu", "swiglu"])
def test_norm_prologue_with_the_activation_epilogues(epilogue):
    """The norm prologue and an activation epilogue in one kernel: GPT-2's ln_2 + c_fc + GELU and Llama's
    post-attention RMSNorm + gate/up + SiLU, against the unfused kernels."""
    from rosecli.kernels import norm as norm_kernels

    g = torch.Generator().manual_seed(11)
    half = torch.float16
    rows, n, k = 3, 48, 256
    x, res = torch.randn(rows, k, generator=g).to(half), torch.randn(rows, k, generator=g).to(half)
    nw = (torch.rand(k, generator=g) + 0.5).to(half)
    rms = epilogue == "swiglu"
    nb = None if rms else torch.randn(k, generator=g).to(half)
    w = (torch.randn(2 * n if rms else n, k, generator=g) / k ** 0.5).to(half)
    b = None if rms else torch.randn(n, generator=g).to(half)
    y, total = skinny_gemm.skinny_norm_linear(x, skinny_gemm.NormIn(res, None, nw, nb, 1e-6, rms), w, b,
                                              gelu=not rms, swiglu=rms)
    h_ref, total_ref = norm_kernels.add_norm(x, res, nw, nb, 1e-6, None, rms)
    assert torch.equal(total, total_ref)
    unfused = skinny_linear(h_ref, w, b, gelu=not rms, swiglu=rms)
    torch.testing.assert_close(y, unfused, atol=2e-3, rtol=2e-3)


STATS_SHAPES = [  # rows, n (the stream's width), k, the producer's launch, the consumer's
    (5, 80, 160, None, None),  # tensor-core tiles, padding rows
    (17, 96, 768, SkinnyLaunch(16, 64, 4, 4, 2), SkinnyLaunch(16, 32, 1, 4, 2)),  # split-K producer (the last
    # program writes the statistics), a 32-row tile, the consumer's K in steps
    (6, 776, 64, SkinnyLaunch(16, 64, 1, 4, 2), SkinnyLaunch(16, 128, 2, 4, 2)),  # 49 tiles (4 chunks), the last
    # tile 8 wide; a split-K consumer
    (64, 72, 64, SkinnyLaunch(32, 64, 1, 4, 3), SkinnyLaunch(16, 16, 1, 4, 2)),  # 64 rows, a column tile past N
    (1, 778, 64, SkinnyLaunch(4, 64, 1, 2, 2), SkinnyLaunch(4, 256, 1, 2, 2)),  # one row (vector products): 195
    # tiles of 4, the last 2 wide
    (1, 40, 2560, stats_fold(1, 40, 2560, before=True), SkinnyLaunch(4, 256, 1, 2, 2)),  # one row, the
    # producer in the table's K steps (1024 wide: two and a half of them)
]


# each shape with the fold `launch_table.fold_copy` gives its rows (a copy at 2-64 rows; at one, the layer's own
# weights, the stream times the norm's scale written by the layer before), and two cheap multi-row shapes with the
# other
STATS_CASES = ([case + (case[0] > 1,) for case in STATS_SHAPES]
               + [STATS_SHAPES[0] + (False,), STATS_SHAPES[3] + (False,)])


@pytest.mark.parametrize("norm_kind", ["layer", "rms"])
@pytest.mark.parametrize("rows,n,k,produce,consume,copy", STATS_CASES)
def test_residual_statistics_pair_matches_add_norm(norm_kind, rows, n, k, produce, consume, copy):
    """The add_norm between two GEMMs at several rows, split between them: the first adds its deferred bias
    and the residual and writes the sum's statistics, the second (the norm's scale folded into a copy of its
    weights, or applied to each input tile as it is read) reads the raw sum and applies each row's statistics
    in its epilogue. The sum is bit for bit what `norm.add_norm` writes after the plain GEMM; the second
    product is as close to the float64 one as add_norm's rows then the GEMM are. Norm scales far from 1, a
    shifted mean, a norm bias and an uneven last tile, so a mean left in RMSNorm, a tile counted at its full
    width, a scale applied twice or not at all, or a missing shift shows."""
    from rosecli.kernels import norm as norm_kernels

    rms = norm_kind == "rms"
    g = torch.Generator().manual_seed(rows * 100 + n)
    half = torch.float16
    x = torch.randn(rows, k, generator=g).to(half)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(half)
    b = torch.randn(n, generator=g).to(half)
    res = (torch.randn(rows, n, generator=g) + 0.7).to(half)
    nw = (torch.rand(n, generator=g) * 2 + 0.2).to(half)
    nb = None if rms else (torch.randn(n, generator=g) * 0.5).to(half)
    w2, b2 = (torch.randn(48, n, generator=g) / n ** 0.5).to(half), torch.randn(48, generator=g).to(half)
    total, stats = skinny_gemm.skinny_linear_add(x, w, b, res, rms, launch=produce, scale=None if copy else nw)
    h_ref, total_ref = norm_kernels.add_norm(skinny_linear(x, w, None, launch=produce), res, nw, nb, 1e-5, b, rms)
    assert torch.equal(total, total_ref)
    if not copy:  # the sum times the norm's scale, rounded once, beside the sum
        assert torch.equal(stats.scaled, (total.float() * nw.float()).half())
    fold = skinny_gemm.fold_norm_weights(w2, nw, nb, 1e-5, rms, copy)
    assert (fold.weight.data_ptr() == w2.data_ptr()) == (not copy)  # no copy of the weights
    y = skinny_gemm.skinny_stats_norm_linear(total, stats, fold, b2, launch=consume)
    # against the float64 product of the normed sum: within twice the unfused path's own error (add_norm's fp16
    # rows, then the GEMM), give or take an ulp
    d = lambda t: None if t is None else t.double()  # noqa: E731
    exact = skinny_gemm.skinny_norm_linear_ref(d(total), skinny_gemm.NormIn(None, None, d(nw), d(nb), 1e-5, rms),
                                               d(w2), d(b2))[0]
    unfused = skinny_linear(h_ref, w2, b2, launch=consume)
    err, unfused_err = [(t.double() - exact).abs().max().item() for t in (y, unfused)]
    assert err <= 2 * unfused_err + 2 * 2 ** -10 * exact.abs().max().item(), (err, unfused_err)
    # the statistics really are used: a stream scaled by 3 with the old statistics gives another product
    tripled = (total.float() * 3).half()
    if not copy:
        stats = stats._replace(scaled=(stats.scaled.float() * 3).half())
    wrong = skinny_gemm.skinny_stats_norm_linear(tripled, stats, fold, b2, launch=consume)
    assert (wrong.double() - unfused.double()).abs().max().item() > 0.1
    if not copy:  # and a fold without a copy refuses statistics that carry no scaled stream
        with pytest.raises(ValueError, match="scale"):
            skinny_gemm.skinny_stats_norm_linear(total, stats._replace(scaled=None), fold, b2, launch=consume)


def test_residual_statistics_refuse_another_width():
    """Statistics written for a stream of one width, read for another: a clear error, not a wrong norm."""
    x, w = torch.randn(4, 64, dtype=torch.float16), torch.randn(96, 64, dtype=torch.float16)
    total, stats = skinny_gemm.skinny_linear_add(x, w, None, torch.randn(4, 96, dtype=torch.float16), True)
    fold = skinny_gemm.fold_norm_weights(torch.randn(32, 128, dtype=torch.float16),
                                         torch.ones(128, dtype=torch.float16), None, 1e-6, True)
    with pytest.raises(ValueError, match="do not cover"):
        skinny_gemm.skinny_stats_norm_linear(torch.randn(4, 128, dtype=torch.float16), stats, fold)


@pytest.mark.parametrize("rows,launch,fold", [
    (1, None, False), (1, SkinnyLaunch(4, 256, 1, 2, 1), True),  # one row; and after the folded norm
    (6, None, False), (6, SkinnyLaunch(16, 64, 3, 4, 2), False),  # tiles; split-K (the last program stores)
])
def test_kv_epilogue_stores_what_store_kv_would(rows, launch, fold):
    """GPT-2's q/k/v projection with its K and V columns stored into the paged cache by the epilogue: the
    same output, and the same caches as `store_kv_cache_ref` of that output (every kv head into its own run
    of the block, the V heads into the V cache); a negative slot (a CUDA-graph padding row) stores nothing."""
    from rosecli.kernels.store_kv import store_kv_cache_ref

    g = torch.Generator().manual_seed(rows)
    half = torch.float16
    heads, head_dim, block, k = 3, 16, 4, 64
    n = 3 * heads * head_dim
    x = torch.randn(rows, k, generator=g).to(half)
    w = (torch.randn(n, k, generator=g) / 8).to(half)
    b = torch.randn(n, generator=g).to(half)
    slots = torch.tensor([9, 2, -1, 13, 4, 0][:rows])
    caches = [torch.full((5, heads, block, head_dim), 7.0, dtype=half) for _ in range(4)]
    kv = skinny_gemm.KVOut(caches[0], caches[1], slots)
    if fold:
        normin = skinny_gemm.NormIn(None, None, torch.ones(k, dtype=half), torch.zeros(k, dtype=half), 1e-5, False)
        y = skinny_gemm.skinny_norm_linear(x, normin, w, b, launch=launch, kv=kv)[0]
        y_plain = skinny_gemm.skinny_norm_linear(x, normin, w, b, launch=launch)[0]
    else:
        y = skinny_linear(x, w, b, launch=launch, kv=kv)
        y_plain = skinny_linear(x, w, b, launch=launch)
    assert torch.equal(y, y_plain)
    qs = heads * head_dim
    store_kv_cache_ref(y[:, qs:2 * qs].view(rows, heads, head_dim), y[:, 2 * qs:].view(rows, heads, head_dim),
                       caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert not torch.equal(caches[0], torch.full_like(caches[0], 7.0))


@pytest.mark.parametrize("rows,launch,fold", [
    (1, None, False), (1, SkinnyLaunch(4, 256, 1, 2, 1), True),  # one row (as the models run it); after the norm
    (1, SkinnyLaunch(2, 64, 2, 2, 2), False),  # one pair per program, split-K
    (5, None, False), (5, SkinnyLaunch(16, 64, 3, 4, 2), False),  # tiles; split-K
])
def test_kv_epilogue_with_rope_rotates_as_rotary_kv(rows, launch, fold):
    """The Llama family's q/k/v projection with q and k rotated (`KVOut.rope`) and K and V stored by the epilogue:
    the output and both caches are those of the plain GEMM followed by `rotary.rotary_kv_ref` (GQA: 4 q heads, 2 kv
    heads; a negative slot stores nothing), and the V columns and the cache rows of other slots are left alone."""
    from rosecli.engine.models.common import RotaryEmbedding
    from rosecli.kernels.rotary import rotary_kv_ref

    g = torch.Generator().manual_seed(10 + rows)
    half = torch.float16
    heads, kv_heads, head_dim, block, k = 4, 2, 16, 4, 64
    n = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(rows, k, generator=g).to(half)
    w = (torch.randn(n, k, generator=g) / 4).to(half)
    b = torch.randn(n, generator=g).to(half)
    slots = torch.tensor([9, 2, -1, 13, 4][:rows])
    rope = RotaryEmbedding(head_dim, 64, base=500.0)
    pos = torch.tensor([37, 5, 0, 63, 20][:rows])
    caches = [torch.full((5, kv_heads, block, head_dim), 7.0, dtype=half) for _ in range(4)]
    kv = skinny_gemm.KVOut(caches[0], caches[1], slots, (pos, rope.cos, rope.sin))
    if fold:
        normin = skinny_gemm.NormIn(None, None, torch.ones(k, dtype=half), None, 1e-5, True)
        y = skinny_gemm.skinny_norm_linear(x, normin, w, b, launch=launch, kv=kv)[0]
        want = skinny_gemm.skinny_norm_linear(x, normin, w, b, launch=launch)[0]
    else:
        y = skinny_linear(x, w, b, launch=launch, kv=kv)
        want = skinny_linear(x, w, b, launch=launch)
    plain = want.clone()
    rotary_kv_ref(want, pos, rope.cos, rope.sin, caches[2], caches[3], slots, heads, kv_heads)
    assert not torch.equal(want, plain)  # (the rotation moved q and k)
    torch.testing.assert_close(y, want, rtol=2e-3, atol=2e-3)  # (up to the float32 multiply-adds' contraction)
    assert torch.equal(y[:, (heads + kv_heads) * head_dim:], plain[:, (heads + kv_heads) * head_dim:])  # V as is
    for got, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)
        assert torch.equal(got == 7.0, ref == 7.0)  # the same slots written, the others untouched


def test_split_k_is_deterministic_and_rearms_its_tickets():
    x, w, b = _case(3, 64, 1024, "bias", torch.float16, "cpu", seed=7)
    launch = SkinnyLaunch(16, 64, 8, 4, 2)
    first = skinny_linear(x, w, b, launch=launch)
    assert int(skinny_gemm._tickets[x.device].abs().sum()) == 0  # ready for the next launch (or graph replay)
    for _ in range(2):
        assert torch.equal(skinny_linear(x, w, b, launch=launch), first)
    assert not torch.equal(skinny_linear(x, w, None, launch=launch), first)


@pytest.mark.parametrize("device", DEVICES)
def test_tma_tiles_load_by_descriptor_or_fall_back_to_plain_loads(device, monkeypatch):
    """A TMA launch (`SkinnyLaunch.tma`) makes the weight and x descriptors and gives the plain-load launch's result to
    the float32 sums' order; where the TMA unit cannot load a tile (an x that does not start on 16 bytes) it takes the
    same tiles with plain loads: the same result, no descriptor. One row (vector products) never takes it."""
    made, real = [], skinny_gemm.TensorDescriptor.from_tensor
    monkeypatch.setattr(skinny_gemm.TensorDescriptor, "from_tensor",
                        lambda t, block: made.append(block) or real(t, block))
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    x, w, _ = _case(9, 40, 320, "swiglu", dtype, device, seed=11)
    launch = SkinnyLaunch(32, 64, 2, 4, 2, True)
    got = skinny_linear(x, w, launch=launch, swiglu=True)
    assert made == [[32, 64], [16, 64]]  # (x's rows padded to a 16-row tile)
    plain = skinny_linear(x, w, launch=launch._replace(tma=False), swiglu=True)
    torch.testing.assert_close(got, plain, atol=2e-3, rtol=2e-3)
    made.clear()
    shifted = torch.empty(x.numel() + 1, dtype=dtype, device=device)[1:].view_as(x)  # 2 bytes past a 16-byte start
    shifted.copy_(x)
    assert skinny_gemm.supported(shifted, w)
    torch.testing.assert_close(skinny_linear(shifted, w, launch=launch, swiglu=True), got, atol=2e-3, rtol=2e-3)
    assert not made
    skinny_linear(x[:1], w, launch=launch, swiglu=True)  # one row: vector products
    assert not made


def test_supported_refuses_what_the_kernel_does_not_take():
    w = torch.randn(32, 64, dtype=torch.float16)
    assert skinny_gemm.supported(torch.randn(4, 64, dtype=torch.float16), w)
    assert not skinny_gemm.supported(torch.randn(65, 64, dtype=torch.float16), w)  # a prefill's rows
    assert not skinny_gemm.supported(torch.randn(4, 64), w.float())  # float32
    assert not skinny_gemm.supported(torch.randn(4, 64, dtype=torch.bfloat16), w)  # mixed dtypes
    assert not skinny_gemm.supported(torch.randn(64, 4, dtype=torch.float16).t(), w)  # strided rows
    assert not skinny_gemm.supported(torch.randn(4, 48, dtype=torch.float16), w)  # another K


@pytest.mark.parametrize("n,k,swiglu,big", [
    (2304, 768, False, False), (768, 3072, False, False), (1536, 576, True, False),  # GPT-2, SmolLM2
    (3072, 2048, False, True), (2048, 8192, False, True), (8192, 2048, True, True),  # Llama-3.2-1B
    (14336, 4096, True, True), (4096, 14336, False, True),  # Llama-3-8B
    (8960, 1536, True, True),  # Qwen2.5-1.5B's gate/up
    (2048, 2048, False, True), (2048, 1536, False, True), (1536, 1536, False, True),  # 1B's o, Qwen's q/k/v and o
    (576, 1536, False, False), (960, 576, False, False), (576, 576, False, False),  # SmolLM2's down, q/k/v, o
    (768, 768, False, False), (3072, 768, False, False),  # GPT-2's attn_proj, c_fc
])
def test_launch_table(n, k, swiglu, big, monkeypatch):
    """One row always takes the kernel; the small models' layers take its plain tiles at 2-64 rows; there the 1B-8B
    layers take the TMA tiles (measured faster than cuBLAS inside whole steps): the gate/up + SiLU in 64-wide K steps,
    the rest in 128-wide ones, a down projection split so about 128 programs run, q/k/v and o split at most in two
    and not at 33-64 rows; all of them go back to cuBLAS with ``ROSE_TMA_GEMM=0``."""
    from rosecli.kernels import launch_table

    for rows in (1, 2, 7, 16, 33, 64):
        cfg = skinny_launch(rows, n, k, swiglu)
        if rows > 1 and big:
            assert cfg.tma and cfg.block_n == 64 and cfg.block_k == (64 if swiglu else 128)
            if swiglu:
                assert cfg == SkinnyLaunch(64, 64, 1, 4, 4, True)
            elif k >= 3 * n:  # 24-64 column tiles: 2-4 splits
                assert 96 <= cfg.split_k * n // 64 <= 128
            else:
                assert cfg.split_k <= (1 if rows > 32 else 2) and cfg.num_stages == 6
            continue
        assert cfg is not None and cfg.block_n & (cfg.block_n - 1) == 0 and cfg.block_k & (cfg.block_k - 1) == 0
        assert (cfg.block_n >= 16 and cfg.block_k >= 16) or rows == 1  # tensor-core tiles need 16
        assert not cfg.tma
    monkeypatch.setattr(launch_table, "TMA_GEMM", False)
    assert all(skinny_launch(rows, n, k, swiglu) is None for rows in (2, 64)) == big


def test_tma_launches_the_sweep_measured():
    """The launches the H200 sweep found best (`launch_table.tma_launch`), and the rule for a shape it did not
    measure (Llama-3.2-3B's o, 48 column tiles)."""
    tma = lambda *f: SkinnyLaunch(*f, True)  # noqa: E731
    assert [skinny_launch(r, 2048, 1536) for r in (8, 24, 64)] == [tma(64, 128, 2, 4, 6)] + [tma(64, 128, 1, 4, 6)] * 2
    assert [skinny_launch(r, 2048, 2048) for r in (16, 32, 40)] == [tma(64, 128, 2, 4, 6)] * 2 + [tma(64, 128, 1, 4, 6)]
    assert skinny_launch(16, 3072, 2048) == skinny_launch(16, 6144, 4096) == tma(64, 128, 1, 4, 6)
    # Qwen2.5-1.5B's down in 96 programs streams more a program (6 stages; 5 in 8 warps), the 1B's in 128 does not
    assert [skinny_launch(r, 1536, 8960) for r in (16, 64)] == [tma(64, 128, 4, 4, 6), tma(64, 128, 4, 8, 5)]
    assert [skinny_launch(r, 2048, 8192) for r in (16, 64)] == [tma(64, 128, 4, 4, 4), tma(64, 128, 4, 8, 4)]
    assert skinny_launch(64, 4096, 14336) == skinny_launch(4, 4096, 14336) == tma(64, 128, 2, 4, 6)
    assert [skinny_launch(r, 3072, 3072) for r in (16, 24)] == [tma(64, 128, 2, 4, 6), tma(64, 128, 1, 4, 6)]


def test_norm_fold_table():
    """The add_norm is folded at one row with K in one tile (K <= 2048: GPT-2, SmolLM2, Llama-3.2-1B,
    Qwen2.5-1.5B), not for Llama-3-8B's K = 4096 nor at 2-64 rows (both measured slower)."""
    from rosecli.kernels.launch_table import fold_norm

    for k in (576, 768, 1536, 2048):
        cfg = fold_norm(1, 2304, k)
        assert cfg is not None and cfg.block_k >= k and cfg.split_k == 1
        assert all(fold_norm(rows, 2304, k) is None for rows in (2, 16, 64))
    assert fold_norm(1, 6144, 4096) is None
    from rosecli.kernels.launch_table import kv_in_gemm

    assert kv_in_gemm(1) and not any(kv_in_gemm(rows) for rows in (2, 16, 64))


def test_prefetch_table():
    """At 2-64 rows a program asks for the rest of its weights (every line past its first tile, in a power of two of
    lines); at one row none (the 1-1.5B shapes' steps measured 11-12% slower with it), nor with nothing left."""
    from rosecli.kernels.launch_table import prefetch_lines

    for rows in (2, 16, 64):
        assert prefetch_lines(rows, 3072 - 512, 64) == 64  # GPT-2's mlp_proj (fp16: 64 elements a line)
        assert prefetch_lines(rows, 768 - 128, 64) == 16 and prefetch_lines(rows, 65, 64) == 2
        assert prefetch_lines(rows, 0, 64) == 0
    assert prefetch_lines(1, 3072 - 512, 64) == 0


def test_residual_statistics_table(monkeypatch):
    """The GEMM pairs around a norm run at 2-64 rows for the small models' layers (GPT-2, SmolLM2-135M), not for
    layers the table leaves to cuBLAS there (Llama-3.2-1B's); at one row for the 1.5B-8B models' widths only."""
    from rosecli.kernels import launch_table
    from rosecli.kernels.launch_table import stats_pair

    small = [(768, 768, False), (768, 3072, False), (3072, 768, False), (2304, 768, False),  # GPT-2
             (576, 576, False), (576, 1536, False), (1536, 576, True), (960, 576, False)]  # SmolLM2
    for n, k, swiglu in small:
        assert stats_fold(65, n, k, swiglu) is None
        for rows in (2, 16, 64):
            cfg = stats_fold(rows, n, k, swiglu)
            assert cfg is not None and cfg.block_n >= 16 and cfg.block_k >= 16 and (cfg.split_k > 1) == (k >= 3072)
    # ... nor for the 1B-8B layers at 2-64 rows, on the TMA tiles (statistics in their epilogues measured slower)
    assert all(stats_fold(64, n, k, sw) is None for n, k, sw in ((2048, 2048, False), (8192, 2048, True),
                                                                  (2048, 8192, False), (4096, 14336, False)))
    # one row: the pair at the 1.5B-8B models' widths (measured faster), the whole-row fold at GPT-2's and SmolLM2's
    assert [stats_pair(1, w) for w in (576, 768, 1536, 2048, 4096)] == [False, False, True, True, True]
    assert not launch_table.fold_copy(1) and launch_table.fold_copy(2)  # (one row: no copy of the weights)
    monkeypatch.setattr(launch_table, "STATS_ONE_ROW_WIDTHS", None)
    assert not any(stats_pair(1, w) for w in (576, 768, 1536, 2048, 4096))
    assert all(stats_pair(rows, w) for rows in (2, 64) for w in (576, 4096)) and not stats_pair(65, 768)
    assert stats_fold(1, 3072, 2048) is not None and stats_fold(1, 8192, 2048, True) is not None
    # one row, 3 stages: the GEMM after the norm in 512-wide K steps, with 2 warps but for Qwen2.5-1.5B's gate/up
    # (K = 1536: 4); the one before in 1024-wide steps, with 4 warps at Llama-3-8B's width (its o and down) and 2 below
    # it (Llama-3.2-1B's and Qwen2.5-1.5B's down, K >= 4096 too)
    assert stats_fold(1, 6144, 4096) == stats_fold(1, 2048, 1536) == SkinnyLaunch(4, 512, 1, 2, 3)
    assert stats_fold(1, 8192, 2048, True) == stats_fold(1, 14336, 4096, True) == SkinnyLaunch(4, 512, 1, 2, 3)
    assert stats_fold(1, 8960, 1536, True) == SkinnyLaunch(4, 512, 1, 4, 3)
    assert stats_fold(1, 4096, 14336, before=True) == stats_fold(1, 4096, 4096, before=True) == SkinnyLaunch(
        4, 1024, 1, 4, 3)
    assert stats_fold(1, 2048, 8192, before=True) == stats_fold(1, 1536, 1536, before=True) == SkinnyLaunch(
        4, 1024, 1, 2, 3)


def test_one_row_logits_gemm_takes_the_kernel(monkeypatch):
    """A decode step's logits GEMM at one row (fused ops) runs on the kernel with the output rows padded, giving
    cuBLAS's logits to fp16 rounding and the same greedy token; at two rows, or without fused ops, cuBLAS's. The one
    row's launch is `logits_launch`'s (2 warps, 512-wide K steps), not the one for other layers of that size."""
    from rosecli.engine.models import common

    monkeypatch.setattr(common, "_skinny_device", lambda x: True)
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear",
                        lambda *a, **kw: calls.append((a[1].shape, kw.get("launch"))) or real(*a, **kw))
    assert logits_launch(1) == SkinnyLaunch(4, 512, 1, 2, 3) != skinny_launch(1, 128256, 2048)
    assert logits_launch(2) is None
    torch.manual_seed(0)
    padded = torch.zeros(320, 64, dtype=torch.float16)
    padded[:300] = torch.randn(300, 64, dtype=torch.float16) / 8
    weight = padded[:300]
    for rows, fused, kernel in ((1, True, True), (2, True, False), (1, False, False)):
        hidden = torch.randn(rows, 64, dtype=torch.float16)
        got = common.logits_gemm(hidden, weight, padded, fused)
        assert got.shape == (rows, 320) and (len(calls) == 1) == kernel
        assert not kernel or calls[0] == ((320, 64), logits_launch(1))
        want = F.linear(hidden.float(), padded.float())
        torch.testing.assert_close(got.float(), want, atol=4e-3, rtol=4e-3)
        assert torch.equal(got[:, :300].float().argmax(-1), want[:, :300].argmax(-1))
        assert torch.count_nonzero(got[:, 300:]) == 0
        calls.clear()


def test_models_route_decode_rows_through_the_kernel(monkeypatch):
    """The models' helpers with fused ops: the same results as their torch paths, the kernel really run
    (gate rows before up rows, the bias added once, GELU after it) and 65 rows left to torch."""
    from rosecli.engine.models import common

    monkeypatch.setattr(common, "_skinny_device", lambda x: True)
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    torch.manual_seed(0)
    half = dict(dtype=torch.float16)
    qkv, proj = nn.Linear(64, 96, **half), nn.Linear(96, 64, **half)
    fc, gate_up = nn.Linear(64, 128, **half), nn.Linear(64, 2 * 80, bias=False, **half)
    down = nn.Linear(80, 64, bias=False, **half)
    for rows in (1, 6):
        x = torch.randn(rows, 64, **half)
        h = torch.randn(rows, 96, **half)
        close = dict(atol=4e-3, rtol=4e-3)
        torch.testing.assert_close(common.fused_linear(qkv, x, True), qkv(x), **close)
        y, bias = common.linear_deferring_bias(proj, h, True)
        torch.testing.assert_close(y + bias, proj(h), **close)
        torch.testing.assert_close(common.linear_gelu(fc, x, True), common.linear_gelu(fc, x, False), **close)
        torch.testing.assert_close(common.gate_up_silu(gate_up, x, True),
                                   common.silu_mul(gate_up(x), False), **close)
        d = torch.randn(rows, 80, **half)
        torch.testing.assert_close(common.fused_linear(down, d, True), down(d), **close)
    assert len(calls) == 2 * 5
    calls.clear()
    # add_norm folded into the next GEMM at one row (LayerNorm + bias + GELU, RMSNorm + gate/up), not at 6
    ln, rms = nn.LayerNorm(64, **half), common.RMSNorm(64, 1e-6).half()
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5), ln.bias.uniform_(-0.5, 0.5), rms.weight.uniform_(0.5, 1.5)
    folds = []
    real_norm = skinny_gemm.skinny_norm_linear
    monkeypatch.setattr(skinny_gemm, "skinny_norm_linear", lambda *a, **kw: folds.append(1) or real_norm(*a, **kw))
    for rows in (1, 6):
        x, res, xb = torch.randn(rows, 64, **half), torch.randn(rows, 64, **half), torch.randn(64, **half)
        for norm, linear, kw in ((ln, qkv, {}), (ln, fc, dict(gelu=True)), (rms, gate_up, dict(swiglu=True))):
            y, total = common.norm_linear(norm, linear, x, res, True, xb if norm is ln else None, **kw)
            y_ref, total_ref = common.norm_linear(norm, linear, x, res, False, xb if norm is ln else None, **kw)
            torch.testing.assert_close(total, total_ref, atol=1e-3, rtol=1e-3)  # (torch rounds x + xb first)
            torch.testing.assert_close(y, y_ref, atol=6e-3, rtol=6e-3)
        assert len(folds) == 3
    # the linear layer before a residual add and a norm (`linear_residual`): at 6 rows its kernel adds the bias and
    # the residual and writes the sum's statistics, and the norm runs in the next GEMM's K loop; at 1 row the
    # bias is deferred to the norm as before
    adds = []
    real_add = skinny_gemm.skinny_linear_add
    monkeypatch.setattr(skinny_gemm, "skinny_linear_add", lambda *a, **kw: adds.append(1) or real_add(*a, **kw))
    for rows in (1, 6):
        h, res = torch.randn(rows, 96, **half), torch.randn(rows, 64, **half)
        for norm, linear, kw in ((ln, fc, dict(gelu=True)), (rms, gate_up, dict(swiglu=True))):
            a, stream, a_bias = common.linear_residual(proj, h, res, True, norm, linear, swiglu=linear is gate_up)
            assert isinstance(a, skinny_gemm.StreamStats) == (rows > 1) and (a_bias is None) == (rows > 1)
            y, total = common.norm_linear(norm, linear, a, stream, True, a_bias, **kw)
            y_ref, total_ref = common.norm_linear(norm, linear, proj(h), res, False, **kw)
            torch.testing.assert_close(total, total_ref, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(y, y_ref, atol=6e-3, rtol=6e-3)
            h_last, _ = common.add_norm(norm, a, stream, True, a_bias)  # (a model's last norm, before the logits)
            torch.testing.assert_close(h_last, common.add_norm(norm, proj(h), res, False)[0], atol=6e-3, rtol=6e-3)
    assert len(adds) == 2  # (6 rows, both norms)
    # a layer after the norm that the table leaves to cuBLAS at these rows: the add_norm kernel stays
    big = nn.Linear(64, 70000, device="meta", **half)  # (over the 4M weights the table gives to the kernel)
    assert common.linear_residual(proj, torch.randn(6, 96, **half), res, True, ln, big)[0].shape == (6, 64)
    assert len(adds) == 2
    # statistics written, and a layer after the norm that the table leaves to cuBLAS: the sum is normed by add_norm,
    # the same result
    wide = nn.Linear(64, 70000, **half)
    h = torch.randn(6, 96, **half)
    a, stream, _ = common.linear_residual(proj, h, res, True, ln, fc)
    y, total = common.norm_linear(ln, wide, a, stream, True, None, gelu=True)
    y_ref, total_ref = common.norm_linear(ln, wide, proj(h), res, False, gelu=True)
    torch.testing.assert_close(total, total_ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(y, y_ref, atol=6e-3, rtol=6e-3)
    calls.clear()
    assert common.fused_linear(qkv, torch.randn(65, 64, **half), True).shape == (65, 96) and not calls
    assert common.fused_linear(qkv, torch.randn(6, 64, **half), False).shape == (6, 96) and not calls


def _decode_step(model, tokens, prior, device):
    """The attention metadata of a fused decode step of ``tokens`` sequences, one new token each after ``prior``
    cached ones, with every layer's fp16 cache (one 16-slot block a sequence) filled with seeded random K and V."""
    from rosecli.engine.attention import AttentionMetadata

    g = torch.Generator().manual_seed(3)
    for attn in model.attention_layers():
        attn.k_cache = (torch.randn(tokens, attn.num_kv_heads, 16, attn.head_dim, generator=g) * 0.5).to(
            device, torch.float16)
        attn.v_cache = torch.randn(attn.k_cache.shape, generator=g).to(device, torch.float16)
    rows = torch.arange(tokens, device=device)
    return AttentionMetadata(is_prefill=False, slot_mapping=rows * 16 + prior,
                             block_tables=rows.to(torch.int32)[:, None],
                             context_lens=torch.full((tokens,), prior + 1, dtype=torch.int32, device=device),
                             max_context_len=prior + 1, use_triton=True, fused_ops=True)


@pytest.mark.parametrize("device,tokens", [("cpu", 5), pytest.param("cuda", 64, marks=pytest.mark.gpu)])
def test_tma_tiles_in_a_decode_step_match_cublas(device, tokens, monkeypatch):
    """A whole Llama decode step with its linear layers (q/k/v, o, gate/up + SiLU, down) on the TMA tiles
    (`launch_table.tma_launch`, given this tiny model's layers as if they were the 1B-8B sizes it takes): the TMA
    launches ran, four a layer, and the logits are cuBLAS's to fp16 rounding, with the same greedy token per row."""
    from engine_utils import our_model, tiny_hf_model
    from rosecli.engine.models import common
    from rosecli.kernels import launch_table

    if device == "cpu":
        monkeypatch.setattr(common, "_skinny_device", lambda x: True)
    monkeypatch.setattr(launch_table, "SMALL_LAYER", 0)  # every layer past the plain tiles' size
    model = our_model(tiny_hf_model("llama", seed=5)).to(device).half()
    launches, real = [], skinny_gemm._launch
    monkeypatch.setattr(skinny_gemm, "_launch", lambda *a, **kw: launches.append(a[4]) or real(*a, **kw))
    ids = torch.randint(2, 250, (tokens,), generator=torch.Generator().manual_seed(2))

    def logits():
        meta = _decode_step(model, tokens, 2, device)
        with torch.inference_mode():
            return model.compute_logits(model(ids.to(device), torch.full((tokens,), 2, device=device), meta)).float()

    on = logits()
    assert [launch.tma for launch in launches] == [True] * 4 * len(model.attention_layers())
    monkeypatch.setattr(common, "SKINNY_GEMM", False)
    off = logits()
    assert rel_err(on, off) < 2e-3 and same_greedy(on, off)
    # a GPU without the TMA unit (or the shared memory of the 6-stage tiles) keeps cuBLAS for these layers
    monkeypatch.setattr(common, "SKINNY_GEMM", True)
    monkeypatch.setattr(skinny_gemm, "tma_device", lambda device: False)
    launches.clear()
    assert torch.equal(logits(), off) and not launches


MODEL_CASES = [pytest.param("cuda", kind, tokens, pair, marks=pytest.mark.gpu)
               for kind in ("gpt2", "llama", "qwen2") for tokens, pair in ((1, False), (1, True), (23, False))]
MODEL_CASES += [("cpu", "gpt2", 1, False), ("cpu", "llama", 1, False), ("cpu", "gpt2", 5, False),
                ("cpu", "llama", 5, False), ("cpu", "gpt2", 1, True), ("cpu", "llama", 1, True)]
# (the Triton interpreter; one row: the folds, or with ``pair`` the residual statistics pairs as a width given
# `launch_table.STATS_ONE_ROW_WIDTHS` takes them; five rows: the pairs)


@pytest.mark.parametrize("device,kind,tokens,pair", MODEL_CASES)
def test_fp16_model_on_the_kernel_matches_cublas_and_hugging_face(device, kind, tokens, pair, monkeypatch):
    """A whole fp16 decode step (fused ops, as CUDA-graph decode runs them) with decode's linear layers on the
    kernel (one row: the norms folded in; K and V stored by the q/k/v GEMM, which also rotates q and k in the Llama
    family; more rows: each add_norm
    split between the GEMMs around it, `linear_residual`): the same logits as on
    cuBLAS, within fp16's rounding of Hugging Face's float32 ones, and the same greedy token per row; and,
    with two cached tokens before (so a K stored wrong moves the softmax), the same as on cuBLAS."""
    from engine_utils import our_model, tiny_hf_model
    from rosecli.engine.models import common

    from rosecli.kernels import launch_table

    if device == "cpu":
        monkeypatch.setattr(common, "_skinny_device", lambda x: True)
    if pair:  # one row takes the pairs at this tiny model's width (measured faster at the 1-2B models' widths)
        monkeypatch.setattr(launch_table, "STATS_ONE_ROW_WIDTHS", (64, 64))
    hf = tiny_hf_model(kind, seed=5)
    model = our_model(hf).to(device).half()
    ids = torch.randint(2, 250, (tokens,), generator=torch.Generator().manual_seed(2))
    calls, folds, adds, normed = [], [], [], []
    real, real_norm = skinny_gemm.skinny_linear, skinny_gemm.skinny_norm_linear
    real_add, real_stats = skinny_gemm.skinny_linear_add, skinny_gemm.skinny_stats_norm_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(skinny_gemm, "skinny_norm_linear", lambda *a, **kw: folds.append(1) or real_norm(*a, **kw))
    monkeypatch.setattr(skinny_gemm, "skinny_linear_add", lambda *a, **kw: adds.append(1) or real_add(*a, **kw))
    monkeypatch.setattr(skinny_gemm, "skinny_stats_norm_linear",
                        lambda *a, **kw: normed.append(1) or real_stats(*a, **kw))
    from rosecli.kernels import rotary
    rotations, real_rot = [], rotary.rotary_kv
    monkeypatch.setattr(rotary, "rotary_kv", lambda *a, **kw: rotations.append(1) or real_rot(*a, **kw))
    from rosecli.kernels import paged_decode
    in_decode, real_decode = [], paged_decode.paged_decode_attention
    monkeypatch.setattr(paged_decode, "paged_decode_attention",
                        lambda *a, **kw: in_decode.append(kw.get("rope") is not None) or real_decode(*a, **kw))

    def logits(prior):  # a decode step: `tokens` sequences of one new token after `prior` cached ones
        meta = _decode_step(model, tokens, prior, device)
        with torch.inference_mode():
            hidden = model(ids.to(device), torch.full((tokens,), prior, device=device), meta)
            out = model.compute_logits(hidden)  # (and the decode graph's logits GEMM: the kernel's at one row)
            return out.cpu().float(), model.logits_gemm(hidden, True)[:, :out.shape[1]].cpu().float()

    (on, on_gemm), (on_prior, _) = logits(0), logits(2)
    if kind != "gpt2":  # the Llama family at one row: q and k rotated, K and V stored, by the q/k/v GEMM (`KVOut.rope`)
        # (more rows: by the decode kernel, `launch_table.rope_in_decode`; the rotary kernel never runs)
        assert not rotations and all(in_decode) == (tokens > 1) and any(in_decode) == (tokens > 1)
    assert calls or adds  # the kernel ran
    layers = len(model.attention_layers())
    # one row: every add_norm but the last folded (2 a layer, 2 steps); with the pairs, every add_norm after a GEMM
    # split in two, but the last's second half (the logits are cuBLAS's), and at one row the first layer's first
    # norm (after the embedding) folded
    paired = tokens > 1 or pair
    assert len(folds) == (2 if pair else 0 if tokens > 1 else 4 * layers)
    assert (len(adds), len(normed)) == ((4 * layers, 4 * layers - 2) if paired else (0, 0))
    # the pairs' folds: norm-folded copies of the weights at 2-64 rows, none at one row (the input scaled as read)
    made = [name for m in model.modules() for name in ("_rose_norm_fold", "_rose_norm_scale") if name in m.__dict__]
    assert sorted(set(made)) == (["_rose_norm_fold"] if tokens > 1 else ["_rose_norm_scale"] if pair else [])
    monkeypatch.setattr(common, "SKINNY_GEMM", False)
    calls.clear(), folds.clear(), adds.clear(), normed.clear()
    (off, off_gemm), (off_prior, _) = logits(0), logits(2)
    assert not calls and not folds and not adds and not normed
    with torch.inference_mode():
        want = hf(ids[:, None]).logits[:, 0].float()
    assert rel_err(on, off) < 2e-3 and rel_err(on, want) < 2 * rel_err(off, want) + 1e-3
    assert same_greedy(on, off)  # (the same token, or one tied with it within rounding)
    assert rel_err(on_gemm, on) < 2e-3 and same_greedy(on_gemm, off) and torch.equal(off_gemm, off)
    assert rel_err(on_prior, off_prior) < 2e-3 and same_greedy(on_prior, off_prior)
    assert rel_err(on_prior, on) > 1e-2  # (the cached tokens do move the output)




# the kernel's variants the decode steps launch: one row (vector products) and tensor-core tiles, each plain, with
# the norm prologue, writing the stream's statistics (and the stream times the norm's scale), and reading them; and
# the TMA-loaded tiles (`SkinnyLaunch.tma`), plain and the gate/up + SiLU, split-K
_COMPILE_VARIANTS = """
import sys
import torch
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor
from rosecli.kernels.skinny_gemm import _skinny_kernel as kernel

failed = []
variants = [(dot, *v, False) for dot in (False, True)
            for v in ((0, 0, 0, 0), (2, 0, 0, 0), (0, 0, 1, 1), (2, 1, 0, 0), (1, 1, 0, 0))]
for dot, norm, from_stats, res_out, scaled, tma in variants + [(True, 0, 0, 0, 0, True), (True, 2, 0, 0, 0, True)]:
        swiglu = norm == 2 and not res_out
        consts = dict(BLOCK_M=16 if dot else 1, BLOCK_N=32 if dot else 4, BLOCK_K=128 if dot else 256, SPLIT_K=1,
                      USE_DOT=dot, HAS_BIAS=not swiglu, GELU=False, SWIGLU=swiglu, NORM=norm, HAS_XB=False,
                      HAS_RES=bool(norm) and not from_stats, HAS_NB=norm == 1, KV_STORE=False, KV_HEAD_DIM=1,
                      KV_BLOCK=1, NUM_STAGES=3, PDL=True, FROM_STATS=bool(from_stats), RES_OUT=res_out,
                      STATS_PAD=32, SCALED_OUT=bool(scaled), ROPE=False, PF_LINES=64 if dot else 0, LINE=64,
                      TMA=tma, w_desc=None, x_desc=None)
        if not dot and not res_out and not swiglu:  # Llama's q/k/v at one row: K/V stored, q and k rotated
            consts.update(KV_STORE=True, KV_HEAD_DIM=64, KV_BLOCK=16, ROPE=True)
        descs = {}
        if tma:  # as `skinny_gemm._launch` makes them: [64, 64] weight tiles, [64, 64] x tiles, K in two splits
            consts.update(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1 if swiglu else 2, NORM=0, PF_LINES=0)
            del consts["w_desc"], consts["x_desc"]
            t = torch.empty(128, 128, dtype=torch.float16)
            descs = {n: mangle_type(TensorDescriptor.from_tensor(t, [64, 64])) for n in ("w_desc", "x_desc")}
        f32 = {"part_ptr", "st_ptr", "cos_ptr", "sin_ptr"} | ({"g_ptr", "nb_ptr"} if from_stats else set())
        sig = {n: descs.get(n) or "constexpr" if n in consts or n in descs else "fp32" if n == "eps" else
               "i32" if not n.endswith("_ptr") else "*i32" if n == "ticket_ptr" else
               "*i64" if n in ("slot_ptr", "pos_ptr") else "*fp32" if n in f32 else "*fp16" for n in kernel.arg_names}
        try:
            ptx = compile(ASTSource(kernel, sig, {(kernel.arg_names.index(n),): v for n, v in consts.items()}),
                          target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        except Exception as e:  # noqa: BLE001
            failed.append(f"{consts}: {type(e).__name__}: {str(e)[-600:]}")
            continue
        if ("prefetch.global.L2" in ptx) != (consts["PF_LINES"] > 0):  # (not dropped as an unused result)
            failed.append(f"{consts}: {ptx.count('prefetch.global.L2')} L2 prefetches in the PTX")
        if ("cp.async.bulk.tensor" in ptx) != tma:  # (the TMA unit's loads where asked for, and only there)
            failed.append(f"{consts}: {ptx.count('cp.async.bulk.tensor')} TMA loads in the PTX")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_kernel_variants_compile_for_hopper():
    """The variants the decode steps launch compile for the H100 (sm_90), not only run under the interpreter, which
    takes code Triton's compiler refuses (a function returning a float32 tile on one branch and an fp16 one on
    another ran in the interpreter and failed to compile on the GPU), and those that prefetch into L2 keep their
    prefetches (`pdl.l2_prefetch`, which the interpreter cannot run). In a process of its own: the tests run the
    kernels interpreted."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_VARIANTS], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
