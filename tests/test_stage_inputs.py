"""A decode step's inputs read from the host's staging areas by the step's first kernel (`kernels.stage_inputs`), and
its greedy ids written back by the argmax (`logits_argmax`'s ``to_host``): on the CPU through the Triton
interpreter, against the torch reference; on a GPU, an engine's tokens against those of the copies it replaces."""

import pytest
import torch

from rosecli.engine.runner import _Staging
from rosecli.kernels.argmax import logits_argmax
from rosecli.kernels.stage_inputs import pick_ref, publish_ids, stage_inputs, stage_inputs_ref

MB, NB = 4, 40  # a long-context model's tables: 40 blocks a row


def _areas(g, mb=MB, nb=NB):
    n = _Staging.nbytes(mb, nb)
    host = [_Staging(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g), mb, nb) for _ in range(2)]
    for h in host:
        h.header.zero_()
    dev = _Staging(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g), mb, nb)
    dev.header.zero_()
    return host, dev


def _write(g, area: _Staging, seq: int, rows: int, blocks: int) -> None:
    """What the host writes for a step: new fields and tables, the header last."""
    start, _ = _Staging.copied_span(MB, NB, 0)
    area.buf[start:] = torch.randint(0, 256, (area.buf.numel() - start,), dtype=torch.uint8, generator=g)
    area.header[1], area.header[2], area.header[0] = rows, blocks, seq


def _stage(host, dev, rows, programs=None, ref=False, nb=NB):
    start, tables = _Staging.copied_span(MB, nb, 0)
    bufs = (host[0].buf, host[1].buf)
    if ref:
        stage_inputs_ref(bufs, dev.buf, start, tables, nb)
    else:
        stage_inputs(bufs, dev.buf, start, tables, nb, rows, programs=programs)


def _assert_staged(dev, before, area, rows, blocks):
    for name in ("host_ids", "src", "positions", "slots", "context_lens"):
        assert torch.equal(getattr(dev, name), getattr(area, name)), name
    assert torch.equal(dev.block_tables[:rows, :blocks], area.block_tables[:rows, :blocks])
    was = _Staging(before, MB, dev.block_tables.shape[1])
    assert torch.equal(dev.block_tables[:rows, blocks:], was.block_tables[:rows, blocks:])  # columns not copied
    assert torch.equal(dev.block_tables[rows:], was.block_tables[rows:])
    assert torch.equal(dev.tokens[:MB], was.tokens[:MB])  # the device's half of the token pool is left alone
    assert int(dev.header[0]) == int(area.header[0]) and int(dev.header[1]) == 0  # seq staged; programs' count reset


@pytest.mark.parametrize("ref", [False, True], ids=["kernel", "reference"])
def test_each_step_stages_the_oldest_area_the_device_has_not_and_a_replay_the_same_again(ref):
    """Steps overlapped: the host writes step 3 into the other area before the device has staged step 2; the device
    takes 2, then 3, and a replay of step 3 (nothing newer) takes 3 again, never the area being written."""
    g = torch.Generator().manual_seed(0)
    host, dev = _areas(g)
    steps = [  # (area the host writes, seq, rows, blocks) before each staging; None: a replay
        [(1, 1, 2, 3)], [(0, 2, 4, 1), (1, 3, 1, 40)], [], [None], [(0, 6, 3, 7)],  # (seqs 4-5: prefills)
    ]
    expect = [1, 2, 3, 3, 6]
    for written, want in zip(steps, expect):
        for w in written:
            if w is not None:
                _write(g, host[w[0]], *w[1:])
        area = host[want & 1]
        assert pick_ref((host[0].buf, host[1].buf), dev.buf) == want & 1
        before = dev.buf.clone()
        _stage(host, dev, MB, ref=ref)
        _assert_staged(dev, before, area, int(area.header[1]), int(area.header[2]))


def test_several_programs_agree_on_the_area_and_copy_every_row():
    """More words than one program's chunk, over two programs striding: each reads the seq staged before the last
    of them moves it, so none takes the newer area."""
    g = torch.Generator().manual_seed(1)
    nb = 700  # 4 rows x 700 columns: 2,800 words of tables, 3 chunks
    n = _Staging.nbytes(MB, nb)
    host = [_Staging(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g), MB, nb) for _ in range(2)]
    dev = _Staging(torch.zeros(n, dtype=torch.uint8), MB, nb)
    for h in host:
        h.header.zero_()
    host[1].header[1], host[1].header[2], host[1].header[0] = 4, 650, 5
    host[0].header[1], host[0].header[2], host[0].header[0] = 4, 700, 6  # the next step, already written
    for programs, want in ((2, 1), (3, 0)):
        _stage(host, dev, 4, programs=programs, nb=nb)
        area = host[want]
        assert int(dev.header[0]) == int(area.header[0]) and int(dev.header[1]) == 0
        cols = int(area.header[2])
        assert torch.equal(dev.block_tables[:4, :cols], area.block_tables[:4, :cols])
        assert torch.equal(dev.positions, area.positions) and torch.equal(dev.context_lens, area.context_lens)


