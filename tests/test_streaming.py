"""The streaming manager: concurrency, abandonment, backpressure, stop strings, timestamps."""

import threading
import time

import pytest

from rosecli.engine.config import SamplingParams
from rosecli.engine.errors import OverloadedError, RequestError
from rosecli.engine.streaming import END, StreamingManager

GREEDY = dict(stop_on_eos=False)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def engine(tiny_engine_factory, request):
    return tiny_engine_factory("tiny-llama", max_batch_size=64, prefill_max_batch_size=16, num_gpu_blocks=400,
                               block_size=8, overlap_schedule=request.param)


def _alone(engine, prompt_ids, n):
    return engine.generate([prompt_ids], SamplingParams(max_new_tokens=n, **GREEDY))[0].token_ids


def _text(engine, ids):
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_64_concurrent_requests_match_each_alone(engine):
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(1, 30))] for _ in range(64)]
    lengths = [rng.randrange(1, 24) for _ in range(64)]
    expected = [_text(engine, _alone(engine, p, n)) for p, n in zip(prompts, lengths)]
    manager = StreamingManager(engine)
    try:
        results = [None] * 64

        def client(i):
            rid = manager.add_request(prompts[i], SamplingParams(max_new_tokens=lengths[i], **GREEDY))
            stream = manager.stream(rid)
            results[i] = ("".join(stream), stream.output)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [r[0] for r in results] == expected
        assert [r[1].output_tokens for r in results] == lengths
        assert all(r[1].finish_reason == "length" for r in results)
        assert manager.wait_idle()
        assert manager.stats()["kv_blocks_used"] == 0
    finally:
        manager.close()


def test_abandoned_stream_releases_blocks_within_a_step(engine):
    manager = StreamingManager(engine)
    try:
        rid = manager.add_request([500, 600, 700] * 10, SamplingParams(max_new_tokens=400, **GREEDY))
        stream = iter(manager.stream(rid))
        next(stream)
        assert manager.stats()["kv_blocks_used"] > 0
        stream.close()  # the consumer goes away
        deadline = time.time() + 5
        while manager.stats()["kv_blocks_used"] and time.time() < deadline:
            time.sleep(0.01)
        assert manager.stats()["kv_blocks_used"] == 0
        assert manager.stats()["finish_counts"].get("abort") == 1
    finally:
        manager.close()


def test_backpressure_refuses_or_waits(tiny_engine_factory):
    engine = tiny_engine_factory("tiny-llama", max_inflight_requests=2)
    manager = StreamingManager(engine)
    try:
        params = SamplingParams(max_new_tokens=400, **GREEDY)  # longer than the wait below, even on a fast CPU
        a = manager.add_request([1000, 1001], params)
        b = manager.add_request([1000, 1002], params)
        with pytest.raises(OverloadedError, match="max-inflight-requests"):
            manager.add_request([1000, 1003], params, wait=False)
        waited = []
        short = SamplingParams(max_new_tokens=5, **GREEDY)
        t = threading.Thread(target=lambda: waited.append(manager.add_request([1000, 1004], short, wait=True)))
        t.start()
        time.sleep(0.05)
        assert not waited  # blocked until one finishes
        manager.result(a)
        t.join(timeout=30)
        assert len(waited) == 1
        manager.result(b)
        manager.result(waited[0])
    finally:
        manager.close()


def test_invalid_prompt_is_refused_at_submit(engine):
    manager = StreamingManager(engine)
    try:
        with pytest.raises(RequestError, match="empty"):
            manager.add_request("", SamplingParams())
        with pytest.raises(RequestError, match="context"):
            manager.add_request([5] * 600, SamplingParams())
    finally:
        manager.close()


def test_stop_string_cuts_output_and_stream_never_shows_it(engine):
    ids = [300, 301, 302]
    full = _text(engine, _alone(engine, ids, 40))
    stop = full[15:19]
    assert stop and stop in full
    expected = full[:full.index(stop)]
    manager = StreamingManager(engine)
    try:
        rid = manager.add_request(ids, SamplingParams(max_new_tokens=40, stop=[stop], **GREEDY))
        stream = manager.stream(rid)
        pieces = list(stream)
        assert "".join(pieces) == expected
        assert stream.output.finish_reason == "stop"
    finally:
        manager.close()


