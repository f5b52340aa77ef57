"""OpenAI-compatible request and response shapes, and the checks OpenAI's wire format adds
(field types and names, its ranges, a prompt plus ``max_tokens`` within the context) on the way
to engine inputs (token ids + ``SamplingParams``) or a 400 that names the bad parameter.
Tokenizing, the chat template and the engine's own checks of a prompt are the input
processor's (`rosecli.engine.inputs`).

Field names and defaults follow the OpenAI API (``max_tokens`` 16 for completions,
``temperature`` 1.0, ``n`` 1); the extensions vLLM users expect (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``) are honoured too, and
so are ``n`` (choices sharing one prefill), ``logprobs`` / ``top_logprobs`` and completions' ``echo``.
Every field of OpenAI's two request bodies, and vLLM's extensions, is honoured, accepted because
it cannot change the output (``user``, ``metadata``, ``store``, ...), or, when set to anything
that would change the output, refused with a 400 that names it (``best_of`` other than ``n``,
``tools``, ``response_format`` other than text, ...: `REFUSED`); nothing that changes the output
is silently ignored. Fields nobody defines are ignored, as vLLM does. docs/server.md has the table.

Types are strict (``"stream": "yes"`` and ``"max_tokens": "3"`` are 400s, not coerced) and every
number is range-checked here, where it enters, against what the engine can represent: a value
that passes these checks cannot overflow a tensor or a generator seed further down.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

from rosecli.engine.config import (MAX_INT32, MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                   SamplingParams)
from rosecli.engine.errors import ConfigError, RequestError
from rosecli.engine.inputs import InputProcessor
from rosecli.engine.logprobs import MAX_LOGPROBS, TokenLogprobs


# --- the error vocabulary -----------------------------------------------------------------------
# One body, ``{"error": {message, type, param, code}}``, for a JSON error response and for a stream's
# error event alike. ``type`` is one of OpenAI's strings; ``code`` is always a string (or null).
INVALID_REQUEST = "invalid_request_error"  # 4xx: the client can fix it
RATE_LIMIT = "requests"  # 429, as OpenAI's request-rate limit
SERVER_ERROR = "server_error"  # 5xx

# codes
INVALID_JSON = "invalid_json"
INVALID_TYPE = "invalid_type"
INVALID_VALUE = "invalid_value"
MISSING_PARAMETER = "missing_required_parameter"
UNSUPPORTED_PARAMETER = "unsupported_parameter"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
INVALID_API_KEY = "invalid_api_key"
MODEL_NOT_FOUND = "model_not_found"
NOT_FOUND = "not_found"
METHOD_NOT_ALLOWED = "method_not_allowed"
REQUEST_TIMEOUT = "request_timeout"
REQUEST_TOO_LARGE = "request_too_large"
UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
INTERNAL_ERROR = "internal_error"
ENGINE_DEAD = "engine_dead"
SHUTTING_DOWN = "shutting_down"

INTERNAL_MESSAGE = "The server had an error while processing your request; the server log has the details."

# Within what the engine can represent (rosecli.engine.config): OpenAI's seed is an int64 and its
# temperature range 0..2; top_k, stop strings and ids as the engine bounds them.
MAX_SEED = 2 ** 63 - 1
MAX_TOP_K = MAX_INT32
MAX_TEMPERATURE = 2.0
MAX_N = 128  # OpenAI's bound on n; the engine's batch may bound it lower (a 400 naming n)
MIN_LOGPROB = -9999.0  # what a -inf logprob is reported as (JSON has no infinity), as vLLM does


class APIError(Exception):
    """An error answered with an OpenAI-style body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST,
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = INVALID_REQUEST, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None, code: str = INVALID_VALUE) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(message: str, param: str) -> APIError:
    return bad_request(message, param, UNSUPPORTED_PARAMETER)


def internal_error() -> APIError:
    """What a client hears of an unexpected exception: nothing of its text."""
    return APIError(500, INTERNAL_MESSAGE, SERVER_ERROR, None, INTERNAL_ERROR)


def engine_dead() -> APIError:
    return APIError(503, "The engine is not running (it stopped on an error or was shut down); the server "
                    "log has the details.", SERVER_ERROR, None, ENGINE_DEAD)


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down: retry on another instance or after it restarts.",
                    SERVER_ERROR, None, SHUTTING_DOWN)


