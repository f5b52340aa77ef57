"""What a new user meets first (issue 24): --version, prompts from stdin and files, rose chat,
--help at 80 columns, the live table's counts while a run goes, and argument checks that answer
before torch is imported."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from io import StringIO

import pytest
import typer
from rich.console import Console
from typer.main import get_command
from typer.testing import CliRunner

from rosecli.commands.main import app

runner = CliRunner()
TINY = ["--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--no-stop-on-eos"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gen(cache_dir, *args, input=None):
    return runner.invoke(app, ["generate", *args, *TINY, "--cache-dir", cache_dir], input=input)


def test_version_names_package_torch_triton_and_device():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("rosecli ") and any(line.startswith("torch ") for line in lines)
    assert any(line.startswith("triton ") for line in lines) and any(line.startswith("CUDA device: ") for line in lines)
    assert runner.invoke(app, ["-V"]).output == r.output


def test_prompt_from_stdin_is_the_same_prompt_as_the_argument(cache_dir):
    by_arg = _gen(cache_dir, "Hello there", "-n", "3")
    by_stdin = _gen(cache_dir, "-", "-n", "3", input="Hello there\n")
    assert by_arg.exit_code == 0 and by_stdin.exit_code == 0, by_stdin.output
    tokens = [re.search(r"prompt tokens (\d+)", r.output).group(1) for r in (by_arg, by_stdin)]
    assert tokens[0] == tokens[1]  # the trailing newline is not part of the prompt


def test_prompt_files_and_arguments_stream_in_order(cache_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "question.txt").write_text("A prompt\nover two lines\n")
    r = _gen(cache_dir, "first", "-p", "question.txt", "--prompt-file", "-", "-n", "4", input="from stdin")
    assert r.exit_code == 0, r.output
    heads = [line for line in r.output.splitlines() if line.startswith("=== [")]
    assert heads == ["=== [0] first", "=== [1] question.txt", "=== [2] stdin"]
    assert "3 prompts: prompt tokens" in r.output and "generated tokens 12" in r.output


def test_summary_says_what_each_figure_measures_within_80_columns(cache_dir):
    r = _gen(cache_dir, "Hello", "-n", "3")
    assert r.exit_code == 0, r.output
    summary = r.output[r.output.index("tiny-llama on cpu"):].splitlines()
    assert any("first byte" in line and "process start to first text on stdout" in line for line in summary)
    assert any(line.lstrip().startswith("TTFT") and "request submitted to its first token" in line
               for line in summary)
    assert all(len(line) <= 80 for line in summary), summary


@pytest.mark.parametrize("args,input,message", [
    (["-p", "no-such-file.txt"], None, "--prompt-file no-such-file.txt: no such file"),
    (["-", "-p", "-"], "x", "- (stdin) was given twice"),
    (["-"], "  \n", "stdin is empty"),
    ([], None, "give a prompt"),
    (["Hi", "--system", "Be brief.", "--no-chat"], None, "--system goes through the chat template"),
])
def test_prompt_source_mistakes_are_one_line(cache_dir, args, input, message):
    r = _gen(cache_dir, *args, input=input)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert [line for line in r.output.splitlines() if line.startswith("error: ")] == [
        next(line for line in r.output.splitlines() if message in line)]


def test_system_prompt_goes_through_the_chat_template(cache_dir):
    short = _gen(cache_dir, "Hi", "-n", "2", "--system", "Be brief.")
    long = _gen(cache_dir, "Hi", "-n", "2", "--system", "Be brief. Answer in French, in one line, politely.")
    n = [int(re.search(r"prompt tokens (\d+)", r.output).group(1)) for r in (short, long)]
    assert long.exit_code == 0 and n[1] > n[0], long.output


# ---- rose chat ------------------------------------------------------------------------------


def _chat(cache_dir, lines, *args):
    return runner.invoke(app, ["chat", *TINY, "--cache-dir", cache_dir, *args], input="".join(f"{x}\n" for x in lines))


def test_chat_two_turns_then_exit(cache_dir):
    r = _chat(cache_dir, ["Hello", "How are you?", "/exit", "never sent"], "-n", "3")
    assert r.exit_code == 0, r.output
    # each answered turn ran to --max-new-tokens; the line after /exit was not sent
    assert r.output.count("the answer stopped at 3 tokens") == 2, r.output


def test_chat_keeps_the_conversation_until_it_outgrows_the_context(cache_dir):
    turn = "Tell me more about the history of the harbour and its ships, please."
    r = _chat(cache_dir, [turn] * 4, "-n", "8", "--max-model-len", "96")
    assert r.exit_code == 0, r.output
    assert r.output.count("the answer stopped at 8 tokens") == 4
    assert "outgrew the 96-token context: dropped the oldest" in r.output  # history was kept, then trimmed


def test_chat_clear_forgets_and_unknown_commands_are_named(cache_dir):
    r = _chat(cache_dir, ["/clear", "/frobnicate", "/help"], "-n", "2")
    assert r.exit_code == 0, r.output
    assert "conversation cleared" in r.output and "unknown command /frobnicate" in r.output
    assert "/exit (or Ctrl-D) ends" in r.output


# ---- help at 80 columns -----------------------------------------------------------------------


def _all_commands():
    out = [[]]
    root = get_command(app)
    for name, cmd in root.commands.items():
        out.append([name])
        if isinstance(cmd, typer.core.TyperGroup):
            out += [[name, sub] for sub in cmd.commands]
    return out


@pytest.mark.parametrize("path", _all_commands(), ids=lambda p: " ".join(p) or "rose")
def test_help_at_80_columns_shows_every_option_whole(path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    r = runner.invoke(app, [*path, "--help"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert "…" not in r.output and not re.search(r"<(bool|str|int|float|list)", r.output)
    assert "{" not in r.output.split("Usage:")[1].splitlines()[0]  # no {prompts}...
    cmd = get_command(app)
    for part in path:
        cmd = cmd.commands[part]
    for p in cmd.params:
        for flag in p.opts + getattr(p, "secondary_opts", []):
            if not flag.startswith("--"):
                continue
            stem = flag[5:] if flag.startswith("--no-") and p.secondary_opts else flag[2:]
            assert re.search(rf"--(\[no-\])?{re.escape(stem)}\b", r.output), (flag, path)


def test_help_shows_choices_and_the_cuda_panel(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = runner.invoke(app, ["bench", "stream", "--help"]).output
    assert "--device auto|cpu|cuda" in out and "--submit-schedule absolute|relative" in out
    cuda = out[out.index("─ CUDA ─"):]
    for flag in ("--gpu-memory-utilization", "--[no-]cuda-graph", "--[no-]paged-attn", "--nvtx"):
        assert re.search(rf"^│ {re.escape(flag)} ", cuda, re.M)
        assert not re.search(rf"^│ {re.escape(flag)} ", out[:out.index("─ CUDA ─")], re.M)
    assert cuda.count("(CUDA)") == 4


# ---- the live table ---------------------------------------------------------------------------


def test_live_table_counts_tokens_as_they_stream(tiny_engine_factory, monkeypatch):
    """A slow engine (every step 30 ms): the table's token count rises while no request has finished
    yet, and every redraw fits 80 columns."""
    from rosecli.bench import report
    from rosecli.bench.run import bench_stream
    from rosecli.bench.workload import WorkloadSpec
    from rosecli.engine.config import SamplingParams

    engine = tiny_engine_factory()
    step = engine.scheduler.step

    def slow_step():
        time.sleep(0.03)
        return step()

    monkeypatch.setattr(engine.scheduler, "step", slow_step)
    screen = StringIO()
    console = Console(file=screen, force_terminal=True, width=80, color_system=None)
    seen = []

    class Recording(report.RunTable):
        def update(self, finished, total, tokens, elapsed):
            seen.append((finished, tokens))
            super().update(finished, total, tokens, elapsed)

    spec = WorkloadSpec(num_requests=4, max_new_tokens=24)
    params = SamplingParams(max_new_tokens=24, stop_on_eos=False)
    with Recording(console, "stream", "streaming benchmark", refresh_s=0.0) as table:
        bench_stream(engine, spec, params, 0, 1, table)
    before_any_finished = sorted({tokens for finished, tokens in seen if finished == 0 and tokens > 0})
    assert len(before_any_finished) >= 3, seen  # counted while streaming, not only at each finish
    assert seen[-1] == (4, 96)
    assert re.search(r"0/4 requests done, [1-9][\d,]* tokens", screen.getvalue())
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())  # the cursor moves between redraws
    assert all(len(line) <= 80 for line in drawn.splitlines()), max(drawn.splitlines(), key=len)
    assert "…" not in drawn.replace("  …", "")  # no cut figure (… marks a run not yet done)


# ---- cheap checks first -----------------------------------------------------------------------


def test_bad_arguments_fail_before_torch_is_imported():
    """Each mistake is refused by a process that never imported torch (the seconds a cold start costs)."""
    cases = [["generate", "Hi", "--max-new-tokens", "0"], ["generate", "-p", "missing.txt"], ["generate"],
             ["bench", "stream", "--repeat-runs", "0"], ["bench", "sched", "--mode", "sometimes"],
             ["generate", "Hi", "--device", "tpu"], ["chat", "--top-p", "2"], ["profile", "--num-requests", "0"]]
    code = ("import sys\nfrom rosecli.commands.main import app\n"
            f"for args in {cases!r}:\n"
            "    try:\n        app(args, prog_name='rose')\n    except SystemExit as e:\n"
            "        print('exit', e.code, flush=True)\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ,
                       "PYTHONPATH": ROOT}, timeout=120)
    elapsed = time.perf_counter() - t0
    assert p.stdout.splitlines() == ["exit 2"] * len(cases) + ["no torch"], p.stdout + p.stderr
    assert len([line for line in p.stderr.splitlines() if line.startswith("error: ")]) == len(cases), p.stderr
    assert elapsed < 20, elapsed  # about a second even on a loaded machine: no torch import
