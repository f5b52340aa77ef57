"""Small prefills as CUDA graphs (`rosecli.engine.prefill_graphs`): the padded forward a graph replays gives the
eager prefill's logits and stores the same K/V, and nothing for its padding (CPU, the Triton kernels in the
interpreter); on the GPU, the engine's replayed prefills sample what its eager ones do."""

import pytest
import torch
from engine_utils import our_model, rel_err, tiny_hf_model

from rosecli.engine import prefill_graphs as P
from rosecli.engine.attention import AttentionMetadata
from rosecli.engine.block_manager import slots_of

BS = 4  # tokens per block (small: the batch below spans several blocks and a prefix hit)


def test_bucket_and_pick():
    assert [P.bucket(n, (16, 32, 64)) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, None]
    pg = P.PrefillGraphs(None, torch.device("cpu"), BS, seqs=3, rows=4, tokens=[16, 32])
    assert pg.pick(20, 3, 4, 2) == 32
    assert pg.pick(33, 1, 1, 1) is None  # more tokens than the largest graph
    assert pg.pick(8, 4, 4, 1) is None  # more sequences than the graphs hold
    assert pg.pick(8, 3, 5, 1) is None  # more sampled rows
    assert pg.pick(8, 1, 1, pg.width + 1) is None  # a context wider than the captured block tables


def _caches(model, blocks=16):
    for attn in model.attention_layers():
        g = torch.Generator().manual_seed(7)
        attn.k_cache = torch.randn(blocks, attn.num_kv_heads, BS, attn.head_dim, generator=g)
        attn.v_cache = torch.randn(blocks, attn.num_kv_heads, BS, attn.head_dim, generator=g)
    return [(a.k_cache.clone(), a.v_cache.clone()) for a in model.attention_layers()]


def _batch():
    """Three sequences: a fresh prompt of 5 tokens, one of 1, and the second chunk (5 tokens) of a prompt whose
    first 7 tokens are cached already (a prefix hit: its context is 12)."""
    g = torch.Generator().manual_seed(3)
    tables = [[2, 3], [5], [8, 9, 10]]
    chunks = [(0, 5), (0, 1), (7, 12)]
    ids, pos, slots, cu, ctx, last = [], [], [], [0], [], []
    for table, (start, end) in zip(tables, chunks):
        ids += torch.randint(2, 250, (end - start,), generator=g).tolist()
        pos += list(range(start, end))
        slots += slots_of(table, start, end, BS)
        cu.append(cu[-1] + end - start)
        ctx.append(end)
        last.append(cu[-1] - 1)
    width = max(map(len, tables))
    tables = [t + [0] * (width - len(t)) for t in tables]
    return ids, pos, slots, cu, ctx, tables, last


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_padded_prefill_gives_the_eager_logits_and_stores_nothing_for_its_padding(kind):
    model = our_model(tiny_hf_model(kind, seed=5))
    ids, pos, slots, cu, ctx, tables, last = _batch()
    before = _caches(model)
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32), max_context_len=max(ctx), use_triton=True,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), max_seqlen_q=5, has_prefix=True)
    with torch.inference_mode():
        want = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), meta)[last])
    eager_cache = [(a.k_cache.clone(), a.v_cache.clone()) for a in model.attention_layers()]

    for attn, (k, v) in zip(model.attention_layers(), before):  # the cache as it was (the prefix's blocks too)
        attn.k_cache.copy_(k)
        attn.v_cache.copy_(v)
    pg = P.PrefillGraphs(model, torch.device("cpu"), BS, seqs=5, rows=6, tokens=[16, 32])
    size = pg.pick(len(ids), len(ctx), len(last), len(tables[0]))
    assert size == 16
    pg._stage(ids, pos, slots, cu, ctx, tables, last, size)
    pg.dev.copy_(pg.host)
    with torch.inference_mode():
        got = pg._forward(size)
    assert got.shape[0] == 6  # every row the graph holds; the step's are the first three
    assert rel_err(got[:3], want) < 1e-5
    written = torch.zeros(16 * BS, dtype=torch.bool)
    written[slots] = True
    for attn, (k, v), (ek, ev) in zip(model.attention_layers(), before, eager_cache):
        for cache, old, eager in ((attn.k_cache, k, ek), (attn.v_cache, v, ev)):
            flat = cache.transpose(1, 2).reshape(16 * BS, -1)
            assert torch.equal(flat[~written], old.transpose(1, 2).reshape(16 * BS, -1)[~written])  # padding
            assert torch.allclose(cache, eager, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gpt2", "smollm2-135m"])
def test_small_prefills_replayed_as_graphs_sample_what_eager_prefills_sample(cache_dir, model):
    from rosecli.engine.config import EngineConfig, SamplingParams
    from rosecli.engine.llm import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", device="cuda", dummy_layers=2,
                                    cache_dir=cache_dir, show_progress=False, num_gpu_blocks=2048))
    runner = engine.runner
    pg = runner.prefill_graphs
    assert pg is not None and sorted(pg.graphs) == list(P.TOKENS)
    params = SamplingParams(max_new_tokens=3, stop_on_eos=False, logprobs=3)
    long = list(range(1000, 1090))
    batches = [[[100]], [[200 + i, 7] * (i + 1) for i in range(5)], [[300 + i, 7, 9] for i in range(64)],
               [list(range(500, 700))], [long], [long + [5, 6]]]  # the last two: a prefix-cache hit
    try:
        for prompts in batches:
            results = {}
            for graphs in (pg, None):
                runner.prefill_graphs = graphs
                replays = pg.replays
                outs = engine.generate(prompts, params)
                assert (pg.replays > replays) == (graphs is not None)
                results[graphs is not None] = outs
            for g, e in zip(results[True], results[False]):
                assert g.token_ids[0] == e.token_ids[0]
                for a, b in zip(g.logprobs[0].top, e.logprobs[0].top):
                    assert abs(a[1] - b[1]) < 0.05, (a, b)
    finally:
        runner.prefill_graphs = pg
        engine.close()


