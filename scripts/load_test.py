#!/usr/bin/env python
"""Bounded load test of `rose serve-local` on loopback.

Starts a server (or uses --url), sends --num-requests streaming completions with
--concurrency in flight (asyncio + httpx), then reports errors (must be 0), KV blocks still
held after the run according to /metrics (must be 0), client-side TTFT / inter-token latency
percentiles and throughput. Exits non-zero when either check fails. Loopback only.

    python scripts/load_test.py --model tiny-llama --load-format dummy --device cpu
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import httpx

SERVE = "import typer; from rosecli.commands.serve import serve_local; typer.run(serve_local)"


def loopback_only(url: str) -> str:
    host = urlparse(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        sys.exit(f"error: --url must point at a loopback address (127.0.0.1, ::1, localhost), got {host!r}")
    return url.rstrip("/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-c", SERVE, "--model", args.model, "--load-format", args.load_format,
           "--device", args.device, "--host", "127.0.0.1", "--port", str(port)]
    if args.max_inflight_requests:
        cmd += ["--max-inflight-requests", str(args.max_inflight_requests), "--overload", "wait"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: the server exited with status {proc.returncode} during start-up")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    sys.exit(f"error: the server was not healthy within {args.startup_timeout} s")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def one_request(client: httpx.AsyncClient, i: int, args, results: list, errors: list) -> None:
    body = {"model": args.served_model, "prompt": f"Request {i}: tell me a story about the number {i * 37}.",
            "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    usage = None
    done = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                errors.append(f"request {i}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line:
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    errors.append(f"request {i}: error event: {chunk['error']}")
                    return
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    times.append(time.perf_counter())
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as e:
        errors.append(f"request {i}: {type(e).__name__}: {e}")
        return
    if not done or usage is None or usage["completion_tokens"] != args.max_tokens or not times:
        errors.append(f"request {i}: incomplete stream (done={done}, usage={usage}, text chunks={len(times)})")
        return
    results.append((t0, times, usage))


async def run_load(url: str, args) -> tuple[list, list, float]:
    results: list = []
    errors: list = []
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(args.num_requests):
        queue.put_nowait(i)

    async with httpx.AsyncClient(base_url=url, limits=limits, headers=headers,
                                 timeout=httpx.Timeout(args.request_timeout)) as client:
        async def worker():
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await one_request(client, i, args, results, errors)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
    return results, errors, wall


def leaked_blocks(url: str, args) -> tuple[float, float]:
    """KV blocks still used (and total) once the server has had a moment to settle."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    deadline = time.monotonic() + 5
    while True:
        text = httpx.get(url + "/metrics", headers=headers, timeout=5).text
        used, running = metric(text, "rose_kv_blocks_used"), metric(text, "rose_num_requests_running")
        if (used == 0 and running == 0) or time.monotonic() > deadline:
            return used, metric(text, "rose_kv_blocks_total")
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="use this running server (loopback only) instead of starting one")
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--served-model", help="model name to send (default: --model)")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--api-key", default=os.environ.get("ROSE_API_KEY"))
    ap.add_argument("--max-inflight-requests", type=int, default=None,
                    help="started server only: admission limit (with --overload wait)")
    ap.add_argument("--startup-timeout", type=float, default=180)
    ap.add_argument("--request-timeout", type=float, default=120)
    args = ap.parse_args()
    if args.num_requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        ap.error("--num-requests, --concurrency and --max-tokens must be >= 1")
    args.served_model = args.served_model or args.model

    proc = None
    if args.url:
        url = loopback_only(args.url)
    else:
        proc, url = start_server(args)
    try:
        results, errors, wall = asyncio.run(run_load(url, args))
        used, total = leaked_blocks(url, args)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    ttft = [(times[0] - t0) * 1e3 for t0, times, _ in results]
    itl = [(b - a) * 1e3 for _, times, _ in results for a, b in zip(times, times[1:])]
    out_tokens = sum(u["completion_tokens"] for _, _, u in results)
    print(f"server {url}  model {args.served_model}  requests {args.num_requests}  concurrency "
          f"{args.concurrency}  max_tokens {args.max_tokens}")
    print(f"completed {len(results)}  errors {len(errors)}  wall {wall:.2f} s  "
          f"{len(results) / wall:.1f} req/s  {out_tokens / wall:.0f} output tok/s")
    print(f"TTFT ms  p50 {pct(ttft, 50):8.1f}  p95 {pct(ttft, 95):8.1f}  p99 {pct(ttft, 99):8.1f}")
    print(f"ITL  ms  p50 {pct(itl, 50):8.1f}  p95 {pct(itl, 95):8.1f}  p99 {pct(itl, 99):8.1f}")
    print(f"KV blocks used after the run: {used:.0f} of {total:.0f}")
    if proc is not None:
        print(f"server exit status after SIGTERM: {proc.returncode}")
    for e in errors[:10]:
        print("  " + e)
    ok = not errors and used == 0 and (proc is None or proc.returncode == 0)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