# --- requests ---------------------------------------------------------------------------------

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _unset(value) -> bool:
    return value is None


def _is(*neutral):
    """The value is None, or equal to one of ``neutral`` and of the same type (``0`` is no ``False``)."""
    return lambda value: value is None or any(type(value) is type(n) and value == n for n in neutral)


# Fields this server does not declare (OpenAI's and vLLM's) that would change the output: each is
# refused with a 400 naming it unless it holds a value that changes nothing (None, or the
# neutral values given). The reason says what the server does instead.
_NO_TOOLS = "tool calling is a chat completions feature (/v1/chat/completions)"
REFUSED: dict[str, tuple] = {
    # OpenAI chat completions (declared by the chat request; refused on /v1/completions)
    "tools": (_is([]), _NO_TOOLS),
    "tool_choice": (_is("none"), _NO_TOOLS),
    "functions": (_is([]), "the deprecated functions API is not supported: use tools"),
    "function_call": (_is("none"), "the deprecated functions API is not supported: use tool_choice"),
    "parallel_tool_calls": (_unset, _NO_TOOLS),
    "audio": (_unset, "this server generates text only"),
    "modalities": (_is(["text"]), "this server generates text only: [\"text\"] is the one value accepted"),
    "prediction": (_unset, "this server has no predicted outputs"),
    "web_search_options": (_unset, "this server has no web search"),
    "verbosity": (_unset, "this server passes nothing to a reasoning model's template"),
    "moderation": (_unset, "this server runs no moderation"),
    # vLLM's extensions
    "best_of": (_is(1), "this server returns the n choices it samples, not the best of more"),
    "echo": (_is(False), "this server echoes the prompt on /v1/completions only"),
    "use_beam_search": (_is(False), "this server has no beam search"),
    "length_penalty": (_is(1, 1.0), "it applies to beam search, which this server does not have"),
    "spaces_between_special_tokens": (_is(True), "this server decodes special tokens as the tokenizer does"),
    "bad_words": (_is([]), "use logit_bias"),
    "guided_decoding_backend": (_is("xgrammar", "auto"), "this server's structured output runs on xgrammar"),
    "guided_whitespace_pattern": (_unset, "this server's JSON output has no free whitespace"),
    "logits_processors": (_unset, "this server runs no custom logits processors"),
    "add_special_tokens": (_is(False), "the chat template adds the model's special tokens itself"),
    "chat_template": (_unset, "this server uses the model's own chat template"),
    "chat_template_kwargs": (_is({}), "there is no chat template on /v1/completions"),
    "documents": (_unset, "this server passes nothing else to the chat template"),
    "mm_processor_kwargs": (_unset, "this server takes text only"),
    "prompt_embeds": (_unset, "this server takes text or token ids only"),
    "vllm_xargs": (_unset, "this server takes no extra arguments"),
}
# Fields accepted because they cannot change the output (documented in docs/server.md): ``user``,
# ``metadata``, ``store``, ``service_tier``, ``safety_identifier``, ``prompt_cache_key``,
# ``prompt_cache_options``, ``prompt_cache_retention``, ``stream_options.include_obfuscation``,
# vLLM's ``priority``, ``request_id``, ``cache_salt``: ignored, as every field nobody defines.

_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,20}")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Body(BaseModel):
    """A request body as `parse_body` reads it: strictly typed fields, others ignored."""
    model_config = _STRICT
    # the body's fields of `REFUSED` this model does not declare, as sent (``parse_body``)
    _undeclared: dict[str, Any] = PrivateAttr(default_factory=dict)


