"""`rose profile`: the stage table on CPU, the torch trace, and free-when-off ranges;
`rose profile --decode-step`: refused in one line without CUDA, replay time and kernels on a GPU."""

import json
import os
import re

import pytest
import torch
from typer.testing import CliRunner

from rosecli.commands.main import app
from rosecli.engine.stages import INSIDE_STEP, Stages, stage_table

runner = CliRunner()


def test_profile_prints_every_stage_and_shares_add_up(cache_dir, tmp_path):
    r = runner.invoke(app, ["profile", "--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
                            "--num-requests", "4", "--max-new-tokens", "6", "--no-stop-on-eos", "--cache-dir",
                            cache_dir, "--torch-trace", str(tmp_path)], terminal_width=200)
    assert r.exit_code == 0, r.output
    for stage in INSIDE_STEP + ("scheduler (other)", "detokenize_fanout", "stream_flush"):
        assert stage in r.output
    shares = [float(line.split("│")[-2].strip().rstrip("%")) for line in r.output.splitlines()
              if line.startswith("│") and "%" in line and not line.startswith("│ total")]
    assert abs(sum(shares) - 100.0) < 0.5
    traces = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    assert traces
    names = {e.get("name") for e in json.load(open(tmp_path / traces[0]))["traceEvents"]}
    assert {"scheduler_step", "decode_forward", "detokenize_fanout"} <= names
    assert "Device (torch trace)" not in r.output  # no device operations on the CPU


def test_device_idle_counts_overlapping_operations_once_and_names_each_gaps_neighbours():
    """`device_idle`: busy time is the union of the operations (PDL's overlapping kernels once), each gap lies between
    the operation that ended last and the next to start, and the pairs are ranked by the idle time around them."""
    from rosecli.bench.profile import device_idle

    ops = [(20.0, 30.0, "gemm"), (0.0, 10.0, "gemm"), (2.0, 12.0, "attn"), (15.0, 17.0, "HtoD"),  # any order
           (25.0, 33.0, "attn"), (31.0, 40.0, "gemm"), (43.0, 44.0, "HtoD"), (45.0, 50.0, "gemm")]
    d = device_idle(ops)
    assert (d.span_us, d.busy_us, d.idle_us) == (50.0, 40.0, 10.0)  # busy 0-12, 15-17, 20-40, 43-44, 45-50
    assert d.gaps == [(3.0, "attn", "HtoD"), (3.0, "HtoD", "gemm"), (3.0, "gemm", "HtoD"), (1.0, "HtoD", "gemm")]
    assert d.between(2) == [("HtoD", "gemm", 2, 4.0), ("attn", "HtoD", 1, 3.0)]
    assert device_idle([(0.0, 5.0, "k"), (1.0, 2.0, "j")]).gaps == [] and device_idle([]) is None


def test_device_events_are_the_devices_work_not_the_stage_ranges_mirrored_on_its_timeline():
    """A stage's ``record_function`` range shows on the GPU timeline too (W4's trace named ``scheduler_step`` beside
    the copies): counted as work, it would hide the idle time it spans."""
    from types import SimpleNamespace

    from rosecli.bench.profile import device_events, device_idle

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda name, s, e, dev=cuda, ann=False: SimpleNamespace(  # noqa: E731
        name=name, device_type=dev, is_user_annotation=ann, time_range=SimpleNamespace(start=s, end=e))
    prof = SimpleNamespace(events=lambda: [ev("scheduler_step", 0.0, 100.0, ann=True), ev("HtoD", 0.0, 2.0),
                                           ev("embed", 50.0, 60.0), ev("decode_forward", 0.0, 100.0, cpu)])
    events = device_events(prof)
    assert [e.name for e in events] == ["HtoD", "embed"]
    d = device_idle([(e.time_range.start, e.time_range.end, e.name) for e in events])
    assert d.gaps == [(48.0, "HtoD", "embed")]


def test_stage_table_shares():
    rows = stage_table({"scheduler_step": [1000, 1000], "decode_forward": [600, 700], "detokenize_fanout": [500]})
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-9
    other = next(r for r in rows if r["stage"] == "scheduler (other)")
    assert abs(other["total_ms"] - 0.0007) < 1e-12


def test_disabled_ranges_never_call_nvtx(monkeypatch):
    import torch.cuda.nvtx as nvtx

    calls = []
    monkeypatch.setattr(nvtx, "range_push", lambda *a: calls.append(a))
    monkeypatch.setattr(nvtx, "range_pop", lambda *a: calls.append(a))
    off = Stages()
    ctx = off.range("decode_forward", 64)
    assert ctx is off.range("sampling")  # one shared no-op context: nothing allocated per call
    with ctx:
        pass
    assert calls == [] and off.samples == {}
    on = Stages(nvtx=True)
    with on.range("decode_forward", 64):
        pass
    assert calls == [("decode_forward n=64",), ()]


