"""Result files (`--save-result FILE.json`) and their comparison (`rose bench compare`).

Schema ``rosecli.bench/1`` (a JSON object):
- ``schema``: "rosecli.bench/1"
- ``kind``: "stream" | "sched"
- ``command``: the rose command line
- ``config``: every option of the run (engine, workload, sampling)
- ``environment``: gpu, torch, triton, transformers, python, platform, rosecli commit, time
- ``startup``: seconds spent before any run (model_load_s, compile_s, graph_capture_s)
- ``runs``: one object per run, in order, with ``warmup`` (bool), ``label`` and ``figures``:
  flat figure names to values, times in seconds, rates in tokens/s
  (stream: throughput_completion, throughput_total, ttft_p50 ... latency_p99, see
  ``metrics.flatten``; sched: decode_s, total_s, throughput_decode, throughput_total, ttft_p50,
  tpot_p50, latency_p50)
- ``summary``: the median over measured runs of each figure
- ``requests``: per measured run, raw per-request timestamps relative to the run's first
  submit (stream only): prompt_tokens, output_tokens, submit, first_token, finish, token_times
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from rosecli.bench.metrics import percentile
from rosecli.engine.errors import ConfigError

SCHEMA = "rosecli.bench/1"


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                                       text=True, timeout=5).stdout.strip() or None
    except Exception:
        env["commit"] = None
    return env


def save_result(path: str, kind: str, config: dict, startup: dict, runs: list[dict], summary: dict,
                requests: Optional[list] = None) -> None:
    doc = {"schema": SCHEMA, "kind": kind, "command": " ".join(["rose", *sys.argv[1:]]), "config": config,
           "environment": environment(), "startup": startup, "runs": runs, "summary": summary,
           "requests": requests or []}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def load_result(path: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read result file {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not a JSON result file: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else None
        raise ConfigError(f"{path} has schema {got!r}; this rose reads {SCHEMA!r} result files")
    return doc


# Figures where a larger value is better; every other figure is a time (smaller is better).
HIGHER_IS_BETTER = ("throughput_completion", "throughput_total", "throughput_decode")


@dataclass
class CompareRow:
    figure: str
    base: float
    other: float
    change: float
    percent: float
    verdict: str  # "better" | "worse" | "noise" | "same" | "n/a"


def _spread(doc: dict, figure: str) -> Optional[float]:
    vals = [r["figures"].get(figure) for r in doc["runs"] if not r.get("warmup")]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return max(vals) - min(vals) if len(vals) >= 2 else None


def compare(base: dict, other: dict) -> list[CompareRow]:
    """Each summary figure of ``other`` against ``base``. A change smaller than the larger
    spread (max - min) of that figure over either file's measured runs is marked noise; with
    fewer than two measured runs in both, the spread is unknown and the verdict is n/a."""
    rows = []
    for fig, b in base["summary"].items():
        o = other["summary"].get(fig)
        if not isinstance(b, (int, float)) or not isinstance(o, (int, float)):
            continue
        change = o - b
        pct = 100.0 * change / b if b else float("nan")
        spreads = [s for s in (_spread(base, fig), _spread(other, fig)) if s is not None]
        if change == 0:
            verdict = "same"
        elif not spreads:
            verdict = "n/a"
        elif abs(change) <= max(spreads):
            verdict = "noise"
        else:
            better = change > 0 if fig in HIGHER_IS_BETTER else change < 0
            verdict = "better" if better else "worse"
        rows.append(CompareRow(fig, b, o, change, pct, verdict))
    return rows


def median_of(values: list[float]) -> float:
    return percentile(values, 50)
