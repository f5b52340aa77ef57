"""Every GPU benchmark run's distance to the floor: the bytes a decode step reads (against a hand
count), the read ceiling's cache, the figures of a run and where they are shown and stored. The
GPU measurement itself is replaced by a fake on CPU; its kernel runs in the Triton interpreter."""

from __future__ import annotations

import json
import math

import pytest
import torch
from engine_utils import our_model, tiny_hf_model
from rich.console import Console
from typer.testing import CliRunner

from rosecli.bench import compare, report, results
from rosecli.bench.roofline import EngineProbe, line
from rosecli.bench.run import bench_sched, bench_stream
from rosecli.bench.workload import WorkloadSpec
from rosecli.engine.config import SamplingParams
from rosecli.engine.roofline import decode_bytes, device_read_ceiling, read_ceiling
from rosecli.kernels.stream_read import stream_read_sum, stream_read_sum_ref

F32 = 4  # bytes


# --- bytes per decode step, against a hand count ----------------------------------------------------


def test_llama_tied_counts_every_weight_once_the_logits_gemm_and_one_embedding_row_per_sequence():
    m = our_model(tiny_hf_model("llama"))  # 2 layers, d 64, 4 heads, 2 kv heads (head_dim 16), mlp 128, vocab 256
    d, inter, vocab, kv = 64, 128, 256, 2 * 16
    layer = d + d * (d + 2 * kv) + d * d + d + d * 2 * inter + inter * d  # norms, qkv, o, gate_up, down
    weights = 2 * layer + d + vocab * d  # + final norm + logits GEMM over the tied embedding
    got = decode_bytes(m, torch.float32)
    assert got.weight_bytes == weights * F32
    assert got.row_bytes == d * F32  # one embedding row per sequence
    assert got.kv_bytes_per_token == 2 * 2 * 2 * 16 * F32  # K and V x layers x kv_heads x head_dim x bytes


def test_gpt2_reads_a_row_of_each_embedding_table_and_the_whole_tied_output_layer():
    m = our_model(tiny_hf_model("gpt2"))  # 2 layers, d 64, 4 heads, mlp 256, vocab 256, 256 positions
    d, vocab = 64, 256
    layer = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    got = decode_bytes(m, torch.float32)
    assert got.weight_bytes == (2 * layer + 2 * d + vocab * d) * F32  # position table: rows only, not 256 x d
    assert got.row_bytes == 2 * d * F32  # a token row and a position row
    assert got.kv_bytes_per_token == 2 * 2 * 4 * 16 * F32


def test_an_untied_lm_head_counts_once_and_the_kv_dtype_is_the_caches():
    m = our_model(tiny_hf_model("qwen2"))  # as the llama, untied, q/k/v biases
    d, inter, vocab, kv = 64, 128, 256, 2 * 16
    layer = d + d * (d + 2 * kv) + (d + 2 * kv) + d * d + d + d * 2 * inter + inter * d
    got = decode_bytes(m, torch.float16)
    assert got.weight_bytes == (2 * layer + d + vocab * d) * F32
    assert got.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # float16 cache: 2 bytes
    assert got.total(steps=3, sequences=6, context_tokens=54) == 3 * got.weight_bytes + 6 * got.row_bytes + 54 * 256


# --- the read ceiling: measured once per device key, then read from the cache --------------------------


def test_the_ceiling_is_measured_once_per_device_key_and_cached(tmp_path):
    calls = []

    def fake(gbs):
        return lambda: calls.append(gbs) or gbs

    first = read_ceiling("H100 | driver 1 | torch 2", tmp_path, fake(3000.0))
    again = read_ceiling("H100 | driver 1 | torch 2", tmp_path, fake(1.0))
    other = read_ceiling("H200 | driver 1 | torch 2", tmp_path, fake(4500.0))
    assert (first.gbs, first.cached, again.gbs, again.cached) == (3000.0, False, 3000.0, True)
    assert (other.gbs, other.cached) == (4500.0, False)
    assert calls == [3000.0, 4500.0]
    stored = json.loads((tmp_path / "read-ceiling.json").read_text())
    assert {k: v["read_gbs"] for k, v in stored.items()} == {"H100 | driver 1 | torch 2": 3000.0,
                                                             "H200 | driver 1 | torch 2": 4500.0}


def test_a_damaged_cache_is_measured_again_and_rewritten(tmp_path):
    (tmp_path / "read-ceiling.json").write_text("{not json")
    got = read_ceiling("dev", tmp_path, lambda: 123.0)
    assert not got.cached and got.gbs == 123.0
    assert read_ceiling("dev", tmp_path, lambda: pytest.fail("measured twice")).cached