class SamplingRequest(_Body):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False  # vLLM's
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: keep the prompt's last k tokens (-1: the context's worth)
    skip_special_tokens: bool = True  # vLLM's: False puts special tokens (end of turn ...) in the text
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N" (any token identified)
    prompt_logprobs: Optional[int] = None  # vLLM's: each prompt token's logprob and rank, and the top k
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM's
    repetition_penalty: Optional[float] = None
    min_p: Optional[float] = None
    min_tokens: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None  # sample only among these ids
    user: Optional[str] = None
    # structured output (checked by `grammar_spec`, which names the field)
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None

    def check_unsupported(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be an integer from 1 to {MAX_N}, got {self.n}", "n")
        for name, value in self._undeclared.items():
            rule = REFUSED.get(name)
            if rule is not None and not rule[0](value):
                shown = {dict: "{...}", list: "[...]"}.get(type(value)) or json.dumps(value)[:60]
                raise unsupported(f"{name}={shown} is not supported: {rule[1]} (leave {name} out)", name)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"prompt_logprobs must be an integer from 0 to {MAX_LOGPROBS}, got "
                              f"{self.prompt_logprobs}", "prompt_logprobs")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens == -1
                                                            or self.truncate_prompt_tokens >= 1):
            raise bad_request(f"truncate_prompt_tokens must be -1 (the model's context) or at least 1, got "
                              f"{self.truncate_prompt_tokens}", "truncate_prompt_tokens")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def logprob_counts(self) -> tuple[Optional[int], Optional[int]]:
        """(logprobs, prompt_logprobs) for `SamplingParams`: top-k counts, None when not asked."""
        return None, None


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    # vLLM's: a text prompt gets the special tokens the tokenizer adds to one (Llama 3's BOS), unless false
    add_special_tokens: Optional[bool] = True  # (null: the default)
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {self.logprobs}",
                              "logprobs")
        if self.best_of not in (None, self.num_choices):
            raise unsupported(f"best_of={self.best_of} is not supported: this server returns the n choices it "
                              f"samples (leave best_of out, or equal to n={self.num_choices})", "best_of")
        if self.suffix:
            raise unsupported("suffix (insertion) is not supported by this server (leave it out)", "suffix")

    def logprob_counts(self) -> tuple[Optional[int], Optional[int]]:
        echoed = self.logprobs if self.echo else None
        if self.prompt_logprobs is not None and echoed is not None and echoed != self.prompt_logprobs:
            raise bad_request(f"prompt_logprobs={self.prompt_logprobs} and echo with logprobs={self.logprobs} ask "
                              "for the prompt's logprobs with two counts: give one, or the same", "prompt_logprobs")
        return self.logprobs, echoed if self.prompt_logprobs is None else self.prompt_logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    # name, tool_calls, tool_call_id reach the template
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None


def _arguments_as_object(call):
    """An assistant message's tool call as chat templates read it: OpenAI sends its arguments as JSON text, and the
    templates (Qwen's, Llama 3's: ``arguments | tojson``) want the object, as vLLM hands them. Left as it is
    where the text is not a JSON object."""
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args)
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": parsed}} if isinstance(parsed, dict) else call


# what the server itself gives the chat template (or its call takes): not settable through chat_template_kwargs
TEMPLATE_OWN_ARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "padding", "truncation", "max_length", "return_tensors",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"))


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's: variables for the template (enable_thinking ...)
    # OpenAI's, for reasoning models: a variable of the template (gpt-oss's reads it), as vLLM passes it
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    add_generation_prompt: bool = True  # vLLM's: False with continue_final_message (a prefilled assistant answer)
    continue_final_message: bool = False

    def check_unsupported(self) -> None:
        super().check_unsupported()
        check_template_fields(self)
        self.template_kwargs()
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {self.top_logprobs}",
                              "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    def logprob_counts(self) -> tuple[Optional[int], Optional[int]]:
        return (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs

    def template_messages(self) -> list[dict]:
        return template_messages(self.messages)

    def template_kwargs(self) -> Optional[dict[str, Any]]:
        """The template's variables: ``chat_template_kwargs``, and ``reasoning_effort`` when given (the two may not
        disagree)."""
        kwargs = self.chat_template_kwargs
        if self.reasoning_effort is None:
            return kwargs
        given = (kwargs or {}).get("reasoning_effort", self.reasoning_effort)
        if given != self.reasoning_effort:
            raise bad_request(f"reasoning_effort={self.reasoning_effort!r} and chat_template_kwargs.reasoning_effort="
                              f"{given!r} disagree: give one", "reasoning_effort")
        return {**(kwargs or {}), "reasoning_effort": self.reasoning_effort}


def check_template_fields(req) -> None:
    """The fields a chat body (or /tokenize's) gives the template: at least one message, template variables that
    are not the server's own, and ``continue_final_message`` only without the generation prompt and after the
    assistant's message."""
    for key in req.chat_template_kwargs or ():
        if key in TEMPLATE_OWN_ARGS:
            raise unsupported(f"chat_template_kwargs.{key}: the server sets {key!r} itself (from the request's "
                              "own fields)", f"chat_template_kwargs.{key}")
    if not req.messages:
        raise bad_request("messages must hold at least one message", "messages")
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request("continue_final_message: true continues the last message instead of starting "
                              "one: send add_generation_prompt: false with it", "add_generation_prompt")
        if req.messages[-1].role != "assistant":
            raise bad_request(f"continue_final_message: true continues the last of the messages, which must "
                              f"be the assistant's (messages[{len(req.messages) - 1}] is "
                              f"{req.messages[-1].role!r})", "messages")


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template wants them: content a string (text parts joined)."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise unsupported(f"messages[{i}]: content part of type {part.type!r} is not supported "
                                      "(text only)", f"messages[{i}].content")
                texts.append(part.text)
            d["content"] = "".join(texts)
        elif m.content is None:
            d["content"] = ""
        if isinstance(d.get("tool_calls"), list):
            d["tool_calls"] = [_arguments_as_object(c) for c in d["tool_calls"]]
        out.append(d)
    return out


