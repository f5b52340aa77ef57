"""`logprobs`, `top_logprobs`, `echo` and `n` through a real uvicorn server (tests/test_server.py's
LiveServer) with the official openai client and raw httpx, streamed and not (issue 18). The values
themselves are checked against a plain forward of the model in tests/test_logprobs_n.py."""

from __future__ import annotations

import pytest

for _extra in ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client"):
    pytest.importorskip(_extra)


from test_server import MODEL, server_fixtures

MSG = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


live, client, http = server_fixtures(timeout=60)


def _check_completion_logprobs(lp, text: str, k: int, n_tokens: int) -> None:
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_tokens
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(n_tokens)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and top[tok] == value  # the chosen token and the top k
        assert k <= len(top) <= k + 1 and all(v <= 0 for v in top.values())


def test_completions_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, logprobs=3, **GREEDY)
    choice = r.choices[0]
    _check_completion_logprobs(choice.logprobs, choice.text, 3, 5)
    assert all(max(top.values()) == v for top, v in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs))
    # streamed: each chunk's logprobs are the tokens of its own text; together, the same as above
    chunks = [c for c in client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                                   logprobs=3, stream=True, **GREEDY)]
    tokens, values, offsets = [], [], []
    for c in chunks:
        lp = c.choices[0].logprobs
        if lp is None:
            assert c.choices[0].text == "" and c.choices[0].finish_reason == "length"
            continue
        assert "".join(lp.tokens) == c.choices[0].text
        tokens += lp.tokens
        values += lp.token_logprobs
        offsets += lp.text_offset
    assert tokens == choice.logprobs.tokens and offsets == choice.logprobs.text_offset
    assert values == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
    # logprobs 0: the chosen token's alone
    zero = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, logprobs=0,
                                     **GREEDY)
    assert [list(t) for t in zero.choices[0].logprobs.top_logprobs] == [[t] for t in zero.choices[0].logprobs.tokens]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, logprobs=True, top_logprobs=2,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.bytes == list(e.token.encode()) and e.logprob <= 0 and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy
    streamed = []
    for c in client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, logprobs=True, top_logprobs=2,
                                            stream=True, **GREEDY):
        if c.choices and c.choices[0].logprobs is not None:
            assert "".join(e.token for e in c.choices[0].logprobs.content) == c.choices[0].delta.content
            streamed += c.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    # without logprobs: none
    plain = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_echo(live, client):
    prompt = "Echo this prompt back"
    n_prompt = len(live.engine.tokenizer.encode(prompt, add_special_tokens=False))
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, **GREEDY)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (n_prompt, 3)
    with_lp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, **GREEDY)
    lp = with_lp.choices[0].logprobs
    assert len(lp.tokens) == n_prompt + 3 and "".join(lp.tokens) == echoed.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    # streamed: the prompt (and its logprobs) come first
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1,
                                            stream=True, **GREEDY))
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    # token-id prompts echo their text
    ids = live.engine.tokenizer.encode(prompt, add_special_tokens=False)
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True, **GREEDY).choices[0].text == \
        echoed.choices[0].text


def test_n_choices_share_one_prefill(live, client, http):
    prompt = "A prompt no other test sends, so that nothing of it is cached: zebra quartz"
    n_prompt = len(live.engine.tokenizer.encode(prompt, add_special_tokens=False))
    common = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, logprobs=0,
                  extra_body={"ignore_eos": True})
    before = live.manager.stats()["prefill_tokens"]
    r = client.completions.create(n=4, seed=7, **common)
    assert live.manager.stats()["prefill_tokens"] - before == n_prompt  # computed once for the four
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and {c.finish_reason for c in r.choices} == {"length"}
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 20
    # choice i samples with seed + i: it equals a request of its own with that seed
    for i, choice in enumerate(r.choices):
        alone = client.completions.create(seed=7 + i, **common).choices[0]
        assert alone.text == choice.text
        assert alone.logprobs.tokens == choice.logprobs.tokens
        assert alone.logprobs.token_logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
    assert len({tuple(c.logprobs.tokens) for c in r.choices}) > 1
    # streamed: every chunk names its choice; each choice ends once, with the same text
    texts, ends = {}, {}
    for c in client.completions.create(n=4, seed=7, stream=True, stream_options={"include_usage": True}, **common):
        if not c.choices:
            assert c.usage.completion_tokens == 20
            continue
        ch = c.choices[0]
        texts[ch.index] = texts.get(ch.index, "") + ch.text
        if ch.finish_reason:
            ends[ch.index] = ends.get(ch.index, 0) + 1
    assert ends == {0: 1, 1: 1, 2: 1, 3: 1} and [texts[i] for i in range(4)] == [c.text for c in r.choices]
    # chat: a role chunk for each choice
    roles = [c.choices[0].index for c in client.chat.completions.create(
        model=MODEL, messages=MSG, n=2, max_tokens=2, stream=True, **GREEDY) if c.choices and c.choices[0].delta.role]
    assert roles == [0, 1]
    chat = client.chat.completions.create(model=MODEL, messages=MSG, n=3, max_tokens=2, **GREEDY)
    assert len({c.message.content for c in chat.choices}) == 1 and chat.usage.completion_tokens == 6
    assert live.manager.wait_idle(10) and live.manager.stats()["kv_blocks_used"] == 0  # the pool is full again


@pytest.mark.parametrize("endpoint,field,value", [
    ("/v1/completions", "logprobs", 21), ("/v1/completions", "logprobs", -1), ("/v1/completions", "logprobs", True),
    ("/v1/chat/completions", "logprobs", 3), ("/v1/chat/completions", "top_logprobs", 21),
    ("/v1/chat/completions", "top_logprobs", -1), ("/v1/chat/completions", "top_logprobs", 2),  # without logprobs
    ("/v1/completions", "n", 0), ("/v1/completions", "n", 129), ("/v1/chat/completions", "n", -1),
    ("/v1/completions", "n", 65),  # more than the engine's batch (64)
    ("/v1/completions", "n", 2.0),
])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_bad_values_are_a_400_naming_the_field(http, endpoint, field, value, stream):
    body = {"model": MODEL, "max_tokens": 2, field: value, "stream": stream}
    body.update({"messages": MSG} if "chat" in endpoint else {"prompt": "hi"})
    r = http.post(endpoint, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


def test_best_of_equal_to_n_is_accepted(client):
    r = client.completions.create(model=MODEL, prompt="hi", n=2, best_of=2, max_tokens=2, **GREEDY)
    assert len(r.choices) == 2