def test_no_ceiling_and_no_measurement_on_cpu(tmp_path):
    assert device_read_ceiling(torch.device("cpu"), tmp_path, lambda key: pytest.fail("measured on CPU")) is None
    assert not (tmp_path / "read-ceiling.json").exists()


@pytest.mark.parametrize("programs,pieces", [(1, 1), (4, 3), (7, 2)])
def test_the_read_kernel_sums_each_programs_piece(programs, pieces):
    block = 64
    x = torch.randn(programs * pieces * block, dtype=torch.float16)
    out = torch.empty(programs, dtype=torch.float32)
    stream_read_sum(x, out, block=block)
    torch.testing.assert_close(out, stream_read_sum_ref(x, programs), rtol=1e-3, atol=1e-2)


def test_the_read_kernel_refuses_a_size_that_is_not_whole_blocks():
    with pytest.raises(ValueError, match="whole 64-element blocks"):
        stream_read_sum(torch.zeros(100, dtype=torch.float16), torch.empty(2), block=64)


# --- a run's figures ------------------------------------------------------------------------------------


def test_sched_run_reports_bytes_rate_and_share_from_the_steps_it_ran(tiny_engine_factory):
    engine = tiny_engine_factory(max_batch_size=8)
    probe = EngineProbe(engine, ceiling_gbs=0.5)
    spec = WorkloadSpec(num_requests=2, max_new_tokens=4, input_len=6, range_ratio=0.0)
    with report.RunTable(Console(record=True, width=200), "sched", plain=True) as table:
        out = bench_sched(engine, spec, SamplingParams(max_new_tokens=4, stop_on_eos=False), "offline", 0, 1,
                          table, roofline=probe)
    m = out["measured"][0]
    r = m.roofline
    w = decode_bytes(engine.loaded.model, engine.dtype)
    # two prompts of 6 tokens: the first token comes from the prefill, then 3 decode steps of both,
    # reading contexts of 7, 8 and 9 tokens each (the new token included)
    assert r.steps == 3
    assert r.bytes == 3 * w.weight_bytes + 6 * w.row_bytes + 2 * (7 + 8 + 9) * w.kv_bytes_per_token
    assert r.kv_bytes == 2 * (7 + 8 + 9) * w.kv_bytes_per_token
    assert r.seconds == pytest.approx(m.decode_s)
    figs = out["runs"][0]["figures"]
    assert figs["decode_bytes_per_step"] == pytest.approx(r.bytes / 3)
    assert figs["decode_read_gbs"] == pytest.approx(r.bytes / m.decode_s / 1e9)
    assert figs["roofline_share"] == pytest.approx(figs["decode_read_gbs"] / 0.5)
    assert figs["decode_step_time"] == pytest.approx(m.decode_s / 3)
    assert out["summary"]["roofline_share"] == pytest.approx(figs["roofline_share"])


def test_stream_runs_carry_the_figures_into_lines_table_summary_and_result(tiny_engine_factory, tmp_path):
    engine = tiny_engine_factory(max_batch_size=8)
    probe = EngineProbe(engine, ceiling_gbs=2.0)
    spec = WorkloadSpec(num_requests=3, max_new_tokens=5, input_len=4, range_ratio=0.0)
    console = Console(record=True, width=300)
    with report.RunTable(console, "stream", plain=True) as table:
        out = bench_stream(engine, spec, SamplingParams(max_new_tokens=5, stop_on_eos=False), 1, 2, table,
                           roofline=probe)
    assert len(out["measured"]) == 2
    for m in out["measured"]:
        r = m.roofline
        assert r.steps >= 4 and r.seconds > 0  # 5 tokens each: at least 4 decode steps
        assert r.share == pytest.approx(r.bytes / r.seconds / 1e9 / 2.0)
    text = console.export_text()
    assert text.count("Decode roofline: ") == 2  # one line per measured run; warm-ups keep their one line
    assert "% of the read ceiling (2 GB/s)" in text
    s = out["summary"]
    a, b = (m.roofline.share for m in out["measured"])
    assert s["roofline_share"] == pytest.approx((a + b) / 2)  # the median of two runs
    doc = results.build_result("stream", {}, {}, out["runs"], s, out["requests"], env={"read_ceiling_gbs": 2.0})
    path = tmp_path / "r.json"
    results.write_document(str(path), doc)
    back = results.load_result(str(path))
    assert back["summary"]["decode_read_gbs"] > 0 and back["environment"]["read_ceiling_gbs"] == 2.0