class TokenizeRequest(_Body):
    """vLLM's /tokenize body: a completions ``prompt``, or chat ``messages`` with the fields that shape what the
    chat template renders."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give either prompt (text, tokenized as /v1/completions does) or messages (through "
                              "the chat template, as /v1/chat/completions does)", "prompt")
        if self.messages is not None:
            check_template_fields(self)
            if self.add_special_tokens:
                raise unsupported("add_special_tokens: true with messages: the chat template adds the model's "
                                  "special tokens itself (leave add_special_tokens out)", "add_special_tokens")


class DetokenizeRequest(_Body):
    """vLLM's /detokenize body: token ids to turn back into text."""
    model: Optional[str] = None
    tokens: list[int]


# --- turning a request into engine inputs -----------------------------------------------------

def completion_prompts(req: CompletionRequest) -> list[Union[str, list[int]]]:
    """The prompts of a completions request: one (text, or token ids) or a batch of them (a list of texts or of
    token-id lists), each generated as its own request."""
    p = req.prompt
    if isinstance(p, list) and not p:
        raise bad_request("prompt is empty: give a string or a list of token ids", "prompt")
    prompts = list(p) if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]
    for i, x in enumerate(prompts):
        where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
        if not x:
            raise bad_request(f"{where} is empty: give " + ("at least one token of text" if isinstance(x, str)
                                                            else "a string or a list of token ids"), where)
    return prompts


def _context_exceeded(message: str, param: str) -> APIError:
    return bad_request(message, param, CONTEXT_LENGTH_EXCEEDED)


