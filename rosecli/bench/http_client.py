"""The HTTP/SSE client of `rose bench serve`: asyncio + httpx, one connection per in-flight
request, timestamps taken as bytes arrive.

Per request (`metrics.HttpTiming`): ``scheduled`` (the arrival schedule), ``dispatched`` (the
client got to it), ``start`` (just before the request is sent, after any ``--max-concurrency``
wait), and the receive time of every SSE event carrying a choice. Events that arrive in one
network read share its receive time. ``output_tokens`` come from the final ``usage`` event
(the request asks for it with ``stream_options: {"include_usage": true}``).

A request that does not end in ``data: [DONE]`` with at least one choice event is failed, with
one of these kinds (never a traceback): ``connection_refused``, ``timeout`` (no byte for
``--request-timeout`` seconds, or no connection within it), ``http_401``, ``http_403``,
``http_429``, ``http_5xx``, ``http_<status>`` (other 4xx), ``server_gone`` (the connection
closed mid-stream), ``stream_error`` (the server sent an error event), ``bad_response`` (not
SSE/JSON, or no choice event), ``client_error`` (anything else).

``--client-processes N`` (N > 1): `ProcessClients` splits the requests round-robin over N spawned
worker processes, started once per benchmark and reused by its runs, each running `run_serve` over
its share from one absolute start (``time.perf_counter()`` is CLOCK_MONOTONIC on Linux, the same
clock in every process of the machine). ``--max-concurrency`` is split across the processes in
shares summing to it (so at most that many requests are in flight in all), a process's requests
waiting for its own share only; there are never more processes than the cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from rosecli.bench.datasets import ServeRequest
from rosecli.bench.metrics import HttpTiming
from rosecli.engine.errors import ConfigError, RoseError

Progress = Callable[[int, int, int, float], None]  # (finished, total, output tokens, elapsed s)
_ERROR_BODY = 300  # characters of an error body kept in a message


@dataclass
class Target:
    base_url: str  # http://host:port (no trailing /v1)
    endpoint: str = "/v1/completions"
    model: Optional[str] = None
    api_key: Optional[str] = None
    request_timeout: float = 600.0
    ignore_eos: bool = True  # also sends min_tokens = max_tokens
    extra_body: dict = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, req: ServeRequest) -> dict:
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            body.update(messages=req.prompt, max_completion_tokens=req.output_len, max_tokens=req.output_len)
        else:
            body.update(prompt=req.prompt, max_tokens=req.output_len)
        if self.ignore_eos:
            body.update(ignore_eos=True, min_tokens=req.output_len)
        body.update(self.extra_body)
        return body


def normalize_base_url(url: str) -> str:
    """``http://h:8000/v1/`` -> ``http://h:8000``; refuses what is not an http(s) URL."""
    u = url.strip().rstrip("/")
    if not u.startswith(("http://", "https://")) or len(u.split("://", 1)[1]) == 0:
        raise ConfigError(f"--base-url must be an http:// or https:// URL such as http://127.0.0.1:8000, got {url!r}")
    return u.removesuffix("/v1")


