"""Every field of OpenAI's completions and chat-completions request bodies (and vLLM's extensions)
is honoured, accepted because it changes nothing, or refused with a 400 that names it (issue 18):
through a real uvicorn server (tests/test_server.py's LiveServer), raw httpx and the official
openai client. What reached the engine is read off the manager's ``add_request``."""

from __future__ import annotations

import pytest

for _extra in ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client"):
    pytest.importorskip(_extra)

import json

import httpx
import openai

from rosecli.engine.config import SamplingParams
from test_server import MODEL, LiveServer

MSG = [{"role": "user", "content": "hi"}]
ENDPOINTS = {"completions": ("/v1/completions", {"model": MODEL, "prompt": "The capital of France is"}),
             "chat": ("/v1/chat/completions", {"model": MODEL, "messages": MSG})}


@pytest.fixture(scope="module")
def live(cache_dir):
    srv = LiveServer(cache_dir)
    seen: list[SamplingParams] = []
    add_request = srv.manager.add_request

    def recording(prompt, params=None, **kw):
        seen.append(params)
        return add_request(prompt, params, **kw)

    srv.manager.add_request = recording  # the app calls the manager it was given
    srv.seen = seen
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def post(http, endpoint: str, stream: bool, **fields) -> httpx.Response:
    path, base = ENDPOINTS[endpoint]
    body = {**base, "max_tokens": 4, **fields}
    if stream:
        body["stream"] = True
    return http.post(path, json=body)


def text_of(r: httpx.Response, endpoint: str, stream: bool) -> str:
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if endpoint == "chat" else choice["text"]
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]", events
    out = ""
    for e in events[:-1]:
        choice = json.loads(e)["choices"][0]
        out += (choice["delta"].get("content") or "") if endpoint == "chat" else choice["text"]
    return out


def sent(live) -> SamplingParams:
    return live.seen[-1]


CASES = [(e, s) for e in ENDPOINTS for s in (False, True)]
IDS = [f"{e}-{'stream' if s else 'json'}" for e, s in CASES]

# --- honoured ----------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint,stream", CASES, ids=IDS)
def test_every_honoured_field_reaches_the_engine(live, http, endpoint, stream):
    r = post(http, endpoint, stream, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.5,
             frequency_penalty=-0.5, repetition_penalty=1.2, min_tokens=2, logit_bias={"5": 10, "17": -100},
             seed=42, stop=["zz"], stop_token_ids=[3], ignore_eos=True, max_tokens=6)
    text_of(r, endpoint, stream)
    p = sent(live)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty,
            p.repetition_penalty, p.min_tokens, p.logit_bias, p.seed, p.stop, p.stop_token_ids, p.stop_on_eos,
            p.max_new_tokens) == (0.7, 0.9, 5, 0.1, 0.5, -0.5, 1.2, 2, {5: 10.0, 17: -100.0}, 42, ["zz"], [3],
                                  False, 6)


def test_unset_fields_reach_the_engine_as_off(live, http):
    text_of(post(http, "completions", False), "completions", False)
    p = sent(live)
    assert (p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens, p.logit_bias) == \
        (0.0, 0.0, 0.0, 1.0, 0, {})


def test_max_completion_tokens_is_max_tokens(live, http):
    text_of(post(http, "chat", False, max_completion_tokens=3), "chat", False)
    assert sent(live).max_new_tokens == 3


NO_EFFECT = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
             "safety_identifier": "s", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
             "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "priority": 0,
             "best_of": 1, "n": 1, "skip_special_tokens": True, "modalities": ["text"]}


@pytest.mark.parametrize("endpoint,stream", CASES, ids=IDS)
def test_fields_that_change_nothing_are_accepted(live, http, endpoint, stream):
    plain = text_of(post(http, endpoint, stream, temperature=0, ignore_eos=True), endpoint, stream)
    fields = dict(NO_EFFECT)
    if stream:
        fields["stream_options"] = {"include_usage": False, "include_obfuscation": True}
    if endpoint == "completions":
        fields.update(echo=False, suffix="")
    else:
        fields.update(logprobs=False, top_logprobs=0)
    assert text_of(post(http, endpoint, stream, temperature=0, ignore_eos=True, **fields), endpoint, stream) == plain