def sampling_params(req: SamplingRequest, prompt_tokens: int, max_model_len: int, *,
                    default_max_tokens: Optional[int], max_tokens: Optional[int], prompt_param: str,
                    inputs: InputProcessor, structured=None) -> SamplingParams:
    """Check the sampling fields as the wire states them (OpenAI's ranges, and its refusal of a
    prompt plus ``max_tokens`` beyond the context); the engine's own checks come from ``inputs``
    (the vocabulary) and `SamplingParams`. A 400 names the field.

    ``default_max_tokens`` None means "the rest of the context" (chat, as vLLM)."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise _context_exceeded(f"This model's maximum context length is {max_model_len} tokens. However, your "
                                f"prompt has {prompt_tokens} tokens, which leaves no room to generate: shorten it.",
                                prompt_param)
    max_param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else default_max_tokens
    elif max_tokens < 1:
        raise bad_request(f"{max_param} must be at least 1, got {max_tokens}", max_param)
    if prompt_tokens + max_tokens > max_model_len:
        raise _context_exceeded(f"This model's maximum context length is {max_model_len} tokens. However, you "
                                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                                f"{max_tokens} in the completion). Please reduce the prompt or {max_param}.",
                                max_param)
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= MAX_TEMPERATURE:  # also NaN (refused before here: non-finite JSON)
        raise bad_request(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {req.temperature}",
                          "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if not 0 <= top_k <= MAX_TOP_K:
        raise bad_request(f"top_k must be -1 or 0 (off) or an integer from 1 to {MAX_TOP_K}, got {req.top_k}",
                          "top_k")
    if inputs.vocab_size is not None and top_k >= inputs.vocab_size:
        top_k = 0  # keeping the whole vocabulary is no filter
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise bad_request(f"seed must be an integer from 0 to {MAX_SEED}, got {req.seed}", "seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop holds {len(stop)} strings: at most {MAX_STOP_STRINGS}", "stop")
    if any(len(s) > MAX_STOP_LENGTH for s in stop):
        raise bad_request(f"a stop string is longer than {MAX_STOP_LENGTH} characters", "stop")
    stop = [s for s in stop if s]  # an empty stop string can never match
    stop_token_ids = list(req.stop_token_ids or [])
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids holds {len(stop_token_ids)} ids: at most {MAX_STOP_TOKEN_IDS}",
                          "stop_token_ids")
    try:
        inputs.check_token_ids(stop_token_ids, "stop_token_ids")  # before SamplingParams: it names the field
    except RequestError as e:
        raise bad_request(str(e), "stop_token_ids") from None
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed {max_param} ({max_tokens})", "min_tokens")
    extra = {name: float(value) for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
             if (value := getattr(req, name)) is not None}
    extra["logprobs"], extra["prompt_logprobs"] = req.logprob_counts()
    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=float(temperature), top_k=top_k,
                                top_p=float(top_p), seed=req.seed, stop_on_eos=not req.ignore_eos, stop=stop,
                                stop_token_ids=stop_token_ids, min_tokens=min_tokens,
                                include_stop_str_in_output=req.include_stop_str_in_output,
                                skip_special_tokens=req.skip_special_tokens,
                                logit_bias=logit_bias(req.logit_bias), allowed_token_ids=req.allowed_token_ids,
                                structured=structured, **extra)
    except ConfigError as e:  # the engine's own checks: their messages begin with the field's name
        name = str(e).split(" ", 1)[0]
        raise bad_request(str(e), {"max_new_tokens": max_param, "stop_on_eos": "ignore_eos"}.get(
            name, name if name in SamplingRequest.model_fields else None)) from None
    try:
        inputs.check_params(params)  # logit_bias and allowed_token_ids within the vocabulary
    except RequestError as e:
        raise bad_request(str(e), e.param) from None
    return params


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of each of ``n`` choices: choice i samples with ``seed + i`` (as vLLM's
    parallel sampling), so choice i of a seeded request equals one request with that seed; without
    a seed each choice draws its own stream."""
    if n == 1:
        return [params]
    return [params if params.seed is None or i == 0 else dataclasses.replace(params, seed=params.seed + i)
            for i in range(n)]


def logit_bias(wire: Optional[dict[str, float]]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings) as {token id: bias};
    the ranges are `SamplingParams`' to check."""
    out: dict[int, float] = {}
    for key, bias in (wire or {}).items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            shown = key if len(key) <= 40 else key[:37] + "..."
            raise bad_request(f"logit_bias keys must be token ids written as decimal strings (such as \"50256\"), "
                              f"got {shown!r}", "logit_bias")
        out[int(key)] = bias
    return out


def prompt_chars(req: SamplingRequest) -> int:
    """Characters of text the prompt holds (chat: every message's text; a batch of prompts: its longest), counted
    before tokenizing."""
    if isinstance(req, ChatCompletionRequest):
        total = 0
        for m in req.messages:
            if isinstance(m.content, str):
                total += len(m.content)
            elif m.content:
                total += sum(len(part.text or "") for part in m.content)
        return total
    p = req.prompt
    if isinstance(p, str):
        return len(p)
    return max((len(x) for x in p if isinstance(x, str)), default=0)  # a batch: each prompt is a request


# --- the request body -------------------------------------------------------------------------

