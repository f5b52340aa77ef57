"""`rose bench serve`: the HTTP/SSE benchmark client. Metric math on hand-made timestamps, then end
to end against a real `rose serve-local` app on uvicorn (tiny dummy Llama, loopback free port) and
against a misbehaving stub server (429, 401, 503, a stream cut mid-way)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading

import pytest

from rosecli.bench import metrics
from rosecli.bench.datasets import arrival_offsets
from rosecli.bench.metrics import HttpTiming, summarize_serve_run

# --- metric math, hand-computed ------------------------------------------------------------------


def _t(i, start, events, out, asked=None, ok=True, kind=None, prompt=10):
    return HttpTiming(i, prompt, out, asked if asked is not None else out, start, start, start, events, ok,
                      kind, None if ok else f"request {i}: boom", ok)


def test_serve_metrics_by_hand():
    timings = [
        # first event is the empty first chunk: TTFT ends there (0.1), E2EL at the last event (0.4)
        _t(0, 0.0, [0.1, 0.2, 0.4], out=3),
        _t(1, 0.05, [0.3], out=1),  # one token: no TPOT (0 for goodput)
        _t(2, 0.1, [], out=0, ok=False, kind="http_429"),
    ]
    m = summarize_serve_run(timings, 0.0, 0.5, percentiles=(50, 90))
    assert (m.requests, m.completed, m.failed) == (3, 2, 1)
    assert m.failure_kinds == {"http_429": 1}
    assert m.throughput_requests == pytest.approx(2 / 0.5)
    assert m.throughput_completion == pytest.approx(4 / 0.5)
    assert m.throughput_total == pytest.approx((20 + 4) / 0.5)
    ttft, tpot, itl, e2el = (m.dists[k] for k in ("ttft", "tpot", "itl", "latency"))
    assert ttft.pcts["p50"] == pytest.approx(0.175) and ttft.pcts["p90"] == pytest.approx(0.1 + 0.9 * 0.15)
    assert ttft.mean == pytest.approx(0.175) and ttft.std == pytest.approx(0.075)
    assert tpot.count == 1 and tpot.mean == pytest.approx((0.4 - 0.1) / 2) and m.tpot_left_out == 1
    assert itl.count == 2 and itl.mean == pytest.approx(0.15) and itl.std == pytest.approx(0.05)
    assert e2el.pcts["p50"] == pytest.approx((0.4 + 0.25) / 2)
    assert m.peak_output == 4 and m.peak_concurrency == 2
    assert math.isnan(m.goodput_requests)


def test_goodput_as_vllm():
    timings = [_t(0, 0.0, [0.1, 0.2, 0.4], out=3), _t(1, 0.05, [0.3], out=1),
               _t(2, 0.1, [], out=0, ok=False, kind="timeout")]
    slo = metrics.parse_goodput(["ttft:200 tpot:100"])
    assert slo == {"ttft": 0.2, "tpot": 0.1}
    m = summarize_serve_run(timings, 0.0, 0.5, goodput=slo)  # request 0: TPOT 150 ms; request 1: TTFT 250 ms
    assert m.goodput_requests == 0 and m.goodput_share == 0
    m = summarize_serve_run(timings, 0.0, 0.5, goodput=metrics.parse_goodput(["tpot:200,e2el:1000"]))
    assert m.goodput_requests == pytest.approx(2 / 0.5) and m.goodput_share == pytest.approx(2 / 3)
    flat = metrics.serve_flatten(m)
    assert flat["throughput_goodput"] == pytest.approx(4.0) and flat["latency_p50"] == pytest.approx(0.325)
    for bad in (["ttft"], ["speed:5"], ["ttft:-1"], ["tpot:abc"]):
        with pytest.raises(Exception, match="--goodput"):
            metrics.parse_goodput(bad)


def test_short_outputs_and_percentile_parsing():
    timings = [_t(0, 0.0, [0.1, 0.2], out=2, asked=8), _t(1, 0.0, [0.1, 0.2], out=8, asked=8)]
    assert summarize_serve_run(timings, 0.0, 1.0, expect_full_outputs=True).short_outputs == 1
    assert summarize_serve_run(timings, 0.0, 1.0, expect_full_outputs=False).short_outputs == 0
    assert metrics.parse_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
    assert metrics.pct_key(99.9) == "p99.9"
    with pytest.raises(Exception, match="--metric-percentiles"):
        metrics.parse_percentiles("50,101")


def test_a_busy_client_is_reported():
    """The client's CPU time over the run is reported, and a client busy 90% of a core or more
    warns that it may be what limits the figures."""
    from rosecli.bench.report import serve_warnings

    timings = [_t(0, 0.0, [0.1, 0.2], out=2, asked=2)]
    idle = summarize_serve_run(timings, 0.0, 2.0, client_cpu_s=0.5)
    assert idle.client_cpu == pytest.approx(0.25) and metrics.serve_flatten(idle)["client_cpu_share"] == 0.25
    assert not any("Client busy" in w for w in serve_warnings(idle))
    busy = summarize_serve_run(timings, 0.0, 2.0, client_cpu_s=1.9)
    assert any("Client busy: this client used 95%" in w for w in serve_warnings(busy))


def test_arrivals_poisson_and_gamma_rescaled_to_the_rate():
    assert arrival_offsets(4, None) == [0.0] * 4
    for burstiness in (1.0, 0.5, 4.0):
        due = arrival_offsets(50, 10.0, burstiness, seed=1)
        assert due == sorted(due) and due[-1] == pytest.approx(5.0)  # the last is due at n / rate
    assert arrival_offsets(4, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(Exception, match="--burstiness"):
        arrival_offsets(4, 2.0, 0.0)


class _FakeResponse:
    def __init__(self, chunks):
        self.chunks = chunks

    async def aiter_bytes(self):
        for c in self.chunks:
            yield c


def test_sse_parsing_empty_first_chunk_usage_and_cut_stream(monkeypatch):
    from rosecli.bench import http_client

    clock = iter([1.0, 1.5, 2.0, 2.5, 3.0])
    monkeypatch.setattr(http_client.time, "perf_counter", lambda: next(clock))
    ev = lambda obj: f"data: {json.dumps(obj)}\n\n".encode()  # noqa: E731
    chunks = [b": ping\n\n" + ev({"choices": [{"text": ""}]}),  # empty first chunk at t=1.0, after a comment
              ev({"choices": [{"text": "a"}]}) + ev({"choices": [{"text": "b"}]}),  # one read: both at t=1.5
              ev({"choices": [{"text": "", "finish_reason": "length"}]}),
              ev({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}) + b"data: [DONE]\n\n"]
    t = HttpTiming(0, 0, 0, 3, 0.0, 0.0, 0.5)
    asyncio.run(http_client._read_stream(_FakeResponse(chunks), t, chat=False))
    assert t.event_times == [1.0, 1.5, 1.5, 2.0] and t.ttft == 0.5 and t.e2el == 1.5
    assert (t.output_tokens, t.prompt_tokens, t.usage_reported) == (3, 7, True)
    assert t.tpot == pytest.approx((1.5 - 0.5) / 2)  # (E2EL - TTFT) / (usage tokens - 1)
    t = HttpTiming(0, 0, 0, 3, 0.0, 0.0, 0.5)
    clock = iter([1.0, 1.5])
    with pytest.raises(http_client._Failed) as e:
        asyncio.run(http_client._read_stream(_FakeResponse([ev({"choices": [{"text": "a"}]})]), t, chat=False))
    assert e.value.kind == "server_gone"


# --- end to end ----------------------------------------------------------------------------------

for _extra in ("fastapi", "uvicorn", "httpx", "prometheus_client"):
    pytest.importorskip(_extra)

from typer.testing import CliRunner  # noqa: E402

from rosecli.commands.main import app  # noqa: E402

runner = CliRunner()
KEY = "sk-bench"


@pytest.fixture(scope="module")
def live(cache_dir):
    from test_server import LiveServer

    srv = LiveServer(cache_dir, api_key=KEY)
    yield srv
    srv.stop()


def _serve(url, *extra, key=KEY):
    return runner.invoke(app, ["bench", "serve", "--base-url", url, "--api-key", key, *extra])


def test_random_dataset_goodput_concurrency_save_and_compare_with_stream(live, cache_dir, tmp_path):
    path = tmp_path / "serve.json"
    r = _serve(live.url, "--num-prompts", "6", "--input-len", "12", "--output-len", "5", "--max-concurrency", "2",
               "--warmup-runs", "1", "--repeat-runs", "2", "--goodput", "ttft:60000 tpot:60000",
               "--metric-percentiles", "50,90,99", "--save-result", str(path))
    assert r.exit_code == 0, r.output
    out = r.output
    assert "warmup (not measured)" in out and "=== run 2/2 ===" in out
    assert "Serving Benchmark Result" in out and "Successful requests:                     12" in out
    assert "Request goodput (req/s):" in out and "Requests meeting every SLO (%):          100.00" in out
    assert "P90 TTFT (ms):" in out and "Client-side Queueing" in out and "Short outputs" not in out
    doc = json.loads(path.read_text())
    assert doc["kind"] == "serve" and doc["config"]["base_url"] == live.url and "api_key" not in doc["config"]
    assert [run["warmup"] for run in doc["runs"]] == [True, False, False]
    recs = doc["requests"][0]
    assert len(recs) == 6 and all(rec["success"] and rec["output_tokens"] == 5 for rec in recs)
    assert all(rec["prompt_tokens"] == 12 for rec in recs)  # ids sent as ids: the server counts exactly 12
    peak = max(run["counts"]["peak_concurrency"] for run in doc["runs"])
    assert peak <= 2
    s = doc["summary"]
    assert s["throughput_completion"] > 0 and s["goodput_share"] == 1.0 and s["ttft_p90"] >= s["ttft_p50"] > 0
    stream = tmp_path / "stream.json"
    r = runner.invoke(app, ["bench", "stream", "--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
                            "--cache-dir", cache_dir, "--no-stop-on-eos", "--num-requests", "4",
                            "--max-new-tokens", "5", "--goodput", "ttft:60000", "--save-result", str(stream)])
    assert r.exit_code == 0, r.output
    assert "Request goodput (ttft <= 60000 ms): " in r.output and "100.0% of requests met every SLO" in r.output
    r = runner.invoke(app, ["bench", "compare", str(stream), str(path)])
    assert r.exit_code == 0, r.output
    assert "TTFT p50" in r.output and "Throughput (completion)" in r.output


def test_prefix_dataset_on_chat_and_sharegpt(live, cache_dir, tmp_path):
    tok = f"{cache_dir}/tokenizers/smollm2"
    r = _serve(live.url, "--endpoint", "/v1/chat/completions", "--dataset", "prefix", "--prefix-groups", "2",
               "--prefix-len", "24", "--input-len", "4", "--output-len", "3", "--num-prompts", "4",
               "--tokenizer", tok, "--request-rate", "200", "--burstiness", "0.5")
    assert r.exit_code == 0, r.output
    assert "Successful requests:                     4" in r.output
    assert "Request rate configured (RPS):           200.00" in r.output and "Request rate achieved" in r.output
    data = [{"conversations": [{"from": "human", "value": "Tell me a story about a brave little fox please."},
                               {"from": "gpt", "value": "Once upon a time there was a fox who was brave."}]},
            {"conversations": [{"from": "human", "value": "only one turn"}]},
            {"conversations": [{"from": "human", "value": "What is the capital city of France, and why?"},
                               {"from": "gpt", "value": "Paris is the capital of France since long ago."}]}]
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps(data))
    r = _serve(live.url, "--dataset", "sharegpt", "--dataset-path", str(sharegpt), "--tokenizer", tok,
               "--num-prompts", "3")
    assert r.exit_code == 0, r.output
    assert "Successful requests:                     3" in r.output
    r = _serve(live.url, "--dataset", "sharegpt", "--dataset-path", str(tmp_path / "missing.json"))
    assert r.exit_code == 2 and "missing.json is not a file" in r.output


def test_sampling_options_reach_the_server(live, monkeypatch):
    seen = []
    add_request = live.manager.add_request

    def recording(prompt, params=None, **kw):
        seen.append(params)
        return add_request(prompt, params, **kw)

    monkeypatch.setattr(live.manager, "add_request", recording)
    r = _serve(live.url, "--num-prompts", "2", "--input-len", "6", "--output-len", "3", "--temperature", "0.8",
               "--top-p", "0.9", "--top-k", "5", "--min-p", "0.1", "--presence-penalty", "0.5",
               "--frequency-penalty", "-0.5", "--repetition-penalty", "1.1")
    assert r.exit_code == 0, r.output
    assert ("Sampling sent: temperature 0.8, top_p 0.9, top_k 5, min_p 0.1, presence_penalty 0.5, "
            "frequency_penalty -0.5, repetition_penalty 1.1 ") in " ".join(r.output.split()) + " "
    assert len(seen) == 2 and {(p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty,
                                p.repetition_penalty, p.min_tokens, p.stop_on_eos) for p in seen} == \
        {(0.8, 0.9, 5, 0.1, 0.5, -0.5, 1.1, 3, False)}
    seen.clear()
    r = _serve(live.url, "--num-prompts", "1", "--input-len", "6", "--output-len", "3")
    assert r.exit_code == 0, r.output
    # the defaults are not sent: the server's own apply
    assert "Sampling sent: temperature 0 " in " ".join(r.output.split())
    p = seen[0]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.0, 1.0, 0, 0.0, 1.0)
    r = _serve(live.url, "--num-prompts", "1", "--min-p", "2")
    assert r.exit_code == 2 and "--min-p must be in [0, 1]" in r.output


def test_wrong_key_and_no_server_fail_before_the_run(live):
    r = _serve(live.url, "--num-prompts", "2", key="sk-wrong")
    assert r.exit_code == 2 and "refused the API key (HTTP 401" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        r = _serve(f"http://127.0.0.1:{port}", "--num-prompts", "2")
    assert r.exit_code == 2 and "no server answers at" in r.output and len(r.output.strip().splitlines()) == 1


def test_real_429_from_an_overloaded_server_is_counted(cache_dir):
    from test_server import LiveServer

    srv = LiveServer(cache_dir, max_inflight_requests=1)  # --overload reject: 429 beyond one request
    try:
        r = runner.invoke(app, ["bench", "serve", "--base-url", srv.url, "--num-prompts", "6", "--input-len", "8",
                                "--output-len", "6"])
    finally:
        srv.stop()
    assert r.exit_code == 0, r.output
    assert "http_429 (first: request" in r.output and "Failed requests: " in r.output
    assert "Traceback" not in r.output


# --- a stub server that misbehaves in every way a real one can -------------------------------------

def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class StubServer:
    """HTTP/1.1 on a free loopback port; the i-th POST gets SCRIPT[i]."""

    SCRIPT = ["ok", "429", "401", "503", "cut", "one"]

    def __init__(self):
        self.n = 0
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self.handle, sock=self.sock))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(10)

    async def handle(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        if head.startswith(b"GET /v1/models"):
            body = json.dumps({"data": [{"id": "stub"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
        else:
            what = self.SCRIPT[self.n % len(self.SCRIPT)]
            self.n += 1
            if what in ("429", "401", "503"):
                body = json.dumps({"error": {"message": f"stub says {what}"}}).encode()
                writer.write(b"HTTP/1.1 %s X\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (what.encode(), len(body), body))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
                writer.write(_sse({"choices": [{"text": ""}]}))  # an empty first chunk
                await writer.drain()
                if what == "cut":
                    writer.write(_sse({"choices": [{"text": "x"}]}))  # then the server goes away
                else:
                    tokens = 1 if what == "one" else 3
                    for _ in range(tokens - 1):
                        writer.write(_sse({"choices": [{"text": "x"}]}))
                    writer.write(_sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": tokens}}))
                    writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_every_failure_kind_is_counted_and_reported(tmp_path):
    stub = StubServer()
    path = tmp_path / "stub.json"
    try:
        r = runner.invoke(app, ["bench", "serve", "--base-url", stub.url, "--num-prompts", "6", "--output-len", "3",
                                "--input-len", "4", "--max-concurrency", "1", "--save-result", str(path)])
    finally:
        stub.stop()
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    assert "Failed requests: 4 of 6 in the measured runs" in r.output
    for kind in ("http_429", "http_401", "http_5xx", "server_gone"):
        assert f"1 {kind} (first: request" in r.output, r.output
    assert "stub says 429" in r.output
    # "one": asked 3, got 1 although ignore_eos was sent
    assert "Short outputs: 1 of 2 completed requests" in r.output
    doc = json.loads(path.read_text())
    counts = doc["runs"][0]["counts"]
    assert counts["completed"] == 2 and counts["failed"] == 4
    assert counts["failure_kinds"] == {"http_429": 1, "http_401": 1, "http_5xx": 1, "server_gone": 1}
    assert doc["summary"]["tpot_p50"] is not None  # the 3-token request has a TPOT, the 1-token one not
