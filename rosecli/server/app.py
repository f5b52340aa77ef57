"""The OpenAI-compatible HTTP app over one ``StreamingManager``.

Every request's text pieces reach the event loop through one shared sink queue read by one
bridge thread, which hands each batch it finds to the loop with a single
``call_soon_threadsafe``: no thread per stream and no thread hop per token.

Nothing a client sends can hurt the engine: the body is read whole, within ``max_request_bytes``
and ``read_timeout`` (413 / 408), before any route sees it; it is parsed as strict JSON into
strictly typed, range-checked fields (400 naming the field); a prompt whose characters cannot fit
the context is refused before it is tokenized, and tokenizing (and chat templates) runs on a small
pool of threads so one long prompt does not hold the others. Any unexpected exception is a 500
whose body says nothing of it (the log has it, once).

A client that goes away is noticed at once, streaming or not (a task waits for the ASGI
disconnect message), and its request is aborted, so its KV blocks are back within one engine step.
``drain`` (called by the uvicorn server on SIGTERM / SIGINT) refuses new requests with 503, lets
running ones finish for the shutdown timeout, then ends each one still open with a last chunk
(``finish_reason`` "abort"), an error event and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import queue
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Iterable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rosecli import __version__ as rosecli_version
from rosecli.engine.errors import OverloadedError, RequestError, RoseError
from rosecli.engine.logprobs import TokenText
from rosecli.engine.streaming import END, EngineDeadError
from rosecli.server import guided
from rosecli.server import protocol as p
from rosecli.server.metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger("rosecli.server")

OVERLOAD_MODES = ("reject", "wait")
OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
_DEAD_END_DELAY_S = 1.0  # after the worker dies, streams still open this long get their end synthesized

# A request body is read whole before any route runs. 4 MiB holds a prompt that fills a 128k-token
# context several times over (about 0.5 MB as text, 0.9 MB as token ids, JSON escapes of non-ASCII
# text up to 6 bytes a character) and bounds what one request can make the server hold and parse.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_READ_TIMEOUT_S = 30.0  # for a request's headers and for its body, each
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
# The torch profiler pauses the engine thread while it starts and while it stops and collects its
# events (about 2 s after a 3 s window of the tiny CPU model), in proportion to what it recorded:
# a short window by default, a bounded one at most.
DEFAULT_PROFILE_SECONDS = 5.0
MAX_PROFILE_SECONDS = 60.0


class _Ended:
    """Queue items the server itself puts in a request's queue (besides the engine's END)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


_GONE = _Ended("GONE")  # the client disconnected
_SHUTDOWN = _Ended("SHUTDOWN")  # the shutdown timeout ran out


def _sse(obj: Union[dict, str]) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


def _error_response(e: p.APIError, close: bool = False) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else {}
    if close:
        headers["Connection"] = "close"
    return JSONResponse(e.body(), e.status, headers=headers)


