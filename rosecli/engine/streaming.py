"""The streaming manager: one worker thread owns the scheduler; callers stream text.

``add_request`` is safe from any thread and returns at once (the prompt is tokenized on the
caller's thread, or by ``tokenize_workers`` threads). The worker loop admits new requests,
runs one scheduler step, then, under one lock acquisition per step, looks up the state of
every request that produced a token, and fans the tokens out through per-request incremental
detokenizers to per-request queues (flushing every ``stream_interval`` tokens and at finish).
Cleanup is driven by the scheduler's finished events. A consumer that stops reading (its
generator is closed, garbage-collected, or ``abort(request_id)`` is called, say by a server that
saw its client disconnect) has its request discarded and its KV blocks released by the worker
within one step.

Failures. Every request's stream ends with ``END``; a failed request ends the same way with its
error set: ``finish_reason`` "error", and ``take_output`` (or iterating ``stream``) raises the
error. An exception while handling one request (admitting it, its stop strings, detokenizing
its tokens) fails that request only, with `RequestFailedError` (a generic message; the cause is
chained and logged); its blocks are freed and the engine goes on. An exception in a batched step
(the model, the device) kills the engine: the worker ends, every request in flight or queued
ends with `EngineDeadError`, later ``add_request`` calls raise it, and ``is_alive`` /
``health()`` say so.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

from rosecli.engine.config import SamplingParams
from rosecli.engine.detokenizer import IncrementalDetokenizer
from rosecli.engine.errors import OverloadedError, RequestError, RequestFailedError, RoseError
from rosecli.engine.sequence import FinishReason

log = logging.getLogger(__name__)


class EngineDeadError(RoseError):
    """The engine worker stopped on an error; no request can be served."""


@dataclass
class RequestTimestamps:
    """``time.perf_counter()`` seconds; None when the stage did not happen (or was not recorded)."""

    submit: float = 0.0
    tokenized: Optional[float] = None
    admitted: Optional[float] = None
    first_token: Optional[float] = None
    token_times: list[float] = field(default_factory=list)  # each token, when the worker fanned it out
    flush_times: list[float] = field(default_factory=list)  # each text chunk put on the queue
    flush_tokens: list[int] = field(default_factory=list)  # tokens in each flushed chunk
    finish: Optional[float] = None


@dataclass
class RequestOutput:
    request_id: int
    text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: Optional[str]
    timestamps: RequestTimestamps
    cached_tokens: int = 0


class _End:
    __slots__ = ()

    def __repr__(self) -> str:
        return "END"


END = _END = _End()  # the last item of every request's stream


class _Request:
    __slots__ = ("rid", "params", "queue", "sink", "detok", "parts", "unsent", "final_text", "sent",
                 "pending_tokens", "holdback", "prompt_tokens", "output_tokens", "finish_reason", "ts", "done",
                 "abandoned", "cached_tokens", "error")

    def __init__(self, rid: int, params: SamplingParams, submit: float, sink: Optional[queue.SimpleQueue]):
        self.rid = rid
        self.params = params
        self.sink = sink
        self.queue: queue.SimpleQueue = sink if sink is not None else queue.SimpleQueue()
        self.detok: Optional[IncrementalDetokenizer] = None
        # The text is kept as pieces already put on the queue plus the text not yet put, so that a
        # token costs no copy of all the text before it; ``text`` joins them when asked.
        self.parts: list[str] = []
        self.unsent = ""
        self.final_text: Optional[str] = None  # the whole text, once finished
        self.sent = 0  # characters of text already put on the queue
        self.pending_tokens = 0
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.finish_reason: Optional[str] = None
        self.ts = RequestTimestamps(submit=submit)
        self.done = threading.Event()
        self.abandoned = False
        self.cached_tokens = 0
        self.error: Optional[BaseException] = None

    @property
    def text(self) -> str:
        """Detokenized so far (the whole output once finished)."""
        if self.final_text is not None:
            return self.final_text
        return "".join(self.parts) + self.unsent


class RequestStream:
    """Iterates one request's text pieces; ``output`` is set once the stream has ended."""

    def __init__(self, manager: "StreamingManager", req: _Request):
        self.manager = manager
        self.req = req
        self.request_id = req.rid
        self.output: Optional[RequestOutput] = None

    def __iter__(self) -> Iterator[str]:
        req = self.req
        finished = False
        try:
            while True:
                item = req.queue.get()
                if item is _END:
                    finished = True
                    self.output = RequestOutput(req.rid, req.text, req.prompt_tokens, req.output_tokens,
                                                req.finish_reason, req.ts, req.cached_tokens)
                    if req.error is not None:
                        raise req.error
                    return
                yield item
        finally:
            if not finished:
                self.manager.abort(req.rid)
            with self.manager._lock:
                self.manager._requests.pop(req.rid, None)


