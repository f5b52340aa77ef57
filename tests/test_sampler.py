"""Sampling: seeds repeat, top-k=1 is greedy, top-p keeps the smallest nucleus."""

import torch

from engine_utils import VOCAB, tiny_hf_model, tiny_scheduler
from rosecli.engine.config import SamplingParams
from rosecli.engine.sampler import apply_top_k_top_p, sample


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    for p, kept in ((0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.95, 3), (0.96, 4), (1.0, 4)):
        out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([p]))
        assert torch.isfinite(out).sum().item() == kept, p


def test_top_k_keeps_k_and_renormalises_before_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False, False]]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    ids = sample(logits, [1.0] * 4000, [0] * 4000, [1.0] * 4000, [None] * 4000, g)
    freq = torch.bincount(ids, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


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
