"""Structured output and tool calls on the wire: OpenAI's ``response_format`` and ``tools`` /
``tool_choice``, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
and their newer ``structured_outputs`` spelling, turned into one `GrammarSpec` for the engine (or a
400 naming the field); and the output of a tool-call request turned back into ``tool_calls``.

Tool calls (chat only): ``tool_choice`` naming a function constrains the output to that function's
arguments (a JSON object valid against its ``parameters`` schema), returned as one call;
``"required"`` constrains it to a JSON array of one or more ``{"name": ..., "parameters": {...}}``
calls of the given functions (at most one with ``parallel_tool_calls: false``). ``"auto"`` (the
default when tools are given) leaves the output free and parses it in the model's own tool-call format, read off its
chat template (`tool_format`): Hermes / Qwen's ``<tool_call>{...}</tool_call>`` blocks, Llama 3's bare JSON
``{"name": ..., "parameters": ...}`` or Mistral's ``[TOOL_CALLS][{...}]`` (`AutoTools`); a model whose template has
none of them gets a 400 that says what to send instead.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional, Union

from rosecli.engine import json_schema
from rosecli.engine.errors import RequestError
from rosecli.engine.structured import GrammarSpec
from rosecli.server.protocol import ChatCompletionRequest, SamplingRequest, bad_request, unsupported

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
_STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}


class ToolMode:
    """How a request's output becomes tool calls: one call of ``name`` whose arguments are the
    output, or (``name`` None) a JSON array of ``{"name", "parameters"}`` calls."""

    __slots__ = ("name",)

    def __init__(self, name: Optional[str]):
        self.name = name

    def calls(self, text: str) -> Optional[list[dict]]:
        """The tool calls ``text`` holds (OpenAI's shape); None when it does not parse (cut short)."""
        if self.name is not None:
            return [tool_call(self.name, text)]
        try:
            items = json.loads(text)
        except ValueError:
            return None
        if not isinstance(items, list) or not all(isinstance(c, dict) and "name" in c for c in items):
            return None
        return [tool_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in items]


HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
_HERMES_OPEN = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)  # (the closing tag may be cut off at EOS)
# the bare-JSON formats: the tag a call may open with (a special token, left out of the text unless kept) and what its
# JSON opens with (Llama 3: one object, or several after one another; Mistral: one list of objects)
_BARE = {LLAMA3_JSON: ("<|python_tag|>", "{"), MISTRAL: ("[TOOL_CALLS]", "[")}


def tool_format(chat_template: Optional[str]) -> Optional[str]:
    """The tool-call format a chat template asks its model for: `HERMES` (Qwen 2.5/3, Hermes: the template shows
    ``<tool_call>`` blocks), `LLAMA3_JSON` (Llama 3.1-3.3: a bare JSON object with "name" and "parameters"),
    `MISTRAL` (Mistral v0.3, Nemo: ``[TOOL_CALLS]`` and a JSON list of calls), or None (no tool format this server
    can parse)."""
    if not isinstance(chat_template, str):
        return None
    if _HERMES_OPEN in chat_template:
        return HERMES
    if _BARE[MISTRAL][0] in chat_template:
        return MISTRAL
    if _BARE[LLAMA3_JSON][0] in chat_template or '"parameters": dictionary of argument name' in chat_template:
        return LLAMA3_JSON
    return None


class AutoTools:
    """``tool_choice: "auto"``: the output is free; what of it is tool calls in the model's format (``fmt``, one of
    `tool_format`'s) is returned as calls of the request's functions (``names``), the rest as content."""

    __slots__ = ("fmt", "names")

    def __init__(self, fmt: str, names: set):
        self.fmt, self.names = fmt, names

    def split(self, text: str) -> tuple[Optional[str], Optional[list[dict]]]:
        """(content, calls) of a finished output: calls None (and the whole text the content) unless every call in
        it parses and names one of the functions; content None when the calls are all there is."""
        start = self._start(text)
        if start is None:
            return text, None
        found = self._parse(text[start:])
        if not found or any(name not in self.names for name, _ in found):
            return text, None
        content = text[:start].rstrip() or None
        return content, [tool_call(name, json.dumps(args, ensure_ascii=False)) for name, args in found]

    def streamable(self, text: str) -> int:
        """How much of ``text`` (an output so far) is content for sure, and can be streamed: up to where a call
        starts, or could start (a `HERMES` text ending in a prefix of ``<tool_call>``; a bare-JSON format's text
        that is blank so far or opens as a call does), less trailing blanks (`split` drops those before a call)."""
        upto = self._start(text)
        if upto is None:
            upto = len(text)
            for k in range(min(len(_HERMES_OPEN) - 1, len(text)) if self.fmt == HERMES else 0, 0, -1):
                if _HERMES_OPEN.startswith(text[-k:]):
                    upto -= k
                    break
        return len(text[:upto].rstrip())

    def _start(self, text: str) -> Optional[int]:
        if self.fmt == HERMES:
            i = text.find(_HERMES_OPEN)
            return i if i >= 0 else None
        tag, opener = _BARE[self.fmt]
        body = text.lstrip()
        call = body[len(tag):].lstrip() if body.startswith(tag) else body
        return len(text) - len(body) if call.startswith(opener) else None

    def _parse(self, text: str) -> Optional[list[tuple[str, dict]]]:
        if self.fmt == HERMES:
            blocks = _HERMES_CALL.findall(text)
            rest = _HERMES_CALL.sub("", text)
            if rest.strip():  # text after the calls: not a tool-call message
                return None
        else:
            tag = _BARE[self.fmt][0]
            body = text.lstrip()
            blocks = _json_values(body[len(tag):] if body.startswith(tag) else body)
            if self.fmt == MISTRAL:  # (one list of calls)
                blocks = blocks[0] if blocks and len(blocks) == 1 and isinstance(blocks[0], list) else None
            if not blocks:
                return None
        out = []
        for block in blocks:
            try:
                obj = json.loads(block) if isinstance(block, str) else block
            except ValueError:
                return None
            args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                return None
            out.append((obj["name"], args))
        return out