def test_the_live_table_shows_rate_and_share_only_when_runs_have_them(tiny_engine_factory):
    from rosecli.bench.metrics import sched_metrics
    from rosecli.bench.roofline import DecodeRoofline

    term = Console(record=True, width=200, force_terminal=True)
    table = report.RunTable(term, "sched", plain=False)
    plain_run = sched_metrics("offline", 0.1, 1.0, 1.2, 100)
    table.rows.append(["run 1/1", False, plain_run])
    term.print(table.render())
    assert "GB/s" not in term.export_text()
    measured = sched_metrics("offline", 0.1, 1.0, 1.2, 100)
    measured.roofline = DecodeRoofline(steps=100, bytes=150 * 10**9, kv_bytes=10**9, seconds=1.0, ceiling_gbs=3000.0)
    table.rows.append(["run 2/2", False, measured])
    term.print(table.render())
    out = term.export_text()
    assert "GB/s (% ceil)" in out and "150 (5%)" in out


def test_the_summary_line_names_bytes_rate_and_share():
    figs = {"decode_bytes_per_step": 2.4713e9, "decode_kv_bytes_per_step": 7.13e7, "decode_step_time": 1.94e-3,
            "decode_read_gbs": 1273.9, "roofline_share": 1273.9 / 2975}
    assert line(figs, 2975.0) == ("Decode roofline: 2471.3 MB/step (KV 71.3 MB), 1.940 ms/step, 1273.9 GB/s = "
                                  "42.8% of the read ceiling (2975 GB/s)")
    assert line({"throughput_completion": 5.0}) is None


def test_compare_reads_more_gbs_and_a_larger_share_as_better_and_shows_mb():
    def doc(gbs, share, nbytes):
        runs = [{"label": f"run {i}", "warmup": False, "figures": {"decode_read_gbs": gbs + i, "roofline_share": share
                                                                  + i / 1e3, "decode_bytes_per_step": nbytes}}
                for i in range(3)]
        return {"kind": "sched", "runs": runs, "summary": {"decode_read_gbs": gbs + 1, "roofline_share": share + 1e-3,
                                                             "decode_bytes_per_step": nbytes},
                "requests": [], "config": {}, "environment": {}}

    rows = {r.figure: r for r in compare.compare_results([doc(1000.0, 0.4, 2e9), doc(2000.0, 0.8, 2e9)])}
    assert rows["decode_read_gbs"].cells[0].verdict == "better" and rows["decode_read_gbs"].unit == "GB/s"
    assert rows["roofline_share"].cells[0].verdict == "better"
    assert rows["roofline_share"].label == "Share of the read ceiling"
    assert rows["decode_bytes_per_step"].unit == "MB" and rows["decode_bytes_per_step"].cells[0].verdict == "same"
    console = Console(record=True, width=300)
    report.print_compare(console, ["a", "b"], list(rows.values()), {}, plain=True)
    assert "Decode bytes per step: 2,000.00 -> 2,000.00" in console.export_text()


def test_cpu_benchmarks_print_no_roofline(cache_dir):
    from rosecli.commands.main import app

    r = CliRunner().invoke(app, ["bench", "sched", "--model", "tiny-llama", "--load-format", "dummy", "--device",
                                 "cpu", "--no-stop-on-eos", "--cache-dir", cache_dir, "--num-requests", "2",
                                 "--max-new-tokens", "3"])
    assert r.exit_code == 0, r.output
    assert "Decode roofline" not in r.output and "GB/s" not in r.output


# --- rose decode-step profile: where the time goes ------------------------------------------------------


def test_decode_step_shares_by_kind_add_up_with_the_gaps():
    from rosecli.bench.profile import DecodeStepProfile, kernel_category

    kernels = [("nvjet_hsh_128x64_64x5_2x1_v_bz_coopA_TNT", 24, 60.0), ("_decode_kernel", 12, 20.0),
               ("_add_norm_kernel", 25, 10.0), ("void at::native::reduce_kernel<ArgMaxOps<float>>", 1, 5.0),
               ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", 12, 3.0),
               ("Memcpy DtoD (Device -> Device)", 1, 2.0)]
    assert [kernel_category(k[0]) for k in kernels] == ["gemm", "attention", "norm/rotary/activation", "sampling",
                                                         "norm/rotary/activation", "other"]
    assert kernel_category("_skinny_kernel") == "gemm"  # decode's linear layers (`kernels.skinny_gemm`)
    shares = DecodeStepProfile(1, 128, True, 125.0, kernels).shares()
    assert shares == pytest.approx({"gemm": 60 / 125, "attention": 20 / 125, "norm/rotary/activation": 13 / 125,
                                    "sampling": 5 / 125, "other": 2 / 125, "gaps": 25 / 125})
    # kernels of the eager step adding up to more than the replayed step: no gaps, shares of their sum
    over = DecodeStepProfile(1, 128, True, 50.0, kernels).shares()
    assert over["gaps"] == 0 and math.isclose(sum(over.values()), 1.0)


