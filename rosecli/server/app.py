"""The OpenAI-compatible HTTP app over one ``StreamingManager``.

Every request's text pieces reach the event loop through one shared sink queue read by one
bridge thread, which hands each batch it finds to the loop with a single
``call_soon_threadsafe``: no thread per stream and no thread hop per token. A stream whose
client goes away is aborted at once (Starlette cancels the response generator; its
``finally`` calls ``manager.abort``), so its KV blocks are released within one engine step.
Prompts are tokenized (and chat templates rendered) on one server thread, so the handlers can
check prompt + max_tokens against the context and answer 400 before anything is queued.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rosecli.engine.errors import OverloadedError, RequestError, RoseError
from rosecli.engine.streaming import END, EngineDeadError
from rosecli.server import protocol as p
from rosecli.server.metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger("rosecli.server")

OVERLOAD_MODES = ("reject", "wait")
OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
_DEAD_END_DELAY_S = 1.0  # after the worker dies, streams still open this long get their end synthesized


def _sse(obj: Union[dict, str]) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


class _Bridge:
    """Carries ``(request_id, piece)`` items from the engine worker to per-request asyncio queues."""

    def __init__(self, manager, on_engine_dead: Callable[[], None]):
        self.manager = manager
        self.sink: queue.SimpleQueue = queue.SimpleQueue()
        self.queues: dict[int, asyncio.Queue] = {}
        self.on_end: dict[int, Callable[[], None]] = {}
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.engine_dead = False
        self._on_engine_dead = on_engine_dead
        self._thread = threading.Thread(target=self._run, name="rose-server-bridge", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread.start()

    def stop(self) -> None:
        self.sink.put(None)
        self._thread.join(timeout=5)

    def open(self, rid: int, on_end: Optional[Callable[[], None]] = None) -> asyncio.Queue:
        """Call on the loop right after ``add_request`` (no await between: no piece can be missed)."""
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        if on_end is not None:
            self.on_end[rid] = on_end
        return q

    def _run(self) -> None:
        sink = self.sink
        while True:
            try:
                batch = [sink.get(timeout=0.25)]
            except queue.Empty:
                batch = []
            while True:
                try:
                    batch.append(sink.get_nowait())
                except queue.Empty:
                    break
            stopping = None in batch
            batch = [item for item in batch if item is not None]
            if batch:
                self.loop.call_soon_threadsafe(self._dispatch, batch)
            if stopping:
                return
            if not self.engine_dead and self.manager.error is not None:
                self.engine_dead = True
                self.loop.call_soon_threadsafe(self._engine_died)

    def _dispatch(self, batch: list) -> None:
        for rid, item in batch:
            q = self.queues.get(rid)
            if q is None:
                continue
            q.put_nowait(item)
            if item is END:
                self._close(rid)

    def _close(self, rid: int) -> None:
        self.queues.pop(rid, None)
        release = self.on_end.pop(rid, None)
        if release is not None:
            release()

    def _engine_died(self) -> None:
        log.error("the engine worker died: %s", self.manager.error)
        self.loop.call_later(_DEAD_END_DELAY_S, self._end_all)
        self._on_engine_dead()

    def _end_all(self) -> None:
        """A request added while the worker was dying may never get its END: end it here."""
        for rid, q in list(self.queues.items()):
            q.put_nowait(END)
            self._close(rid)


class _ApiKeyMiddleware:
    """Pure ASGI (streaming and disconnects pass through untouched): 401 without the key."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if secrets.compare_digest(given.strip(), self.expected):
            return await self.app(scope, receive, send)
        body = p.error_body("Incorrect or missing API key: send the header 'Authorization: Bearer <key>'.",
                            "invalid_request_error", None, "invalid_api_key")
        await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


