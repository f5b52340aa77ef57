"""Sampling kernels: four Triton launches (seven with winner rows, below) do penalties, greedy argmax,
the min_p / top-k / top-p threshold (exact, without sorting) and the exponential race with
counter-based noise. A plain-torch reference (`sample_ref`, sorting) beside it gives the same result.

Noise is a hash of (the slot's key, its step, the token id): the same (request seed, step) gives the
same noise whatever the batch, the row, the device or the candidate set raced over, so a seeded
request repeats exactly and racing over a candidate set picks the same token as racing over the whole
vocabulary restricted to those candidates. The race picks the token that maximises
``logit / T + Gumbel noise`` among tokens whose logit is at least the row's threshold ``tau``
(that is softmax sampling restricted to them); a greedy row (temperature 0) takes the argmax, first
index on ties, like ``torch.argmax``.

Filters (vLLM v1's order; each over what the previous kept), as one threshold ``tau`` on the logit:
min_p keeps ``x >= max + T*log(min_p)`` (probability at least min_p times the largest); top-k keeps
``x >= `` the k-th largest kept logit (ties at it are all kept); top-p keeps token j when the softmax
mass of the kept tokens with a larger logit is below ``top_p`` (the smallest set of largest logits
reaching top_p; ties at its last value are all kept).

The kernels find that threshold without sorting, each row split into chunks over the GPU for the
passes over the vocabulary: pass 1 (penalties written back, max, argmax); pass 2 counts the tokens
(and, for top-p without top-k, their mass) at 8 cutoffs below the max; pass 3 picks the highest cutoff
that cannot exclude a kept token and leaves at most ``C`` candidates, and copies them to a scratch row
(a row without top-k/top-p races its chunks instead); then one program per row runs a bisection on
the float's bit pattern over its candidates (registers) for the exact k-th value and top-p cut, and
the race over them: up to 256 candidates in a 256-token tile; up to 4096 first narrowed by the row's
first filter's search in a 4096-token tile until at most 256 are left at or above the cut, then
copied and finished in the small tile (each count costs the tile's width); more than 4096 over the
scratch row. On a Hopper GPU each pass is launched with PDL (`kernels.pdl`). A row no cutoff fits (a flat
distribution, a huge tie) narrows its cutoffs over its whole row, and failing that bisects and races
over its whole row: slower, equally exact. The finishing program's narrowing and its rare paths are functions it
calls, not inlined (its code is fetched from device memory every decode step: the step's weights evict it from L2).

When the thresholds themselves are not wanted (`sample`'s ``want_tau``: only processed logprobs need
them), a top-p row without top-k skips its search: it races over everything min_p kept, and top-p keeps
the winner when less than top_p of the mass lies above it; then the winner is the answer (the race over
the kept tokens has the same noise per token, so the same winner). A dropped winner means every kept
token lies above it: the row races again over the tokens above it. The first check and one more race and
check are split over the row's chunks like the passes; a row still without a kept winner goes on in one
program, then searches its threshold. A row samples outside its nucleus with probability about 1 -
top_p, so most rows stop at the first check.
"""

from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from rosecli.kernels.pdl import pdl_begin, use_pdl

PROMPT_BIT = 1 << 30  # counts[slot, token]: bit 30 = token in the prompt, low 30 bits = times in the output
M32 = 0xFFFFFFFF
BLOCK = 4096  # tile of a pass over a row; up to BLOCK candidates are searched in registers
FINISH_TILE = 256  # the finishing search's register tile (more candidates are first narrowed to this many)
SPLIT_BLOCK = 2048  # tile of the passes split over chunks of a row
PIVOT_BLOCK = 512  # tile of the cutoff-counting pass ([PIVOT_BLOCK, PIVOTS] accumulators)
PIVOTS = 8
REFINE = 4  # narrowing passes when no first-pass cutoff fits
TRIES = 6  # races over the tokens above a winner top-p dropped, before the threshold's search


# --- noise (uint32 hash; the torch reference emulates uint32 in int64) -------------------------
def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 a in [0, 2**32), without int64 overflow."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & M32


