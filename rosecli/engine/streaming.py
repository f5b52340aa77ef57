"""The streaming manager: one worker thread owns the scheduler; callers stream text.

Every caller (``rose generate``, the HTTP server, the benchmarks, ``LLMEngine.generate``) goes
through this manager. ``add_request`` is safe from any thread and returns at once: the prompt is
tokenized and checked by the input processor (`engine/inputs.py`) on the caller's thread, or by
``tokenize_workers`` threads. The worker loop admits new requests, runs one scheduler step, then,
under one lock acquisition per step, looks up the state of every request that produced a token
and hands the tokens to the output processor (`engine/outputs.py`: detokenizing, stop strings,
the per-request queues). Cleanup is driven by the scheduler's finished events. A consumer that
stops reading (its generator is closed, garbage-collected, or ``abort(request_id)`` is called,
say by a server that saw its client disconnect) has its request discarded and its KV blocks released by the worker
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
from typing import Iterator, Optional, Union

from rosecli.engine.config import SamplingParams
from rosecli.engine.errors import OverloadedError, RequestError, RoseError
from rosecli.engine.outputs import END, OutputProcessor, RequestOutput, RequestState

__all__ = ["END", "EngineDeadError", "RequestOutput", "RequestStream", "StreamingManager"]

log = logging.getLogger(__name__)


class EngineDeadError(RoseError):
    """The engine worker stopped on an error; no request can be served."""


class RequestStream:
    """Iterates one request's text pieces; ``output`` is set once the stream has ended."""

    def __init__(self, manager: "StreamingManager", req: RequestState):
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
                if item is END:
                    finished = True
                    self.output = req.output()
                    if req.error is not None:
                        raise req.error
                    return
                yield item
        finally:
            if not finished:
                self.manager.abort(req.rid)
            self.manager.forget(req.rid)


