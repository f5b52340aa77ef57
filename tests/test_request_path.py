"""One request path: every caller (the streaming manager, `rose generate`, the HTTP server streaming
and not, the `bench stream` driver) gets the same text through the same output processor; a stop
string, even one split across several tokens, never leaks a prefix of itself or anything after it.

The tiny dummy Llama (real SmolLM2 tokenizer) repeats the last prompt token, so the text without
a stop string is known; the stop strings are cut from it across token boundaries."""

from __future__ import annotations

import json
import queue

import pytest

from rosecli.bench.drivers import run_stream
from rosecli.bench.workload import Workload
from rosecli.engine.config import SamplingParams
from rosecli.engine.streaming import END, StreamingManager

PROMPT = "The capital of France is"
N = 12
GREEDY = dict(stop_on_eos=False)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def engine(tiny_engine_factory, request):
    return tiny_engine_factory("tiny-llama", overlap_schedule=request.param, block_size=8)


@pytest.fixture(scope="module")
def reference(tiny_engine_factory):
    """(text, each token's text) of PROMPT's N greedy tokens without any stop string."""
    engine = tiny_engine_factory("tiny-llama")
    out = engine.generate([PROMPT], SamplingParams(max_new_tokens=N, **GREEDY))[0]
    pieces = [engine.tokenizer.decode([t]) for t in out.token_ids]
    assert "".join(pieces) == out.text and all(len(p) >= 4 for p in pieces[:4]), pieces
    return out.text, pieces


def _cases(reference):
    """(name, stop strings, expected text, tokens generated up to the stop)."""
    text, pieces = reference
    b1 = len(pieces[0])
    b2 = b1 + len(pieces[1])
    b3 = b2 + len(pieces[2])
    cases = [
        ("across two tokens", [text[b1 - 2:b1 + 3]]),
        ("across three tokens", [text[b1 - 1:b2 + 2]]),
        ("across four tokens, with a decoy", ["never seen", text[b1 - 1:b3 + 1]]),
        ("in the first token", [pieces[0][1:3]]),
    ]
    out = []
    for name, stops in cases:
        at = min(text.index(s) for s in stops if s in text)
        end = min(text.index(s) + len(s) for s in stops if s in text and text.index(s) == at)
        tokens = next(i + 1 for i in range(N) if len("".join(pieces[:i + 1])) >= end)
        out.append((name, stops, text[:at], tokens))
    return out


def _check_manager(engine, stops, expected, tokens):
    manager = StreamingManager(engine)
    try:
        rid = manager.add_request(PROMPT, SamplingParams(max_new_tokens=N, stop=stops, **GREEDY))
        stream = manager.stream(rid)
        pieces = list(stream)
        out = stream.output
        assert "".join(pieces) == out.text == expected
        assert out.finish_reason == "stop" and out.output_tokens == tokens
        assert manager.wait_idle() and manager.stats()["kv_blocks_used"] == 0
        # sink mode: the same text
        sink = queue.SimpleQueue()
        rid = manager.add_request(PROMPT, SamplingParams(max_new_tokens=N, stop=stops, **GREEDY), sink=sink)
        got = []
        while (item := sink.get(timeout=60))[1] is not END:
            got.append(item[1])
        assert "".join(got) == manager.take_output(rid).text == expected
        assert manager.wait_idle() and manager.stats()["kv_blocks_used"] == 0
    finally:
        manager.close()


def test_manager_cuts_stop_strings_split_across_tokens(engine, reference):
    for name, stops, expected, tokens in _cases(reference):
        _check_manager(engine, stops, expected, tokens)


def test_stop_string_ends_a_request_among_others_and_frees_its_blocks(engine, reference):
    text, pieces = reference
    stop = text[len(pieces[0]) - 1:len(pieces[0]) + 2]
    manager = StreamingManager(engine)
    try:
        long = manager.add_request(PROMPT, SamplingParams(max_new_tokens=N, **GREEDY))
        short = manager.add_request(PROMPT, SamplingParams(max_new_tokens=N, stop=[stop], **GREEDY))
        assert manager.result(short).text == text[:text.index(stop)]
        assert manager.result(long).text == text
        assert manager.wait_idle() and manager.stats()["kv_blocks_used"] == 0
    finally:
        manager.close()


def test_offline_generate_cuts_the_same(engine, reference):
    for name, stops, expected, tokens in _cases(reference):
        out = engine.generate([PROMPT], SamplingParams(max_new_tokens=N, stop=stops, **GREEDY))[0]
        assert (out.text, out.finish_reason, len(out.token_ids)) == (expected, "stop", tokens), name


def test_bench_stream_driver_stops_like_the_others(engine, reference):
    (name, stops, expected, tokens) = _cases(reference)[1]
    manager = StreamingManager(engine)
    try:
        workload = Workload([PROMPT] * 3, [N] * 3, [0.0] * 3, relative=False)
        run = run_stream(manager, workload, SamplingParams(max_new_tokens=N, stop=stops, **GREEDY))
        assert not run.failures
        assert [(t.finish_reason, t.output_tokens) for t in run.timings] == [("stop", tokens)] * 3
        assert manager.wait_idle() and manager.stats()["kv_blocks_used"] == 0
    finally:
        manager.close()


def _rose(args, cache_dir):
    from typer.testing import CliRunner

    from rosecli.commands.main import app

    return CliRunner().invoke(app, ["generate", "--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
                                    "--no-chat", "--no-stop-on-eos", "--max-new-tokens", str(N),
                                    "--cache-dir", cache_dir, *args])


def test_rose_generate_prints_no_part_of_a_stop_string(reference, cache_dir):
    cases = _cases(reference)
    for name, stops, expected, tokens in cases:
        args = [a for s in stops for a in ("--stop", s)]
        r = _rose([*args, PROMPT], cache_dir)
        assert r.exit_code == 0, r.output
        assert r.stdout == expected + "\n", name  # streamed: exactly the text before the stop
        summary = " ".join(r.stderr.split())
        assert f"generated tokens {tokens}," in summary and "finish stop" in summary
    # several prompts: one block each
    name, stops, expected, tokens = cases[0]
    r = _rose(["--stop", stops[0], PROMPT, PROMPT], cache_dir)
    assert r.exit_code == 0, r.output
    assert r.stdout == f"=== [0] {PROMPT}\n{expected}\n=== [1] {PROMPT}\n{expected}\n"


def test_server_stream_and_non_stream_cut_the_same(reference, cache_dir):
    for extra in ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client"):
        pytest.importorskip(extra)
    import httpx
    from test_server import LiveServer

    live = LiveServer(cache_dir)
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            for name, stops, expected, tokens in _cases(reference):
                body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": N, "temperature": 0,
                        "ignore_eos": True, "stop": stops}
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert (choice["text"], choice["finish_reason"]) == (expected, "stop"), name
                assert r.json()["usage"]["completion_tokens"] == tokens
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                    events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                chunks = [json.loads(e)["choices"] for e in events[:-1]]
                assert "".join(c[0]["text"] for c in chunks if c) == expected, name
                assert [c[0]["finish_reason"] for c in chunks if c][-1] == "stop"
            assert live.manager.wait_idle() and live.manager.stats()["kv_blocks_used"] == 0
    finally:
        live.stop()