def _fmix32_ref(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def fmix32_int(x: int) -> int:
    """The same hash on a Python int (host side: slot keys from seeds)."""
    x &= M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def gumbel_ref(key: torch.Tensor, step: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Gumbel noise for tokens [B, N] (int64) of rows with key [B], step [B] (int64)."""
    key = key[:, None] & M32
    key2 = _fmix32_ref((key + _mul32(step[:, None] & M32, 0x9E3779B1)) & M32)
    h = _fmix32_ref(_mul32(tokens & M32, 0x85EBCA77) ^ key2)
    h = _fmix32_ref(h ^ key)
    u = ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608)  # in (0, 1) exactly: 23 bits, never rounds to 1
    return -torch.log(-torch.log(u))


def _fmix32_np(x: np.ndarray) -> np.ndarray:
    """`_fmix32_ref` on uint32 arrays (their products wrap at 2**32 as the kernel's do)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def gumbel_cpu(key: torch.Tensor, step: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`gumbel_ref`'s noise, bit for bit, hashed in uint32 (numpy) on CPU tensors: the reference's int64
    emulation of uint32 products ran ~60 small torch operations a call, most of the CPU race's time."""
    u32 = lambda t: (t.numpy() & M32).astype(np.uint32)  # noqa: E731
    key = u32(key)[:, None]
    key2 = _fmix32_np(key + u32(step)[:, None] * np.uint32(0x9E3779B1))
    h = _fmix32_np(_fmix32_np(u32(tokens) * np.uint32(0x85EBCA77) ^ key2) ^ key)
    u = torch.from_numpy(((h >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 8388608))
    return -torch.log(-torch.log(u))


@triton.jit
def _fmix32(x):
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


# --- reference ----------------------------------------------------------------------------------
def race_ref(x: torch.Tensor, tokens, slots: torch.Tensor, inv_t: torch.Tensor, tau: torch.Tensor,
             keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """x: [B, N] float32 logits (untempered); tokens: [B, N] token ids of x's columns, or None for
    0..N-1; inv_t, tau: [B]; keys, steps: per slot, read at ``slots`` [B]. -> token ids [B] int64."""
    B, N = x.shape
    if tokens is None:
        tokens = torch.arange(N, device=x.device).expand(B, N)
    kept = x >= tau[:, None]
    score = x.masked_fill(~kept, float("-inf"))  # greedy rows race on their logits alone
    # noise only where it can win: the kept entries of sampled rows (a nucleus is often a few
    # tokens; the CPU's sampling cost is mostly this hash)
    rows, cols = (kept & (inv_t != 0)[:, None]).nonzero(as_tuple=True)
    if rows.numel():
        g = gumbel_ref(keys[slots][rows], steps[slots][rows], tokens[rows, cols][:, None]).squeeze(1)
        score[rows, cols] = x[rows, cols] * inv_t[rows] + g
    best = score.argmax(dim=1, keepdim=True)
    return tokens.gather(1, best).squeeze(1).long()


def penalties_ref(x: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, rep: torch.Tensor,
                  pres: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """In place on x [B, V]: repetition penalty over prompt and output tokens (divide a positive
    logit, multiply a negative one), then frequency (times the output count) and presence
    (once if in the output) subtracted, as vLLM v1 and OpenAI define them. rep/pres/freq: per slot."""
    c = counts.index_select(0, slots)
    n = (c & (PROMPT_BIT - 1)).to(torch.float32)
    seen = c != 0
    r = rep[slots][:, None]
    penalised = torch.where(x > 0, x / r, x * r)
    x.copy_(torch.where(seen, penalised, x) - freq[slots][:, None] * n - pres[slots][:, None] * (n > 0))
    return x


def penalties_cpu(x: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, rep: torch.Tensor,
                  pres: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """`penalties_ref`'s result, bit for bit, computed on the tokens each row's slot has seen (found by numpy)
    instead of the whole vocabulary: every other logit, and every logit of a row without penalties, it leaves
    as it was (x / 1, x * 1, x - 0 are x)."""
    cn = counts.numpy()
    neutral = ((rep == 1) & (pres == 0) & (freq == 0)).tolist()
    for r, slot in enumerate(slots.tolist()):
        if neutral[slot]:
            continue
        i = torch.from_numpy(np.flatnonzero(cn[slot]))
        n = (counts[slot, i] & (PROMPT_BIT - 1)).to(torch.float32)
        v = x[r, i]
        x[r, i] = torch.where(v > 0, v / rep[slot], v * rep[slot]) - freq[slot] * n - pres[slot] * (n > 0)
    return x


def _filters(x, temp, top_k, top_p, min_p):
    """What the threshold searches start from: -inf per row, the greedy rows, 1/T (0 for greedy), each row's
    max, min_p's threshold (or -inf), and the sampled rows using top-k and top-p."""
    ninf = torch.full((x.shape[0],), float("-inf"), device=x.device)
    greedy = temp == 0
    inv_t = torch.where(greedy, 0.0, 1.0 / torch.where(greedy, 1.0, temp))
    m = x.amax(dim=1)
    tau = torch.where(min_p > 0, m + temp * torch.log(min_p.clamp_min(1e-30)), ninf)
    sampled = ~greedy
    return ninf, greedy, inv_t, m, tau, sampled & (top_k > 0), sampled & (top_p < 1)


def thresholds_ref(x: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """Each row's logit threshold tau (module doc) by sorting; -inf for greedy rows (temp 0)."""
    ninf, greedy, inv_t, m, tau, uses_k, uses_p = _filters(x, temp, top_k, top_p, min_p)
    if bool((uses_k | uses_p).any()):
        # (the whole row: the k largest alone miss ties of the k-th value past them, which top-k keeps and
        # top-p then weighs)
        srt = x.sort(dim=1, descending=True).values
        kept = srt >= tau[:, None]
        kth = srt.gather(1, (top_k.clamp(1, srt.shape[1]) - 1)[:, None]).squeeze(1)
        tau = torch.where(uses_k & (kept.sum(dim=1) >= top_k), torch.maximum(tau, kth), tau)
        kept = srt >= tau[:, None]
        w = torch.where(kept, torch.exp((srt - m[:, None]) * inv_t[:, None]), 0.0)
        cum = w.cumsum(dim=1)
        keep = kept & ((cum - w) < top_p[:, None] * w.sum(dim=1, keepdim=True))
        tau_p = srt.gather(1, (keep.sum(dim=1).clamp_min(1) - 1)[:, None]).squeeze(1)
        tau = torch.where(uses_p, torch.maximum(tau, tau_p), tau)
    return torch.where(greedy, ninf, tau)


def sample_ref(x, slots, f, i, steps, counts, cand_x=None, cand_i=None, fallback=None, want_tau=True,
               kinds=None):
    """Plain-torch `sample`: same arguments, same result (sorting where the kernel searches; every row's
    threshold, whatever ``want_tau``)."""
    return _sample_torch(x, slots, f, i, steps, counts, thresholds_ref, race_ref)


def _sample_torch(x, slots, f, i, steps, counts, thresholds, race, penalties=penalties_ref):
    if counts is not None:
        penalties(x, slots, counts, f[3], f[4], f[5])
    temp = f[0][slots]
    tau = thresholds(x, temp, i[0][slots], f[1][slots], f[2][slots])
    inv_t = torch.where(temp == 0, 0.0, 1.0 / torch.where(temp == 0, 1.0, temp))
    return race(x, None, slots, inv_t, tau, i[4], steps), tau


# --- the CPU's sampler: the reference's answers with less work ----------------------------------
FIRST_TOP = 256  # the largest logits `_thresholds_topk` sorts first (8 times more while the nucleus reaches past),
# and the most kept tokens `race_cpu` races over alone
GUMBEL_MAX = 16.7  # above the largest noise the hash gives: -log(-log(1 - 2**-24)) = 16.6355
NUCLEUS_CUTS = (2.0, 4.0, 8.0, 16.0)  # `thresholds_cpu`'s cutoffs, tempered distances below a row's max
NUCLEUS_MAX = 4096  # candidates it sorts at most


def thresholds_cpu(x: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """`thresholds_ref`'s thresholds with less work. A top-k or top-p row sorts only the tokens above the first
    cutoff below its max (`NUCLEUS_CUTS`, found by numpy) that holds its k largest, or whose weight reaches
    top_p of what min_p kept (a trained model's nucleus is a few tokens); a flat row sorts the largest logits
    (`torch.topk`, `_thresholds_topk`)."""
    filt = _filters(x, temp, top_k, top_p, min_p)
    ninf, greedy, inv_t, m, tau, uses_k, uses_p = filt
    filters = (uses_k | uses_p).tolist()
    if not any(filters):
        return torch.where(greedy, ninf, tau)
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return _thresholds_topk(x, top_k, top_p, filt)
    out = torch.where(greedy, ninf, tau)
    rest = []
    xn, mn, taun, tn, kn = x.numpy(), m.tolist(), tau.tolist(), temp.tolist(), top_k.tolist()
    for r, f in enumerate(filters):
        if not f:
            continue
        t = _nucleus_cut(x[r], xn[r], mn[r], inv_t[r], tn[r], taun[r], top_p[r], kn[r] if uses_k[r] else 0)
        if t is None:
            rest.append(r)
        else:
            out[r] = t
    if rest:
        rt = torch.tensor(rest)
        out[rt] = _thresholds_topk(x[rt], top_k[rt], top_p[rt], tuple(t[rt] for t in filt))
    return out


def _nucleus_cut(x: torch.Tensor, xn: np.ndarray, m: float, inv_t: torch.Tensor, temp: float, tau: float,
                 top_p: torch.Tensor, top_k: int) -> Optional[torch.Tensor]:
    """One row's threshold (over min_p's ``tau``) from the tokens above a cutoff, sorted as `thresholds_ref`
    sorts the row: with top-k, the first cutoff above which lie at least top_k tokens (the k-th value, its
    ties, and all that top-p then weighs); without, the first whose weight reaches top_p of the row's. None
    when no cutoff of `NUCLEUS_CUTS` does so within `NUCLEUS_MAX` tokens."""
    if not top_k:
        w_row = torch.exp((x - m) * inv_t)
        target = top_p * (w_row.sum() if tau == float("-inf") else torch.where(x >= tau, w_row, 0.0).sum())
    tau_t = torch.tensor(tau)
    for d in NUCLEUS_CUTS:
        c = max(m - d * temp, tau)
        cand = np.flatnonzero(xn >= c)
        if len(cand) > NUCLEUS_MAX:
            return None
        if top_k and len(cand) < top_k and c > tau:
            continue  # (fewer than k above it: the k-th value lies lower)
        srt = x[torch.from_numpy(cand)].sort(descending=True).values
        t = tau_t
        if top_k:  # (c at min_p's cut with fewer than k: top-k keeps everything min_p kept)
            if len(cand) >= top_k:
                t = torch.maximum(t, srt[top_k - 1])
            if not top_p < 1:
                return t
            w = torch.where(srt >= t, torch.exp((srt - m) * inv_t), 0.0)
            target = top_p * w.sum()
        else:
            w = torch.exp((srt - m) * inv_t)
        cum = w.cumsum(0)
        if top_k or bool(cum[-1] >= target) or c <= tau:  # (the nucleus ends among them: ties of its last value too)
            n_keep = int(((srt >= t) & ((cum - w) < target)).sum())
            return torch.maximum(srt[max(n_keep, 1) - 1], t)
    return None


def _thresholds_topk(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, filt: tuple) -> torch.Tensor:
    """`thresholds_ref`'s thresholds from the largest logits only (`torch.topk`, sorted) instead of a sort of
    every row: the top-k value and the top-p cut lie among the largest ones unless the nucleus reaches past
    them (then 8 times more, up to the whole row). The total weight top-p divides is what min_p and top-k kept
    of the whole row. ``filt``: the rows' `_filters`, some of which filter."""
    V = x.shape[1]
    ninf, greedy, inv_t, m, tau, uses_k, uses_p = filt
    # one more than the largest top_k: the last one says whether ties of the k-th value go on past them
    k = int(top_k[uses_k].max()) + 1 if bool(uses_k.any()) else 0
    k = min(V, max(FIRST_TOP, k) if bool((uses_p & ~uses_k).any()) else k)  # (top-p over top-k: k is enough)
    while True:
        srt = x.topk(k, dim=1).values
        kept = srt >= tau[:, None]
        kth = srt.gather(1, (top_k.clamp(1, k) - 1)[:, None]).squeeze(1)
        # (fewer than top_k kept among the largest k >= top_k: fewer in the row)
        tau_k = torch.where(uses_k & (kept.sum(dim=1) >= top_k), torch.maximum(tau, kth), tau)
        if not bool(uses_p.any()):
            return torch.where(greedy, ninf, tau_k)
        kept = srt >= tau_k[:, None]
        w = torch.where(kept, torch.exp((srt - m[:, None]) * inv_t[:, None]), 0.0)
        z = w.sum(dim=1)
        n_kept = kept.sum(dim=1)
        beyond = uses_p & (srt[:, -1] >= tau_k) & (k < V)  # (maybe) kept tokens past the k largest
        if bool(beyond.any()):
            rest = torch.where(x >= tau_k[:, None], torch.exp((x - m[:, None]) * inv_t[:, None]), 0.0).sum(dim=1)
            z = torch.where(beyond, rest, z)
        n_keep = (kept & ((w.cumsum(dim=1) - w) < (top_p * z)[:, None])).sum(dim=1)
        if k == V or not bool((beyond & (n_keep >= n_kept)).any()):  # (no nucleus reaching past them)
            break
        k = min(V, 8 * k)
    tau_p = srt.gather(1, (n_keep.clamp_min(1) - 1)[:, None]).squeeze(1)
    return torch.where(greedy, ninf, torch.where(uses_p, torch.maximum(tau_k, tau_p), tau_k))


def race_cpu(x: torch.Tensor, tokens, slots: torch.Tensor, inv_t: torch.Tensor, tau: torch.Tensor,
             keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`race_ref`'s winner, hashing only the tokens that can win: no noise exceeds `GUMBEL_MAX`, so a
    kept token whose tempered logit plus it falls short of the score of the largest kept logit's token
    cannot win (nor tie) the race. A row that keeps at most `FIRST_TOP` tokens (a trained model's nucleus:
    SmolLM2's at temperature 0.8, top-p 0.95 held a median of 7) races over them alone, found by numpy:
    torch's vocabulary-wide operations on one thread cost 20-150 us each, numpy's select in ~8."""
    B, N = x.shape
    if tokens is None and x.dtype == torch.float32 and x.device.type == "cpu":
        xn, taun, sampled = x.numpy(), tau.numpy(), (inv_t != 0).tolist()
        ids = []
        for r in range(B):
            if not sampled[r]:
                ids.append(int(np.argmax(xn[r])) if taun[r] == float("-inf") else None)
                continue
            cand = np.flatnonzero(xn[r] >= taun[r])
            if len(cand) > FIRST_TOP:
                ids.append(None)
                continue
            c = torch.from_numpy(cand)
            g = gumbel_cpu(keys[slots[r:r + 1]], steps[slots[r:r + 1]], c[None, :])[0]
            ids.append(int(cand[int((x[r, c] * inv_t[r] + g).argmax())]))
        if None not in ids:
            return torch.tensor(ids, dtype=torch.int64)
        rest = [r for r, t in enumerate(ids) if t is None]  # (flat rows: the race below, over the row)
        rt = torch.tensor(rest)
        out = torch.tensor([-1 if t is None else t for t in ids], dtype=torch.int64)
        out[rt] = race_cpu(x[rt], torch.arange(N).expand(len(rest), N), slots[rt], inv_t[rt], tau[rt], keys, steps)
        return out
    if tokens is None:
        tokens = torch.arange(N, device=x.device).expand(B, N)
    kept = x >= tau[:, None]
    score = x.masked_fill(~kept, float("-inf"))  # greedy rows race on their logits alone
    sampled = (inv_t != 0)[:, None]
    if int((kept & sampled).sum()) > FIRST_TOP:  # (a few kept tokens: hashing them costs less than the bound)
        xs = x * inv_t[:, None]
        top = score.argmax(dim=1, keepdim=True)
        reached = xs.gather(1, top) + gumbel_cpu(keys[slots], steps[slots], tokens.gather(1, top))
        can_win = kept & sampled & (xs + GUMBEL_MAX >= reached)
        score = score.masked_fill(sampled & ~can_win, float("-inf"))
    else:
        can_win = kept & sampled
    rows, cols = can_win.nonzero(as_tuple=True)
    if rows.numel():
        g = gumbel_cpu(keys[slots][rows], steps[slots][rows], tokens[rows, cols][:, None]).squeeze(1)
        score[rows, cols] = x[rows, cols] * inv_t[rows] + g
    best = score.argmax(dim=1, keepdim=True)
    return tokens.gather(1, best).squeeze(1).long()


def sample_cpu(x, slots, f, i, steps, counts, cand_x=None, cand_i=None, fallback=None, want_tau=True,
               kinds=None):
    """`sample_ref`'s answers for the CPU's engine, with less work (`penalties_cpu`, `thresholds_cpu`, `race_cpu`)."""
    cpu = counts is not None and counts.device.type == "cpu" and x.dtype == torch.float32
    return _sample_torch(x, slots, f, i, steps, counts, thresholds_cpu, race_cpu,
                         penalties_cpu if cpu else penalties_ref)


# --- the fused kernel ---------------------------------------------------------------------------
@triton.jit
def _key_of(c):
    """float32 -> int64 whose order is the floats' order."""
    b = c.to(tl.int32, bitcast=True)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return b.to(tl.int64)


@triton.jit
def _float_of(k):
    b = k.to(tl.int32)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _count_mass(ptr, n, xt, wt, c, m, inv_t, WITH_MASS: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """How many of x = ptr[:n] are >= c, and (WITH_MASS) their softmax weight exp((x - m) / T).
    TILE: x is the register tile xt (n <= BLOCK) with weights wt, no load."""
    if TILE:
        ge = (tl.arange(0, BLOCK) < n) & (xt >= c)
        cnt = tl.sum(ge.to(tl.int32), 0)
        if WITH_MASS:
            mass = tl.sum(tl.where(ge, wt, 0.0), 0)
        else:
            mass = 0.0
    else:
        acc_c = tl.zeros([BLOCK], tl.int32)
        acc_m = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(ptr + offs, mask=mask, other=float("-inf"))
            ge = mask & (x >= c)
            acc_c += ge.to(tl.int32)
            if WITH_MASS:
                acc_m += tl.where(ge, tl.exp((x - m) * inv_t), 0.0)
        cnt = tl.sum(acc_c, 0)
        mass = tl.sum(acc_m, 0)
    return cnt, mass


@triton.jit
def _granularity(ptr, n, xt, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """The largest power of two G dividing the mantissa bits of every x = ptr[:n] (or the tile xt): 2**13 for
    logits a float16 GEMM made, 2**16 for bfloat16's, 1 or 2 for float32's. The keys (`_key_of`) of x are then
    multiples of G, or for negative x one less than a multiple, so a bracket of keys at most G wide holds at
    most one value of x (-0 and +0 alike)."""
    if TILE:
        mant = (xt.to(tl.int32, bitcast=True) & 0x7FFFFF) | 0x800000
        g = tl.min(tl.where(tl.arange(0, BLOCK) < n, mant & -mant, 0x800000), 0)
    else:
        acc = tl.full([BLOCK], 0x800000, tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            mant = (tl.load(ptr + offs, mask=mask, other=0.0).to(tl.int32, bitcast=True) & 0x7FFFFF) | 0x800000
            acc = tl.minimum(acc, tl.where(mask, mant & -mant, 0x800000))
        g = tl.min(acc, 0)
    return g.to(tl.int64)


@triton.jit
def _bisect(ptr, n, xt, wt, lo_k, hi_k, k, target, m, inv_t, gran, most, BY_MASS: tl.constexpr, TILE: tl.constexpr,
            BLOCK: tl.constexpr):
    """Halve the bracket of keys [lo_k, hi_k) (lo qualifies: count(x >= lo) >= k or, BY_MASS, mass(x >= lo) >=
    target; hi does not) until one value of x is left in it, or at most ``most`` tokens are >= lo (``most`` 0:
    no such stop). ``gran``: `_granularity` of x (1 always does): a bracket that narrow holds one value, so a
    tie stops the search there instead of ~13 (float16 logits) or ~16 (bfloat16) halvings later (ties are
    common in half-precision logits, and a row's worst search sets the kernel's time). -> (lo_k, hi_k, n_lo)."""
    n_lo, _ = _count_mass(ptr, n, xt, wt, _float_of(lo_k), m, inv_t, False, TILE, BLOCK)
    n_hi, _ = _count_mass(ptr, n, xt, wt, _float_of(hi_k), m, inv_t, False, TILE, BLOCK)
    while (hi_k - lo_k > gran) & (n_lo - n_hi > 1) & (n_lo > most):
        mid = lo_k + (hi_k - lo_k) // 2
        cnt, mass = _count_mass(ptr, n, xt, wt, _float_of(mid), m, inv_t, BY_MASS, TILE, BLOCK)
        if BY_MASS:
            ok = mass >= target
        else:
            ok = cnt >= k
        lo_k = tl.where(ok, mid, lo_k)
        hi_k = tl.where(ok, hi_k, mid)
        n_lo = tl.where(ok, cnt, n_lo)
        n_hi = tl.where(ok, n_hi, cnt)
    return lo_k, hi_k, n_lo


@triton.jit
def _largest_cut(ptr, n, xt, wt, lo, hi, k, target, m, inv_t, gran, BY_MASS: tl.constexpr, TILE: tl.constexpr,
                 BLOCK: tl.constexpr):
    """The largest float c in [lo, hi) with count(x >= c) >= k (or, BY_MASS, mass(x >= c) >= target);
    lo is assumed to qualify and hi not (`_bisect`): the smallest x >= lo once one value is left."""
    lo_k, _, _ = _bisect(ptr, n, xt, wt, _key_of(lo), _key_of(hi), k, target, m, inv_t, gran, 0, BY_MASS, TILE, BLOCK)
    return _min_at_least(ptr, n, xt, _float_of(lo_k), TILE, BLOCK)


@triton.jit
def _min_at_least(ptr, n, xt, c, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """The smallest x >= c (c itself when none is)."""
    if TILE:
        best = tl.min(tl.where((tl.arange(0, BLOCK) < n) & (xt >= c), xt, float("inf")), 0)
    else:
        acc = tl.full([BLOCK], float("inf"), tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(ptr + offs, mask=offs < n, other=float("-inf"))
            acc = tl.minimum(acc, tl.where((offs < n) & (x >= c), x, float("inf")))
        best = tl.min(acc, 0)
    return tl.where(best == float("inf"), c, best)


@triton.jit
def _noise_keys(i_ptr, step_ptr, S, slot):
    """The slot's two noise keys: its key, and its key mixed with its step (`gumbel_ref`'s)."""
    key = tl.load(i_ptr + 4 * S + slot).to(tl.uint32)
    return key, _fmix32(key + tl.load(step_ptr + slot).to(tl.uint32) * 0x9E3779B1)


@triton.jit
def _noise_score(x, tok, inv_t, key, key2):
    h = _fmix32((tok.to(tl.uint32) * 0x85EBCA77) ^ key2)
    h = _fmix32(h ^ key)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608)
    return x * inv_t - tl.log(-tl.log(u))


@triton.jit
def _race(ptr, n, base, tau, inv_t, key, key2, BLOCK: tl.constexpr, id_ptr=None, HAS_IDS: tl.constexpr = False):
    """argmax over x = ptr[:n] >= tau (tokens base..base+n-1, or HAS_IDS: id_ptr[:n], increasing) of
    x / T + Gumbel(hash(key, step, token)), first on ties. -> (best score, its token id)."""
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(ptr + offs, mask=mask, other=float("-inf"))
        if HAS_IDS:
            tok = tl.load(id_ptr + offs, mask=mask, other=0)
        else:
            tok = base + offs
        score = tl.where(mask & (x >= tau), _noise_score(x, tok, inv_t, key, key2), float("-inf"))
        mx = tl.max(score, 0)
        i = tl.argmax(score, 0)
        take = mx > best
        best_id = tl.where(take, tl.sum(tl.where(tl.arange(0, BLOCK) == i, tok, 0), 0).to(tl.int64), best_id)
        best = tl.where(take, mx, best)
    return best, best_id


@triton.jit
def _pivot_counts(xrow, V, c, m, inv_t, tau_minp, WITH_MASS: tl.constexpr, BLOCK: tl.constexpr,
                  P: tl.constexpr):
    """For each of the P cutoffs c: how many x >= c and (WITH_MASS) their weight; and the weight of
    x >= tau_minp (what min_p kept). The accumulators are [P, BLOCK], tokens on the fast axis: laid out so,
    each thread holds every cutoff's count for the tokens it loaded, and x goes from its load to the compares
    in registers ([BLOCK, P] put the cutoffs across a warp's threads, and each tile's x through shared
    memory to them: two barriers a tile)."""
    acc_c = tl.zeros([P, BLOCK], tl.int32)
    acc_m = tl.zeros([P, BLOCK], tl.float32)
    acc_z = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(xrow + offs, mask=mask, other=float("-inf"))
        ge = (x[None, :] >= c[:, None]) & mask[None, :]
        acc_c += ge.to(tl.int32)
        if WITH_MASS:
            w = tl.exp((x - m) * inv_t)
            acc_m += tl.where(ge, w[None, :], 0.0)
            acc_z += tl.where(mask & (x >= tau_minp), w, 0.0)
    return tl.sum(acc_c, 1), tl.sum(acc_m, 1), tl.sum(acc_z, 0)


@triton.jit
def _threshold(ptr, n, xt, wt, lo, hi, m, inv_t, tau_minp, top_k, top_p, z_a, gran, TILE: tl.constexpr,
               BLOCK: tl.constexpr):
    """Exact top-k / top-p threshold over x = ptr[:n] (or the tile xt), which holds every token >= lo;
    lo cannot exclude a kept token, hi is above the answer; gran: `_largest_cut`'s."""
    t = tau_minp
    if top_k > 0:
        cnt, _ = _count_mass(ptr, n, xt, wt, lo, m, inv_t, False, TILE, BLOCK)
        if cnt >= top_k:
            t = tl.maximum(t, _largest_cut(ptr, n, xt, wt, lo, hi, top_k, 0.0, m, inv_t, gran, False, TILE, BLOCK))
    if top_p < 1.0:
        if top_k > 0:  # top-p over what top-k kept: all of it is here
            _, z = _count_mass(ptr, n, xt, wt, t, m, inv_t, True, TILE, BLOCK)
            hi_p = _float_of(_key_of(m) + 1)
        else:  # over what min_p kept, counted on the whole row
            z = z_a
            hi_p = hi
        t = tl.maximum(t, _largest_cut(ptr, n, xt, wt, tl.maximum(t, lo), hi_p, 0, top_p * z, m, inv_t, gran, True,
                                       TILE, BLOCK))
    return t


@triton.jit
def _first_pivots(m, temp, tau_minp, P: tl.constexpr):
    """P cutoffs below the max: tempered distances 0.5, 1, 2, .. 32 and none (what min_p kept)."""
    j = tl.arange(0, P)
    d = tl.where(j == P - 1, float("inf"), 0.5 * tl.exp2(j.to(tl.float32)))
    return tl.maximum(m - d * temp, tau_minp)


@triton.jit
def _tau_minp(m, temp, min_p):
    return tl.where(min_p > 0, m + temp * tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))


@triton.jit
def _row_max(pmax_ptr, row, split, SP2: tl.constexpr):
    j = tl.arange(0, SP2)
    return tl.max(tl.load(pmax_ptr + row * split + j, mask=j < split, other=float("-inf")), 0)


@triton.jit
def _choose(pc_ptr, pm_ptr, pz_ptr, row, split, c, m, tau_minp, top_k, top_p, C, P: tl.constexpr, SP2: tl.constexpr):
    """From the chunks' counts at the cutoffs c: whether one keeps every token the filters keep and at
    most C candidates (found), the highest such (cstar, its index jstar, its count n_c), the bracket
    (lo qualifies, hi does not), the weight z_a of what min_p kept (0 for a top-k row, which does not use it)
    and every chunk's counts ([SP2, P]: a chunk's offset among the candidates). The counts in one load; the
    weights summed in chunk order, so every kernel that calls this gets the same answer."""
    pj = tl.arange(0, P)
    sj = tl.arange(0, SP2)
    at = (row * split + sj).to(tl.int64)
    cnts = tl.load(pc_ptr + at[:, None] * P + pj[None, :], mask=(sj < split)[:, None], other=0)
    cnt = tl.sum(cnts, 0)
    mass = tl.zeros([P], tl.float32)
    z_a = tl.full((), 0.0, tl.float32)
    if top_k <= 0:  # (top-k rows qualify a cutoff by its count alone)
        for s in range(0, split):
            a = (row * split + s).to(tl.int64)
            mass += tl.load(pm_ptr + a * P + pj)
            z_a += tl.load(pz_ptr + a)
    valid = (c <= tau_minp) | tl.where(top_k > 0, cnt >= top_k, mass >= top_p * z_a)
    ok = valid & (cnt <= C)
    found = tl.sum(ok.to(tl.int32), 0)
    cstar = tl.max(tl.where(ok, c, float("-inf")), 0)
    jstar = tl.max(tl.where(ok & (c == cstar), pj, -1), 0)
    n_c = tl.sum(tl.where(pj == jstar, cnt, 0), 0)
    lo = tl.max(tl.where(valid, c, float("-inf")), 0)
    hi = tl.minimum(tl.min(tl.where(valid, float("inf"), c), 0), _float_of(_key_of(m) + 1))
    return found, cstar, jstar, n_c, lo, hi, z_a, cnts


@triton.jit
def _tile_finish(cx, ci, n_c, lo, hi, m, inv_t, tau_minp, top_k, top_p, z_a, key, key2, BLOCK: tl.constexpr):
    """Threshold and race over the n_c <= BLOCK candidates cx (ids ci, in token order) in one register tile."""
    lane = tl.arange(0, BLOCK)
    mask = lane < n_c
    xt = tl.load(cx + lane, mask=mask, other=float("-inf"))
    wt = tl.exp((xt - m) * inv_t)
    gran = _granularity(cx, n_c, xt, True, BLOCK)
    tau = _threshold(cx, n_c, xt, wt, lo, hi, m, inv_t, tau_minp, top_k, top_p, z_a, gran, True, BLOCK)
    score = tl.where(mask & (xt >= tau), _noise_score(xt, tl.load(ci + lane, mask=mask, other=0), inv_t, key,
                                                      key2), float("-inf"))
    return tau, tl.load(ci + tl.argmax(score, 0)).to(tl.int64)


@triton.jit(noinline=True)
def _narrow(cx, ci, n_c, cstar, hi, m, inv_t, top_k, top_p, z_a, BLOCK: tl.constexpr, SMALL: tl.constexpr):
    """A row of SMALL < n_c <= BLOCK candidates cx (token ids ci, in token order): its first filter's search in a
    BLOCK register tile until at most SMALL tokens are at or above the cut, and those copied to the front of cx
    and ci. -> (n_s, the tokens >= lo; lo; hi): n_s > SMALL (a tie at the cut, a wide nucleus) leaves cx, ci as
    they were. Not inlined, like the finish's rare paths (`_wide_finish`, `_refine`, `_retry`, `_row_finish`):
    the finishing program's code is fetched from device memory every decode step (the step's weights evict it
    from L2), and inlined at every tile width it was 545 KB. Unlike them this one is common (18 of S1's 64 GPT-2
    rows took it in one step), but only the programs whose row takes it fetch its code."""
    lane = tl.arange(0, BLOCK)
    mask = lane < n_c
    xt = tl.load(cx + lane, mask=mask, other=float("-inf"))
    it = tl.load(ci + lane, mask=mask, other=0)
    wt = tl.exp((xt - m) * inv_t)
    gran = _granularity(cx, n_c, xt, True, BLOCK)
    lo_k = _key_of(cstar)
    hi_k = _key_of(hi)
    n_s = n_c
    if top_k > 0:  # (every token top-k keeps is >= a cut it qualifies)
        if n_c >= top_k:
            lo_k, hi_k, n_s = _bisect(cx, n_c, xt, wt, lo_k, hi_k, top_k, 0.0, m, inv_t, gran, SMALL, False, True,
                                      BLOCK)
    elif top_p < 1.0:  # (the same for top-p's nucleus: what min_p kept, weighed on the whole row)
        lo_k, hi_k, n_s = _bisect(cx, n_c, xt, wt, lo_k, hi_k, 0, top_p * z_a, m, inv_t, gran, SMALL, True, True,
                                  BLOCK)
    lo = _float_of(lo_k)
    if n_s <= SMALL:
        keep = mask & (xt >= lo)
        pos = tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.debug_barrier()  # every thread's loads of cx / ci above happen before any store below
        tl.store(cx + pos, xt, mask=keep)
        tl.store(ci + pos, it, mask=keep)
        tl.debug_barrier()  # written by all threads, read next by others
    return n_s, lo, _float_of(hi_k)


@triton.jit(noinline=True)
def _wide_finish(cx, ci, n_c, lo, hi, m, inv_t, tau_minp, top_k, top_p, z_a, key, key2, BLOCK: tl.constexpr):
    """Threshold and race over more candidates than the small tile holds: in a BLOCK tile, else over the
    scratch row."""
    if n_c <= BLOCK:
        tau, res = _tile_finish(cx, ci, n_c, lo, hi, m, inv_t, tau_minp, top_k, top_p, z_a, key, key2, BLOCK)
    else:
        dummy = tl.zeros([BLOCK], tl.float32)
        gran = _granularity(cx, n_c, dummy, False, BLOCK)
        tau = _threshold(cx, n_c, dummy, dummy, lo, hi, m, inv_t, tau_minp, top_k, top_p, z_a, gran, False, BLOCK)
        _, res = _race(cx, n_c, 0, tau, inv_t, key, key2, BLOCK, ci, True)
    return tau, res


@triton.jit(noinline=True)
def _row_finish(xrow, V, lo, hi, m, inv_t, tau_minp, top_k, top_p, z_a, key, key2, BLOCK: tl.constexpr):
    """A row no cutoff fitted even after `_refine` (a flat row, a huge tie): threshold and race over the whole
    row (rare: not worth a pass for the granularity)."""
    dummy = tl.zeros([BLOCK], tl.float32)
    tau = _threshold(xrow, V, dummy, dummy, lo, hi, m, inv_t, tau_minp, top_k, top_p, z_a, 1, False, BLOCK)
    _, res = _race(xrow, V, 0, tau, inv_t, key, key2, BLOCK)
    return tau, res


@triton.jit
def _cand_finish(cx, ci, n_c, cstar, hi, m, inv_t, tau_minp, top_k, top_p, z_a, key, key2, BLOCK: tl.constexpr,
                 SMALL: tl.constexpr):
    """Threshold and race over the n_c candidates cx (token ids ci, in token order): in a SMALL register tile
    when they fit one; up to BLOCK of them first narrowed to at most SMALL tokens (`_narrow`: each count of a
    search costs the tile's width, and a row with thousands of candidates set the kernel's time); a row left
    wider in the BLOCK tile or over the scratch row (`_wide_finish`)."""
    lo = cstar
    n_s = n_c  # (tokens >= lo)
    if (n_c > SMALL) & (n_c <= BLOCK):
        n_s, lo, hi = _narrow(cx, ci, n_c, cstar, hi, m, inv_t, top_k, top_p, z_a, BLOCK, SMALL)
    if n_s <= SMALL:
        tau, res = _tile_finish(cx, ci, n_s, lo, hi, m, inv_t, tau_minp, top_k, top_p, z_a, key, key2, SMALL)
    else:  # (cx, ci as they were)
        tau, res = _wide_finish(cx, ci, n_c, lo, hi, m, inv_t, tau_minp, top_k, top_p, z_a, key, key2, BLOCK)
    return tau, res


@triton.jit
def _compact(xrow, lo, n, cstar, cx, ci, at, BLOCK: tl.constexpr):
    """Copy x >= cstar of xrow[lo:lo+n] to cx[at:] (token ids to ci), in token order. -> the end."""
    at = tl.full((), 0, tl.int32) + at
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(xrow + lo + offs, mask=mask, other=float("-inf"))
        pred = mask & (x >= cstar)
        pos = at + tl.cumsum(pred.to(tl.int32), 0) - 1
        tl.store(cx + pos, x, mask=pred)
        tl.store(ci + pos, lo + offs, mask=pred)
        at += tl.sum(pred.to(tl.int32), 0)
    return at


@triton.jit(noinline=True)
def _refine(xrow, V, lo, hi, z_a, m, lo_min, temp, inv_t, tau_minp, top_k, top_p, cx, ci, C,
            BLOCK: tl.constexpr, PB: tl.constexpr, P: tl.constexpr, REFINE: tl.constexpr):
    """A row no first cutoff fitted: narrow [lo, hi) with up to REFINE passes of P cutoffs over the
    whole row; a cutoff that fits has its candidates copied to cx/ci.
    -> (found, cutoff, candidates, lo, hi)."""
    frac = (tl.arange(0, P) + 1).to(tl.float32) / (P + 1)
    lo = tl.where(lo == float("-inf"), tl.minimum(lo_min, m), lo)
    cstar = lo
    found = 0
    it = 0
    while (found == 0) & (it < REFINE):
        c = tl.maximum(lo + (hi - lo) * frac, tau_minp)
        if top_k > 0:
            cnt, mass, _ = _pivot_counts(xrow, V, c, m, inv_t, tau_minp, False, PB, P)
        else:
            cnt, mass, _ = _pivot_counts(xrow, V, c, m, inv_t, tau_minp, True, PB, P)
        valid = (c <= tau_minp) | tl.where(top_k > 0, cnt >= top_k, mass >= top_p * z_a)
        ok = valid & (cnt <= C)
        found = tl.sum(ok.to(tl.int32), 0)
        cstar = tl.max(tl.where(ok, c, float("-inf")), 0)
        lo = tl.maximum(lo, tl.max(tl.where(valid, c, float("-inf")), 0))
        hi = tl.minimum(hi, tl.min(tl.where(valid, float("inf"), c), 0))
        it += 1
    n_c = tl.full((), 0, tl.int32)
    if found > 0:
        n_c = _compact(xrow, 0, V, cstar, cx, ci, 0, BLOCK)
        tl.debug_barrier()  # written above by all threads, read next by others
    return found, cstar, n_c, lo, hi


# Four launches (seven with winner rows; fewer where no row of the slots needs a pass: `sample`'s ``kinds``);
# the row is split into `split` chunks of CH tokens for the passes over it. A *winner row* (``WINNER``: the
# thresholds are not wanted) samples with top-p and no top-k: it races over everything min_p kept and keeps
# the winner when top-p keeps it.
@triton.jit
def _pass1_kernel(x_ptr, x_stride, V, CH, slot_ptr, f_ptr, S, cnt_ptr, pmax_ptr, pidx_ptr, pmin_ptr,
                  PEN: tl.constexpr, PROMPT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Per chunk: penalties (written back), max, its first index, smallest finite value."""
    pdl_begin(PDL)
    row = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.num_programs(1)
    slot = tl.load(slot_ptr + row)
    xrow = x_ptr + row.to(tl.int64) * x_stride
    lo = s * CH
    end = tl.minimum(lo + CH, V)
    m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
    min_vec = tl.full([BLOCK], float("inf"), tl.float32)
    i_vec = tl.zeros([BLOCK], tl.int32)
    if PEN:
        rep = tl.load(f_ptr + 3 * S + slot)
        pres = tl.load(f_ptr + 4 * S + slot)
        freq = tl.load(f_ptr + 5 * S + slot)
        pen_row = (rep != 1.0) | (pres != 0.0) | (freq != 0.0)
    for start in range(lo, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < end
        x = tl.load(xrow + offs, mask=mask, other=float("-inf"))
        if PEN:
            if pen_row:
                seen = tl.load(cnt_ptr + slot.to(tl.int64) * V + offs, mask=mask, other=0)
                nout = (seen & (PROMPT - 1)).to(tl.float32)
                x = tl.where(seen != 0, tl.where(x > 0, x / rep, x * rep), x)
                x = x - freq * nout - tl.where(nout > 0, pres, 0.0)
                tl.store(xrow + offs, x, mask=mask)
        upd = x > m_vec
        m_vec = tl.where(upd, x, m_vec)
        i_vec = tl.where(upd, offs, i_vec)
        min_vec = tl.minimum(min_vec, tl.where(x > float("-inf"), x, float("inf")))
    m = tl.max(m_vec, 0)
    at = row * split + s
    tl.store(pmax_ptr + at, m)
    tl.store(pidx_ptr + at, tl.min(tl.where(m_vec == m, i_vec, V), 0))
    tl.store(pmin_ptr + at, tl.min(min_vec, 0))


@triton.jit
def _chunk_program(slot_ptr, f_ptr, i_ptr, S):
    """A (row, chunk) program's row, chunk, chunk count, slot, temperature, top_p and top_k."""
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    return (row, tl.program_id(1), tl.num_programs(1), slot, tl.load(f_ptr + slot), tl.load(f_ptr + S + slot),
            tl.load(i_ptr + slot))


@triton.jit
def _winner_row(temp, top_k, top_p, WINNER: tl.constexpr):
    """A row that takes its race's winner when its filter, top-p without top-k, keeps it (top-k keeps
    its winner only with the mass of its k tokens, often small: its candidates are few, searched fast)."""
    if WINNER:
        return (temp > 0) & (top_k <= 0) & (top_p < 1.0)
    else:
        return temp < 0  # (never)


@triton.jit
def _pivot_kernel(x_ptr, x_stride, V, CH, slot_ptr, f_ptr, i_ptr, S, pmax_ptr, piv_ptr, pc_ptr, pm_ptr, pz_ptr,
                  SP2: tl.constexpr, P: tl.constexpr, PB: tl.constexpr, WINNER: tl.constexpr,
                  PDL: tl.constexpr = False):
    """Per chunk of a row that filters by top-k or top-p (not a winner row): counts (and weights) at
    the first cutoffs."""
    pdl_begin(PDL)
    row, s, split, slot, temp, top_p, top_k = _chunk_program(slot_ptr, f_ptr, i_ptr, S)
    if (temp > 0) & ((top_k > 0) | (top_p < 1.0)) & ~_winner_row(temp, top_k, top_p, WINNER):
        m = _row_max(pmax_ptr, row, split, SP2)
        inv_t = 1.0 / temp
        tau_minp = _tau_minp(m, temp, tl.load(f_ptr + 2 * S + slot))
        c = _first_pivots(m, temp, tau_minp, P)
        pj = tl.arange(0, P)
        if s == 0:
            tl.store(piv_ptr + row * P + pj, c)  # the cutoffs the counts were made with, bit for bit
        xrow = x_ptr + row.to(tl.int64) * x_stride + s * CH
        n = tl.minimum(CH, V - s * CH)
        if top_k > 0:
            cnt, mass, za = _pivot_counts(xrow, n, c, m, inv_t, tau_minp, False, PB, P)
        else:
            cnt, mass, za = _pivot_counts(xrow, n, c, m, inv_t, tau_minp, True, PB, P)
        at = (row * split + s).to(tl.int64)
        tl.store(pc_ptr + at * P + pj, cnt)
        tl.store(pm_ptr + at * P + pj, mass)
        tl.store(pz_ptr + at, za)


@triton.jit
def _compact_kernel(x_ptr, x_stride, V, CH, slot_ptr, f_ptr, i_ptr, S, step_ptr, pmax_ptr, piv_ptr, pc_ptr, pm_ptr,
                    pz_ptr, cx_ptr, ci_ptr, C, rs_ptr, ri_ptr, SP2: tl.constexpr, P: tl.constexpr,
                    BLOCK: tl.constexpr, WINNER: tl.constexpr, PDL: tl.constexpr = False):
    """Per chunk: a filtering row's candidates to its scratch row (at the chunk's offset); a row that
    does not filter (temperature, min_p) races its chunk, and so does a winner row, which also weighs
    what min_p kept of its chunk."""
    pdl_begin(PDL)
    row = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.num_programs(1)
    slot = tl.load(slot_ptr + row)
    temp = tl.load(f_ptr + slot)
    if temp > 0:
        top_p = tl.load(f_ptr + S + slot)
        top_k = tl.load(i_ptr + slot)
        m = _row_max(pmax_ptr, row, split, SP2)
        tau_minp = _tau_minp(m, temp, tl.load(f_ptr + 2 * S + slot))
        xrow = x_ptr + row.to(tl.int64) * x_stride
        lo = s * CH
        n = tl.minimum(CH, V - lo)
        filters = (top_k > 0) | (top_p < 1.0)
        winner = _winner_row(temp, top_k, top_p, WINNER)
        if filters & ~winner:
            c = tl.load(piv_ptr + row * P + tl.arange(0, P))
            found, cstar, jstar, n_c, _, _, _, cnts = _choose(pc_ptr, pm_ptr, pz_ptr, row, split, c, m, tau_minp,
                                                              top_k, top_p, C, P, SP2)
            if found > 0:  # (at: the candidates of the chunks before this one)
                before = (tl.arange(0, SP2) < s)[:, None] & (tl.arange(0, P) == jstar)[None, :]
                at = tl.sum(tl.sum(tl.where(before, cnts, 0), 1), 0)
                _compact(xrow, lo, n, cstar, cx_ptr + row.to(tl.int64) * C, ci_ptr + row.to(tl.int64) * C, at, BLOCK)
        else:
            key, key2 = _noise_keys(i_ptr, step_ptr, S, slot)
            best, best_id = _race(xrow + lo, n, lo, tau_minp, 1.0 / temp, key, key2, BLOCK)
            tl.store(rs_ptr + row * split + s, best)
            tl.store(ri_ptr + row * split + s, best_id)
            if winner:
                dummy = tl.zeros([BLOCK], tl.float32)
                _, za = _count_mass(xrow + lo, n, dummy, dummy, tau_minp, m, 1.0 / temp, True, False, BLOCK)
                tl.store(pz_ptr + row * split + s, za)


@triton.jit
def _chunks_winner(rs_ptr, ri_ptr, row, split, res):
    """The best of a row's chunk races (the first chunk on ties): (its score, its token; ``res`` if none)."""
    best = tl.full((), float("-inf"), tl.float32)
    for s in range(0, split):
        sc = tl.load(rs_ptr + row * split + s)
        take = sc > best
        res = tl.where(take, tl.load(ri_ptr + row * split + s), res)
        best = tl.where(take, sc, best)
    return best, res


@triton.jit
def _kept(pm_ptr, pz_ptr, row, split, k, best, top_p, P: tl.constexpr):
    """Whether top-p keeps a winner row's winner of race ``k`` (best: its score): the chunks' weights
    above it (`_above_kernel`) come to less than top_p of what min_p kept. Sums in chunk order: every
    kernel that asks gets the same answer."""
    mass = tl.full((), 0.0, tl.float32)
    z_a = tl.full((), 0.0, tl.float32)
    for s in range(0, split):
        at = (row * split + s).to(tl.int64)
        mass += tl.load(pm_ptr + at * P + k)
        z_a += tl.load(pz_ptr + at)
    return (best > float("-inf")) & (mass < top_p * z_a)


@triton.jit
def _above_kernel(x_ptr, x_stride, V, CH, slot_ptr, f_ptr, i_ptr, S, step_ptr, pmax_ptr, pm_ptr, pz_ptr,
                  rs_ptr, ri_ptr, rs2_ptr, ri2_ptr, SP2: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr,
                  STAGE: tl.constexpr, PDL: tl.constexpr = False):
    """Per chunk of a winner row. STAGE 0: the weight of its tokens above the winner of race 0
    (`_compact_kernel`'s). STAGE 1, where top-p dropped race 0's winner: race 1, over its tokens above
    that winner (top-p keeps only tokens above a token it dropped). STAGE 2, the same: the weight of
    its tokens above race 1's winner."""
    pdl_begin(PDL)
    row, s, split, slot, temp, top_p, top_k = _chunk_program(slot_ptr, f_ptr, i_ptr, S)
    if _winner_row(temp, top_k, top_p, True):
        best, w = _chunks_winner(rs_ptr, ri_ptr, row, split, tl.full((), 0, tl.int64))  # race 0's
        go = STAGE == 0
        if STAGE > 0:
            go = ~_kept(pm_ptr, pz_ptr, row, split, 0, best, top_p, P)
        if go:
            m = _row_max(pmax_ptr, row, split, SP2)
            inv_t = 1.0 / temp
            xrow = x_ptr + row.to(tl.int64) * x_stride
            lo = s * CH
            n = tl.minimum(CH, V - lo)
            if STAGE == 2:
                _, w = _chunks_winner(rs2_ptr, ri2_ptr, row, split, w)
            above = _float_of(_key_of(tl.load(xrow + w)) + 1)  # x >= above: x > x[w]
            at = row * split + s
            if STAGE == 1:
                key, key2 = _noise_keys(i_ptr, step_ptr, S, slot)
                best, best_id = _race(xrow + lo, n, lo, above, inv_t, key, key2, BLOCK)
                tl.store(rs2_ptr + at, best)
                tl.store(ri2_ptr + at, best_id)
            else:
                dummy = tl.zeros([BLOCK], tl.float32)
                _, mass = _count_mass(xrow + lo, n, dummy, dummy, above, m, inv_t, True, False, BLOCK)
                tl.store(pm_ptr + at.to(tl.int64) * P + STAGE // 2, mass)


@triton.jit(noinline=True)
def _retry(xrow, V, w, m, inv_t, top_p, z_a, key, key2, BLOCK: tl.constexpr, TRIES: tl.constexpr):
    """A winner row whose first two winners were dropped (w the second), in one program: race over
    the tokens above the last winner and count above the new one, up to TRIES times.
    -> (1 and the kept winner, or 0: search the threshold)."""
    dummy = tl.zeros([BLOCK], tl.float32)
    kept = tl.full((), 0, tl.int32)
    tries = 0
    while (kept == 0) & (tries < TRIES):
        best, w = _race(xrow, V, 0, _float_of(_key_of(tl.load(xrow + w)) + 1), inv_t, key, key2, BLOCK)
        _, mass = _count_mass(xrow, V, dummy, dummy, _float_of(_key_of(tl.load(xrow + w)) + 1), m, inv_t, True,
                              False, BLOCK)
        kept = ((best > float("-inf")) & (mass < top_p * z_a)).to(tl.int32)
        tries += 1
    return kept, w


@triton.jit
def _finish_kernel(x_ptr, x_stride, V, slot_ptr, f_ptr, i_ptr, S, step_ptr, pmax_ptr, pidx_ptr, pmin_ptr, piv_ptr,
                   pc_ptr, pm_ptr, pz_ptr, cx_ptr, ci_ptr, C, rs_ptr, ri_ptr, rs2_ptr, ri2_ptr, out_ptr, tau_ptr,
                   fb_ptr, split, SP2: tl.constexpr, P: tl.constexpr, PB: tl.constexpr, BLOCK: tl.constexpr,
                   REFINE: tl.constexpr, WINNER: tl.constexpr, TRIES: tl.constexpr, SMALL: tl.constexpr,
                   PDL: tl.constexpr = False):
    """Per row: greedy argmax; a winner row's first kept winner; the exact threshold and race over the
    candidates (or the whole row); or the best of the chunks' races."""
    pdl_begin(PDL)
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    temp = tl.load(f_ptr + slot)
    j = tl.arange(0, SP2)
    pmax = tl.load(pmax_ptr + row * split + j, mask=j < split, other=float("-inf"))
    m = tl.max(pmax, 0)
    res = tl.min(tl.where(pmax == m, tl.load(pidx_ptr + row * split + j, mask=j < split, other=V), V), 0)
    res = res.to(tl.int64)
    tau = tl.full((), float("-inf"), tl.float32)
    if temp > 0:
        inv_t = 1.0 / temp
        top_p = tl.load(f_ptr + S + slot)
        top_k = tl.load(i_ptr + slot)
        tau_minp = _tau_minp(m, temp, tl.load(f_ptr + 2 * S + slot))
        key, key2 = _noise_keys(i_ptr, step_ptr, S, slot)
        if (top_k > 0) | (top_p < 1.0):
            cx = cx_ptr + row.to(tl.int64) * C
            ci = ci_ptr + row.to(tl.int64) * C
            xrow = x_ptr + row.to(tl.int64) * x_stride
            search = tl.full((), 1, tl.int32)
            if _winner_row(temp, top_k, top_p, WINNER):
                # the race over everything min_p kept picks the same token as the race over what the
                # filter keeps whenever the filter keeps its winner (the same noise per token)
                z_a = tl.sum(tl.load(pz_ptr + row * split + j, mask=j < split, other=0.0), 0)
                found = tl.full((), 0, tl.int32)
                cstar = tau_minp
                n_c = tl.full((), 0, tl.int32)
                lo = tl.full((), float("-inf"), tl.float32)
                hi = _float_of(_key_of(m) + 1)
                best, w = _chunks_winner(rs_ptr, ri_ptr, row, split, res)
                if _kept(pm_ptr, pz_ptr, row, split, 0, best, top_p, P):
                    res = w
                    search = 0
                else:
                    best, w = _chunks_winner(rs2_ptr, ri2_ptr, row, split, w)
                    if _kept(pm_ptr, pz_ptr, row, split, 1, best, top_p, P):
                        res = w
                        search = 0
                    else:
                        kept, w = _retry(xrow, V, w, m, inv_t, top_p, z_a, key, key2, BLOCK, TRIES)
                        if kept != 0:
                            res = w
                            search = 0
                if search == 0:
                    tau = tl.full((), float("nan"), tl.float32)
            else:
                c = tl.load(piv_ptr + row * P + tl.arange(0, P))
                found, cstar, jstar, n_c, lo, hi, z_a, _ = _choose(pc_ptr, pm_ptr, pz_ptr, row, split, c, m,
                                                                   tau_minp, top_k, top_p, C, P, SP2)
            if search != 0:
                if found == 0:
                    tl.atomic_add(fb_ptr, 1)
                    lo_min = tl.min(tl.load(pmin_ptr + row * split + j, mask=j < split, other=float("inf")), 0)
                    found, cstar, n_c, lo, hi = _refine(xrow, V, lo, hi, z_a, m, lo_min, temp, inv_t, tau_minp,
                                                        top_k, top_p, cx, ci, C, BLOCK, PB, P, REFINE)
                if found > 0:
                    tau, res = _cand_finish(cx, ci, n_c, cstar, hi, m, inv_t, tau_minp, top_k, top_p, z_a, key, key2,
                                            BLOCK, SMALL)
                else:  # still too many (a flat row, a huge tie): threshold and race over the whole row
                    tau, res = _row_finish(xrow, V, lo, hi, m, inv_t, tau_minp, top_k, top_p, z_a, key, key2, BLOCK)
        else:
            tau = tau_minp
            _, res = _chunks_winner(rs_ptr, ri_ptr, row, split, res)
    tl.store(out_ptr + row, res)
    tl.store(tau_ptr + row, tau)


_SMS: dict = {}

# The passes compile one Triton variant per chunk count (and per alignment of the scratch slices):
# a chunk count chosen per batch size made every new batch size a compile of four kernels (~0.5 s
# each) in the middle of serving. The batch sizes are bucketed instead (powers of 4), so a model has
# at most a few variants, all compiled at start-up (`batch_classes`, the runner's sampler warm-up).
_BATCH_CLASS_BASE = 4


def batch_class(B: int) -> int:
    """The bucket of batch size ``B`` the chunk count is chosen for: the next power of 4."""
    c = 1
    while c < B:
        c *= _BATCH_CLASS_BASE
    return c


def batch_classes(max_batch: int) -> list[int]:
    """One batch size per bucket up to ``max_batch``: sampling one batch of each compiles every
    variant a run can meet."""
    out, c = [], 1
    while True:
        out.append(min(c, max_batch))
        if c >= max_batch:
            return out
        c *= _BATCH_CLASS_BASE


def _split(B: int, V: int, device: torch.device) -> tuple[int, int]:
    """Chunks per row and their length: about 4 programs per multiprocessor over the batch's
    bucket (`batch_class`)."""
    if device.type == "cuda":
        if device.index not in _SMS:
            _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
        sms = _SMS[device.index]
    else:
        sms = 16  # (the interpreter: several chunks a row, as on a GPU)
    split = max(1, min(triton.cdiv(4 * sms, batch_class(max(B, 1))), triton.cdiv(V, SPLIT_BLOCK)))
    ch = triton.cdiv(triton.cdiv(V, split), SPLIT_BLOCK) * SPLIT_BLOCK
    return triton.cdiv(V, ch), ch


def sample(x, slots, f, i, steps, counts, cand_x, cand_i, fallback, want_tau: bool = True,
           kinds: Optional[tuple[bool, bool]] = None):
    """x [B, V] float32 logits (penalties applied in place), slots [B] int64; per slot: f [6, S] float32
    (temperature, top_p, min_p, repetition, presence, frequency penalty), i [5, S] int64 (top_k, ..,
    noise key in row 4), steps [S] int64; counts [S, V] int32 or None (no penalties); cand_x [>=B, C]
    float32 and cand_i [>=B, C] int32 scratch; fallback: int32 counter of rows whose first cutoffs did
    not fit in C (they search their whole row). -> (token ids [B] int64, tau [B] float32). Same result
    as `sample_ref`. ``want_tau`` false: a top-p row without top-k whose race winner over what min_p
    kept is also kept by top-p takes it without its threshold's search (its tau is nan). ``kinds``: whether
    any row may be (top-p without top-k, top-k) among the slots (`SamplerState.variant`); a pass no row
    needs is not launched (None: every pass)."""
    B, V = x.shape
    assert x.stride(1) == 1 and f.is_contiguous() and i.is_contiguous()
    dev = x.device
    ids = torch.empty(B, dtype=torch.int64, device=dev)
    tau = torch.empty(B, dtype=torch.float32, device=dev)
    if not B:
        return ids, tau
    split, ch = _split(B, V, dev)
    sp2, P, S, C = triton.next_power_of_2(split), PIVOTS, f.shape[1], cand_x.shape[1]
    # every slice starts 64-byte aligned whatever B: Triton compiles a variant per pointer alignment
    n = triton.cdiv(B * split, 16) * 16
    fl = torch.empty((5 + 2 * P) * n + B * P, dtype=torch.float32, device=dev)
    pmax, pmin, pz, rs, rs2 = (fl[k * n:k * n + B * split] for k in range(5))
    pm = fl[5 * n:5 * n + P * B * split]
    pc = fl[(5 + P) * n:(5 + P) * n + P * B * split].view(torch.int32)
    piv = fl[(5 + 2 * P) * n:]
    pidx = torch.empty(B * split, dtype=torch.int32, device=dev)
    ri = torch.empty(2 * n, dtype=torch.int64, device=dev)
    ri, ri2 = ri[:B * split], ri[n:n + B * split]
    cnt = counts if counts is not None else x
    winner = not want_tau
    top_p_rows, top_k_rows = (True, True) if kinds is None else kinds
    grid = (B, split)
    pdl = use_pdl(dev, "sampler")  # (each pass launched while the one before ends: `kernels.pdl`)
    # (4 warps read a chunk faster where no penalty is applied; with penalties 8: H200, docs/performance.md)
    _pass1_kernel[grid](x, x.stride(0), V, ch, slots, f, S, cnt, pmax, pidx, pmin,
                        PEN=counts is not None, PROMPT=PROMPT_BIT, BLOCK=SPLIT_BLOCK, PDL=pdl,
                        num_warps=8 if counts is not None else 4, launch_pdl=pdl)
    if top_k_rows or (top_p_rows and not winner):  # (the rows that search their thresholds)
        _pivot_kernel[grid](x, x.stride(0), V, ch, slots, f, i, S, pmax, piv, pc, pm, pz,
                            SP2=sp2, P=P, PB=PIVOT_BLOCK, WINNER=winner, PDL=pdl, num_warps=8, launch_pdl=pdl)
    _compact_kernel[grid](x, x.stride(0), V, ch, slots, f, i, S, steps, pmax, piv, pc, pm, pz, cand_x, cand_i, C,
                          rs, ri, SP2=sp2, P=P, BLOCK=SPLIT_BLOCK, WINNER=winner, PDL=pdl, num_warps=8,
                          launch_pdl=pdl)
    if winner and top_p_rows:  # (winner rows: the first winner's check, then one more race and its check, split)
        for stage in range(3):
            _above_kernel[grid](x, x.stride(0), V, ch, slots, f, i, S, steps, pmax, pm, pz, rs, ri, rs2, ri2,
                                SP2=sp2, P=P, BLOCK=SPLIT_BLOCK, STAGE=stage, PDL=pdl, num_warps=8, launch_pdl=pdl)
    _finish_kernel[(B,)](x, x.stride(0), V, slots, f, i, S, steps, pmax, pidx, pmin, piv, pc, pm, pz, cand_x, cand_i, C,
                         rs, ri, rs2, ri2, ids, tau, fallback, split, SP2=sp2, P=P, PB=PIVOT_BLOCK, BLOCK=BLOCK,
                         REFINE=REFINE, WINNER=winner, TRIES=TRIES, SMALL=FINISH_TILE, PDL=pdl, num_warps=8,
                         launch_pdl=pdl)
    return ids, tau
