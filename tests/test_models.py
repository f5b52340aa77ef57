"""Our forward pass against transformers' reference implementation, same random weights."""

import pytest
import torch

from engine_utils import VOCAB, hf_greedy, our_model, tiny_hf_model, tiny_scheduler
from rosecli.engine.attention import AttentionMetadata
from rosecli.engine.config import SamplingParams
from rosecli.engine.kv_cache import allocate_kv_cache

KINDS = ["gpt2", "llama", "qwen2"]


def _prefill_logits(model, ids):
    n = len(ids)
    allocate_kv_cache(model, 64, 4, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n),
                             block_tables=torch.arange(64, dtype=torch.int32)[None],
                             context_lens=torch.tensor([n], dtype=torch.int32), max_context_len=n,
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), max_seqlen_q=n)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta))


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind):
    hf = tiny_hf_model(kind, seed=3)
    ours = our_model(hf)
    ids = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    out = _prefill_logits(ours, ids)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-4


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batched", [False, True])
def test_greedy_continuations_match_transformers(kind, batched):
    hf = tiny_hf_model(kind, seed=5)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (1, 4, 9, 16, 17, 30)]
    refs = [hf_greedy(hf, p, 32) for p in prompts]
    sched = tiny_scheduler(hf, block_size=4, prefill_max_tokens=24)
    params = SamplingParams(max_new_tokens=32, stop_on_eos=False)
    if batched:
        outs = [s.output_token_ids for s in sched.run_to_completion(prompts, params)]
    else:
        outs = [sched.run_to_completion([p], params)[0].output_token_ids for p in prompts]
    assert outs == refs
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
