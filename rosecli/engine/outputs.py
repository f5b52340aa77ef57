"""Output processing: the engine's sampled tokens become each request's text, once.

One `RequestState` per request holds its incremental detokenizer (`engine/detokenizer.py`), the
text produced so far and its stream's queue. After every scheduler step, on the engine's worker
thread, `OutputProcessor.process` pushes each new token through its request's detokenizer,
looks for the request's stop strings in the new text, and puts text pieces on the queue
(every ``stream_interval`` tokens, the first token at once, and at finish).

Stop strings. The last ``len(longest stop) - 1`` characters are held back until they cannot
start a stop string, so no prefix of one ever reaches a caller. When a stop string appears, the
text is cut before it and the request is finished in the scheduler at once
(``scheduler.finish_request``), before the next step: with overlap scheduling its token in the
step already in flight is dropped, exactly as for EOS at that step, and nothing after the stop
reaches the caller. The final text is the pieces sent, concatenated.

``min_tokens`` (vLLM's semantics): the text of a request's first ``min_tokens`` tokens is never
searched for a stop string, and no stop string ends it before then; the first token after that
searches its own new text (a stop string may begin in the earlier text and end in it, as any).

Logprobs. A request that asked (``logprobs`` / ``prompt_logprobs`` in its params) gets each piece
as a `TextPiece`: the text, with the logprobs of the tokens pushed since the last piece (and, on
the first, the prompt's), so a stream's logprobs go with the text their tokens made (text held
back by a stop string or an unfinished character goes out later; its logprobs with it). A token
with no text yet keeps its logprobs for the next piece; the last piece carries whatever is left.
The output has them all (`RequestOutput.logprobs`, ``prompt_logprobs``: None for the first token).
Other requests' pieces stay plain strings.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from rosecli.engine.detokenizer import IncrementalDetokenizer
from rosecli.engine.errors import RequestFailedError
from rosecli.engine.sequence import FinishReason

log = logging.getLogger(__name__)


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
    token_ids: list[int] = field(default_factory=list)  # the output token ids (once finished)
    logprobs: Optional[list] = None  # [TokenLogprobs] for each output token, when asked
    prompt_logprobs: Optional[list] = None  # [None, TokenLogprobs, ...] for each prompt token, when asked


class TextPiece(str):
    """A piece of a request that asked for logprobs: the text, with ``logprobs`` (the
    `TokenLogprobs` of the tokens flushed with it) and ``prompt_logprobs`` (on the first piece
    when asked, else None)."""

    logprobs: list
    prompt_logprobs: Optional[list]


class _End:
    __slots__ = ()

    def __repr__(self) -> str:
        return "END"


END = _End()  # the last item of every request's stream


def find_stop(text: str, stops: list[str], start: int, keep: bool = False) -> int:
    """Where the earliest of ``stops`` that ends after ``text[start:]`` begins begins in ``text`` (``keep``: where
    it ends, the stop string kept in the output), or -1. Only a stop string that ends in the new text can be new:
    ``start`` is where it begins."""
    best, end = -1, -1
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best < 0 or i < best):
            best, end = i, i + len(s)
    return end if keep else best


class RequestState:
    """One request's text and stream, owned by the worker thread once the request is admitted."""

    __slots__ = ("rid", "params", "stops", "min_tokens", "queue", "sink", "detok", "parts", "unsent", "final_text", "bare",
                 "pending_tokens", "holdback", "prompt_tokens", "output_tokens", "finish_reason", "ts", "done",
                 "abandoned", "cached_tokens", "error", "token_ids", "logprobs", "prompt_logprobs",
                 "lp_unsent", "plp_unsent", "keep_stop")

    def __init__(self, rid: int, params, submit: float, sink: Optional[queue.SimpleQueue]):
        self.rid = rid
        self.params = params
        self.stops = params.stop
        self.keep_stop = getattr(params, "include_stop_str_in_output", False)
        self.min_tokens = getattr(params, "min_tokens", 0)
        self.sink = sink
        self.queue: queue.SimpleQueue = sink if sink is not None else queue.SimpleQueue()
        self.detok: Optional[IncrementalDetokenizer] = None
        # The text is kept as pieces already put on the queue plus the text not yet put, so that a
        # token costs no copy of all the text before it; ``text`` joins them when asked.
        self.parts: list[str] = []
        self.unsent = ""
        self.final_text: Optional[str] = None  # the whole text, once finished
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
        self.token_ids: list[int] = []
        asked = getattr(params, "logprobs", None) is not None or getattr(params, "prompt_logprobs", None) is not None
        self.logprobs: Optional[list] = [] if asked else None  # None: pieces are plain strings
        self.prompt_logprobs: Optional[list] = None
        self.lp_unsent = 0  # logprobs not yet sent with a piece (the last ones of ``logprobs``)
        self.plp_unsent = False
        self.bare = not self.stops and self.logprobs is None  # each piece goes out as the detokenizer gives it

    @property
    def text(self) -> str:
        """Detokenized so far (the whole output once finished)."""
        if self.final_text is not None:
            return self.final_text
        return "".join(self.parts) + self.unsent

    def output(self) -> RequestOutput:
        return RequestOutput(self.rid, self.text, self.prompt_tokens, self.output_tokens, self.finish_reason,
                             self.ts, self.cached_tokens, self.token_ids, self.logprobs, self.prompt_logprobs)


