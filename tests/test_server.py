"""`rose serve-local`: a real uvicorn server on 127.0.0.1 over the tiny dummy Llama (real SmolLM2
tokenizer), driven by the official openai client and raw httpx."""

from __future__ import annotations

import pytest

# the server's optional extras (rosecli[serve]) and the test clients: absent on a bare GPU image
for _extra in ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client"):
    pytest.importorskip(_extra)

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

import rosecli
from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.llm import LLMEngine
from rosecli.engine.streaming import StreamingManager
from rosecli.server.app import create_app
from rosecli.server.uvicorn_server import bind_socket, make_server

MODEL = "tiny-llama"
KEY = "sk-test-key"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


class LiveServer:
    """One engine + manager + app on uvicorn in a background thread, on a free loopback port."""

    def __init__(self, cache_dir: str, api_key=None, profile_dir=None, read_timeout=30.0, shutdown_timeout=5.0,
                 max_request_bytes=4 * 1024 * 1024, read_ceiling_gbs=None, **engine_kw):
        self.engine = LLMEngine(EngineConfig(model=MODEL, load_format="dummy", device="cpu", cache_dir=cache_dir,
                                             show_progress=False, **engine_kw))
        self.manager = StreamingManager(self.engine)
        self.dead_calls = 0
        self.app = create_app(self.manager, self.engine, api_key=api_key, served_model_name=MODEL,
                              profile_dir=profile_dir, on_engine_dead=self._on_dead,
                              max_request_bytes=max_request_bytes, read_timeout=read_timeout,
                              read_ceiling_gbs=read_ceiling_gbs)
        # bound as `rose serve-local` binds its port: a TCP socket (proto IPPROTO_TCP), whose connections
        # asyncio sets TCP_NODELAY on; on a plain socket.socket() (proto 0) it does not, and a response
        # written as headers then body waited ~40 ms for the client's delayed ACK
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.app, read_timeout=read_timeout, shutdown_timeout=shutdown_timeout,
                                  log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def _on_dead(self):
        self.dead_calls += 1

    def client(self, api_key=KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=30)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.engine.close()


def server_fixtures(timeout: float = 60, **server_kw):
    """``live, client, http`` module fixtures for a test file of its own server (no API key):
    ``live, client, http = server_fixtures(...)`` at the top of the file."""

    @pytest.fixture(scope="module")
    def live(cache_dir):
        srv = LiveServer(cache_dir, **server_kw)
        yield srv
        srv.stop()

    @pytest.fixture(scope="module")
    def client(live):
        return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=timeout)

    @pytest.fixture(scope="module")
    def http(live):
        with httpx.Client(base_url=live.url, timeout=timeout) as c:
            yield c

    return live, client, http


@pytest.fixture(scope="module")
def live(cache_dir, tmp_path_factory):
    srv = LiveServer(cache_dir, api_key=KEY, profile_dir=str(tmp_path_factory.mktemp("profiles")))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return live.client()


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        yield c


def metrics(http) -> dict:
    """{(name, frozenset(labels)): value} from /metrics, parsed by prometheus_client."""
    out = {}
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def chat_prompt_tokens(live, content: str) -> int:
    ids = live.engine.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                    add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "input_ids") or isinstance(ids, dict) else ids)


def completion_prompt_tokens(live, prompt: str) -> int:
    return len(live.engine.tokenizer.encode(prompt, add_special_tokens=False))


# --- the happy path --------------------------------------------------------------------------

def test_completion_nonstreaming_usage_exact(live, client):
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.prompt_tokens == completion_prompt_tokens(live, prompt)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_completion_default_max_tokens_is_16(client):
    r = client.completions.create(model=MODEL, prompt="Hello there", **GREEDY)
    assert r.usage.completion_tokens == 16


def test_completion_streaming_matches_nonstreaming(live, client):
    prompt = "Once upon a time"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == completion_prompt_tokens(live, prompt)


def test_completion_token_id_prompts(client):
    ids = [504, 3458, 6354, 28]
    for prompt in (ids, [ids]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, **GREEDY)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3
    r = client.completions.create(model=MODEL, prompt=["a single string in a list"], max_tokens=2, **GREEDY)
    assert r.usage.completion_tokens == 2


