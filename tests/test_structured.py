"""Structured output and tool calls (issue 22). The tiny dummy model's weights are random, so its
free output is noise: an output that parses and validates can only come from the grammar."""

from __future__ import annotations

import json
import re

import pytest

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from rosecli.engine.config import SamplingParams  # noqa: E402
from rosecli.engine.errors import ConfigError, RequestError  # noqa: E402
from rosecli.engine.structured import GrammarSpec  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                    "required": ["city"], "additionalProperties": False},
        "active": {"type": "boolean"},
        "nickname": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
POINTS = {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99,
                                                                          "maximum": 99},
                                                                    "y": {"type": "integer", "minimum": -99,
                                                                          "maximum": 99}},
                                     "required": ["x", "y"], "additionalProperties": False},
          "minItems": 1, "maxItems": 4}
REGEX = r"[0-9]{3}-[a-z]{2,5}( #[0-9]{1,3})?"
CHOICES = ["red", "green", "blue whale", "naïve \"quoted\""]


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(overlap_schedule=True)  # the overlapped path: a token is read one step late


def sampled(seed, spec, n=200):
    return SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed, structured=spec)


def test_json_schema_outputs_parse_and_validate(engine):
    """At least 1,000 sampled tokens under schemas with objects, arrays, enums, nested and
    optional fields: every output is complete, parses and validates."""
    for schema in (PERSON, POINTS):
        spec = GrammarSpec.json_schema(schema)
        outs = engine.generate(["Describe:"] * 8, [sampled(seed, spec, 300) for seed in range(8)])
        for o in outs:
            assert o.finish_reason == "stop", o.text
            jsonschema.validate(json.loads(o.text), schema)


def test_enough_constrained_tokens(engine):
    """1,000 tokens sampled under the grammar, all in valid documents (arrays of objects)."""
    schema = {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3}
    spec = GrammarSpec.json_schema(schema)
    outs = engine.generate(["x"] * 6, [sampled(100 + i, spec, 600) for i in range(6)])
    total = 0
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)
        total += len(o.token_ids)
    assert total >= 1000, total


def test_regex_choice_and_json_object(engine):
    outs = engine.generate(["a"] * 4, [sampled(s, GrammarSpec("regex", REGEX)) for s in range(4)])
    for o in outs:
        assert re.fullmatch(REGEX, o.text), o.text
    outs = engine.generate(["b"] * 6, [sampled(s, GrammarSpec.choice(CHOICES)) for s in range(6)])
    assert all(o.text in CHOICES for o in outs), [o.text for o in outs]
    grammar = 'root ::= "yes" | "no" | ("maybe " [0-9])'
    outs = engine.generate(["c"] * 3, [sampled(s, GrammarSpec("grammar", grammar)) for s in range(3)])
    assert all(re.fullmatch(r"yes|no|maybe [0-9]", o.text) for o in outs), [o.text for o in outs]
    outs = engine.generate(["d"] * 3, [sampled(s, GrammarSpec("json_object"), 60) for s in range(3)])
    for o in outs:  # any object: done, or cut short at max_tokens as a valid prefix
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.text.startswith("{")


def test_free_requests_in_a_mixed_batch_are_unchanged(engine):
    """Requests without a grammar give the same tokens beside grammar requests as alone."""
    free = [SamplingParams(max_new_tokens=12, temperature=0.0),
            SamplingParams(max_new_tokens=12, temperature=0.8, seed=7, top_k=50)]
    alone = engine.generate(["free one", "free two"], free)
    spec = GrammarSpec.json_schema(POINTS)
    mixed = engine.generate(["free one", "g1", "free two", "g2"],
                            [free[0], sampled(1, spec), free[1], sampled(2, spec)])
    assert [mixed[0].token_ids, mixed[2].token_ids] == [alone[0].token_ids, alone[1].token_ids]
    jsonschema.validate(json.loads(mixed[1].text), POINTS)


def test_kv_blocks_and_grammar_state_are_released(engine):
    bm = engine.scheduler.block_manager
    free_before = bm.num_free_blocks
    engine.generate(["z"] * 3, [sampled(s, GrammarSpec("regex", REGEX), 30) for s in range(3)])
    free_after = bm.num_free_blocks
    assert free_after == free_before
    assert not engine.structured.active  # no matcher left behind


