"""The batched device sampler (`SamplerState`) against references: transformers' logits processors
and plain-torch (sorting) implementations of vLLM v1's semantics, on random logits."""

import math
from types import SimpleNamespace as P

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from rosecli.engine.sampling_state import SamplerState
from rosecli.kernels import sampling as K

V = 48
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # kernels: the GPU, else the Triton interpreter


def _state(slots=8, vocab=V, **kw):
    kw.setdefault("max_stop_ids", 8)
    return SamplerState(slots, vocab, "cpu", seed=kw.pop("seed", 0), **kw)


def _slots(*s):
    return torch.tensor(s, dtype=torch.long)


def ref_filter(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM v1 order with a full sort: temperature, min_p, top-k, top-p (over what is left) -> probs."""
    x = logits / temperature
    probs = x.softmax(-1)
    if min_p > 0:
        x = x.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k > 0:
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    if top_p < 1:
        srt, order = x.sort(descending=True)
        p = srt.softmax(-1)
        drop = (p.cumsum(-1) - p) >= top_p
        x = x.clone()
        x[order[drop]] = float("-inf")
    return x.softmax(-1)


def _draw(state, slot_list, logits_row, steps):
    """ids of `steps` sampling steps of every slot in slot_list on the same logits row."""
    slots = _slots(*slot_list)
    draws = []
    for _ in range(steps):
        x = logits_row.expand(len(slot_list), -1).clone()
        draws.append(state.sample(x, slots).token_ids)
    return torch.cat(draws)


def _tv(ids, probs):
    freq = torch.bincount(ids, minlength=probs.numel()).double() / ids.numel()
    return 0.5 * (freq - probs.double()).abs().sum().item()


CASES = [dict(temperature=0.8), dict(temperature=1.0, top_k=5), dict(temperature=0.7, top_p=0.8),
         dict(temperature=1.3, min_p=0.1), dict(temperature=0.8, top_k=12, top_p=0.9),
         dict(temperature=1.1, top_k=20, top_p=0.7, min_p=0.05), dict(temperature=1.5, top_p=0.6, min_p=0.02)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_empirical_distribution_matches_reference(case):
    torch.manual_seed(0)
    logits = torch.randn(V) * 2
    ref = ref_filter(logits, **case)
    st = _state(slots=400)
    slots = [st.acquire(P(**case, seed=i)) for i in range(400)]
    st.flush()
    ids = _draw(st, slots, logits, 20)  # 8000 draws: fresh noise per slot and per step
    assert ref[ids].min() > 0, "sampled a token the filters remove"
    assert _tv(ids, ref) < 0.04


def test_single_filters_match_transformers_warpers():
    torch.manual_seed(1)
    logits = torch.randn(1, V) * 3
    ids = torch.zeros(1, 1, dtype=torch.long)
    for case, warpers in ((dict(temperature=0.7), [TemperatureLogitsWarper(0.7)]),
                          (dict(top_k=7), [TopKLogitsWarper(7)]),
                          (dict(top_p=0.75), [TopPLogitsWarper(0.75)]),
                          (dict(min_p=0.2), [MinPLogitsWarper(0.2)]),
                          (dict(temperature=0.7, top_k=9), [TemperatureLogitsWarper(0.7), TopKLogitsWarper(9)])):
        hf = logits.clone()
        for w in warpers:
            hf = w(ids, hf)
        assert torch.allclose(ref_filter(logits[0], **case), hf.softmax(-1)[0], atol=1e-6), case


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * 4)
    logits = probs.clamp_min(1e-30).log()
    for p, kept in ((0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.95, 3), (0.96, 4), (1.0, 4)):
        st = _state(slots=64, vocab=8)
        slots = [st.acquire(P(temperature=1.0, top_p=p, seed=i)) for i in range(64)]
        st.flush()
        ids = set(_draw(st, slots, logits, 8).tolist())
        assert ids == set(range(kept)), p


def test_penalties_match_transformers_and_openai_definitions():
    torch.manual_seed(2)
    logits = torch.randn(3, V) * 2
    prompt, output = [1, 2, 3, 3, 9], [3, 4, 4, 4, 7]
    st = _state()
    params = [P(repetition_penalty=1.3), P(presence_penalty=0.5, frequency_penalty=0.25),
              P(repetition_penalty=0.8, presence_penalty=-0.3, frequency_penalty=0.4)]
    slots = [st.acquire(p, prompt, output) for p in params]
    st.flush()
    out = st.sample(logits.clone(), _slots(*slots), num_logprobs=V)  # greedy rows; raw logprobs
    x = logits.clone()
    seq = torch.tensor([prompt + output] * 3)
    counts = torch.bincount(torch.tensor(output), minlength=V).float()
    ref = torch.empty_like(x)
    for i, p in enumerate(params):
        r = RepetitionPenaltyLogitsProcessor(getattr(p, "repetition_penalty", 1.0))(seq[i:i + 1], x[i:i + 1].clone())[0]
        ref[i] = (r - getattr(p, "frequency_penalty", 0.0) * counts
                  - getattr(p, "presence_penalty", 0.0) * (counts > 0).float())
    assert out.token_ids.tolist() == ref.argmax(-1).tolist()
    # penalties go on counting the tokens the sampler picks
    picked = out.token_ids.tolist()
    out2 = st.sample(logits.clone(), _slots(*slots))
    for i, p in enumerate(params):
        c = counts.clone()
        c[picked[i]] += 1
        r = RepetitionPenaltyLogitsProcessor(getattr(p, "repetition_penalty", 1.0))(
            torch.tensor([prompt + output + [picked[i]]]), logits[i:i + 1].clone())[0]
        r = r - getattr(p, "frequency_penalty", 0.0) * c - getattr(p, "presence_penalty", 0.0) * (c > 0).float()
        assert out2.token_ids[i].item() == r.argmax().item()


def _kernel_case(rows, vocab, scale=3.0, penalties=False, slots=8, seed=0):
    """Random logits and per-slot parameter blocks for `K.sample` / `K.sample_ref`; rows: list of
    (temperature, top_k, top_p, min_p)."""
    g = torch.Generator().manual_seed(seed)
    B = len(rows)
    x = torch.randn(B, vocab, generator=g) * scale
    f = torch.zeros(6, slots)
    f[3] = 1.0
    i = torch.zeros(5, slots, dtype=torch.int64)
    perm = torch.randperm(slots, generator=g)[:B]  # rows map to scattered slots
    for r, (t, k, p, mp) in enumerate(rows):
        f[0, perm[r]], f[1, perm[r]], f[2, perm[r]], i[0, perm[r]] = t, p, mp, k
    i[4] = torch.randint(0, 2**32, (slots,), generator=g)
    steps = torch.randint(0, 10**6, (slots,), generator=g)
    counts = None
    if penalties:
        f[3, perm] = torch.linspace(0.7, 1.4, B)
        f[4, perm] = torch.linspace(-0.5, 0.8, B)
        f[5, perm] = torch.linspace(0.3, -0.2, B)
        counts = torch.randint(0, 3, (slots, vocab), dtype=torch.int32, generator=g)
        counts[torch.rand(slots, vocab, generator=g) < 0.3] |= K.PROMPT_BIT
        counts[torch.rand(slots, vocab, generator=g) < 0.5] = 0
    return x, perm.clone(), f, i, steps, counts


def _row_kinds(slots, f, i):
    """The row kinds `SamplerState.variant` tells `K.sample` of (top-p without top-k, top-k), from the rows."""
    sampled = f[0][slots] > 0
    k, p = i[0][slots], f[1][slots]
    return bool((sampled & (k <= 0) & (p < 1)).any()), bool((sampled & (k > 0)).any())


def _kernel_vs_ref(x, slots, f, i, steps, counts, capacity, fill=float("nan")):
    """`K.sample` against `K.sample_ref`: the ids and thresholds (``want_tau``), and the ids alone when the
    kernel may take a race winner without its row's threshold, with every pass launched and with only the
    passes the rows' kinds need. ``fill``: what the candidate scratch holds before (NaN, or a huge logit as a
    stale one past a row's candidates would be). -> rows that searched their whole row."""
    B = x.shape[0]
    x, slots, f, i, steps = (t.to(DEV) for t in (x, slots, f, i, steps))
    counts = counts.to(DEV) if counts is not None else None
    ref_ids, ref_tau = K.sample_ref(x.clone(), slots, f, i, steps, counts.clone() if counts is not None else None)
    searched, own = [], _row_kinds(slots, f, i)
    for want_tau, kinds in [(True, None), (False, None)] + ([(True, own), (False, own)] if own != (True, True) else []):
        fallback = torch.zeros((), dtype=torch.int32, device=DEV)
        xk, xr = x.clone(), x.clone()
        # (scratch of NaN: a pass the kinds skip must not be one a row reads)
        ids, tau = K.sample(xk, slots, f, i, steps, counts, torch.full((B, capacity), fill, device=DEV),
                            torch.empty(B, capacity, dtype=torch.int32, device=DEV), fallback, want_tau=want_tau,
                            kinds=kinds)
        K.sample_ref(xr, slots, f, i, steps, counts)
        assert torch.allclose(xk, xr, atol=1e-5)  # penalties written back
        if want_tau:
            assert torch.allclose(tau, ref_tau, atol=1e-5, rtol=0) and torch.equal(tau.isinf(), ref_tau.isinf())
        assert ids.tolist() == ref_ids.tolist(), f"want_tau={want_tau}, kinds={kinds}"
        searched.append(fallback.item())
    return searched[0]


ROWS = [(0.0, 0, 1.0, 0.0), (0.8, 50, 0.95, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.05), (1.2, 0, 1.0, 0.1),
        (0.5, 7, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (1.1, 20, 0.7, 0.05), (0.9, 3000, 1.0, 0.0), (1.0, 1, 0.5, 0.0)]


@pytest.mark.parametrize("vocab", [37, 5000, 33000])
@pytest.mark.parametrize("penalties", [False, True])
def test_sample_kernel_matches_reference(vocab, penalties):
    """The fused kernel (penalties, argmax, exact min_p/top-k/top-p threshold, race) gives the sorting
    reference's tokens and thresholds: greedy, temperature, top-k, top-p, min_p and combinations."""
    x, slots, f, i, steps, counts = _kernel_case(ROWS, vocab, penalties=penalties, slots=12, seed=vocab)
    _kernel_vs_ref(x, slots, f, i, steps, counts, capacity=256)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sample_kernel_matches_reference_on_half_precision_logits(dtype):
    """Logits a float16 or bfloat16 GEMM made (every engine on a GPU): few distinct values, so ties at the
    k-th value and at the nucleus's edge everywhere; the searches stop once their bracket can hold only one
    value (`_granularity`), and still give the reference's tokens and thresholds. A granularity taken too
    coarse (a bracket stopped with two values in it) gives another threshold here."""
    rows = [r for r in ROWS if r[1] > 0 or r[2] < 1] * 2
    x, slots, f, i, steps, counts = _kernel_case(rows, 5000, scale=1.0, slots=16, seed=41 if dtype == torch.float16 else 42)
    x = x.to(dtype).float()
    x[1] = (x[1] * 0.05).to(dtype).float()  # flat: hundreds of tokens on each of a few values
    _kernel_vs_ref(x, slots, f, i, steps, counts, capacity=2 * K.BLOCK)


def _first_cut_candidates(x, t, k, p):
    """How many candidates the first cutoffs give a row (`_first_pivots`, `_choose`; no min_p): the tokens at
    or above the highest cutoff m - 0.5 * 2**j * t that holds its top-k (or, without top-k, its nucleus)."""
    m = x.max()
    w = ((x - m) / t).exp()
    for j in range(K.PIVOTS - 1):
        ge = x >= m - 0.5 * 2 ** j * t
        if (k > 0 and ge.sum() >= k) or (k <= 0 and w[ge].sum() >= p * w.sum()):
            return int(ge.sum())
    return x.numel()


def test_sample_kernel_narrows_many_candidates_to_a_small_tile():
    """Rows whose first cutoffs leave hundreds to thousands of candidates (one token far above the rest: the
    next cutoff's count jumps from a few to thousands) are narrowed by their first filter's search in the
    candidates' wide tile to at most `FINISH_TILE` tokens, copied to the front of the scratch row, and finished
    in a small tile: the reference's tokens and thresholds for top-k, top-k with top-p, top-p alone, on float16
    values (ties), and where more than `FINISH_TILE` tokens stay (a tie at the k-th value, a wide nucleus)."""
    vocab, cap = 5000, 2 * K.BLOCK
    rows = [(1.0, 50, 1.0, 0.0), (1.0, 50, 0.9, 0.0), (1.0, 0, 0.05, 0.0), (1.0, 50, 0.95, 0.0),
            (1.0, 0, 0.5, 0.0), (1.0, 40, 1.0, 0.0), (0.9, 30, 0.8, 0.01)]
    x, slots, f, i, steps, counts = _kernel_case(rows, vocab, seed=31)
    g = torch.Generator().manual_seed(32)
    for r in range(len(rows)):
        x[r] = torch.randn(vocab, generator=g) * 0.3 - 2.0
        x[r, 7:17] = 4.75 + 0.25 * torch.rand(10, generator=g)  # 10 tokens within 0.25 of the max ...
        x[r, 7] = 5.0
        x[r, 100:1600] = 4.0 + 0.5 * torch.rand(1500, generator=g)  # ... then 1,500 within 1
    x[3] = x[3].half().float()  # float16 values: a dozen tokens on each
    x[5, 100:500] = 4.6  # 400 tokens tie at the k-th value
    x[6, 1600:3000] = 3.5 + torch.rand(1400, generator=g)
    fit = [_first_cut_candidates(x[r], *rows[r][:3]) for r in range(len(rows))]
    assert all(K.FINISH_TILE < n <= K.BLOCK for n in fit), fit
    assert _kernel_vs_ref(x, slots, f, i, steps, counts, capacity=cap) == 0
    assert _kernel_vs_ref(x, slots, f, i, steps, counts, capacity=cap, fill=1e30) == 0  # (none read past its own)


@pytest.mark.parametrize("kind", ["temperature", "top-k", "top-p", "greedy"])
def test_sample_kernel_batches_of_one_kind(kind):
    """A batch of one kind of row (W1 sampled, S1, temperature alone) launches only the passes its rows need
    (`_row_kinds`): the reference's tokens and thresholds all the same."""
    rows = [r for r in ROWS if {"temperature": r[0] > 0 and r[1] == 0 and r[2] == 1.0,
                                "top-k": r[0] > 0 and r[1] > 0, "top-p": r[0] > 0 and r[1] == 0 and r[2] < 1,
                                "greedy": r[0] == 0}[kind]]
    x, slots, f, i, steps, counts = _kernel_case(rows, 5000, slots=12, seed=len(rows))
    assert _row_kinds(slots, f, i) == {"temperature": (False, False), "top-k": (False, True),
                                       "top-p": (True, False), "greedy": (False, False)}[kind]
    _kernel_vs_ref(x, slots, f, i, steps, counts, capacity=256)


def test_variant_names_the_row_kinds_the_slots_hold():
    """`SamplerState.variant` tells the kernels which rows the acquired slots can give (top-p without top-k,
    top-k), so they launch only the passes those need: a kind it left out would have its rows read scratch
    no pass wrote. Greedy slots (temperature 0, top_k 1) are neither; a released slot's kind goes with it."""
    st = _state()
    kinds = lambda: st.variant()[-1]  # noqa: E731
    held = [st.acquire(P(temperature=0.0, top_p=0.5)), st.acquire(P(temperature=0.9, top_k=1, top_p=0.9)),
            st.acquire(P(temperature=0.7))]
    assert kinds() == (False, False)
    k = st.acquire(P(temperature=0.8, top_k=50, top_p=0.95))
    assert kinds() == (False, True)
    p = st.acquire(P(temperature=0.8, top_p=0.95, min_p=0.05))
    assert kinds() == (True, True)
    st.release(k)
    assert kinds() == (True, False)
    st.release(p)
    assert kinds() == (False, False)
    for slot in held:
        st.release(slot)


def test_sample_kernel_exact_beyond_its_candidates():
    """Flat rows (nucleus far larger than the candidate scratch), a huge tie at the k-th value and rows
    of held-back (-inf) tokens: still the reference's exact threshold, through the whole-row search."""
    rows = [(1.0, 0, 0.9, 0.0), (0.8, 0, 0.95, 0.0), (1.0, 40, 0.9, 0.0), (1.0, 10, 1.0, 0.0), (1.0, 0, 0.3, 0.0),
            (0.7, 5, 0.8, 0.02)]
    x, slots, f, i, steps, counts = _kernel_case(rows, 4000, scale=0.05, seed=11)
    x[2, :300] = 2.0  # 300 tokens tie at the top: top_k 40 keeps all of them
    x[3] = torch.randint(0, 3, (4000,)).float()  # three distinct values
    x[5, 100:] = float("-inf")  # min_tokens / logit_bias holding most of the vocabulary back
    assert _kernel_vs_ref(x, slots, f, i, steps, counts, capacity=32) >= 3
    # a nucleus of thousands of tokens: more candidates than one register tile (searched in the scratch)
    x, slots, f, i, steps, counts = _kernel_case([(1.0, 0, 0.2, 0.0), (1.0, 5000, 1.0, 0.0)], 30000, scale=0.05)
    _kernel_vs_ref(x, slots, f, i, steps, counts, capacity=2 * K.BLOCK)


def test_sample_kernel_takes_the_race_winner_top_p_keeps():
    """Without the threshold (``want_tau=False``), a top-p row without top-k races over everything min_p
    kept and keeps the winner when top-p keeps it (less than top_p of the mass above it), else races again
    over the tokens above that winner: the reference's token at every step either way, and flat rows (a
    nucleus far beyond the candidate scratch) skip the search. Rows with top-k search as before."""
    rows = [(1.0, 0, 0.95, 0.0), (0.8, 0, 0.6, 0.0), (1.0, 0, 0.85, 0.0), (1.0, 2000, 1.0, 0.0),
            (1.0, 0, 0.5, 0.0), (1.3, 0, 0.9, 0.05), (0.9, 200, 0.9, 0.0)]
    x, slots, f, i, steps, counts = _kernel_case(rows, 4000, scale=0.05, seed=21)
    g = torch.Generator().manual_seed(5)
    x[4] = torch.randn(4000, generator=g) * 3  # a peaked row: its candidates hold the nucleus
    x[5] = torch.randn(4000, generator=g) * 2
    x, slots, f, i = (t.to(DEV) for t in (x, slots, f, i))
    draws, searched, skipped, dropped = 12, 0, 0, 0
    for step in range(draws):
        st = (steps + 7919 * step).to(DEV)
        fallback = torch.zeros((), dtype=torch.int32, device=DEV)
        ids, tau = K.sample(x.clone(), slots, f, i, st, None, torch.empty(len(rows), 32, device=DEV),
                            torch.empty(len(rows), 32, dtype=torch.int32, device=DEV), fallback, want_tau=False)
        ref_ids, _ = K.sample_ref(x.clone(), slots, f, i, st, None)
        assert ids.tolist() == ref_ids.tolist(), f"step {step}"
        searched += fallback.item()
        skipped += int(tau.isnan().sum())
        assert not tau[[3, 6]].isnan().any()  # top-k rows: their thresholds, searched
        # the winner of the race without the filters (what the kernel tries first) where the filter dropped it
        t = f[0][slots]
        free = K.race_ref(x.clone(), None, slots, 1 / t, torch.full_like(t, float("-inf")), i[4], st)
        dropped += int((free[[0, 1, 2, 4, 5]] != ref_ids[[0, 1, 2, 4, 5]]).sum())
    # rows 0-3 are flat (their cutoffs never fit 32 candidates): only the top-k rows 3 and 6 search
    assert searched == 2 * draws and skipped == 5 * draws and dropped >= 6


def test_cpu_sampler_gives_the_references_tokens_and_thresholds():
    """`sample_cpu` (the CPU engine's: the largest logits sorted instead of every row, the race hashing only
    tokens that can win) against the sorting reference: nuclei inside the first 256 logits and far past them
    (flat rows: the sorted prefix grows twice), top-k of thousands, ties of the k-th value past the prefix,
    min_p, held-back tokens, greedy rows, penalties; same ids and thresholds at every step."""
    rows = [(0.0, 0, 1.0, 0.0), (0.8, 0, 0.95, 0.0), (1.0, 0, 0.99, 0.0), (0.7, 0, 0.9, 0.05), (1.2, 0, 1.0, 0.1),
            (0.9, 0, 1.0, 0.0), (1.0, 3000, 0.9, 0.0), (1.0, 5, 0.9, 0.0), (0.8, 50, 0.95, 0.0), (1.0, 7, 1.0, 0.0),
            (1.5, 0, 0.5, 0.0), (1.0, 0, 0.97, 0.0)]
    for penalties in (False, True):
        x, slots, f, i, steps, counts = _kernel_case(rows, 20000, penalties=penalties, slots=16, seed=3)
        x[1] *= 0.02  # flat: a nucleus of most of the row
        x[2] *= 0.1
        x[7, 100:140] = x[7].max() + 1  # 40 tokens tie at the top: top_k 5 keeps all of them
        x[9, :3000] = float("-inf")
        x[11] *= 0.3
        for step in range(4):
            st = steps + 104729 * step
            ids, tau = K.sample_cpu(x.clone(), slots, f, i, st, counts.clone() if penalties else None)
            ref_ids, ref_tau = K.sample_ref(x.clone(), slots, f, i, st, counts.clone() if penalties else None)
            assert ids.tolist() == ref_ids.tolist(), (penalties, step)
            assert torch.allclose(tau, ref_tau, atol=1e-5, rtol=0) and torch.equal(tau.isinf(), ref_tau.isinf())
    # every row with top-k, so only the largest top_k + 1 are sorted: 40 tokens tie at row 0's 3rd value, past
    # them, and top-p 0.5 keeps the ties only when they all count (the top token holds 10 of their 50 parts)
    x, slots, f, i, steps, counts = _kernel_case([(1.0, 3, 0.5, 0.0), (0.8, 2, 0.95, 0.0)], 5000, seed=4)
    x[0] = -20.0
    x[0, 1000:1040] = 0.0
    x[0, 7] = math.log(10.0)
    ids, tau = K.sample_cpu(x.clone(), slots, f, i, steps, None)
    ref_ids, ref_tau = K.sample_ref(x.clone(), slots, f, i, steps, None)
    assert ids.tolist() == ref_ids.tolist() and torch.allclose(tau, ref_tau, atol=1e-6, rtol=0)
    assert ref_tau[0].item() == 0.0  # (the ties are kept)
    _kernel_vs_ref(x, slots, f, i, steps, None, capacity=64)  # (and the GPU's kernel weighs them too)


def test_cpu_noise_is_the_references_bit_for_bit():
    """`gumbel_cpu` (uint32 in numpy) gives `gumbel_ref`'s noise (uint32 emulated in int64) to the bit, keys and
    steps at their extremes included: a seeded request samples the same text on either."""
    g = torch.Generator().manual_seed(0)
    key = torch.randint(0, 2**32, (6,), generator=g)
    step = torch.randint(0, 2**40, (6,), generator=g)  # (steps past 2**32 wrap as the kernel's do)
    key[:2], step[2:4] = torch.tensor([0, 2**32 - 1]), torch.tensor([0, 2**32 - 1])
    tokens = torch.randint(0, 2**31, (6, 4000), generator=g)
    tokens[0, :2] = torch.tensor([0, 2**31 - 1])
    ref, cpu = K.gumbel_ref(key, step, tokens), K.gumbel_cpu(key, step, tokens)
    assert cpu.dtype == ref.dtype == torch.float32 and torch.equal(cpu.view(torch.int32), ref.view(torch.int32))


def test_cpu_penalties_are_the_references_bit_for_bit():
    """`penalties_cpu` (the tokens a slot has seen only) gives `penalties_ref`'s logits to the bit: repetition
    over prompt and output tokens, frequency and presence over the output, rows without penalties (left as they
    were whatever their counts hold) and a slot that has seen nothing."""
    x, slots, f, i, steps, counts = _kernel_case(ROWS, 5000, penalties=True, slots=12, seed=17)
    x[:, :50] = -x[:, :50].abs()  # negative logits: multiplied, not divided
    f[3:, slots[2]] = torch.tensor([1.0, 0.0, 0.0])  # a row without penalties
    counts[slots[3]] = 0  # a slot that has seen nothing
    ref = K.penalties_ref(x.clone(), slots, counts, f[3], f[4], f[5])
    cpu = K.penalties_cpu(x.clone(), slots, counts, f[3], f[4], f[5])
    assert torch.equal(cpu.view(torch.int32), ref.view(torch.int32))
    assert not torch.equal(ref, x)  # (the penalties changed something)


def test_cpu_thresholds_sort_only_the_tokens_above_a_cutoff(monkeypatch):
    """`thresholds_cpu` sorts only the tokens above the first cutoff that holds a row's k largest or, without
    top-k, its nucleus (peaked rows, rows past two cutoffs, ties at the nucleus's edge and at the k-th value,
    min_p's cut reached before k tokens or the nucleus): the reference's thresholds and tokens; only a flat row
    (more than `NUCLEUS_MAX` candidates) sorts the largest logits."""
    rows = [(0.8, 0, 0.9, 0.0), (1.0, 0, 0.5, 0.0), (1.0, 0, 0.9, 0.0), (0.7, 0, 0.5, 0.0), (1.0, 0, 0.99, 0.2),
            (1.0, 20, 0.9, 0.0), (1.2, 0, 0.8, 0.0), (0.0, 0, 1.0, 0.0), (0.9, 30, 1.0, 0.0), (1.0, 5, 0.9, 0.0),
            (1.0, 3000, 0.95, 0.3), (0.7, 40, 0.95, 0.0)]
    x, slots, f, i, steps, counts = _kernel_case(rows, 20000, slots=16, seed=13)
    x[1] *= 0.8  # rows 0 and 1: their nucleus past the first two cutoffs (3,786 candidates at the third)
    x[2] *= 0.01  # flat: thousands of candidates at every cutoff
    x[3, 100:140] = x[3].max() + 1  # 40 tokens tie at the top: top-p 0.5 keeps them all
    x[6, 5000] = x[6].max() + 30  # one token holds nearly all the weight
    x[9, 200:230] = x[9].max() - 1  # 30 tokens tie at the 5th value: top-k 5 keeps them all, top-p weighs them
    x[11] *= 0.4  # top-k 40 past the first cutoffs
    sent = []
    real = K._thresholds_topk
    monkeypatch.setattr(K, "_thresholds_topk", lambda x, *a: sent.append(x.shape[0]) or real(x, *a))
    for step in range(3):
        st = steps + 104729 * step
        ids, tau = K.sample_cpu(x.clone(), slots, f, i, st, None)
        ref_ids, ref_tau = K.sample_ref(x.clone(), slots, f, i, st, None)
        assert ids.tolist() == ref_ids.tolist(), step
        assert torch.allclose(tau, ref_tau, atol=1e-6, rtol=0) and torch.equal(tau.isinf(), ref_tau.isinf())
    assert sent == [1, 1, 1]  # (the flat row)
    assert (ref_tau[3] == x[3].max()).item() and (x[3] >= ref_tau[3]).sum() == 40
    assert (x[9] >= ref_tau[9]).sum() >= 30  # (all the ties at the 5th value)


def test_cpu_sampling_runs_on_one_thread_and_gives_the_threads_back(monkeypatch):
    """torch's threads woken by a vocabulary-wide operation spin afterwards on the cores the decode step's
    threads need: the CPU sampler runs on one thread (sampled decoding of the default model: 98 -> 207
    tok/s on 2 CPUs) and the process's thread count is what it was after."""
    seen = []
    real = K.sample_cpu
    monkeypatch.setattr(K, "sample_cpu", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        st = _state()
        s = st.acquire(P(temperature=0.8, top_p=0.9, seed=1))
        st.flush()
        st.sample(torch.randn(1, V), _slots(s))
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_sample_kernel_ties_take_the_first_token():
    """Greedy rows take the first of tied maxima, also when they lie in different chunks of the row;
    a top-k row keeps every token tied at its k-th value."""
    x, slots, f, i, steps, counts = _kernel_case([(0.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 2, 1.0, 0.0)], 20000)
    x[:2, [3000, 7000, 19000]] = 50.0
    x[1, 3000] = 49.0
    x[2, [100, 12000, 15000]] = 50.0  # top_k 2: all three tie
    _kernel_vs_ref(x, slots, f, i, steps, counts, capacity=64)
    ids, _ = K.sample_ref(x.clone(), slots, f, i, steps, counts)
    assert ids[:2].tolist() == [3000, 7000] and ids[2].item() in (100, 12000, 15000)


def test_min_tokens_holds_back_eos_and_stop_ids():
    torch.manual_seed(5)
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 11], logits[0, 3] = 10.0, 9.0, 8.0  # EOS 7 and stop id 11 lead
    st = _state()
    s = st.acquire(P(min_tokens=3), stop_ids=[7, 11])
    t = st.acquire(P())  # no min_tokens: EOS as usual
    st.flush()
    picked = [st.sample(logits.expand(2, -1).clone(), _slots(s, t)).token_ids.tolist() for _ in range(4)]
    assert [p[0] for p in picked] == [3, 3, 3, 7]
    assert all(p[1] == 7 for p in picked)
    # the same as transformers' processor (EOS only) on a request that already has 1 output token
    hf = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=3, eos_token_id=7)
    ref = hf(torch.tensor([[1, 2, 5]]), logits.clone())
    st2 = _state()
    u = st2.acquire(P(min_tokens=3), output_ids=[5], stop_ids=[7])
    st2.flush()
    out = st2.sample(logits.clone(), _slots(u), num_logprobs=3)
    assert out.token_ids.item() == ref.argmax().item() == 11


def test_logit_bias_and_bad_ids():
    torch.manual_seed(6)
    logits = torch.randn(2, V)
    st = _state(logprobs_mode="processed")
    a = st.acquire(P(logit_bias={5: 100.0, 6: -3.5}))
    b = st.acquire(P(logit_bias={int(logits[1].argmax()): -100}))
    st.flush()
    out = st.sample(logits.clone(), _slots(a, b), num_logprobs=4)
    ref = logits.clone()
    ref[0, 5] += 100.0
    ref[0, 6] -= 3.5
    ref[1, logits[1].argmax()] -= 100
    assert out.token_ids.tolist() == ref.argmax(-1).tolist()
    assert torch.allclose(out.top_logprobs, ref.log_softmax(-1).topk(4).values, atol=1e-5)
    with pytest.raises(ValueError, match="logit_bias token id 48 is outside the vocabulary"):
        st.acquire(P(logit_bias={48: 1.0}))
    with pytest.raises(ValueError, match="at most 300"):
        st.acquire(P(logit_bias={i: 1.0 for i in range(301)}))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        st.acquire(P(temperature=1.0, top_p=0.0))
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\], got 1.5"):
        st.acquire(P(temperature=1.0, min_p=1.5))


