"""Nothing a request asks for can hurt the engine: parameters out of range are refused when the
request is built, a failure in one request fails that request only, aborted and oversized
requests give their KV blocks back, and a dead engine tells every waiting caller."""

import math
import threading
import time

import pytest

from rosecli.engine import outputs
from rosecli.engine.config import SamplingParams
from rosecli.engine.detokenizer import IncrementalDetokenizer
from rosecli.engine.errors import ConfigError, RequestFailedError
from rosecli.engine.streaming import EngineDeadError, StreamingManager

GREEDY = dict(stop_on_eos=False)
POISON = 4242  # a prompt starting with this token id is the one request made to fail
POISON_STOP = "\x00poison"  # a stop string only the poisoned request has (it never matches)


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    # tokenize_workers: text prompts are tokenized off the caller's thread, where a failure used to be lost
    return tiny_engine_factory("tiny-llama", tokenize_workers=1, num_gpu_blocks=64, block_size=8)


def _consume(manager, rid, box, i):
    stream = manager.stream(rid)
    try:
        box[i] = ("".join(stream), stream.output)
    except Exception as e:  # noqa: BLE001 - the test looks at what each consumer got
        box[i] = (e, stream.output)


def _run_concurrently(manager, prompts, params, timeout=60.0):
    """Submit every prompt, read every stream on its own thread; [(text or error, output)]."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    rids = [manager.add_request(p, sp) for p, sp in zip(prompts, plist)]
    box = [None] * len(rids)
    threads = [threading.Thread(target=_consume, args=(manager, rid, box, i), daemon=True)
               for i, rid in enumerate(rids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert all(r is not None for r in box), f"a stream did not end within {timeout} s: {box}"
    return box

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


def test_extreme_but_allowed_params_run(engine):
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


def _poison_tokenizer(monkeypatch, engine):
    encode = engine.inputs.encode

    def failing(prompt, *args):
        if prompt.startswith("poison"):
            raise UnicodeError("the tokenizer choked")
        return encode(prompt, *args)

    monkeypatch.setattr(engine.inputs, "encode", failing)


def _poison_admission(monkeypatch, engine):
    add = engine.runner.add_request

    def failing(seq):
        if seq.token_ids[0] == POISON:
            raise RuntimeError("seeding failed")
        add(seq)

    monkeypatch.setattr(engine.runner, "add_request", failing)


def _poison_stop_check(monkeypatch, engine):
    find = outputs.find_stop

    def failing(text, stops, start, keep=False):
        if POISON_STOP in stops and len(text) >= 3:
            raise IndexError("stop-string check failed")
        return find(text, stops, start, keep)

    monkeypatch.setattr(outputs, "find_stop", failing)


def _poison_detokenizer(monkeypatch, engine):
    class Failing(IncrementalDetokenizer):
        __slots__ = ("poisoned", "pushed")

        def __init__(self, tokenizer, prompt_token_ids=None, **kw):
            super().__init__(tokenizer, prompt_token_ids, **kw)
            self.poisoned = bool(prompt_token_ids) and prompt_token_ids[0] == POISON
            self.pushed = 0

        def push(self, token_id):
            self.pushed += 1
            if self.poisoned and self.pushed > 3:
                raise KeyError(token_id)
            return super().push(token_id)

    monkeypatch.setattr(outputs, "IncrementalDetokenizer", Failing)


@pytest.mark.parametrize("poison", [_poison_tokenizer, _poison_admission, _poison_stop_check, _poison_detokenizer],
                         ids=["tokenize", "admit", "stop-check", "detokenize"])
def test_a_failure_in_one_request_fails_it_alone(engine, monkeypatch, poison):
    poison(monkeypatch, engine)
    bad = "poison pill" if poison is _poison_tokenizer else [POISON, 5, 600]  # 600 has text: it is echoed
    prompts = [[5, 6, 7], "some text", bad, [8, 9], [10, 11, 12, 13]]
    manager = StreamingManager(engine)
    try:
        params = [SamplingParams(max_new_tokens=8, stop=["never"] + ([POISON_STOP] if i == 2 else []), **GREEDY)
                  for i in range(len(prompts))]
        results = _run_concurrently(manager, prompts, params)
        error, out = results[2]
        assert isinstance(error, RequestFailedError) and "internal error" in str(error)
        assert out.finish_reason == "error"
        assert all(isinstance(text, str) and o.output_tokens == 8 and o.finish_reason == "length"
                   for i, (text, o) in enumerate(results) if i != 2)
        assert manager.is_alive and manager.health()["status"] == "ok"
        assert manager.wait_idle()
        assert manager.stats()["kv_blocks_used"] == 0  # the failed request's blocks came back
        assert manager.result(manager.add_request([7, 8], SamplingParams(max_new_tokens=2))).output_tokens == 2
    finally:
        manager.close()


def test_abort_frees_blocks_within_a_step_while_others_run(engine, monkeypatch):
    step = engine.scheduler.step

    def slow_step():  # a step of a bigger model: the requests are still running when we look
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine.scheduler, "step", slow_step)
    manager = StreamingManager(engine)
    sched = engine.scheduler
    try:
        params = SamplingParams(max_new_tokens=400, **GREEDY)
        a = manager.add_request([5, 6, 7] * 10, params)
        b = manager.add_request([8, 9, 10] * 10, params)
        deadline = time.monotonic() + 10
        while not all(sched.get(r) and sched.get(r).num_output_tokens for r in (a, b)):
            assert time.monotonic() < deadline, "the requests did not start"
            time.sleep(0.002)
        waiter = []  # a non-streaming caller of a, waiting for its result
        t = threading.Thread(target=lambda: waiter.append(manager.result(a)), daemon=True)
        t.start()
        assert manager.abort(a) is True
        deadline = time.monotonic() + 1.0
        while sched.get(a) is not None and time.monotonic() < deadline:
            time.sleep(0.002)
        used = manager.stats()["kv_blocks_used"]
        seq_b = sched.get(b)
        assert sched.get(a) is None and seq_b is not None and not seq_b.is_finished
        assert used <= len(seq_b.block_table) + 1  # only b's blocks (it may have grown by one since)
        t.join(5)
        assert waiter and waiter[0].finish_reason == "abort"
        assert manager.abort(a) is False  # already ended
        assert manager.abort(b) is True
        deadline = time.monotonic() + 1.0
        while sched.block_manager.num_free_blocks != sched.block_manager.num_blocks and time.monotonic() < deadline:
            time.sleep(0.002)
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
        assert not sched.has_unfinished()
    finally:
        manager.close()


def test_a_request_aborted_as_it_ends_is_forgotten(engine):
    """The server aborts the choices its client left behind; one whose END was already on its way is not taken
    by anyone either: the manager keeps no record of it."""
    import queue

    from rosecli.engine.streaming import END

    manager = StreamingManager(engine)
    try:
        sink = queue.SimpleQueue()
        rid = manager.add_request([5, 6, 7], SamplingParams(max_new_tokens=2, **GREEDY), sink=sink)
        while sink.get(timeout=30)[1] is not END:
            pass
        assert manager.abort(rid) is False
        with pytest.raises(KeyError):
            manager.take_output(rid)
    finally:
        manager.close()


def test_engine_death_ends_every_waiting_consumer_and_call(engine, monkeypatch):
    entered, release = threading.Event(), threading.Event()

    def dying_step():
        entered.set()
        release.wait(10)
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.scheduler, "step", dying_step)
    manager = StreamingManager(engine)
    try:
        first = manager.add_request([5, 6, 7], SamplingParams(max_new_tokens=5))
        assert entered.wait(10)
        queued = [manager.add_request([8, 9], SamplingParams(max_new_tokens=5)),
                  manager.add_request("queued text", SamplingParams(max_new_tokens=5))]
        call = []
        caller = threading.Thread(target=lambda: call.append(_outcome(manager.call_on_worker, lambda: 42)),
                                  daemon=True)
        caller.start()
        assert manager.health() == {"status": "ok", "error": None}
        box = [None] * 3
        consumers = [threading.Thread(target=_consume, args=(manager, rid, box, i), daemon=True)
                     for i, rid in enumerate([first, *queued])]
        for t in consumers:
            t.start()
        release.set()
        for t in [*consumers, caller]:
            t.join(5)
        assert all(r is not None and isinstance(r[0], EngineDeadError) and "device lost" in str(r[0]) for r in box), box
        assert call and isinstance(call[0], EngineDeadError)  # not left waiting for a worker that is gone
        health = manager.health()
        assert health["status"] == "dead" and "device lost" in health["error"] and not manager.is_alive
        with pytest.raises(EngineDeadError):
            manager.add_request([5], SamplingParams())
        with pytest.raises(EngineDeadError):
            manager.call_on_worker(lambda: 42)
    finally:
        manager.close()
    assert manager.health()["status"] == "dead"


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return e


def test_call_on_worker_waits_for_a_slow_step(engine, monkeypatch):
    step = engine.scheduler.step
    entered = threading.Event()

    def slow_step():
        entered.set()
        time.sleep(0.5)
        return step()

    monkeypatch.setattr(engine.scheduler, "step", slow_step)
    manager = StreamingManager(engine)
    try:
        manager.add_request([5, 6, 7], SamplingParams(max_new_tokens=1))
        assert entered.wait(10)
        assert manager.call_on_worker(threading.get_ident) == manager._thread.ident
        with pytest.raises(TimeoutError):  # only when a caller asks for a bound
            entered.clear()
            manager.add_request([5, 6], SamplingParams(max_new_tokens=1))
            assert entered.wait(10)
            manager.call_on_worker(lambda: 42, timeout=0.2)
    finally:
        manager.close()
