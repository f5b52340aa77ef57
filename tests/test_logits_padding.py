"""The output layer's rows padded for an aligned logits GEMM, and the split greedy argmax of the
decode graph (issue 21): the argmax equals torch.argmax (Triton interpreter on CPU), and padding
changes no token, logprob, sampled id, grammar or byte count a user sees (forced on the CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from engine_utils import VOCAB, our_model, tiny_hf_model, tiny_scheduler

from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.errors import ConfigError
from rosecli.engine.models.common import vocab_padding
from rosecli.engine.roofline import decode_bytes
from rosecli.kernels.argmax import argmax, argmax_ref, chunk_for, logits_argmax, logits_argmax_ref

PAD = 100  # the tests' multiple: VOCAB = 256 rows become 300
INF, NAN = float("inf"), float("nan")


# --- the split argmax against torch.argmax ------------------------------------------------------------


def _same(x, n_cols=None, chunk=None):
    got, want = argmax(x, n_cols, chunk), argmax_ref(x, n_cols)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()


@pytest.mark.parametrize("rows,cols,chunk", [(1, 1, None), (3, 511, None), (2, 513, None), (4, 3000, 512),
                                             (2, 5000, 1024), (3, 9000, 4096), (1, 50257, None)])
def test_split_argmax_equals_torch_on_random_rows(rows, cols, chunk):
    g = torch.Generator().manual_seed(rows * cols)
    _same(torch.randn(rows, cols, generator=g), chunk=chunk)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_argmax_of_half_precision_logits_is_torchs(dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 2000, generator=g) * 3).to(dtype)  # coarse values: many exact ties
    x[1, 100] = x[1, 1900] = x[1].max() + 1  # a tie in the first and the last chunk
    _same(x, chunk=512)


def test_ties_go_to_the_lowest_index_across_chunks():
    x = torch.zeros(5, 2048)
    x[0] = 1.0  # all equal: 0
    x[1, [700, 511, 512, 2047]] = 3.0  # on both sides of a chunk boundary
    x[2, [2047, 1536]] = 3.0
    x[3, 513] = INF
    x[3, 1800] = INF
    x[4, 2047] = 1e30
    _same(x, chunk=512)
    assert argmax(x, chunk=512).tolist() == [0, 511, 1536, 513, 2047]


def test_inf_rows_and_nan_are_handled_as_torch_does():
    """NaN is the largest value (its first index wins); a row of -inf gives 0."""
    x = torch.randn(6, 1500, generator=torch.Generator().manual_seed(3))
    x[0] = -INF
    x[1] = -INF
    x[1, 1400] = -1e30
    x[2, [1200, 700]] = NAN  # NaN in a later chunk than another NaN and than the maximum
    x[2, 5] = INF
    x[3] = NAN
    x[4, 1499] = NAN
    x[5, :1024] = -INF  # whole chunks of -inf
    _same(x, chunk=512)
    assert argmax(x, chunk=512)[:5].tolist() == [0, 1400, 700, 0, 1499]


def test_padded_columns_are_never_the_answer():
    """A padded row (stride past n_cols) whose tail holds the largest values, NaN and +inf."""
    g = torch.Generator().manual_seed(5)
    full = torch.randn(4, 1100, generator=g)
    full[:, 1000:] = 1e9
    full[1, 1050] = NAN
    full[2, 1099] = INF
    full[3, :1000] = -INF
    for chunk in (None, 512, 1024):
        got = argmax(full, 1000, chunk)
        assert got.tolist() == full[:, :1000].argmax(-1).tolist() and (got < 1000).all()
    view = full[:, :1000]  # the same as a non-contiguous view, n_cols from its width
    assert argmax(view).tolist() == argmax_ref(view).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_logits_argmax_writes_the_float32_logits_and_their_argmax(dtype):
    g = torch.Generator().manual_seed(9)
    raw = (torch.randn(3, 1100, generator=g) * 3).to(dtype)
    raw[:, 1000:] = 1e4  # padding columns
    raw[1, [10, 900]] = raw[1, :1000].max() + 1
    raw[2, 600] = NAN
    for chunk in (None, 512):
        logits, ids = logits_argmax(raw, 1000, chunk)
        want_logits, want_ids = logits_argmax_ref(raw, 1000)
        assert logits.dtype == torch.float32 and logits.shape == (3, 1000) and logits.is_contiguous()
        assert torch.equal(logits.nan_to_num(), want_logits.nan_to_num()) and ids.tolist() == want_ids.tolist()
    assert ids.tolist()[1:] == [10, 600]


def test_split_argmax_edge_shapes_and_bad_widths():
    assert argmax(torch.zeros(0, 10)).shape == (0,)
    with pytest.raises(ValueError, match="argmax over 11 columns of a tensor 10 wide"):
        argmax(torch.zeros(2, 10), 11)
    # one row of a large vocabulary spreads over many programs; a large batch keeps the partials few
    assert chunk_for(1, 128256) == 512 and chunk_for(64, 128256) == 4096 and chunk_for(64, 50257) == 2048


# --- the padded output layer ------------------------------------------------------------------------


def _padded_model(kind, multiple=PAD, seed=0):
    hf = tiny_hf_model(kind, seed=seed)
    with vocab_padding(multiple):
        return hf, our_model(hf)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])  # tied, tied, untied
def test_padded_output_rows_share_the_loaded_weights_and_give_the_same_logits(kind):
    hf, padded = _padded_model(kind)
    plain = our_model(hf)
    rows = padded.logits_weight
    assert rows.shape == (300, 64)
    assert torch.count_nonzero(rows[VOCAB:]) == 0  # the padding rows stay zero
    head = padded.lm_head.weight if padded.lm_head is not None else padded.output_embedding()
    assert head.data_ptr() == rows.data_ptr() and head.shape == (VOCAB, 64)  # a view: no second copy
    # the checkpoint's parameters keep their shapes: the padding is no parameter of its own
    assert {n: p.shape for n, p in padded.named_parameters()} == {n: p.shape for n, p in plain.named_parameters()}
    assert plain.logits_weight is None
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    got, want = padded.compute_logits(hidden), plain.compute_logits(hidden)
    assert got.shape == (5, VOCAB) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    raw = padded.logits_gemm(hidden)  # the GEMM alone (the decode graph's input to `logits_argmax`)
    assert raw.shape == (5, 300) and torch.equal(raw[:, :VOCAB], got) and torch.count_nonzero(raw[:, VOCAB:]) == 0


def test_a_multiple_of_the_padding_is_not_padded_and_a_bad_multiple_is_refused():
    _, m = _padded_model("llama", multiple=64)  # 256 rows already a multiple of 64
    assert m.logits_weight is None
    with pytest.raises(ValueError, match="at least 1"):
        with vocab_padding(0):
            pass


def test_the_roofline_counts_the_padded_rows_the_gemm_reads():
    for kind in ("gpt2", "qwen2"):
        hf, padded = _padded_model(kind)
        plain = our_model(hf)
        extra = decode_bytes(padded, torch.float32).weight_bytes - decode_bytes(plain, torch.float32).weight_bytes
        assert extra == (300 - VOCAB) * 64 * 4, kind


def _run(sch) -> dict:
    got: dict = {}
    while sch.has_unfinished():
        for rid, tok in sch.step().items():
            got.setdefault(rid, {"tokens": [], "logprobs": []})["tokens"].append(tok)
        for rid, e in sch.step_logprobs.items():
            got[rid]["logprobs"].append((e.token_id, e.logprob, e.top))
    sch.pop_finished_ids()
    return got


@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_greedy_tokens_and_logprobs_are_unchanged_by_padding(kind):
    hf = tiny_hf_model(kind, seed=2)
    prompts = [[5, 9, 33, 7, 100], [12, 44, 3], [200, 201, 202, 203, 204, 205, 206]]

    def run(multiple):
        with vocab_padding(multiple):
            sch = tiny_scheduler(hf, block_size=4, num_gpu_blocks=64)
        ids = [sch.add_request(p, SamplingParams(max_new_tokens=8, stop_on_eos=False, logprobs=3)) for p in prompts]
        got = _run(sch)
        return [got[i] for i in ids]

    plain, padded = run(1), run(PAD)
    for a, b in zip(plain, padded):
        assert a["tokens"] == b["tokens"]
        for (ta, la, topa), (tb, lb, topb) in zip(a["logprobs"], b["logprobs"]):
            assert ta == tb and [t for t, _ in topa] == [t for t, _ in topb]
            assert lb == pytest.approx(la, abs=1e-5)
            assert [v for _, v in topb] == pytest.approx([v for _, v in topa], abs=1e-5)


@pytest.mark.parametrize("kind,sampled", [("gpt2", False), ("qwen2", False), ("llama", True)])
def test_the_decode_graphs_forward_gives_the_tokens_and_logprobs_of_the_plain_one(kind, sampled):
    """The forward a decode graph captures (fused kernels, the logits GEMM's output turned into
    float32 logits and the greedy argmax in one pass), run eagerly on the CPU in the Triton
    interpreter on a padded model: the tokens and logprobs of the plain path. All greedy, the
    graph's argmax is every token; with a sampled request, the sampler reads the graph's logits."""
    hf = tiny_hf_model(kind, seed=4)
    prompts = [[5, 9, 33, 7, 100], [12, 44, 3]]
    second = SamplingParams(max_new_tokens=6, stop_on_eos=False, **(dict(temperature=0.8, seed=11) if sampled else {}))
    params = [SamplingParams(max_new_tokens=6, stop_on_eos=False, logprobs=2), second]

    def run(graph_path):
        with vocab_padding(PAD if graph_path else 1):
            sch = tiny_scheduler(hf, block_size=4, num_gpu_blocks=64)
        sch.runner.use_graphs = graph_path  # no graph is captured on the CPU: the same forward, run eagerly
        ids = [sch.add_request(p, sp) for p, sp in zip(prompts, params)]
        got = _run(sch)
        return [got[i] for i in ids]

    plain, graph = run(False), run(True)
    assert [r["tokens"] for r in graph] == [r["tokens"] for r in plain]
    for (ta, la, topa), (tb, lb, topb) in zip(plain[0]["logprobs"], graph[0]["logprobs"]):
        assert ta == tb and [t for t, _ in topa] == [t for t, _ in topb] and lb == pytest.approx(la, abs=1e-4)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_requests_that_read_the_logits_joining_an_all_greedy_batch_read_this_steps(kind):
    """While every request is plain greedy the decode graph's forward skips writing its float32 logits
    (`ModelRunner._logits_wanted`). A request with logprobs, then a sampled one, that join such a batch later must
    read the logits of their own steps, and the greedy one goes on unchanged: every token and logprob is the plain
    path's (which always writes them). A flag left off would hand them an earlier step's logits."""
    hf = tiny_hf_model(kind, seed=6)
    prompts = [[5, 9, 33], [12, 44, 3, 8], [7, 7, 90]]
    params = [SamplingParams(max_new_tokens=14, stop_on_eos=False),
              SamplingParams(max_new_tokens=4, stop_on_eos=False, logprobs=2),
              SamplingParams(max_new_tokens=4, stop_on_eos=False, temperature=0.8, seed=3)]

    def run(graph_path):
        with vocab_padding(PAD if graph_path else 1):
            sch = tiny_scheduler(hf, block_size=4, num_gpu_blocks=64)
        sch.runner.use_graphs = graph_path  # (the graphs' forward, run eagerly on the CPU)
        ids, got, stored = [sch.add_request(prompts[0], params[0])], {}, []
        for step in range(60):
            if step in (3, 9):  # joins while only plain greedy requests run
                i = len(ids)
                ids.append(sch.add_request(prompts[i], params[i]))
            if not sch.has_unfinished():
                break
            for rid, tok in sch.step().items():
                got.setdefault(rid, {"tokens": [], "logprobs": []})["tokens"].append(tok)
            for rid, e in sch.step_logprobs.items():
                got[rid]["logprobs"].append((e.token_id, e.logprob, e.top))
            stored.append(sch.runner._storing_logits)
        return [got[i] for i in ids], stored

    (plain, _), (graph, stored) = run(False), run(True)
    assert False in stored and True in stored and stored[-1] is False  # the write was skipped, then made, then not
    assert [r["tokens"] for r in graph] == [r["tokens"] for r in plain]
    assert len(graph[1]["logprobs"]) == 4
    for (ta, la, topa), (tb, lb, topb) in zip(plain[1]["logprobs"], graph[1]["logprobs"]):
        assert ta == tb and [t for t, _ in topa] == [t for t, _ in topb] and lb == pytest.approx(la, abs=1e-4)


def test_the_logits_are_written_only_while_the_flag_is_set():
    """`logits_argmax`'s ``store_flag``: the argmax either way; the float32 logits only when the flag is non-zero."""
    from rosecli.kernels.argmax import _split_argmax

    raw = torch.randn(3, 700, generator=torch.Generator().manual_seed(1)).half()
    want_logits, want_ids = logits_argmax_ref(raw, 650)
    for flag in (0, 1):
        out = torch.full((3, 650), NAN)
        ids = _split_argmax(raw, 650, None, out, store_flag=torch.tensor([flag], dtype=torch.int32))
        assert ids.tolist() == want_ids.tolist()
        if flag:
            assert torch.equal(out, want_logits)
        else:
            assert out.isnan().all()