def test_bad_grammars_fail_alone_naming_the_field(engine):
    with pytest.raises(RequestError, match="Unsupported type"):
        engine.structured.compile(GrammarSpec.json_schema({"type": "foo"}))
    with pytest.raises(RequestError, match="'not'"):
        GrammarSpec.json_schema({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    with pytest.raises(RequestError, match="regex"):
        engine.structured.compile(GrammarSpec("regex", "((", "guided_regex"))
    with pytest.raises(ConfigError, match="ignore_eos"):
        SamplingParams(stop_on_eos=False, structured=GrammarSpec("json_object"))
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=GrammarSpec("json_object"))
    # the engine goes on: the next request is served
    out = engine.generate(["ok"], [sampled(0, GrammarSpec("regex", "[ab]{4}"))])[0]
    assert re.fullmatch("[ab]{4}", out.text)


INT, BOOL = {"type": "integer"}, {"type": "boolean"}
REFUSED = [  # what the grammar would drop or get wrong (sampled and validated when this was written): a 400
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf'", "#"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]*$", "minLength": 4}}},
     "beside 'pattern'", "#/properties/a"),
    ({"allOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                {"type": "object", "properties": {"b": INT}, "required": ["b"]}]}, "'allOf' of more than one", "#"),
    ({"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}], "properties": {"a": INT, "b": INT}},
     "'anyOf' beside 'type', 'properties'", "#"),
    ({"oneOf": [INT, {"type": "number", "minimum": 0}]}, "alternatives 0 and 1 may both match", "#"),
    ({"type": "array", "items": {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                                           {"type": "object", "properties": {"k": {"enum": ["b", "a"]}},
                                            "required": ["k"]}]}}, "'oneOf'", "#/items"),
    ({"type": "object", "patternProperties": {"^[a-e]$": BOOL}, "additionalProperties": False, "minProperties": 3},
     "'minProperties'", "#"),
    ({"type": "object", "properties": {"a": INT}, "required": ["a", "b"], "additionalProperties": False},
     "required property 'b'", "#"),
    ({"type": "string", "enum": [1, 2]}, "no value of the 'enum'", "#"),
]


@pytest.mark.parametrize("schema,words,where", REFUSED, ids=[r[1] for r in REFUSED])
def test_schemas_the_grammar_cannot_enforce_are_refused_naming_where(schema, words, where):
    with pytest.raises(RequestError, match=re.escape(words)) as e:
        GrammarSpec.json_schema(schema, "guided_json")
    assert f"(at {where})" in str(e.value) and e.value.param == "guided_json"


def test_a_schema_nested_past_the_limit_is_one_clear_error():
    deep = INT
    for _ in range(3000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(RequestError, match="nests deeper than 256 levels"):
        GrammarSpec.json_schema(deep, "guided_json")
    with pytest.raises(RequestError, match="nests too deeply"):  # (as text, e.g. --json-schema FILE)
        GrammarSpec.json_schema('{"items":' * 5000 + "{}" + "}" * 5000, "--json-schema")


REWRITTEN = [  # (schema, the draft its validator reads): every output validates against the schema as given
    ({"type": "object", "properties": {"a": BOOL}, "required": ["a", "b"], "additionalProperties": BOOL,
      "maxProperties": 2}, jsonschema.Draft202012Validator),
    ({"type": "array", "items": {"type": ["integer", "null"], "enum": [3, "x", None, 4.0, True]}, "minItems": 3,
      "maxItems": 5}, jsonschema.Draft202012Validator),
    ({"type": "array", "items": [BOOL, {"type": "null"}], "additionalItems": False, "minItems": 2},
     jsonschema.Draft7Validator),
    ({"$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": INT},
                        "required": ["kind", "lives"], "additionalProperties": False},
                "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "good": BOOL},
                        "required": ["kind", "good"], "additionalProperties": False}},
      "type": "array", "items": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                                 "discriminator": {"propertyName": "kind"}}, "minItems": 2, "maxItems": 4},
     jsonschema.Draft202012Validator),
    ({"oneOf": [{"type": "object", "properties": {"a": BOOL}, "required": ["a"], "additionalProperties": False},
                {"type": "object", "properties": {"b": BOOL}, "required": ["b"], "additionalProperties": False}]},
     jsonschema.Draft202012Validator),
]


@pytest.mark.parametrize("schema,validator", REWRITTEN, ids=["required-not-in-properties", "enum-of-other-types",
                                                              "items-as-a-list", "discriminated-oneOf",
                                                              "oneOf-exclusive-keys"])
