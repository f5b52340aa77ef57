"""Overlap scheduling: step N+1 is launched before step N's tokens are read. Same tokens as the
synchronous scheduler in every situation where the two could differ."""

import pytest
import torch

from engine_utils import VOCAB, hf_greedy, tiny_hf_model, tiny_scheduler
from rosecli.engine.config import SamplingParams
from rosecli.engine.sequence import PENDING


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("gpt2", seed=5)


def _prompts(n, seed, lo=1, hi=30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def _run(hf, prompts, params, arrivals=None, **kw):
    """Outputs, finish reasons and the scheduler, with requests joining at the given steps."""
    sched = tiny_scheduler(hf, **kw)
    arrivals = arrivals or [0] * len(prompts)
    ids, step = [None] * len(prompts), 0
    while any(i is None for i in ids) or sched.has_unfinished():
        for i, at in enumerate(arrivals):
            if at == step and ids[i] is None:
                ids[i] = sched.add_request(prompts[i], params[i])
        sched.step()
        step += 1
    seqs = [sched.get(i) for i in ids]
    return [s.output_token_ids for s in seqs], [s.finish_reason.value for s in seqs], sched


def test_eos_mid_flight_drops_the_extra_token_and_matches_sync(hf):
    prompts = _prompts(12, 1)
    refs = [hf_greedy(hf, p, 20) for p in prompts]
    # each request's EOS is a token it produces at a different point, so stops land while the next step runs
    eos = sorted({r[i % 7 + 2] for i, r in enumerate(refs[:4])})
    arrivals = [0, 0, 0, 1, 2, 2, 3, 5, 8, 8, 9, 13]
    params = [SamplingParams(max_new_tokens=20) for _ in prompts]
    runs = {ov: _run(hf, prompts, params, arrivals, overlap_schedule=ov, eos=eos, block_size=4, max_batch_size=16)
            for ov in (False, True)}
    assert runs[True][:2] == runs[False][:2]
    outs, reasons, sched = runs[True]
    assert reasons.count("stop") >= 4
    for out, ref, reason in zip(outs, refs, reasons):
        assert PENDING not in out
        cut = next((j for j, t in enumerate(ref) if t in eos), None)
        assert out == (ref[:cut + 1] if cut is not None else ref)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_more_running_than_max_batch_takes_turns(hf):
    prompts = _prompts(10, 2)
    lengths = [5, 17, 9, 30, 12, 3, 22, 8, 15, 11]
    params = [SamplingParams(max_new_tokens=n, stop_on_eos=False) for n in lengths]
    outs, reasons, sched = _run(hf, prompts, params, overlap_schedule=True, block_size=4, max_batch_size=4,
                                max_active_requests=10)
    assert outs == [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    assert reasons == ["length"] * 10
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_pool_too_small_preempts_and_matches_sync(hf):
    prompts = _prompts(8, 3, 3, 20)
    params = [SamplingParams(max_new_tokens=24, stop_on_eos=False)] * 8
    outs, _, sched = _run(hf, prompts, params, overlap_schedule=True, block_size=4, num_gpu_blocks=24,
                          max_batch_size=8)
    assert sched.num_preemptions > 0
    assert outs == [hf_greedy(hf, p, 24) for p in prompts]
    assert sched.block_manager.num_free_blocks == 24


def test_seeded_sampling_matches_sync(hf):
    prompts = _prompts(6, 4)
    params = [SamplingParams(max_new_tokens=15, temperature=0.8, top_k=40, seed=100 + i, stop_on_eos=False)
              for i in range(6)]
    outs = {ov: _run(hf, prompts, params, overlap_schedule=ov, block_size=4)[0] for ov in (False, True)}
    assert outs[True] == outs[False]


def test_step_returns_last_launched_tokens_and_discard_mid_flight_frees_blocks(hf):
    sched = tiny_scheduler(hf, overlap_schedule=True, block_size=4)
    params = SamplingParams(max_new_tokens=40, stop_on_eos=False)
    keep, drop = (sched.add_request(p, params) for p in _prompts(2, 5, 5, 9))
    first = sched.step()  # prefill: both first tokens at once
    assert set(first) == {keep, drop}
    assert sched.step() == {}  # decode step 1 launched, not read yet
    assert set(sched.step()) == {keep, drop}  # step 2 launched, step 1 read
    sched.discard_request(drop)  # while step 2 is in flight
    while sched.has_unfinished():
        assert drop not in sched.step()
    seq = sched.get(keep)
    assert seq.output_token_ids == hf_greedy(hf, seq.token_ids[:seq.num_prompt_tokens], 40)
    assert sched.block_manager.num_used_blocks == 0


def test_a_step_in_flight_with_only_finished_requests_is_not_waited_for(hf):
    sched = tiny_scheduler(hf, overlap_schedule=True, block_size=4)
    prompt = _prompts(1, 6, 5, 9)[0]
    ref = hf_greedy(hf, prompt, 8)
    sched.run_to_completion([prompt], SamplingParams(max_new_tokens=8, stop_on_eos=False, stop_token_ids=[ref[3]]))
    # it stopped at its 4th token while its 5th step was in flight: that step is dropped, not read later
    assert sched.step() == {} and sched.last_step_kind == "idle"
    rid = sched.add_request(prompt, SamplingParams(max_new_tokens=3, stop_on_eos=False))
    assert rid in sched.step(), "the next request's first step is its prefill"