def test_the_sampler_never_returns_a_padded_id():
    """At temperature 100 every id is about equally likely: were the 44 padding columns (logit 0)
    sampled, some of 4 x 60 draws would land there (probability 1 - (256/300)^240)."""
    hf = tiny_hf_model("llama", seed=3)
    with vocab_padding(PAD):
        sch = tiny_scheduler(hf, block_size=4, num_gpu_blocks=128, seed=5)
    for i in range(4):
        sch.add_request([3 + i, 4, 5], SamplingParams(max_new_tokens=60, temperature=100.0, stop_on_eos=False,
                                                      seed=i))
    got = _run(sch)
    tokens = [t for r in got.values() for t in r["tokens"]]
    assert len(tokens) == 240 and max(tokens) < VOCAB
    assert len(set(tokens)) > 100  # the temperature did flatten the distribution


# --- through the loader (ROSE_VOCAB_PAD forces the padding on the CPU) --------------------------------


def test_rose_vocab_pad_pads_a_loaded_model_and_a_bad_value_is_one_clear_error(monkeypatch, cache_dir):
    from rosecli.engine.loader import load_model

    config = EngineConfig(model="tiny-gpt2", load_format="dummy", device="cpu", cpu_weights="float",
                          cache_dir=cache_dir, show_progress=False)
    plain = load_model(config, torch.device("cpu"), torch.float32).model
    monkeypatch.setenv("ROSE_VOCAB_PAD", "1000")
    padded = load_model(config, torch.device("cpu"), torch.float32).model
    assert plain.logits_weight is None and padded.logits_weight.shape == (50000, 64)  # 49,152 rows padded
    assert torch.equal(padded.wte.weight, plain.wte.weight)  # the same dummy weights
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(padded.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-6, atol=1e-6)
    # other CPU weight representations replace the output layer: never padded
    auto = load_model(EngineConfig(model="tiny-gpt2", load_format="dummy", device="cpu", cpu_weights="float16",
                                   cache_dir=cache_dir, show_progress=False), torch.device("cpu"), torch.float32)
    assert getattr(auto.model, "logits_weight", None) is None
    monkeypatch.setenv("ROSE_VOCAB_PAD", "many")
    with pytest.raises(ConfigError, match="ROSE_VOCAB_PAD must be a whole number of rows of at least 1"):
        load_model(config, torch.device("cpu"), torch.float32)


