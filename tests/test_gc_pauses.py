"""The server's garbage-collector watch: every collection timed, long ones logged, start-up frozen."""

import gc
import logging

from rosecli.engine.gc_pauses import GcPauses, freeze_startup


def test_every_collection_is_timed_and_a_long_one_is_logged(caplog):
    seen = []
    watch = GcPauses(warn_ms=0.0, on_pause=lambda gen, s, n: seen.append((gen, s, n)))
    try:
        with caplog.at_level(logging.WARNING, logger="rosecli.gc"):
            junk = [[] for _ in range(10)]
            for a, b in zip(junk, junk[1:] + junk[:1]):
                a.append(b)  # a cycle only the collector frees
            del junk, a, b
            gc.collect()
    finally:
        watch.close()
    full = [x for x in seen if x[0] == 2]
    assert full and full[-1][1] >= 0 and full[-1][2] >= 10
    assert watch.count[2] >= 1 and watch.longest_s >= full[-1][1]
    assert any("generation 2" in r.getMessage() and "ms" in r.getMessage() for r in caplog.records)
    n = len(seen)
    gc.collect()
    assert len(seen) == n  # closed: no longer called


def test_freeze_moves_start_up_objects_out_of_collections(monkeypatch):
    try:
        monkeypatch.setenv("ROSE_GC_FREEZE", "0")
        gc.unfreeze()
        assert freeze_startup() == 0 and gc.get_freeze_count() == 0
        monkeypatch.delenv("ROSE_GC_FREEZE")
        frozen = freeze_startup()
        assert frozen > 1000 and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_what_start_up_froze_is_finalized_at_exit():
    """Frozen objects are never collected; one that became garbage was never finalized, and the server's exit
    printed nanobind's "leaked ..." lines for Triton's objects. The process unfreezes at exit: its last
    collection finalizes it."""
    import subprocess
    import sys

    code = ("import gc\n"
            "from rosecli.engine.gc_pauses import freeze_startup\n"
            "class C:\n"
            "    def __del__(self): print('finalized', flush=True)\n"
            "x = C(); x.cycle = x\n"
            "freeze_startup()\n"
            "del x\n"
            "gc.collect()\n"
            "print('exiting', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["exiting", "finalized"]


def test_every_command_freezes_what_its_engine_start_up_made(cache_dir):
    """`rose bench`, `chat` and `profile` start their engine through `start_engine`, as the in-process server
    does: what start-up made is frozen before the first request, whose collections would otherwise walk it
    (W1-cold's first burst waited 7.5-10 ms for one on the H200). `rose generate` (one batch, then exit)
    asks for no freeze."""
    import io

    from rich.console import Console

    from rosecli.commands.progress import start_engine
    from rosecli.engine.config import EngineConfig

    gc.unfreeze()
    try:
        start_engine(EngineConfig(model="tiny-llama", load_format="dummy", device="cpu", cache_dir=cache_dir),
                     Console(file=io.StringIO()), freeze_gc=False).close()
        assert gc.get_freeze_count() == 0
        engine = start_engine(EngineConfig(model="tiny-llama", load_format="dummy", device="cpu",
                                           cache_dir=cache_dir), Console(file=io.StringIO()))
        try:
            frozen = gc.get_freeze_count()
            assert frozen > 1000
            tracked = [o for o in gc.get_objects() if o is engine or o is engine.runner]
            assert not tracked  # the engine itself is among the frozen objects, never walked again
        finally:
            engine.close()
    finally:
        gc.unfreeze()


def test_take_gives_the_collections_since_the_last_take():
    watch = GcPauses(warn_ms=float("inf"))
    try:
        watch.take()
        gc.collect()
        gc.collect(0)
        first = watch.take()
        second = watch.take()
    finally:
        watch.close()
    assert first.collections >= 2 and first.full >= 1
    assert 0 < first.longest_s <= first.paused_s
    assert second.collections == 0 and second.paused_s == 0 and second.longest_s == 0  # each interval on its own


def test_a_full_collection_inside_a_bench_run_is_in_its_figures_lines_and_summary(tiny_engine_factory):
    """`bench stream` and `bench sched` say how often this process collected during each run, and how long that
    held it: the pause W1-cold's first burst paid (8-10 ms on the H200) was invisible until measured by hand."""
    from rich.console import Console

    from rosecli.bench import report
    from rosecli.bench.run import bench_sched, bench_stream
    from rosecli.bench.workload import WorkloadSpec
    from rosecli.commands.bench import _print_attached_summary
    from rosecli.engine.config import SamplingParams

    class CollectingTable(report.RunTable):
        """Collects once (a full collection) while the first measured run is in flight."""
        collected = False

        def update(self, *a, **kw):
            if not self.rows[-1][1] and not CollectingTable.collected:
                CollectingTable.collected = True
                gc.collect()
            return super().update(*a, **kw)

    engine = tiny_engine_factory(max_batch_size=8)
    spec = WorkloadSpec(num_requests=3, max_new_tokens=5, input_len=4, range_ratio=0.0)
    params = SamplingParams(max_new_tokens=5, stop_on_eos=False)
    console = Console(record=True, width=300)
    with CollectingTable(console, "stream", plain=True) as table:
        out = bench_stream(engine, spec, params, 1, 2, table)
    first, second = (r["figures"] for r in out["runs"] if not r["warmup"])
    assert first["gc_full_collections"] >= 1 and first["gc_longest_pause_s"] > 0
    assert first["gc_pause_s"] >= first["gc_longest_pause_s"]
    assert second["gc_full_collections"] == 0  # each run counts its own
    assert {"gc_collections", "gc_full_collections", "gc_pause_s", "gc_longest_pause_s"} <= set(out["summary"])
    _print_attached_summary(console, out, None)
    text = console.export_text()
    assert text.count("GC pauses: ") == 2  # one line a measured run
    assert "GC pauses (the 2 measured runs together): " in text and " full), " in text
    with report.RunTable(Console(record=True, width=300), "sched", plain=True) as table:
        out = bench_sched(engine, spec, params, "offline", 0, 1, table)
    assert "gc_full_collections" in out["runs"][0]["figures"] and "gc_pause_s" in out["summary"]
