#!/usr/bin/env python
"""Bounded soak test of `rose serve-local` on loopback: abuse mixed into ordinary traffic.

Starts `rose serve-local` (tiny dummy model on the CPU unless told otherwise) on a free loopback
port and sends --requests requests, --concurrency at a time: streaming and non-streaming
completions and chats, a third of them from clients that disconnect at a random moment, plus a
few oversized bodies (413), malformed ones (400: bad JSON, wrong types, huge integers, non-finite
numbers, lone surrogates) and bodies that stop arriving (408). Then it checks that no KV block is
still held, starts a few long streams and sends SIGTERM: they must end with an error event and
[DONE], the server must exit 0 without a traceback. Prints requests served, outcomes by kind,
leaked KV blocks and the server's peak RSS; exits non-zero on any unexpected outcome.
Stops by itself: --requests and --max-seconds bound it.

    python scripts/soak_server.py
    python scripts/soak_server.py --requests 1000 --concurrency 32 -- --max-batch-size 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_REQUEST_BYTES = 64 * 1024
READ_TIMEOUT_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MiB; 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rosecli", "serve-local", "--model", args.model, "--load-format", args.load_format,
           "--device", args.device, "--host", "127.0.0.1", "--port", str(port),
           "--max-request-bytes", str(MAX_REQUEST_BYTES), "--read-timeout", str(READ_TIMEOUT_S),
           "--shutdown-timeout", str(args.shutdown_timeout), *args.server_args]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: the server exited with status {proc.returncode} during start-up:\n"
                     f"{proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"error: the server was not healthy within {timeout} s")


# --- the requests -------------------------------------------------------------------------------

def ordinary_body(rng: random.Random, model: str) -> tuple[str, dict]:
    stream = rng.random() < 0.5
    common = {"model": model, "max_tokens": rng.randint(1, 48), "stream": stream,
              "temperature": rng.choice([0, 0.7, 1.0]), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": f"Request {rng.randint(0, 10 ** 6)} says " * rng.randint(1, 20)}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "Tell me about "
                                                             f"topic {rng.randint(0, 1000)}"}]}


MALFORMED = [
    b'{"model": "M", "prompt": "hi",',
    b'{"model": "M", "prompt": "\\ud800"}',
    b'{"model": "M", "messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"model": "M", "prompt": "hi", "top_k": 9223372036854775808}',
    b'{"model": "M", "prompt": "hi", "seed": 18446744073709551616}',
    b'{"model": "M", "prompt": "hi", "temperature": Infinity}',
    b'{"model": "M", "prompt": "hi", "temperature": NaN}',
    b'{"model": "M", "prompt": "hi", "stream": "yes"}',
    b'{"model": "M", "prompt": "hi", "max_tokens": "3"}',
    b'[1, 2, 3]',
    b'{"model": "M", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
]


async def ordinary(client: httpx.AsyncClient, rng: random.Random, model: str, disconnect: bool) -> str:
    path, body = ordinary_body(rng, model)

    async def run() -> str:
        if body["stream"]:
            async with client.stream("POST", path, json=body) as r:
                lines = [line async for line in r.aiter_lines() if line]
            if r.status_code != 200:
                return f"unexpected {r.status_code}"
            if lines[-1] != "data: [DONE]" or any('"error"' in line for line in lines):
                return "stream ended badly"
            return "served"
        r = await client.post(path, json=body)
        return "served" if r.status_code == 200 else f"unexpected {r.status_code}: {r.text[:120]}"

    if not disconnect:
        return await run()
    try:
        await asyncio.wait_for(run(), timeout=rng.uniform(0.01, 0.5))
        return "served (before its client left)"
    except asyncio.TimeoutError:
        return "client disconnected"


async def malformed(client: httpx.AsyncClient, rng: random.Random, model: str) -> str:
    raw = rng.choice(MALFORMED).replace(b'"M"', json.dumps(model).encode())
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = await client.post(path, content=raw, headers={"content-type": "application/json"})
    ok = r.status_code == 400 and isinstance(r.json().get("error", {}).get("code"), str)
    return "400 malformed" if ok else f"unexpected {r.status_code} for malformed"


async def oversized(client: httpx.AsyncClient, model: str) -> str:
    body = {"model": model, "prompt": "x" * (MAX_REQUEST_BYTES + 1)}
    try:
        r = await client.post("/v1/completions", json=body)
    except httpx.HTTPError:  # the server may close before the whole body is sent: that is the point
        return "413 oversized (connection closed)"
    return "413 oversized" if r.status_code == 413 else f"unexpected {r.status_code} for oversized"


async def stalled_body(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    await writer.drain()
    try:
        head = await asyncio.wait_for(reader.read(64), READ_TIMEOUT_S + 5)
    except asyncio.TimeoutError:
        head = b""
    writer.close()
    return "408 stalled body" if head.startswith(b"HTTP/1.1 408") else f"unexpected {head[:20]!r} for stalled"


async def traffic(args, url: str, port: int) -> Counter:
    rng = random.Random(args.seed)
    outcomes: Counter = Counter()
    sem = asyncio.Semaphore(args.concurrency)
    deadline = time.monotonic() + args.max_seconds
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def one(i: int) -> None:
            async with sem:
                if time.monotonic() > deadline:
                    outcomes["not sent (--max-seconds)"] += 1
                    return
                roll = rng.random()
                try:
                    if roll < 0.04:
                        outcome = await oversized(client, args.model)
                    elif roll < 0.10:
                        outcome = await malformed(client, rng, args.model)
                    elif roll < 0.11:
                        outcome = await stalled_body(port)
                    else:
                        outcome = await ordinary(client, rng, args.model, disconnect=rng.random() < 1 / 3)
                except Exception as e:  # noqa: BLE001 - every failure is counted and printed
                    outcome = f"unexpected {type(e).__name__}: {e}"
                outcomes[outcome] += 1

        await asyncio.gather(*(one(i) for i in range(args.requests)))
    return outcomes


async def streams_at_shutdown(url: str, model: str, n: int, proc: subprocess.Popen) -> Counter:
    outcomes: Counter = Counter()
    started = asyncio.Event()  # set once every stream has its first event
    first_events: set = set()
    body = {"model": model, "prompt": "Keep going", "max_tokens": 10 ** 4, "stream": True, "ignore_eos": True}

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    outcomes[f"unexpected {r.status_code} at shutdown"] += 1
                    started.set()
                    return
                lines = []
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line)
                        first_events.add(i)
                        if len(first_events) == n:
                            started.set()
            ended = (lines[-1] == "data: [DONE]"
                     and json.loads(lines[-2][6:]).get("error", {}).get("code") == "shutting_down")
            outcomes["ended at shutdown with an error event" if ended else "stream cut at shutdown"] += 1
        except Exception as e:  # noqa: BLE001
            outcomes[f"unexpected {type(e).__name__} at shutdown"] += 1

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        info = (await client.get("/v1/models")).json()["data"][0]
        body["max_tokens"] = info["max_model_len"] - 16
        tasks = [asyncio.create_task(stream(client, i)) for i in range(n)]
        await asyncio.wait_for(started.wait(), 30)
        proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks)
    return outcomes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-seconds", type=float, default=180.0, help="stop sending after this long")
    ap.add_argument("--shutdown-timeout", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("server_args", nargs="*", help="more serve-local options, after --")
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    proc = start_server(args, port)
    try:
        wait_healthy(proc, url, args.startup_timeout)
        outcomes = asyncio.run(traffic(args, url, port))
        deadline = time.monotonic() + 30
        while True:  # the last aborts land within a step; give the worker a moment
            text = httpx.get(url + "/metrics", timeout=10).text
            leaked = metric(text, "rose_kv_blocks_used")
            running = metric(text, "rose_num_requests_running") + metric(text, "rose_num_requests_waiting")
            aborted = metric(text, 'rose_requests_total{finish_reason="abort"}')
            if (leaked == 0 and running == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        healthy = httpx.get(url + "/health", timeout=10).status_code == 200
        shutdown = asyncio.run(streams_at_shutdown(url, args.model, 4, proc))
        rss = peak_rss_mib(proc.pid)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    took = time.monotonic() - start

    served = sum(n for k, n in outcomes.items() if k.startswith("served"))
    unexpected = {k: n for k, n in {**outcomes, **shutdown}.items() if k.startswith(("unexpected", "stream "))}
    traceback = "Traceback" in err
    print(f"requests sent: {sum(outcomes.values())} in {took:.1f} s (server start and shutdown included)")
    print(f"requests served: {served}")
    print("outcomes by kind:")
    for kind, n in sorted({**outcomes, **shutdown}.items(), key=lambda kv: -kv[1]):
        print(f"  {n:6d}  {kind}")
    print(f"requests the server aborted (client gone): {aborted:.0f}")
    print(f"leaked KV blocks after the run: {leaked:.0f} (requests still running or waiting: {running:.0f})")
    print(f"/health after the run: {'200' if healthy else 'not 200'}")
    print(f"server exit status after SIGTERM: {proc.returncode}; traceback in its log: {'yes' if traceback else 'no'}")
    print(f"server peak RSS: {rss:.0f} MiB")
    failed = bool(unexpected) or leaked != 0 or running != 0 or not healthy or proc.returncode != 0 or traceback
    if traceback:
        print(err[-3000:], file=sys.stderr)
    print("FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
