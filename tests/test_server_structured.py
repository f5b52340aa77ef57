"""Structured output and tool calls through the real server (uvicorn, the official openai client):
``response_format``, vLLM's ``guided_*`` and ``structured_outputs``, ``tools`` with ``tool_choice``
"required" or a named function, streamed and not; bad schemas are 400s naming the field. The tiny
model's weights are random: only the grammar makes its output valid."""

from __future__ import annotations

for _extra in ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client"):
    __import__("pytest").importorskip(_extra)

import json
import re

import httpx
import pytest

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from test_server import MODEL, assert_released_after_leaving, metrics, server_fixtures  # noqa: E402

from rosecli.server import guided  # noqa: E402

MSG = [{"role": "user", "content": "Give me a city."}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
                                         "capital": {"type": "boolean"}},
        "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
COMMON = {"temperature": 1.0, "max_tokens": 200}


live, client, http = server_fixtures(timeout=120)


def _stream_text(chunks) -> tuple[str, str]:
    text, finish = "", None
    for c in chunks:
        if c.choices:
            d = c.choices[0]
            text += (d.delta.content or "") if hasattr(d, "delta") else (d.text or "")
            finish = d.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_response_format_json_schema(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=MSG, response_format=fmt, seed=seed,
                                           stream=stream, **COMMON)
        if stream:
            text, finish = _stream_text(r)
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), CITY)


