"""Incremental detokenization: text as tokens arrive, never a broken character.

Decoding the whole output at every token costs O(length) per token, so each push decodes only
a window (vLLM's prefix_offset/read_offset technique): ``ids[prefix_offset:]``, where the
tokens before ``read_offset`` were already emitted and serve as left context. The context is
what keeps the tokenizer's spacing right: a window decoded on its own would lose the leading
space that a SentencePiece decoder strips from its first token, or start mid-character.
Text is emitted past the context and past what was already emitted, up to the last point
known to be final:

* a trailing U+FFFD may be a multi-byte character still incomplete, so a trailing run of them
  is held back until a later token completes it (or ``flush`` gives up at finish);
* with a SentencePiece byte-fallback decoder, a run of byte tokens is decoded as one group, all
  of it as U+FFFD if the group is not valid UTF-8, so a completed "你" turns into four U+FFFD
  when one more stray byte follows: while the last token is a byte token, nothing is emitted;
* when the tokenizer cleans up tokenization spaces (``" ." -> "."``), a tail that starts with
  a space within the last 4 characters is held back, since the next token may rewrite it.

Once the whole window text is final, ``read_offset`` moves to the end; every few tokens the
window slides so that it starts at an earlier ``read_offset``, a point where the text was
final and so where a decode of the tokens after it agrees with the decode of everything.

Guarantee: the pieces returned by ``push``/``push_many`` plus ``flush()`` concatenate to
``tokenizer.decode(output_ids, skip_special_tokens=...)``, which is what a non-streaming
request returns. For that reason the prompt is not used as left context of the first output
token: with a SentencePiece tokenizer it would keep a leading space that decoding the output
alone drops. Ids outside the tokenizer's vocabulary (a dummy GPT-2 has 50,257 logits, the
SmolLM2 tokenizer 49,152 entries) are dropped on arrival: ``decode`` gives them no text
(negative ids make it raise), so the guarantee holds for the output ids as generated.
"""

from __future__ import annotations

import codecs
import re
import weakref
from typing import Iterable, Optional

_REPLACEMENT = "\ufffd"
# Tokens of emitted text kept as left context before the window slides forward; one
# text-producing token is enough for correctness, a few save re-decoding the context often.
_CONTEXT_TOKENS = 4
# The longest pattern of transformers' clean_up_tokenization (" n't") has 4 characters.
_CLEANUP_TAIL = 4
_byte_fallback_cache: "weakref.WeakKeyDictionary[object, frozenset[int]]" = weakref.WeakKeyDictionary()


def _byte_fallback_ids(tokenizer) -> frozenset[int]:
    """Ids of the ``<0xNN>`` tokens when the decoder groups them (SentencePiece byte fallback)."""
    try:
        return _byte_fallback_cache[tokenizer]
    except KeyError:
        pass
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    ids: frozenset[int] = frozenset()
    if decoder is not None and "ByteFallback" in str(decoder):
        found = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
        ids = frozenset(i for i in found if i is not None and i != tokenizer.unk_token_id)
    _byte_fallback_cache[tokenizer] = ids
    return ids