class _Server:
    """The state behind the routes of one app."""

    def __init__(self, manager, engine, served_model_name: str, overload: str, profile_dir: Optional[str],
                 on_engine_dead: Optional[Callable[[], None]]):
        self.manager = manager
        self.engine = engine
        self.model_name = served_model_name
        self.overload = overload
        self.profile_dir = profile_dir
        self.max_model_len = engine.max_model_len
        model = getattr(engine, "loaded", None)
        self.vocab_size = getattr(getattr(model, "model", None), "vocab_size", None) or len(engine.tokenizer)
        self.created = p.now()
        self.metrics = ServerMetrics(manager)
        self.user_on_engine_dead = on_engine_dead
        self.bridge = _Bridge(manager, self._engine_dead)
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="rose-server-tokenize")
        limit = engine.config.max_inflight_requests
        self.room: Optional[asyncio.Semaphore] = (asyncio.Semaphore(limit) if overload == "wait" and limit
                                                  else None)
        self.profiler = None

    def _engine_dead(self) -> None:
        if self.user_on_engine_dead is not None:
            self.user_on_engine_dead()

    # --- request -> engine ------------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise p.APIError(404, f"The model `{model}` does not exist. This server serves "
                             f"`{self.model_name}` (see GET /v1/models).", "invalid_request_error", "model",
                             "model_not_found")

    def check_alive(self) -> None:
        if not self.manager.is_alive:
            raise p.APIError(503, f"the engine is not running: {self.manager.error or 'it was shut down'}",
                             "server_error", None, "engine_dead")

    def _encode_completion(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.scheduler.encode(prompt)
        p.check_token_ids(prompt, self.vocab_size, "prompt")
        return list(prompt)

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        tok = self.engine.tokenizer
        if getattr(tok, "chat_template", None) is None:
            raise p.bad_request(f"the model {self.model_name} has no chat template: use /v1/completions",
                                "messages")
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # jinja raises its own errors for conversations it rejects
            raise p.bad_request(f"the chat template rejected the messages: {e}", "messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    async def tokenize(self, fn, arg) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, arg)

    async def submit(self, ids: list[int], params) -> tuple[int, asyncio.Queue]:
        self.check_alive()
        if self.room is not None:
            await self.room.acquire()
        try:
            while True:
                try:
                    rid = self.manager.add_request(ids, params, wait=False, sink=self.bridge.sink)
                    break
                except OverloadedError as e:
                    if self.overload != "wait":
                        raise p.APIError(429, f"the server is overloaded: {e}", "rate_limit_exceeded", None,
                                         "rate_limit_exceeded") from None
                    await asyncio.sleep(0.005)  # the slot is released just before the END we wait on
        except RequestError as e:
            self._release_room()
            raise p.bad_request(str(e), "prompt") from None
        except EngineDeadError as e:
            self._release_room()
            raise p.APIError(503, str(e), "server_error", None, "engine_dead") from None
        except BaseException:
            self._release_room()
            raise
        return rid, self.bridge.open(rid, self._release_room if self.room is not None else None)

    def _release_room(self) -> None:
        if self.room is not None:
            self.room.release()

    def output(self, rid: int):
        """The finished request's RequestOutput; raises the engine's error if it failed."""
        try:
            return self.manager.take_output(rid)
        except KeyError:
            raise EngineDeadError(f"the engine stopped before this request finished: "
                                  f"{self.manager.error or 'it was shut down'}") from None

    # --- one generation request -------------------------------------------------------------
    async def generate(self, request: Request, req: p.SamplingRequest, chat: bool):
        arrival = time.perf_counter()
        req.check_unsupported()
        self.check_model(req.model)
        self.check_alive()
        if chat:
            ids = await self.tokenize(self._encode_chat, req.template_messages())
            prompt_param = "messages"
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            default_max = None  # the rest of the context, as vLLM
        else:
            ids = await self.tokenize(self._encode_completion, p.completion_prompt(req))
            prompt_param = "prompt"
            max_tokens = req.max_tokens
            default_max = 16  # OpenAI's default for completions
        if not ids:
            raise p.bad_request("the prompt is empty: give at least one token of text", prompt_param)
        params = p.sampling_params(req, len(ids), self.max_model_len, default_max_tokens=default_max,
                                   max_tokens=max_tokens, prompt_param=prompt_param, vocab_size=self.vocab_size)
        rid, q = await self.submit(ids, params)
        env = p.Envelope(chat, req.model or self.model_name)
        headers = {"x-request-id": env.id}
        if req.stream:
            return StreamingResponse(self._stream(rid, q, env, req.include_usage, arrival),
                                     media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(request, rid, q, env, arrival, headers)

    async def _stream(self, rid: int, q: asyncio.Queue, env: p.Envelope, include_usage: bool,
                      arrival: float) -> AsyncIterator[str]:
        ended = False
        try:
            if env.chat:
                yield _sse(env.chunk(text="", role=True, include_usage=include_usage))
            while True:
                piece = await q.get()
                if piece is END:
                    break
                yield _sse(env.chunk(text=piece, include_usage=include_usage))
            ended = True
            try:
                out = self.output(rid)
            except RoseError as e:
                self.metrics.finished("error", arrival)
                yield _sse(p.error_body(str(e), "server_error", None, 503 if isinstance(e, EngineDeadError)
                                        else 500))
                yield _sse("[DONE]")
                return
            self.metrics.finished(p.finish_reason(out.finish_reason), arrival, out)
            yield _sse(env.chunk(text=None if env.chat else "", finish=p.finish_reason(out.finish_reason),
                                 include_usage=include_usage))
            if include_usage:
                yield _sse(env.usage_chunk(p.usage(out.prompt_tokens, out.output_tokens, out.cached_tokens)))
            yield _sse("[DONE]")
        finally:
            if not ended:  # the client went away (or the server is stopping): free the request now
                self.manager.abort(rid)
                self.metrics.finished("abort", arrival)

    async def _complete(self, request: Request, rid: int, q: asyncio.Queue, env: p.Envelope, arrival: float,
                        headers: dict) -> Response:
        ended = False
        try:
            while True:
                try:
                    piece = await asyncio.wait_for(q.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)  # nobody reads it; the finally frees the request
                    continue
                if piece is END:
                    break
            ended = True
            try:
                out = self.output(rid)
            except RoseError as e:
                self.metrics.finished("error", arrival)
                raise p.APIError(503 if isinstance(e, EngineDeadError) else 500, str(e), "server_error", None,
                                 "engine_dead" if isinstance(e, EngineDeadError) else None) from None
            reason = p.finish_reason(out.finish_reason)
            self.metrics.finished(reason, arrival, out)
            body = env.response(out.text, reason, p.usage(out.prompt_tokens, out.output_tokens, out.cached_tokens))
            return JSONResponse(body, headers=headers)
        finally:
            if not ended:
                self.manager.abort(rid)
                self.metrics.finished("abort", arrival)

    # --- profiling --------------------------------------------------------------------------
    def start_profile(self) -> dict:
        if self.profile_dir is None:
            raise p.bad_request("profiling is off: start the server with --profile-dir DIR")
        if self.profiler is not None:
            raise p.bad_request("the profiler is already running: POST /stop_profile first")
        self.check_alive()
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and self.engine.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities)
        self.engine.stages.enable_torch_trace(True)
        self.manager.call_on_worker(prof.start)  # the profiler records the thread that starts it
        self.profiler = prof
        return {"status": "started", "activities": [a.name for a in activities]}

    def stop_profile(self) -> dict:
        if self.profiler is None:
            raise p.bad_request("the profiler is not running: POST /start_profile first")
        prof, self.profiler = self.profiler, None
        self.engine.stages.enable_torch_trace(False)
        self.manager.call_on_worker(prof.stop)
        os.makedirs(self.profile_dir, exist_ok=True)
        path = os.path.join(self.profile_dir, f"rose-trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json")
        prof.export_chrome_trace(path)
        return {"status": "stopped", "trace": os.path.abspath(path)}

    def close(self) -> None:
        if self.profiler is not None:
            try:
                self.stop_profile()
            except Exception as e:  # a dead engine cannot stop it; nothing to save then
                log.warning("could not save the profile on shutdown: %s", e)
        self.manager.close()  # streams still open end with an error; the bridge delivers it, then stops
        self.bridge.stop()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)


def create_app(manager, engine, *, api_key: Optional[str] = None, served_model_name: Optional[str] = None,
               overload: str = "reject", profile_dir: Optional[str] = None,
               on_engine_dead: Optional[Callable[[], None]] = None) -> FastAPI:
    """The app; its lifespan starts the bridge and, at shutdown, closes the manager (in-flight
    streams still open then end with an error event). ``on_engine_dead`` is called once, on the
    event loop, when the engine worker dies."""
    if overload not in OVERLOAD_MODES:
        raise ValueError(f"overload must be one of {', '.join(OVERLOAD_MODES)}, got {overload!r}")
    server = _Server(manager, engine, served_model_name or engine.model_name, overload, profile_dir,
                     on_engine_dead)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.bridge.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, server.close)

    app = FastAPI(title="rose serve-local", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.rose = server
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(p.APIError)
    async def _api_error(request: Request, e: p.APIError):
        server.metrics.rejected.labels(str(e.status)).inc()
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        err = p.validation_error(list(e.errors()))
        server.metrics.rejected.labels("400").inc()
        return JSONResponse(err.body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(p.error_body(str(e.detail), kind, None, None), e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse(p.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        return await server.generate(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        return await server.generate(request, body, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [p.model_card(server.model_name, server.max_model_len, server.created)]}

    @app.get("/health")
    async def health():
        if manager.is_alive:
            return {"status": "ok"}
        return JSONResponse({"status": "engine dead", "error": str(manager.error or "shut down")}, 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/start_profile")
    async def start_profile():
        return await asyncio.get_running_loop().run_in_executor(None, server.start_profile)

    @app.post("/stop_profile")
    async def stop_profile():
        return await asyncio.get_running_loop().run_in_executor(None, server.stop_profile)

    return app
