"""Sampling through the engine (the runner's SamplerState; its kernels are tested against their
references in test_sampler_state.py): seeds repeat, top-k=1 is greedy, penalties, logit_bias and
min_tokens change what the model says exactly as transformers' logits processors do."""

import pytest
import torch

from engine_utils import tiny_hf_model, tiny_scheduler
from rosecli.engine.config import SamplingParams
from rosecli.engine.errors import RequestError


def _run(sched, prompts, params):
    return [s.output_token_ids for s in sched.run_to_completion(prompts, params)]


def test_seeded_runs_repeat_and_top_k_1_is_greedy():
    hf = tiny_hf_model("gpt2", seed=1)
    prompts = [[5, 6, 7], [9, 10]]
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, stop_on_eos=False)
    a = _run(tiny_scheduler(hf, seed=7), prompts, sampled)
    b = _run(tiny_scheduler(hf, seed=7), prompts, sampled)
    c = _run(tiny_scheduler(hf, seed=8), prompts, sampled)
    assert a == b and a != c
    greedy = _run(tiny_scheduler(hf), prompts, SamplingParams(max_new_tokens=16, stop_on_eos=False))
    topk1 = _run(tiny_scheduler(hf, seed=3), prompts,
                 SamplingParams(max_new_tokens=16, temperature=1.5, top_k=1, stop_on_eos=False))
    assert topk1 == greedy


def test_per_request_seed_does_not_depend_on_batch():
    hf = tiny_hf_model("llama", seed=2)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234, stop_on_eos=False)
    alone = _run(tiny_scheduler(hf, seed=1), [[3, 4, 5]], params)[0]
    other = SamplingParams(max_new_tokens=12, temperature=0.8, stop_on_eos=False)
    batched = tiny_scheduler(hf, seed=99).run_to_completion([[8, 9], [3, 4, 5]], [other, params])
    assert batched[1].output_token_ids == alone


def _hf_generate(hf, prompt, n, **kw):
    """transformers' greedy decoding with its logits processors (eos never stops it)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_greedy_matches_transformers():
    hf = tiny_hf_model("llama", seed=4)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = _run(tiny_scheduler(hf), [prompt], SamplingParams(max_new_tokens=12, stop_on_eos=False))[0]
    params = SamplingParams(max_new_tokens=12, stop_on_eos=False, repetition_penalty=1.8)
    ours = _run(tiny_scheduler(hf), [prompt], params)[0]
    assert ours == _hf_generate(hf, prompt, 12, repetition_penalty=1.8, eos_token_id=None, min_new_tokens=12)
    assert ours != plain  # the penalty changed what the model says


def test_logit_bias_and_min_tokens_through_the_engine():
    hf = tiny_hf_model("gpt2", seed=5)
    prompt = [11, 12, 13]
    forced = _run(tiny_scheduler(hf), [prompt], SamplingParams(max_new_tokens=5, stop_on_eos=False,
                                                               logit_bias={42: 100.0}))[0]
    assert forced == [42] * 5
    # EOS (id 1 in the tiny scheduler) biased to win: without min_tokens the request stops at once,
    # with min_tokens=4 EOS is held back for four tokens, then it stops
    eos_first = SamplingParams(max_new_tokens=10, logit_bias={1: 100.0})
    assert _run(tiny_scheduler(hf), [prompt], eos_first)[0] == [1]
    held = SamplingParams(max_new_tokens=10, logit_bias={1: 100.0}, min_tokens=4)
    out = _run(tiny_scheduler(hf), [prompt], held)[0]
    assert len(out) == 5 and 1 not in out[:4] and out[4] == 1


def test_penalties_in_a_mixed_batch_leave_greedy_rows_alone():
    hf = tiny_hf_model("llama", seed=6)
    prompts = [[3, 4, 5, 3, 4], [8, 9, 8, 9]]
    greedy = SamplingParams(max_new_tokens=10, stop_on_eos=False)
    alone = _run(tiny_scheduler(hf), [prompts[0]], greedy)[0]
    pen = SamplingParams(max_new_tokens=10, stop_on_eos=False, presence_penalty=1.5, frequency_penalty=1.0)
    sched = tiny_scheduler(hf)
    mixed = _run(sched, prompts, [greedy, pen])
    assert mixed[0] == alone
    assert mixed[1] == _run(tiny_scheduler(hf), [prompts[1]], pen)[0]
    assert sched.block_manager.num_used_blocks == 0 and not sched.runner.sampler.active.any()  # slots back


def test_logit_bias_outside_the_vocabulary_is_refused_when_added():
    sched = tiny_scheduler(tiny_hf_model("gpt2", seed=1))
    with pytest.raises(RequestError, match="logit_bias: token id 1000000 is outside the vocabulary"):
        sched.add_request([1, 2], SamplingParams(logit_bias={10 ** 6: 1.0}))


def test_every_sampling_slot_is_free_after_start_up_and_after_each_request():
    """The start-up warm-up steps and every finished, aborted or preempted-then-finished request give
    their slot back: a full batch of max_batch_size requests is admitted again and again."""
    hf = tiny_hf_model("llama", seed=8)
    sched = tiny_scheduler(hf, max_batch_size=4, prefill_max_batch_size=4)
    sched.runner._warmup_kernels()  # what prepare() runs on CUDA before capturing graphs
    sched.runner._warmup_sampler()
    assert not sched.runner.sampler.active.any()
    params = SamplingParams(max_new_tokens=3, stop_on_eos=False, temperature=0.7, seed=1)
    for _ in range(3):
        outs = sched.run_to_completion([[5, 6], [7, 8], [9, 10], [11, 12]], params)
        assert all(len(s.output_token_ids) == 3 for s in outs)
        assert not sched.runner.sampler.active.any()


@pytest.mark.parametrize("vocab", [49_152, 50_257, 128_256, 151_936])
def test_every_batch_size_uses_a_kernel_variant_the_start_up_warm_up_compiled(vocab):
    """The sampler's passes compile a variant per chunk count: each batch size must map to one that
    the runner's warm-up (one batch per `batch_classes` bucket) compiled, or serving stalls on a
    compile (seconds) the first time a batch of a new size samples (seen on the H100: 6 s of TTFT)."""
    from rosecli.kernels import sampling as K

    K._SMS[0] = 132  # an H100's multiprocessors (no GPU needed: only the count is read)
    dev = torch.device("cuda", 0)
    for most in (1, 8, 64, 256):
        warmed = {K._split(b, vocab, dev) for b in K.batch_classes(most)}
        assert max(K.batch_classes(most)) == most
        for B in range(1, most + 1):
            assert K._split(B, vocab, dev) in warmed, (most, B)
        assert len(warmed) <= 5
