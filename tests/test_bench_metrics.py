"""Benchmark figures: metric math on hand-made timestamps, result files, compare, plain report."""

import json
import math
import re
from io import StringIO

import pytest
from rich.console import Console

from rosecli.bench import compare, metrics, report, results
from rosecli.bench.metrics import RequestTiming, percentile, sched_metrics, summarize_run, summarize_sched_runs
from rosecli.engine.errors import ConfigError

ENV = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0", "commit": "abc", "time": "t"}


# --- percentile -------------------------------------------------------------------------

def test_percentile_linear_interpolation_small_samples():
    vals = [40.0, 10.0, 20.0]  # sorted: 10, 20, 40
    assert percentile(vals, 50) == pytest.approx(20.0)
    # p95: rank (3-1)*0.95 = 1.9 -> 20 + 0.9*(40-20) = 38
    assert percentile(vals, 95) == pytest.approx(38.0)
    # p99: rank (3-1)*0.99 = 1.98 -> 20 + 0.98*(40-20) = 39.6 (not the max, not nearest-rank 40)
    assert percentile(vals, 99) == pytest.approx(39.6)


def test_percentile_ties_single_and_empty():
    # sorted 5,5,5,9: p50 rank 1.5 between two 5s -> 5; p99 rank 2.97 -> 5 + 0.97*4 = 8.88
    assert percentile([5, 9, 5, 5], 50) == pytest.approx(5.0)
    assert percentile([5, 9, 5, 5], 99) == pytest.approx(8.88)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


# --- one stream run ---------------------------------------------------------------------

def _timings():
    a = RequestTiming(request_id=0, prompt_tokens=3, output_tokens=4, scheduled_submit=0.0, submit=0.002,
                      add_request_done=0.0025, tokenized=0.003, admitted=0.010, first_token=0.020,
                      token_times=[0.020, 0.030, 0.045, 0.050], chunk_tokens=[1, 1, 1, 1], finish=0.050,
                      finish_reason="length")
    b = RequestTiming(request_id=1, prompt_tokens=2, output_tokens=1, scheduled_submit=0.010, submit=0.010,
                      add_request_done=0.0101, tokenized=None, admitted=0.015, first_token=0.030,
                      token_times=[0.030], chunk_tokens=[1], finish=0.030, finish_reason="length")
    # chunked stream (--stream-interval 8): 12 tokens in 3 chunks
    c = RequestTiming(request_id=2, prompt_tokens=5, output_tokens=12, scheduled_submit=0.020, submit=0.021,
                      add_request_done=0.0212, tokenized=0.022, admitted=0.025, first_token=0.040,
                      token_times=[0.040, 0.080, 0.120], chunk_tokens=[1, 8, 3], finish=0.120,
                      finish_reason="length")
    return [a, b, c]


def test_summarize_run_hand_computed():
    m = summarize_run(_timings(), 0.002, 0.120, 0.0192)
    d = m.dists
    # submit lag: 0.002, 0, 0.001
    assert d["submit_lag"].p50 == pytest.approx(0.001)
    assert d["add_request"].p50 == pytest.approx(0.0002)  # 0.0005, 0.0001, 0.0002
    # tokenize only where recorded (b has no tokenize stage): 0.001, 0.001
    assert d["tokenize"].count == 2 and d["tokenize"].p50 == pytest.approx(0.001)
    # queue wait: a 0.010-0.003, b 0.015-0.010 (from submit), c 0.025-0.022
    assert d["queue_wait"].p50 == pytest.approx(0.005)
    assert d["queue_wait"].mean == pytest.approx(0.005)
    assert d["prefill_first_token"].p50 == pytest.approx(0.015)  # 0.010, 0.015, 0.015
    # TTFT: 0.018, 0.020, 0.019 -> p95 rank 1.9: 0.019 + 0.9*0.001; p99 rank 1.98
    assert (d["ttft"].p50, d["ttft"].p95, d["ttft"].p99) == pytest.approx((0.019, 0.0199, 0.01998))
    # TPOT: a (0.050-0.020)/3 = 0.010, c (0.120-0.040)/11; b (one token) left out
    assert d["tpot"].count == 2 and m.tpot_left_out == 1
    assert d["tpot"].p50 == pytest.approx((0.010 + 0.08 / 11) / 2)
    # ITL per received chunk, pooled: a 0.010 0.015 0.005, c 0.040 0.040
    assert d["itl"].count == 5
    assert d["itl"].p50 == pytest.approx(0.015)
    assert d["itl"].p95 == pytest.approx(0.040)  # rank 3.8 between the two 0.040s
    assert d["itl"].mean == pytest.approx(0.110 / 5)
    # latency: 0.048, 0.020, 0.099
    assert d["latency"].p50 == pytest.approx(0.048)
    assert m.chunks == 8 and m.mean_chunk_tokens == pytest.approx(17 / 8)
    # wall 0.118 s (first submit 0.002 -> last finish 0.120); 17 output, 10 prompt tokens
    assert m.wall_s == pytest.approx(0.118)
    assert m.throughput_completion == pytest.approx(17 / 0.118)
    assert m.throughput_total == pytest.approx(27 / 0.118)


