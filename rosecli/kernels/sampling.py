"""Sampling kernels: penalties from per-slot token counts, and the exponential race with
counter-based noise. Each has a plain-torch reference beside it that gives the same result.

Noise is a hash of (the slot's key, its step, the token id): the same (request seed, step) gives the
same noise whatever the batch, the row, the device or the candidate set raced over, so a seeded
request repeats exactly and racing over a top-k candidate set picks the same token as racing over
the whole vocabulary restricted to those candidates. The race picks the token that maximises
``logit / T + Gumbel noise`` among tokens whose logit is at least the row's threshold ``tau``
(that is softmax sampling restricted to them); a row with ``inv_t == 0`` is greedy: plain argmax,
first index on ties, like ``torch.argmax``.
"""

import torch
import triton
import triton.language as tl

PROMPT_BIT = 1 << 30  # counts[slot, token]: bit 30 = token in the prompt, low 30 bits = times in the output
M32 = 0xFFFFFFFF
RACE_CHUNK = 8192  # tokens per race program: a 128k vocabulary is 16 programs per row
PENALTY_BLOCK = 2048


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


@triton.jit
def _fmix32(x):
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


# --- race ---------------------------------------------------------------------------------------
def race_ref(x: torch.Tensor, tokens, slots: torch.Tensor, inv_t: torch.Tensor, tau: torch.Tensor,
             keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """x: [B, N] float32 logits (untempered); tokens: [B, N] token ids of x's columns, or None for
    0..N-1; inv_t, tau: [B]; keys, steps: per slot, read at ``slots`` [B]. -> token ids [B] int64."""
    B, N = x.shape
    if tokens is None:
        tokens = torch.arange(N, device=x.device).expand(B, N)
    g = gumbel_ref(keys[slots], steps[slots], tokens)
    greedy = (inv_t == 0)[:, None]
    score = torch.where(greedy, x, x * inv_t[:, None] + g)
    score = score.masked_fill(~(x >= tau[:, None]), float("-inf"))
    best = score.argmax(dim=1, keepdim=True)
    return tokens.gather(1, best).squeeze(1).long()


@triton.jit
def _race_kernel(x_ptr, x_stride, tok_ptr, tok_stride, score_ptr, id_ptr, slot_ptr, inv_t_ptr, tau_ptr,
                 key_ptr, step_ptr, N, NSPLIT, CHUNK: tl.constexpr, HAS_TOK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    slot = tl.load(slot_ptr + row)
    inv_t = tl.load(inv_t_ptr + row)
    tau = tl.load(tau_ptr + row)
    key = tl.load(key_ptr + slot).to(tl.uint32)
    step = tl.load(step_ptr + slot).to(tl.uint32)
    key2 = _fmix32(key + step * 0x9E3779B1)
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int64)
    for start in range(part * CHUNK, part * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + row.to(tl.int64) * x_stride + offs, mask=mask, other=float("-inf"))
        if HAS_TOK:
            tok = tl.load(tok_ptr + row.to(tl.int64) * tok_stride + offs, mask=mask, other=0)
        else:
            tok = offs
        h = _fmix32((tok.to(tl.uint32) * 0x85EBCA77) ^ key2)
        h = _fmix32(h ^ key)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608)
        g = -tl.log(-tl.log(u))
        score = tl.where(inv_t == 0, x, x * inv_t + g)
        score = tl.where(mask & (x >= tau), score, float("-inf"))
        m = tl.max(score, 0)
        i = tl.argmax(score, 0)
        t = tl.sum(tl.where(tl.arange(0, BLOCK) == i, tok.to(tl.int64), 0), 0)
        take = m > best
        best_id = tl.where(take, t, best_id)
        best = tl.where(take, m, best)
    tl.store(score_ptr + row * NSPLIT + part, best)
    tl.store(id_ptr + row * NSPLIT + part, best_id)


def race(x: torch.Tensor, tokens, slots, inv_t, tau, keys, steps) -> torch.Tensor:
    """Triton version of `race_ref` (same arguments, same result)."""
    B, N = x.shape
    assert x.stride(1) == 1 and (tokens is None or tokens.stride(1) == 1)
    chunk = min(RACE_CHUNK, triton.next_power_of_2(max(N, 16)))
    nsplit = triton.cdiv(N, chunk)
    scores = torch.empty((B, nsplit), dtype=torch.float32, device=x.device)
    ids = torch.empty((B, nsplit), dtype=torch.int64, device=x.device)
    if B == 0:
        return ids[:, 0]
    block = min(chunk, 2048)
    inv_t, tau = inv_t.contiguous(), tau.contiguous()
    _race_kernel[(B, nsplit)](
        x, x.stride(0), tokens if tokens is not None else x, tokens.stride(0) if tokens is not None else 0,
        scores, ids, slots, inv_t, tau, keys, steps, N, nsplit,
        CHUNK=chunk, HAS_TOK=tokens is not None, BLOCK=block, num_warps=8)
    if nsplit == 1:
        return ids[:, 0]
    return ids.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)


# --- penalties ----------------------------------------------------------------------------------
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


@triton.jit
def _penalty_kernel(x_ptr, x_stride, slot_ptr, cnt_ptr, rep_ptr, pres_ptr, freq_ptr, V,
                    PROMPT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    rep = tl.load(rep_ptr + slot)
    pres = tl.load(pres_ptr + slot)
    freq = tl.load(freq_ptr + slot)
    if (rep != 1.0) | (pres != 0.0) | (freq != 0.0):  # rows without penalties read nothing
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < V
        xp = x_ptr + row.to(tl.int64) * x_stride + offs
        x = tl.load(xp, mask=mask, other=0.0)
        c = tl.load(cnt_ptr + slot.to(tl.int64) * V + offs, mask=mask, other=0)
        n = (c & (PROMPT - 1)).to(tl.float32)
        x = tl.where(c != 0, tl.where(x > 0, x / rep, x * rep), x)
        x = x - freq * n - tl.where(n > 0, pres, 0.0)
        tl.store(xp, x, mask=mask)


def penalties(x, slots, counts, rep, pres, freq) -> torch.Tensor:
    """Triton version of `penalties_ref` (same arguments, same result, in place)."""
    B, V = x.shape
    assert x.stride(1) == 1 and counts.shape[1] == V
    if B:
        _penalty_kernel[(B, triton.cdiv(V, PENALTY_BLOCK))](
            x, x.stride(0), slots, counts, rep, pres, freq, V, PROMPT=PROMPT_BIT, BLOCK=PENALTY_BLOCK, num_warps=8)
    return x