def test_structured_output_on_a_padded_model(monkeypatch, tiny_engine_factory):
    pytest.importorskip("xgrammar")
    from rosecli.engine.structured import GrammarSpec

    monkeypatch.setenv("ROSE_VOCAB_PAD", "1000")
    engine = tiny_engine_factory(cpu_weights="float", overlap_schedule=True)
    assert engine.loaded.model.logits_weight.shape[0] == 50000
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    outs = engine.generate(["Hi", "Hello"], [SamplingParams(max_new_tokens=40, temperature=1.0, seed=s,
                                                            structured=spec) for s in (1, 2)])
    for out in outs:
        assert 0 <= json.loads(out.text)["n"] <= 99


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masked_argmax_of_the_raw_gemm_output_is_that_of_its_float32_logits(dtype):
    """What a greedy grammar row's masked argmax reads in a decode graph (the logits GEMM's output: half precision,
    padded columns, coarse values with ties) gives the ids the float32 logits the step would write give; a padding
    column, however large, is never the answer."""
    from rosecli.kernels.argmax import masked_argmax

    g = torch.Generator().manual_seed(11)
    V = 4099
    raw = (torch.randn(5, V + 61, generator=g) * 3).to(dtype)
    raw[:, V:] = 1e4
    raw[1, [30, 4000]] = raw[1].max() + 1  # a tie far apart
    bits = torch.randint(-2**31, 2**31 - 1, (5, (V + 31) // 32), dtype=torch.int32, generator=g)
    bits[1, 0] |= 1 << 30
    bits[1, 4000 // 32] |= 1 << (4000 % 32)
    logits, _ = logits_argmax_ref(raw, V)
    got = masked_argmax(raw, bits, V)
    assert got.tolist() == masked_argmax(logits, bits).tolist() and got[1] == 30 and max(got.tolist()) < V


def test_greedy_grammar_rows_read_the_raw_gemm_output_and_no_float32_logits_are_written(monkeypatch,
                                                                                        tiny_engine_factory):
    """Where the decode step keeps the logits GEMM's raw output (the decode graphs: `_raw_for_grammar`), greedy rows
    under a grammar take their masked argmax from it, and the step does not write its float32 logits for them
    (`_logits_wanted`). Every token is the plain path's (float32 logits, always written), for the grammar rows and
    a free greedy row beside them, and every step of the run skipped the write. (The graphs' forward, run eagerly
    on the CPU; an argmax left on the float32 buffer would read logits no step wrote.)"""
    pytest.importorskip("xgrammar")
    from rosecli.engine.structured import GrammarSpec

    monkeypatch.setenv("ROSE_VOCAB_PAD", "1000")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    prompts = ["free", "Hi", "Hello there", "Go"]
    params = [SamplingParams(max_new_tokens=12, stop_on_eos=False)] + [
        SamplingParams(max_new_tokens=40, temperature=0.0, structured=spec)] * 3

    def run(raw_path):
        engine = tiny_engine_factory(cpu_weights="float", max_batch_size=4)
        runner = engine.runner
        stored = []
        if raw_path:
            runner.use_graphs = runner._raw_for_grammar = True
            wanted = runner._logits_wanted

            def record():
                wanted()
                stored.append(runner._storing_logits)

            monkeypatch.setattr(runner, "_logits_wanted", record)
        return engine.generate(prompts, params), stored

    (plain, _), (raw, stored) = run(False), run(True)
    assert [o.token_ids for o in raw] == [o.token_ids for o in plain]
    for o in raw[1:]:
        assert set(json.loads(o.text)) == {"n", "ok"}
    assert len(stored) > 10 and not any(stored)


# --- on the GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("cols", [49152, 50257, 128256, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_argmax_on_cuda_equals_torch(rows, cols, dtype):
    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    x = (torch.randn(rows, cols + 47, device="cuda", generator=g) * 4).to(dtype)
    x[0, cols - 1] = x[0, 3] = 1e4  # a tie far apart
    x[-1, cols:] = 1e4  # padding columns: never the answer
    if rows > 2:  # compiled, NaN and -inf behave as in the interpreter
        x[1, [cols - 2, 40000]] = NAN
        x[2] = -INF
    assert argmax(x, cols).tolist() == x[:, :cols].argmax(-1).tolist()


@pytest.mark.gpu
def test_gpt2_on_cuda_pads_its_output_rows_and_decodes_through_the_graphs(monkeypatch, tiny_engine_factory):
    """GPT-2's 50,257 rows become 50,304 on CUDA: the logits equal those of the same model built
    unpadded (ROSE_VOCAB_PAD=1) to float16 rounding, and a batch of 64 greedy and sampled
    requests through the CUDA graphs never gives a padded id."""
    padded = tiny_engine_factory(model="gpt2", device="cuda")
    rows = padded.loaded.model.logits_weight
    assert rows.shape == (50304, 768) and torch.count_nonzero(rows[50257:]) == 0
    monkeypatch.setenv("ROSE_VOCAB_PAD", "1")
    plain = tiny_engine_factory(model="gpt2", device="cuda")
    assert plain.loaded.model.logits_weight is None
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(64, 768, device="cuda", dtype=rows.dtype, generator=g)
    with torch.inference_mode():
        got, want = padded.loaded.model.compute_logits(hidden), plain.loaded.model.compute_logits(hidden)
    assert got.shape == (64, 50257) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    params = [SamplingParams(max_new_tokens=16, stop_on_eos=False, temperature=0.0 if i % 2 else 100.0, seed=i)
              for i in range(64)]
    outs = padded.generate([f"Hello {i}" for i in range(64)], params)
    assert all(len(o.token_ids) == 16 and max(o.token_ids) < 50257 for o in outs)


# --- the masked argmax of greedy rows under a grammar ---------------------------------------------


@pytest.mark.parametrize("rows,cols", [(1, 50257), (3, 4099), (6, 300)])
def test_masked_argmax_equals_masking_then_argmax(rows, cols):
    """One masked argmax (the bits read in its first stage, the logits not rewritten) against
    the bitmask applied in place and torch.argmax: random masks, a row with one token allowed, a
    row with none (0, as torch gives for a row of -inf), NaN allowed and not, a bitmask buffer
    wider and taller than the logits, and ids written into a given buffer."""
    from rosecli.kernels.argmax import masked_argmax, masked_argmax_ref

    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols + 5, generator=g)
    W = (cols + 31) // 32
    bits = torch.randint(-2**31, 2**31 - 1, (rows + 2, W + 1), dtype=torch.int32, generator=g)
    bits[0] = 0
    bits[0, (cols - 1) // 32] = 1 << ((cols - 1) % 32)  # only the last token
    if rows > 2:
        bits[1] = 0  # nothing allowed
        x[2, 7] = NAN
        bits[2, 0] |= 1 << 7  # an allowed NaN wins, as in torch
        x[2, 9] = NAN
        bits[2, 0] &= ~(1 << 9)
    before = x.clone()
    out = torch.full((rows,), -5, dtype=torch.long)
    got = masked_argmax(x, bits, cols, out=out)
    assert got is out and out.tolist() == masked_argmax_ref(x, bits, cols).tolist()
    assert out[0] == cols - 1
    assert torch.equal(x.nan_to_num(), before.nan_to_num())  # the logits are left as they were
    if rows > 2:
        assert out[1] == 0 and out[2] == 7