def test_a_batch_of_prompts_answers_each_as_alone_in_vllms_order(live, client, http):
    """/v1/completions with a list of prompts (lm-eval-harness and batch clients send them): choice
    ``prompt x n + j`` is choice j of that prompt sent alone (seed + j with a seed), the echo is each prompt's,
    usage counts each prompt once; streamed, the same texts under the same indices."""
    prompts = ["The quick brown fox", "Once upon a time there", "A list: one, two,"]
    body = {"model": MODEL, "max_tokens": 5}
    alone = [client.completions.create(prompt=x, **body, **GREEDY) for x in prompts]
    r = client.completions.create(prompt=prompts, **body, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) and r.usage.completion_tokens == 15
    ids = [live.engine.tokenizer.encode(x, add_special_tokens=False) for x in prompts[:2]]
    body["ignore_eos"] = True
    r = http.post("/v1/completions", json={**body, "prompt": ids, "n": 2, "temperature": 1.0, "seed": 5,
                                           "echo": True, "logprobs": 1}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3] and r["usage"]["completion_tokens"] == 20
    for k, j in ((0, 0), (0, 1), (1, 0), (1, 1)):
        one = http.post("/v1/completions", json={**body, "prompt": ids[k], "temperature": 1.0, "seed": 5 + j,
                                                 "echo": True, "logprobs": 1}).json()["choices"][0]
        got = r["choices"][2 * k + j]
        assert got["text"] == one["text"] and got["text"].startswith(prompts[k]), (k, j)
        assert got["logprobs"]["tokens"] == one["logprobs"]["tokens"]
    texts: dict = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, stream=True, **GREEDY):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {i: a.choices[0].text for i, a in enumerate(alone)}


def test_a_batch_with_a_bad_prompt_runs_none_of_them(live, http):
    """One prompt the engine refuses (a token id past the vocabulary) fails the whole request with a 400 naming
    it; the prompts added before it are ended, their KV blocks freed."""
    err = _bad(http, "/v1/completions", {"model": MODEL, "prompt": [[5, 6, 7] * 30, [1, 10 ** 9]],
                                         "max_tokens": 300, "ignore_eos": True}, param="prompt[1]")
    assert err["message"].startswith("prompt[1]: ") and "vocabulary" in err["message"]
    deadline = time.monotonic() + 5
    while metrics(http)[("rose_kv_blocks_used", frozenset())] or live.manager.stats()["running"]:
        assert time.monotonic() < deadline, "the batch's first prompt still runs"
        time.sleep(0.05)


def test_tokenize_and_detokenize_as_vllm_serves_them(live, client, http):
    """vLLM's /tokenize counts what the generation endpoints would feed the model (a prompt as /v1/completions
    tokenizes it, messages through the chat template), /detokenize turns ids back into text, /version names the
    build; bad bodies are 400s naming the field."""
    prompt = "The quick brown fox"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()
    used = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY).usage.prompt_tokens
    assert r["count"] == len(r["tokens"]) == used and r["max_model_len"] == live.engine.max_model_len
    assert r["token_strs"] is None
    assert http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": prompt}
    msgs = [{"role": "user", "content": "Hi there"}]
    chat = http.post("/tokenize", json={"messages": msgs, "return_token_strs": True}).json()
    used = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, **GREEDY).usage.prompt_tokens
    assert chat["count"] == used and chat["token_strs"] == live.engine.tokenizer.convert_ids_to_tokens(chat["tokens"])
    bare = http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][:bare["count"]] and bare["count"] < chat["count"]
    assert http.get("/version").json()["version"] == rosecli.__version__
    _bad(http, "/tokenize", {"prompt": "a", "messages": msgs}, param="prompt")
    _bad(http, "/tokenize", {"model": MODEL}, param="prompt")
    _bad(http, "/tokenize", {"messages": []}, param="messages")
    _bad(http, "/tokenize", {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False},
         param="messages")
    _bad(http, "/tokenize", {"prompt": "a", "model": "gpt-4"}, status=404, param="model")
    _bad(http, "/detokenize", {"tokens": [1, 10 ** 9]}, param="tokens")
    _bad(http, "/detokenize", {"tokens": "abc"}, param="tokens")