def test_wall_defaults_to_first_submit_and_last_finish():
    m = summarize_run(_timings())
    assert m.wall_s == pytest.approx(0.118)
    assert m.submit_wall_s == pytest.approx(0.0212 - 0.002)


def test_throughput_and_all_one_token_outputs():
    ts = [RequestTiming(request_id=i, prompt_tokens=10, output_tokens=100, scheduled_submit=None, submit=1.0,
                        first_token=1.5, token_times=[1.5, 3.0], finish=3.0) for i in range(2)]
    m = summarize_run(ts, 1.0, 3.0, 0.0)
    assert m.throughput_completion == pytest.approx(100.0)  # 200 tokens / 2 s
    assert m.throughput_total == pytest.approx(110.0)  # 220 tokens / 2 s
    assert m.dists["submit_lag"].count == 0 and math.isnan(m.dists["submit_lag"].p50)
    one = [RequestTiming(request_id=0, prompt_tokens=1, output_tokens=1, scheduled_submit=0.0, submit=0.0,
                         first_token=0.01, token_times=[0.01], finish=0.01)]
    m1 = summarize_run(one)
    assert m1.dists["tpot"].count == 0 and math.isnan(m1.dists["tpot"].p50)
    assert m1.dists["itl"].count == 0 and m1.dists["ttft"].p99 == pytest.approx(0.01)


def test_median_run_over_measured_runs():
    runs = [summarize_run(_timings(), 0.002, end, 0.0) for end in (0.120, 0.102, 0.202)]
    s = metrics.median_run(runs)
    assert s["throughput_completion"] == pytest.approx(17 / 0.118)  # walls 0.118, 0.100, 0.200
    assert s["ttft_p99"] == pytest.approx(0.01998)


# --- bench sched --------------------------------------------------------------------------

def test_sched_run_and_summary():
    ts = _timings()
    m = sched_metrics("online", prefill_s=0.5, decode_s=2.0, total_s=2.6, completion_tokens=1000, timings=ts)
    assert m.throughput_decode == pytest.approx(500.0)
    assert m.throughput_total == pytest.approx(1000 / 2.6)
    assert m.ttft_p50 == pytest.approx(0.019) and m.latency_p50 == pytest.approx(0.048)
    runs = [sched_metrics("online", 0.5, dec, dec + 0.5, 1000, ts) for dec in (2.0, 2.2, 2.1)]
    s = summarize_sched_runs(runs)
    assert s["decode_s"] == pytest.approx((2.1, 2.1))
    assert s["throughput_decode"] == pytest.approx((1000 / 2.1, (500 + 1000 / 2.2 + 1000 / 2.1) / 3))
    off = summarize_sched_runs([sched_metrics("offline", 0.5, 2.0, 2.6, 1000)])
    assert "ttft_p50" not in off and off["total_s"] == pytest.approx((2.6, 2.6))


# --- result files -------------------------------------------------------------------------

def _stream_doc(throughputs, ttft_p99s, config=None, warmup=True):
    runs = [{"label": "warmup 1/1", "warmup": True, "figures": {"throughput_completion": 1.0, "ttft_p99": 9.0}}] \
        if warmup else []
    for i, (tp, t) in enumerate(zip(throughputs, ttft_p99s)):
        runs.append({"label": f"run {i + 1}/{len(throughputs)}", "warmup": False,
                     "figures": {"throughput_completion": tp, "ttft_p99": t}})
    return results.build_result("stream", config or {"max_batch_size": 64}, {"model_load_s": 1.0}, runs,
                                command="rose bench stream", env=ENV)