def test_allowed_token_ids_restrict_their_rows_only():
    """vLLM's allowed_token_ids: a greedy row takes the best allowed token, a sampled row draws only among the allowed
    (in proportion to their probabilities), a row without them in the same batch is unchanged, raw logprobs are the
    model's; a slot given back and taken by a request without them samples the whole vocabulary again."""
    torch.manual_seed(8)
    logits = torch.randn(3, V) * 2
    allowed = [3, 17, 40, 41]
    st = _state(slots=4, logprobs_mode="raw")
    g = st.acquire(P(allowed_token_ids=allowed))
    sampled = st.acquire(P(temperature=1.0, allowed_token_ids=allowed, seed=5))
    free = st.acquire(P(temperature=1.0, seed=6))
    st.flush()
    alone = _state(slots=1)
    a = alone.acquire(P(temperature=1.0, seed=6))
    alone.flush()
    draws, free_draws, want_free = [], [], []
    for step in range(400):
        out = st.sample(logits.clone(), _slots(g, sampled, free), num_logprobs=2)
        if step == 0:
            assert out.token_ids[0].item() == allowed[int(logits[0, allowed].argmax())]
            assert torch.allclose(out.top_logprobs[0], logits[0].log_softmax(-1).topk(2).values, atol=1e-5)
        draws.append(out.token_ids[1].item())
        free_draws.append(out.token_ids[2].item())
        want_free.append(alone.sample(logits[2:].clone(), _slots(a)).token_ids.item())
    assert set(draws) <= set(allowed) and free_draws == want_free
    probs = torch.zeros(V)
    probs[allowed] = logits[1, allowed].softmax(-1)
    assert _tv(torch.tensor(draws), probs) < 0.1
    st.release(g)
    again = st.acquire(P())
    st.flush()
    x = torch.zeros(1, V)
    x[0, 9] = 1.0
    assert st.sample(x, _slots(again)).token_ids.item() == 9  # the slot's last user's mask is gone
    with pytest.raises(ValueError, match="allowed_token_ids: token id 48 is outside the vocabulary"):
        st.acquire(P(allowed_token_ids=[1, 48]))
    with pytest.raises(ValueError, match="at least one token id"):
        st.acquire(P(allowed_token_ids=[]))


