"""Logprobs, prompt logprobs (echo) and ``n`` choices sharing one prefill (issue 18), in the engine:
logprobs against a plain forward of the same tiny model (transformers), choices against separate
seeded requests, the prefill done once and the KV pool full again after."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_utils import tiny_hf_model, tiny_scheduler
from rosecli.engine.config import SamplingParams
from rosecli.engine.errors import ConfigError, RequestError
from rosecli.engine.sequence import FinishReason
from rosecli.engine.streaming import StreamingManager

PROMPT = [5, 9, 33, 7, 100, 12, 44]  # 7 tokens: with blocks of 4 it ends inside its second block


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama")


def _run(sch) -> dict:
    """Step until idle: {request id: {"tokens", "logprobs", "prompt"}}."""
    got: dict = {}
    while sch.has_unfinished():
        for rid, tok in sch.step().items():
            got.setdefault(rid, {"tokens": [], "logprobs": [], "prompt": None})["tokens"].append(tok)
        for rid, e in sch.step_logprobs.items():
            got[rid]["logprobs"].append(e)
        for rid, plp in sch.step_prompt_logprobs.items():
            got[rid]["prompt"] = plp
    sch.pop_finished_ids()
    return got


def _reference(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain forward of the whole sequence: row j predicts token j + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check(entry, token: int, row: torch.Tensor, k: int) -> None:
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
    values, ids = row.topk(k)
    assert [t for t, _ in entry.top] == ids.tolist()
    assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def _sp(**kw) -> SamplingParams:
    kw.setdefault("stop_on_eos", False)
    return SamplingParams(**kw)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_logprobs_are_the_models_log_softmax_for_the_rows_that_asked(hf, overlap):
    sch = tiny_scheduler(hf, block_size=4, num_gpu_blocks=64, overlap_schedule=overlap)
    greedy = sch.add_request(PROMPT, _sp(max_new_tokens=5, logprobs=3))
    # sampled: the logprobs are the model's raw ones whatever the temperature, top-k and penalties
    sampled = sch.add_request(PROMPT[:5], _sp(max_new_tokens=5, temperature=0.7, top_k=20, seed=3, logprobs=0,
                                              presence_penalty=1.0))
    plain = sch.add_request(PROMPT[2:], _sp(max_new_tokens=5))
    got = _run(sch)
    for rid, prompt, k in ((greedy, PROMPT, 3), (sampled, PROMPT[:5], 0)):
        tokens = got[rid]["tokens"]
        ref = _reference(hf, prompt + tokens)
        assert len(got[rid]["logprobs"]) == len(tokens) == 5
        for j, entry in enumerate(got[rid]["logprobs"]):
            _check(entry, tokens[j], ref[len(prompt) - 1 + j], k)
    assert got[plain]["logprobs"] == []
    # asking for logprobs changes no token, of that request or of the others
    alone = tiny_scheduler(hf, block_size=4, num_gpu_blocks=64, overlap_schedule=overlap)
    ids = [alone.add_request(PROMPT, _sp(max_new_tokens=5)),
           alone.add_request(PROMPT[:5], _sp(max_new_tokens=5, temperature=0.7, top_k=20, seed=3, presence_penalty=1.0)),
           alone.add_request(PROMPT[2:], _sp(max_new_tokens=5))]
    again = _run(alone)
    assert [again[i]["tokens"] for i in ids] == [got[i]["tokens"] for i in (greedy, sampled, plain)]


def test_prompt_logprobs_over_chunks_bypass_the_prefix_cache(hf):
    sch = tiny_scheduler(hf, block_size=4, num_gpu_blocks=64, prefill_max_tokens=3)  # prompts in chunks of 3
    sch.add_request(PROMPT, _sp(max_new_tokens=2))
    _run(sch)  # its blocks are cached now
    rid = sch.add_request(PROMPT, _sp(max_new_tokens=2, logprobs=2, prompt_logprobs=2))
    got = _run(sch)[rid]
    assert sch.block_manager.prefix_hit_tokens == 0
    prompt_lp = got["prompt"]
    assert len(prompt_lp) == len(PROMPT) and prompt_lp[0] is None
    ref = _reference(hf, PROMPT + got["tokens"])
    for t in range(1, len(PROMPT)):
        _check(prompt_lp[t], PROMPT[t], ref[t - 1], 2)
        x = ref[t - 1][PROMPT[t]]  # its rank in the distribution (vLLM's prompt_logprobs), ties within 1e-4 either way
        assert int((ref[t - 1] > x + 1e-4).sum()) + 1 <= prompt_lp[t].rank <= int((ref[t - 1] > x - 1e-4).sum()) + 1
    _check(got["logprobs"][0], got["tokens"][0], ref[len(PROMPT) - 1], 2)
    # a request that does not ask still reads the cache
    sch.add_request(PROMPT, _sp(max_new_tokens=1))
    _run(sch)
    assert sch.block_manager.prefix_hit_tokens == 4


def _choices(n: int, **kw) -> list[SamplingParams]:
    base = _sp(**kw)
    return [dataclasses.replace(base, seed=base.seed + i) for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[:4]], ids=["last-block-partial", "last-block-full"])
def test_n_choices_prefill_once_and_equal_separate_seeded_requests(hf, prompt, overlap):
    sch = tiny_scheduler(hf, block_size=4, num_gpu_blocks=64, enable_prefix_cache=False, overlap_schedule=overlap)
    params = _choices(4, max_new_tokens=7, temperature=1.0, seed=10, logprobs=1)
    ids = sch.add_group(prompt, params, [100, 101, 102, 103])
    got = _run(sch)
    assert sch.num_prefill_tokens == len(prompt)  # the prompt was computed once for the four
    assert sch.block_manager.num_free_blocks == sch.block_manager.num_blocks
    assert len({tuple(got[i]["tokens"]) for i in ids}) > 1  # four streams, not one
    for rid, p in zip(ids, params):
        assert len(got[rid]["tokens"]) == 7 and len(got[rid]["logprobs"]) == 7
        alone = sch.add_request(prompt, p)
        one = _run(sch)[alone]
        assert one["tokens"] == got[rid]["tokens"]
        assert [e.logprob for e in one["logprobs"]] == pytest.approx([e.logprob for e in got[rid]["logprobs"]],
                                                                     abs=1e-5)
    assert sch.block_manager.num_free_blocks == sch.block_manager.num_blocks


def test_choices_that_end_before_the_fork_leave_the_others_going(hf):
    sch = tiny_scheduler(hf, block_size=4, num_gpu_blocks=64, prefill_max_tokens=2, enable_prefix_cache=False)
    params = _choices(3, max_new_tokens=4, temperature=1.0, seed=5)
    ids = sch.add_group(PROMPT, params, [7, 8, 9])
    sch.step()  # the first chunk of the prompt
    sch.finish_request(ids[0], FinishReason.ABORT)  # the leader: the next choice takes its place
    sch.finish_request(ids[2], FinishReason.ABORT)
    got = _run(sch)
    assert set(got) == {ids[1]}
    alone = sch.add_request(PROMPT, params[1])
    assert _run(sch)[alone]["tokens"] == got[ids[1]]["tokens"]
    assert sch.block_manager.num_free_blocks == sch.block_manager.num_blocks
    assert not sch.has_unfinished()


def test_n_beyond_the_batch_or_the_pool_is_refused_naming_n(hf):
    sch = tiny_scheduler(hf, block_size=4, num_gpu_blocks=8, max_batch_size=4, prefill_max_batch_size=4)
    sch.check_group(4, 3)
    with pytest.raises(RequestError, match="n=5") as e:
        sch.check_group(5, 3)
    assert e.value.param == "n"
    with pytest.raises(RequestError, match="KV blocks") as e:  # 7 blocks for 24 + 1 tokens, one more per choice
        sch.add_group(list(range(24)), _choices(4, max_new_tokens=1, seed=0), [1, 2, 3, 4])
    assert e.value.param == "n" and not sch.has_unfinished()


def test_logprobs_out_of_range_are_refused_naming_the_field():
    for name in ("logprobs", "prompt_logprobs"):
        for bad in (-1, 21, True, 2.0):
            with pytest.raises(ConfigError, match=name):
                SamplingParams(**{name: bad})


# --- through the streaming manager, as the server and `LLMEngine.generate` drive it ------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_manager_logprobs_and_choices(tiny_engine_factory, device):
    """On CUDA: the decode graph, overlap, and the logprobs' pinned copies."""
    engine = tiny_engine_factory(device=device, overlap_schedule=True)
    m = StreamingManager(engine)
    try:
        prompt = list(range(10, 30))
        plain = m.result(m.add_request(prompt, _sp(max_new_tokens=8)))
        ids = [m.add_request(prompt, _sp(max_new_tokens=8, logprobs=5)), m.add_request(prompt, _sp(max_new_tokens=8))]
        with_lp, other = (m.result(rid) for rid in ids)
        assert with_lp.token_ids == other.token_ids == plain.token_ids and plain.logprobs is None
        assert len(with_lp.logprobs) == 8
        for e, t in zip(with_lp.logprobs, with_lp.token_ids):  # greedy: the chosen token is the most likely
            assert e.token_id == t == e.top[0][0] and e.logprob == pytest.approx(e.top[0][1])
            assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True) and len(e.top) == 5
        echoed = m.result(m.add_request(prompt, _sp(max_new_tokens=1, prompt_logprobs=4)))
        plp = echoed.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None and echoed.token_ids == plain.token_ids[:1]
        for t, e in zip(prompt[1:], plp[1:]):  # each prompt token's rank agrees with the top 4 it is ranked among
            assert e.token_id == t and len(e.top) == 4 and isinstance(e.rank, int)
            assert e.rank >= 1 + sum(v > e.logprob + 1e-3 for _, v in e.top)
            if any(v < e.logprob - 1e-3 for _, v in e.top):
                assert e.rank <= sum(v >= e.logprob - 1e-3 for _, v in e.top)
        params = _choices(4, max_new_tokens=8, temperature=1.0, seed=3)
        before = m.stats()["prefill_tokens"]
        outs = [m.result(r) for r in m.add_choices(prompt, params)]
        assert m.stats()["prefill_tokens"] - before <= len(prompt)  # once (less: prefix-cache hits)
        for p, out in zip(params, outs):
            assert m.result(m.add_request(prompt, p)).token_ids == out.token_ids
        with pytest.raises(RequestError) as e:
            m.add_choices(prompt, _choices(engine.config.max_batch_size + 1, max_new_tokens=1, seed=0))
        assert e.value.param == "n"
        assert m.wait_idle(10) and m.stats()["kv_blocks_used"] == 0
    finally:
        m.close()