class StreamingManager:
    def __init__(self, engine, record_timestamps: bool = False, start: bool = True):
        self.engine = engine
        self.scheduler = engine.scheduler
        self.inputs = engine.inputs
        cfg = engine.config
        self.stream_interval = cfg.stream_interval
        self.max_inflight = cfg.max_inflight_requests
        self.record_timestamps = record_timestamps
        self.stages = engine.stages
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._requests: dict[int, RequestState] = {}
        self.outputs = OutputProcessor(engine.tokenizer, self.scheduler, self.stages, self.stream_interval,
                                       record_timestamps, on_end=lambda req: self._release_slot())
        self._inbox: deque = deque()  # ("add", rid, ids, params) | ("group", rids, ids, [params]) | ("discard", rid, request) | ("call", fn, ...)
        self._ids = itertools.count()
        self._inflight = 0
        self._room = threading.Condition(threading.Lock())
        self._stop = False
        self.error: Optional[BaseException] = None
        self.generated_tokens = 0  # tokens the engine produced so far (live progress; written by the stepping thread)
        # seconds of decode steps so far, each from the end of the step before (host work between steps
        # included) unless the engine idled: what the benchmarks divide a decode step's bytes by
        self.decode_s = 0.0
        self._step_end: Optional[float] = None
        self._tokenizer_pool = (ThreadPoolExecutor(cfg.tokenize_workers, thread_name_prefix="rose-tokenize")
                                if cfg.tokenize_workers > 0 else None)
        self._fault: Optional[BaseException] = None  # the engine died outside a step (a tensor-parallel rank)
        listen = getattr(engine, "add_fault_listener", None)
        if listen is not None:
            listen(self._engine_fault)
        self._thread = threading.Thread(target=self._worker, name="rose-engine", daemon=True)
        if start:
            self._thread.start()

    # --- callers' side ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker of a manager made with ``start=False`` (requests added before it are
        admitted together, as one batch); does nothing once started."""
        if self._thread.ident is None:
            self._thread.start()

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
        if not isinstance(prompt, str) or self._tokenizer_pool is None:
            token_ids = self.inputs.process(prompt, params)
        self._acquire_slot(wait, timeout)
        rid = next(self._ids)
        req = RequestState(rid, params, submit, sink)
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

    def add_choices(self, prompt: Union[str, list[int]], params: list[SamplingParams], wait: bool = True,
                    timeout: Optional[float] = None, sink: Optional[queue.SimpleQueue] = None) -> list[int]:
        """Submit ``len(params)`` choices of one prompt (OpenAI's ``n``), one request id each (in
        order), as ``add_request`` does one: the prompt is tokenized and prefilled once and its KV
        shared (`Scheduler.add_group`). Each takes a place of ``max_inflight_requests``. Raises
        RequestError (``param`` "n") when so many choices can never run together."""
        submit = time.perf_counter()
        if self.error is not None or self._stop:
            raise EngineDeadError(f"the engine is not running: {self.error or 'it was shut down'}")
        if not params:
            raise RequestError("n must be at least 1", "n")
        token_ids = self.inputs.process(prompt, params[0])
        for p in params[1:]:
            self.inputs.check_params(p)
        self.scheduler.check_group(len(params), len(token_ids))
        taken = 0
        try:
            for _ in params:
                self._acquire_slot(wait, timeout)
                taken += 1
        except BaseException:
            for _ in range(taken):
                self._release_slot()
            raise
        reqs = [RequestState(next(self._ids), p, submit, sink) for p in params]
        with self._lock:
            dead = self.error is not None or self._stop
            if not dead:
                for req in reqs:
                    req.prompt_tokens = len(token_ids)
                    self._requests[req.rid] = req
                self._inbox.append(("group", [r.rid for r in reqs], token_ids, params))
                self._wake.notify()
        if dead:
            for _ in reqs:
                self._release_slot()
            raise EngineDeadError(f"the engine is not running: {self.error or 'it was shut down'}")
        return [r.rid for r in reqs]

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

    def _tokenize(self, req: RequestState, prompt: str) -> None:
        try:
            token_ids = self.inputs.process(prompt, req.params)
        except RequestError as e:
            self.outputs.fail(req, e)
            return
        except Exception as e:  # the tokenizer failed on this prompt: nobody else is hurt
            self.outputs.request_failed(req, e, in_scheduler=False)
            return
        self._enqueue(req, token_ids)

    def _enqueue(self, req: RequestState, token_ids: list[int]) -> None:
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
        return req.output()

    def forget(self, rid: int) -> None:
        """Drop the manager's record of request ``rid`` once its caller is done with its stream."""
        with self._lock:
            self._requests.pop(rid, None)

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
        ``finish_reason`` "abort". Returns False when the request is unknown or already ended (then it is
        forgotten: whoever aborts a request does not take its output)."""
        with self._lock:
            req = self._requests.get(rid)
            if req is None or req.abandoned:
                return False
            if req.done.is_set():
                del self._requests[rid]
                return False
            req.abandoned = True
            self._inbox.append(("discard", rid, req))
            self._wake.notify()
        return True

    def decode_counts(self) -> dict:
        """Decode steps launched, the sequences they decoded and those sequences' context tokens
        (the runner's sums since start-up), and the seconds spent in decode steps: two snapshots'
        difference is what the steps between them read, and how long they took (GET /roofline)."""
        steps, seqs, ctx = self.engine.runner.decode_counts()
        return {"decode_steps": steps, "decode_sequences": seqs, "decode_context_tokens": ctx,
                "decode_s": self.decode_s}

    def stats(self) -> dict:
        """A snapshot for /metrics and the benchmarks (read without stopping the worker)."""
        s = self.scheduler
        bm = s.block_manager
        return {"running": len(s.running) + len(s.prefilling), "waiting": len(s.waiting),
                "inflight": self._inflight, "kv_blocks_total": bm.num_blocks, "kv_blocks_used": bm.num_used_blocks,
                "prefix_cache_hit_rate": bm.prefix_hit_rate, "prefix_cache_hit_tokens": bm.prefix_hit_tokens,
                "prefix_cache_queried_tokens": bm.prefix_queried_tokens, "preemptions": s.num_preemptions,
                "prefill_tokens": s.num_prefill_tokens,
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
            self.outputs.fail(req, EngineDeadError("the engine was shut down before this request finished"))

    # --- worker -----------------------------------------------------------------------------
    def run_until_idle(self) -> None:
        """Run the engine loop on the calling thread, instead of the worker, until every request
        added so far has ended (a manager made with ``start=False``; its consumers read on other
        threads). On CPU this is what a one-shot command wants: torch's intra-op threads speed up
        the process's main thread only (measured on 2 cores: a SmolLM2 decode step takes 1.6x as
        long on any other thread), so `rose generate` and `LLMEngine.generate` step the engine
        here. Raises EngineDeadError if the engine fails (every request ends with it)."""
        if self._thread.ident is not None:
            raise RuntimeError("run_until_idle needs a manager made with start=False and not started")
        self._loop(until_idle=True)
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped on an error: {type(self.error).__name__}: "
                                  f"{self.error}") from self.error

    def _idle(self) -> bool:
        """Nothing queued, running or waiting to be tokenized (under the lock)."""
        return (not self._inbox and not self.scheduler.has_unfinished()
                and all(r.done.is_set() for r in self._requests.values()))

    def _worker(self) -> None:
        self._loop(until_idle=False)

    def _loop(self, until_idle: bool) -> None:
        try:
            while True:
                with self._lock:
                    if until_idle and self._idle():
                        return
                    while (not self._stop and not self._inbox and not self.scheduler.has_unfinished()
                           and self._fault is None):
                        self._wake.wait(timeout=0.5)
                        if until_idle and self._idle():
                            return
                    if self._fault is not None:
                        raise self._fault
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
                self.outputs.fail(req, EngineDeadError(f"the engine stopped on an error: {type(e).__name__}: {e}"))

    def _engine_fault(self, error: BaseException) -> None:
        with self._lock:
            self._fault = error
            self._wake.notify()

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
                self.outputs.close(req)
            return
        if item[0] == "group":
            self._admit_group(*item[1:])
            return
        _, rid, token_ids, params = item
        with self._lock:
            req = self._requests.get(rid)
        if req is None or req.abandoned:
            return
        try:
            self.scheduler.add_request(token_ids, params, request_id=rid)
            self.outputs.start(req, token_ids)
        except RequestError as e:  # refused before the scheduler took it
            self.outputs.fail(req, e)
        except Exception as e:  # building this request's state failed: it alone fails
            self.outputs.request_failed(req, e)

    def _admit_group(self, rids: list[int], token_ids: list[int], params: list[SamplingParams]) -> None:
        with self._lock:
            reqs = [self._requests.get(rid) for rid in rids]
        live = [(req, p) for req, p in zip(reqs, params) if req is not None and not req.abandoned]
        if not live:
            return
        try:
            self.scheduler.add_group(token_ids, [p for _, p in live], [req.rid for req, _ in live])
            for req, _ in live:
                self.outputs.start(req, token_ids)
        except RequestError as e:
            for req, _ in live:
                self.outputs.fail(req, e)
        except Exception as e:
            for req, _ in live:
                self.outputs.request_failed(req, e)

    def _step(self) -> None:
        sched = self.scheduler
        start = time.perf_counter()
        tokens = sched.step()
        end = time.perf_counter()
        if sched.last_step_kind == "decode":  # from the step before's end, unless the engine idled since
            self.decode_s += end - (self._step_end or start)
        self._step_end = end if sched.has_unfinished() else None
        self.generated_tokens += len(tokens)
        finished = sched.pop_finished_ids()
        if not tokens and not finished:
            return
        self.outputs.process(tokens, finished, time.perf_counter(), self._requests, self._lock,
                             sched.step_logprobs, sched.step_prompt_logprobs)