class _Bridge:
    """Carries ``(request_id, piece)`` items from the engine worker to asyncio queues, as
    ``(choice index, piece)``: the choices of one HTTP request (``n``) share one queue."""

    def __init__(self, manager, on_engine_dead: Callable[[], None]):
        self.manager = manager
        self.sink: queue.SimpleQueue = queue.SimpleQueue()
        self.queues: dict[int, asyncio.Queue] = {}
        self.index: dict[int, int] = {}  # request id -> its choice index
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

    def open(self, rids: list[int], on_end: Optional[Callable[[], None]] = None) -> asyncio.Queue:
        """Call on the loop right after ``add_request`` / ``add_choices`` (no await between: no
        piece can be missed). ``on_end`` is called once every choice has ended."""
        q: asyncio.Queue = asyncio.Queue()
        left = [len(rids)]

        def one_ended() -> None:
            left[0] -= 1
            if not left[0]:
                on_end()

        for i, rid in enumerate(rids):
            self.queues[rid] = q
            self.index[rid] = i
            if on_end is not None:
                self.on_end[rid] = one_ended
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
            q.put_nowait((self.index[rid], item))
            if item is END:
                self._close(rid)

    def _close(self, rid: int) -> None:
        self.queues.pop(rid, None)
        self.index.pop(rid, None)
        release = self.on_end.pop(rid, None)
        if release is not None:
            release()

    def _engine_died(self) -> None:
        e = self.manager.error
        log.error("the engine worker died: %s: %s", type(e).__name__, e, exc_info=e)
        self.loop.call_later(_DEAD_END_DELAY_S, self._end_all)
        self._on_engine_dead()

    def _end_all(self) -> None:
        """A request added while the worker was dying may never get its END: end it here."""
        for rid, q in list(self.queues.items()):
            q.put_nowait((self.index[rid], END))
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
        e = p.APIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'.",
                       p.INVALID_REQUEST, None, p.INVALID_API_KEY)
        await JSONResponse(e.body(), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


class _RequestLimits:
    """Pure ASGI: reads the whole request body before the app runs, within ``max_bytes`` (413,
    at once when Content-Length says so) and ``read_timeout`` seconds (408: a body that stops
    arriving, or is short of its Content-Length, cannot hold its connection), then replays it.
    Later ``receive`` calls reach the server's own, so the app still hears of a disconnect."""

    def __init__(self, app, max_bytes: int, read_timeout: float, on_reject: Callable[[int], None]):
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout
        self.on_reject = on_reject

    async def _refuse(self, e: p.APIError, scope, receive, send) -> None:
        self.on_reject(e.status)
        await _error_response(e, close=True)(scope, receive, send)

    def _too_large(self) -> p.APIError:
        return p.APIError(413, f"The request body is larger than this server's limit of {self.max_bytes} bytes "
                          "(--max-request-bytes).", p.INVALID_REQUEST, None, p.REQUEST_TOO_LARGE)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and int(length) > self.max_bytes:  # the HTTP parser has checked it is a number
            return await self._refuse(self._too_large(), scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                e = p.APIError(408, f"The request body did not arrive within {self.read_timeout:g} s "
                               "(--read-timeout).", p.INVALID_REQUEST, None, p.REQUEST_TIMEOUT)
                return await self._refuse(e, scope, receive, send)
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._refuse(self._too_large(), scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay: Optional[dict] = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def receive_replayed():
            nonlocal replay
            if replay is not None:
                message, replay = replay, None
                return message
            return await receive()

        await self.app(scope, receive_replayed, send)


class _InternalErrors:
    """Pure ASGI, outermost: an exception nothing else handled is logged once, here, and answered
    with a 500 that says nothing of it (a stream already under way is just ended)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracking(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await _error_response(p.internal_error(), close=True)(scope, receive, send)


async def _wait_disconnect(receive, on_gone: Callable[[], None]) -> None:
    """Wait for the ASGI disconnect message (the body has been read: nothing else can come)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_gone()
            return


class _Choices:
    """The choices of one generation request (``n`` for each of its prompts: choice i is choice i % n of prompt
    i // n, as vLLM numbers a batch of completions prompts): their request ids, which have ended, their outputs, and
    their chunks and choices in the endpoint's shape (the echoed prompt, logprobs, and vLLM's fields `vllm_fields`
    adds when ``req`` asks for them)."""

    def __init__(self, server: "_Server", env: p.Envelope, rids: list[int], params, prompt_ids: list[list[int]],
                 echoes: Optional[list[str]], req: Optional[p.SamplingRequest] = None):
        self.env, self.rids, self.prompt_ids = env, rids, prompt_ids
        self.n = len(rids) // len(prompt_ids)
        self.ended = [False] * len(rids)
        self.outputs: list = [None] * len(rids)
        self.echoes = echoes  # each prompt's text, to send before its choices' first text (``echo``)
        self.echoed = [echoes is None] * len(rids)
        as_ids = getattr(req, "return_tokens_as_token_ids", False)
        self.text = text = p.token_id_text if as_ids else server.token_text()
        self.formats = ([p.LogprobsFormat(env.chat, text) for _ in rids] if params.logprobs is not None else None)
        self.return_ids = getattr(req, "return_token_ids", False)  # vLLM's return_token_ids
        self.prompt_k = getattr(req, "prompt_logprobs", None)  # vLLM's prompt_logprobs
        self.extras = self.return_ids or self.prompt_k is not None
        self.ids_sent = [False] * len(rids)  # a streamed choice's prompt ids went out (completions)
        self.prompt_lp_sent = [False] * len(rids)  # ... its prompt logprobs (chat: [0], once for all)

    def open_rids(self) -> list[int]:
        return [rid for rid, ended in zip(self.rids, self.ended) if not ended]

    def _text_and_logprobs(self, i: int, text: str, entries: list, prompt_logprobs) -> tuple[str, Optional[dict]]:
        """The text of choice i's next chunk (the echoed prompt first) and its logprobs."""
        echo = not self.echoed[i]
        self.echoed[i] = True
        if self.formats is None:
            return (self.echoes[i // self.n] + text if echo else text), None
        if echo:
            return (self.echoes[i // self.n] + text,
                    self.formats[i](entries, self.prompt_ids[i // self.n], prompt_logprobs))
        return text, self.formats[i](entries)

    def piece_event(self, i: int, piece: str, include_usage: bool) -> str:
        """The SSE event of choice i's next piece (plain text: from the envelope's template)."""
        if self.formats is None and self.echoed[i] and not self.extras:
            return self.env.text_event(piece, include_usage, i)
        return _sse(self.piece_chunk(i, piece, include_usage))

    def piece_chunk(self, i: int, piece: str, include_usage: bool) -> dict:
        prompt_lp = getattr(piece, "prompt_logprobs", None)
        text, lp = self._text_and_logprobs(i, piece, getattr(piece, "logprobs", []), prompt_lp)
        return self.vllm_fields(self.env.chunk(text=text, include_usage=include_usage, index=i, logprobs=lp),
                                prompt_lp)

    def final_chunk(self, i: int, include_usage: bool) -> dict:
        out = self.outputs[i]
        text, lp = None if self.env.chat else "", None
        if not self.echoed[i]:  # no piece came: the prompt and the logprobs of whatever there was
            text, lp = self._text_and_logprobs(i, "", out.logprobs or [], out.prompt_logprobs)
        body = self.env.chunk(text=text, finish=p.finish_reason(out.finish_reason), include_usage=include_usage,
                              index=i, logprobs=lp)
        return self.vllm_fields(body, out.prompt_logprobs, final=True)

    def vllm_fields(self, body: dict, prompt_lp: Optional[list] = None, final: bool = False,
                    first: bool = False) -> dict:
        """A chunk (of one choice; ``final``: its last; ``first``: the stream's first) or, with ``final`` and
        ``first``, a whole response, with the vLLM fields the request asked for. ``return_token_ids``: the prompt's
        ids (chat: on the response or the stream's first chunk; completions: on each choice, streamed in its first
        chunk) and each choice's generated ids (all of them in the response or a choice's last chunk, [] in the
        chunks before). ``prompt_logprobs``: from ``prompt_lp`` (a response: each choice's output), the first time
        they come (chat: on the chunk or response, once for every choice; completions: on the choice)."""
        if not self.extras:
            return body
        chat = self.env.chat
        if self.return_ids and chat and first:
            body["prompt_token_ids"] = list(self.prompt_ids[0])
        for c in body["choices"]:
            j = c["index"]
            entries = self.outputs[j].prompt_logprobs if final and first else prompt_lp
            at = 0 if chat else j
            if self.prompt_k is not None and entries is not None and not self.prompt_lp_sent[at]:
                (body if chat else c)["prompt_logprobs"] = p.prompt_logprobs_body(entries, self.prompt_k, self.text)
                self.prompt_lp_sent[at] = True
            if self.return_ids:
                if not chat and not self.ids_sent[j]:
                    c["prompt_token_ids"] = list(self.prompt_ids[j // self.n])
                    self.ids_sent[j] = True
                c["token_ids"] = list(self.outputs[j].token_ids or []) if final else []
        return body

    def usage(self) -> dict:
        firsts = self.outputs[::self.n]  # each prompt counted once, whatever its n
        return p.usage(sum(o.prompt_tokens for o in firsts), sum(o.output_tokens for o in self.outputs),
                       sum(o.cached_tokens for o in firsts))

    def response(self) -> dict:
        choices = []
        for i, o in enumerate(self.outputs):
            text, lp = self._text_and_logprobs(i, o.text, o.logprobs or [], o.prompt_logprobs)
            choices.append((text, p.finish_reason(o.finish_reason), lp))
        return self.vllm_fields(self.env.response(choices, self.usage()), final=True, first=True)


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
        self.inputs = engine.inputs
        self.max_prompt_chars = self.inputs.max_prompt_chars
        # the model's tool-call format, for tool_choice "auto" (None: none this server parses)
        self.tool_format = guided.tool_format(getattr(self.inputs.tokenizer, "chat_template", None))
        self.created = p.now()
        self.metrics = ServerMetrics(manager)
        self.user_on_engine_dead = on_engine_dead
        self.bridge = _Bridge(manager, self._engine_dead)
        # tokenizers release the GIL: a few threads let a short prompt pass a long one
        self.tokenize_pool = ThreadPoolExecutor(min(4, max(2, os.cpu_count() or 1)),
                                                thread_name_prefix="rose-server-tokenize")
        self.max_inflight = limit = engine.config.max_inflight_requests
        self.room: Optional[asyncio.Semaphore] = (asyncio.Semaphore(limit) if overload == "wait" and limit
                                                  else None)
        self.active = 0  # generation requests between arrival and their last byte
        self.draining = False  # shutdown began: new requests are refused
        self.closing = False  # the shutdown timeout ran out: open requests are being ended
        self._grammar_checker = None  # compiles grammars here when the engine is in another process
        self.profiler: Optional[tuple] = None  # (torch profiler, trace path, auto-stop timer)
        self.export_pool = ThreadPoolExecutor(1, thread_name_prefix="rose-server-profile-export")
        self._token_text: Optional[TokenText] = None  # logprobs' token strings, made on first use

    def _engine_dead(self) -> None:
        if self.user_on_engine_dead is not None:
            self.user_on_engine_dead()

    # --- request -> engine ------------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise p.APIError(404, f"The model `{model}` does not exist. This server serves "
                             f"`{self.model_name}` (see GET /v1/models).", p.INVALID_REQUEST, "model",
                             p.MODEL_NOT_FOUND)

    def check_alive(self) -> None:
        if not self.manager.is_alive:
            raise p.engine_dead()

    def check_prompt_chars(self, req: p.SamplingRequest, param: str) -> None:
        """Refuse, without tokenizing it, a prompt with more characters than the context can hold
        tokens of: no token covers more characters than the longest vocabulary entry."""
        messages = len(getattr(req, "messages", ()))
        if messages > self.max_model_len:  # a chat template spends at least a token on each message
            raise p.bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"your conversation has {messages} messages: shorten it.", param,
                                p.CONTEXT_LENGTH_EXCEEDED)
        chars = p.prompt_chars(req)
        if chars > self.max_prompt_chars:
            raise p.bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"your prompt has {chars} characters, more than that many tokens can hold: "
                                "shorten it.", param, p.CONTEXT_LENGTH_EXCEEDED)

    def _encode_completion(self, prompt: Union[str, list[int]], add_special_tokens: bool = True) -> list[int]:
        return self.inputs.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)

    def _encode_chat(self, messages: list[dict], tools: Optional[list] = None, template_kwargs: Optional[dict] = None,
                     continue_final_message: bool = False, add_generation_prompt: bool = True) -> list[int]:
        if not self.inputs.has_chat_template:
            raise p.bad_request(f"the model {self.model_name} has no chat template: use /v1/completions",
                                "messages")
        try:
            return self.inputs.chat(messages, tools=tools or None, template_kwargs=template_kwargs,
                                    continue_final_message=continue_final_message,
                                    add_generation_prompt=add_generation_prompt)
        except RequestError as e:
            if e.__cause__ is not None:
                log.info("the chat template failed on a request's messages: %s: %s",
                         type(e.__cause__).__name__, e.__cause__)
            raise p.bad_request(str(e), "messages") from None

    async def tokenize(self, fn, *args) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    async def compile_grammar(self, spec) -> None:
        """Compile (or find cached) a request's grammar off the event loop, before it is admitted:
        one that does not compile, or a server without the library, is a 400 naming the field."""
        structured = getattr(self.engine, "structured", None)
        if structured is None:  # the engine runs in its own process: check it here, on a compiler of our own
            structured = self._grammar_checker
            if structured is None:
                from rosecli.engine.structured import StructuredOutput

                tok = self.engine.tokenizer
                eos = [tok.eos_token_id] if getattr(tok, "eos_token_id", None) is not None else []
                structured = self._grammar_checker = StructuredOutput(tok, self.inputs.vocab_size, eos, "cpu", 1)
        try:
            await self.tokenize(structured.compile, spec)
        except RequestError as e:
            raise p.bad_request(str(e), e.param) from None

    async def submit(self, groups: list[tuple[list[int], list]],
                     prompt_param: str) -> tuple[list[int], asyncio.Queue]:
        """Hand the request's prompts, each with its choices (one `SamplingParams` each), to the manager, whose
        input processor checks each prompt (a 400 names the field it is about, and which prompt of several). All
        of them are added or none: what was added before one that fails is aborted."""
        self.check_alive()
        if self.closing:
            raise p.shutting_down()
        total = sum(len(params) for _, params in groups)
        if self.max_inflight and total > self.max_inflight:  # it could never be admitted: not a 429 to retry
            what = (f"prompt holds {len(groups)} prompts, {total} requests with n" if len(groups) > 1
                    else f"n={total} is {total} requests")
            raise p.bad_request(f"{what}: more than --max-inflight-requests {self.max_inflight} lets run at once",
                                "prompt" if len(groups) > 1 else "n")
        if self.room is not None:
            await self.room.acquire()
        rids: list[int] = []
        at = 0
        try:
            if self.closing:  # the shutdown timeout ran out while this request waited for room
                raise p.shutting_down()
            while True:
                rids = []
                try:
                    for at, (ids, params) in enumerate(groups):
                        if len(params) == 1:
                            rids.append(self.manager.add_request(ids, params[0], wait=False, sink=self.bridge.sink))
                        else:
                            rids += self.manager.add_choices(ids, params, wait=False, sink=self.bridge.sink)
                    break
                except OverloadedError as e:
                    self._abort_all(rids)
                    rids = []
                    if self.overload != "wait":
                        raise p.APIError(429, f"the server is overloaded: {e}", p.RATE_LIMIT, None,
                                         p.RATE_LIMIT_EXCEEDED) from None
                    if self.closing:
                        raise p.shutting_down() from None
                    await asyncio.sleep(0.005)  # the slot is released just before the END we wait on
        except RequestError as e:
            self._abort_all(rids)
            self._release_room()
            param = prompt_param if e.param == "prompt" else e.param
            where = f"prompt[{at}]: " if len(groups) > 1 else ""
            raise p.bad_request(where + str(e), f"prompt[{at}]" if where and param == "prompt" else param) from None
        except EngineDeadError:
            self._abort_all(rids)
            self._release_room()
            raise p.engine_dead() from None
        except BaseException:
            self._abort_all(rids)
            self._release_room()
            raise
        return rids, self.bridge.open(rids, self._release_room if self.room is not None else None)

    def _abort_all(self, rids: list[int]) -> None:
        """End requests added for an HTTP request that is not going ahead (a later prompt of it failed)."""
        for rid in rids:
            self.manager.abort(rid)

    def _release_room(self) -> None:
        if self.room is not None:
            self.room.release()

    def output(self, rid: int):
        """The finished request's RequestOutput; raises the engine's error if it failed."""
        try:
            return self.manager.take_output(rid)
        except KeyError:
            raise EngineDeadError("the engine stopped before this request finished") from None

    @staticmethod
    def _engine_failure(e: RoseError) -> p.APIError:
        """A request the engine ended with an error, as the client hears of it: a request error's
        message is written for the user; anything else is only named by its code."""
        if isinstance(e, RequestError):
            return p.bad_request(str(e), getattr(e, "param", None) or "prompt")
        log.warning("a request ended with an engine error: %s: %s", type(e).__name__, e)
        return p.engine_dead() if isinstance(e, EngineDeadError) else p.internal_error()

    # --- one generation request -------------------------------------------------------------
    async def generate(self, request: Request, model_cls: type, chat: bool):
        arrival = time.perf_counter()
        if self.draining:
            raise p.shutting_down()
        req = p.parse_body(await request.body(), model_cls)
        self.active += 1
        handed_off = False
        try:
            response = await self._generate(request, req, chat, arrival)
            handed_off = isinstance(response, StreamingResponse)
            return response
        finally:
            if not handed_off:
                self.active -= 1

    async def _generate(self, request: Request, req: p.SamplingRequest, chat: bool, arrival: float):
        req.check_unsupported()
        self.check_model(req.model)
        self.check_alive()
        prompt_param = "messages" if chat else "prompt"
        keep = req.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if keep > self.max_model_len:
                raise p.bad_request(f"truncate_prompt_tokens ({keep}) must not exceed the model's context of "
                                    f"{self.max_model_len} tokens", "truncate_prompt_tokens")
        else:  # (a prompt to be cut to its last tokens may be longer than the context)
            self.check_prompt_chars(req, prompt_param)
        spec, tools = guided.grammar_spec(req, self.tool_format)
        if chat:
            prompts = None
            batch = [await self.tokenize(self._encode_chat, req.template_messages(), req.tools if tools else None,
                                         req.template_kwargs(), req.continue_final_message,
                                         req.add_generation_prompt)]
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            default_max = None  # the rest of the context, as vLLM
        else:
            prompts = p.completion_prompts(req)
            encode = functools.partial(self._encode_completion, add_special_tokens=req.add_special_tokens is not False)
            batch = ([await self.tokenize(encode, prompts[0])] if len(prompts) == 1 else
                     list(await asyncio.gather(*(self.tokenize(encode, x) for x in prompts))))
            max_tokens = req.max_tokens
            default_max = 16  # OpenAI's default for completions
        cut = [keep is not None and len(ids) > keep for ids in batch]
        if any(cut):  # vLLM's truncate_prompt_tokens: each prompt's last ``keep`` tokens
            batch = [ids[-keep:] for ids in batch]
        params = []
        for i, ids in enumerate(batch):
            try:
                params.append(p.sampling_params(req, len(ids), self.max_model_len, default_max_tokens=default_max,
                                                max_tokens=max_tokens, prompt_param=prompt_param,
                                                inputs=self.inputs, structured=spec))
            except p.APIError as e:
                if len(batch) > 1:  # which prompt of the batch
                    e.message = f"prompt[{i}]: {e.message}"
                raise
        if tools is not None and req.num_choices > 1:
            raise p.bad_request("n must be 1 with tools: one tool-call message is returned", "n")
        if spec is not None:
            await self.compile_grammar(spec)
        rids, q = await self.submit([(ids, p.choice_params(pr, req.num_choices)) for ids, pr in zip(batch, params)],
                                    prompt_param)
        env = p.Envelope(chat, req.model or self.model_name)
        echoes = None
        if getattr(req, "echo", False):
            echoes = [x if isinstance(x, str) and not c else self.inputs.tokenizer.decode(ids)
                      for x, ids, c in zip(prompts, batch, cut)]
        out = _Choices(self, env, rids, params[0], batch, echoes, req)
        headers = {"x-request-id": env.id}
        if req.stream:
            stream = (self._stream(out, q, req.include_usage, arrival) if tools is None
                      else self._stream_tools(out, q, req.include_usage, arrival, tools))
            return StreamingResponse(stream,
                                     media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(request, out, q, arrival, headers, tools)

    # --- /tokenize, /detokenize (vLLM's) -----------------------------------------------------
    async def tokenize_body(self, request: Request) -> dict:
        """The ids a prompt or a conversation becomes, as the generation endpoints tokenize them."""
        req = p.parse_body(await request.body(), p.TokenizeRequest)
        self.check_model(req.model)
        req.check()
        if req.messages is not None:
            ids = await self.tokenize(self._encode_chat, p.template_messages(req.messages), req.tools,
                                      req.chat_template_kwargs, req.continue_final_message, req.add_generation_prompt)
        else:  # (as /v1/completions: the tokenizer's special tokens unless add_special_tokens is false)
            ids = await self.tokenize(self._encode_completion, req.prompt, req.add_special_tokens is not False)
        ids = list(ids)
        strs = self.inputs.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize_body(self, request: Request) -> dict:
        req = p.parse_body(await request.body(), p.DetokenizeRequest)
        self.check_model(req.model)
        try:
            self.inputs.check_token_ids(req.tokens, "tokens")
        except RequestError as e:
            raise p.bad_request(str(e), "tokens") from None
        return {"prompt": await self.tokenize(self.inputs.tokenizer.decode, req.tokens)}

    def token_text(self):
        if self._token_text is None:
            self._token_text = TokenText(self.inputs.tokenizer)
        return self._token_text

    def _ended_early(self, rid: int, q: asyncio.Queue, why: _Ended) -> None:
        q.put_nowait((None, why))
        self.manager.abort(rid)

    def _stream_error(self, env: p.Envelope, e: p.APIError, finish: str, include_usage: bool,
                      choices: Iterable[int] = (0,)) -> list[str]:
        """The end of a stream that could not finish: a last chunk with ``finish`` for each of the ``choices``
        still open, the error event (the same body a JSON error has), ``[DONE]``."""
        return [*(_sse(env.chunk(text=None if env.chat else "", finish=finish, include_usage=include_usage, index=i))
                  for i in choices), _sse(e.body()), _sse("[DONE]")]

    def _finish_choices(self, out: "_Choices", arrival: float) -> None:
        """Abort and count the choices still open (the client went away, another choice failed)."""
        for rid in out.open_rids():
            self.manager.abort(rid)
            self.metrics.finished("abort", arrival)
        out.ended = [True] * len(out.rids)

    async def _stream(self, out: "_Choices", q: asyncio.Queue, include_usage: bool,
                      arrival: float) -> AsyncIterator[str]:
        env = out.env
        try:
            if env.chat:
                yield "".join(_sse(out.vllm_fields(env.chunk(text="", role=True, include_usage=include_usage,
                                                             index=i), first=i == 0))
                              for i in range(len(out.rids)))
            while not all(out.ended):
                # every item already queued goes out in one write (one event each): when the loop
                # runs behind the engine, a stream costs one send per wake-up, not one per token
                events = []
                item = await q.get()
                while True:
                    i, piece = item
                    if piece is _SHUTDOWN:  # aborted already
                        open_ = [j for j, ended in enumerate(out.ended) if not ended]
                        self._finish_choices(out, arrival)
                        if events:
                            yield "".join(events)
                        yield "".join(self._stream_error(env, p.shutting_down(), "abort", include_usage, open_))
                        return
                    if piece is not END:
                        events.append(out.piece_event(i, piece, include_usage))
                    else:
                        out.ended[i] = True
                        try:
                            o = self.output(out.rids[i])
                        except RoseError as e:
                            self.metrics.finished("error", arrival)
                            open_ = [j for j, ended in enumerate(out.ended) if not ended or j == i]
                            self._finish_choices(out, arrival)
                            if events:
                                yield "".join(events)
                            yield "".join(self._stream_error(env, self._engine_failure(e), "error", include_usage,
                                                             open_))
                            return
                        out.outputs[i] = o
                        self.metrics.finished(p.finish_reason(o.finish_reason), arrival, o)
                        events.append(_sse(out.final_chunk(i, include_usage)))
                    if all(out.ended) or q.empty():
                        break
                    item = q.get_nowait()
                if all(out.ended):
                    if include_usage:
                        events.append(_sse(env.usage_chunk(out.usage())))
                    events.append(_sse("[DONE]"))
                yield "".join(events)
        finally:
            self._finish_choices(out, arrival)  # the client went away: free the requests now
            self.active -= 1

    async def _stream_tools(self, out: "_Choices", q: asyncio.Queue, include_usage: bool, arrival: float,
                            tools: Union[guided.ToolMode, guided.AutoTools]) -> AsyncIterator[str]:
        """A chat stream of one choice whose output becomes tool calls. A named function's arguments stream as
        deltas as they come; calls as an array ("required") are sent whole once parsed; under "auto" the content
        streams up to where a call (in the model's format) starts or could start, and the rest is sent at the end
        as the calls if it parses as them. What is left unsent at the end (no call, or cut short) goes as text."""
        env = out.env
        auto = isinstance(tools, guided.AutoTools)
        named = not auto and tools.name is not None
        text, sent = "", 0
        try:
            # (a tool-call message has no content, unless "auto" finds none)
            yield _sse(out.vllm_fields(env.chunk(text="" if auto else None, role=True, include_usage=include_usage),
                                       first=True))
            if named:
                yield _sse(env.tool_chunk([{"index": 0, **guided.tool_call(tools.name, "")}], include_usage))
            last = None
            while last is not END:
                _, piece = await q.get()
                while True:
                    if piece is END or piece is _SHUTDOWN:
                        last = piece
                        break
                    text += piece
                    if q.empty():
                        break
                    _, piece = q.get_nowait()
                upto = len(text) if named else tools.streamable(text) if auto else 0
                if upto > sent:
                    new = text[sent:upto]
                    yield (_sse(env.tool_chunk([{"index": 0, "function": {"arguments": new}}], include_usage))
                           if named else env.text_event(new, include_usage))
                    sent = upto
                if last is _SHUTDOWN:
                    self._finish_choices(out, arrival)
                    yield "".join(self._stream_error(env, p.shutting_down(), "abort", include_usage))
                    return
            out.ended[0] = True
            try:
                o = out.outputs[0] = self.output(out.rids[0])
            except RoseError as e:
                self.metrics.finished("error", arrival)
                yield "".join(self._stream_error(env, self._engine_failure(e), "error", include_usage))
                return
            self.metrics.finished(p.finish_reason(o.finish_reason), arrival, o)
            finish = p.finish_reason(o.finish_reason)
            calls = None if named else tools.split(o.text)[1] if auto else tools.calls(o.text)
            tail = []
            if calls:
                tail.append(_sse(env.tool_chunk([{"index": i, **c} for i, c in enumerate(calls)], include_usage)))
            elif not named and len(o.text) > sent:
                tail.append(env.text_event(o.text[sent:], include_usage))
            if finish == "stop" and (calls or not auto):
                finish = "tool_calls"
            tail.append(_sse(out.vllm_fields(env.chunk(text=None, finish=finish, include_usage=include_usage),
                                             o.prompt_logprobs, final=True)))
            if include_usage:
                tail.append(_sse(env.usage_chunk(out.usage())))
            tail.append(_sse("[DONE]"))
            yield "".join(tail)
        finally:
            self._finish_choices(out, arrival)  # the client went away: free the request now
            self.active -= 1

    async def _complete(self, request: Request, out: "_Choices", q: asyncio.Queue, arrival: float,
                        headers: dict, tools: Union[guided.ToolMode, guided.AutoTools, None] = None) -> Response:
        def gone() -> None:
            q.put_nowait((None, _GONE))
            for rid in out.open_rids():
                self.manager.abort(rid)

        watcher = asyncio.ensure_future(_wait_disconnect(request.receive, gone))
        try:
            while not all(out.ended):
                i, piece = await q.get()
                if piece is _GONE:
                    return Response(status_code=499)  # nobody reads it; the finally counts the abort
                if piece is _SHUTDOWN:
                    raise p.shutting_down()
                if piece is not END:
                    continue
                out.ended[i] = True
                try:
                    out.outputs[i] = self.output(out.rids[i])
                except RoseError as e:
                    self.metrics.finished("error", arrival)
                    raise self._engine_failure(e) from None
            for o in out.outputs:
                self.metrics.finished(p.finish_reason(o.finish_reason), arrival, o)
            if tools is not None:  # one choice (n > 1 is refused with tools): its text is the calls
                o = out.outputs[0]
                reason = p.finish_reason(o.finish_reason)
                content, calls = (tools.split(o.text) if isinstance(tools, guided.AutoTools)
                                  else (None, tools.calls(o.text)))
                if calls and reason == "stop":
                    reason = "tool_calls"
                body = out.env.response([(o.text, reason, None)], out.usage(), calls, content)
                return JSONResponse(out.vllm_fields(body, final=True, first=True), headers=headers)
            return JSONResponse(out.response(), headers=headers)
        finally:
            watcher.cancel()
            self._finish_choices(out, arrival)

    # --- shutdown -----------------------------------------------------------------------------
    async def drain(self, timeout: float, force: Callable[[], bool] = lambda: False) -> None:
        """Refuse new generation requests (503), give running ones ``timeout`` seconds, then end
        each one still open: a stream gets its last chunk, an error event and [DONE], a
        non-streaming request a 503."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self.active:
            log.info("shutting down: waiting up to %g s for %d running request(s)", timeout, self.active)
        while self.active and loop.time() < deadline and not force():
            await asyncio.sleep(0.05)
        if not self.active:
            return
        self.closing = True
        log.warning("shutting down: ending %d request(s) still running after %g s", self.active, timeout)
        for rid, q in list(self.bridge.queues.items()):
            self._ended_early(rid, q, _SHUTDOWN)
        end = loop.time() + 2.0  # for their last events to be written
        while self.active and loop.time() < end and not force():
            await asyncio.sleep(0.02)

    # --- profiling --------------------------------------------------------------------------
    async def start_profile(self, seconds: float) -> dict:
        if self.profiler is not None:
            raise p.bad_request("the profiler is already running: POST /stop_profile first")
        self.check_alive()
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and self.engine.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities)
        path = os.path.abspath(os.path.join(
            self.profile_dir, f"rose-trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{id(prof):x}.json"))
        loop = asyncio.get_running_loop()
        self.profiler = (prof, path, None)  # before any await: a second start sees it
        try:
            self.engine.stages.enable_torch_trace(True)
            # the profiler records the thread that starts it
            await loop.run_in_executor(None, self.manager.call_on_worker, prof.start)
        except BaseException:
            self.engine.stages.enable_torch_trace(False)
            self.profiler = None
            raise
        timer = loop.call_later(seconds, lambda: asyncio.ensure_future(self._auto_stop_profile()))
        self.profiler = (prof, path, timer)
        log.info("profiling for at most %g s; the trace will be %s", seconds, path)
        return {"status": "started", "activities": [a.name for a in activities], "seconds": seconds,
                "trace": path}

    async def _auto_stop_profile(self) -> None:
        try:
            path = await self.stop_profile()
            log.info("profiling window over: trace written to %s", path["trace"])
        except Exception as e:  # stopped by hand meanwhile, or the engine died: nothing to save
            log.warning("could not stop the profiler at the end of its window: %s", e)

    async def stop_profile(self) -> dict:
        if self.profiler is None or self.profiler[2] is None:
            raise p.bad_request("the profiler is not running: POST /start_profile first")
        prof, path, timer = self.profiler
        self.profiler = None
        timer.cancel()
        self.engine.stages.enable_torch_trace(False)
        loop = asyncio.get_running_loop()
        if not self.manager.is_alive:
            raise p.engine_dead()
        await loop.run_in_executor(None, self.manager.call_on_worker, prof.stop)
        # Writing the trace (hundreds of MB for a long window) happens on a thread of its own, and the
        # C++ writer lets the engine thread run meanwhile: generation goes on during the export.
        await loop.run_in_executor(self.export_pool, _export_trace, prof, path)
        return {"status": "stopped", "trace": path}

    def close(self) -> None:
        if self.profiler is not None and self.profiler[2] is not None:
            prof, path, timer = self.profiler
            self.profiler = None
            timer.cancel()
            try:
                self.manager.call_on_worker(prof.stop, timeout=10)
                _export_trace(prof, path)
            except Exception as e:  # a dead engine cannot stop it; nothing to save then
                log.warning("could not save the profile on shutdown: %s", e)
        self.manager.close()  # streams still open end with an error; the bridge delivers it, then stops
        self.bridge.stop()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.export_pool.shutdown(wait=True)


def _export_trace(prof, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    prof.export_chrome_trace(path)


async def _json_object_body(request: Request) -> dict:
    """A control endpoint's body: only with Content-Type application/json (a browser cannot send
    that cross-site without a CORS preflight, which this server never grants); empty means {}."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise p.APIError(415, "send this request with Content-Type: application/json (a JSON object body, "
                         "or none)", p.INVALID_REQUEST, None, p.UNSUPPORTED_MEDIA_TYPE)
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=p._refuse_constant)
    except (ValueError, RecursionError):
        raise p.bad_request("the request body is not valid JSON", None, p.INVALID_JSON) from None
    if not isinstance(obj, dict):
        raise p.bad_request("the request body must be a JSON object", None, p.INVALID_TYPE)
    return obj


def create_app(manager, engine, *, api_key: Optional[str] = None, served_model_name: Optional[str] = None,
               overload: str = "reject", profile_dir: Optional[str] = None,
               on_engine_dead: Optional[Callable[[], None]] = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               read_timeout: float = DEFAULT_READ_TIMEOUT_S, read_ceiling_gbs: Optional[float] = None) -> FastAPI:
    """The app; its lifespan starts the bridge and, at shutdown, closes the manager (in-flight
    streams still open then end with an error event). ``on_engine_dead`` is called once, on the
    event loop, when the engine worker dies. The uvicorn server of ``rosecli.server.uvicorn_server`` calls
    ``app.state.rose.drain`` on SIGTERM / SIGINT. ``read_ceiling_gbs``: the device's read ceiling
    (`rosecli.engine.roofline`), reported by ``GET /roofline`` with the decode counts `rose bench
    serve` reads before and after each run (null on CPU)."""
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

    app = FastAPI(title="rose serve-local", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.rose = server
    # outermost last: errors -> API key (before a body is buffered) -> body limits -> routes
    app.add_middleware(_RequestLimits, max_bytes=max_request_bytes, read_timeout=read_timeout,
                       on_reject=lambda status: server.metrics.rejected.labels(str(status)).inc())
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(_InternalErrors)

    @app.exception_handler(p.APIError)
    async def _api_error(request: Request, e: p.APIError):
        server.metrics.rejected.labels(str(e.status)).inc()
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: p.NOT_FOUND, 405: p.METHOD_NOT_ALLOWED}.get(e.status_code)
        kind = p.INVALID_REQUEST if e.status_code < 500 else p.SERVER_ERROR
        return JSONResponse(p.error_body(str(e.detail), kind, None, code), e.status_code,
                            headers=getattr(e, "headers", None))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.generate(request, p.CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.generate(request, p.ChatCompletionRequest, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await server.tokenize_body(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await server.detokenize_body(request)

    @app.get("/version")
    async def version():
        return {"version": rosecli_version}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [p.model_card(server.model_name, server.max_model_len, server.created)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):  # OpenAI's retrieve (`client.models.retrieve`)
        server.check_model(model)
        return p.model_card(server.model_name, server.max_model_len, server.created)

    @app.get("/health")
    async def health():
        if not manager.is_alive:
            return JSONResponse({"status": "engine_dead", "message": "the engine worker is not running; the "
                                 "server log has the details"}, 503)
        if server.draining:
            return JSONResponse({"status": "shutting_down"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    from rosecli.engine.roofline import decode_bytes

    # an engine in another process (--engine-process) sends what its model reads per decode step
    weights = getattr(engine, "decode_weights", None) or decode_bytes(engine.loaded.model, engine.dtype).as_dict()

    @app.get("/roofline")
    async def roofline():
        """What a decode step reads (bytes), the decode counts so far and the device's read ceiling."""
        counts = await asyncio.get_running_loop().run_in_executor(None, manager.decode_counts)
        return {"device": engine.device.type, "read_ceiling_gbs": read_ceiling_gbs, **weights, **counts}

    def profiling_on() -> None:
        if server.profile_dir is None:
            raise p.APIError(404, "profiling is off: start the server with --profile-dir DIR", p.INVALID_REQUEST,
                             None, p.NOT_FOUND)

    @app.post("/start_profile")
    async def start_profile(request: Request):
        profiling_on()
        body = await _json_object_body(request)
        seconds = body.get("seconds", DEFAULT_PROFILE_SECONDS)
        if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                or not 0 < seconds <= MAX_PROFILE_SECONDS):
            raise p.bad_request(f"seconds must be a number in (0, {MAX_PROFILE_SECONDS:g}], got {seconds!r}",
                                "seconds")
        return await server.start_profile(float(seconds))

    @app.post("/stop_profile")
    async def stop_profile(request: Request):
        profiling_on()
        await _json_object_body(request)
        return await server.stop_profile()

    return app
