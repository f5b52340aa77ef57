"""`rose serve-local --engine-process`: the engine in a spawned child process, the server doing
HTTP only. Same answers as the engine in process; the child's death, a client going away and
an overload are handled as in process; nothing is left running."""

from __future__ import annotations

import pytest

for _extra in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_extra)

import json
import threading
import time

import httpx

from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.server.app import create_app
from rosecli.server.engine_process import start_engine_process
from rosecli.server.uvicorn_server import bind_socket, make_server

MODEL = "tiny-llama"


class RemoteServer:
    def __init__(self, cache_dir: str, **engine_kw):
        self.config = EngineConfig(model=MODEL, load_format="dummy", device="cpu", cache_dir=cache_dir,
                                   show_progress=False, **engine_kw)
        self.manager, self.engine = start_engine_process(self.config)
        self.app = create_app(self.manager, self.engine, served_model_name=MODEL)
        # bound as `rose serve-local` binds its port: a TCP socket (proto IPPROTO_TCP), whose connections
        # asyncio sets TCP_NODELAY on; on a plain socket.socket() (proto 0) it does not, and a response
        # written as headers then body waited ~40 ms for the client's delayed ACK
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make_server(self.app, read_timeout=30, shutdown_timeout=2, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.manager.close()
        assert not self.manager._proc.is_alive()


@pytest.fixture(scope="module")
def remote(cache_dir):
    srv = RemoteServer(cache_dir, max_inflight_requests=4)
    yield srv
    srv.stop()


def _stream_texts(http: httpx.Client, body: dict) -> list:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_answers_equal_the_engine_in_process(remote, cache_dir):
    from rosecli.engine.llm import LLMEngine

    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=remote.url, timeout=60) as http:
        before = http.get("/roofline").json()
        whole = http.post("/v1/completions", json=body).json()
        chunks = _stream_texts(http, body)
        assert http.get("/health").json()["status"] == "ok"
        after = http.get("/roofline").json()  # the engine's decode counts, from its process
    assert after["decode_steps"] >= before["decode_steps"] + 2 * 11 and after["weight_bytes_per_step"] > 0
    local = LLMEngine(EngineConfig(model=MODEL, load_format="dummy", device="cpu", cache_dir=cache_dir,
                                   show_progress=False))
    try:
        want = local.generate(["The capital of France is"],
                              SamplingParams(max_new_tokens=12, temperature=0, stop_on_eos=False))[0]
    finally:
        local.close()
    assert whole["choices"][0]["text"] == want.text
    assert whole["usage"]["completion_tokens"] == 12
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text


def test_logprobs_echo_and_n_cross_the_pipe(remote):
    body = {"model": MODEL, "prompt": "Tell me", "max_tokens": 4, "temperature": 1.0, "seed": 11,
            "ignore_eos": True, "logprobs": 1}
    with httpx.Client(base_url=remote.url, timeout=60) as http:
        r = http.post("/v1/completions", json={**body, "n": 3}).json()
        assert [c["index"] for c in r["choices"]] == [0, 1, 2] and r["usage"]["completion_tokens"] == 12
        for i, choice in enumerate(r["choices"]):  # choice i: seed + i
            alone = http.post("/v1/completions", json={**body, "seed": 11 + i}).json()["choices"][0]
            assert alone["text"] == choice["text"] and alone["logprobs"]["tokens"] == choice["logprobs"]["tokens"]
        chunks = _stream_texts(http, {**body, "echo": True})
        lp = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
        assert lp[0]["token_logprobs"][0] is None and chunks[0]["choices"][0]["text"].startswith("Tell me")
        assert "".join(t for x in lp for t in x["tokens"]) == "".join(c["choices"][0]["text"] for c in chunks)
        err = http.post("/v1/completions", json={**body, "n": 65}).json()["error"]  # beyond the batch of 64
        assert err["param"] == "n"
        batch = http.post("/v1/completions", json={**body, "prompt": ["Tell me", "Say"], "n": 2}).json()
        assert [c["text"] for c in batch["choices"][:2]] == [c["text"] for c in r["choices"][:2]]  # prompt 0
        err = http.post("/v1/completions", json={**body, "prompt": ["a"] * 3, "n": 2}).json()["error"]
        assert err["param"] == "prompt" and "--max-inflight-requests 4" in err["message"]  # 6 could never run
        r = http.post("/v1/completions", json={**body, "n": 5})  # nor could 5 choices: a 400, not a 429 to retry
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_bad_requests_and_overload_are_answered_in_the_server_process(remote):
    with httpx.Client(base_url=remote.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [10 ** 9], "max_tokens": 2})
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
        # four long requests fill --max-inflight-requests 4: the fifth is refused with 429
        long = {"model": MODEL, "prompt": "a", "max_tokens": 400, "ignore_eos": True, "stream": True}
        opened = [http.stream("POST", "/v1/completions", json=long) for _ in range(4)]
        responses = [cm.__enter__() for cm in opened]
        try:
            assert all(r.status_code == 200 for r in responses)
            assert http.post("/v1/completions", json={**long, "stream": False}).status_code == 429
        finally:
            for cm in opened:  # the clients go away mid-stream: the engine frees their blocks
                cm.__exit__(None, None, None)
    deadline = time.monotonic() + 30
    while remote.manager.stats()["kv_blocks_used"] or remote.manager.stats()["running"]:
        assert time.monotonic() < deadline, remote.manager.stats()
        time.sleep(0.05)
    # nor does the server's side keep the outputs of the requests it aborted (nobody takes them)
    while remote.manager._outputs:
        assert time.monotonic() < deadline, list(remote.manager._outputs)
        time.sleep(0.05)


def test_a_dead_engine_process_is_reported_and_ends_every_stream(cache_dir):
    srv = RemoteServer(cache_dir)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            body = {"model": MODEL, "prompt": "a", "max_tokens": 480, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[len("data: "):])["choices"]
                srv.manager._proc.kill()  # the engine dies mid-stream
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "engine_dead"
            deadline = time.monotonic() + 10
            while http.get("/health").status_code != 503:
                assert time.monotonic() < deadline, "/health did not report the dead engine"
                time.sleep(0.05)
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2})
            assert r.status_code == 503
    finally:
        srv.stop()


def test_a_request_error_that_cannot_cross_the_pipe_still_ends_its_request():
    """A request's error is pickled to the server: one that cannot be (it holds a lock, say)
    becomes RequestFailedError, so that request still ends and the pipe keeps serving the rest;
    a RequestError keeps the field it names."""
    from rosecli.engine.errors import RequestError, RequestFailedError
    from rosecli.server.engine_process import _portable

    kept = _portable(RequestError("bad messages", "messages"))
    assert isinstance(kept, RequestError) and kept.param == "messages"

    class HoldsALock(Exception):
        def __init__(self):
            super().__init__("x")
            self.lock = threading.Lock()

    assert isinstance(_portable(HoldsALock()), RequestFailedError)