def test_min_tokens_keeps_a_stop_string_from_ending_the_request(http):
    """The tiny model repeats one token; a stop string inside it ends the request at the first
    token, or, with min_tokens, at the first token after them."""
    full = text_of(post(http, "completions", False, temperature=0, ignore_eos=True, max_tokens=6), "completions",
                   False)
    piece = full[:len(full) // 6]
    stop = piece[1:3]
    for stream in (False, True):
        r = post(http, "completions", stream, temperature=0, ignore_eos=True, max_tokens=6, stop=[stop])
        assert text_of(r, "completions", stream) == piece[:1]
        r = post(http, "completions", stream, temperature=0, ignore_eos=True, max_tokens=6, stop=[stop], min_tokens=3)
        assert text_of(r, "completions", stream) == full[:3 * len(piece) + 1]
        r = post(http, "completions", stream, temperature=0, ignore_eos=True, max_tokens=6, stop=[stop], min_tokens=6)
        assert text_of(r, "completions", stream) == full


# --- refused -----------------------------------------------------------------------------------

COMMON_REFUSED = [
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}), ("verbosity", "low"), ("moderation", {}),
    ("use_beam_search", True), ("length_penalty", 0.5), ("spaces_between_special_tokens", False),
    ("bad_words", ["x"]),
    ("guided_decoding_backend", "outlines"), ("guided_whitespace_pattern", " *"), ("logits_processors", ["x"]),
]
# tools are a chat feature (tests/test_server_structured.py has them, and structured output)
COMPLETION_REFUSED = COMMON_REFUSED + [("best_of", 2), ("suffix", "end"),
                                      ("tools", [{"type": "function", "function": {"name": "f"}}]),
                                      ("tool_choice", "required"), ("parallel_tool_calls", False)]
CHAT_REFUSED = COMMON_REFUSED + [("best_of", 3), ("echo", True), ("chat_template", "{{ x }}"),
                                 ("add_special_tokens", True),
                                 ("chat_template_kwargs", {"add_generation_prompt": False}),
                                 ("documents", [{"text": "d"}])]


def test_a_prefilled_assistant_answer_is_continued(live, http):
    """vLLM's ``continue_final_message`` with ``add_generation_prompt: false``: the prompt ends inside the
    assistant's message (no end of turn after it) and the reply is what follows, as the same ids sent to
    /v1/completions give; with the generation prompt left on, or a last message not the assistant's, a 400."""
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
    ids = live.engine.inputs.tokenizer.apply_chat_template(msgs, continue_final_message=True, return_dict=False)
    closed = live.engine.inputs.tokenizer.apply_chat_template(msgs, return_dict=False)
    assert ids == closed[:len(ids)] and len(closed) > len(ids)  # the template's end of turn is left off
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = post(http, "chat", False, messages=msgs, continue_final_message=True, add_generation_prompt=False, **greedy)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    for stream in (False, True):
        chat = post(http, "chat", stream, messages=msgs, continue_final_message=True, add_generation_prompt=False,
                    **greedy)
        assert text_of(chat, "chat", stream) == text_of(post(http, "completions", False, prompt=ids, **greedy),
                                                        "completions", False)
    _refused(post(http, "chat", False, messages=msgs, continue_final_message=True), "add_generation_prompt")
    _refused(post(http, "chat", False, messages=msgs[:1], continue_final_message=True, add_generation_prompt=False),
             "messages")
    dropped = {"role": "assistant", "content": "x"}  # a template that never shows an assistant's content
    tok = live.engine.inputs.tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
        err = _refused(post(http, "chat", False, messages=msgs[:1] + [dropped], continue_final_message=True,
                            add_generation_prompt=False), "messages")
        assert "continue_final_message" in err["message"]
    finally:
        tok.chat_template = saved
    opened = post(http, "chat", False, messages=msgs[:1], add_generation_prompt=False, **greedy)
    assert opened.status_code == 200 and opened.json()["usage"]["prompt_tokens"] == len(
        live.engine.inputs.tokenizer.apply_chat_template(msgs[:1], return_dict=False))