_byte_table_cache: "weakref.WeakKeyDictionary[object, Optional[list]]" = weakref.WeakKeyDictionary()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable-character map, which byte-level BPE vocabularies use."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_level_table(tokenizer) -> Optional[list]:
    """For a pure byte-level BPE tokenizer (GPT-2, SmolLM2: a ByteLevel decoder and no space
    clean-up), the bytes of every token id (added tokens: their text), so that decoding is the
    concatenation of token bytes read through an incremental UTF-8 decoder. None otherwise."""
    try:
        return _byte_table_cache[tokenizer]
    except KeyError:
        pass
    table = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if (decoder is not None and type(decoder).__name__ == "ByteLevel"
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        to_byte = {ord(c): b for b, c in _bytes_to_unicode().items()}  # str.translate's map: char -> byte
        not_byte_level = re.compile("[^" + "".join(re.escape(chr(c)) for c in to_byte) + "]")
        added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        table = [b""] * len(tokenizer)
        for token, i in backend.get_vocab(with_added_tokens=True).items():
            if i >= len(table):
                continue
            if i in added:
                table[i] = added[i].encode("utf-8")
            elif not_byte_level.search(token) is None:  # translate + latin-1: each char's byte, in C
                table[i] = token.translate(to_byte).encode("latin-1")
            else:  # not a byte-level vocabulary after all
                table = None
                break
    _byte_table_cache[tokenizer] = table
    return table


_special_cache: "weakref.WeakKeyDictionary[object, frozenset[int]]" = weakref.WeakKeyDictionary()


def _special_ids(tokenizer) -> frozenset[int]:
    """Cached per tokenizer: building it costs about a millisecond, too much for every request."""
    try:
        return _special_cache[tokenizer]
    except KeyError:
        pass
    added = getattr(tokenizer, "added_tokens_decoder", {})
    ids = frozenset(tokenizer.all_special_ids) | frozenset(i for i, t in added.items() if getattr(t, "special", False))
    _special_cache[tokenizer] = ids
    return ids


_text_table_cache: "weakref.WeakKeyDictionary[object, dict[bool, list]]" = weakref.WeakKeyDictionary()


def _text_table(tokenizer, byte_table: list, skip_special_tokens: bool) -> list:
    """Per id of a byte-level vocabulary: "" for a skipped special token, the token's text when its
    bytes are whole UTF-8 on their own, else None. While no partial character is pending, such a
    token decodes to exactly this text, so one list index replaces an incremental decode."""
    per_skip = _text_table_cache.setdefault(tokenizer, {})
    table = per_skip.get(skip_special_tokens)
    if table is None:
        special = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        table = [None] * len(byte_table)
        for i, b in enumerate(byte_table):
            if i in special:
                table[i] = ""
            else:
                try:
                    table[i] = b.decode("utf-8")
                except UnicodeDecodeError:
                    pass
        per_skip[skip_special_tokens] = table
    return table


def prepare(tokenizer) -> None:
    """Build the per-tokenizer tables now (start-up), not when the first request streams."""
    IncrementalDetokenizer(tokenizer)


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "skip_special_tokens", "vocab_size", "cleanup_spaces",
                 "byte_ids", "special_ids", "byte_table", "text_table", "utf8",
                 "ids", "prefix_offset", "read_offset", "emitted_chars")

    def __init__(self, tokenizer, prompt_token_ids: Optional[list[int]] = None, skip_special_tokens: bool = True):
        # prompt_token_ids is accepted for the callers' convenience and deliberately unused:
        # see the module docstring.
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.vocab_size = len(tokenizer)
        self.cleanup_spaces = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.byte_ids = _byte_fallback_ids(tokenizer)
        self.special_ids = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        self.ids: list[int] = []
        # Fast path for byte-level BPE: token bytes through an incremental UTF-8 decoder (about
        # 1 us a token instead of a windowed decode); it holds back an unfinished character itself.
        # A token that is whole UTF-8 while nothing is pending skips even that: its text is looked up.
        self.byte_table = _byte_level_table(tokenizer)
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self.byte_table is not None else None
        self.text_table = (_text_table(tokenizer, self.byte_table, skip_special_tokens)
                           if self.byte_table is not None else None)
        self.prefix_offset = 0  # first token of the window
        self.read_offset = 0  # tokens before it: the window text up to them is final
        self.emitted_chars = 0  # characters of the window text that are context or already emitted

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became final (may be "")."""
        utf8 = self.utf8
        if utf8 is not None:
            if 0 <= token_id < self.vocab_size:
                # .buffer: the bytes of a character still incomplete (BufferedIncrementalDecoder)
                if not utf8.buffer:
                    text = self.text_table[token_id]
                    if text is not None:
                        return text
                if token_id not in self.special_ids:
                    return utf8.decode(self.byte_table[token_id])
            return ""
        if 0 <= token_id < self.vocab_size:
            self.ids.append(token_id)
        return self._emit(final=False)

    def push_many(self, token_ids: Iterable[int]) -> str:
        """Add several generated tokens at once; one decode for all of them."""
        vocab_size = self.vocab_size
        if self.utf8 is not None:
            table, special = self.byte_table, self.special_ids
            return self.utf8.decode(b"".join(table[t] for t in token_ids if 0 <= t < vocab_size and t not in special))
        self.ids.extend(t for t in token_ids if 0 <= t < vocab_size)
        return self._emit(final=False)

    def flush(self) -> str:
        """At finish: everything not yet emitted, an incomplete character as U+FFFD included."""
        if self.utf8 is not None:
            return self.utf8.decode(b"", final=True)
        return self._emit(final=True)

    def _decode(self, start: int) -> str:
        return self.tokenizer.decode(self.ids[start:], skip_special_tokens=self.skip_special_tokens)

    def _emit(self, final: bool) -> str:
        n = len(self.ids)
        if self.read_offset == n:
            return ""
        text = self._decode(self.prefix_offset)
        end = len(text) if final else self._final_end(text)
        if end < len(text):
            if end <= self.emitted_chars:
                return ""
            piece = text[self.emitted_chars:end]
            self.emitted_chars = end
            return piece
        piece = text[self.emitted_chars:]
        old_read = self.read_offset
        self.read_offset = n
        self.emitted_chars = len(text)
        if old_read - self.prefix_offset >= _CONTEXT_TOKENS:
            # old_read is a point where the text was final; a window starting there needs the
            # tokens up to n as context, and they must produce text (a skipped special token
            # alone would let a SentencePiece decoder strip the next token's leading space).
            context_chars = len(self._decode(old_read))
            if context_chars:
                self.prefix_offset = old_read
                self.emitted_chars = context_chars
        return piece

    def _final_end(self, text: str) -> int:
        """How much of the window text no later token can change."""
        if self.byte_ids and self._ends_in_byte_token():
            return 0
        end = len(text)
        while end and text[end - 1] == _REPLACEMENT:
            end -= 1
        if self.cleanup_spaces:
            space = text.find(" ", max(0, end - _CLEANUP_TAIL), end)
            if space >= 0:
                end = space
        return end

    def _ends_in_byte_token(self) -> bool:
        ids = self.ids
        # Skipped special tokens do not end a group of byte tokens. The window starts where the
        # last token that counts was not a byte token, so the scan stops there.
        for k in range(len(ids) - 1, self.prefix_offset - 1, -1):
            if ids[k] not in self.special_ids:
                return ids[k] in self.byte_ids
        return False
