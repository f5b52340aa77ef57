"""Input processing: a prompt (text, chat messages or token ids) and its `SamplingParams` become
checked token ids, once, for every caller (CLI, HTTP server, benchmarks, offline generate).

`SamplingParams` checks its own ranges when built; what depends on the engine (the model's
context, the KV pool, the vocabulary) is checked here. The HTTP layer keeps only what OpenAI's
wire format adds (field types, its ranges, the prompt plus ``max_tokens`` within the context).
Every refusal is a `RequestError` whose message names the problem and the fix, and whose
``param`` names the input it is about.
"""

from __future__ import annotations

from typing import Optional, Union

from rosecli.engine.config import SamplingParams
from rosecli.engine.errors import RequestError

# A floor for the characters one token may stand for (see max_token_chars).
_MIN_CHARS_PER_TOKEN_BOUND = 32


def max_token_chars(tokenizer) -> int:
    """The most characters one token can stand for (byte-level vocabularies spell a byte as one
    character, so no input character takes less); at least 32."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max((len(t) for t in vocab), default=0)
    except Exception:  # a tokenizer without a readable vocabulary: the floor below
        longest = 0
    return max(_MIN_CHARS_PER_TOKEN_BOUND, longest)


class InputProcessor:
    """Tokenizes and checks requests for one engine. Thread-safe: it holds no per-request state."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: Optional[int], block_manager):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_manager = block_manager
        self._max_prompt_chars: Optional[int] = None

    # --- text -> token ids ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids with the special tokens the tokenizer adds to a plain prompt (Llama 3's
        ``<|begin_of_text|>``; none for GPT-2 or SmolLM2), as vLLM, transformers and llama.cpp tokenize a
        prompt; ``add_special_tokens=False``: the text's own tokens only."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens) if text else []

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.tokenizer, "chat_template", None) is not None

    def chat(self, messages: Union[str, list[dict]], tools: Optional[list[dict]] = None,
             template_kwargs: Optional[dict] = None, continue_final_message: bool = False,
             add_generation_prompt: bool = True) -> list[int]:
        """The chat template applied to ``messages`` (a string is one user message) and ``tools``
        (OpenAI's function definitions, for a template that shows them), with the generation
        prompt; a template that refuses the messages is a RequestError. ``template_kwargs``: more
        variables for the template (vLLM's ``chat_template_kwargs``, e.g. Qwen 3's ``enable_thinking``).
        ``continue_final_message`` (vLLM's, with ``add_generation_prompt`` False): the last message, the
        assistant's, left open for the model to go on with (a prefilled answer)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        try:
            kw = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
            if continue_final_message:
                kw["continue_final_message"] = True
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, **kw)
        except Exception as e:
            # A template may refuse a conversation on purpose (raise_exception, a TemplateError whose
            # message is written for the user); anything else is the template tripping over what
            # the messages hold, named without its internal text.
            if type(e).__module__.startswith("jinja2") and type(e).__name__ == "TemplateError":
                raise RequestError(f"the chat template rejected the messages: {e}", "messages") from None
            if isinstance(e, ValueError) and str(e).startswith("continue_final_message"):  # (ours, transformers')
                why = str(e).split("\n")[0][:300]  # (transformers' goes on with the whole rendered chat)
                raise RequestError(f"the chat template cannot continue the last of the messages: {why}",
                                   "messages") from None
            raise RequestError("the chat template could not render these messages (check the roles, and "
                              "that extra message fields are plain strings)", "messages") from e
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    @property
    def max_prompt_chars(self) -> int:
        """No prompt of more characters can fit the context (computed once, on first use)."""
        if self._max_prompt_chars is None:
            self._max_prompt_chars = self.max_model_len * max_token_chars(self.tokenizer)
        return self._max_prompt_chars

    # --- checks -----------------------------------------------------------------------------
    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise RequestError("the prompt is empty: give at least one token of text")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(token_ids)} tokens but the model's context is "
                              f"{self.max_model_len}: shorten the prompt (at least one token must be left "
                              "to generate)")
        bm = self.block_manager
        if bm.blocks_needed(len(token_ids) + 1) > bm.num_blocks:
            raise RequestError(f"the prompt has {len(token_ids)} tokens; with one token to generate it needs "
                              f"{bm.blocks_needed(len(token_ids) + 1)} KV blocks of {bm.block_size} tokens, but "
                              f"the whole KV cache has {bm.num_blocks} blocks ({bm.num_blocks * bm.block_size} "
                              "tokens): shorten the prompt or raise --num-gpu-blocks")
        if not all(type(t) is int for t in token_ids):
            bad = next(t for t in token_ids if type(t) is not int)
            raise RequestError(f"prompt token ids must be integers, got {bad!r}")
        self.check_token_ids(token_ids, "prompt")

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Every id within the vocabulary (``param`` names the input in the error)."""
        if not token_ids:
            return
        lo, hi = min(token_ids), max(token_ids)
        if lo < 0 or (self.vocab_size is not None and hi >= self.vocab_size):
            raise RequestError(f"token id {lo if lo < 0 else hi} is outside the vocabulary "
                              f"[0, {self.vocab_size})", param)

    def check_params(self, params: SamplingParams) -> None:
        """What of ``params`` depends on the vocabulary: every token id of ``logit_bias`` and ``allowed_token_ids``
        in it (a token the model cannot produce is a mistake, as OpenAI's API answers)."""
        if self.vocab_size is None:
            return
        for name in ("logit_bias", "allowed_token_ids"):
            bad = next((t for t in getattr(params, name, None) or () if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})", name)

    def process(self, prompt: Union[str, list[int]], params: Optional[SamplingParams] = None) -> list[int]:
        """The checked token ids of ``prompt`` (text is tokenized with the tokenizer's special tokens: `encode`), and
        the parts of ``params`` that depend on the vocabulary (``check_params``).

        ``params`` checked its own ranges when built (`SamplingParams`); a stop token id outside
        the vocabulary is allowed here (it never matches) and refused by the HTTP layer, which
        checks it with ``check_token_ids`` as OpenAI's API does."""
        if params is not None:
            self.check_params(params)
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(token_ids)
        return token_ids