def _json_values(text: str) -> Optional[list]:
    """The JSON values ``text`` is made of, one after another (separated by blanks or ";"); None if it is not."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return out or None
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(obj)


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _spec(kind: str, value, param: str) -> GrammarSpec:
    try:
        if kind == "json":
            return GrammarSpec.json_schema(value, param)
        if kind == "choice":
            return GrammarSpec.choice(value, param)
        if kind == "json_object":
            return GrammarSpec("json_object", "", param)
        if not isinstance(value, str) or not value:
            raise RequestError(f"{param} must be a non-empty string", param)
        return GrammarSpec(kind, value, param)
    except RequestError as e:
        raise bad_request(str(e), e.param) from None


def _response_format(rf: dict) -> Optional[GrammarSpec]:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("response_format.json_schema must be an object holding the schema: "
                              "{\"name\": ..., \"schema\": {...}}", "response_format.json_schema")
        schema = js.get("schema")
        if schema is None:  # no schema: any JSON object
            return GrammarSpec("json_object", "", "response_format")
        return _spec("json", schema, "response_format.json_schema.schema")
    raise bad_request(f"response_format.type must be \"text\", \"json_object\" or \"json_schema\", got "
                      f"{json.dumps(kind)[:40]}", "response_format.type")


def grammar_spec(req: SamplingRequest, fmt: Optional[str] = None
                 ) -> tuple[Optional[GrammarSpec], Union[ToolMode, AutoTools, None]]:
    """The grammar a request's output must match (None: free), and how its output becomes tool
    calls (None: it is the message's content). At most one of the fields may ask for a grammar.
    ``fmt``: the model's tool-call format (`tool_format`), for ``tool_choice: "auto"``."""
    found: list[tuple[str, GrammarSpec]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, _spec(kind, value, name)))
    if req.structured_outputs:
        so = req.structured_outputs
        keys = [k for k in so if k in _STRUCTURED_KEYS and so[k] not in (None, False)]
        unknown = [k for k in so if k not in _STRUCTURED_KEYS and k not in ("disable_any_whitespace", "backend",
                                                                              "whitespace_pattern")]
        if unknown:
            raise unsupported(f"structured_outputs.{unknown[0]} is not supported (json, regex, choice, grammar, "
                              "json_object)", f"structured_outputs.{unknown[0]}")
        if len(keys) != 1:
            raise bad_request("structured_outputs must hold exactly one of json, regex, choice, grammar, "
                              "json_object", "structured_outputs")
        k = keys[0]
        found.append(("structured_outputs", _spec(_STRUCTURED_KEYS[k], so[k], f"structured_outputs.{k}")))
    mode = None
    if isinstance(req, ChatCompletionRequest):
        tool = _tool_spec(req, fmt)
        if tool is not None:
            if tool[0] is not None:
                found.append(("tool_choice", tool[0]))
            mode = tool[1]
    if len(found) > 1:
        raise bad_request(f"{found[0][0]} and {found[1][0]} both constrain the output: give one of them",
                          found[1][0])
    return (found[0][1] if found else None), mode


def _tool_spec(req: ChatCompletionRequest, fmt: Optional[str]
               ) -> Optional[tuple[Optional[GrammarSpec], Union[ToolMode, AutoTools]]]:
    tools, choice = req.tools or [], req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise bad_request("tool_choice needs tools: give the functions in tools", "tool_choice")
    if choice == "auto" and fmt is None:
        raise unsupported("tool_choice \"auto\" (the default when tools are given) is not supported for this "
                          "model: its chat template has no tool-call format this server parses (Hermes/Qwen "
                          "<tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS]). Send tool_choice \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}: the output is then constrained to "
                          "a valid call", "tool_choice")
    schemas: dict[str, Any] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                              "\"parameters\": {...}}}}", f"tools[{i}]")
        params = fn.get("parameters")
        if params is None or params == {}:
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              f"tools[{i}].function.parameters")
        # its keywords checked (and rewritten) where it is named
        schemas[fn["name"]] = json.loads(_spec("json", params, f"tools[{i}].function.parameters").value)
    if choice == "auto":
        return None, AutoTools(fmt, set(schemas))
    if choice == "required":
        calls, defs = [], {}
        for i, (name, schema) in enumerate(schemas.items()):
            ref, own = json_schema.embed(schema, f"tool{i}")  # (its own $refs kept pointing inside it)
            defs.update(own)
            calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": ref},
                          "required": ["name", "parameters"], "additionalProperties": False})
        array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                 "minItems": 1, "$defs": defs}
        if req.parallel_tool_calls is False:
            array["maxItems"] = 1
        return _spec("json", array, "tools"), ToolMode(None)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice must be \"none\", \"required\" or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}", "tool_choice")
        if name not in schemas:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
        i = list(schemas).index(name)
        return _spec("json", schemas[name], f"tools[{i}].function.parameters"), ToolMode(name)
    raise bad_request(f"tool_choice must be \"none\", \"required\" or a named function, got "
                      f"{json.dumps(choice)[:40]}", "tool_choice")