def _events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_return_token_ids_gives_the_prompts_and_each_choices_ids(live, http):
    """vLLM's ``return_token_ids`` (what RL frameworks train on): the prompt's ids (completions: on each choice,
    chat: on the response) and each choice's generated ids, which decode to its text; streamed, the prompt's in
    the first chunk and the generated ids adding up over the chunks to the same list. Off: none of the fields."""
    tok = live.engine.inputs.tokenizer
    greedy = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    prompts = ["The quick brown fox", "Once upon a time"]
    r = post(http, "completions", False, prompt=prompts, n=2, **greedy).json()
    for c in r["choices"]:
        assert c["prompt_token_ids"] == tok.encode(prompts[c["index"] // 2], add_special_tokens=False)
        assert len(c["token_ids"]) == 5 and tok.decode(c["token_ids"]) == c["text"]
    assert "token_ids" not in post(http, "completions", False, max_tokens=2).json()["choices"][0]
    chunks = _events(post(http, "completions", True, prompt=prompts[0], **greedy))
    assert chunks[0]["choices"][0]["prompt_token_ids"] == r["choices"][0]["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == r["choices"][0]["token_ids"]
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    chat = post(http, "chat", False, messages=msgs, **greedy).json()
    assert chat["prompt_token_ids"] == tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert tok.decode(chat["choices"][0]["token_ids"]) == chat["choices"][0]["message"]["content"]
    chunks = _events(post(http, "chat", True, messages=msgs, **greedy))
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == chat["choices"][0]["token_ids"]


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(live, http):
    """vLLM's ``return_tokens_as_token_ids``: logprobs name tokens ``token_id:N`` (chosen and top ones), the ids
    ``return_token_ids`` gives, in the same order; completions' echo names the prompt's ids the same way."""
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
              "return_tokens_as_token_ids": True}
    r = post(http, "completions", False, logprobs=2, echo=True, **greedy).json()["choices"][0]
    named = [int(t.removeprefix("token_id:")) for t in r["logprobs"]["tokens"]]
    assert named == r["prompt_token_ids"] + r["token_ids"]
    assert all(k.startswith("token_id:") for top in r["logprobs"]["top_logprobs"][1:] for k in top)
    c = post(http, "chat", False, logprobs=True, top_logprobs=2, **greedy).json()["choices"][0]
    assert [e["token"] for e in c["logprobs"]["content"]] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(t["token"].startswith("token_id:") for e in c["logprobs"]["content"] for t in e["top_logprobs"])


def test_prompt_logprobs_as_vllm_gives_them(live, http):
    """vLLM's ``prompt_logprobs``: for each prompt token (None for the first) its logprob and rank and the k most
    likely (ranks 1..k), the logprobs completions' echo reports; chat's on the response; streamed, in one chunk.
    With echo's logprobs at another count, or past 20: a 400."""
    tok = live.engine.inputs.tokenizer
    prompt = "The quick brown fox jumps over"
    ids = tok.encode(prompt, add_special_tokens=False)
    greedy = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    c = post(http, "completions", False, prompt=prompt, prompt_logprobs=2, echo=True, logprobs=2,
             **greedy).json()["choices"][0]
    plp = c["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for j, (t, d) in enumerate(zip(ids[1:], plp[1:]), 1):
        mine = d[str(t)]
        assert mine["logprob"] == pytest.approx(c["logprobs"]["token_logprobs"][j], abs=1e-5)
        assert mine["decoded_token"] == c["logprobs"]["tokens"][j]
        top = sorted((v["rank"], v["logprob"], k) for k, v in d.items() if k != str(t) or v["rank"] <= 2)
        assert [r for r, _, _ in top] == [1, 2] and top[0][1] >= top[1][1]
        assert mine["rank"] >= 1 and (mine["rank"] > 2) == (str(t) not in [k for _, _, k in top])
    msgs = [{"role": "user", "content": prompt}]
    chat = post(http, "chat", False, messages=msgs, prompt_logprobs=1, **greedy).json()
    n_ids = len(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False))
    assert len(chat["prompt_logprobs"]) == n_ids and chat["prompt_logprobs"][0] is None
    chunks = _events(post(http, "chat", True, messages=msgs, prompt_logprobs=1, **greedy))
    assert [ch["prompt_logprobs"] for ch in chunks if "prompt_logprobs" in ch] == [chat["prompt_logprobs"]]
    _refused(post(http, "completions", False, prompt_logprobs=2, echo=True, logprobs=1), "prompt_logprobs")
    _refused(post(http, "chat", False, prompt_logprobs=21), "prompt_logprobs")


def test_special_tokens_are_in_the_text_only_when_asked(live, http):
    """vLLM's ``skip_special_tokens: false``: an end-of-turn token the model generates (here forced by logit_bias,
    past EOS with ignore_eos) is in the text, streamed or not; by default it is left out."""
    tok = live.engine.inputs.tokenizer
    eos = tok.eos_token_id
    forced = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {str(eos): 100}}
    for endpoint in ("completions", "chat"):
        for stream in (False, True):
            assert text_of(post(http, endpoint, stream, **forced), endpoint, stream) == ""
            shown = text_of(post(http, endpoint, stream, skip_special_tokens=False, **forced), endpoint, stream)
            assert shown == tok.eos_token * 3, (endpoint, stream, shown)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(live, http):
    """vLLM's ``truncate_prompt_tokens``: a prompt longer than the context runs on its last k tokens (-1: the
    context's worth, less room to generate is the client's to leave), as those ids sent alone do; the echo is
    what ran. k past the context, 0 or below -1: a 400."""
    tok = live.engine.inputs.tokenizer
    long = "The river ran on and on through the valley. " * 200
    ids = tok.encode(long, add_special_tokens=False)
    assert len(ids) > live.engine.max_model_len
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = post(http, "completions", False, prompt=long, truncate_prompt_tokens=20, echo=True, **greedy)
    assert r.status_code == 200, r.text
    body = r.json()
    alone = post(http, "completions", False, prompt=ids[-20:], **greedy).json()
    assert body["usage"]["prompt_tokens"] == 20
    assert body["choices"][0]["text"] == tok.decode(ids[-20:]) + alone["choices"][0]["text"]
    msgs = [{"role": "user", "content": long}]
    chat = post(http, "chat", True, messages=msgs, truncate_prompt_tokens=30, **greedy)
    assert chat.status_code == 200 and text_of(chat, "chat", True)
    assert post(http, "completions", False, prompt=long).status_code == 400  # without it: too long
    short = post(http, "completions", False, prompt="Hi there", truncate_prompt_tokens=50, echo=True, **greedy)
    assert short.json()["choices"][0]["text"].startswith("Hi there")  # nothing cut
    for k in (0, -2, live.engine.max_model_len + 1):
        _refused(post(http, "completions", False, truncate_prompt_tokens=k), "truncate_prompt_tokens")


def test_chat_template_kwargs_reach_the_template(live, http, monkeypatch):
    """vLLM's ``chat_template_kwargs`` (what clients send for Qwen 3's ``enable_thinking``) are the template's
    variables: a template that reads one renders a longer prompt with it set. Names the server sets itself are a
    400 (in the table below)."""
    tok = live.engine.inputs.tokenizer
    monkeypatch.setattr(tok, "chat_template", "{% if enable_thinking %}<think>deep thoughts</think>{% endif %}"
                                              "{{ messages[0]['content'] }}")
    usage = {}
    for kwargs in (None, {"enable_thinking": False}, {"enable_thinking": True}):
        r = post(http, "chat", False, chat_template_kwargs=kwargs)
        assert r.status_code == 200, r.text
        usage[json.dumps(kwargs)] = r.json()["usage"]["prompt_tokens"]
    assert usage["null"] == usage['{"enable_thinking": false}'] < usage['{"enable_thinking": true}']


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_allowed_token_ids_keep_the_output_within_them(live, http, endpoint):
    """vLLM's ``allowed_token_ids``: greedy and sampled choices generate only those ids (it had been refused); an id
    outside the vocabulary or an empty list is a 400 naming the field."""
    allowed = [200, 300, 301, 4000]
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 2}):
        r = post(http, endpoint, False, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed,
                 return_token_ids=True, **kw)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert len(choice["token_ids"]) == 6 and set(choice["token_ids"]) <= set(allowed), choice
    vocab = live.engine.loaded.model.vocab_size
    _refused(post(http, endpoint, False, allowed_token_ids=[1, vocab]), "allowed_token_ids")
    _refused(post(http, endpoint, False, allowed_token_ids=[]), "allowed_token_ids")
    eos = min(live.engine.scheduler.eos_token_ids)  # only a token min_tokens holds back: nothing could be generated
    _refused(post(http, endpoint, False, allowed_token_ids=[eos], min_tokens=2), "allowed_token_ids")


