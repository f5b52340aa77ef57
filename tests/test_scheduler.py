"""Continuous batching, chunked prefill, preemption, prefix cache and stopping."""

import pytest
import torch

from engine_utils import VOCAB, hf_greedy, tiny_hf_model, tiny_scheduler
from rosecli.engine.config import SamplingParams
from rosecli.engine.errors import RequestError
from rosecli.engine.inputs import InputProcessor


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=11)


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def overlap(request):
    """Every scheduling test runs with and without overlap scheduling (launch step N+1, then read step N)."""
    return request.param


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_preemption_keeps_outputs_identical(hf, overlap):
    prompts = _prompts((3, 9, 14, 20, 7, 11, 25, 5), 1)
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    sched = tiny_scheduler(hf, overlap_schedule=overlap, block_size=4, num_gpu_blocks=24, max_batch_size=8)
    seqs = sched.run_to_completion(prompts, SamplingParams(max_new_tokens=24, stop_on_eos=False))
    assert sched.num_preemptions > 0, "the pool was meant to be too small for all requests at once"
    assert [s.output_token_ids for s in seqs] == refs
    assert sched.block_manager.num_free_blocks == 24


def test_requests_join_and_leave_every_step(hf, overlap):
    prompts = _prompts((5, 6, 7, 8), 2)
    lengths = [3, 9, 1, 6]
    refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    sched = tiny_scheduler(hf, overlap_schedule=overlap, block_size=4)
    ids = [sched.add_request(prompts[0], SamplingParams(max_new_tokens=lengths[0], stop_on_eos=False))]
    finished, step = [], 0
    while sched.has_unfinished() or len(ids) < 4:
        if step in (1, 2, 4) and len(ids) < 4:
            i = len(ids)
            ids.append(sched.add_request(prompts[i], SamplingParams(max_new_tokens=lengths[i], stop_on_eos=False)))
        sched.step()
        finished += sched.pop_finished_ids()
        step += 1
    assert sorted(finished) == sorted(ids)
    assert [sched.get(i).output_token_ids for i in ids] == refs
    assert all(sched.get(i).finish_reason.value == "length" for i in ids)


def test_chunked_prefill_interleaves_decode(hf, overlap):
    sched = tiny_scheduler(hf, overlap_schedule=overlap, block_size=4, prefill_max_tokens=8)
    short = sched.add_request(_prompts((3,), 3)[0], SamplingParams(max_new_tokens=50, stop_on_eos=False))
    sched.step()  # prefill the short one
    long_prompt = _prompts((40,), 4)[0]
    sched.add_request(long_prompt, SamplingParams(max_new_tokens=2, stop_on_eos=False))
    produced = []
    for _ in range(10):
        produced.append(short in sched.step())
    # the 40-token prompt needs 5 chunks of 8; the running stream must get a token at least every other step
    assert all(produced[i] or produced[i + 1] for i in range(len(produced) - 1))


def test_prefix_cache_hits_and_outputs_equal(hf, overlap):
    shared = _prompts((20,), 5)[0]
    tails = _prompts((3, 9, 1), 6)
    prompts = [shared + t for t in tails] + [shared[:16], shared]
    refs = [hf_greedy(hf, p, 10) for p in prompts]
    sched = tiny_scheduler(hf, overlap_schedule=overlap, block_size=4)
    params = SamplingParams(max_new_tokens=10, stop_on_eos=False)
    first = sched.run_to_completion([shared + [7]], params)
    seqs = sched.run_to_completion(prompts, params)
    assert [s.output_token_ids for s in seqs] == refs
    assert all(s.num_cached_tokens >= 12 for s in seqs), [s.num_cached_tokens for s in seqs]
    # a prompt fully made of cached blocks still computes its last token
    assert seqs[3].num_cached_tokens == 12 and seqs[3].output_token_ids == refs[3]
    bm = sched.block_manager
    assert bm.prefix_hit_rate > 0.5
    assert bm.num_free_blocks == bm.num_blocks
    assert first[0].num_cached_tokens == 0


def test_no_prefix_cache_means_no_hits(hf, overlap):
    shared = _prompts((20,), 5)[0]
    sched = tiny_scheduler(hf, overlap_schedule=overlap, block_size=4, enable_prefix_cache=False)
    params = SamplingParams(max_new_tokens=3, stop_on_eos=False)
    sched.run_to_completion([shared], params)
    seqs = sched.run_to_completion([shared + [3]], params)
    assert seqs[0].num_cached_tokens == 0 and sched.block_manager.prefix_hit_tokens == 0


def test_stop_on_eos_and_stop_token_ids(hf, overlap):
    prompt = _prompts((6,), 7)[0]
    ref = hf_greedy(hf, prompt, 12)
    eos = ref[4]
    sched = tiny_scheduler(hf, overlap_schedule=overlap, block_size=4, eos=(eos,))
    seq = sched.run_to_completion([prompt], SamplingParams(max_new_tokens=12))[0]
    assert seq.output_token_ids == ref[:ref.index(eos) + 1] and seq.finish_reason.value == "stop"
    seq = sched.run_to_completion([prompt], SamplingParams(max_new_tokens=12, stop_on_eos=False))[0]
    assert seq.output_token_ids == ref and seq.finish_reason.value == "length"
    seq = sched.run_to_completion([prompt], SamplingParams(max_new_tokens=12, stop_on_eos=False,
                                                           stop_token_ids=[ref[2]]))[0]
    assert seq.output_token_ids == ref[:ref.index(ref[2]) + 1]


