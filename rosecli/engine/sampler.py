"""Token sampling on the model's device: greedy, temperature, top-k, top-p, seeds.

Sampling draws one exponential variate per vocabulary entry and takes
``argmax(probs / noise)``, which picks token i with probability probs[i] (the "exponential
race"). A request with its own seed draws its noise from its own generator, so its tokens do
not depend on what else is in the batch; other requests share the engine's generator, seeded
by ``--seed``, so a whole run repeats exactly.
"""

from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k, then outside its top-p nucleus.

    top_k 0 keeps all; top-p keeps the smallest set of most likely tokens whose probability
    mass (after top-k, renormalised) reaches p.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_ks > 0, top_ks, torch.full_like(top_ks, vocab))
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_ps[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, temperatures: Seq[float], top_ks: Seq[int], top_ps: Seq[float],
           generators: Seq[Optional[torch.Generator]], default_generator: Optional[torch.Generator]) -> torch.Tensor:
    """logits: [B, vocab] float32 -> token ids [B] (int64, on logits' device)."""
    device = logits.device
    greedy = logits.argmax(dim=-1)
    if all(t == 0 for t in temperatures):  # decided on the host: no device sync in a launched step
        return greedy
    temps = torch.tensor(temperatures, dtype=torch.float32, device=device)
    greedy_rows = temps == 0
    scaled = logits / torch.where(greedy_rows, torch.ones_like(temps), temps)[:, None]
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        scaled = apply_top_k_top_p(scaled, torch.tensor(top_ks, device=device),
                                   torch.tensor(top_ps, dtype=torch.float32, device=device))
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    shared_rows = [i for i, g in enumerate(generators) if g is None]
    if shared_rows:
        noise[shared_rows] = torch.empty((len(shared_rows), probs.shape[1]), device=device).exponential_(
            generator=default_generator)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy_rows, greedy, sampled)
