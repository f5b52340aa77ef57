"""`rose bench stream | sched | compare` end to end on a tiny dummy model (CPU)."""

import json

import pytest
from typer.testing import CliRunner

from rosecli.commands.main import app

runner = CliRunner()
TINY = ["--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--no-stop-on-eos"]


def _bench(kind, cache_dir, *extra):
    return runner.invoke(app, ["bench", kind, *TINY, "--cache-dir", cache_dir, *extra])


def test_stream_and_sched_save_results_and_compare(cache_dir, tmp_path):
    a, b, s = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "s.json"
    for path in (a, b):
        r = _bench("stream", cache_dir, "--num-requests", "5", "--max-new-tokens", "6", "--warmup-runs", "1",
                   "--repeat-runs", "2", "--stream-interval", "2", "--save-result", str(path))
        assert r.exit_code == 0, r.output
    assert "TTFT p50/p95/p99:" in r.output and "Throughput (completion,total):" in r.output
    doc = json.loads(a.read_text())
    assert doc["schema"] == "rosecli.bench/1" and doc["kind"] == "stream"
    assert [run["warmup"] for run in doc["runs"]] == [True, False, False]
    assert len(doc["requests"]) == 2 and len(doc["requests"][0]) == 5
    assert all(rec["output_tokens"] == 6 for rec in doc["requests"][0])
    assert doc["summary"]["throughput_completion"] > 0
    r = runner.invoke(app, ["bench", "compare", str(a), str(b)])
    assert r.exit_code == 0, r.output
    assert "TTFT p50" in r.output and "%" in r.output
    r = _bench("sched", cache_dir, "--num-requests", "3", "--max-new-tokens", "5", "--mode", "online",
               "--repeat-runs", "2", "--save-result", str(s))
    assert r.exit_code == 0, r.output
    assert "=== online summary ===" in r.output and "Throughput(completion,decode) p50/mean:" in r.output
    assert "Sampling: greedy\n" in r.output
    r = runner.invoke(app, ["bench", "compare", str(a), str(s)])
    assert r.exit_code != 0 and "different benchmarks" in r.output


def test_the_header_says_how_tokens_are_sampled_and_what_dummy_weights_do_to_top_p(cache_dir):
    r = _bench("sched", cache_dir, "--num-requests", "2", "--max-new-tokens", "3", "--repeat-runs", "1",
               "--temperature", "0.8", "--top-p", "0.95")
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("Sampling: "))
    assert line.startswith("Sampling: temperature 0.8, top-p 0.95 (dummy weights: near-uniform logits")
    r = _bench("sched", cache_dir, "--num-requests", "2", "--max-new-tokens", "3", "--repeat-runs", "1",
               "--temperature", "0.8", "--top-k", "20")
    assert r.exit_code == 0, r.output
    assert "Sampling: temperature 0.8, top-k 20\n" in r.output  # (no nucleus: no search over the whole row)


def test_poisson_arrivals_and_random_lengths(cache_dir):
    r = _bench("stream", cache_dir, "--num-requests", "6", "--input-len", "12", "--output-len", "5",
               "--range-ratio", "0.4", "--request-rate", "200", "--seed", "3")
    assert r.exit_code == 0, r.output
    assert "Poisson 200.0 req/s" in r.output


def test_stream_against_the_scheduler_directly(cache_dir, tmp_path):
    """--against-direct: each run is followed by the same workload through the scheduler directly; the
    summary names the manager's overhead and the saved result holds the direct throughput per run."""
    path = tmp_path / "r.json"
    r = _bench("stream", cache_dir, "--num-requests", "4", "--max-new-tokens", "8", "--warmup-runs", "1",
               "--repeat-runs", "2", "--against-direct", "--save-result", str(path))
    assert r.exit_code == 0, r.output
    line = " ".join(r.output[r.output.index("Against the scheduler directly"):].split())
    assert "tokens/s direct" in line and "through the streaming manager, overhead" in line
    doc = json.loads(path.read_text())
    assert all(run["figures"]["throughput_direct"] > 0 for run in doc["runs"])
    assert doc["summary"]["throughput_direct"] > 0
    r = runner.invoke(app, ["bench", "compare", str(path), str(path)])
    assert r.exit_code == 0 and "Throughput (scheduler directly)" in r.output, r.output
    r = _bench("stream", cache_dir, "--against-direct", "--request-rate", "50")
    assert r.exit_code == 2 and "--against-direct compares runs that submit every request at once" in r.output


@pytest.mark.parametrize("args,message", [
    (["--warmup-runs", "-1"], "--warmup-runs must be >= 0"),
    (["--repeat-runs", "0"], "--repeat-runs must be >= 1"),
    (["--submit-schedule", "sometimes"], "--submit-schedule must be one of"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
])
def test_argument_validation(cache_dir, args, message):
    r = _bench("stream", cache_dir, *args)
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output


def test_compare_rejects_foreign_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"schema": "other/9"}')
    r = runner.invoke(app, ["bench", "compare", str(bad), str(bad)])
    assert r.exit_code != 0 and "schema" in r.output
