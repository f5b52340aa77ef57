"""A decode step's first kernel (`kernels.embed.gather_embed`: each row's id from the token pool and its embedding
rows) and the argmax that writes the next step's ids into the pool (`logits_argmax`'s ``copy_to``)."""

import pytest
import torch

from rosecli.kernels.argmax import logits_argmax, logits_argmax_ref
from rosecli.kernels.embed import gather_embed, gather_embed_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width,pos", [(64, True), (768, True), (1500, False)])
def test_gather_embed_takes_each_rows_id_from_the_pool_and_gathers_its_rows(dtype, width, pos):
    g = torch.Generator().manual_seed(width)
    vocab, mb = 300, 5
    table = torch.randn(vocab, width, generator=g).to(dtype)
    ptable = torch.randn(40, width, generator=g).to(dtype) if pos else None
    tokens = torch.randint(0, vocab, (2 * mb,), generator=g)  # [last step's samples | the host's ids]
    src = torch.tensor([0, mb + 1, 3, mb + 4])  # rows from both halves, out of order
    positions = torch.tensor([7, 0, 39, 12]) if pos else None
    x, res = gather_embed(tokens, src, table, positions, ptable)
    want_x, want_res = gather_embed_ref(tokens, src, table, positions, ptable)
    assert x.dtype == dtype and x.shape == (4, width) and torch.equal(x, want_x)
    assert torch.equal(x[1], table[tokens[mb + 1]]) and torch.equal(x[2], table[tokens[3]])
    if pos:
        assert torch.equal(res, want_res) and torch.equal(res[2], ptable[39])
    else:
        assert res is None


def test_gather_embed_with_no_rows_and_bad_tables():
    table = torch.randn(10, 16)
    tokens, src = torch.tensor([3, 4]), torch.tensor([1])
    x, res = gather_embed(tokens, src[:0], table)
    assert x.shape == (0, 16) and res is None
    with pytest.raises(ValueError, match="a position table needs the positions"):
        gather_embed(tokens, src, table, torch.tensor([0]), None)
    with pytest.raises(ValueError, match="contiguous rows of one width"):
        gather_embed(tokens, src, torch.randn(16, 10).t())
    with pytest.raises(ValueError, match="contiguous rows of one width"):
        gather_embed(tokens, src, table, torch.tensor([0]), torch.randn(4, 8))


def test_logits_argmax_also_writes_the_ids_into_the_pool_and_nothing_else():
    g = torch.Generator().manual_seed(2)
    raw = (torch.randn(3, 1100, generator=g) * 3).half()
    raw[:, 1000:] = 1e4  # padding columns: never an answer
    pool = torch.full((6,), -5, dtype=torch.int64)
    logits, ids = logits_argmax(raw, 1000, copy_to=pool[:3])
    want_logits, want_ids = logits_argmax_ref(raw, 1000)
    assert ids.tolist() == want_ids.tolist() == pool[:3].tolist()
    assert pool[3:].tolist() == [-5, -5, -5] and torch.equal(logits, want_logits)


@pytest.mark.gpu
@pytest.mark.parametrize("width,pos", [(768, True), (2048, False), (4096, False)])
def test_gather_embed_on_cuda_is_the_reference(width, pos):
    g = torch.Generator(device="cuda").manual_seed(width)
    vocab, mb = 50304, 64
    table = torch.randn(vocab, width, device="cuda", generator=g).to(torch.bfloat16)
    ptable = torch.randn(1024, width, device="cuda", generator=g).to(torch.bfloat16) if pos else None
    tokens = torch.randint(0, vocab, (2 * mb,), device="cuda", generator=g)
    src = torch.randperm(2 * mb, device="cuda", generator=g)[:mb]
    positions = torch.randint(0, 1024, (mb,), device="cuda", generator=g) if pos else None
    x, res = gather_embed(tokens, src, table, positions, ptable)
    want_x, want_res = gather_embed_ref(tokens, src, table, positions, ptable)
    assert torch.equal(x, want_x) and (res is None) == (not pos) and (res is None or torch.equal(res, want_res))
