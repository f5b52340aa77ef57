"""The `rose` CLI through Typer's test runner: help, generation, and every user error."""

import pytest
import torch
from typer.testing import CliRunner

from rosecli.commands.main import app

runner = CliRunner()


def _run(args, cache_dir):
    return runner.invoke(app, [*args, "--cache-dir", cache_dir] if args[0] in ("generate", "profile") else args)


def test_help_lists_every_command():
    out = runner.invoke(app, ["--help"]).output
    for name in ("generate", "serve-local", "bench", "profile"):
        assert name in out
    bench = runner.invoke(app, ["bench", "--help"]).output
    assert "stream" in bench and "sched" in bench


def test_generate_help_documents_chat_default():
    out = runner.invoke(app, ["generate", "--help"], terminal_width=200).output
    assert "--[no-]chat" in out and "instruct" in out and "--max-new-tokens" in out


def test_generate_streams_on_a_dummy_model(cache_dir):
    r = _run(["generate", "Hello world", "--model", "tiny-llama", "--load-format", "dummy", "--max-new-tokens", "5",
              "--no-stop-on-eos"], cache_dir)
    assert r.exit_code == 0, r.output
    assert "generated tokens 5" in r.output  # the summary line (stderr is mixed into output by the runner)


def test_generate_several_prompts_as_one_batch(cache_dir):
    r = _run(["generate", "one", "two", "three", "--model", "tiny-gpt2", "--load-format", "dummy",
              "--max-new-tokens", "3", "--no-stop-on-eos"], cache_dir)
    assert r.exit_code == 0, r.output
    assert "=== [0] one" in r.output and "=== [2] three" in r.output and "generated tokens 9" in r.output


BAD = [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "tiny-llama", "--load-format", "dummy", "--max-new-tokens", "0"], "--max-new-tokens must be"),
    (["--model", "tiny-llama", "--load-format", "dummy", "--temperature", "-1"], "--temperature must be >= 0"),
    (["--model", "tiny-llama", "--load-format", "dummy", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--model", "tiny-llama", "--load-format", "dummy", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--model", "tiny-llama", "--load-format", "dummy", "--top-k", "-1"], "--top-k must be"),
    (["--model", "tiny-llama", "--load-format", "dummy", "--dtype", "float8"], "--dtype must be one of"),
    (["--model", "org/some-model"], "hub"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_user_errors_are_one_clear_line(cache_dir, args, message):
    r = _run(["generate", "Hello", *args], cache_dir)
    assert r.exit_code != 0
    assert message in r.output, r.output
    assert "Traceback" not in r.output


def test_prompt_longer_than_context(cache_dir):
    r = _run(["generate", "word " * 600, "--model", "tiny-llama", "--load-format", "dummy"], cache_dir)
    assert r.exit_code != 0 and "context is 512" in r.output and "Traceback" not in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_without_cuda(cache_dir):
    r = _run(["generate", "Hello", "--model", "tiny-llama", "--load-format", "dummy", "--device", "cuda"], cache_dir)
    assert r.exit_code != 0 and "no CUDA GPU" in r.output and "--device cpu" in r.output


def test_corrupt_weights(cache_dir, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, '
                                          '"num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 100}')
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00not a safetensors file")
    import shutil
    from pathlib import Path

    tok_dir = Path(cache_dir) / "tokenizers" / "smollm2"
    if tok_dir.is_dir():
        for f in tok_dir.iterdir():
            shutil.copy(f, tmp_path / f.name)
    r = _run(["generate", "Hello", "--model", str(tmp_path), "--no-chat"], cache_dir)
    assert r.exit_code != 0 and "corrupt" in r.output and "Traceback" not in r.output


def test_directory_without_config(cache_dir, tmp_path):
    r = _run(["generate", "Hello", "--model", str(tmp_path)], cache_dir)
    assert r.exit_code != 0 and "no config.json" in r.output
