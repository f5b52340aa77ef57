"""Logprobs: what the engine reports next to each token id when a request asks.

Which logprob (vLLM's documented default, ``logprobs_mode="raw_logprobs"``): the log_softmax of
the model's logits as they leave the model, before logit_bias, penalties, temperature, min_p,
top-k and top-p. So the numbers are the model's distribution whatever the request samples with,
and a greedy and a sampled request over the same text report the same values.

Computed on the device, for the rows of a batch whose request asked and no other: one
log_softmax and one top-k over those rows (``k`` the largest any of them asked for), the chosen
token's logprob gathered after sampling; the host gets them with one copy per step. A step where
no request asked does none of this (the greedy decode graph's argmax stays the whole answer).

Prompt logprobs (``echo`` with logprobs) need the logits of every prompt position: the prefill
computes them in slices of `PROMPT_SLICE` rows, only for the requests that asked; such a request
bypasses the prefix cache (a cached block has no logits to report).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs (and vLLM's default max_logprobs)
PROMPT_SLICE = 512  # prompt positions whose full-vocabulary logits exist at once


@dataclass
class TokenLogprobs:
    """One position: the token there, its logprob, and the ``k`` most likely tokens (id, logprob),
    most likely first (``k`` as the request asked; empty for 0); for a prompt position also the token's
    rank in the distribution (1: the most likely; ties share the better rank), as vLLM's prompt_logprobs give."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: Optional[int] = None


def row_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of raw logits rows [R, V] (float32; the input is left as it is)."""
    return logits.float().log_softmax(dim=-1)


def pick(lp: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """[R, 1 + 2k] float32 on lp's device: the logprob of ``ids`` [R], then the top-k logprobs,
    then their ids (as floats: exact below 2**24, beyond any vocabulary here)."""
    chosen = lp.gather(1, ids.view(-1, 1).long())
    if k <= 0:
        return chosen
    top_v, top_i = lp.topk(min(k, lp.shape[1]), dim=1)
    return torch.cat([chosen, top_v, top_i.float()], dim=1)


def unpack(rows, ids: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Host rows of `pick` (array-like [R, 1 + 2k]) as `TokenLogprobs`, each cut to its own k."""
    out = []
    for row, tok, k in zip(rows, ids, ks):
        row = row.tolist() if hasattr(row, "tolist") else list(row)
        kmax = (len(row) - 1) // 2
        top = [(int(row[1 + kmax + j]), row[1 + j]) for j in range(min(k, kmax))]
        out.append(TokenLogprobs(int(tok), row[0], top))
    return out


def prompt_logprobs(hidden: torch.Tensor, compute_logits, rows: list[int], targets: list[int],
                    k: int) -> list[TokenLogprobs]:
    """The logprob of each ``targets[j]`` given the logits of hidden row ``rows[j]`` (and the top
    ``k``), in slices of `PROMPT_SLICE` positions."""
    out: list[TokenLogprobs] = []
    dev = hidden.device
    for at in range(0, len(rows), PROMPT_SLICE):
        r = torch.tensor(rows[at:at + PROMPT_SLICE], dtype=torch.long, device=dev)
        t = torch.tensor(targets[at:at + PROMPT_SLICE], dtype=torch.long, device=dev)
        lp = row_logprobs(compute_logits(hidden.index_select(0, r)))
        packed = pick(lp, t, k)
        ranks = (lp > packed[:, :1]).sum(dim=1, keepdim=True).float() + 1  # (as floats, as pick's ids: exact)
        host = torch.cat([packed, ranks], dim=1).cpu()  # one copy to the host
        entries = unpack(host[:, :-1], targets[at:at + PROMPT_SLICE], [k] * len(t))
        for e, rank in zip(entries, host[:, -1].tolist()):
            e.rank = int(rank)
        out += entries
    return out


class TokenText:
    """A token's text and bytes on its own, as logprobs report it (OpenAI's ``bytes``; a token that
    is part of a multi-byte character has bytes that are not UTF-8 alone, and its text has U+FFFD).
    A byte-level BPE vocabulary is read from the detokenizer's byte table; others decode the id."""

    def __init__(self, tokenizer):
        from rosecli.engine.detokenizer import _byte_level_table

        self.tokenizer = tokenizer
        self.table: Optional[list] = _byte_level_table(tokenizer)
        self.size = len(tokenizer)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        if not 0 <= token_id < self.size:
            b = b""
        elif self.table is not None:
            b = self.table[token_id]
        else:
            b = self.tokenizer.decode([token_id]).encode("utf-8")
        hit = (b.decode("utf-8", errors="replace"), b)
        if len(self._cache) < 1 << 16:
            self._cache[token_id] = hit
        return hit