def test_areas_of_another_layout_are_refused():
    host = [torch.zeros(256, dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(ValueError, match="one size"):
        stage_inputs((host[0], host[1]), torch.zeros(128, dtype=torch.uint8), 64, 128, 4, 1)
    with pytest.raises(ValueError, match="whole int32 words"):
        stage_inputs((host[0], host[1]), torch.zeros(256, dtype=torch.uint8), 66, 128, 4, 1)


@pytest.mark.parametrize("seq", [6, 7])
def test_the_argmax_writes_the_ids_into_the_host_buffer_of_the_steps_parity(seq):
    g = torch.Generator().manual_seed(seq)
    raw = torch.randn(5, 300, generator=g).half()
    hosts = [torch.full((8,), -1, dtype=torch.long) for _ in range(2)]
    header = torch.zeros(8, dtype=torch.long)
    header[0] = seq
    tokens = torch.zeros(5, dtype=torch.long)
    _, ids = logits_argmax(raw, 290, copy_to=tokens, to_host=(hosts[0], hosts[1], header))
    want = raw[:, :290].float().argmax(dim=-1)
    assert torch.equal(ids, want) and torch.equal(tokens, want)
    assert torch.equal(hosts[seq & 1][:5], want) and (hosts[seq & 1][5:] == -1).all()
    assert (hosts[(seq & 1) ^ 1] == -1).all()  # the other step's buffer, which the host may be reading, is left


@pytest.mark.parametrize("seq", [4, 9])
def test_sampled_ids_go_to_the_token_pool_and_the_host_buffer_of_the_steps_parity(seq):
    ids = torch.tensor([7, 3, 99], dtype=torch.long)
    tokens = torch.full((8,), -5, dtype=torch.long)
    hosts = [torch.full((8,), -1, dtype=torch.long) for _ in range(2)]
    header = torch.zeros(8, dtype=torch.long)
    header[0] = seq
    publish_ids(ids, tokens, (hosts[0], hosts[1]), header, 8)
    assert tokens.tolist() == [7, 3, 99] + [-5] * 5  # the sampled half of the pool, these rows only
    assert hosts[seq & 1].tolist() == [7, 3, 99] + [-1] * 5 and (hosts[(seq & 1) ^ 1] == -1).all()
    with pytest.raises(ValueError, match="in a block of 2"):
        publish_ids(ids, tokens, (hosts[0], hosts[1]), header, 2)


@pytest.mark.gpu
def test_an_engine_reading_its_inputs_in_the_step_says_what_the_copies_say(tiny_engine_factory, monkeypatch):
    """The tokens of greedy and seeded sampled rows, steps overlapped, contexts over several blocks, a batch that
    shrinks as rows finish (padded graph rows): the same with the inputs read by the step's first kernel and the
    greedy ids written by its argmax, as with the copies before and after the step (ROSE_STAGE_KERNEL=0)."""
    from rosecli.engine.config import SamplingParams

    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(6)]
    params = [SamplingParams(max_new_tokens=24 + 4 * i, stop_on_eos=False,
                             **({"temperature": 0.8, "seed": i} if i % 2 else {})) for i in range(len(prompts))]
    allowed = [7, 70, 700, 7000]  # a row limited to these (the sampler's graph with its bitmask)
    params[2] = SamplingParams(max_new_tokens=20, stop_on_eos=False, temperature=0.9, seed=9, allowed_token_ids=allowed)
    outs = []
    for staged in ("1", "0"):
        monkeypatch.setenv("ROSE_STAGE_KERNEL", staged)
        engine = tiny_engine_factory(device="cuda", seed=3)
        assert engine.runner._stage_kernel == (staged == "1")  # (the start-up check passed)
        outs.append([o.token_ids for o in engine.generate(prompts, params)])
        assert set(outs[-1][2]) <= set(allowed)
        greedy = [o.token_ids for o in engine.generate(prompts[:2], [SamplingParams(max_new_tokens=30,
                                                                                   stop_on_eos=False)] * 2)]
        outs[-1].append(greedy)
    assert outs[0] == outs[1]


@pytest.mark.gpu
def test_a_device_that_cannot_read_the_areas_falls_back_to_the_copies(tiny_engine_factory, monkeypatch):
    import rosecli.engine.runner as runner_mod
    from rosecli.engine.config import SamplingParams

    def unreadable(*args, **kwargs):
        raise RuntimeError("pointer argument cannot be accessed from Triton")

    prompts = [list(range(5, 30))]
    params = [SamplingParams(max_new_tokens=12, stop_on_eos=False)]
    want = [o.token_ids for o in tiny_engine_factory(device="cuda", seed=3).generate(prompts, params)]
    monkeypatch.setattr(runner_mod, "stage_inputs", unreadable)
    engine = tiny_engine_factory(device="cuda", seed=3)
    assert engine.runner._stage_kernel is False
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
