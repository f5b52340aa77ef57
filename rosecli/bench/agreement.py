"""How far a fast path moves what the model says: agreement with the float32 reference.

Two figures, both against the same model run with ``cpu_weights="float"`` (float32):

- greedy: for each of a fixed set of chat prompts (`agreement_prompts`), whether the first
  `GREEDY_TOKENS` greedy tokens are the same (a flip anywhere counts the prompt as changed);
- teacher-forced top-1: over a fixed text of more than 2,000 tokens (`agreement_text`, the
  Apache License 2.0), the share of positions where the most likely next token is the same when
  both read the same text. Unlike greedy text, one flip does not derail the rest.

tests/test_default_model.py holds the default CPU path to its bars; scripts/bench_cpu_generate.py
prints every representation's figures beside its speed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import torch

from rosecli.engine.attention import AttentionMetadata
from rosecli.engine.config import SamplingParams
from rosecli.engine.kv_cache import allocate_kv_cache

GREEDY_TOKENS = 32
TEXT_TOKENS = 2048


def agreement_prompts() -> list[str]:
    return json.loads(resources.files("rosecli.bench").joinpath("data/agreement_prompts.json").read_text())


def agreement_text() -> str:
    return resources.files("rosecli.bench").joinpath("data/agreement_text.txt").read_text()


def text_ids(tokenizer, n: int = TEXT_TOKENS) -> list[int]:
    ids = list(tokenizer(agreement_text())["input_ids"])
    if len(ids) < n:
        raise ValueError(f"the agreement text has {len(ids)} tokens with this tokenizer, fewer than {n}")
    return ids[:n]


def prefill_logits(model: torch.nn.Module, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of one prefill of ``ids``, on a KV pool of its own (the
    model's own KV views are put back after, so an engine that owns the model keeps working)."""
    layers = model.attention_layers()
    saved = [(a.k_cache, a.v_cache) for a in layers]
    n = len(ids)
    num_blocks = -(-n // block_size)
    device = next(model.parameters()).device
    dtype = model.embed_tokens.weight.dtype if hasattr(model, "embed_tokens") else torch.float32
    try:
        allocate_kv_cache(model, num_blocks, block_size, dtype, device)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n, device=device),
                                 block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
                                 context_lens=torch.tensor([n], dtype=torch.int32, device=device),
                                 max_context_len=n,
                                 cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
                                 max_seqlen_q=n)
        with torch.no_grad():
            return model.compute_logits(model(torch.tensor(ids, device=device),
                                              torch.arange(n, device=device), meta)).float()
    finally:
        for a, (k, v) in zip(layers, saved):
            a.k_cache, a.v_cache = k, v


def greedy_outputs(engine, prompts: list[str], n: int = GREEDY_TOKENS) -> list[list[int]]:
    """Greedy token ids of each chat prompt, all prompts in one batch."""
    ids = [engine.inputs.chat(p) for p in prompts]
    return [out.token_ids for out in engine.generate(ids, SamplingParams(max_new_tokens=n))]


@dataclass
class Agreement:
    greedy_same: int  # prompts whose first GREEDY_TOKENS greedy tokens equal the reference's
    prompts: int
    top1: float  # teacher-forced top-1 agreement, 0..1
    positions: int
    changed: list[int]  # indices of the prompts whose greedy text changed

    def line(self) -> str:
        return (f"greedy {self.greedy_same}/{self.prompts} prompts same for {GREEDY_TOKENS} tokens, "
                f"teacher-forced top-1 {100 * self.top1:.2f}% of {self.positions} tokens")


class Reference:
    """The float32 reference's figures, computed once and compared with any number of engines."""

    def __init__(self, engine, prompts: list[str] | None = None):
        self.prompts = prompts or agreement_prompts()
        self.ids = text_ids(engine.tokenizer)
        self.greedy = greedy_outputs(engine, self.prompts)
        self.top1 = prefill_logits(engine.loaded.model, self.ids).argmax(-1)

    def compare(self, engine) -> Agreement:
        out = greedy_outputs(engine, self.prompts)
        changed = [i for i, (a, b) in enumerate(zip(out, self.greedy)) if a != b]
        top1 = prefill_logits(engine.loaded.model, self.ids).argmax(-1)
        return Agreement(len(self.prompts) - len(changed), len(self.prompts),
                         (top1 == self.top1).float().mean().item(), len(self.ids), changed)