# --- bench serve against a rose server: its counts over GET /roofline --------------------------------


def test_bench_serve_reads_a_rose_servers_counts_per_run_and_stores_them(cache_dir, tmp_path):
    import httpx
    from test_server import LiveServer

    from rosecli.commands.main import app

    srv = LiveServer(cache_dir, read_ceiling_gbs=1.0)
    try:
        stats = httpx.get(f"{srv.url}/roofline").json()
        w = decode_bytes(srv.engine.loaded.model, srv.engine.dtype)
        assert stats["read_ceiling_gbs"] == 1.0 and stats["weight_bytes_per_step"] == w.weight_bytes
        path = tmp_path / "serve.json"
        r = CliRunner().invoke(app, ["bench", "serve", "--base-url", srv.url, "--num-prompts", "3", "--input-len",
                                     "8", "--output-len", "4", "--repeat-runs", "2", "--save-result", str(path)])
        assert r.exit_code == 0, r.output
        assert r.output.count("Decode roofline: ") == 2 and "Decode roofline (median, server): " in r.output
        doc = json.loads(path.read_text())
        after = httpx.get(f"{srv.url}/roofline").json()
        for run in doc["runs"]:
            assert run["figures"]["decode_bytes_per_step"] > w.weight_bytes
            assert run["figures"]["roofline_share"] == pytest.approx(run["figures"]["decode_read_gbs"] / 1.0)
        assert doc["environment"]["read_ceiling_gbs"] == 1.0
        # every decode step of the two runs was counted (3 requests of 4 tokens: 3 steps each at least)
        assert after["decode_steps"] - stats["decode_steps"] >= 2 * 3
    finally:
        srv.stop()


def test_a_server_without_a_read_ceiling_gives_no_figures(cache_dir):
    from test_server import LiveServer

    from rosecli.bench.roofline import server_stats

    srv = LiveServer(cache_dir)  # on CPU serve-local measures none
    try:
        assert server_stats(srv.url, {}) is None
        assert server_stats("http://127.0.0.1:9", {}, timeout=1.0) is None  # nobody there
    finally:
        srv.stop()


# --- on a GPU (the lead runs these) ----------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_ceiling_is_plausible_and_measured_once(tmp_path):
    from rosecli.engine.roofline import measure_read_gbs

    dev = torch.device("cuda")
    assert 100 < measure_read_gbs(dev, max_bytes=512 << 20) < 50_000
    first = device_read_ceiling(dev, tmp_path)
    again = device_read_ceiling(dev, tmp_path, lambda key: pytest.fail("measured twice"))
    assert not first.cached and again.cached and again.gbs == first.gbs


@pytest.mark.gpu
def test_gpu_bench_stream_and_profile_report_the_floor(cache_dir, tmp_path):
    from rosecli.commands.main import app

    path = tmp_path / "w.json"
    gpu = ["--model", "gpt2", "--load-format", "dummy", "--device", "cuda", "--cache-dir", cache_dir]
    r = CliRunner().invoke(app, ["bench", "stream", *gpu, "--num-requests", "16", "--max-new-tokens", "32",
                                 "--no-stop-on-eos", "--max-batch-size", "16", "--repeat-runs", "2",
                                 "--save-result", str(path)])
    assert r.exit_code == 0, r.output
    assert r.output.count("Decode roofline: ") == 2 and "Decode roofline (median): " in r.output
    s = json.loads(path.read_text())["summary"]
    # GPT-2: about 123.7M parameters read per step, 2 bytes each, and some KV
    assert 0 < s["roofline_share"] < 1.2 and s["decode_bytes_per_step"] > 240e6
    r = CliRunner().invoke(app, ["profile", *gpu, "--decode-step", "--decode-batch-sizes", "1,8"])
    assert r.exit_code == 0, r.output
    assert r.output.count("floor: ") == 2 and r.output.count("time: gemm ") == 2
