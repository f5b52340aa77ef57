"""The README's "On CPU" commands run as written, so the README cannot go stale.

The block is run by bash, line for line, in a fresh directory, with `rose` on PATH as this
checkout's `python -m rosecli` and the session's model cache (ROSE_CACHE_DIR). One substitution:
the port 8000 becomes a free one, so the test cannot collide with a server already running.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def cpu_block() -> str:
    """The first ```bash block of the README's "## On CPU" section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## On CPU\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert blocks, "the README's On CPU section has no bash block"
    return blocks[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_block_covers_every_command_and_no_gpu_flag():
    lines = [line for line in cpu_block().splitlines() if line.strip()]
    commands = {m.group(1) for line in lines for m in [re.search(r"\brose ((?:bench )?[a-z-]+)", line)] if m}
    assert commands >= {"--version", "generate", "chat", "serve-local", "profile", "bench stream", "bench sched",
                        "bench serve", "bench compare"}, commands
    assert not any("--device cuda" in line or "--nvtx" in line for line in lines)


def test_readme_cpu_commands_run_as_written(cache_dir, tmp_path):
    pytest.importorskip("fastapi")  # rose serve-local needs the serve extras
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    rose = bin_dir / "rose"
    rose.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m rosecli "$@"\n')
    rose.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    script = "set -euo pipefail\n" + cpu_block().replace("8000", str(_free_port()))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT),
           "ROSE_CACHE_DIR": cache_dir, "COLUMNS": "80"}
    proc = subprocess.Popen(["bash", "-c", script], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=540)
    finally:
        try:  # a background server left by a failing line
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-6000:]
    assert "Traceback" not in out, out[-6000:]
    for marker in ("rosecli ", "torch ", "first byte", "TTFT p50/p95/p99:", "=== compare: baseline batch4.json",
                   "=== online summary ===", "Host time per stage", "Serving Benchmark Result"):
        assert marker in out, (marker, out[-6000:])
    assert (work / "batch4.json").is_file() and (work / "batch1.json").is_file()
