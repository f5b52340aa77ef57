"""Result files: ``--save-result FILE.json`` writes one, ``rose bench compare`` reads them.

Schema ``rosecli.bench/1``: one JSON object (documented also in docs/bench-results.md).
Times are seconds, rates tokens/s; a figure that could not be measured is ``null``.

- ``schema``: ``"rosecli.bench/1"``. A reader refuses any other value.
- ``kind``: ``"stream"`` | ``"sched"`` | ``"serve"`` (`rose bench serve`: measured by an HTTP/SSE
  client against a server; its ``config`` holds ``base_url``, ``endpoint``, ``model``, the
  dataset and load shape, its runs also ``counts``: requests, completed, failed, tokens,
  ``failure_kinds``; its ``requests`` entries: ``request_id``, ``prompt_tokens``,
  ``output_tokens``, ``asked_tokens``, ``success``, ``error_kind``, ``error``,
  ``usage_reported`` and the times ``scheduled``, ``dispatched``, ``start``, ``event_times``
  (each SSE event carrying a choice), relative to the run's start).
  ``"sweep"`` (`rose bench sweep`: ``points``, each with its own runs, summary and requests, and
  ``sweep``; see rosecli.bench.sweep).
- ``command``: the command line that produced it (``rose bench stream ...``).
- ``config``: every option of the run (engine, workload, sampling), name -> value.
- ``environment``: ``gpu`` (device name or null), ``gpu_count``, ``cuda`` (torch's CUDA
  version), ``torch``, ``triton``, ``transformers`` (versions or null), ``python``,
  ``platform``, with a GPU and NVML (pynvml) also ``gpu_sm_clock_mhz``, ``gpu_mem_clock_mhz``,
  ``gpu_max_sm_clock_mhz``, ``gpu_temperature_c``, ``gpu_power_limit_w``; ``commit`` (``git rev-parse HEAD`` of the rosecli checkout, null when not a
  git checkout), ``dirty`` (tracked files changed since that commit; null without git),
  ``time`` (UTC, ISO 8601).
- ``startup``: seconds spent before any run, e.g. ``model_load_s``, ``compile_s``,
  ``graph_capture_s``, ``prefill_graph_capture_s``; never part of a run's figures.
- ``runs``: every run in order, warm-ups first: ``{"label": "warmup 1/1", "warmup": true,
  "figures": {...}, "errors": [...]}``. Figures are flat keys: for stream
  ``metrics.flatten`` (``throughput_completion``, ``throughput_total``, ``wall_s``,
  ``submit_wall_s``, ``ttft_p50`` ... ``latency_mean``); for sched
  ``metrics.SCHED_FIGURES`` (``decode_s``, ``total_s``, ``prefill_s``,
  ``throughput_decode``, ``throughput_total``, ``ttft_p50`` ...).
- ``summary``: over the measured runs (``warmup`` false): the median of each figure.
- ``requests``: one list per measured run (in run order), one object per request:
  ``request_id``, ``prompt_tokens``, ``output_tokens``, ``finish_reason``, ``chunk_tokens``
  and the timestamps ``scheduled_submit``, ``submit``, ``add_request_done``, ``tokenized``,
  ``admitted``, ``first_token``, ``finish``, ``token_times`` (each chunk's receive time) in
  seconds relative to that run's start (its first submit).

API:
    doc = build_result(kind, config, startup, runs, summary, requests=None, command=None)
    save_result(path, kind, config, startup, runs, summary, requests=None, command=None) -> doc
    check_result_path(path)             # raises ConfigError when --save-result cannot be written
    load_result(path) -> doc            # raises ConfigError on unreadable file / unknown schema
    run_record(label, warmup, metrics, errors=None) -> dict      # one entry of "runs"
    request_records(timings, t0) -> list[dict]                    # one entry of "requests"
    environment() -> dict
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from typing import Optional, Sequence, Union

from rosecli.bench.metrics import RequestTiming, RunMetrics, SchedRunMetrics, flatten, median_figures, sched_figures
from rosecli.engine.errors import ConfigError

SCHEMA = "rosecli.bench/1"
KINDS = ("stream", "sched", "serve", "sweep")  # sweep: `rose bench sweep` (rosecli.bench.sweep)
_TIMESTAMPS = ("scheduled_submit", "submit", "add_request_done", "tokenized", "admitted", "first_token", "finish")


def _git(args: list[str], cwd: str) -> Optional[str]:
    try:
        p = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def _checkout() -> tuple[Optional[str], Optional[bool]]:
    """Commit and dirty flag of the git checkout rosecli runs from; (None, None) when the
    package is not in one (an installed copy inside some other repository does not count)."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../rosecli
    top = _git(["rev-parse", "--show-toplevel"], pkg)
    if top is None or os.path.realpath(os.path.join(top, "rosecli")) != os.path.realpath(pkg):
        return None, None
    commit = _git(["rev-parse", "HEAD"], pkg)
    status = _git(["status", "--porcelain", "--untracked-files=no"], pkg)
    return commit, (None if status is None else bool(status))


