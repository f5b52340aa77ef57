"""The scheduler's output for one step, which the model runner executes: plain data."""

from __future__ import annotations

from typing import Optional

from rosecli.engine.sequence import Sequence


class StepPlan:
    """One step: the sequences it computes and how many tokens of each.

    Prefill: ``num_new_tokens[i]`` tokens of ``seqs[i]`` from its ``num_computed_tokens`` on (a
    chunk of a longer prompt when that stops short of its end). Decode (``num_new_tokens`` None):
    one token of each sequence, its last, which may be `PENDING` (sampled by the decode step in
    flight and read from that step's output on the device). Either way every token computed
    already has a KV slot in its sequence's block table.

    ``forks`` (prefill): {index in ``seqs``: the other choices of that ``n`` > 1 request}, for a
    sequence whose prompt this step completes; each gets a token sampled from the same logits,
    returned after ``seqs``' own, in order.
    """

    __slots__ = ("is_prefill", "seqs", "num_new_tokens", "forks")

    def __init__(self, is_prefill: bool, seqs: list[Sequence], num_new_tokens: Optional[list[int]] = None,
                 forks: Optional[dict[int, list[Sequence]]] = None):
        self.is_prefill = is_prefill
        self.seqs = seqs
        self.num_new_tokens = num_new_tokens
        self.forks = forks

    @classmethod
    def prefill(cls, seqs: list[Sequence], num_new_tokens: list[int],
                forks: Optional[dict[int, list[Sequence]]] = None) -> "StepPlan":
        return cls(True, seqs, num_new_tokens, forks)

    @classmethod
    def decode(cls, seqs: list[Sequence]) -> "StepPlan":
        return cls(False, seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    def __repr__(self) -> str:
        kind = "prefill" if self.is_prefill else "decode"
        return f"StepPlan({kind}, requests={[s.request_id for s in self.seqs]}, tokens={self.num_new_tokens})"