def test_reasoning_effort_reaches_the_template(live, http, monkeypatch):
    """OpenAI's ``reasoning_effort`` is the template's variable of that name (gpt-oss's template reads it), as vLLM
    passes it; a value OpenAI does not define, or one that disagrees with chat_template_kwargs', is a 400."""
    tok = live.engine.inputs.tokenizer
    monkeypatch.setattr(tok, "chat_template", "{% if reasoning_effort %}Reasoning: {{ reasoning_effort }}. {% endif %}"
                                              "{{ messages[0]['content'] }}")

    def prompt(**kw) -> str:
        r = post(http, "chat", False, return_token_ids=True, **kw)
        assert r.status_code == 200, r.text
        return tok.decode(r.json()["prompt_token_ids"])

    assert not prompt().startswith("Reasoning")
    assert prompt(reasoning_effort="medium").startswith("Reasoning: medium. ")
    both = prompt(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "low"})
    assert both.startswith("Reasoning: low. ")
    _refused(post(http, "chat", False, reasoning_effort="extreme"), "reasoning_effort")
    _refused(post(http, "chat", False, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}),
             "reasoning_effort")


def _refused(r: httpx.Response, field: str) -> dict:
    """A 400 whose param is ``field`` (or a path inside it: ``logit_bias.5``)."""
    assert r.status_code == 400, (field, r.text)
    err = r.json()["error"]
    assert err["param"] == field or err["param"].startswith(field + "."), (field, err)
    assert err["type"] == "invalid_request_error", err
    assert field in err["message"], err
    return err


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_every_refused_field_is_a_400_naming_it(http, endpoint, stream):
    for field, value in COMPLETION_REFUSED if endpoint == "completions" else CHAT_REFUSED:
        err = _refused(post(http, endpoint, stream, **{field: value}), field)
        assert err["code"] == "unsupported_parameter", err