def test_logprobs_raw_and_processed():
    torch.manual_seed(7)
    logits = torch.randn(3, V) * 2
    for mode in ("raw", "processed"):
        st = _state(logprobs_mode=mode)
        params = [P(), P(temperature=0.5, top_k=6, seed=1), P(temperature=0.9, presence_penalty=1.0, seed=2)]
        slots = [st.acquire(p, [1, 2], [4, 4]) for p in params]
        st.flush()
        out = st.sample(logits.clone(), _slots(*slots), num_logprobs=5)
        if mode == "raw":  # vLLM's default: the model's own distribution
            ref = logits.log_softmax(-1)
        else:  # what each row samples from
            x = logits.clone()
            x[2, 4] -= 1.0
            ref = torch.stack([x[0].log_softmax(-1), ref_filter(x[1], 0.5, top_k=6).log(),
                               ref_filter(x[2], 0.9).log()])
        assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0], atol=1e-5)
        assert torch.allclose(out.top_logprobs, ref.topk(5).values, atol=1e-5)
        assert torch.equal(ref.gather(1, out.top_ids), out.top_logprobs) or \
            torch.allclose(ref.gather(1, out.top_ids), out.top_logprobs, atol=1e-5)


def test_mixed_batch_greedy_sampled_seeded_rows():
    torch.manual_seed(8)
    steps = 6
    seq = [torch.randn(V) * 2 for _ in range(steps)]
    seeded = P(temperature=1.0, top_p=0.9, seed=1234)

    def run(batch, order):
        st = _state(seed=99)
        slots = {name: st.acquire(p) for name, p in batch}
        st.flush()
        out = {name: [] for name, _ in batch}
        for s in range(steps):
            names = order(s)
            ids = st.sample(torch.stack([seq[s]] * len(names)), _slots(*[slots[n] for n in names])).token_ids
            for n, t in zip(names, ids.tolist()):
                out[n].append(t)
        return out

    alone = run([("seeded", seeded)], lambda s: ["seeded"])
    mixed = run([("greedy", P()), ("hot", P(temperature=1.5)), ("seeded", seeded), ("k", P(temperature=1, top_k=3))],
                lambda s: ["greedy", "hot", "seeded", "k"] if s % 2 else ["seeded", "k", "hot", "greedy"])
    assert mixed["seeded"] == alone["seeded"]  # its own stream, whatever the batch and row
    assert mixed["greedy"] == [int(x.argmax()) for x in seq]
    assert all(t in x.topk(3).indices.tolist() for t, x in zip(mixed["k"], seq))
    again = run([("greedy", P()), ("hot", P(temperature=1.5)), ("seeded", seeded), ("k", P(temperature=1, top_k=3))],
                lambda s: ["greedy", "hot", "seeded", "k"])
    assert again == run([("greedy", P()), ("hot", P(temperature=1.5)), ("seeded", seeded),
                         ("k", P(temperature=1, top_k=3))], lambda s: ["greedy", "hot", "seeded", "k"])
    other = run([("seeded", P(temperature=1.0, top_p=0.9, seed=1235))], lambda s: ["seeded"])
    assert other["seeded"] != alone["seeded"]


