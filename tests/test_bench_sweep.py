"""`rose bench sweep` / `plot` / `compare` intervals: the sweep on a tiny dummy model (CPU), the SLO
search against a synthetic goodput curve, bootstrap intervals on synthetic samples, charts, the
step timeline."""

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from rosecli.bench import compare, sweep
from rosecli.bench.timeline import StepTimeline
from rosecli.commands.main import app
from rosecli.engine.errors import ConfigError

runner = CliRunner()
TINY = ["--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--no-stop-on-eos"]


@pytest.fixture(scope="module")
def sweep_file(cache_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep") / "sweep.json"
    r = runner.invoke(app, ["bench", "sweep", "stream", *TINY, "--cache-dir", cache_dir, "--num-requests", "3",
                            "--max-new-tokens", "4", "--request-rates", "100,inf", "--warmup-runs", "1", "--timeline",
                            "--save-result", str(path)])
    assert r.exit_code == 0, r.output
    return path, r.output


def test_sweep_of_two_rates_is_one_result_file(sweep_file):
    path, out = sweep_file
    # in a pipe: one plain line per point as it finishes, in order
    assert out.index("Point rate 100:") < out.index("Point rate inf:")
    doc = json.loads(path.read_text())
    assert doc["schema"] == "rosecli.bench/1" and doc["kind"] == "sweep" and doc["sweep"]["mode"] == "stream"
    assert doc["sweep"]["axes"]["request_rate"] == [100.0, None]  # inf is null in strict JSON
    assert [p["label"] for p in doc["points"]] == ["rate 100", "rate inf"]
    for p in doc["points"]:
        assert [r["warmup"] for r in p["runs"]] == [True, False]  # each point: its warm-up, then measured
        assert len(p["requests"]) == 1 and len(p["requests"][0]) == 3  # raw samples of the measured run
        assert all(rec["output_tokens"] == 4 for rec in p["requests"][0])
        assert p["summary"]["throughput_completion"] > 0 and p["summary"]["ttft_p99"] > 0
    assert doc["environment"]["torch"] and "python" in doc["environment"]


def test_timeline_recorded_in_a_sweep_when_asked(sweep_file):
    path, out = sweep_file
    doc = json.loads(path.read_text())
    tl = doc["points"][1]["timeline"][0]  # rate inf: all three at once
    n = len(tl["t"])
    assert n >= 4 and all(len(tl[k]) == n for k in ("step_ms", "kind", "running", "tokens_in_flight",
                                                   "kv_blocks_used", "preemptions"))
    assert max(tl["running"]) == 3 and max(tl["kv_blocks_used"]) > 0 and tl["kv_blocks_total"] > 0
    assert tl["t"] == sorted(tl["t"]) and "Timeline: " in out


def test_timeline_only_when_asked(tiny_engine_factory):
    """Without a recorder the scheduler runs its own step (nothing recorded anywhere); with one,
    every step while attached and none after detach."""
    from rosecli.engine.config import SamplingParams

    engine = tiny_engine_factory()
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=3, stop_on_eos=False)
    sched.run_to_completion([[5, 6, 7]], params)
    tl = StepTimeline(sched)
    assert tl.columns()["t"] == []
    with tl:
        sched.run_to_completion([[5, 6, 7], [8, 9]], params)
    steps = len(tl.columns()["t"])
    assert steps >= 3 and set(tl.columns()["kind"]) <= {"prefill", "decode", "idle"}
    sched.run_to_completion([[5, 6, 7]], params)
    assert len(tl.columns()["t"]) == steps  # detached: no more rows
    assert "step" not in vars(sched)