def test_a_text_prompt_gets_the_special_tokens_its_tokenizer_adds_as_vllm_gives_them(cache_dir):
    """vLLM's add_special_tokens: a completions prompt (and /tokenize's) begins with what the model's tokenizer adds
    to one (Llama 3's <|begin_of_text|>; here a BOS made up for the test) unless the request says false; token ids
    are taken as sent; chat leaves it to the template, and the engine's own text prompts get it too."""
    from tokenizers import processors

    srv = LiveServer(cache_dir)
    try:
        tok = srv.engine.inputs.tokenizer
        plain = tok.encode("The quick brown fox", add_special_tokens=False)
        tok._tokenizer.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", 0)])
        http = httpx.Client(base_url=srv.url, timeout=30)
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 2, "temperature": 0,
                "return_token_ids": True}
        got = http.post("/v1/completions", json=body).json()
        assert got["choices"][0]["prompt_token_ids"] == [0] + plain and got["usage"]["prompt_tokens"] == len(plain) + 1
        without = http.post("/v1/completions", json={**body, "add_special_tokens": False}).json()
        assert without["choices"][0]["prompt_token_ids"] == plain
        null = http.post("/v1/completions", json={**body, "add_special_tokens": None}).json()  # (null: the default)
        assert null["choices"][0]["prompt_token_ids"] == [0] + plain
        ids = http.post("/v1/completions", json={**body, "prompt": plain}).json()  # ids: as sent
        assert ids["choices"][0]["prompt_token_ids"] == plain
        assert http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"] == [0] + plain
        assert http.post("/tokenize", json={"prompt": "The quick brown fox",
                                            "add_special_tokens": False}).json()["tokens"] == plain
        _bad(http, "/v1/completions", {**body, "add_special_tokens": "yes"}, param="add_special_tokens")
        msgs = [{"role": "user", "content": "Hi"}]
        _bad(http, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "add_special_tokens": True},
             param="add_special_tokens")
        assert srv.engine.inputs.process("The quick brown fox") == [0] + plain  # `rose generate --no-chat`'s way
    finally:
        srv.stop()


def test_chat_streaming_shape_and_usage(live, client):
    content = "Tell me about the sea."
    full = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=6, **GREEDY)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == chat_prompt_tokens(live, content)
    assert full.usage.completion_tokens == 6

    parts = [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "about the sea."}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=1,
                                       **GREEDY)
    assert r.usage.prompt_tokens == full.usage.prompt_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                 max_completion_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == msg.content
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_raw_sse_framing(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0]["delta"] == {} and payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in payloads[-1]  # only with stream_options.include_usage


def test_stream_events_are_the_chunks_byte_for_byte():
    """The per-request SSE template gives exactly json.dumps of the chunk, for any text."""
    from rosecli.server import protocol as p

    for chat in (False, True):
        for include_usage in (False, True):
            env = p.Envelope(chat, 'org/model "q"')
            for text in ["", "hi", " \u00e9\u4e2d\n\"\\", "\x00", "\U0001f642", "\ud800"]:
                want = "data: " + json.dumps(env.chunk(text=text, include_usage=include_usage),
                                             separators=(",", ":")) + "\n\n"
                assert env.text_event(text, include_usage) == want


def test_pieces_queued_behind_a_busy_loop_go_out_in_one_write_one_event_each(live):
    """When the event loop falls behind the engine, a stream sends what has queued in one write,
    still one SSE event per piece, in order; a shutdown ends it with the error event and [DONE]."""
    import asyncio

    from rosecli.server import app as server_app
    from rosecli.server import protocol as p

    rose = live.app.state.rose

    async def collect():
        q = asyncio.Queue()
        for piece in ("Hel", "lo", " wor", "ld"):
            q.put_nowait((0, piece))  # (choice index, piece), as the bridge queues them
        q.put_nowait((None, server_app._SHUTDOWN))
        rose.active += 1  # as a request that passed generate(); _stream gives it back
        choices = server_app._Choices(rose, p.Envelope(False, MODEL), [-1], SamplingParams(), [[]], None)
        return [w async for w in rose._stream(choices, q, False, time.perf_counter())]

    writes = asyncio.run(collect())
    assert len(writes) == 2  # the four pieces, then the end of the stream
    texts = [json.loads(e[len("data: "):])["choices"][0]["text"] for e in writes[0].split("\n\n") if e]
    assert texts == ["Hel", "lo", " wor", "ld"]
    tail = [e for e in writes[1].split("\n\n") if e]
    assert json.loads(tail[0][len("data: "):])["choices"][0]["finish_reason"] == "abort"
    assert "error" in json.loads(tail[1][len("data: "):]) and tail[-1] == "data: [DONE]"