def test_stops_at_model_context(hf, overlap):
    sched = tiny_scheduler(hf, overlap_schedule=overlap, block_size=4)
    prompt = _prompts((250,), 8)[0]
    seq = sched.run_to_completion([prompt], SamplingParams(max_new_tokens=100, stop_on_eos=False))[0]
    assert len(seq.token_ids) == 256 and seq.finish_reason.value == "length"


def _inputs(sched) -> InputProcessor:
    """The input processor an engine puts in front of this scheduler (token ids only: no tokenizer)."""
    return InputProcessor(None, sched.max_model_len, VOCAB, sched.block_manager)


def test_bad_requests_are_refused_clearly(hf, overlap):
    sched = tiny_scheduler(hf, overlap_schedule=overlap, block_size=4)
    inputs = _inputs(sched)
    with pytest.raises(RequestError, match="empty"):
        inputs.process([], SamplingParams())
    with pytest.raises(RequestError, match="context is 256"):
        inputs.process(list(range(2, 300)), SamplingParams())
    with pytest.raises(RequestError, match="token id 256 is outside the vocabulary") as e:
        inputs.check_token_ids([5, VOCAB], "stop_token_ids")
    assert e.value.param == "stop_token_ids"
    assert inputs.process(list(range(2, 255)), SamplingParams()) == list(range(2, 255))  # the longest that fits


def test_discard_releases_blocks_at_once(hf, overlap):
    sched = tiny_scheduler(hf, overlap_schedule=overlap, block_size=4)
    rid = sched.add_request(_prompts((30,), 9)[0], SamplingParams(max_new_tokens=50, stop_on_eos=False))
    sched.step()
    sched.step()
    assert sched.block_manager.num_used_blocks > 0
    sched.discard_request(rid)
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_unfinished()
    assert sched.pop_finished_ids() == []


def test_prompt_that_can_never_fit_the_pool_is_refused(hf, overlap):
    sched = tiny_scheduler(hf, overlap_schedule=overlap, block_size=4, num_gpu_blocks=3)
    inputs = _inputs(sched)
    with pytest.raises(RequestError, match="needs 4 KV blocks of 4 tokens.*has 3 blocks"):
        inputs.process(_prompts((12,), 12)[0], SamplingParams())
    with pytest.raises(RequestError, match="outside the vocabulary"):
        inputs.process([5, VOCAB], SamplingParams())
    with pytest.raises(RequestError, match="outside the vocabulary"):
        inputs.process([-1, 5], SamplingParams())
    with pytest.raises(RequestError, match="integers"):
        inputs.process([5, 6.0], SamplingParams())
    # the longest prompt that fits runs to the end of the pool
    seq = sched.run_to_completion([inputs.process(_prompts((11,), 12)[0])],
                                  SamplingParams(max_new_tokens=5, stop_on_eos=False))[0]
    assert seq.finish_reason.value == "length" and sched.block_manager.num_used_blocks == 0


def _run_bounded(sched, prompts, params, max_steps=200):
    """run_to_completion, but a scheduler that loops fails the test instead of hanging it."""
    seqs = [sched.get(sched.add_request(p, params)) for p in prompts]
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        sched.step()
    assert not sched.has_unfinished(), f"still unfinished after {max_steps} steps: {seqs}"
    sched.pop_finished_ids()
    return [sched.pop_request(s.request_id) for s in seqs]


def test_outgrowing_the_whole_pool_finishes_with_length(hf, overlap):
    """Alone, a request that would need more blocks than the pool has stops when the pool is full
    (it used to be preempted and re-admitted forever); two such requests take turns by preemption."""
    prompts = _prompts((3, 4), 13)  # both admitted at once (a block each), then they outgrow the pool
    sched = tiny_scheduler(hf, overlap_schedule=overlap, block_size=4, num_gpu_blocks=3)
    params = SamplingParams(max_new_tokens=100, stop_on_eos=False)
    seq = _run_bounded(sched, prompts[:1], params)[0]
    assert len(seq.token_ids) == 12 and seq.finish_reason.value == "length"
    assert seq.output_token_ids == hf_greedy(hf, prompts[0], 9)
    seqs = _run_bounded(sched, prompts, params)
    assert [len(s.token_ids) for s in seqs] == [12, 12] and sched.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == [hf_greedy(hf, p, 12 - len(p)) for p in prompts]
    assert all(s.finish_reason.value == "length" for s in seqs)
    assert sched.block_manager.num_free_blocks == 3


def test_slot_mapping_of_a_range_equals_the_slots_of_each_position():
    from rosecli.engine.block_manager import slot_of, slots_of

    table = [7, 2, 9, 4]
    for bs in (1, 3, 4):
        for start in range(0, len(table) * bs):
            for end in range(start, len(table) * bs + 1):
                expect = [table[p // bs] * bs + p % bs for p in range(start, end)]
                assert slots_of(table, start, end, bs) == expect
                assert [slot_of(table, p, bs) for p in range(start, end)] == expect