@pytest.mark.gpu
def test_first_tokens_sampled_after_a_prefill_graph_replay_the_sampler_as_a_graph(cache_dir):
    """A sampled burst's first tokens (W1's 64 short prompts under S1's top-k + top-p, seeded) come from the
    prefill graph's logits through a sampler graph of their own, captured once and replayed by the next burst
    (launched eagerly, one by one from Python after the graph, they kept the device idle: ~0.3 ms of the burst's
    prefill step on the H200): the same tokens as eager prefills and an eager sampler."""
    from rosecli.engine.config import EngineConfig, SamplingParams
    from rosecli.engine.llm import LLMEngine

    engine = LLMEngine(EngineConfig(model="gpt2", load_format="dummy", device="cuda", dummy_layers=2,
                                    cache_dir=cache_dir, show_progress=False, num_gpu_blocks=2048))
    runner = engine.runner
    pg = runner.prefill_graphs
    prompts = [[300 + i, 7, 9] for i in range(64)]
    params = [SamplingParams(max_new_tokens=1, stop_on_eos=False, temperature=0.8, top_k=50, top_p=0.95, seed=i)
              for i in range(64)]
    try:
        firsts, made = {}, []
        for graphs in (pg, pg, None):
            runner.prefill_graphs = graphs
            replays = pg.replays
            firsts.setdefault(graphs is not None, []).append(
                [o.token_ids[0] for o in engine.generate(prompts, params)])
            assert (pg.replays > replays) == (graphs is not None)
            made.append(dict(runner._prefill_sampler_graphs))
        assert all(v is not None for v in made[0].values()) and made[0]  # captured by the first burst
        assert made[1] == made[0] == made[2]  # replayed by the second (no new key); eager prefills sample eagerly
        assert firsts[True][0] == firsts[True][1] == firsts[False][0]
        assert len(set(firsts[False][0])) > 8  # (sampled, not one argmax for every prompt)
    finally:
        runner.prefill_graphs = pg
        engine.close()
