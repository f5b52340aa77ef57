"""`rose profile`: the stage table on CPU, the torch trace, and free-when-off ranges."""

import json
import os

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
