"""Nothing a request asks for can hurt the engine: parameters out of range are refused when the
request is built, a failure in one request fails that request only, aborted and oversized
requests give their KV blocks back, and a dead engine tells every waiting caller."""

import math
import threading
import time

import pytest

from rosecli.engine.config import SamplingParams
from rosecli.engine.errors import ConfigError
from rosecli.engine.streaming import StreamingManager

GREEDY = dict(stop_on_eos=False)

BAD_PARAMS = [
    ("top_k", dict(top_k=2**63)),
    ("top_k", dict(top_k=2**31)),
    ("top_k", dict(top_k=True)),
    ("seed", dict(seed=2**64)),
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=False)),
    ("max_new_tokens", dict(max_new_tokens=2**31)),
    ("max_new_tokens", dict(max_new_tokens=True)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature=1e6)),
    ("temperature", dict(temperature=True)),
    ("top_p", dict(top_p=math.nan)),
    ("top_p", dict(top_p=True)),
    ("stop_on_eos", dict(stop_on_eos="no")),
    ("stop", dict(stop=[f"s{i}" for i in range(17)])),
    ("stop", dict(stop=["x" * 257])),
    ("stop", dict(stop=[3])),
    ("stop_token_ids", dict(stop_token_ids=[2**40])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=list(range(1025)))),
]


@pytest.mark.parametrize("field,kw", BAD_PARAMS, ids=[f"{f}={list(kw.values())[0]!r}"[:40] for f, kw in BAD_PARAMS])
def test_out_of_range_sampling_params_name_the_field(field, kw):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kw)


def test_extreme_but_allowed_params_run(tiny_engine_factory):
    engine = tiny_engine_factory("tiny-llama")
    manager = StreamingManager(engine)
    try:
        params = [SamplingParams(max_new_tokens=3, temperature=100.0, top_k=2**31 - 1, seed=2**64 - 1, **GREEDY),
                  SamplingParams(max_new_tokens=3, temperature=1e-9, top_p=1e-300, **GREEDY),
                  SamplingParams(max_new_tokens=3, stop=["x" * 256] * 16, stop_token_ids=[2**31 - 1], **GREEDY)]
        outs = [manager.result(manager.add_request([5, 6, 7], p)) for p in params]
        assert [o.output_tokens for o in outs] == [3, 3, 3]
        assert params[1].temperature == 0.0  # too small to divide by: greedy
        assert manager.is_alive
    finally:
        manager.close()


def _invoke_cli(args, timeout):
    """Run `rose ARGS` through Typer's runner on a thread: a command that loops fails the test."""
    from typer.testing import CliRunner

    from rosecli.commands.main import app

    box = []
    t = threading.Thread(target=lambda: box.append(CliRunner().invoke(app, args)), daemon=True)
    t.start()
    t.join(timeout)
    assert box, f"`rose {' '.join(args)}` did not finish within {timeout} s"
    return box[0]


def test_generate_longer_than_the_pool_finishes_with_length(cache_dir):
    # one block of 16 tokens; it used to spin forever once the sequence needed a second block
    r = _invoke_cli(["generate", "Hello", "--load-format", "dummy", "--model", "tiny-llama", "--device", "cpu",
                     "--no-chat", "--num-gpu-blocks", "1", "--max-new-tokens", "100", "--no-stop-on-eos",
                     "--cache-dir", cache_dir], timeout=120)
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())  # the summary line may be wrapped
    assert "prompt tokens 1, generated tokens 15" in out and "finish length" in out