def test_schemas_rewritten_or_kept_validate_as_given(engine, schema, validator):
    """A required property missing from ``properties``, ``enum`` values of other types and a draft-7 ``items`` list are
    rewritten (the grammar would otherwise drop or break them); exclusive ``oneOf`` alternatives are kept. Random
    weights: every output validates against the schema as the user gave it."""
    spec = GrammarSpec.json_schema(schema, "guided_json")
    outs = engine.generate(["Go:"] * 6, [sampled(seed, spec, 200) for seed in range(6)])
    for o in outs:
        assert o.finish_reason == "stop", o.text
        validator(schema).validate(json.loads(o.text))


def test_embedded_schemas_keep_their_references():
    from rosecli.engine.json_schema import embed

    ref, defs = embed({"$defs": {"A": INT}, "properties": {"x": {"$ref": "#/$defs/A"}, "me": {"$ref": "#"},
                                                           "ext": {"$ref": "other.json#/x"}}}, "tool3")
    assert ref == {"$ref": "#/$defs/tool3"}
    props = defs["tool3"]["properties"]
    assert props["x"] == {"$ref": "#/$defs/tool3/$defs/A"} and props["me"] == {"$ref": "#/$defs/tool3"}
    assert props["ext"] == {"$ref": "other.json#/x"}


def test_compiled_grammars_are_cached(engine):
    spec = GrammarSpec.json_schema(PERSON)
    assert engine.structured.compile(spec) is engine.structured.compile(GrammarSpec.json_schema(dict(PERSON)))


# --- the CLI: rose generate --json-schema FILE / --regex ---------------------------------------

def _generate(cache_dir, *args):
    from typer.testing import CliRunner

    from rosecli.commands.main import app

    return CliRunner().invoke(app, ["generate", "--model", "tiny-llama", "--load-format", "dummy", "--cache-dir",
                                    cache_dir, *args])


def test_cli_json_schema_and_regex(cache_dir, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(PERSON))
    r = _generate(cache_dir, "Who?", "--json-schema", str(path), "--do-sample", "--max-new-tokens", "300")
    assert r.exit_code == 0, r.output
    jsonschema.validate(json.loads(r.stdout.splitlines()[0]), PERSON)
    r = _generate(cache_dir, "Call:", "--regex", REGEX)
    assert r.exit_code == 0, r.output
    assert re.fullmatch(REGEX, r.stdout.splitlines()[0])


@pytest.mark.parametrize("args,message", [
    (["--json-schema", "BAD"], "--json-schema: the JSON schema could not be compiled: Unsupported type"),
    (["--json-schema", "MISSING"], "--json-schema: cannot read"),
    (["--json-schema", "NOTJSON"], "--json-schema: the JSON schema is not valid JSON"),
    (["--regex", "(("], "--regex: the regex could not be compiled"),
    (["--regex", "a", "--json-schema", "BAD"], "give one of them"),
])
def test_cli_bad_grammar_is_one_line(cache_dir, tmp_path, args, message):
    (tmp_path / "bad.json").write_text('{"type": "foo"}')
    (tmp_path / "notjson.json").write_text('{"type": ')
    files = {"BAD": tmp_path / "bad.json", "MISSING": tmp_path / "none.json", "NOTJSON": tmp_path / "notjson.json"}
    r = _generate(cache_dir, "x", *[str(files.get(a, a)) for a in args])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


@pytest.mark.gpu
def test_gpu_graphs_and_overlap_with_grammar_rows(tiny_engine_factory, monkeypatch):
    """On CUDA: decode graphs, the sampler's captured graph and overlap scheduling, with grammar
    rows masked eagerly on the static logits buffer; free rows beside them unchanged."""
    engine = tiny_engine_factory(device="cuda", max_batch_size=16)
    assert engine.runner._raw_for_grammar  # greedy grammar rows read the logits GEMM's output: no float32 write
    spec = GrammarSpec.json_schema(PERSON)
    free = SamplingParams(max_new_tokens=16, temperature=0.0)
    alone = engine.generate(["free"], [free])[0]
    outs = engine.generate(["free"] + ["g"] * 12, [free] + [sampled(s, spec, 300) for s in range(12)])
    assert outs[0].token_ids == alone.token_ids
    for o in outs[1:]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    # greedy grammar rows (the masked argmax, no sampler) beside the free one: the same again
    g_alone = engine.generate([f"{i} g" for i in range(6)], [greedy(spec)] * 6)
    outs = engine.generate(["free"] + [f"{i} g" for i in range(6)], [free] + [greedy(spec)] * 6)
    assert outs[0].token_ids == alone.token_ids
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in g_alone]
    for o in outs[1:]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    # the masked argmax (its own captured graph after a first eager step) against the mask written
    # into the logits and the sampler's greedy pick (a zero logit_bias sends a request there)
    biased = SamplingParams(max_new_tokens=300, temperature=0.0, structured=spec, logit_bias={0: 0.0})
    via_sampler = engine.generate([f"{i} g" for i in range(6)], [biased] * 6)
    assert [o.token_ids for o in via_sampler] == [o.token_ids for o in g_alone]
    # the bitmask copied inside the masked graph, and on a copy stream beside the forward
    import rosecli.engine.runner as runner_mod

    for aside in (False, True):
        monkeypatch.setattr(runner_mod, "MASK_COPY_ASIDE", aside)
        again = engine.generate([f"{i} g" for i in range(6)], [greedy(spec)] * 6)
        assert [o.token_ids for o in again] == [o.token_ids for o in g_alone]
        assert any(k[2] is aside for k in engine.runner._masked_replays)


