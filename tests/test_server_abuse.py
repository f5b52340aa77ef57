"""What a client types cannot hurt the engine (issue 16): each defect found by hand, as a
regression test through a real uvicorn server on 127.0.0.1 (tests/test_server.py's LiveServer)."""

from __future__ import annotations

import pytest

# the server's optional extras (rosecli[serve]) and the test clients: absent on a bare GPU image
for _extra in ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client"):
    pytest.importorskip(_extra)

import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from test_server import MODEL, LiveServer, metrics

READ_TIMEOUT = 1.0
MAX_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def live(cache_dir):
    srv = LiveServer(cache_dir, read_timeout=READ_TIMEOUT, max_request_bytes=MAX_BYTES)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        yield c


def post_raw(http, path: str, raw: bytes) -> httpx.Response:
    return http.post(path, content=raw, headers={"content-type": "application/json"})


def assert_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] is None or isinstance(err["code"], str)
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_healthy(live, http) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert live.manager.is_alive
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "still here?", "max_tokens": 2,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def raw_exchange(port: int, data: bytes, wait: float) -> tuple[bytes, float]:
    """Send ``data`` on a fresh connection, then read until the server closes it (or ``wait`` s)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        if data:
            s.sendall(data)
        got = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        except socket.timeout:
            pass
    return got, time.monotonic() - start


# --- 1. numbers and types ------------------------------------------------------------------------

def test_numbers_beyond_what_the_engine_represents_are_400(live, http):
    hi = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    cases = [
        ({"top_k": 9223372036854775808}, "top_k"),  # killed the engine worker before
        ({"top_k": 2 ** 31}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 18446744073709551616}, "seed"),  # killed the engine worker before
        ({"seed": 2 ** 63}, "seed"),
        ({"seed": -1}, "seed"),
        ({"temperature": 100}, "temperature"),
        ({"temperature": 2.0001}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.0000001}, "top_p"),
        ({"max_tokens": 10 ** 30}, "max_tokens"),
        ({"stop_token_ids": [2 ** 70]}, "stop_token_ids"),
        ({"stop": ["x"] * 17}, "stop"),
    ]
    for extra, param in cases:
        assert_error(http.post("/v1/completions", json={**hi, **extra}), 400, param)
        assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, **extra,
                                                             "messages": [{"role": "user", "content": "hi"}]}),
                     400, param)
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2 ** 64]}), 400, "prompt")
    assert_healthy(live, http)
    # the edges themselves are served; a top_k beyond the vocabulary keeps every token
    for extra in ({"seed": 2 ** 63 - 1}, {"top_k": 2 ** 31 - 1}, {"temperature": 2}, {"top_k": -1},
                  {"top_p": 1}, {"temperature": 0}):
        r = http.post("/v1/completions", json={**hi, **extra})
        assert r.status_code == 200, (extra, r.text)


def test_non_finite_numbers_are_400(live, http):
    for field in ("temperature", "top_p", "presence_penalty"):
        for literal in (b"Infinity", b"-Infinity", b"NaN", b"1e999"):
            raw = b'{"model": "tiny-llama", "prompt": "hi", "%s": %s}' % (field.encode(), literal)
            err = assert_error(post_raw(http, "/v1/completions", raw), 400)
            assert err["param"] in (field, None), err  # a literal that is no JSON number names no field
    assert_healthy(live, http)


def test_types_are_strict(http):
    hi = {"model": MODEL, "prompt": "hi"}
    cases = [({"stream": "yes"}, "stream"), ({"stream": 1}, "stream"), ({"max_tokens": "3"}, "max_tokens"),
             ({"max_tokens": 3.0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
             ({"temperature": "0.5"}, "temperature"), ({"temperature": True}, "temperature"),
             ({"ignore_eos": "true"}, "ignore_eos"), ({"seed": "1"}, "seed"), ({"n": "1"}, "n"),
             ({"stop": 5}, "stop"), ({"stream_options": {"include_usage": "yes"}, "stream": True},
                                     "stream_options.include_usage")]
    for extra, param in cases:
        assert_error(http.post("/v1/completions", json={**hi, **extra}), 400, param, "invalid_type")
    err = assert_error(http.post("/v1/completions", json={"model": MODEL}), 400, "prompt")
    assert err["code"] == "missing_required_parameter"
    # ints where floats are asked for are numbers all the same
    r = http.post("/v1/completions", json={**hi, "max_tokens": 2, "temperature": 1, "top_p": 1})
    assert r.status_code == 200


# --- 2. text that is not text; no internal error text to clients ---------------------------------

def test_lone_surrogates_are_400_naming_the_field(live, http):
    cases = [
        (b'{"model": "tiny-llama", "prompt": "\\ud800"}', "/v1/completions", "prompt"),
        (b'{"model": "tiny-llama", "prompt": ["ok", "\\udfff"]}', "/v1/completions", "prompt[1]"),
        (b'{"model": "tiny-llama", "prompt": "hi", "stop": ["\\ud800x"]}', "/v1/completions", "stop[0]"),
        (b'{"model": "tiny-\\udc00llama", "prompt": "hi"}', "/v1/completions", "model"),
        (b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "a\\ud800"}]}',
         "/v1/chat/completions", "messages[0].content"),
        (b'{"model": "tiny-llama", "messages": [{"role": "user", "content": [{"type": "text", '
         b'"text": "\\ud800"}]}]}', "/v1/chat/completions", "messages[0].content[0].text"),
        (b'{"model": "tiny-llama", "\\ud800": 1, "prompt": "hi"}', "/v1/completions", None),
    ]
    for raw, path, param in cases:
        err = assert_error(post_raw(http, path, raw), 400, code="invalid_value")
        assert err["param"] == param, (raw, err)
        assert "surrogate" in err["message"] and "TypeError" not in err["message"]
    # invalid UTF-8 and UTF-8-encoded surrogates are not JSON text either
    for raw in (b'{"model": "tiny-llama", "prompt": "\xff"}', b'{"model": "tiny-llama", "prompt": "\xed\xa0\x80"}'):
        assert_error(post_raw(http, "/v1/completions", raw), 400, code="invalid_json")
    # a pair of surrogate escapes is one character and fine
    r = post_raw(http, "/v1/completions", b'{"model": "tiny-llama", "prompt": "smile \\ud83d\\ude00", '
                                          b'"max_tokens": 2}')
    assert r.status_code == 200, r.text
    assert_healthy(live, http)


def test_bodies_that_are_not_requests_are_400(live, http):
    for raw in (b"", b"null", b"[]", b'"prompt"', b"{", b"[" * 30000 + b"]" * 30000,
                b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"model": "tiny-llama", "prompt": 1' + b"0" * 5000
                + b"}"):
        r = post_raw(http, "/v1/completions", raw)
        assert_error(r, 400)
    assert_healthy(live, http)


def test_unexpected_exceptions_are_a_generic_500_logged_once(live, http, caplog, monkeypatch):
    def broken(prompt, *args):
        raise RuntimeError("secret internal detail /home/user/model.bin")

    monkeypatch.setattr(live.engine.inputs, "encode", broken)
    with caplog.at_level(logging.ERROR):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    err = assert_error(r, 500, code="internal_error")
    assert err["type"] == "server_error"
    assert "secret" not in r.text and "RuntimeError" not in r.text
    logged = [rec for rec in caplog.records if rec.exc_info and "secret" in str(rec.exc_info[1])]
    assert len(logged) == 1, [rec.getMessage() for rec in caplog.records]
    monkeypatch.undo()
    assert_healthy(live, http)


# --- 4. HTTP limits ------------------------------------------------------------------------------

def test_request_size_limit_is_413(live, http):
    big = json.dumps({"model": MODEL, "prompt": "x" * (MAX_BYTES + 10)}).encode()
    err = assert_error(post_raw(http, "/v1/completions", big), 413, code="request_too_large")
    assert str(MAX_BYTES) in err["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(MAX_BYTES // 4096 + 2):
            yield b"x" * 4096
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, code="request_too_large")
    # an absurd Content-Length is refused at once, before any body byte arrives
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {10 ** 15}\r\n\r\n").encode()
    got, took = raw_exchange(live.port, head, wait=5)
    assert got.startswith(b"HTTP/1.1 413") and took < 2
    assert_healthy(live, http)


def test_a_body_that_stops_arriving_is_408(live, http):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    got, took = raw_exchange(live.port, head + b'{"model": "tiny-llama", ', wait=READ_TIMEOUT + 5)
    assert got.startswith(b"HTTP/1.1 408"), got
    assert b'"request_timeout"' in got and READ_TIMEOUT * 0.9 <= took < READ_TIMEOUT + 2  # and closed
    assert_healthy(live, http)


def test_headers_that_stop_arriving_are_408(live, http):
    for partial in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"):
        got, took = raw_exchange(live.port, partial, wait=READ_TIMEOUT + 5)
        assert got.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in got, got
        assert took < READ_TIMEOUT + 2  # the server closed it
    # a keep-alive connection is answered, then its next request's headers get the same deadline
    with socket.create_connection(("127.0.0.1", live.port), timeout=READ_TIMEOUT + 5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /hea")
        start = time.monotonic()
        rest = b""
        while chunk := s.recv(65536):
            rest += chunk
        assert rest.startswith(b"HTTP/1.1 408") and time.monotonic() - start < READ_TIMEOUT + 2
    assert_healthy(live, http)


def test_prompt_too_long_in_characters_is_refused_without_tokenizing(live, http, monkeypatch):
    server = live.app.state.rose
    calls = []
    real = live.engine.inputs.encode
    monkeypatch.setattr(live.engine.inputs, "encode", lambda text, *a: calls.append(len(text)) or real(text, *a))
    real_chat = live.engine.tokenizer.apply_chat_template
    monkeypatch.setattr(live.engine.tokenizer, "apply_chat_template",
                        lambda messages, **kw: calls.append("chat") or real_chat(messages, **kw))
    text = "a" * (server.max_prompt_chars + 1)
    assert len(json.dumps({"prompt": text})) < MAX_BYTES  # under the size limit: this check refuses it
    err = assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": text}), 400, "prompt",
                       "context_length_exceeded")
    assert str(live.engine.max_model_len) in err["message"]
    parts = [{"type": "text", "text": text[:20000]}, {"type": "text", "text": text[20000:]}]
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": parts}]}), 400, "messages", "context_length_exceeded")
    many = [{"role": "user", "content": ""}] * (live.engine.max_model_len + 1)
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": many}), 400, "messages",
                 "context_length_exceeded")
    assert calls == []
    # at the bound itself the prompt is tokenized (and then found too long in tokens)
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": text[:-1]}), 400, "prompt",
                 "context_length_exceeded")
    assert calls == [len(text) - 1]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and calls[-1] == "chat"  # the spy does see the template rendered


def test_one_slow_prompt_does_not_hold_the_others(live, http, monkeypatch):
    real = live.engine.inputs.encode
    release = threading.Event()

    def encode(text, *args):
        if text.startswith("SLOW"):
            release.wait(10)
        return real(text, *args)

    monkeypatch.setattr(live.engine.inputs, "encode", encode)
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(http.post, "/v1/completions", json={"model": MODEL, "prompt": "SLOW prompt",
                                                               "max_tokens": 2})
        time.sleep(0.2)
        start = time.monotonic()
        fast = http.post("/v1/completions", json={"model": MODEL, "prompt": "quick", "max_tokens": 2})
        took = time.monotonic() - start
        assert fast.status_code == 200 and not slow.done() and took < 2
        release.set()
        assert slow.result().status_code == 200


# --- 6. a client that goes away ----------------------------------------------------------------

def _kv_used(http) -> float:
    return metrics(http)[("rose_kv_blocks_used", frozenset())]


@pytest.mark.parametrize("stream", [False, True])
def test_client_gone_frees_kv_within_a_step(live, http, monkeypatch, stream):
    real_step = live.engine.scheduler.step

    def slow_step():  # a step as slow as a big model's, so the request outlives the checks below
        time.sleep(0.01)
        return real_step()

    monkeypatch.setattr(live.engine.scheduler, "step", slow_step)
    before = metrics(http)[("rose_requests_total", frozenset({("finish_reason", "abort")}))]
    body = json.dumps({"model": MODEL, "prompt": "A long story: " * 20, "max_tokens": 380, "stream": stream,
                       "temperature": 0, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", live.port))
    s.sendall(head + body)
    deadline = time.monotonic() + 10
    while _kv_used(http) == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    time.sleep(0.1)
    s.close()
    gone = time.monotonic()
    while True:
        m = metrics(http)
        if m[("rose_kv_blocks_used", frozenset())] == 0 and m[("rose_num_requests_running", frozenset())] == 0:
            break
        assert time.monotonic() - gone < 1.0, "KV blocks still held 1 s after the client went away"
        time.sleep(0.01)
    assert m[("rose_requests_total", frozenset({("finish_reason", "abort")}))] == before + 1
