"""Incremental detokenization: text as tokens arrive, never a broken character.

Each push decodes only a small window: the tokens since ``prefix_offset`` (the left context
that makes the tokenizer's spacing right) versus the same window without the new tokens, and
emits the difference. If the new text ends in U+FFFD, a multi-byte character is still
incomplete, so nothing is emitted and the window grows until it completes. ``flush`` emits
whatever is left at finish, so the concatenation of every piece equals
``tokenizer.decode(all_ids)``.

Ids outside the tokenizer's vocabulary (dummy GPT-2 models have 50,257 ids, the SmolLM2
tokenizer 49,152) decode to no text; they are dropped here, so the guarantee holds relative to
the decode of the in-vocabulary ids.
"""

from __future__ import annotations

from typing import Iterable, Optional

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "skip_special_tokens", "ids", "prefix_offset", "read_offset", "vocab_size")

    def __init__(self, tokenizer, prompt_token_ids: Optional[list[int]] = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.vocab_size = len(tokenizer)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        if 0 <= token_id < self.vocab_size:
            self.ids.append(token_id)
        return self._emit(final=False)

    def push_many(self, token_ids: Iterable[int]) -> str:
        for t in token_ids:
            if 0 <= t < self.vocab_size:
                self.ids.append(t)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if not final and (len(full) <= len(prefix) or full.endswith(_REPLACEMENT)):
            return ""
        new = full[len(prefix):] if full.startswith(prefix) else full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new
