"""Shutting down and starting up `rose serve-local`: SIGTERM drains (503 for new requests, running
ones finish within --shutdown-timeout, the rest end with an error event and [DONE]), exits 0 with no
traceback; a port already in use fails at once, before the model loads; --chat-template is used, or a bad one fails
start-up in one line."""

from __future__ import annotations

import pytest

# the server's optional extras (rosecli[serve]) and the test clients: absent on a bare GPU image
for _extra in ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client"):
    pytest.importorskip(_extra)

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from test_server import MODEL, LiveServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 450, "temperature": 0, "ignore_eos": True}


def sse_events(r: httpx.Response):
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def test_drain_then_end_open_streams(cache_dir, caplog):
    srv = LiveServer(cache_dir, shutdown_timeout=1.0)
    real_step = srv.engine.scheduler.step

    def slow_step():  # a big model's step time: the long requests outlive the shutdown timeout
        time.sleep(0.01)
        return real_step()

    srv.engine.scheduler.step = slow_step
    started = threading.Event()

    def long_stream():
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={**LONG, "stream": True, "n": 2}) as r:
                events = []
                for event in sse_events(r):
                    events.append(event)
                    started.set()
                return r.status_code, events

    try:
        with caplog.at_level(logging.INFO), ThreadPoolExecutor(4) as pool:
            stream = pool.submit(long_stream)
            assert started.wait(20)
            long_plain = pool.submit(httpx.post, srv.url + "/v1/completions", json=LONG, timeout=30)
            short_plain = pool.submit(httpx.post, srv.url + "/v1/completions",
                                      json={**LONG, "max_tokens": 20}, timeout=30)
            deadline = time.monotonic() + 20
            while srv.app.state.rose.active < 3:  # all three are in
                assert time.monotonic() < deadline
                time.sleep(0.01)
            srv.server.should_exit = True  # what SIGTERM does
            time.sleep(0.3)
            with httpx.Client(base_url=srv.url, timeout=10) as c:
                health = c.get("/health")
                assert health.status_code == 503 and health.json()["status"] == "shutting_down"
                r = c.post("/v1/completions", json={"model": MODEL, "prompt": "new", "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            status, events = stream.result(timeout=20)
            assert status == 200 and events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "shutting_down" and events[-2]["error"]["type"] == "server_error"
            # each choice still open gets its last chunk (n=2: both)
            assert [(e["choices"][0]["index"], e["choices"][0]["finish_reason"]) for e in events[-4:-2]] == \
                [(0, "abort"), (1, "abort")]
            assert all(e["choices"][0]["finish_reason"] is None for e in events[:-4])
            assert short_plain.result(timeout=20).status_code == 200  # finished within the timeout
            late = long_plain.result(timeout=20)
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        srv.thread.join(timeout=20)
        assert not srv.thread.is_alive()
        logged = "\n".join(r.getMessage() + (str(r.exc_info) if r.exc_info else "") for r in caplog.records)
        assert "Cancel" not in logged and "Exception in ASGI" not in logged and "Traceback" not in logged
        assert srv.engine.scheduler.block_manager.num_used_blocks == 0
    finally:
        srv.stop()


def _serve(cache_dir: str, port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rosecli", "serve-local", "--model", MODEL, "--load-format", "dummy",
           "--device", "cpu", "--cache-dir", cache_dir, "--host", "127.0.0.1", "--port", str(port), *extra]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("mode", ["in-process", "engine-process"])
def test_sigterm_ends_streams_cleanly_and_exits_0(cache_dir, mode):
    """With the engine in the server process or in its own: SIGTERM drains, ends the open streams
    with an error event and [DONE], exits 0, and leaves no engine process behind."""
    port = _free_port()
    extra = ("--engine-process",) if mode == "engine-process" else ("--no-engine-process",)
    proc = _serve(cache_dir, port, "--shutdown-timeout", "0.2", *extra)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        first = threading.Barrier(5)

        def stream():
            with httpx.Client(base_url=url, timeout=30) as c:
                with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                    lines = r.iter_lines()
                    got = [next(lines)]
                    first.wait(20)
                    got += list(lines)
            return [line for line in got if line]

        children = [c for c in _children(proc.pid) if os.path.exists(f"/proc/{c}")]
        if mode == "engine-process" and sys.platform.startswith("linux"):
            assert children, "the engine should run in a child process"
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream) for _ in range(4)]
            first.wait(20)
            proc.send_signal(signal.SIGTERM)
            ends = [s.result(timeout=30) for s in streams]
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        # the engine process (and multiprocessing's resource tracker, which sees the server's pipe
        # close a moment after it exits) are gone within a few seconds
        deadline = time.monotonic() + 10
        for child in children:
            while _running(child):
                assert time.monotonic() < deadline, f"process {child} outlived the server"
                time.sleep(0.05)
        assert "Traceback" not in err and "CancelledError" not in err and "Cancel " not in err, err
        for lines in ends:
            assert lines[-1] == "data: [DONE]"
            last = json.loads(lines[-2][len("data: "):])
            assert last["error"]["code"] == "shutting_down", lines[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_port_in_use_fails_before_loading_the_model(cache_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = _serve(cache_dir, port)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"port {port}" in lines[0] and "in use" in lines[0], err


def test_chat_template_flag_replaces_the_models_and_a_bad_one_fails_at_start_up(cache_dir, tmp_path):
    """``--chat-template FILE`` (vLLM's flag): the conversation renders through it (/tokenize shows it, chat answers
    with it); a template that cannot render one message ends start-up with one line and exit status 1."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}<<assistant>>{% endif %}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _serve(cache_dir, port, "--chat-template", str(template))
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.2)
        msgs = [{"role": "user", "content": "Hi"}]
        ids = httpx.post(url + "/tokenize", json={"messages": msgs}, timeout=10).json()["tokens"]
        text = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=10).json()["prompt"]
        assert text == "<<user>>Hi<<assistant>>"
        r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    proc = _serve(cache_dir, port, "--chat-template", "{{ raise_exception('no system prompt') }}")
    out, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("Loading", "INFO"))]
    assert proc.returncode == 1 and lines[-1].startswith("error: --chat-template:") and "no system prompt" in lines[-1]
    assert "Traceback" not in err
    proc = _serve(cache_dir, port, "--chat-template", str(tmp_path / "missing.jinja"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "no such file" in err and "Traceback" not in err