def test_stream_interval_and_timestamps(tiny_engine_factory):
    import queue

    engine = tiny_engine_factory("tiny-llama", stream_interval=4)
    manager = StreamingManager(engine, record_timestamps=True)
    try:
        sink = queue.SimpleQueue()
        rid = manager.add_request("Hello there", SamplingParams(max_new_tokens=13, **GREEDY), sink=sink)
        items = []
        while True:
            r, item = sink.get(timeout=30)
            assert r == rid
            if item is END:
                break
            items.append(item)
        out = manager.take_output(rid)
        ts = out.timestamps
        assert out.output_tokens == 13 and len(ts.token_times) == 13
        assert sum(ts.flush_tokens) <= 13 and len(items) == len(ts.flush_times)
        assert all(n <= 4 for n in ts.flush_tokens) and ts.flush_tokens[0] == 1  # first token at once
        assert ts.submit <= ts.tokenized <= ts.admitted <= ts.first_token <= ts.finish
    finally:
        manager.close()


def test_tokenize_workers(tiny_engine_factory):
    engine = tiny_engine_factory("tiny-llama", tokenize_workers=2)
    manager = StreamingManager(engine)
    try:
        outs = [manager.result(manager.add_request(f"prompt number {i}", SamplingParams(max_new_tokens=3, **GREEDY)))
                for i in range(4)]
        assert all(o.output_tokens == 3 and o.prompt_tokens >= 3 for o in outs)
        rid = manager.add_request("", SamplingParams())  # refused on the tokenizer thread: the stream says so
        with pytest.raises(RequestError):
            list(manager.stream(rid))
    finally:
        manager.close()


def test_engine_death_ends_streams_with_an_error(tiny_engine_factory, monkeypatch):
    from rosecli.engine.streaming import EngineDeadError

    engine = tiny_engine_factory("tiny-llama")
    manager = StreamingManager(engine)
    try:
        def boom():
            raise RuntimeError("device lost")

        monkeypatch.setattr(engine.scheduler, "step", boom)
        rid = manager.add_request([5, 6, 7], SamplingParams(max_new_tokens=5))
        with pytest.raises(EngineDeadError, match="device lost"):
            list(manager.stream(rid))
        assert not manager.is_alive
        with pytest.raises(EngineDeadError):
            manager.add_request([5], SamplingParams())
    finally:
        manager.close()


def test_run_until_idle_steps_the_engine_on_the_calling_thread(engine):
    """`rose generate` and `LLMEngine.generate` step the engine on their own (main) thread: on CPU
    torch's intra-op threads speed up the main thread only. Readers on other threads still stream."""
    stepped_on = set()
    step = engine.scheduler.step

    def recording_step():
        stepped_on.add(threading.get_ident())
        return step()

    engine.scheduler.step = recording_step
    try:
        manager = StreamingManager(engine, start=False)
        try:
            ids = [manager.add_request([300 + i, 301, 302], SamplingParams(max_new_tokens=6, **GREEDY))
                   for i in range(3)]
            texts = {}
            readers = [threading.Thread(target=lambda r=r: texts.__setitem__(r, "".join(manager.stream(r))))
                       for r in ids]
            for t in readers:
                t.start()
            manager.run_until_idle()
            for t in readers:
                t.join(timeout=10)
            assert stepped_on == {threading.get_ident()}
            assert [texts[r] for r in ids] == [_text(engine, _alone(engine, [300 + i, 301, 302], 6))
                                               for i in range(3)]
            started = StreamingManager(engine)
            try:
                with pytest.raises(RuntimeError, match="start=False"):
                    started.run_until_idle()
            finally:
                started.close()
        finally:
            manager.close()
        outs = engine.generate([[400, 401]], SamplingParams(max_new_tokens=4, **GREEDY))
        assert len(outs[0].token_ids) == 4 and stepped_on == {threading.get_ident()}
    finally:
        engine.scheduler.step = step
    assert engine.scheduler.block_manager.num_used_blocks == 0