def test_response_format_json_object_and_completions(client):
    r = client.completions.create(model=MODEL, prompt="JSON:", seed=1, extra_body={"guided_json": CITY}, **COMMON)
    jsonschema.validate(json.loads(r.choices[0].text), CITY)
    chunks = client.completions.create(model=MODEL, prompt="JSON:", seed=2, stream=True,
                                       extra_body={"guided_json": json.dumps(CITY)}, **COMMON)
    jsonschema.validate(json.loads(_stream_text(chunks)[0]), CITY)
    r = client.chat.completions.create(model=MODEL, messages=MSG, response_format={"type": "json_object"}, seed=3,
                                       temperature=1.0, max_tokens=40)
    text = r.choices[0].message.content
    assert text.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_guided_regex_choice_grammar(http, stream):
    def text_of(path, body):
        r = http.post(path, json={"model": MODEL, **COMMON, "seed": 5, "stream": stream, **body})
        assert r.status_code == 200, r.text
        if not stream:
            c = r.json()["choices"][0]
            return c["message"]["content"] if "message" in c else c["text"]
        out = ""
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    out += c.get("text") or (c.get("delta") or {}).get("content") or ""
        return out

    rx = r"[A-Z][a-z]{2,6}, [0-9]{2}"
    assert re.fullmatch(rx, text_of("/v1/completions", {"prompt": "x", "guided_regex": rx}))
    choices = ["yes", "no", "it depends"]
    assert text_of("/v1/chat/completions", {"messages": MSG, "guided_choice": choices}) in choices
    assert text_of("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": choices}}) in choices
    assert re.fullmatch(r"(ab)+!", text_of("/v1/completions", {"prompt": "x",
                                                                "guided_grammar": 'root ::= ("ab")+ "!"'}))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_choice_required(client, stream):
    """The openai client assembles the tool calls; each names a given function and its arguments
    validate against that function's parameters."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(3):
        kw = dict(model=MODEL, messages=MSG, tools=[WEATHER, TIME], tool_choice="required", seed=seed, **COMMON)
        if stream:
            with client.chat.completions.stream(**kw) as s:
                for _ in s:
                    pass
                msg = s.get_final_completion().choices[0]
        else:
            msg = client.chat.completions.create(**kw).choices[0]
        assert msg.finish_reason == "tool_calls"
        calls = msg.message.tool_calls
        assert calls and msg.message.content is None
        for call in calls:
            assert call.type == "function" and call.id
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_required_with_refs_in_the_parameters(client):
    """A tool whose parameters use ``$defs`` / ``$ref`` (what pydantic writes for nested models): its references
    still resolve once its schema sits inside the list of calls, so the call is made and its arguments validate
    (it was a 400, "Cannot find field $defs")."""
    city = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"],
            "additionalProperties": False}
    params = {"$defs": {"City": city}, "type": "object", "properties": {"to": {"$ref": "#/$defs/City"},
                                                                          "back": {"$ref": "#/$defs/City"}},
              "required": ["to", "back"], "additionalProperties": False}
    book = {"type": "function", "function": {"name": "book", "parameters": params}}
    for seed in range(2):
        msg = client.chat.completions.create(model=MODEL, messages=MSG, tools=[book, TIME], tool_choice="required",
                                             seed=seed, **COMMON).choices[0]
        assert msg.finish_reason == "tool_calls"
        for call in msg.message.tool_calls:
            schema = params if call.function.name == "book" else TIME["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_choice_named_function(client, stream):
    kw = dict(model=MODEL, messages=MSG, tools=[WEATHER, TIME], seed=11,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, **COMMON)
    if stream:
        with client.chat.completions.stream(**kw) as s:
            for _ in s:
                pass
            msg = s.get_final_completion().choices[0]
    else:
        msg = client.chat.completions.create(**kw).choices[0]
    (call,) = msg.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "Unsupported type"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
    ({"guided_json": {"type": "object", "not": {"required": ["a"]}}}, "guided_json", "'not'"),
    ({"guided_json": "{nope"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "(("}, "guided_regex", "parenthesis"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "not defined"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "both"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos", "structured output"),
    ({"tools": [WEATHER]}, "tool_choice", "auto"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "if": {}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "'if'"),
    ({"guided_json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "guided_json", "'oneOf'"),
]


@pytest.mark.parametrize("body,param,words", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_structured_requests_are_400s_naming_the_field(live, http, body, param, words):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert live.manager.is_alive
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 8, "guided_regex": "[0-9]{3}"})
    assert ok.status_code == 200 and re.fullmatch("[0-9]{3}", ok.json()["choices"][0]["text"])


# --- tool_choice "auto": the model's own format parsed --------------------------------------------------------

HERMES_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')


@pytest.mark.parametrize("template,fmt", [
    ("{% if tools %}...<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
     "{% endif %}", guided.HERMES),
    ("{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
     "value}.' }}", guided.LLAMA3_JSON),
    ("{{- '<|python_tag|>' + tool_call.name }}", guided.LLAMA3_JSON),
    ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}...{{- '[TOOL_CALLS]' }}",
     guided.MISTRAL),
    ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", None),
    (None, None),
])
def test_the_tool_format_is_read_off_the_chat_template(template, fmt):
    assert guided.tool_format(template) == fmt


AUTO_SPLITS = [  # (format, output, content, [(name, arguments)] or None: no call)
    (guided.HERMES, HERMES_CALL, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (guided.HERMES, "Let me look. " + HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Rome"), "Let me look.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Rome", "unit": "celsius"})]),
    (guided.HERMES, '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}', None,
     [("get_time", {"zone": "UTC"})]),  # arguments as a JSON string, the closing tag cut off at EOS
    (guided.HERMES, HERMES_CALL + " and then some words", HERMES_CALL + " and then some words", None),
    (guided.HERMES, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', None, None),  # not a given function
    (guided.HERMES, "<tool_call>{broken</tool_call>", None, None),
    (guided.HERMES, "It is sunny.", "It is sunny.", None),
    (guided.LLAMA3_JSON, ' {"name": "get_time", "parameters": {"zone": "CET"}}', None, [("get_time", {"zone": "CET"})]),
    (guided.LLAMA3_JSON, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", '
     '"parameters": {"city": "Oslo", "unit": "celsius"}}', None,
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    (guided.MISTRAL, '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": '
     '{"city": "Oslo", "unit": "celsius"}}]', None,
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    (guided.MISTRAL, '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "CET"}}]', None,
     [("get_time", {"zone": "CET"})]),  # the tag, where the text keeps it
    (guided.MISTRAL, '[1, 2, 3]', None, None),  # a list, not of calls
    (guided.MISTRAL, '{"name": "get_time", "arguments": {}}', None, None),  # not in a list
    (guided.LLAMA3_JSON, '{"name": "get_time"}', None, None),  # no arguments
    (guided.LLAMA3_JSON, 'Sure: {"name": "get_time", "parameters": {}}', None, None),  # text first: content
]


@pytest.mark.parametrize("fmt,text,content,calls", AUTO_SPLITS)
def test_auto_tool_calls_are_parsed_in_the_models_format(fmt, text, content, calls):
    tools = guided.AutoTools(fmt, {"get_weather", "get_time"})
    got_content, got = tools.split(text)
    if calls is None:
        assert got is None and got_content == text
        return
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)


def test_auto_streams_content_up_to_where_a_call_could_start():
    h = guided.AutoTools(guided.HERMES, {"f"})
    assert h.streamable("Let me look. <tool") == len("Let me look.")
    assert h.streamable("Let me look. <tool_call>{") == len("Let me look.")
    assert h.streamable("a < b") == len("a < b") and h.streamable("a <") == len("a") and h.streamable("a  ") == 1
    j = guided.AutoTools(guided.LLAMA3_JSON, {"f"})
    assert j.streamable("  ") == 0 and j.streamable(' {"name"') == 0 and j.streamable("Hi {") == 4
    m = guided.AutoTools(guided.MISTRAL, {"f"})
    assert m.streamable('[{"na') == 0 and m.streamable("[TOOL_CALLS][") == 0 and m.streamable("Sure [1]") == 8


def test_a_tool_round_trip_reaches_the_template_with_arguments_as_objects(http):
    """The agent loop's next turn: the assistant's call (arguments as JSON text, as OpenAI sends them) and the tool's
    result. Templates read ``arguments | tojson``, so the server hands them the object, as vLLM does; arguments
    that are not a JSON object stay text. The server takes the turn."""
    from rosecli.server.protocol import ChatCompletionRequest

    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    odd = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}
    body = {"model": MODEL, "max_tokens": 4, "tools": [TIME], "tool_choice": "none",
            "messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [call, odd]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]}
    msgs = ChatCompletionRequest.model_validate(body).template_messages()
    assert [c["function"]["arguments"] for c in msgs[1]["tool_calls"]] == [{"zone": "UTC"}, "not json"]
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"zone": "UTC"}'  # (not changed)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


@pytest.fixture
def auto_format(live):
    """The live server as if its model's template had ``fmt``'s tool format (the tiny model's has none)."""
    server = live.app.state.rose
    saved = server.tool_format

    def use(fmt):
        server.tool_format = fmt

    yield use
    server.tool_format = saved


def _forced(regex: str, stream: bool, client, **kw):
    """A chat completion under tool_choice "auto" whose output a guided_regex forces (random weights)."""
    kw = dict(model=MODEL, messages=MSG, tools=[WEATHER, TIME], seed=1, temperature=1.0, max_tokens=120,
              extra_body={"guided_regex": regex}, **kw)
    if not stream:
        return client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as s:
        deltas = [e.delta for e in s if e.type == "content.delta"]
        choice = s.get_final_completion().choices[0]
    assert "".join(deltas) == (choice.message.content or "")  # content streamed as it came, nothing twice
    return choice


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_choice_auto_returns_the_models_calls(client, auto_format, stream):
    """Content before the call and the call itself (Hermes), a bare JSON call (Llama 3), a list of calls (Mistral),
    and plain text (no call):
    the openai client gets ``tool_calls`` with ``finish_reason`` "tool_calls", or content with "stop"."""
    auto_format(guided.HERMES)
    msg = _forced(re.escape("Let me check. " + HERMES_CALL), stream, client)
    assert msg.finish_reason == "tool_calls" and msg.message.content == "Let me check."
    (call,) = msg.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris",
                                                                                          "unit": "celsius"}
    msg = _forced("It is (sunny|raining)\\.", stream, client)
    assert msg.finish_reason == "stop" and not msg.message.tool_calls and msg.message.content in ("It is sunny.",
                                                                                                 "It is raining.")
    auto_format(guided.LLAMA3_JSON)
    msg = _forced(re.escape('{"name": "get_time", "parameters": {"zone": "UTC"}}'), stream, client)
    assert msg.finish_reason == "tool_calls" and not msg.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.message.tool_calls] == [
        ("get_time", {"zone": "UTC"})]
    auto_format(guided.MISTRAL)
    msg = _forced(re.escape('[{"name": "get_time", "arguments": {"zone": "CET"}}]'), stream, client)
    assert msg.finish_reason == "tool_calls" and not msg.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.message.tool_calls] == [
        ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("held", [False, True], ids=["content-streaming", "call-held"])
def test_a_client_leaving_an_auto_tool_stream_frees_its_request(http, auto_format, held):
    """The client goes away mid-stream under "auto": while content streams, and while a call is held (nothing is
    sent until the end). The request is aborted and its KV blocks freed, and the server serves the next one."""
    import time

    auto_format(guided.HERMES)
    regex = ('<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "[a-z]{400}"\\}\\}' if held
             else "Let me think[a-z ]{400}")
    before = metrics(http)[("rose_requests_total", frozenset({("finish_reason", "abort")}))]
    body = {"model": MODEL, "messages": MSG, "tools": [WEATHER], "stream": True, "max_tokens": 420, "seed": 1,
            "temperature": 1.0, "guided_regex": regex}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)  # the role chunk
        deadline = time.monotonic() + 10
        while metrics(http)[("rose_kv_blocks_used", frozenset())] == 0:  # (running: it holds blocks)
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert_released_after_leaving(http, before, within_s=10)
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 8, "guided_regex": "[0-9]{3}"})
    assert ok.status_code == 200 and re.fullmatch("[0-9]{3}", ok.json()["choices"][0]["text"])


def test_tools_are_a_chat_feature(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "tools": [WEATHER],
                                           "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("tools", "tool_choice")


def test_without_the_library_the_error_says_what_to_install(live, http, monkeypatch):
    import builtins

    structured = live.engine.structured
    real_import = builtins.__import__

    def no_xgrammar(name, *a, **kw):
        if name == "xgrammar":
            raise ImportError("No module named 'xgrammar'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    monkeypatch.setattr(structured, "compiler", None)  # as before any grammar was compiled
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "guided_regex": "[a-z]{1,3}x"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "install rosecli[structured]" in err["message"] and err["param"] == "guided_regex"


def test_structured_output_with_the_engine_in_its_own_process(cache_dir):
    """serve-local --engine-process: the server checks the grammar (a 400 names the field), the
    child compiles it off its engine thread and constrains the output."""
    from test_engine_process import RemoteServer

    srv = RemoteServer(cache_dir)
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "seed": 3, **COMMON,
                                                        "response_format": {"type": "json_schema", "json_schema": {
                                                            "name": "c", "schema": CITY}}})
            assert r.status_code == 200, r.text
            jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), CITY)
            bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "guided_regex": "(("})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
    finally:
        srv.stop()
