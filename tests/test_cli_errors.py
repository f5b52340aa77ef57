"""Nothing a user types makes `rose` print a traceback: every mistake is one line on stderr that
names the flag (as typed) or file and the fix, with exit code 2; a benchmark whose every request
failed exits 1 and says why."""

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from rosecli.commands.main import app

runner = CliRunner()
TINY = ["--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cmd(command, cache_dir, *extra):
    """Argument lists of the commands that load a model, on the tiny dummy model."""
    head = {"generate": ["generate", "Hello"], "stream": ["bench", "stream"], "sched": ["bench", "sched"],
            "profile": ["profile"], "serve-local": ["serve-local"]}[command]
    size = {"generate": ["--max-new-tokens", "2"], "serve-local": []}.get(command, ["--num-requests", "2"])
    return [*head, *TINY, "--cache-dir", cache_dir, *size, *extra]


def _one_line_error(r, *needles, code=2):
    """Exit ``code``, no traceback, the error is one line and names every needle."""
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output and not (r.exception and not isinstance(r.exception, SystemExit)), r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, r.output
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


# ---- 1. --cache-dir that cannot be used ------------------------------------------------------


def test_cache_dir_that_is_a_file(cache_dir, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for bad in (f, f / "sub"):
        r = runner.invoke(app, _cmd("generate", cache_dir, "--cache-dir", str(bad)))
        line = _one_line_error(r, "--cache-dir", "is not a directory", "pass a directory")
        assert r.output.strip() == line  # refused before anything was loaded or printed


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any directory")
def test_cache_dir_not_writable(cache_dir, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = runner.invoke(app, _cmd("generate", cache_dir, "--cache-dir", str(ro / "cache")))
        _one_line_error(r, "--cache-dir", "not writable")
    finally:
        ro.chmod(0o755)


# ---- 2. text that is not UTF-8 ---------------------------------------------------------------


def test_prompt_argument_with_invalid_utf8_bytes(cache_dir):
    # argv bytes that are not UTF-8 reach Python as lone surrogates: only a real process shows it
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "rosecli", "generate", b"ok", b"caf\xff", *TINY, "--cache-dir",
                        cache_dir], capture_output=True, env=env, timeout=120)
    err = p.stderr.decode("utf-8", "replace").strip()
    assert p.returncode == 2 and "Traceback" not in err, err
    assert err.startswith("error: prompt argument 2 is not valid UTF-8 (byte 0xff") and len(err.splitlines()) == 1


@pytest.mark.parametrize("command,flag", [("stream", "--prompt"), ("profile", "--prompt"), ("generate", "--stop")])
def test_flag_text_with_invalid_utf8(cache_dir, command, flag):
    r = runner.invoke(app, _cmd(command, cache_dir, flag, "caf\udcff"))
    _one_line_error(r, f"{flag} is not valid UTF-8", "0xff")


# ---- 3. --nvtx without CUDA ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["stream", "sched", "profile", "serve-local"])  # every command with --nvtx
def test_nvtx_refused_on_cpu(cache_dir, command):
    r = runner.invoke(app, _cmd(command, cache_dir, "--nvtx"))
    line = _one_line_error(r, "--nvtx", "CUDA", "--device cpu")
    assert r.output.strip() == line


def test_nvtx_refused_without_a_gpu(cache_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = [a for a in _cmd("sched", cache_dir, "--nvtx") if a not in ("--device", "cpu")]
    _one_line_error(runner.invoke(app, args), "--nvtx", "no CUDA GPU")


@pytest.mark.parametrize("command", ["generate", "stream", "profile"])
@pytest.mark.parametrize("flag", ["--paged-attn", "--cuda-graph"])
def test_cuda_only_paths_refused_on_cpu(cache_dir, command, flag):
    """Once silently ignored on CPU; now one line naming the flag, before the model loads."""
    r = runner.invoke(app, _cmd(command, cache_dir, flag))
    _one_line_error(r, flag, "needs a CUDA GPU", "the engine runs on cpu", f"leave out {flag}")


# ---- 4. --save-result checked before the run -------------------------------------------------


@pytest.mark.parametrize("command", ["stream", "sched"])
def test_save_result_checked_before_the_run(cache_dir, tmp_path, command):
    for bad, message in (("", "needs a file name"), (str(tmp_path), "is a directory"),
                         (str(tmp_path / "none" / "r.json"), "does not exist")):
        r = runner.invoke(app, _cmd(command, cache_dir, "--save-result", bad))
        line = _one_line_error(r, "--save-result", message)
        assert r.output.strip() == line  # nothing ran
    assert os.listdir(tmp_path) == []  # no .tmp left behind


def test_save_result_failing_late_leaves_no_tmp(tmp_path, monkeypatch):
    from rosecli.bench import results
    from rosecli.engine.errors import ConfigError

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(results.os, "replace", refuse)
    with pytest.raises(ConfigError, match="--save-result: cannot write"):
        results.save_result(str(tmp_path / "r.json"), "sched", {}, {}, [], {}, env={})
    assert os.listdir(tmp_path) == []


# ---- 5. failed requests are counted, all failing is an error ---------------------------------


@pytest.mark.parametrize("command", ["stream", "sched", "profile"])
def test_every_request_failing_exits_1_saying_why(cache_dir, command):
    # 600 words do not fit tiny-llama's 512-token context: the engine refuses every request
    r = runner.invoke(app, _cmd(command, cache_dir, "--prompt-repeats", "600"))
    _one_line_error(r, "all 2 requests", "failed", "2 RequestError", "context is 512", code=1)


def test_some_requests_failing_are_counted_by_kind(cache_dir):
    # prompts of 200..600 random tokens: those over the 512-token context fail, the rest run
    r = runner.invoke(app, _cmd("stream", cache_dir, "--num-requests", "8", "--input-len", "400", "--range-ratio",
                                "0.5", "--max-new-tokens", "2", "--seed", "1"))
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("Failed requests:"))
    failed = int(line.split()[2])
    assert 0 < failed < 8 and f"of 8 in the measured runs: {failed} RequestError" in line


# ---- 6. every other mistake ------------------------------------------------------------------


@pytest.mark.parametrize("command,args,needles", [
    # non-numbers, unknown options, missing arguments: click's errors, one line
    ("generate", ["--max-new-tokens", "ten"], ["'--max-new-tokens'", "valid integer", "rose generate --help"]),
    ("stream", ["--request-rate", "fast"], ["'--request-rate'", "rose bench stream --help"]),
    ("sched", ["--no-such-flag"], ["No such option: --no-such-flag"]),
    # numbers no engine tensor or list can hold: refused as parsed, naming the flag
    ("generate", ["--max-new-tokens", "9223372036854775808"], ["'--max-new-tokens'", "2147483647"]),
    ("generate", ["--top-k", "9223372036854775808"], ["'--top-k'", "2147483647"]),
    ("generate", ["--seed", "18446744073709551616"], ["'--seed'", "18446744073709551615"]),
    ("stream", ["--num-requests", "9223372036854775808"], ["'--num-requests'"]),
    ("sched", ["--num-gpu-blocks", "9223372036854775808"], ["'--num-gpu-blocks'"]),
    ("profile", ["--warmup-runs", "9223372036854775808"], ["'--warmup-runs'"]),
    # the engine's range checks, worded with the flag the user typed
    ("generate", ["--max-new-tokens", "0"], ["--max-new-tokens must be"]),
    ("stream", ["--top-p", "0"], ["--top-p must be in (0, 1]"]),
    ("sched", ["--top-k", "-1"], ["--top-k must be"]),
    ("profile", ["--temperature", "nan"], ["--temperature must be"]),
    ("generate", ["--stop", ""], ["--stop strings must be non-empty"]),
    ("stream", ["--submit-interval-ms", "nan"], ["--submit-interval-ms must be a finite number"]),
    ("profile", ["--torch-trace", ""], ["--torch-trace needs a directory name"]),
])
def test_bad_values_are_one_line_naming_the_flag(cache_dir, command, args, needles):
    r = runner.invoke(app, _cmd(command, cache_dir, *args))
    line = _one_line_error(r, *needles)
    assert "max_new_tokens" not in line and "top_p" not in line and "top_k" not in line


def test_missing_prompt_is_one_line():
    _one_line_error(runner.invoke(app, ["generate"]), "give a prompt", "-p FILE", "- to read stdin")


def test_torch_trace_that_is_a_file(cache_dir, tmp_path):
    f = tmp_path / "trace"
    f.write_text("")
    _one_line_error(runner.invoke(app, _cmd("profile", cache_dir, "--torch-trace", str(f))), "--torch-trace",
                    "is not a directory")


def test_input_len_longer_than_the_context(cache_dir):
    r = runner.invoke(app, _cmd("stream", cache_dir, "--input-len", "2147483647"))
    _one_line_error(r, "--input-len 2147483647", "context of 512", "at most 511")


def test_compare_missing_and_damaged_files(tmp_path):
    good = {"schema": "rosecli.bench/1", "kind": "sched", "config": {}, "environment": {}, "startup": {},
            "runs": [{"label": "run 1/1", "warmup": False, "figures": {"decode_s": 1.0}, "errors": []}],
            "summary": {"decode_s": 1.0}, "requests": []}
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(good))
    cases = {"missing.json": (None, "cannot read result file"),
             "binary.json": (b"\xff\xfe\x00", "is not a JSON result file"),
             "cut.json": (json.dumps(good)[:40].encode(), "is not a JSON result file"),
             "runs.json": (json.dumps({**good, "runs": [1, 2]}).encode(), "run 0 is not an object"),
             "figures.json": (json.dumps({**good, "runs": [{"figures": [1]}]}).encode(), "run 0 is not an object"),
             "config.json": (json.dumps({**good, "config": None}).encode(), "'config' is not an object")}
    for name, (content, message) in cases.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        r = runner.invoke(app, ["bench", "compare", str(ok), str(tmp_path / name)])
        _one_line_error(r, name, message)
    r = runner.invoke(app, ["bench", "compare", str(ok), str(ok)])
    assert r.exit_code == 0, r.output


# ---- --cpu-weights and --threads -------------------------------------------------------------


@pytest.mark.parametrize("flag,value,needles", [
    ("--cpu-weights", "int2", ["--cpu-weights", "auto, blocks, int4, float16, int8, float", "'int2'"]),
    ("--threads", "0", ["--threads", "between 1 and 1024", "0"]),
    ("--threads", "100000", ["--threads", "between 1 and 1024"]),
    ("--threads", "two", ["--threads"]),
])
def test_cpu_weights_and_threads_bad_values(cache_dir, flag, value, needles):
    for command in ("generate", "stream"):
        r = runner.invoke(app, _cmd(command, cache_dir, flag, value))
        _one_line_error(r, *needles)
