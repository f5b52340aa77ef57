"""OpenAI-compatible request and response shapes, and the checks that turn a request into
engine inputs (token ids + ``SamplingParams``) or a 400 that names the bad parameter.

Field names and defaults follow the OpenAI API (``max_tokens`` 16 for completions,
``temperature`` 1.0, ``n`` 1); the extensions vLLM users expect (``top_k``, ``ignore_eos``,
``stop_token_ids``) are accepted too. Unknown fields are ignored, as OpenAI and vLLM do;
known fields this server cannot honour (``n`` > 1, ``logprobs``, penalties ...) are refused
with a 400 rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

from rosecli.engine.config import SamplingParams
from rosecli.engine.errors import ConfigError


class APIError(Exception):
    """An error answered with an OpenAI-style body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[Union[str, int]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[Union[str, int]] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param)


# --- requests ---------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    def check_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise bad_request(f"n={self.n} is not supported: this server returns one choice per request "
                              "(send n separate requests)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported by this server (leave it unset or 0)", name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise bad_request("echo is not supported by this server", "echo")
        if self.logprobs is not None:
            raise bad_request("logprobs is not supported by this server", "logprobs")
        if self.best_of not in (None, 1):
            raise bad_request(f"best_of={self.best_of} is not supported: only 1", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id reach the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs or self.top_logprobs:
            raise bad_request("logprobs is not supported by this server", "logprobs")
        if self.tools:
            raise bad_request("tools are not supported by this server", "tools")
        if not self.messages:
            raise bad_request("messages must hold at least one message", "messages")

    def template_messages(self) -> list[dict]:
        """Messages as the chat template wants them: content a string (text parts joined)."""
        out = []
        for i, m in enumerate(self.messages):
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    if part.type != "text" or part.text is None:
                        raise bad_request(f"messages[{i}]: content part of type {part.type!r} is not supported "
                                          "(text only)", f"messages[{i}].content")
                    texts.append(part.text)
                d["content"] = "".join(texts)
            elif m.content is None:
                d["content"] = ""
            out.append(d)
        return out


# --- turning a request into engine inputs -----------------------------------------------------

def completion_prompt(req: CompletionRequest) -> Union[str, list[int]]:
    """The one prompt of a completions request: text, or token ids."""
    p = req.prompt
    if isinstance(p, list):
        if not p:
            raise bad_request("prompt is empty: give a string or a list of token ids", "prompt")
        if isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request(f"prompt holds {len(p)} prompts: this server takes one prompt per request "
                                  "(send them as separate requests)", "prompt")
            p = p[0]
    if isinstance(p, list) and not p:
        raise bad_request("prompt is empty: give a string or a list of token ids", "prompt")
    if isinstance(p, str) and not p:
        raise bad_request("prompt is empty: give at least one token of text", "prompt")
    return p


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param)


def sampling_params(req: SamplingRequest, prompt_tokens: int, max_model_len: int, *,
                    default_max_tokens: Optional[int], max_tokens: Optional[int], prompt_param: str,
                    vocab_size: int) -> SamplingParams:
    """Check the sampling fields against the prompt and the context; 400 names the field.

    ``default_max_tokens`` None means "the rest of the context" (chat, as vLLM)."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your "
                          f"prompt has {prompt_tokens} tokens, which leaves no room to generate: shorten it.",
                          prompt_param)
    max_param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else default_max_tokens
    elif max_tokens < 1:
        raise bad_request(f"{max_param} must be at least 1, got {max_tokens}", max_param)
    if prompt_tokens + max_tokens > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you "
                          f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                          f"{max_tokens} in the completion). Please reduce the prompt or {max_param}.", max_param)
    temperature = 1.0 if req.temperature is None else req.temperature
    if not temperature >= 0.0:  # also NaN
        raise bad_request(f"temperature must be >= 0, got {req.temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if top_k < 0:
        raise bad_request(f"top_k must be -1 or 0 (off) or a positive integer, got {req.top_k}", "top_k")
    if req.seed is not None and req.seed < 0:
        raise bad_request(f"seed must be >= 0, got {req.seed}", "seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop = [s for s in stop if s]  # an empty stop string can never match
    stop_token_ids = list(req.stop_token_ids or [])
    check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=float(temperature), top_k=top_k,
                              top_p=float(top_p), seed=req.seed, stop_on_eos=not req.ignore_eos, stop=stop,
                              stop_token_ids=stop_token_ids)
    except ConfigError as e:
        raise bad_request(str(e)) from None


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

    def _wrap(self, object_: str, choices: list, usage_: Optional[dict], with_usage: bool) -> dict:
        out = {"id": self.id, "object": object_, "created": self.created, "model": self.model,
               "choices": choices, "system_fingerprint": None}
        if with_usage:
            out["usage"] = usage_
        return out

    # streaming
    def chunk(self, text: Optional[str] = None, finish: Optional[str] = None, role: bool = False,
              include_usage: bool = False) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._wrap("chat.completion.chunk", [choice], None, include_usage)
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._wrap("text_completion", [choice], None, include_usage)

    def usage_chunk(self, usage_: dict) -> dict:
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [], usage_, True)

    # non-streaming
    def response(self, text: str, finish: str, usage_: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": finish}
            return self._wrap("chat.completion", [choice], usage_, True)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._wrap("text_completion", [choice], usage_, True)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def validation_error(errors: list[dict]) -> APIError:
    """A pydantic / FastAPI validation failure as one 400 that names the first bad field."""
    if not errors:
        return bad_request("the request body is invalid")
    e = errors[0]
    if e.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
    loc = [str(part) for part in e.get("loc", ()) if part != "body"]
    # pydantic names the member of a union it tried ("str", "list[int]"): not a field
    fields = [part for part in loc if not any(c in part for c in "[]-") and part not in _TYPE_TAGS]
    param = ".".join(fields) or None
    where = f"{param}: " if param else ""
    if e.get("type") == "missing":
        return bad_request(f"{where}this field is required", param)
    msg = f"{where}{'wrong type' if fields != loc else e.get('msg', 'invalid value')}"
    if "input" in e and param:
        got = repr(e["input"])
        msg += f" (got {got if len(got) <= 80 else got[:77] + '...'})"
    return bad_request(msg, param)