def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _find_surrogate(obj: Any) -> Optional[str]:
    """The path (``messages[0].content``) of the first string holding a lone UTF-16 surrogate, which
    no UTF-8 text can hold ("" for a top-level key); None when there is none. Iterative: nesting
    depth costs no stack."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                if _SURROGATE.search(k):
                    return path
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


def parse_body(raw: bytes, model: type[_Body]) -> _Body:
    """The request body as ``model``: strict UTF-8 JSON (no NaN / Infinity literals, no lone
    surrogates), an object, valid against the model; anything else is a 400 naming the field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})", None, INVALID_JSON) from None
    try:
        obj = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        reason = str(e) if isinstance(e, ValueError) else "nested too deeply"
        raise bad_request(f"the request body is not valid JSON: {reason[:200]}", None, INVALID_JSON) from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}", None,
                          INVALID_TYPE)
    if "\\u" in text:  # a surrogate can only arrive as an escape: valid UTF-8 cannot encode one
        where = _find_surrogate(obj)
        if where is not None:
            raise bad_request(f"{where or 'the request body'}: the text holds a lone UTF-16 surrogate "
                              "(an unpaired \\ud800-\\udfff escape), which is not a character",
                              where or None, INVALID_VALUE)
    try:
        req = model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", None, INVALID_JSON) from None
    req._undeclared = {k: v for k, v in obj.items() if k in REFUSED and k not in model.model_fields}
    return req


# --- responses --------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(engine_reason: Optional[str]) -> str:
    """OpenAI knows "stop" (EOS, stop string, stop token) and "length"."""
    return "length" if engine_reason == "length" else "stop"


def model_card(name: str, max_model_len: int, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "rosecli",
            "max_model_len": max_model_len}


class Envelope:
    """The fields every response and chunk of one request shares (id, created, model)."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now()
        self.model = model
        self._templates: dict[tuple, tuple[str, str]] = {}  # text_event's, by (include_usage, index)

    def _wrap(self, object_: str, choices: list, usage_: Optional[dict], with_usage: bool) -> dict:
        out = {"id": self.id, "object": object_, "created": self.created, "model": self.model,
               "choices": choices, "system_fingerprint": None}
        if with_usage:
            out["usage"] = usage_
        return out

    # streaming
    def tool_chunk(self, calls: list[dict], include_usage: bool = False) -> dict:
        """A chat chunk whose delta holds tool-call deltas (each with its ``index``)."""
        choice = {"index": 0, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}
        return self._wrap("chat.completion.chunk", [choice], None, include_usage)

    def chunk(self, text: Optional[str] = None, finish: Optional[str] = None, role: bool = False,
              include_usage: bool = False, index: int = 0, logprobs: Optional[dict] = None) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return self._wrap("chat.completion.chunk", [choice], None, include_usage)
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return self._wrap("text_completion", [choice], None, include_usage)

    def text_event(self, text: str, include_usage: bool = False, index: int = 0) -> str:
        """``chunk(text, index=index)`` as its SSE event (``data: {...}``): the same bytes, from a
        template made once per request (and choice), so a token costs one ``json.dumps`` of its
        text and not of the envelope."""
        key = (bool(include_usage), index)
        t = self._templates.get(key)
        if t is None:
            mark = "\x00rose-text\x00"
            body = json.dumps(self.chunk(text=mark, include_usage=include_usage, index=index), separators=(",", ":"))
            before, after = body.split(json.dumps(mark), 1)
            t = self._templates[key] = ("data: " + before, after + "\n\n")
        return t[0] + json.dumps(text) + t[1]

    def usage_chunk(self, usage_: dict) -> dict:
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [], usage_, True)

    # non-streaming
    def response(self, choices: list[tuple[str, str, Optional[dict]]], usage_: dict,
                 tool_calls: Optional[list[dict]] = None, content: Optional[str] = None) -> dict:
        """``choices``: (text, finish reason, logprobs or None) of each, in index order.
        ``tool_calls``: the one choice's message is these calls (chat, tools), with ``content`` beside them."""
        if self.chat:
            out = [{"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": lp, "finish_reason": finish} for i, (text, finish, lp) in enumerate(choices)]
            if tool_calls:
                out[0]["message"].update(content=content, tool_calls=tool_calls)
            return self._wrap("chat.completion", out, usage_, True)
        out = [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
               for i, (text, finish, lp) in enumerate(choices)]
        return self._wrap("text_completion", out, usage_, True)