class OutputProcessor:
    """Turns each step's tokens into text on the requests' queues; runs on the worker thread.

    ``on_end(state)`` is called once per request, after its last item (END) is queued."""

    def __init__(self, tokenizer, scheduler, stages, stream_interval: int = 1, record_timestamps: bool = False,
                 on_end: Callable[[RequestState], None] = lambda state: None):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.stages = stages
        self.stream_interval = stream_interval
        self.record_timestamps = record_timestamps
        self.on_end = on_end

    def start(self, req: RequestState, token_ids: list[int]) -> None:
        """The request was admitted with these prompt ids: its text starts here."""
        req.detok = IncrementalDetokenizer(self.tokenizer, token_ids,
                                           skip_special_tokens=getattr(req.params, "skip_special_tokens", True))

    def process(self, tokens: dict[int, int], finished: list[int], now: float,
                requests: dict[int, RequestState], lock: threading.Lock, logprobs: Optional[dict] = None,
                prompt_logprobs: Optional[dict] = None) -> None:
        """One step's output: ``tokens`` {request id: token}, ``finished`` the ids the scheduler
        finished in it; ``requests`` (guarded by ``lock``) maps ids to their states; ``logprobs``
        and ``prompt_logprobs`` the scheduler's ``step_logprobs`` / ``step_prompt_logprobs``."""
        stages = self.stages
        with stages.range("detokenize_fanout", len(tokens)):
            with lock:  # one acquisition per step
                get = requests.get
                records = [(get(rid), tok) for rid, tok in tokens.items()]
                done = [get(rid) for rid in finished]
            interval = self.stream_interval
            record = self.record_timestamps
            finishing = {req.rid for req in done if req is not None} if done else ()
            scheduler = self.scheduler
            plain = interval == 1 and not record
            failed = None
            for req, tok in records:
                # a request ended by the output processor or its caller has no seq any more: no
                # later token of it comes, so ``done`` needs no test here
                if req is None or req.abandoned:
                    continue
                try:
                    req.output_tokens += 1
                    if req.output_tokens == 1:
                        req.ts.first_token = now
                        seq = scheduler.get(req.rid)
                        if seq is not None:
                            req.ts.admitted = seq.admitted_at
                            req.cached_tokens = seq.num_cached_tokens
                    if record:
                        req.ts.token_times.append(now)
                    if req.logprobs is not None:
                        self._add_logprobs(req, logprobs, prompt_logprobs)
                    piece = req.detok.push(tok)
                    if plain and req.bare and req.rid not in finishing:  # (no stop string, no logprobs: as it is)
                        if piece:
                            req.parts.append(piece)
                            self._put(req, piece)
                        continue
                    req.pending_tokens += 1
                    if req.stops and piece and req.output_tokens > req.min_tokens:
                        start = len(req.unsent)
                        req.unsent += piece
                        cut = find_stop(req.unsent, req.stops, start, req.keep_stop)
                        if cut >= 0:
                            req.unsent = req.unsent[:cut]
                            self._finish(req, scheduler.finish_request(req.rid, FinishReason.STOP), now,
                                         stopped=True)
                            continue
                    else:
                        req.unsent += piece
                    if req.rid in finishing:  # flushed below, with the rest of its text
                        continue
                    if plain and req.logprobs is None:  # (`_flush` inline: a request with stop strings, held back)
                        unsent = req.unsent
                        upto = len(unsent) - req.holdback
                        if upto > 0:
                            piece = unsent[:upto] if req.holdback else unsent
                            req.unsent = unsent[upto:] if req.holdback else ""
                            req.parts.append(piece)
                            self._put(req, piece)
                            req.pending_tokens = 0
                    elif req.pending_tokens >= interval or req.output_tokens == 1:  # (the first token at once)
                        self._flush(req, now)
                except Exception as e:  # this request's text failed: it alone fails, below
                    failed = failed or []
                    failed.append((req, e))
            if failed:
                for req, e in failed:
                    self.request_failed(req, e)
        with stages.range("stream_flush", len(done)):
            for req in done:
                if req is None or req.done.is_set():
                    continue
                try:
                    self._finish(req, scheduler.pop_request(req.rid), now)
                except Exception as e:
                    self.request_failed(req, e)

    @staticmethod
    def _add_logprobs(req: RequestState, logprobs: Optional[dict], prompt_logprobs: Optional[dict]) -> None:
        entry = logprobs.get(req.rid) if logprobs else None
        if entry is not None:
            req.logprobs.append(entry)
            req.lp_unsent += 1
        plp = prompt_logprobs.get(req.rid) if prompt_logprobs else None
        if plp is not None:
            req.prompt_logprobs = plp
            req.plp_unsent = True

    def _finish(self, req: RequestState, seq, now: float, stopped: bool = False) -> None:
        """Send a finished request's last text and end its stream. Text still held in the
        detokenizer (an unfinished character) is checked for stop strings too."""
        reason = "stop" if stopped else (seq.finish_reason.value if seq is not None and seq.finish_reason else "stop")
        if not stopped:
            tail = req.detok.flush() if req.detok is not None else ""
            if tail:
                start = len(req.unsent)
                req.unsent += tail
                cut = (find_stop(req.unsent, req.stops, start, req.keep_stop)
                       if req.stops and req.output_tokens > req.min_tokens else -1)
                if cut >= 0:
                    req.unsent = req.unsent[:cut]
                    reason = "stop"
        if seq is not None:
            req.token_ids = seq.output_token_ids
        req.finish_reason = reason
        req.ts.finish = now
        self._flush(req, now, final=True)
        req.final_text = "".join(req.parts)
        self.close(req)

    def _flush(self, req: RequestState, now: float, final: bool = False) -> None:
        unsent = req.unsent
        upto = len(unsent) if final else len(unsent) - req.holdback
        if upto > 0 or (final and req.logprobs is not None and (req.lp_unsent or req.plp_unsent)):
            piece = unsent[:upto] if upto > 0 else ""
            req.unsent = unsent[upto:] if upto > 0 else unsent
            req.parts.append(piece)
            self._put(req, piece if req.logprobs is None else self._with_logprobs(req, piece))
            if self.record_timestamps:
                req.ts.flush_times.append(now)
                req.ts.flush_tokens.append(req.pending_tokens)
            req.pending_tokens = 0

    @staticmethod
    def _with_logprobs(req: RequestState, text: str) -> TextPiece:
        piece = TextPiece(text)
        n = req.lp_unsent
        piece.logprobs = req.logprobs[len(req.logprobs) - n:] if n else []
        piece.prompt_logprobs = req.prompt_logprobs if req.plp_unsent else None
        req.lp_unsent, req.plp_unsent = 0, False
        return piece

    # --- ending a stream --------------------------------------------------------------------
    def request_failed(self, req: RequestState, cause: Optional[BaseException], in_scheduler: bool = True) -> None:
        """Handling one request raised ``cause``: end it alone (blocks freed, the stream gets a
        RequestFailedError); the engine goes on. ``in_scheduler`` only on the worker thread."""
        log.error("request %d failed, the engine goes on", req.rid, exc_info=cause)
        if in_scheduler:
            self.scheduler.discard_request(req.rid, FinishReason.ERROR)
        error = RequestFailedError()
        error.__cause__ = cause
        self.fail(req, error)

    def fail(self, req: RequestState, error: BaseException) -> None:
        if req.done.is_set():
            return
        req.error = error
        req.finish_reason = "error"
        self.close(req)

    def close(self, req: RequestState) -> None:
        if req.done.is_set():
            return
        req.done.set()
        self._put(req, END)
        self.on_end(req)

    @staticmethod
    def _put(req: RequestState, item) -> None:
        req.queue.put(item if req.sink is None else (req.rid, item))