def _reason(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return " ".join(text.split())[:_ERROR_BODY]


def _status_kind(status: int) -> str:
    if status in (401, 403, 429):
        return f"http_{status}"
    return "http_5xx" if status >= 500 else f"http_{status}"


def _error_text(body: bytes) -> str:
    """The message of an OpenAI-style error body, else the body's start."""
    text = body.decode("utf-8", "replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:_ERROR_BODY]
        if isinstance(err, str):
            return err[:_ERROR_BODY]
    return " ".join(text.split())[:_ERROR_BODY]


def check_server(target: Target, timeout: float = 10.0) -> list[str]:
    """Before any run: ask ``/v1/models``; one ConfigError line when nobody answers, the key is
    refused, or the model is not served. Returns the served model ids (empty when the server
    has no /v1/models). Sets ``target.model`` to the first served model when none was given."""
    import httpx

    url = f"{target.base_url}/v1/models"
    try:
        with httpx.Client(timeout=timeout) as client:
            r = client.get(url, headers=target.headers())
    except httpx.ConnectError as e:
        raise ConfigError(f"no server answers at {target.base_url} ({_reason(e)}): start it, or check --base-url") \
            from None
    except httpx.TimeoutException:
        raise ConfigError(f"the server at {target.base_url} did not answer GET /v1/models within {timeout:g} s") \
            from None
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach {url}: {_reason(e)}") from None
    if r.status_code in (401, 403):
        what = "refused the API key" if target.api_key else "wants an API key"
        raise ConfigError(f"the server at {target.base_url} {what} (HTTP {r.status_code}: {_error_text(r.content)}): "
                          "pass the right --api-key")
    ids: list[str] = []
    if r.status_code == 200:
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            ids = [m["id"] for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
    elif r.status_code != 404:
        raise ConfigError(f"GET {url} answered HTTP {r.status_code}: {_error_text(r.content)}")
    if target.model is None:
        if not ids:
            raise ConfigError(f"the server at {target.base_url} lists no models: pass --model")
        target.model = ids[0]
    elif ids and target.model not in ids:
        raise ConfigError(f"the server at {target.base_url} does not serve {target.model!r} (it serves "
                          f"{', '.join(ids[:8])}): pass one of them as --model")
    return ids


@dataclass
class ServeRun:
    timings: list[HttpTiming]
    wall_start: float  # run start: before the first request was due
    wall_end: float  # the last request ended
    cpu_s: float = float("nan")  # this client process's CPU time over the run (all its threads); several
    # client processes: the busiest one's
    cpu_total_s: float = float("nan")  # several client processes: the CPU time of all of them (NaN with one)


class _Failed(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


async def _read_stream(response, t: HttpTiming, chat: bool) -> None:
    """Consume one SSE response, filling ``t``; raises _Failed when it does not end well."""
    buf = b""
    done = False
    content_events = 0
    async for chunk in response.aiter_bytes():
        now = time.perf_counter()
        buf += chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        while b"\n\n" in buf:
            message, buf = buf.split(b"\n\n", 1)
            for line in message.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # comments (": ping"), event:/id: fields
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                try:
                    obj = json.loads(data)
                except ValueError:
                    raise _Failed("bad_response", f"an SSE event is not JSON: {data[:80]!r}") from None
                if not isinstance(obj, dict):
                    raise _Failed("bad_response", f"an SSE event is not a JSON object: {data[:80]!r}")
                choices = obj.get("choices")
                if choices:
                    t.event_times.append(now)
                    c = choices[0] if isinstance(choices[0], dict) else {}
                    text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    content_events += bool(text)
                elif isinstance(obj.get("usage"), dict):
                    u = obj["usage"]
                    if isinstance(u.get("completion_tokens"), int):
                        t.output_tokens = u["completion_tokens"]
                        t.usage_reported = True
                    if isinstance(u.get("prompt_tokens"), int):
                        t.prompt_tokens = u["prompt_tokens"]
                elif "error" in obj:
                    err = obj["error"]
                    msg = err.get("message") if isinstance(err, dict) else err
                    raise _Failed("stream_error", f"the server ended the stream with an error: {msg}")
    if not done:
        raise _Failed("server_gone", "the stream ended without data: [DONE] (the server closed it mid-stream)")
    if not t.event_times:
        raise _Failed("bad_response", "the stream carried no choice event")
    if not t.usage_reported:
        t.output_tokens = content_events  # no usage event: one token per event with text (an estimate)


async def _send(pool: ClientPool, target: Target, req: ServeRequest, t: HttpTiming, sem) -> None:
    import httpx

    try:
        async with sem:
            t.start = time.perf_counter()
            try:
                async with pool.client() as client, \
                        client.stream("POST", target.endpoint, json=target.payload(req)) as r:
                    if r.status_code != 200:
                        body = await r.aread()
                        raise _Failed(_status_kind(r.status_code), f"HTTP {r.status_code}: {_error_text(body)}")
                    await _read_stream(r, t, target.chat)
            except httpx.ConnectError as e:
                raise _Failed("connection_refused", _reason(e)) from None
            except httpx.TimeoutException as e:
                raise _Failed("timeout", f"no answer within --request-timeout {target.request_timeout:g} s "
                                         f"({type(e).__name__})") from None
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                raise _Failed("server_gone", f"the connection broke: {_reason(e)}") from None
        t.success = True
    except _Failed as f:
        t.success, t.error_kind, t.error = False, f.kind, f"request {t.index}: {f}"
    except Exception as e:  # anything else is counted and reported, never a traceback
        t.success, t.error_kind, t.error = False, "client_error", f"request {t.index}: {type(e).__name__}: {_reason(e)}"


class ClientPool:
    """One ``httpx.AsyncClient`` (one keep-alive connection) per concurrent request, reused between
    requests and runs. httpx's own pool checks every pooled connection each time a request is
    assigned (a ``getpeername`` and a readability poll per connection): at 64 streams that was
    about half of this client's CPU time, and the client became the bottleneck it must not be."""

    def __init__(self, target: Target):
        import ssl

        import httpx

        self._httpx = httpx
        self.target = target
        self._timeout = httpx.Timeout(target.request_timeout, connect=min(30.0, target.request_timeout))
        self._limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        self._ssl = ssl.create_default_context()  # made once: a context per client costs milliseconds
        self._free: list = []
        self._all: list = []

    @contextlib.asynccontextmanager
    async def client(self):
        c = self._free.pop() if self._free else None
        if c is None:
            c = self._httpx.AsyncClient(base_url=self.target.base_url, headers=self.target.headers(),
                                        timeout=self._timeout, limits=self._limits, verify=self._ssl)
            self._all.append(c)
        try:
            yield c
        finally:
            self._free.append(c)

    async def __aenter__(self) -> "ClientPool":
        return self

    async def __aexit__(self, *exc) -> None:
        clients, self._all, self._free = self._all, [], []
        for c in clients:
            await c.aclose()


def make_client(target: Target, max_concurrency: Optional[int] = None) -> ClientPool:
    """The clients of one benchmark (an async context manager; ``run_serve`` takes it)."""
    return ClientPool(target)


async def run_serve(pool: ClientPool, target: Target, requests: list[ServeRequest], offsets: list[float],
                    max_concurrency: Optional[int] = None, progress: Optional[Progress] = None,
                    progress_every_s: float = 0.1, start: Optional[float] = None,
                    indices: Optional[list[int]] = None) -> ServeRun:
    """Send ``requests`` on the schedule ``offsets`` (seconds after the start) and wait for all.
    ``start``: the run's start as an absolute ``time.perf_counter()`` (default: now); ``indices``:
    the requests' numbers in the whole run (default 0..n-1)."""
    n = len(requests)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    timings = [HttpTiming(indices[i] if indices is not None else i, r.prompt_len, 0, r.output_len, 0.0, 0.0)
               for i, r in enumerate(requests)]
    cpu0 = time.process_time()
    start = time.perf_counter() if start is None else start
    tasks = []
    stop = asyncio.Event()

    async def report() -> None:
        while not stop.is_set():
            # ended requests: their usage's count; the others: one token per choice event so far (live)
            done = sum(1 for t in timings if t.success or t.error_kind)
            tokens = sum(t.output_tokens if (t.success or t.error_kind) else len(t.event_times) for t in timings)
            progress(done, n, tokens, time.perf_counter() - start)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), progress_every_s)

    reporter = asyncio.create_task(report()) if progress else None
    for i, req in enumerate(requests):
        due = start + offsets[i]
        left = due - time.perf_counter()
        if left > 0:
            await asyncio.sleep(left)
        t = timings[i]
        t.scheduled, t.dispatched = due, time.perf_counter()
        tasks.append(asyncio.create_task(_send(pool, target, req, t, sem)))
    await asyncio.gather(*tasks)
    end = time.perf_counter()
    if reporter is not None:
        stop.set()
        await reporter
        progress(n, n, sum(t.output_tokens for t in timings if t.success), end - start)
    return ServeRun(timings, start, end, time.process_time() - cpu0)


# --- several client processes (--client-processes N) ----------------------------------------------

class ClientProcessError(RoseError):
    """A client worker process died or failed: the run has no figures."""


def parse_client_processes(text) -> "int | str":
    """``--client-processes``: a count >= 1 or ``auto``."""
    s = str(text).strip().lower()
    if s == "auto":
        return "auto"
    try:
        n = int(s)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"--client-processes must be a whole number >= 1 or 'auto', got {text!r}")
    return n


def resolve_client_processes(spec, num_requests: int, max_concurrency: Optional[int] = None) -> int:
    """The processes a benchmark uses: ``auto`` = min(4, CPUs - 1, ceil(concurrency / 16)), the
    concurrency being --max-concurrency or else every request; never more than the requests or
    the cap (each process holds a share >= 1 of the cap), never fewer than 1."""
    conc = max_concurrency or num_requests
    if spec == "auto":
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = min(4, cpus - 1, math.ceil(conc / 16))
    else:
        n = int(spec)
    return max(1, min(n, num_requests, conc))


def _worker(conn, target: Target, requests: list[ServeRequest], offsets: list[float], indices: list[int],
            max_concurrency: Optional[int]) -> None:
    """One client process: ``ready``, then per ``start`` it gets one run (``progress`` messages
    every 0.1 s, then ``done`` with its `ServeRun`), until ``None`` or the parent is gone."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers

    async def main() -> None:
        import httpx

        # the first request of a fresh process imports and sets up httpx's async path (~0.1 s): done
        # here, as the parent's check_server did for itself, not in the first run (no connection kept)
        with contextlib.suppress(Exception):
            async with httpx.AsyncClient(base_url=target.base_url, timeout=10.0) as c:
                await c.get("/v1/models", headers=target.headers())
        async with ClientPool(target) as pool:
            conn.send(("ready",))
            while (start := conn.recv()) is not None:  # between runs nothing else is on this loop
                progress = (lambda done, total, tokens, elapsed: conn.send(("progress", done, tokens)))
                try:
                    run = await run_serve(pool, target, requests, offsets, max_concurrency, progress,
                                          start=start, indices=indices)
                except Exception as e:  # noqa: BLE001 - reported to the parent as one line
                    conn.send(("error", f"{type(e).__name__}: {_reason(e)}"))
                    return
                conn.send(("done", run))

    with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        asyncio.run(main())


class ProcessClients:
    """``processes`` spawned client processes sending one benchmark's ``requests`` on ``offsets``,
    round-robin (request i goes to process i % N), started on entering (an async context manager,
    as `ClientPool`) and reused by every `run`. ``max_concurrency`` is split in shares summing to it.
    `run` blocks this process's event loop while it waits (nothing else runs on it)."""

    READY_TIMEOUT_S = 120.0
    LEAD_S = 0.05  # a run starts this long after the parent sends it, so every process is there at its start

    def __init__(self, target: Target, requests: list[ServeRequest], offsets: list[float], processes: int,
                 max_concurrency: Optional[int] = None):
        n = max(1, min(processes, len(requests), max_concurrency or len(requests)))
        self.target, self.n_requests, self.processes = target, len(requests), n
        self._shares = [list(range(w, len(requests), n)) for w in range(n)]
        self._caps = ([max_concurrency // n + (w < max_concurrency % n) for w in range(n)] if max_concurrency
                      else [None] * n)
        self._requests, self._offsets = requests, offsets
        self._procs: list = []
        self._conns: list = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    async def __aenter__(self) -> "ProcessClients":
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # not fork: the parent may hold threads (rich's live table) and sockets
        try:
            for w, share in enumerate(self._shares):
                here, there = ctx.Pipe()
                p = ctx.Process(target=_worker, name=f"rose-bench-client-{w + 1}", daemon=True,
                                args=(there, self.target, [self._requests[i] for i in share],
                                      [self._offsets[i] for i in share], share, self._caps[w]))
                p.start()
                there.close()
                self._procs.append(p)
                self._conns.append(here)
            deadline = time.monotonic() + self.READY_TIMEOUT_S
            for w in range(self.processes):
                while not self._conns[w].poll(0.05):
                    if not self._procs[w].is_alive():
                        self._died(w, "while starting")
                    if time.monotonic() > deadline:
                        raise ClientProcessError(f"client process {w + 1} of {self.processes} did not start within "
                                                 f"{self.READY_TIMEOUT_S:g} s")
                self._recv(w, "while starting")
        except BaseException:
            self.close(graceful=False)
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        self.close(graceful=exc[0] is None)

    def close(self, graceful: bool = True) -> None:
        """Stop every process (ask, then terminate, then kill) and reap it: none is left behind."""
        procs, conns, self._procs, self._conns = self._procs, self._conns, [], []
        if graceful:
            for c in conns:
                with contextlib.suppress(OSError, ValueError):
                    c.send(None)
            for p in procs:
                p.join(5)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()

    def _died(self, w: int, when: str):
        p = self._procs[w]
        p.join(1)
        code = p.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        hint = (" (its error is above; a script that runs the benchmark needs `if __name__ == \"__main__\":`)"
                if when == "while starting" else "")
        raise ClientProcessError(f"client process {w + 1} of {self.processes} (pid {p.pid}) {how} {when}; "
                                 f"the run has no figures{hint}")

    def _recv(self, w: int, when: str):
        try:
            msg = self._conns[w].recv()
        except (EOFError, OSError):
            self._died(w, when)
        if msg[0] == "error":
            raise ClientProcessError(f"client process {w + 1} of {self.processes} failed {when}: {msg[1]}")
        return msg

    async def run(self, progress: Optional[Progress] = None, progress_every_s: float = 0.1) -> ServeRun:
        """One run over every process; their timings merged in request order. ``progress`` is
        called here (this thread) with the sums of the processes' latest reports."""
        from multiprocessing.connection import wait

        cpu0 = time.process_time()
        start = time.perf_counter() + self.LEAD_S
        for c in self._conns:
            c.send(start)
        runs: dict[int, ServeRun] = {}
        latest = [(0, 0)] * self.processes
        last_report = 0.0
        by_handle = {**{c: w for w, c in enumerate(self._conns)}, **{p.sentinel: w for w, p in enumerate(self._procs)}}
        while len(runs) < self.processes:
            waiting = [h for h, w in by_handle.items() if w not in runs]
            for h in wait(waiting, timeout=progress_every_s):
                w = by_handle[h]
                if w in runs:
                    continue
                if h is not self._conns[w] and not self._conns[w].poll():
                    self._died(w, "during the run")  # its sentinel: the process is gone, nothing left to read
                while w not in runs and self._conns[w].poll():
                    msg = self._recv(w, "during the run")
                    if msg[0] == "progress":
                        latest[w] = (msg[1], msg[2])
                    elif msg[0] == "done":
                        runs[w] = msg[1]
                        latest[w] = (len(msg[1].timings), sum(t.output_tokens for t in msg[1].timings if t.success))
            now = time.perf_counter()
            if progress is not None and now - last_report >= progress_every_s and len(runs) < self.processes:
                last_report = now
                progress(sum(d for d, _ in latest), self.n_requests, sum(k for _, k in latest), max(0.0, now - start))
        timings = sorted((t for r in runs.values() for t in r.timings), key=lambda t: t.index)
        end = max(r.wall_end for r in runs.values())
        parent_cpu = time.process_time() - cpu0
        cpus = [r.cpu_s for r in runs.values()]
        if progress is not None:
            progress(self.n_requests, self.n_requests, sum(t.output_tokens for t in timings if t.success), end - start)
        return ServeRun(timings, start, end, max(cpus + [parent_cpu]), sum(cpus) + parent_cpu)