def test_stop_string_excluded(client):
    base = client.completions.create(model=MODEL, prompt="Rivers flow to", max_tokens=12, **GREEDY)
    text = base.choices[0].text
    assert len(text) > 6
    stop = text[4:7]
    expected = text[:text.find(stop)]
    r = client.completions.create(model=MODEL, prompt="Rivers flow to", max_tokens=12, stop=[stop], **GREEDY)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="Rivers flow to", max_tokens=12, stop=stop,
                                            stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # vLLM's include_stop_str_in_output: the stop string that ended the text stays in it, streamed or not
    kept = text[:text.find(stop) + len(stop)]
    extra = {"extra_body": {**GREEDY["extra_body"], "include_stop_str_in_output": True}}
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="Rivers flow to", max_tokens=12, stop=[stop, "\x00"],
                                      stream=stream, temperature=0, **extra)
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks) == kept and chunks[-1].choices[0].finish_reason == "stop"


def test_models_and_health(live, http):
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert live.client().models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        live.client().models.retrieve("gpt-4")
    assert httpx.get(live.url + "/health").status_code == 200  # no key needed


def test_32_concurrent_streams(live):
    prompts = [f"Request number {i} asks about topic {i * 7}" for i in range(32)]

    def one(i):
        c = live.client()
        text, usage = "", None
        for chunk in c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8, stream=True,
                                          stream_options={"include_usage": True}, **GREEDY):
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return text, usage

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    for i, (text, usage) in enumerate(results):
        assert usage.completion_tokens == 8 and text
        assert usage.prompt_tokens == completion_prompt_tokens(live, prompts[i])


# --- abuse -----------------------------------------------------------------------------------

def _bad(http, path, body, status=400, param=None, raw=None):
    r = http.post(path, content=raw, headers={"content-type": "application/json"}) if raw is not None \
        else http.post(path, json=body)
    assert r.status_code == status, (body, raw, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    return err


def test_bad_completion_requests_are_400(http):
    long_prompt = "word " * 600
    cases = [
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL, "prompt": []}, "prompt"),
        ({"model": MODEL, "prompt": long_prompt}, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 10 ** 12}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 512}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
        ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
        ({"model": MODEL, "prompt": ["a", ""]}, "prompt[1]"),
        ({"model": MODEL, "prompt": [[5, 6], []]}, "prompt[1]"),
        ({"model": MODEL, "prompt": ["a", [5, 6]]}, "prompt"),
        ({"model": MODEL, "prompt": [1, 2, 10 ** 9]}, "prompt"),
        ({"model": MODEL, "prompt": 123}, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "stream": "maybe"}, "stream"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ]
    for body, param in cases:
        _bad(http, "/v1/completions", body, param=param)
    err = _bad(http, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 512})
    assert "512" in err["message"] and "512" in err["message"]
    _bad(http, "/v1/completions", None, raw=b'{"model": "tiny-llama", "prompt": "hi",')
    _bad(http, "/v1/completions", None, raw=b"[1, 2]")
    err = _bad(http, "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, status=404, param="model")
    assert err["code"] == "model_not_found"


def test_bad_chat_requests_are_400(http):
    msg = [{"role": "user", "content": "hi"}]
    cases = [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, None),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 600}]}, "messages"),
        ({"model": MODEL, "messages": msg, "max_completion_tokens": -3}, "max_completion_tokens"),
        ({"model": MODEL, "messages": msg, "max_tokens": 100000}, "max_tokens"),
        ({"model": MODEL, "messages": msg, "temperature": -1}, "temperature"),
        ({"model": MODEL, "messages": msg, "top_p": 2}, "top_p"),
        ({"model": MODEL, "messages": msg, "n": 500}, "n"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, "messages[0].content"),
    ]
    for body, param in cases:
        _bad(http, "/v1/chat/completions", body, param=param)