def _decode_step(cache_dir, *args):
    return runner.invoke(app, ["profile", "--model", "tiny-llama", "--load-format", "dummy", "--cache-dir", cache_dir,
                               *args], terminal_width=200)


def _error_line(r):
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output  # refused before loading anything
    return lines[0]


def test_decode_step_without_cuda_is_one_line(cache_dir, monkeypatch):
    line = _error_line(_decode_step(cache_dir, "--decode-step", "--device", "cpu"))
    assert "--decode-step" in line and "CUDA GPU" in line and "--device cpu" in line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _error_line(_decode_step(cache_dir, "--decode-step"))
    assert "--decode-step" in line and "no CUDA GPU" in line


@pytest.mark.parametrize("args, needle", [
    (["--decode-step", "--decode-contexts", "128,x"], "--decode-contexts takes comma-separated whole numbers"),
    (["--decode-step", "--decode-contexts", "128,0"], "--decode-contexts: 0 is not a context"),
    (["--decode-step", "--decode-contexts", "64", "--input-len", "64"], "from --input-len or --decode-contexts, not"),
    (["--decode-contexts", "64"], "--decode-contexts applies only with --decode-step"),
    (["--decode-step", "--decode-batch-sizes", "0"], "0 is outside 1..--max-batch-size (64)"),
    (["--decode-step", "--decode-batch-sizes", "8", "--max-batch-size", "4"], "8 is outside 1..--max-batch-size (4)"),
    (["--decode-step", "--decode-batch-sizes", "1,x"], "comma-separated whole numbers"),
    (["--decode-batch-sizes", "4"], "only with --decode-step"),
])
def test_decode_batch_sizes_are_checked(cache_dir, args, needle):
    assert needle in _error_line(_decode_step(cache_dir, "--device", "cpu", *args))


def test_decode_step_refuses_contexts_past_the_model_or_the_kv_cache(tiny_engine_factory):
    """`--decode-step --input-len N` queues its prompts on the scheduler directly: N past the model's context (GPT-2's
    1,024 positions at --input-len 2048 was a device-side assert) or a batch of them past the KV cache is a ConfigError
    naming the flag and the limit, before anything is queued; a context that fits gets as far as the device check."""
    from rosecli.bench.profile import DECODE_STEP_HEADROOM, profile_decode_step
    from rosecli.engine.errors import ConfigError

    engine = tiny_engine_factory()
    most = engine.max_model_len - DECODE_STEP_HEADROOM
    for n in (most + 1, engine.max_model_len, 0):
        with pytest.raises(ConfigError, match=rf"--input-len {n}: .* allows --input-len 1\.\.{most}$"):
            profile_decode_step(engine, [1], n)
    bm = engine.scheduler.block_manager
    per_seq = bm.blocks_needed(64 + DECODE_STEP_HEADROOM)
    batch = bm.num_blocks // per_seq + 1
    with pytest.raises(ConfigError, match=rf"--input-len 64 at B={batch}: {batch * per_seq} KV blocks .* has "
                                          rf"{bm.num_blocks}: .*--num-gpu-blocks"):
        profile_decode_step(engine, [1, batch], 64)
    for sizes, n in (([batch - 1], 64), ([1], most)):
        with pytest.raises(ConfigError, match="needs a CUDA GPU"):  # (this engine is on the CPU)
            profile_decode_step(engine, sizes, n)
    assert not engine.scheduler.has_unfinished()


def test_layer_program_finds_one_layers_kernels_in_launch_order():
    """`layer_program`: a step's launches split into before / one layer (each kernel the mean over the layers) /
    after, the layer's kernels in the order they run; the final norm, named as the layers' norms are, stays after."""
    from rosecli.bench.profile import layer_program

    layer = ["norm", "gemm", "attention", "gemm", "norm", "gemm", "gemm"]
    launches = [("embed", 2.0)]
    for i in range(3):  # layer i's kernels take (i + 1) x (their place in the layer + 1) us
        launches += [(name, (i + 1) * (j + 1.0)) for j, name in enumerate(layer)]
    launches += [("norm", 1.5), ("logits", 140.0), ("argmax", 10.0)]
    prog = layer_program(launches, 3)
    assert prog.layers == 3 and prog.before == [("embed", 2.0)]
    assert prog.layer == [(name, 2.0 * (j + 1)) for j, name in enumerate(layer)]  # mean of 1x, 2x, 3x
    assert prog.after == [("norm", 1.5), ("logits", 140.0), ("argmax", 10.0)]
    # a first layer with a kernel of its own: no three alike (None, not a made-up layer); asked for two, the two
    # alike runs from just after it (a rotation of a layer's order, each kernel once)
    odd = launches[:4] + [("extra", 1.0)] + launches[4:]
    assert layer_program(odd, 3) is None
    prog = layer_program(odd, 2)
    assert sorted(name for name, _ in prog.layer) == sorted(layer) and prog.before[-1] == ("extra", 1.0)
    assert layer_program([(f"k{i}", 1.0) for i in range(20)], 4) is None  # nothing repeats