def prompt_logprobs_body(entries: Optional[list], k: int, token_text) -> Optional[list]:
    """vLLM's ``prompt_logprobs``: for each prompt token, None for the first, else {token id (a string): {logprob,
    rank, decoded_token}} for the token there and the ``k`` most likely (ranks 1..k)."""
    if entries is None:
        return None
    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": token_text(e.token_id)[0]}}
        for r, (t, lp) in enumerate(e.top[:k], 1):
            d.setdefault(str(t), {"logprob": _lp(lp), "rank": r, "decoded_token": token_text(t)[0]})
        out.append(d)
    return out


def token_id_text(token_id: int) -> tuple[str, bytes]:
    """A token as ``return_tokens_as_token_ids`` names it in logprobs (vLLM's): ``token_id:N``."""
    name = f"token_id:{token_id}"
    return name, name.encode()


def _lp(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB  # also -inf and NaN


class LogprobsFormat:
    """One choice's logprobs in its endpoint's shape. Completions: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (a dict per position of the chosen token and the top k, as vLLM) and
    ``text_offset`` (each token's offset in the choice's text, echoed prompt included: the sum of
    the token strings before it, as vLLM counts them). Chat: ``content``, a list of ``token``,
    ``logprob``, ``bytes`` and ``top_logprobs`` (the top k). ``token_text(id)`` -> (str, bytes)."""

    def __init__(self, chat: bool, token_text):
        self.chat = chat
        self.token_text = token_text
        self.offset = 0

    def __call__(self, entries: list[TokenLogprobs], prompt_ids: Optional[list[int]] = None,
                 prompt: Optional[list[Optional[TokenLogprobs]]] = None) -> dict:
        """The logprobs of ``entries`` (after the prompt's, ``prompt`` for ``prompt_ids``, when given)."""
        text = self.token_text
        if self.chat:
            content = []
            for e in entries:
                tok, b = text(e.token_id)
                top = []
                for t, lp in e.top:
                    s, tb = text(t)
                    top.append({"token": s, "logprob": _lp(lp), "bytes": list(tb)})
                content.append({"token": tok, "logprob": _lp(e.logprob), "bytes": list(b), "top_logprobs": top})
            return {"content": content, "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        positions = []
        if prompt_ids is not None:
            positions += [(t, prompt[j] if prompt is not None and j < len(prompt) else None)
                          for j, t in enumerate(prompt_ids)]
        positions += [(e.token_id, e) for e in entries]
        for token_id, e in positions:
            tok = text(token_id)[0]
            out["tokens"].append(tok)
            out["text_offset"].append(self.offset)
            self.offset += len(tok)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_lp(e.logprob))
            top = {tok: _lp(e.logprob)}
            for t, lp in e.top:
                top.setdefault(text(t)[0], _lp(lp))
            out["top_logprobs"].append(top)
        return out


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def validation_error(errors: list[dict]) -> APIError:
    """A pydantic validation failure as one 400 that names the first bad field."""
    if not errors:
        return bad_request("the request body is invalid")
    e = errors[0]
    loc = list(e.get("loc", ()))
    # pydantic names the member of a union it tried ("str", "list[int]"): not a field
    fields = [part for part in loc if isinstance(part, int)
              or not any(c in part for c in "[]-") and part not in _TYPE_TAGS]
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in fields).lstrip(".") or None
    where = f"{param}: " if param else ""
    if e.get("type") == "missing":
        return bad_request(f"{where}this field is required", param, MISSING_PARAMETER)
    kind = e.get("type", "")
    if fields != loc or kind.endswith("_type") or kind in ("model_type", "model_attributes_type"):
        msg, code = f"{where}wrong type", INVALID_TYPE
    else:
        msg, code = f"{where}{e.get('msg', 'invalid value')}", INVALID_VALUE
    if "input" in e and param:
        got = repr(e["input"])
        msg += f" (got {got if len(got) <= 80 else got[:77] + '...'})"
    return bad_request(msg, param, code)