class StreamingManager:
    def __init__(self, engine, record_timestamps: bool = False, start: bool = True):
        self.engine = engine
        self.scheduler = engine.scheduler
        self.tokenizer = engine.tokenizer
        cfg = engine.config
        self.stream_interval = cfg.stream_interval
        self.max_inflight = cfg.max_inflight_requests
        self.record_timestamps = record_timestamps
        self.stages = engine.stages
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._requests: dict[int, _Request] = {}
        self._inbox: deque = deque()  # ("add", rid, ids, params) | ("discard", rid, request) | ("call", fn, ...)
        self._ids = itertools.count()
        self._inflight = 0
        self._room = threading.Condition(threading.Lock())
        self._stop = False
        self.error: Optional[BaseException] = None
        self._tokenizer_pool = (ThreadPoolExecutor(cfg.tokenize_workers, thread_name_prefix="rose-tokenize")
                                if cfg.tokenize_workers > 0 else None)
        self._thread = threading.Thread(target=self._worker, name="rose-engine", daemon=True)
        if start:
            self._thread.start()

    # --- callers' side ----------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def health(self) -> dict:
        """``{"status": "ok" | "dead" | "stopped", "error": message or None}``: "dead" once the
        worker stopped on an error (every request then ends with EngineDeadError), "stopped" after
        ``close`` (or a worker that is not running)."""
        if self.error is not None:
            return {"status": "dead", "error": f"{type(self.error).__name__}: {self.error}"}
        if self._stop or not self._thread.is_alive():
            return {"status": "stopped", "error": "the engine was shut down"}
        return {"status": "ok", "error": None}

    def add_request(self, prompt: Union[str, list[int]], params: Optional[SamplingParams] = None,
                    wait: bool = True, timeout: Optional[float] = None,
                    sink: Optional[queue.SimpleQueue] = None) -> int:
        """Submit a request; returns its id at once. Beyond ``max_inflight_requests`` it waits for
        room (``wait=True``) or raises OverloadedError. Invalid prompts raise RequestError here
        when tokenized on this thread, or end the stream with it when tokenized by the pool.

        With ``sink``, the request's pieces go to that shared queue as ``(request_id, piece)``,
        ending with ``(request_id, END)``, so one consumer can read many requests; then call
        ``take_output(request_id)`` after END."""
        submit = time.perf_counter()
        if self.error is not None or self._stop:
            raise EngineDeadError(f"the engine is not running: {self.error or 'it was shut down'}")
        params = params or SamplingParams()
        token_ids = None
        if not isinstance(prompt, str):
            token_ids = list(prompt)
            self.scheduler.validate(token_ids)
        elif self._tokenizer_pool is None:
            token_ids = self.scheduler.encode(prompt)
            self.scheduler.validate(token_ids)
        self._acquire_slot(wait, timeout)
        rid = next(self._ids)
        req = _Request(rid, params, submit, sink)
        with self._lock:  # the worker's death fails every request registered before it, under this lock
            dead = self.error is not None or self._stop
            if not dead:
                self._requests[rid] = req
        if dead:
            self._release_slot()
            raise EngineDeadError(f"the engine is not running: {self.error or 'it was shut down'}")
        if token_ids is not None:
            self._enqueue(req, token_ids)
        else:
            self._tokenizer_pool.submit(self._tokenize, req, prompt)
        return rid

    def _acquire_slot(self, wait: bool, timeout: Optional[float]) -> None:
        if self.max_inflight is None:
            with self._room:
                self._inflight += 1
            return
        with self._room:
            if self._inflight >= self.max_inflight:
                if not wait:
                    raise OverloadedError(f"{self._inflight} requests are in flight, the limit set by "
                                          f"--max-inflight-requests is {self.max_inflight}: retry later")
                if not self._room.wait_for(lambda: self._inflight < self.max_inflight, timeout):
                    raise OverloadedError(f"no room for a new request within {timeout} s "
                                          f"(--max-inflight-requests {self.max_inflight})")
            self._inflight += 1

    def _release_slot(self) -> None:
        with self._room:
            self._inflight -= 1
            self._room.notify()

    def _tokenize(self, req: _Request, prompt: str) -> None:
        try:
            token_ids = self.scheduler.encode(prompt)
            self.scheduler.validate(token_ids)
        except RequestError as e:
            self._fail(req, e)
            return
        except Exception as e:  # the tokenizer failed on this prompt: nobody else is hurt
            self._request_failed(req, e, in_scheduler=False)
            return
        self._enqueue(req, token_ids)

    def _enqueue(self, req: _Request, token_ids: list[int]) -> None:
        req.prompt_tokens = len(token_ids)
        if self.record_timestamps:
            req.ts.tokenized = time.perf_counter()
        with self._lock:
            self._inbox.append(("add", req.rid, token_ids, req.params))
            self._wake.notify()

    def stream(self, rid: int) -> "RequestStream":
        """An iterable of request ``rid``'s text pieces as they are produced; after the last piece
        its ``output`` holds the counts, finish reason and timestamps. Closing it early (or
        dropping it) discards the request and releases its KV blocks."""
        with self._lock:
            req = self._requests.get(rid)
        if req is None:
            raise KeyError(f"unknown request id {rid}")
        return RequestStream(self, req)

    def result(self, rid: int) -> RequestOutput:
        """Wait for request ``rid`` to finish and return its whole output (consumes its stream)."""
        stream = self.stream(rid)
        for _ in stream:
            pass
        return stream.output

    def take_output(self, rid: int) -> RequestOutput:
        """The output of a sink-mode request after its END; forgets the request."""
        with self._lock:
            req = self._requests.pop(rid)
        if req.error is not None:
            raise req.error
        return RequestOutput(req.rid, req.text, req.prompt_tokens, req.output_tokens, req.finish_reason, req.ts,
                             req.cached_tokens)

    def call_on_worker(self, fn, timeout: Optional[float] = None):
        """Run ``fn()`` on the engine's worker thread between steps and return its result (the torch
        profiler, for one, records only the thread that starts it).

        Waits as long as the worker lives: the step before the call may take long on a busy CPU.
        Raises EngineDeadError if the worker stops first, TimeoutError after ``timeout`` s if given."""
        done = threading.Event()
        box: list = []
        with self._lock:
            if self.error is not None or self._stop:
                raise EngineDeadError(f"the engine is not running: {self.error or 'it was shut down'}")
            self._inbox.append(("call", fn, done, box))
            self._wake.notify()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done.wait(0.1):
            if not self._thread.is_alive() and not done.is_set():
                raise EngineDeadError(f"the engine stopped before running the call: "
                                      f"{self.error or 'it was shut down'}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine worker did not run the call within {timeout} s")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def abort(self, rid: int) -> bool:
        """Discard request ``rid`` (its consumer went away); safe from any thread, returns at once.
        The worker frees its KV blocks before its next step and ends its stream with
        ``finish_reason`` "abort". Returns False when the request is unknown or already ended."""
        with self._lock:
            req = self._requests.get(rid)
            if req is None or req.done.is_set() or req.abandoned:
                return False
            req.abandoned = True
            self._inbox.append(("discard", rid, req))
            self._wake.notify()
        return True

    def stats(self) -> dict:
        """A snapshot for /metrics and the benchmarks (read without stopping the worker)."""
        s = self.scheduler
        bm = s.block_manager
        return {"running": len(s.running) + len(s.prefilling), "waiting": len(s.waiting),
                "inflight": self._inflight, "kv_blocks_total": bm.num_blocks, "kv_blocks_used": bm.num_used_blocks,
                "prefix_cache_hit_rate": bm.prefix_hit_rate, "prefix_cache_hit_tokens": bm.prefix_hit_tokens,
                "prefix_cache_queried_tokens": bm.prefix_queried_tokens, "preemptions": s.num_preemptions,
                "finish_counts": dict(s.finish_counts)}

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until no request is queued or running (used by tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                idle = not self._inbox and not self.scheduler.has_unfinished()
            if idle:
                return True
            time.sleep(0.002)
        return False

    def close(self, abort_inflight: bool = True) -> None:
        """Stop the worker; in-flight streams end (with an error if they were still running)."""
        with self._lock:
            self._stop = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            pending = [r for r in self._requests.values() if not r.done.is_set()]
        for req in pending:
            self._fail(req, EngineDeadError("the engine was shut down before this request finished"))

    # --- worker -----------------------------------------------------------------------------
    def _worker(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stop and not self._inbox and not self.scheduler.has_unfinished():
                        self._wake.wait(timeout=0.5)
                    if self._stop:
                        return
                    inbox = list(self._inbox)
                    self._inbox.clear()
                for item in inbox:
                    self._admit(item)
                if self.scheduler.has_unfinished():
                    self._step()
        except BaseException as e:  # the engine is dead: every stream must hear of it
            log.error("the engine worker stopped on an error", exc_info=e)
            with self._lock:  # add_request registers under this lock only while no error is set
                self.error = e
                pending = [r for r in self._requests.values() if not r.done.is_set()]
            for req in pending:
                self._fail(req, EngineDeadError(f"the engine stopped on an error: {type(e).__name__}: {e}"))

    def _admit(self, item) -> None:
        if item[0] == "call":
            _, fn, done, box = item
            try:
                box.append(fn())
            except BaseException as e:  # handed back to the caller
                box.append(e)
            done.set()
            return
        if item[0] == "discard":
            _, rid, req = item
            self.scheduler.discard_request(rid)
            with self._lock:
                self._requests.pop(rid, None)
            if not req.done.is_set():
                req.finish_reason = "abort"
                self._close(req)
            return
        _, rid, token_ids, params = item
        with self._lock:
            req = self._requests.get(rid)
        if req is None or req.abandoned:
            return
        try:
            self.scheduler.add_request(token_ids, params, request_id=rid)
            req.detok = IncrementalDetokenizer(self.tokenizer, token_ids)
        except RequestError as e:  # refused before the scheduler took it
            self._fail(req, e)
        except Exception as e:  # building this request's state failed: it alone fails
            self._request_failed(req, e)

    def _step(self) -> None:
        stages = self.stages
        tokens = self.scheduler.step()
        finished = self.scheduler.pop_finished_ids()
        if not tokens and not finished:
            return
        now = time.perf_counter()
        with stages.range("detokenize_fanout", len(tokens)):
            with self._lock:  # one acquisition per step
                records = [(self._requests.get(rid), tok) for rid, tok in tokens.items()]
                done = [self._requests.get(rid) for rid in finished]
            interval = self.stream_interval
            record = self.record_timestamps
            finishing = set(finished) if finished else ()
            failed = None
            for req, tok in records:
                if req is None or req.abandoned:
                    continue
                try:
                    req.output_tokens += 1
                    if req.output_tokens == 1:
                        req.ts.first_token = now
                        seq = self.scheduler.get(req.rid)
                        if seq is not None:
                            req.ts.admitted = seq.admitted_at
                            req.cached_tokens = seq.num_cached_tokens
                    if record:
                        req.ts.token_times.append(now)
                    req.unsent += req.detok.push(tok)
                    req.pending_tokens += 1
                    # first token at once; a finishing request is flushed below, after any stop-string cut
                    if (req.pending_tokens >= interval or req.output_tokens == 1) and req.rid not in finishing:
                        self._flush(req, now)
                except Exception as e:  # this request's detokenizing failed: it alone fails, below
                    failed = failed or []
                    failed.append((req, e))
            if failed:
                for req, e in failed:
                    self._request_failed(req, e)
        with stages.range("stream_flush", len(done)):
            for req in done:
                if req is None or req.done.is_set():
                    continue
                try:
                    self._finish(req, now)
                except Exception as e:
                    self._request_failed(req, e)

    def _finish(self, req: _Request, now: float) -> None:
        """Send a finished request's last text and end its stream."""
        seq = self.scheduler.get(req.rid)
        if seq is not None and seq.finish_reason is FinishReason.ERROR:
            self._request_failed(req, seq.error)
            return
        reason = seq.finish_reason.value if seq is not None and seq.finish_reason else "stop"
        final = self.scheduler.pop_response(req.rid) if seq is not None else None
        if seq is not None and seq.final_text is not None:
            text = final  # cut before the stop string
        else:
            text = req.text + (req.detok.flush() if req.detok else "")
        req.final_text = text
        req.unsent = text[req.sent:]
        req.finish_reason = reason
        req.ts.finish = now
        self._flush(req, now, final=True)
        self._close(req)

    def _request_failed(self, req: _Request, cause: Optional[BaseException], in_scheduler: bool = True) -> None:
        """Handling one request raised ``cause``: end it alone (blocks freed, the stream gets a
        RequestFailedError); the engine goes on. ``in_scheduler`` only on the worker thread."""
        log.error("request %d failed, the engine goes on", req.rid, exc_info=cause)
        if in_scheduler:
            self.scheduler.discard_request(req.rid, FinishReason.ERROR)
        error = RequestFailedError()
        error.__cause__ = cause
        self._fail(req, error)

    def _flush(self, req: _Request, now: float, final: bool = False) -> None:
        unsent = req.unsent
        upto = len(unsent) if final else len(unsent) - req.holdback
        if upto > 0:
            piece = unsent[:upto]
            req.unsent = unsent[upto:]
            req.parts.append(piece)
            req.sent += upto
            self._put(req, piece)
            if self.record_timestamps:
                req.ts.flush_times.append(now)
                req.ts.flush_tokens.append(req.pending_tokens)
            req.pending_tokens = 0

    def _close(self, req: _Request) -> None:
        if req.done.is_set():
            return
        req.done.set()
        self._put(req, _END)
        self._release_slot()

    @staticmethod
    def _put(req: _Request, item) -> None:
        req.queue.put(item if req.sink is None else (req.rid, item))

    def _fail(self, req: _Request, error: BaseException) -> None:
        if req.done.is_set():
            return
        req.error = error
        req.finish_reason = "error"
        self._close(req)
