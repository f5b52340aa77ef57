"""Property-based fuzzing of the HTTP API (hypothesis): request bodies for /v1/completions and
/v1/chat/completions with wrong types, huge integers, non-finite floats, lone surrogates,
missing and extra fields, sent as JSON text to a real uvicorn server on a tiny dummy model.
Whatever arrives, the answer is a 2xx or a 4xx with an OpenAI error body, never a 5xx or a hang,
and the engine keeps serving. Bounded (derandomized, a fixed number of examples) to stay fast."""

from __future__ import annotations

import pytest

# the server's optional extras (rosecli[serve]) and the test clients: absent on a bare GPU image
for _extra in ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client", "hypothesis"):
    pytest.importorskip(_extra)

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server import MODEL, metrics, server_fixtures

VOCAB = 49152

plain_text = st.text(max_size=24)
# one string in four may hold lone surrogates (JSON can escape them; no UTF-8 text holds them)
text = st.one_of(plain_text, plain_text, plain_text,
                 st.text(st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF,
                                                                  exclude_categories=())), max_size=24))
scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(2 ** 70), 2 ** 70),
                   st.integers(-5, 600), st.floats(), st.floats(0, 2), text)
anything = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(text, inner, max_size=4), max_leaves=8)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)

# plausible values, so that many bodies get past the checks and reach the engine
PLAUSIBLE = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 100),
    "seed": st.integers(0, 2 ** 63 - 1),
    "stop": st.one_of(text, st.lists(text, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 3),
    "echo": st.booleans(),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 21)),
    "top_logprobs": st.integers(-1, 21),
    "model": st.just(MODEL),
    "user": text,
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_p": st.floats(0, 1),
    "min_tokens": st.integers(0, 6),
    "logit_bias": st.dictionaries(st.integers(-1, VOCAB).map(str), st.floats(-100, 100), max_size=3),
}
COMMON = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "stream",
          "stream_options", "ignore_eos", "presence_penalty", "frequency_penalty", "logit_bias", "user",
          "repetition_penalty", "min_p", "min_tokens", "response_format", "tools", "tool_choice", "modalities",
          "unknown_field"]
COMPLETION_FIELDS = COMMON + ["prompt", "echo", "logprobs", "best_of", "suffix"]
CHAT_FIELDS = COMMON + ["messages", "max_completion_tokens", "logprobs", "top_logprobs"]

message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), text),
     "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                         max_size=2), anything)},
    optional={"name": st.one_of(text, anything)})


@st.composite
def bodies(draw):
    chat = draw(st.booleans())
    if chat:
        body = {"model": MODEL, "messages": draw(st.lists(message, min_size=1, max_size=3)),
                "max_tokens": draw(PLAUSIBLE["max_tokens"])}
        fields = CHAT_FIELDS
    else:
        body = {"model": MODEL, "prompt": draw(st.one_of(text.filter(bool), token_ids, st.lists(text, max_size=2),
                                                         st.lists(token_ids, max_size=2))),
                "max_tokens": draw(PLAUSIBLE["max_tokens"])}
        fields = COMPLETION_FIELDS
    for name in draw(st.lists(st.sampled_from(fields), max_size=4, unique=True)):
        roll = draw(st.integers(0, 5))
        if roll == 0:
            body.pop(name, None)  # missing fields, required ones too
        elif name in PLAUSIBLE and roll > 2:
            body[name] = draw(PLAUSIBLE[name])
        else:
            body[name] = draw(anything)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


# chat's default max_tokens is the rest of the context; a hang fails the test (20 s)
live, _, http = server_fixtures(timeout=20, max_model_len=96)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=bodies())
def test_fuzzed_requests_get_a_clean_answer(live, http, case):
    path, body = case
    # json.dumps writes NaN / Infinity literals and \ud800-style escapes as they are
    raw = json.dumps(body, allow_nan=True).encode()
    with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        payload = r.read().decode()
    assert r.status_code < 500, (r.status_code, payload, raw[:500])
    if r.status_code >= 400:
        err = json.loads(payload)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error" and (err["code"] is None or isinstance(err["code"], str))
        assert "Traceback" not in err["message"] and "Error:" not in err["message"], err
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in payload.split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), payload[-500:]
    else:
        assert json.loads(payload)["choices"][0]["finish_reason"] in ("stop", "length")


def test_after_the_fuzz_the_engine_still_serves(live, http):
    # runs after the fuzz test in file order; on its own it still checks a fresh server
    assert http.get("/health").json() == {"status": "ok"}
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0,
                                           "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert live.manager.wait_idle(5)
    assert metrics(http)[("rose_kv_blocks_used", frozenset())] == 0