def test_result_round_trip(tmp_path):
    ts = _timings()
    m = summarize_run(ts, 0.002, 0.120, 0.0192)
    runs = [results.run_record("warmup 1/1", True, m), results.run_record("run 1/1", False, m)]
    path = str(tmp_path / "r.json")
    doc = results.save_result(path, "stream", {"max_batch_size": 64}, {"model_load_s": 1.5, "compile_s": 2.0},
                              runs, requests=[results.request_records(ts, 0.002)], command="rose bench stream",
                              env=ENV)
    back = results.load_result(path)
    assert back == doc
    assert back["schema"] == "rosecli.bench/1" and back["runs"][0]["warmup"] is True
    assert back["summary"]["ttft_p99"] == pytest.approx(0.01998)  # median over the one measured run
    assert back["summary"]["submit_lag_p50"] == pytest.approx(0.001)
    req = back["requests"][0][1]
    assert req["tokenized"] is None and req["submit"] == pytest.approx(0.008)
    assert back["requests"][0][2]["chunk_tokens"] == [1, 8, 3]
    assert "NaN" not in open(path).read()  # strict JSON: absent figures are null


def test_load_result_errors(tmp_path):
    p = tmp_path / "future.json"
    p.write_text(json.dumps({"schema": "rosecli.bench/2", "kind": "stream", "runs": [], "summary": {}}))
    with pytest.raises(ConfigError, match="rosecli.bench/2"):
        results.load_result(str(p))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a JSON result file"):
        results.load_result(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        results.load_result(str(tmp_path / "missing.json"))


def test_environment_capture():
    env = results.environment()
    assert {"gpu", "torch", "triton", "transformers", "python", "platform", "commit", "time"} <= set(env)
    assert env["commit"] is None or len(env["commit"]) == 40


# --- compare -------------------------------------------------------------------------------

def test_compare_noise_direction_and_percent():
    # no raw samples: the intervals come from bootstrapping the three repeat runs of each file
    base = _stream_doc([100, 104, 102], [0.030, 0.031, 0.032])  # medians 102, 0.031
    near = _stream_doc([103, 105, 104], [0.020, 0.021, 0.022])
    slow = _stream_doc([90, 91, 92], [0.0305, 0.0315, 0.0325])
    rows = {r.figure: r for r in compare.compare_results([base, near, slow])}
    tp, ttft = rows["throughput_completion"], rows["ttft_p99"]
    assert tp.base == 102 and tp.higher_is_better and not ttft.higher_is_better
    # +2 tokens/s: the interval of the change reaches 0
    assert tp.cells[0].verdict == "noise" and tp.cells[0].percent == pytest.approx(100 * 2 / 102)
    # -11 tokens/s: the interval lies below 0, throughput down is worse
    assert tp.cells[1].verdict == "worse" and tp.cells[1].change == -11
    assert tp.cells[1].percent == pytest.approx(-100 * 11 / 102)
    # TTFT p99 0.031 -> 0.021: latency down is better, -32.26 %
    assert ttft.cells[0].verdict == "better" and ttft.cells[0].percent == pytest.approx(-100 * 0.010 / 0.031)
    assert ttft.cells[1].verdict == "noise"  # +0.0005 s: the interval holds 0
    assert ttft.cells[1].ci_low < 0 < ttft.cells[1].ci_high and ttft.cells[0].ci_high < 0
    assert list(rows) == ["throughput_completion", "ttft_p99"]


def test_compare_single_runs_not_judged_and_kind_mismatch():
    a, b = _stream_doc([100], [0.03]), _stream_doc([120], [0.02], config={"max_batch_size": 32})
    rows = compare.compare_results([a, b])
    assert all(r.cells[0].verdict == "n/a" for r in rows)
    assert compare.config_differences([a, b]) == {"max_batch_size": [64, 32]}
    sched = dict(a, kind="sched")
    with pytest.raises(ConfigError, match="different benchmarks"):
        compare.compare_results([a, sched])


# --- report -------------------------------------------------------------------------------

def _plain_console():
    buf = StringIO()
    return Console(file=buf, force_terminal=False, width=80), buf


def test_plain_stream_report_post_format_no_escapes():
    console, buf = _plain_console()
    m = summarize_run(_timings(), 0.002, 0.120, 0.0192)
    report.print_startup(console, {"model_load_s": 1.5, "compile_s": 2.25, "graph_capture_s": 0.5})
    with report.RunTable(console, "stream", "streaming benchmark") as table:
        table.start_run("warmup 1/1", warmup=True)
        table.update(1, 3, 10, 0.05)
        table.finish_run("warmup 1/1", m)
        table.start_run("run 1/1", warmup=False)
        table.finish_run(m)
    report.print_stream_summary(console, [m], metrics.median_run([m]))
    out = buf.getvalue()
    lines = out.splitlines()
    assert "\x1b" not in out
    assert "Startup (not in any run): model load 1.50 s, kernel compile 2.25 s, graph capture 0.50 s" in lines
    assert lines.index("=== warmup 1/1 ===") < lines.index("=== run 1/1 ===")
    assert "TTFT p50/p95/p99: 19.00/19.90/19.98 ms" in lines
    assert "Throughput (completion,total): 144.07 tokens/s" in lines
    assert "Throughput (prompt+completion,total): 228.81 tokens/s" in lines
    assert "Queue wait (post-tok) p50/p95/p99: 5.00/6.80/6.96 ms" in lines  # 3, 5, 7 ms
    assert any(x.startswith("TPOT p50/p95/p99: ") and "(1 one-token request left out)" in x for x in lines)
    assert any(x.startswith("ITL p50/p95/p99: 15.00/40.00/40.00 ms (per chunk") for x in lines)
    # only measured runs and the summary match the grep users know; the warm-up does not
    assert sum(x.startswith("TTFT p50/p95/p99:") for x in lines) == 2
    assert any(x.startswith("warmup (not measured):") for x in lines)
    assert "=== summary: median of 1 measured run ===" in lines


def test_plain_sched_summary_matches_post():
    console, buf = _plain_console()
    runs = [sched_metrics("online", 0.17, dec, dec + 0.17, 32768, _timings()) for dec in (3.3, 3.31, 3.3)]
    with report.RunTable(console, "sched", "", plain=True) as table:
        table.start_run("run 1/1", warmup=False)
        table.finish_run(runs[0])
    report.print_sched_summary(console, "online", 1, summarize_sched_runs(runs), len(runs))
    lines = buf.getvalue().splitlines()
    assert "\x1b" not in buf.getvalue()
    i = lines.index("=== online summary ===")
    assert lines[i + 1:i + 4] == ["Warmup runs: 1", "Measured runs: 3", "Decode time p50/mean: 3.300000/3.303333 s"]
    assert "TTFT p50/mean: 19.00/19.00 ms" in lines
    assert any(x.startswith("Throughput(completion,decode) p50/mean: 9929.70/") for x in lines)


def test_compare_report_plain_and_terminal():
    base = _stream_doc([100, 104, 102], [0.030, 0.031, 0.032])
    other = _stream_doc([90, 91, 92], [0.020, 0.021, 0.022], config={"max_batch_size": 32})
    rows = compare.compare_results([base, other])
    diffs = compare.config_differences([base, other])
    console, buf = _plain_console()
    report.print_compare(console, ["a.json", "b.json"], rows, diffs)
    lines = buf.getvalue().splitlines()
    assert "Differs: max_batch_size: 64 | 32" in lines
    # the interval: a bootstrap over the three repeat runs of each file (no raw samples in these)
    assert "TTFT p99: 31.00 -> 21.00 (-10.00, -32.3%, [-11.33, -8.67], better) ms" in lines
    assert "Throughput (completion): 102.00 -> 91.00 (-11.00, -10.8%, [-13.00, -9.00], worse) tokens/s" in lines
    term = Console(file=StringIO(), force_terminal=True, width=160)
    report.print_compare(term, ["a.json", "b.json"], rows, diffs)
    assert "better" in term.file.getvalue()


def test_live_table_in_a_terminal():
    term = Console(file=StringIO(), force_terminal=True, width=160)
    m = summarize_run(_timings(), 0.002, 0.120, 0.0192)
    with report.RunTable(term, "stream", "streaming benchmark") as table:
        table.start_run("run 1/1", warmup=False)
        table.update(2, 3, 10, 0.05)
        table.finish_run("run 1/1", m)
    assert re.search(r"19\.00/\d+\.\d\d/19\.98", term.file.getvalue())  # p50/p95/p99 where they fit