def test_device_mask_op_matches_the_library():
    """The batch mask op used on the GPU (plain torch), checked on CPU against xgrammar's own."""
    import torch

    from rosecli.engine.structured import apply_bitmask

    g = torch.Generator().manual_seed(0)
    for V in (100, 49152, 152064):
        mask = torch.randint(-2**31, 2**31 - 1, (5, (V + 31) // 32), dtype=torch.int32, generator=g)
        mask[0] = -1  # a row without a grammar: left as it was
        logits = torch.randn(5, V, generator=g)
        want = logits.clone()
        xgrammar.apply_token_bitmask_inplace(want, mask)
        apply_bitmask(logits, mask)
        assert torch.equal(logits, want)
        assert torch.isfinite(logits[0]).all()


@pytest.mark.parametrize("V", [100, 4099, 50257])
def test_bitmask_kernel_matches_the_torch_op(V):
    """The one-kernel mask (used on CUDA), run by Triton's interpreter here, against the torch op;
    rows of a wider bitmask buffer (the engine's, sized for the largest batch) and strided logits."""
    import torch

    from rosecli.engine.structured import apply_bitmask
    from rosecli.kernels.bitmask import apply_bitmask as kernel

    g = torch.Generator().manual_seed(V)
    mask = torch.randint(-2**31, 2**31 - 1, (6, (V + 31) // 32 + 1), dtype=torch.int32, generator=g)
    mask[1] = -1
    mask[2] = 0
    base = torch.randn(4, V + 3, generator=g)
    want, got = base.clone(), base.clone()
    apply_bitmask(want[:, :V], mask[:4, :(V + 31) // 32])
    kernel(got[:, :V], mask)
    assert torch.equal(got, want)
    assert torch.isfinite(got[1, :V]).all() and torch.isneginf(got[2, :V]).all()


# --- greedy grammar rows: the masked logits' argmax, no sampler kernels -------------------------


def greedy(spec, n=300):
    return SamplingParams(max_new_tokens=n, temperature=0.0, structured=spec)


def test_greedy_grammar_rows_match_the_sampler_and_the_unoverlapped_path(engine, tiny_engine_factory):
    """Greedy requests under a grammar, overlap scheduling on: valid outputs, the same tokens as
    through the sampler (a zero logit_bias sends a request there without changing its logits) and
    as without overlap."""
    assert engine.scheduler.overlap
    spec = GrammarSpec.json_schema(PERSON)
    prompts = [f"{i} who?" for i in range(6)]
    fast = engine.generate(prompts, [greedy(spec)] * 6)
    for o in fast:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    biased = SamplingParams(max_new_tokens=300, temperature=0.0, structured=spec, logit_bias={0: 0.0})
    assert [o.token_ids for o in engine.generate(prompts, [biased] * 6)] == [o.token_ids for o in fast]
    plain = tiny_engine_factory(overlap_schedule=False)
    assert not plain.scheduler.overlap
    assert [o.token_ids for o in plain.generate(prompts, [greedy(spec)] * 6)] == [o.token_ids for o in fast]


def test_free_rows_beside_greedy_grammar_rows_are_unchanged(engine):
    """Free requests (greedy, and one ignoring EOS) beside greedy grammar requests: every request's
    tokens are the same as when it runs alone."""
    free = [SamplingParams(max_new_tokens=12, temperature=0.0),
            SamplingParams(max_new_tokens=20, temperature=0.0, stop_on_eos=False)]
    alone = engine.generate(["free one", "free two"], free)
    spec = GrammarSpec.json_schema(POINTS)
    g_alone = engine.generate(["g1", "g2"], [greedy(spec), greedy(spec)])
    mixed = engine.generate(["free one", "g1", "free two", "g2"], [free[0], greedy(spec), free[1], greedy(spec)])
    assert [mixed[0].token_ids, mixed[2].token_ids] == [alone[0].token_ids, alone[1].token_ids]
    assert [mixed[1].token_ids, mixed[3].token_ids] == [o.token_ids for o in g_alone]
    for o in (mixed[1], mixed[3]):
        jsonschema.validate(json.loads(o.text), POINTS)


@pytest.mark.parametrize("name", ["w1_schema.json", "w1_schema_strings.json"])
def test_benchmark_schemas_run_to_max_tokens(engine, name):
    """The benchmark's schemas (rosecli/bench/data) hold every output to max_new_tokens, greedy or
    sampled, so a run under them compares the same work as an unconstrained one."""
    import importlib.resources

    text = importlib.resources.files("rosecli.bench").joinpath("data", name).read_text()
    spec = GrammarSpec.json_schema(text)
    outs = engine.generate([f"{i} Hello" for i in range(4)], [greedy(spec, 128), greedy(spec, 128),
                                                             sampled(1, spec, 128), sampled(2, spec, 128)])
    for o in outs:
        assert (len(o.token_ids), o.finish_reason) == (128, "length"), o.text
        assert o.text.startswith('{"records": [{"id": '), o.text


def test_threaded_and_serial_mask_fills_agree(engine, monkeypatch):
    """The batched fill runs on the engine's thread or on the library's threads by its cost: both
    give the same masks, so the same greedy tokens."""
    import rosecli.engine.structured as st

    spec = GrammarSpec.json_schema(PERSON)
    prompts = [f"{i} t" for i in range(5)]
    monkeypatch.setattr(st, "THREADED_ABOVE_S", float("inf"))  # always on one thread
    serial = engine.generate(prompts, [greedy(spec)] * 5)
    monkeypatch.setattr(st, "THREADED_ABOVE_S", 0.0)  # always on the library's threads
    monkeypatch.setattr(st, "SERIAL_BELOW_S", 0.0)
    threaded = engine.generate(prompts, [greedy(spec)] * 5)
    assert [o.token_ids for o in threaded] == [o.token_ids for o in serial]
    for o in threaded:
        jsonschema.validate(json.loads(o.text), PERSON)


# --- the host half: a step's tokens accepted in one batched call ---------------------------------


class _Seq:
    def __init__(self, request_id, prompt, out):
        self.request_id, self.num_prompt_tokens, self.token_ids = request_id, len(prompt), list(prompt) + list(out)


def test_batched_accept_refusals_stops_and_resumed_rows(engine):
    """`fill` after one decode step: rows with one new token go through the library's batched
    accept, a row with several (a resumed request) token by token. Each row's mask is what a
    matcher fed the same tokens one by one allows; a token the grammar refuses leaves only the
    stop tokens (the request ends); a row whose stop token was accepted and a row without a
    grammar stay all ones."""
    so = engine.structured
    spec = GrammarSpec.choice(["red", "green", "blue whale"])
    tok = engine.tokenizer
    eos = so.eos_token_ids
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    rows = {  # request id -> (tokens sampled before this fill, tokens sampled since)
        901: ([], ids("gr")[:1]),  # one new token: batched
        902: ([], [ids("x")[0]]),  # refused
        903: (ids("red"), eos[:1]),  # the stop token after a whole choice: terminated
        904: ([], ids("blue whale")[:3]),  # several new tokens: one by one
        905: ([], []),  # nothing new yet
    }
    for rid in rows:
        so.add(rid, spec)
    try:
        seqs = [_Seq(rid, [1, 2], before) for rid, (before, _) in rows.items()]
        seqs.insert(2, _Seq(990, [1], [5]))  # a free request between them
        assert so.fill(seqs, None, -1) is not None  # the tokens before: accepted
        for s in seqs:
            if s.request_id in rows:
                s.token_ids += rows[s.request_id][1]
        written = so.fill(seqs, None, -1)
        assert written == [0, 1, 3, 4, 5]
        host = so.filled_host().numpy()
        W = host.shape[1]
        for i, s in enumerate(seqs):
            rid = s.request_id
            if rid == 902:
                assert host[i].tolist() == so._only_eos.tolist()
                continue
            if rid in (990, 903):
                assert (host[i] == -1).all(), rid
                continue
            ref = xgrammar.GrammarMatcher(so.compile(spec))
            for t in rows[rid][0] + rows[rid][1]:
                assert ref.accept_token(t)
            want = xgrammar.allocate_token_bitmask(1, so.vocab_size)
            ref.fill_next_token_bitmask(want)
            assert host[i].tolist() == want[0, :W].tolist(), rid
    finally:
        for rid in rows:
            so.release(rid)