BAD_VALUES = [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", -1),
    ("min_p", 1.5), ("min_p", -0.1), ("min_tokens", -1), ("min_tokens", 5), ("min_tokens", 10 ** 30),
    ("min_tokens", "2"), ("min_p", "0.1"), ("presence_penalty", True),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"1.5": 1}), ("logit_bias", {" 5": 1}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {"5": 101}), ("logit_bias", {"5": "1"}), ("logit_bias", [5]),
    ("logit_bias", {str(i): 1 for i in range(301)}), ("logit_bias", {"9" * 40: 1}),
]


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_bad_values_are_a_400_naming_the_field(http, endpoint):
    for field, value in BAD_VALUES:
        for stream in (False, True):
            _refused(post(http, endpoint, stream, max_tokens=4, **{field: value}), field)


def test_logit_bias_outside_the_vocabulary_is_a_400_naming_the_id(live, http):
    vocab = live.engine.inputs.vocab_size
    for endpoint in ENDPOINTS:
        for bad in (vocab, vocab + 1000, 2 ** 31 - 1):
            err = _refused(post(http, endpoint, False, logit_bias={"5": 1, str(bad): -3}), "logit_bias")
            assert str(bad) in err["message"], err
        text_of(post(http, endpoint, False, logit_bias={str(vocab - 1): -3}), endpoint, False)


# --- the official client -----------------------------------------------------------------------

def test_the_openai_client_sends_every_parameter(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)
    extra = {"top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
             "stop_token_ids": [11]}
    want = (0.25, -0.25, {5: 3.0, 9: -1.0}, 123, 7, 0.05, 1.1, 2, False, [11], 0.8, 0.95, 5)
    common = dict(temperature=0.8, top_p=0.95, max_tokens=5, presence_penalty=0.25, frequency_penalty=-0.25,
                  logit_bias={"5": 3, "9": -1}, seed=123, extra_body=extra, user="me")

    def got():
        p = sent(live)
        return (p.presence_penalty, p.frequency_penalty, p.logit_bias, p.seed, p.top_k, p.min_p,
                p.repetition_penalty, p.min_tokens, p.stop_on_eos, p.stop_token_ids, p.temperature, p.top_p,
                p.max_new_tokens)

    out = client.completions.create(model=MODEL, prompt="Hello", **common)
    assert out.choices[0].finish_reason == "length" and got() == want
    # (the dummy model's sampled ids may decode to no text: the finish reason says the 5 tokens came)
    streamed = list(client.completions.create(model=MODEL, prompt="Hello", stream=True, **common))
    assert streamed[-1].choices[0].finish_reason == "length" and got() == want
    chat = client.chat.completions.create(model=MODEL, messages=MSG, **common)
    assert chat.choices[0].finish_reason == "length" and got() == want
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSG, stream=True, **common))
    assert chunks[-1].choices[0].finish_reason == "length" and got() == want


def test_the_openai_client_hears_each_refusal(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)
    calls = [
        ("best_of", lambda: client.completions.create(model=MODEL, prompt="hi", n=2, best_of=3)),
        ("n", lambda: client.completions.create(model=MODEL, prompt="hi", n=0)),
        ("logprobs", lambda: client.completions.create(model=MODEL, prompt="hi", logprobs=21)),
        ("top_logprobs", lambda: client.chat.completions.create(model=MODEL, messages=MSG, logprobs=True,
                                                                top_logprobs=21)),
        ("response_format.type", lambda: client.chat.completions.create(model=MODEL, messages=MSG,
                                                                        response_format={"type": "yaml"})),
        ("tool_choice", lambda: client.chat.completions.create(
            model=MODEL, messages=MSG, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])),
        ("logit_bias", lambda: client.chat.completions.create(model=MODEL, messages=MSG,
                                                              logit_bias={"999999": 1})),
        ("min_p", lambda: client.chat.completions.create(model=MODEL, messages=MSG, stream=True,
                                                         extra_body={"min_p": 2})),
    ]
    for field, call in calls:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.status_code == 400 and e.value.param == field, (field, e.value)
