"""Structured output: a request's output constrained by a grammar (JSON schema, regex, choice list,
EBNF), with xgrammar (the optional extra ``rosecli[structured]``; docs/structured-output.md says
why this library).

What a request asks for is a `GrammarSpec` on its `SamplingParams` (``structured``). The engine
holds one `StructuredOutput`: it compiles specs (cached per spec; a spec that does not compile is a
`RequestError` naming the field, raised before the request is admitted), keeps one matcher per
request, and, in a sampling step whose batch holds grammar requests, fills their rows of a packed
int32 bitmask on the host (one batched call, multi-threaded only while masks are expensive),
copies it to the device in one non-blocking copy and masks the whole batch's logits there with one
kernel (rows of other requests are all ones: their logits are left as they were). Greedy grammar
requests instead take one masked argmax, which reads the bitmask itself (in the runner); the others
go through the sampler. A step whose batch holds no grammar request does none of this: the runner
does not call in. A step's new tokens are accepted in one batched call of the library.

Each matcher is advanced with every token its request samples, before the next mask is filled.
Under overlap scheduling the next step is launched before the host has read the previous step's
tokens: the runner launches step N+1's model forward first, then waits for step N's tokens (already
on their way to the host), advances the matchers and fills the masks while the GPU runs the forward,
and only then launches the sampling. So the mask fill is hidden behind the forward, and overlap goes
on for every batch.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from rosecli.engine import aside_copy, json_schema
from rosecli.engine.errors import RequestError

INSTALL_HINT = "structured output needs the xgrammar library: install rosecli[structured] (pip install xgrammar)"
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CACHED = 256  # compiled grammars kept (least recently used dropped)
THREADED_ABOVE_S = 300e-6  # a batch fill that took longer on one thread: the next one runs on several
SERIAL_BELOW_S = 100e-6  # one that took less on several threads: the next one runs on one
PROBE_MAX = 64  # while threaded, at most this many steps between fills run on one thread again (to see)


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class GrammarSpec:
    """What constrains a request's output. ``value``: the JSON schema as canonical JSON text
    (json_schema), the regex, the choices as a JSON list (choice), the EBNF grammar; "" for
    json_object (any JSON object). ``param`` names the request field it came from, for errors."""

    kind: str
    value: str = ""
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema, param: str = "response_format") -> "GrammarSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise RequestError(f"{param}: the JSON schema is not valid JSON: {e}", param) from None
            except RecursionError:
                raise RequestError(f"{param}: the JSON schema nests too deeply to be read", param) from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param)
        schema = json_schema.normalize(schema, param)  # (what the grammar cannot enforce is refused here)
        # property order kept: the output follows it
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def choice(cls, choices, param: str = "guided_choice") -> "GrammarSpec":
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise RequestError(f"{param} must be a non-empty list of non-empty strings", param)
        return cls("choice", json.dumps(choices), param)


_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: (Check failed: \(.*?\) is false: )?")


def _reason(e: Exception) -> str:
    text = _CPP_PREFIX.sub("", str(e).strip())
    return text.split(". The JSON string is:")[0].strip()[:300]


# xgrammar 0.2 writes a string with a length bound (maxLength) as characters of this class, which
# lets raw control characters through (JSON needs them escaped); its unbounded strings exclude them
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def _json_grammar(xgr, schema: str, strict: bool):
    """The schema's grammar: compact JSON (no free whitespace: a model cannot wander off into
    it), every string JSON-valid."""
    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def _ebnf_literal(s: str) -> str:
    return json.dumps(s)  # xgrammar's EBNF strings take JSON's escapes


class _Request:
    __slots__ = ("matcher", "handle", "accepted", "failed", "ended")

    def __init__(self, matcher):
        # ended: the matcher accepted its stop token (terminated) or refused a token (failed)
        self.matcher, self.accepted, self.failed, self.ended = matcher, 0, False, False
        self.handle = getattr(matcher, "_handle", None)


class StructuredOutput:
    """Grammars for one engine: compile (cached), one matcher per request, the batch's mask."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], device: torch.device,
                 max_rows: int, threads: Optional[int] = None):
        """Cheap: the library is imported, and the vocabulary read, by the first `compile`."""
        self.tokenizer, self.threads = tokenizer, threads or min(8, os.cpu_count() or 1)
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.eos_token_ids = sorted({t for t in eos_token_ids if 0 <= t < vocab_size})
        self._stop_set: set[int] = set()  # the tokens that end a matcher (its stop tokens)
        self.xgr = self.compiler = self.batch_matcher = None
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._lock = threading.Lock()
        self._requests: dict[int, _Request] = {}
        self.max_rows = max_rows

    # --- compile --------------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec):
        """The compiled grammar of ``spec`` (cached); a RequestError naming ``spec.param`` with the
        library's reason when it does not compile. Thread-safe: the server compiles off the engine's thread."""
        with self._lock:
            if self.compiler is None:
                self._setup(spec.param)
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        c = self.compiler
        try:
            if spec.kind == "json_schema":
                g = c.compile_grammar(_json_grammar(self.xgr, spec.value, strict=True))
            elif spec.kind == "json_object":
                g = c.compile_grammar(_json_grammar(self.xgr, '{"type": "object"}', strict=False))
            elif spec.kind == "regex":
                g = c.compile_regex(spec.value)
            elif spec.kind == "choice":
                g = c.compile_grammar("root ::= " + " | ".join(_ebnf_literal(s) for s in json.loads(spec.value)))
            else:
                g = c.compile_grammar(spec.value)
        except (RuntimeError, ValueError) as e:
            what = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(spec.kind, spec.kind)
            raise RequestError(f"{spec.param}: the {what} could not be compiled: {_reason(e)}", spec.param) from None
        with self._lock:
            self._cache[spec] = g
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return g

    def _setup(self, param: str) -> None:
        try:
            import xgrammar as xgr
        except ImportError:
            raise RequestError(INSTALL_HINT, param) from None
        info = _tokenizer_info(xgr, self.tokenizer, self.vocab_size, self.eos_token_ids)
        # the library's batched fill, on the calling thread or on `threads` (see _fill_rows)
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        self.threaded_matcher = xgr.BatchGrammarMatcher(max_threads=self.threads) if self.threads > 1 else None
        self._threaded, self._probe_in, self._probe_gap = False, 0, 2
        core = getattr(getattr(xgr, "matcher", None), "_core", None)
        self._core_accept = getattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token", None)
        self.xgr, self.compiler = xgr, xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
        W = (self.vocab_size + 31) // 32
        pin = self.device.type == "cuda"
        # two host bitmasks, alternating between steps (a copy in flight is never rewritten); rows
        # of requests without a grammar stay all ones (-1)
        self._host = [torch.full((self.max_rows, W), -1, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._written: list[list[int]] = [[], []]
        self._flip = 0
        self._dev = torch.full((self.max_rows, W), -1, dtype=torch.int32, device=self.device)
        self._aside = None  # (`stage_bitmask(aside=True)`'s side stream, made on first use)
        # whether that copy goes through the driver (a few us of the host's time a step)
        self.aside_is_cheap = self.device.type == "cuda" and aside_copy.driver() is not None
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (`stage_bitmask`)
        self._kernel = None
        if self.device.type == "cuda":
            from rosecli.kernels.bitmask import apply_bitmask as kernel

            self._kernel = kernel
        cols = torch.arange(self.vocab_size, device=self.device)
        self._word = cols // 32
        self._bit = (cols % 32).to(torch.int32)
        only_eos = np.zeros(W, np.uint32)
        for t in self.eos_token_ids:
            only_eos[t // 32] |= np.uint32(1 << (t % 32))
        self._only_eos = only_eos.view(np.int32)  # a row that allows the stop tokens only

    # --- requests -------------------------------------------------------------------------------
    def add(self, request_id: int, spec: GrammarSpec) -> None:
        compiled = self.compile(spec)
        matcher = self.xgr.GrammarMatcher(compiled)
        self._stop_set.update(matcher.stop_token_ids)
        self._requests[request_id] = _Request(matcher)

    def release(self, request_id: int) -> None:
        self._requests.pop(request_id, None)

    def has(self, request_id: int) -> bool:
        return request_id in self._requests

    @property
    def active(self) -> bool:
        return bool(self._requests)

    # --- a sampling step ------------------------------------------------------------------------
    def mask_logits(self, seqs, logits: torch.Tensor, pending: Callable[[int], int], pending_id: int) -> bool:
        """Mask ``logits`` (row i: ``seqs[i]``) in place for the rows whose request has a grammar,
        after advancing each matcher with the tokens its request sampled since (a token still
        ``pending_id`` on the host comes from ``pending(request_id)``). Returns whether any row was masked."""
        written = self.fill(seqs, pending, pending_id)
        if written is None:
            return False
        self.apply_filled(logits, written)
        return True

    def apply_filled(self, logits: torch.Tensor, written: Optional[list[int]] = None) -> None:
        """The device half of `mask_logits`: the last fill's bitmask on ``logits``, in place
        (``written``: the rows it wrote, if known)."""
        B = logits.shape[0]
        if self.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            # on the CPU the library's own op, on the masked rows only, costs less than the gather below
            if written is None:
                written = [i for i in self._written[self._flip ^ 1] if i < B]
            self.xgr.apply_token_bitmask_inplace(logits, self.filled_host()[:B], indices=written)
            return
        d = self.stage_bitmask(B)
        if self._kernel is not None and logits.stride(1) == 1:
            self._kernel(logits, d)  # one Triton kernel
        else:
            apply_bitmask(logits, d, self._word, self._bit)

    def filled_index(self) -> int:
        """Which of the two host bitmasks the last `fill` wrote (they alternate)."""
        return self._flip ^ 1

    def filled_host(self) -> torch.Tensor:
        """The host bitmask the last `fill` wrote: [max_rows, ceil(V / 32)] int32."""
        return self._host[self._flip ^ 1]

    def stage_bitmask(self, rows: int, aside: bool = False) -> torch.Tensor:
        """Copy the first ``rows`` rows of the last fill's host bitmask to the device (non-blocking
        on CUDA: the host area is not rewritten until two fills later) and return them there.

        ``aside`` (CUDA): copy on a side stream, which the current stream then waits for, so the
        copy (~16 us for 64 rows of GPT-2's vocabulary on the H100) runs beside the step's forward
        instead of after it (`aside_copy.AsideCopy`: ~4.5 us of the host's time through the
        driver, 9-30 us through torch). The caller makes sure no kernel still reads the device
        buffer (the runner has waited for the step before)."""
        idx = self._flip ^ 1
        views = self._views.get((idx, rows))
        if views is None:  # (two slices per step cost the host more than this lookup)
            views = self._views[(idx, rows)] = (self._dev[:rows], self._host[idx][:rows])
        d, host = views
        if not aside or self.device.type != "cuda":
            d.copy_(host, non_blocking=self.device.type == "cuda")
            return d
        if self._aside is None:
            self._aside = aside_copy.AsideCopy(self.device, torch.cuda.current_stream(self.device))
        self._aside(d, host)
        return d

    def fill(self, seqs, pending: Callable[[int], int], pending_id: int) -> Optional[list[int]]:
        """The host half of `mask_logits`: advance the matchers of ``seqs``' grammar rows and fill
        their rows of the next host bitmask (rows of other requests all ones). Returns the rows it
        wrote (None: no grammar row in ``seqs``).

        A decode step brings each row one new token: those are accepted in one batched call (a
        Python call per row cost more than the library's work at 64 rows); a row with several
        new tokens (a resumed request) accepts them one by one."""
        reqs = self._requests
        flip = self._flip
        hn = self._host_np[flip]
        stale = self._written[flip]  # rows this area masked last time: all ones again unless refilled
        written: list[int] = []
        rows: list[int] = []  # the rows to fill (grammar not ended), their requests
        live: list[_Request] = []
        one: list[_Request] = []  # requests with exactly one new token, and those tokens
        one_ids: list[int] = []
        failed: list[int] = []  # rows whose request had a token refused: only the stop tokens
        changed = False  # a request ended (refused token, or its stop token) in this fill
        get = reqs.get
        for i, s in enumerate(seqs):
            r = get(s.request_id)
            if r is None:
                continue
            written.append(i)
            if r.ended:
                if r.failed:
                    failed.append(i)
                continue
            rows.append(i)
            live.append(r)
            tokens = s.token_ids
            n = len(tokens) - s.num_prompt_tokens
            k = n - r.accepted
            if k == 1:
                t = tokens[-1]
                one.append(r)
                one_ids.append(pending(s.request_id) if t == pending_id else t)
            elif k > 1:
                new = tokens[s.num_prompt_tokens + r.accepted:]
                if new[-1] == pending_id:
                    new[-1] = pending(s.request_id)
                for t in new:
                    if not self._accept(r, t):
                        changed = True
                        break
            r.accepted = n
        if one:
            ok = self._batch_accept(one, one_ids)
            if 0 in ok:  # a refused token (rare: the mask allows only what the grammar accepts)
                changed = True
                for r, accepted in zip(one, ok):
                    if not accepted:
                        r.failed = r.ended = True
            stops = self._stop_set
            if not stops.isdisjoint(one_ids):  # (only a stop token ends a matcher)
                for r, t in zip(one, one_ids):
                    if t in stops and not r.failed and r.matcher.is_terminated():
                        r.ended = changed = True
        if changed:  # (ended: its stop token was sampled; the row's token is dropped: all ones)
            failed += [i for i, r in zip(rows, live) if r.failed]
            kept = [(i, r) for i, r in zip(rows, live) if not r.ended]
            rows, live = [i for i, _ in kept], [r for _, r in kept]
        self._written[flip] = written
        if stale:
            if stale != rows:  # (a fill rewrites its rows whole)
                refilled = set(rows)
                hn[[i for i in stale if i not in refilled]] = -1
        if not written:
            return None
        self._flip ^= 1
        if failed:
            hn[failed] = self._only_eos  # a token the grammar refused: end the request
        if live:
            self._fill_rows(live, self._host[flip], rows)
        return written

    def _batch_accept(self, reqs: list, tokens: list[int]):
        """Each request's matcher advanced by its token in one call; whether each was accepted."""
        core = self._core_accept
        if core is not None and reqs[0].handle is not None:
            # the library's binding, on handles kept per request (its wrapper builds the handle list
            # and a list of bools per call: a fifth of the call at 64 rows)
            return core([r.handle for r in reqs], tokens, False)
        return self.xgr.BatchGrammarMatcher.batch_accept_token([r.matcher for r in reqs], tokens)

    def _accept(self, r: _Request, token: int) -> bool:
        """Advance one request's matcher by one token; False (and the request ended) when the
        grammar refused it or it was the stop token that ends the grammar."""
        m = r.matcher
        if not m.accept_token(token):
            r.failed = r.ended = True
            return False
        if token in self._stop_set and m.is_terminated():
            r.ended = True
            return False
        return True

    def _fill_rows(self, reqs: list, host: torch.Tensor, rows: list[int]) -> None:
        """One batched fill of ``reqs``' matchers into ``rows`` of ``host``: on this thread while
        masks are cheap (the usual case: a JSON structure's states take a few microseconds a row,
        less than waking threads costs), on the library's threads after a fill on one took longer
        than THREADED_ABOVE_S (large context-dependent token sets, e.g. inside strings with a
        maxLength). While threaded, a fill now and then runs on one thread again to see (after 2
        steps, then 4, 8... up to PROBE_MAX while it stays expensive); one that takes less than
        SERIAL_BELOW_S on the threads also ends it."""
        threaded = self._threaded and self.threaded_matcher is not None
        probe = False
        if threaded:
            self._probe_in -= 1
            probe = self._probe_in <= 0
            threaded = not probe
        t = time.perf_counter()
        bm = self.threaded_matcher if threaded else self.batch_matcher
        handle = getattr(bm, "_handle", None)
        if handle is not None and reqs[0].handle is not None:  # (the wrapper rebuilds the handle list)
            handle.batch_fill_next_token_bitmask([r.handle for r in reqs], host, rows, False)
        else:
            bm.batch_fill_next_token_bitmask([r.matcher for r in reqs], host, rows)
        took = time.perf_counter() - t
        if threaded:
            self._threaded = took >= SERIAL_BELOW_S
        elif took > THREADED_ABOVE_S:
            self._probe_gap = min(2 * self._probe_gap, PROBE_MAX) if probe else 2
            self._threaded, self._probe_in = True, self._probe_gap
        else:
            self._threaded = False


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, word: Optional[torch.Tensor] = None,
                  bit: Optional[torch.Tensor] = None) -> None:
    """Set ``logits[i, t]`` to -inf where bit ``t % 32`` of ``bitmask[i, t // 32]`` is 0 (the packed
    int32 layout of xgrammar and llguidance), in place, for the whole batch: one gather, a shift and a
    masked fill, no host sync (CUDA-graph friendly). ``word``/``bit``: ``arange(V) // 32`` and
    ``% 32`` (int32), precomputed on the device."""
    V = logits.shape[1]
    if word is None:
        cols = torch.arange(V, device=logits.device)
        word, bit = cols // 32, (cols % 32).to(torch.int32)
    logits.masked_fill_(((bitmask.index_select(1, word) >> bit) & 1) == 0, float("-inf"))


def _tokenizer_info(xgr, tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """xgrammar's view of the vocabulary: token strings by id (padding ids past the tokenizer's are
    empty: never allowed), how they encode bytes (read from the tokenizer's serialized backend)."""
    vocab = tokenizer.get_vocab()
    encoded = [""] * vocab_size
    for token, i in vocab.items():
        if i < vocab_size:
            encoded[i] = token
    meta = {"vocab_type": xgr.VocabType.RAW, "add_prefix_space": False}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=eos_token_ids or None, add_prefix_space=meta["add_prefix_space"])
