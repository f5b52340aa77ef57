"""Structured output and tool calls on the wire: OpenAI's ``response_format`` and ``tools`` /
``tool_choice``, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
and their newer ``structured_outputs`` spelling, turned into one `GrammarSpec` for the engine (or a
400 naming the field); and the output of a tool-call request turned back into ``tool_calls``.

Tool calls (chat only): ``tool_choice`` naming a function constrains the output to that function's
arguments (a JSON object valid against its ``parameters`` schema), returned as one call;
``"required"`` constrains it to a JSON array of one or more ``{"name": ..., "parameters": {...}}``
calls of the given functions (at most one with ``parallel_tool_calls: false``). ``"auto"`` (the
default when tools are given) needs a parser for the model's own tool-call format, which this
server does not have: it is a 400 that says what to send instead.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

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


def grammar_spec(req: SamplingRequest) -> tuple[Optional[GrammarSpec], Optional[ToolMode]]:
    """The grammar a request's output must match (None: free), and how its output becomes tool
    calls (None: it is the message's content). At most one of the fields may ask for a grammar."""
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
        tool = _tool_spec(req)
        if tool is not None:
            found.append(("tool_choice", tool[0]))
            mode = tool[1]
    if len(found) > 1:
        raise bad_request(f"{found[0][0]} and {found[1][0]} both constrain the output: give one of them",
                          found[1][0])
    return (found[0][1] if found else None), mode


def _tool_spec(req: ChatCompletionRequest) -> Optional[tuple[GrammarSpec, ToolMode]]:
    tools, choice = req.tools or [], req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if choice == "auto":
        raise unsupported("tool_choice \"auto\" (the default when tools are given) is not supported: this server "
                          "has no parser for the model's own tool-call format. Send tool_choice \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}: the output is then constrained "
                          "to a valid call", "tool_choice")
    if not tools:
        raise bad_request("tool_choice needs tools: give the functions in tools", "tool_choice")
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