def _nvml() -> dict:
    """GPU 0's clocks (MHz), temperature (C) and power limit (W) through NVML, when pynvml (or
    nvidia-ml-py) is installed and answers; {} otherwise. A throttled or hot GPU explains a change."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    out = {}
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        reads = {"gpu_sm_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                 "gpu_mem_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                 "gpu_max_sm_clock_mhz": lambda: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                 "gpu_temperature_c": lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                 "gpu_power_limit_w": lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000}
        for k, read in reads.items():
            with contextlib.suppress(Exception):
                out[k] = read()
    except Exception:
        pass
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return out


def environment() -> dict:
    """Where the figures were taken. Imports torch (only here) for the GPU and versions."""
    import torch

    env: dict = {"gpu": None, "gpu_count": 0, "cuda": torch.version.cuda, "torch": torch.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_count"] = torch.cuda.device_count()
        env.update(_nvml())
    try:
        env["triton"] = __import__("triton").__version__
    except Exception:  # absent or broken: the version is unknown, not an error
        env["triton"] = None
    try:  # read from its metadata: importing transformers costs about a second
        env["transformers"] = importlib.metadata.version("transformers")
    except Exception:
        env["transformers"] = None
    env["python"] = platform.python_version()
    env["platform"] = platform.platform()
    env["commit"], env["dirty"] = _checkout()
    env["time"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return env


def run_record(label: str, warmup: bool, metrics: Union[RunMetrics, SchedRunMetrics],
               errors: Optional[list[str]] = None) -> dict:
    """One entry of ``runs``."""
    figures = flatten(metrics) if isinstance(metrics, RunMetrics) else sched_figures(metrics)
    return {"label": label, "warmup": bool(warmup), "figures": figures, "errors": list(errors or [])}


def request_records(timings: Sequence[RequestTiming], t0: float) -> list[dict]:
    """Raw per-request timestamps of one run, relative to ``t0`` (the run's start)."""
    out = []
    for t in timings:
        rec = {"request_id": t.request_id, "prompt_tokens": t.prompt_tokens, "output_tokens": t.output_tokens,
               "finish_reason": t.finish_reason}
        for k in _TIMESTAMPS:
            v = getattr(t, k)
            rec[k] = None if v is None else v - t0
        rec["token_times"] = [x - t0 for x in t.token_times]
        rec["chunk_tokens"] = list(t.chunk_tokens)
        out.append(rec)
    return out


def _finite(obj):
    """NaN/inf -> None, so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def build_result(kind: str, config: dict, startup: dict, runs: list[dict], summary: Optional[dict] = None,
                 requests: Optional[list] = None, command: Optional[str] = None,
                 env: Optional[dict] = None) -> dict:
    """The result document (see the module docstring). ``summary`` defaults to the median of each
    figure over the measured runs (`metrics.median_figures`);
    ``command`` to this process's command line; ``env`` to `environment()`."""
    if kind not in KINDS:
        raise ConfigError(f"result kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return _finite({
        "schema": SCHEMA, "kind": kind, "command": command or " ".join(["rose", *sys.argv[1:]]),
        "config": config, "environment": env if env is not None else environment(), "startup": startup,
        "runs": runs, "summary": summary if summary is not None else
        median_figures([r["figures"] for r in runs if not r.get("warmup")]), "requests": requests or []})


def save_result(path: str, kind: str, config: dict, startup: dict, runs: list[dict], summary: Optional[dict] = None,
                requests: Optional[list] = None, command: Optional[str] = None, env: Optional[dict] = None) -> dict:
    """Write the result document to ``path`` (atomically) and return it."""
    doc = build_result(kind, config, startup, runs, summary, requests, command, env)
    write_document(path, doc)
    return doc


def write_document(path: str, doc: dict) -> None:
    """Write a result document to ``path`` atomically (ConfigError when it cannot be written)."""
    check_result_path(path)
    tmp = f"{path}.tmp"
    left = False  # a temporary file of ours that is not moved into place is removed, never left behind
    try:
        with open(tmp, "w") as f:
            left = True
            json.dump(doc, f, indent=1, default=str, allow_nan=False)
        os.replace(tmp, path)
        left = False
    except OSError as e:
        raise ConfigError(f"--save-result: cannot write {path}: {e.strerror}") from None
    finally:
        if left:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def check_result_path(path: str) -> None:
    """Refuse a --save-result path that cannot be written, before any benchmark runs."""
    if not path.strip():
        raise ConfigError("--save-result needs a file name, got an empty one: pass e.g. --save-result result.json")
    if os.path.isdir(path):
        raise ConfigError(f"--save-result {path} is a directory: pass a file name, e.g. "
                          f"{os.path.join(path, 'result.json')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"--save-result {path}: the directory {parent} does not exist: create it or pass "
                          "another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"--save-result {path} is not writable: pass a path you can write to")


def load_result(path: str) -> dict:
    """Read and check a result file; ConfigError names the file and the problem."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read result file {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not a JSON result file: {e}") from None
    got = doc.get("schema") if isinstance(doc, dict) else None
    if got != SCHEMA:
        raise ConfigError(f"{path} has schema {got!r}; this rose reads {SCHEMA!r} result files "
                          "(written by rose bench ... --save-result)")
    if doc.get("kind") not in KINDS or not isinstance(doc.get("runs"), list) or not isinstance(doc.get("summary"), dict):
        raise ConfigError(f"{path}: schema {SCHEMA} file without a valid kind, runs list or summary")
    for section in ("config", "environment", "startup"):
        if not isinstance(doc.get(section, {}), dict):
            raise ConfigError(f"{path}: {section!r} is not an object: the file is damaged, save the result again")
    for i, run in enumerate(doc["runs"]):
        if not isinstance(run, dict) or not isinstance(run.get("figures", {}), dict):
            raise ConfigError(f"{path}: run {i} is not an object with a figures object: the file is damaged, "
                              "save the result again")
    return doc