def test_stream_saves_no_timeline_unless_asked(cache_dir, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    base = ["bench", "stream", *TINY, "--cache-dir", cache_dir, "--num-requests", "2", "--max-new-tokens", "3"]
    r = runner.invoke(app, [*base, "--save-result", str(a)])
    assert r.exit_code == 0 and "Timeline: " not in r.output, r.output
    r = runner.invoke(app, [*base, "--timeline", "--save-result", str(b)])
    assert r.exit_code == 0 and "run 1: Timeline: " in r.output, r.output
    assert "timelines" not in json.loads(a.read_text())
    tls = json.loads(b.read_text())["timelines"]
    assert len(tls) == 1 and len(tls[0]["t"]) >= 3


def test_slo_search_end_to_end_on_the_tiny_model(cache_dir, tmp_path):
    """A loose SLO every load meets: the search stops at inf (all at once) and says so."""
    path = tmp_path / "slo.json"
    r = runner.invoke(app, ["bench", "sweep", "stream", *TINY, "--cache-dir", cache_dir, "--num-requests", "3",
                            "--max-new-tokens", "3", "--request-rates", "50,inf", "--slo", "ttft:60000 tpot:60000",
                            "--save-result", str(path)])
    assert r.exit_code == 0, r.output
    line = " ".join(r.output[r.output.index("SLO search"):].split())
    assert "highest request rate meeting it inf req/s" in line and "100.0% of requests met every SLO" in line
    doc = json.loads(path.read_text())
    assert doc["sweep"]["search"]["best_label"] == "inf" and not doc["sweep"]["search"]["bracketed"]
    assert [p["search"] for p in doc["points"]] == [True, True]
    assert doc["sweep"]["slo_ms"] == {"ttft": 60000.0, "tpot": 60000.0}


@pytest.mark.parametrize("args,message", [
    (["--request-rates", "1,x"], "--request-rates takes comma-separated numbers > 0"),
    (["--request-rates", "0"], "--request-rates takes comma-separated numbers > 0"),
    (["--max-batch-size", "0"], "--max-batch-size takes comma-separated whole numbers >= 1"),
    (["--request-rates", "1,2", "--input-len", "4,8", "--output-len", "2,3"], "at most two axes"),
    (["--slo", "ttft:100"], "--slo needs the loads to start from"),
    (["--slo", "speed:1", "--request-rates", "1"], "--slo takes NAME:MILLISECONDS pairs"),
    (["--slo", "ttft:100", "--request-rates", "1,2", "--input-len", "4,8"], "give input_len one value"),
    (["--slo", "ttft:100", "--request-rates", "1", "--goodput-target", "1.5"], "--goodput-target must be in"),
    (["--plot", "chart.txt"], "--plot writes a PNG"),
])
def test_sweep_argument_errors(cache_dir, args, message):
    r = runner.invoke(app, ["bench", "sweep", "stream", *TINY, "--cache-dir", cache_dir, *args])
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output, r.output


# --- the SLO search on a synthetic model of goodput against load -------------------------------------


def _knee(at: float, below: float = 1.0, above: float = 0.6):
    calls = []

    def measure(load):
        calls.append(load)
        return below if load <= at else above

    return measure, calls


def test_slo_search_finds_a_rate_knee_within_one_bisection_step():
    measure, calls = _knee(7.3)
    r = sweep.slo_search(measure, [1, 2, 4, 16], 0.99, max_steps=4, rel_tol=0.0)
    assert r.bracketed and r.best <= 7.3 < r.first_miss
    # the grid brackets [4, 16]; 4 halvings leave a last step of 12 / 2**4 = 0.75 req/s
    assert r.first_miss - r.best <= 0.75
    assert calls[:4] == [1, 2, 4, 16] and len(calls) == 8  # the grid stops at its first miss, then 4 steps
    # the default tolerance stops once the interval is within 5% of the passing rate
    r = sweep.slo_search(_knee(7.3)[0], [1, 2, 4, 16], 0.99, max_steps=20)
    assert r.best <= 7.3 < r.first_miss and r.first_miss - r.best <= 0.05 * r.best


def test_slo_search_over_concurrency_is_exact():
    r = sweep.slo_search(_knee(37)[0], [1, 8, 64], 0.99, integer=True, max_steps=10, axis="max_concurrency")
    assert (r.best, r.first_miss) == (37, 38)


def test_slo_search_edges():
    measure, calls = _knee(100)
    r = sweep.slo_search(measure, [1, 2], 0.99, max_steps=3)  # all pass: doubles upward until a miss
    assert calls[:5] == [1, 2, 4, 8, 16] and not r.bracketed and r.best == 32  # at most 4 doublings
    measure, calls = _knee(0.3)
    r = sweep.slo_search(measure, [1, 2], 0.99, max_steps=3)  # the lowest misses: halved until one passes
    assert calls[:3] == [1, 0.5, 0.25] and r.bracketed and r.best <= 0.3 < r.first_miss <= 0.5
    r = sweep.slo_search(_knee(0.01)[0], [1, 2], 0.99)  # at most 4 halvings, then nothing meets it
    assert r.best is None and r.first_miss == 1 / 16
    r = sweep.slo_search(_knee(0)[0], [4], 0.99, integer=True, axis="max_concurrency")
    assert r.best is None and r.first_miss == 1  # concurrency stops at 1
    r = sweep.slo_search(_knee(math.inf)[0], [1, math.inf], 0.99)
    assert r.best == math.inf  # everything at once still meets it
    r = sweep.slo_search(lambda load: float("nan"), [1], 0.99)
    assert r.best is None  # an unmeasured goodput is a miss
    measure, calls = _knee(5)
    r = sweep.slo_search(measure, [2, math.inf], 0.99, max_steps=6)
    assert r.best <= 5 < r.first_miss and r.first_miss != math.inf


def test_axes_and_grid():
    assert sweep.parse_axis("request_rate", "1, 2,inf,2") == [1.0, 2.0, math.inf]
    points = sweep.grid({"request_rate": [1.0, 2.0], "input_len": [8, 16], "output_len": [4]}, "serve")
    assert len(points) == 4 and points[0] == {"request_rate": 1.0, "input_len": 8, "output_len": 4}
    with pytest.raises(ConfigError, match="bench sweep serve"):
        sweep.grid({"max_concurrency": [1, 8]}, "stream")
    with pytest.raises(ConfigError, match="bench sweep stream"):
        sweep.grid({"max_batch_size": [8, 16]}, "serve")
    assert sweep.point_label({"request_rate": math.inf, "max_concurrency": 8}) == "rate inf conc 8"


# --- bootstrap intervals ---------------------------------------------------------------------------


def test_bootstrap_interval_of_a_mean_difference_matches_the_normal_approximation():
    rng = np.random.default_rng(1)
    a, b = rng.normal(10.0, 2.0, 4000), rng.normal(10.5, 2.0, 4000)
    lo, hi = compare.bootstrap_diff(a, b, "mean")
    se = math.sqrt(a.var() / len(a) + b.var() / len(b))
    d = b.mean() - a.mean()
    assert lo == pytest.approx(d - 1.96 * se, abs=0.25 * se) and hi == pytest.approx(d + 1.96 * se, abs=0.25 * se)
    assert compare.bootstrap_diff(a, b, "mean") == (lo, hi)  # seeded: the same files give the same interval


def _doc_with_ttfts(ttfts, kind="stream"):
    if kind == "stream":
        reqs = [{"request_id": i, "prompt_tokens": 4, "output_tokens": 2, "submit": 0.0, "first_token": t,
                 "finish": t + 0.01, "token_times": [t, t + 0.01]} for i, t in enumerate(ttfts)]
    else:
        reqs = [{"request_id": i, "output_tokens": 2, "success": True, "start": 0.0, "dispatched": 0.0,
                 "scheduled": 0.0, "event_times": [t, t + 0.01]} for i, t in enumerate(ttfts)]
    summary = {"ttft_p50": float(np.percentile(ttfts, 50)), "ttft_p99": float(np.percentile(ttfts, 99)),
               "ttft_mean": float(np.mean(ttfts)), "throughput_completion": 100.0}
    runs = [{"label": "run 1/1", "warmup": False, "figures": summary}]
    return {"schema": "rosecli.bench/1", "kind": kind, "config": {}, "environment": {}, "startup": {}, "runs": runs,
            "summary": summary, "requests": [reqs]}


def test_compare_same_distribution_is_noise_and_a_ten_percent_shift_is_a_change():
    rng = np.random.default_rng(7)
    # same distribution: a 95% interval holds 0 about 19 times in 20 (never always: that is what 95% means)
    noise = 0
    for _ in range(40):
        a = _doc_with_ttfts(rng.lognormal(np.log(0.05), 0.3, 500))
        b = _doc_with_ttfts(rng.lognormal(np.log(0.05), 0.3, 500))
        cells = [r.cells[0] for r in compare.compare_results([a, b]) if r.figure in ("ttft_p50", "ttft_mean")]
        assert all(c.ci_method == "requests" for c in cells)
        noise += sum(c.verdict == "noise" for c in cells)
    assert noise >= 0.85 * 80
    base = _doc_with_ttfts(rng.lognormal(np.log(0.05), 0.3, 3000))
    same = _doc_with_ttfts(rng.lognormal(np.log(0.05), 0.3, 3000))
    slower = _doc_with_ttfts(rng.lognormal(np.log(0.05 * 1.10), 0.3, 3000), kind="serve")
    rows = {r.figure: r for r in compare.compare_results([base, same, slower], percentiles=[50, 90])}
    for fig in ("ttft_p50", "ttft_p90", "ttft_mean"):
        _, shifted = rows[fig].cells
        assert shifted.verdict == "worse" and shifted.ci_low > 0  # TTFT up by ~10%: worse, by the interval
        assert 5 < shifted.percent < 15
    assert "ttft_p99" not in rows  # --percentiles replaces the summary's percentiles
    # one run each and no raw samples for throughput: not judged
    assert rows["throughput_completion"].cells[0].verdict == "same"
    few = _doc_with_ttfts(rng.lognormal(np.log(0.05 * 1.10), 0.3, 8))
    cell = {r.figure: r for r in compare.compare_results([_doc_with_ttfts(rng.lognormal(np.log(0.05), 0.3, 8)),
                                                         few])}["ttft_p50"].cells[0]
    assert cell.verdict == "noise"  # the same 10% on 8 requests is within the noise


def test_compare_cli_intervals_environment_first_and_sweeps(sweep_file, tmp_path):
    path, _ = sweep_file
    doc = json.loads(path.read_text())
    doc["environment"]["torch"] = "0.0-other"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    r = runner.invoke(app, ["bench", "compare", str(path), str(other), "--percentiles", "50,90"])
    assert r.exit_code == 0, r.output
    out = r.output
    assert out.index("Differs: environment.torch:") < out.index("=== point rate inf ===")
    assert "TTFT p90:" in out and "same" in out and "bootstrap interval" in out
    r = runner.invoke(app, ["bench", "compare", str(path), str(other), "--confidence", "2"])
    assert r.exit_code != 0 and "--confidence must be between 0 and 1" in r.output


# --- charts ------------------------------------------------------------------------------------------


def test_terminal_chart_at_80_columns(sweep_file):
    pytest.importorskip("plotext")
    path, _ = sweep_file
    r = runner.invoke(app, ["bench", "plot", str(path), str(path), "--width", "80"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert "TTFT p50/p99 (ms) vs output throughput" in r.output and "TPOT" in r.output
    assert max(len(x) for x in lines) <= 80 and "\x1b" not in r.output
    r = runner.invoke(app, ["bench", "plot", str(path), "--timeline", "--width", "80"])
    assert r.exit_code == 0 and "decode batch" in r.output and "KV blocks used" in r.output, r.output


def test_png_has_one_series_per_file(sweep_file, tmp_path):
    pytest.importorskip("plotext")
    pytest.importorskip("matplotlib")
    from rosecli.bench import plot as plots
    from rosecli.bench import results

    path, _ = sweep_file
    png = tmp_path / "curves.png"
    r = runner.invoke(app, ["bench", "plot", str(path), str(path), "--plot", str(png), "--width", "80"])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    docs = [results.load_result(str(path))] * 2
    labels = plots.write_png([plots.series_of(d, n) for d, n in zip(docs, ["base", "new"])], str(tmp_path / "b.png"))
    assert labels == ["base p50", "base p99", "new p50", "new p99"]


def test_charts_without_the_extra_say_what_to_install(sweep_file, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "plotext", None)  # import plotext -> ImportError
    path, _ = sweep_file
    r = runner.invoke(app, ["bench", "plot", str(path)])
    assert r.exit_code != 0 and "pip install 'rosecli[plot]'" in r.output and "Traceback" not in r.output


def test_serve_sweep_over_concurrency_against_a_live_server(cache_dir, tmp_path):
    for extra in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(extra)
    from test_server import LiveServer

    srv = LiveServer(cache_dir)
    try:
        path = tmp_path / "serve-sweep.json"
        r = runner.invoke(app, ["bench", "sweep", "serve", "--base-url", srv.url, "--num-prompts", "4",
                                "--input-len", "8", "--output-len", "3", "--max-concurrency", "1,2",
                                "--save-result", str(path)])
        assert r.exit_code == 0, r.output
        assert r.output.index("Point conc 1 in 8 out 3:") < r.output.index("Point conc 2 in 8 out 3:")
        doc = json.loads(path.read_text())
        assert doc["sweep"]["mode"] == "serve" and doc["sweep"]["axes"]["max_concurrency"] == [1, 2]
        for p, conc in zip(doc["points"], (1, 2)):
            assert p["params"] == {"max_concurrency": conc, "input_len": 8, "output_len": 3}
            assert max(run["counts"]["peak_concurrency"] for run in p["runs"]) <= conc
            assert all(rec["success"] and rec["output_tokens"] == 3 for rec in p["requests"][0])
        r = runner.invoke(app, ["bench", "sweep", "serve", "--base-url", srv.url, "--max-batch-size", "1,2"])
        assert r.exit_code != 0 and "no such option" in r.output.lower(), r.output
    finally:
        srv.stop()