def test_the_openai_client_sees_bad_requests(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_api_key(live):
    assert httpx.get(live.url + "/v1/models").status_code == 401
    r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(live.url + "/metrics").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        live.client(api_key="wrong").models.list()
    assert httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(live.url + "/health").status_code == 200


def test_disconnect_mid_stream_frees_kv_blocks(http):
    before = metrics(http)[("rose_requests_total", frozenset({("finish_reason", "abort")}))]
    body = {"model": MODEL, "prompt": "A long story: " * 20, "max_tokens": 380, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(line == "" or line.startswith("data: ") for line in got)
        held = metrics(http)[("rose_kv_blocks_used", frozenset())]
    assert held > 0  # the stream held KV blocks while it ran
    assert_released_after_leaving(http, before)


def assert_released_after_leaving(http, aborts_before: float, within_s: float = 5) -> None:
    """After a client left its stream: no KV block is held and no request runs (within ``within_s``), and the
    request was counted as aborted."""
    deadline = time.monotonic() + within_s
    while True:
        m = metrics(http)
        if m[("rose_kv_blocks_used", frozenset())] == 0 and m[("rose_num_requests_running", frozenset())] == 0:
            break
        assert time.monotonic() < deadline, "KV blocks were not released after the client went away"
        time.sleep(0.05)
    assert m[("rose_requests_total", frozenset({("finish_reason", "abort")}))] == aborts_before + 1


def test_metrics_parse(http, client):
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=4, **GREEDY)
    m = metrics(http)
    assert m[("rose_requests_total", frozenset({("finish_reason", "length")}))] >= 1
    for name in ("rose_num_requests_running", "rose_num_requests_waiting", "rose_kv_blocks_used",
                 "rose_kv_blocks_total", "rose_prefix_cache_hit_rate"):
        assert (name, frozenset()) in m
    assert m[("rose_kv_blocks_total", frozenset())] > 0
    for hist in ("rose_time_to_first_token_seconds", "rose_time_per_output_token_seconds",
                 "rose_e2e_request_latency_seconds"):
        assert m[(hist + "_count", frozenset())] >= 1
        assert m[(hist + "_sum", frozenset())] > 0


def test_profile_endpoints(http, client, monkeypatch):
    import rosecli.server.app as server_app

    export = server_app._export_trace
    exported_on = []
    monkeypatch.setattr(server_app, "_export_trace",
                        lambda prof, path: exported_on.append(threading.current_thread().name) or export(prof, path))
    # only a JSON POST: a cross-site form post (a "simple" request, no CORS preflight) cannot start it
    r = http.post("/start_profile", data={"seconds": "1"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert http.post("/start_profile", content=b"{}").status_code == 415  # no content type at all
    assert http.post("/stop_profile", json={}).status_code == 400
    for seconds in (0, -1, 1e9, "10", True, None):
        r = http.post("/start_profile", json={"seconds": seconds})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seconds", seconds
    r = http.post("/start_profile", json={"seconds": 60})
    assert r.status_code == 200 and r.json()["seconds"] == 60
    assert http.post("/start_profile", json={"seconds": 60.5}).status_code == 400  # bounded
    assert http.post("/start_profile", json={}).status_code == 400
    client.completions.create(model=MODEL, prompt="profile me", max_tokens=3, **GREEDY)
    r = http.post("/stop_profile", json={})
    assert r.status_code == 200
    with open(r.json()["trace"]) as f:
        assert "traceEvents" in json.load(f)
    assert exported_on and all(not name.startswith("rose-engine") for name in exported_on)  # not the engine's

    # the window is bounded: it stops and writes its trace by itself
    r = http.post("/start_profile", headers={"content-type": "application/json"})  # no body: the default
    assert r.status_code == 200 and r.json()["seconds"] == 5
    assert http.post("/stop_profile", json={}).status_code == 200
    r = http.post("/start_profile", json={"seconds": 0.3})
    trace = r.json()["trace"]
    client.completions.create(model=MODEL, prompt="profile me", max_tokens=3, **GREEDY)
    deadline = time.monotonic() + 10
    while not os.path.exists(trace):
        assert time.monotonic() < deadline, "the profiling window did not end by itself"
        time.sleep(0.05)
    assert http.post("/stop_profile", json={}).status_code == 400  # already stopped


# --- overload and engine death (their own server) --------------------------------------------

def test_overload_then_engine_death(cache_dir):
    srv = LiveServer(cache_dir, max_inflight_requests=1)
    try:
        long_body = {"model": MODEL, "prompt": "Keep talking", "max_tokens": 480, "stream": True,
                     "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=long_body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                over = http.post("/v1/completions", json={"model": MODEL, "prompt": "me too", "max_tokens": 2})
                assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"

                def boom():
                    raise RuntimeError("simulated device failure")

                srv.engine.scheduler.step = boom
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            err = json.loads(rest[-2][len("data: "):])["error"]
            assert err["code"] == "engine_dead" and err["type"] == "server_error"
            assert "simulated" not in err["message"]  # the log has the exception, the client does not
            assert json.loads(rest[-3][len("data: "):])["choices"][0]["finish_reason"] == "error"
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "engine_dead"
            assert "simulated" not in health.text
            assert http.post("/start_profile", json={}).status_code == 404  # no --profile-dir
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "anyone?", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            with pytest.raises(openai.APIError):
                srv.client().completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True).__next__()
            deadline = time.monotonic() + 3
            while srv.dead_calls == 0:
                assert time.monotonic() < deadline, "on_engine_dead was not called"
                time.sleep(0.02)
            assert srv.dead_calls == 1
    finally:
        srv.stop()
