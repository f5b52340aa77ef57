"""`rose bench serve --client-processes N`: the requests split over N client processes give the
same counts and sane timings as one, --max-concurrency stays a global cap, the live table moves,
and a client process that dies fails the run in one line with no process left behind. Against a
small raw-asyncio SSE server (a completions endpoint streaming max_tokens events, usage, [DONE])."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import socket
import threading

import pytest

pytest.importorskip("httpx")

from rosecli.bench import http_client  # noqa: E402
from rosecli.bench.datasets import ServeRequest  # noqa: E402
from rosecli.bench.serve import bench_serve  # noqa: E402


class SSEServer:
    """HTTP/1.1 on a free loopback port: GET /v1/models, and POST /v1/completions streaming one
    event per asked token (``delay`` s apart), then usage and ``data: [DONE]``. Counts the
    requests it is streaming at once (``peak``)."""

    def __init__(self, delay: float = 0.0):
        self.delay, self.live, self.peak, self.posts = delay, 0, 0, 0
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(asyncio.start_server(self.handle, sock=self.sock))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)

    async def handle(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            body = await reader.readexactly(length)
            if head.startswith(b"GET /v1/models"):
                out = json.dumps({"data": [{"id": "fake"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(out), out))
                return
            n = json.loads(body)["max_tokens"]
            self.posts += 1
            self.live += 1
            self.peak = max(self.peak, self.live)
            try:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
                for _ in range(n):
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    writer.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
                    await writer.drain()
                usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}}
                writer.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            finally:
                self.live -= 1
            await writer.drain()
        finally:
            writer.close()

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Table:
    """The live table's calls, recorded."""

    def __init__(self, on_update=None):
        self.updates, self.runs, self.on_update = [], [], on_update

    def start_run(self, label, warmup):
        self.runs.append(label)
        self.updates.append([])

    def update(self, finished, total, tokens, elapsed):
        self.updates[-1].append((finished, total, tokens, elapsed))
        if self.on_update is not None:
            self.on_update()

    def finish_run(self, m):
        pass


def _requests(n, out):
    return [ServeRequest(f"prompt {i}", 5, out) for i in range(n)]


@pytest.fixture
def server():
    srv = SSEServer(delay=0.01)
    yield srv
    srv.stop()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _spy_starts(monkeypatch) -> list:
    """The pids of every ProcessClients started, one list per start."""
    starts, real_enter = [], http_client.ProcessClients.__aenter__

    async def enter(self):
        await real_enter(self)
        starts.append(self.pids)
        return self

    monkeypatch.setattr(http_client.ProcessClients, "__aenter__", enter)
    return starts


def test_two_processes_give_the_counts_and_timings_of_one(server, monkeypatch):
    starts = _spy_starts(monkeypatch)
    target = http_client.Target(server.url, model="fake")
    reqs, offsets = _requests(8, 12), [0.0] * 8
    out, tables = {}, {}
    for n in (1, 2):
        tables[n] = Table()
        out[n] = bench_serve(target, reqs, offsets, 1, 2, tables[n], client_processes=n, roofline=False)
    for n in (1, 2):
        runs = out[n]["runs"]
        assert [r["label"] for r in runs] == ["warmup 1/1", "run 1/2", "run 2/2"]
        for r in runs:
            c = r["counts"]
            assert (c["requests"], c["completed"], c["failed"]) == (8, 8, 0)
            assert (c["prompt_tokens"], c["completion_tokens"]) == (8 * 5, 8 * 12)
            f = r["figures"]
            assert 0 < f["ttft_mean"] <= f["latency_mean"] <= f["wall_s"]
            assert f["throughput_completion"] == pytest.approx(96 / f["wall_s"])
            assert f["tpot_mean"] > 0 and f["dispatch_lag_mean"] >= 0
        for recs in out[n]["requests"]:  # request order, times within the run
            assert [x["request_id"] for x in recs] == list(range(8))
            for x in recs:
                assert len(x["event_times"]) == 12 and 0 <= x["start"] <= x["event_times"][0]
        # the table moved, and each run's last update is its whole count
        for ups in tables[n].updates:
            assert ups and ups[-1][:3] == (8, 8, 96)
            assert all(a[0] <= b[0] for a, b in zip(ups, ups[1:]))
    # both runs take about 12 x 10 ms; the split does not make requests late or slow
    one, two = out[1]["summary"], out[2]["summary"]
    assert two["latency_mean"] < 3 * one["latency_mean"] + 0.1
    assert "client_cpu_total_share" in two and two["client_cpu_total_share"] >= two["client_cpu_share"]
    assert "client_cpu_total_share" not in one
    assert len(starts) == 1 and len(starts[0]) == 2  # two processes, started once for the three runs
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("cap,processes", [(2, 2), (3, 2), (1, 4)])
def test_max_concurrency_stays_a_global_cap(server, cap, processes):
    target = http_client.Target(server.url, model="fake")
    out = bench_serve(target, _requests(8, 8), [0.0] * 8, 0, 1, Table(), max_concurrency=cap,
                      client_processes=processes, roofline=False)
    assert server.peak == cap  # reached, never passed, over all the processes together
    assert out["runs"][0]["counts"]["completed"] == 8 and out["runs"][0]["counts"]["peak_concurrency"] <= cap
    assert http_client.resolve_client_processes(processes, 8, cap) == min(cap, processes)


def test_auto_and_bad_values(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))
    auto = http_client.parse_client_processes("auto")
    assert http_client.resolve_client_processes(auto, 64, None) == 4
    assert http_client.resolve_client_processes(auto, 64, 20) == 2
    assert http_client.resolve_client_processes(auto, 8, None) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1})
    assert http_client.resolve_client_processes(auto, 64, None) == 1  # CPUs - 1
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(Exception, match="--client-processes"):
            http_client.parse_client_processes(bad)


def test_a_dying_client_process_fails_the_run_in_one_line_and_leaves_none(server, monkeypatch):
    server.delay = 0.05  # runs of ~1 s: the kill lands mid-run
    target = http_client.Target(server.url, model="fake")
    starts = _spy_starts(monkeypatch)

    def kill_second():
        if starts and not _gone(starts[0][1]):
            os.kill(starts[0][1], signal.SIGKILL)

    with pytest.raises(http_client.ClientProcessError) as e:
        bench_serve(target, _requests(6, 20), [0.0] * 6, 0, 2, Table(on_update=kill_second), client_processes=2,
                    roofline=False)
    pids = starts[0]
    msg = str(e.value)
    assert "\n" not in msg and "client process 2 of 2" in msg and "killed by signal 9" in msg, msg
    assert len(pids) == 2 and all(_gone(p) for p in pids)
    assert not multiprocessing.active_children()


def test_cli_takes_the_option(server):
    from typer.testing import CliRunner

    from rosecli.commands.main import app

    runner = CliRunner()
    r = runner.invoke(app, ["bench", "serve", "--base-url", server.url, "--num-prompts", "6", "--input-len", "4",
                            "--output-len", "5", "--client-processes", "2"])
    assert r.exit_code == 0, r.output
    assert "Client processes" in r.output and "Successful requests:" in r.output
    assert "Client CPU, all processes" in r.output
    r = runner.invoke(app, ["bench", "serve", "--base-url", server.url, "--client-processes", "zero"])
    assert r.exit_code != 0 and "--client-processes must be" in r.output
    assert "Traceback" not in r.output