@pytest.mark.gpu
def test_decode_step_prints_replay_time_and_kernels_per_batch_size(cache_dir):
    cache_dir = os.environ.get("ROSE_CACHE_DIR", cache_dir)  # a GPU host may have no tokenizer package, only a cache
    r = _decode_step(cache_dir, "--decode-step", "--decode-batch-sizes", "1,3", "--max-batch-size", "4",
                     "--input-len", "40")
    assert r.exit_code == 0, r.output
    assert "40 tokens of context" in r.output
    for batch in (1, 3):  # 3 replays the graph captured for 4
        m = re.search(rf"B={batch}: graph replay ([0-9.]+) us/step .* eager step: (\d+) kernels, ([0-9.]+) us",
                      r.output)
        assert m, r.output
        assert float(m[1]) > 0 and int(m[2]) > 0 and float(m[3]) > 0
    kernel_lines = [line for line in r.output.splitlines() if re.match(r"\s+\d+ x\s+[0-9.]+ us  \S", line)]
    assert len(kernel_lines) >= 2, r.output
    assert r.output.count("one layer of 2, in launch order") == 2, r.output  # tiny-llama: two layers, at each size
    assert re.search(r"\s+1\.\s+[0-9.]+ us\s+[0-9.]+%  \S", r.output), r.output


@pytest.mark.gpu
def test_profile_with_a_torch_trace_says_where_the_device_sat_idle(cache_dir, tmp_path):
    cache_dir = os.environ.get("ROSE_CACHE_DIR", cache_dir)
    r = runner.invoke(app, ["profile", "--model", "tiny-llama", "--load-format", "dummy", "--device", "cuda",
                            "--num-requests", "2", "--max-new-tokens", "16", "--no-stop-on-eos", "--cache-dir",
                            cache_dir, "--torch-trace", str(tmp_path)], terminal_width=200)
    assert r.exit_code == 0, r.output
    m = re.search(r"Device \(torch trace\): busy ([0-9.]+) ms of ([0-9.]+) ms \(([0-9.]+)%\), idle in ([0-9,]+) gaps",
                  r.output)
    assert m and 0 < float(m[1]) <= float(m[2]) and 0 < float(m[3]) <= 100, r.output
    pairs = re.findall(r"\s+[0-9.]+ ms\s+[0-9,]+ x\s+[0-9.]+ us  (\S.*) -> (\S.*)", r.output)
    assert pairs, r.output
    assert not {"scheduler_step", "decode_forward"} & {n.strip() for p in pairs for n in p}, r.output  # not work


@pytest.mark.gpu
def test_decode_step_times_each_of_several_contexts_in_one_start_up(cache_dir):
    """--decode-contexts: each context at each batch size, in turn, the longer one reading more K/V a step; a context
    past the model is refused, naming the flag and the limit, before any is timed."""
    cache_dir = os.environ.get("ROSE_CACHE_DIR", cache_dir)
    args = ("--decode-step", "--decode-batch-sizes", "1,2", "--max-batch-size", "2")
    r = _decode_step(cache_dir, *args, "--decode-contexts", "40,300")
    assert r.exit_code == 0, r.output
    assert "40 / 300 tokens of context per sequence, in turn" in r.output
    short, long = r.output.split("at 40 tokens:")[1].split("at 300 tokens:")
    floors = []
    for group in (short, long):
        for batch in (1, 2):
            assert re.search(rf"B={batch}: graph replay [0-9.]+ us/step", group), r.output
        floors.append(float(re.search(r"floor: ([0-9.]+) MB read", group.split("B=2:")[1])[1]))
    assert floors[1] > floors[0], r.output
    r = _decode_step(cache_dir, *args, "--decode-contexts", "40,100000000")
    assert r.exit_code == 2 and "Traceback" not in r.output and "graph replay" not in r.output, r.output
    assert re.search(r"--decode-contexts 100000000: .* allows --decode-contexts 1\.\.\d+", r.output), r.output