def test_resumed_request_continues_its_seeded_stream():
    torch.manual_seed(9)
    logits = [torch.randn(1, V) for _ in range(6)]
    p = P(temperature=1.0, seed=42)
    st = _state()
    s = st.acquire(p)
    st.flush()
    full = [st.sample(x.clone(), _slots(s)).token_ids.item() for x in logits]
    st2 = _state()
    s2 = st2.acquire(p, output_ids=full[:3])  # preempted after 3 tokens, recomputed
    st2.flush()
    assert [st2.sample(x.clone(), _slots(s2)).token_ids.item() for x in logits[3:]] == full[3:]


def test_slots_are_reused_cleanly():
    st = _state(slots=2)
    a = st.acquire(P(logit_bias={3: 50.0}, presence_penalty=2.0), [1], [3, 3])
    st.release(a)
    b = st.acquire(P())
    st.flush()
    x = torch.zeros(1, V)
    x[0, 9] = 1.0
    assert st.sample(x, _slots(b)).token_ids.item() == 9  # no bias or penalty left from the slot's last user
    st.acquire(P())
    with pytest.raises(RuntimeError, match="all 2 sampling slots are in use"):
        st.acquire(P())


@pytest.mark.gpu
def test_gpu_matches_cpu():
    torch.manual_seed(10)
    params = [P(), P(temperature=0.8, top_k=50, top_p=0.95, seed=1), P(temperature=1.0, seed=2),
              P(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3, seed=3),
              P(temperature=1.2, min_tokens=4, logit_bias={5: 3.0}, seed=4), P(temperature=0.5, top_k=7, seed=5),
              P(temperature=0.9, allowed_token_ids=[7, 70, 700, 1999], seed=6), P(allowed_token_ids=[11, 1500])]
    logits = torch.randn(len(params), 2000) * 3
    res = []
    for dev in ("cpu", "cuda"):
        st = SamplerState(8, 2000, dev, max_stop_ids=8)
        slots = [st.acquire(p, [1, 2, 3], [4, 5], stop_ids=[0, 1]) for p in params]
        st.flush()
        s = torch.tensor(slots, device=dev)
        res.append([st.sample(logits.clone().to(dev), s).token_ids.cpu() for _ in range(3)])  # in place
    assert all(torch.equal(a, b) for a, b in zip(*res))
