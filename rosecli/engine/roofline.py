"""Decode's floor: the bytes a decode step must read, and the device's read ceiling.

A decode step reads every weight and the batch's KV cache once, so (bytes per step) / (the
device's read rate) is a floor no engine can beat. docs/bench-metrics.md ("Distance to the
floor") defines the figures the benchmarks build from these.

Bytes per decode step (`DecodeBytes`), each tensor in its own dtype:

- weights: every parameter once, except the embedding tables (token and position), of which a
  step reads only the rows it looks up: one row of each per sequence. The logits GEMM reads the
  output layer in full: an untied ``lm_head`` is a parameter like any other; a tied one is the
  token embedding, counted in full for it (its looked-up rows count as well). Where the output
  layer's rows are padded (``model.logits_weight``, `models.common.vocab_padding`), the GEMM
  reads the padded tensor: it is counted instead, padding rows included.
- KV: each sequence reads K and V of its whole context (its new token included) in every layer:
  2 x layers x kv_heads x head_dim x KV dtype bytes x the sum of the batch's context lengths.

Not counted: activations, the logits the step writes and sampling reads, rotary tables, block
tables, and the writes of the new tokens' K and V. A sliding-window layer is counted at the whole
context (what it reads at most).

The read ceiling (`read_ceiling`): the best rate of a plain streaming read over a large buffer
(`rosecli.kernels.stream_read`, as scripts/bench_kernels.py's read floor), measured once per
device and cached in ``<cache root>/read-ceiling.json`` under a key of the device name, driver,
torch and CUDA versions (a new driver or torch measures again).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from rosecli.engine.kv_cache import kv_bytes_per_block

CEILING_FILE = "read-ceiling.json"
READ_BYTES = 2 << 30  # the buffer the ceiling streams over, at most (a quarter of the free memory at most)
READ_ROUNDS = 5  # rounds of READ_CALLS back-to-back reads; the best round counts
READ_CALLS = 10
READ_PROGRAMS = 1024


@dataclass(frozen=True)
class DecodeBytes:
    """What a decode step reads, in bytes (see the module's docstring)."""

    weight_bytes: int  # read once per step, whatever the batch (the logits GEMM's included)
    row_bytes: int  # embedding rows each sequence of the batch looks up
    kv_bytes_per_token: int  # K and V of one context token over all layers

    def total(self, steps: int, sequences: int, context_tokens: int) -> int:
        """Bytes of ``steps`` decode steps that decoded ``sequences`` sequences (summed over the
        steps) holding ``context_tokens`` tokens of context (summed likewise)."""
        return steps * self.weight_bytes + sequences * self.row_bytes + context_tokens * self.kv_bytes_per_token

    def as_dict(self) -> dict:
        return {"weight_bytes_per_step": self.weight_bytes, "embedding_row_bytes": self.row_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def decode_bytes(model: nn.Module, kv_dtype: torch.dtype) -> DecodeBytes:
    """`DecodeBytes` of ``model`` (its parameters' own dtypes) with a KV cache of ``kv_dtype``."""
    tables = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    table_ids = {id(w) for w in tables}
    weights = sum(_nbytes(p) for p in model.parameters() if id(p) not in table_ids)
    head = getattr(model, "lm_head", None)
    padded = getattr(model, "logits_weight", None)  # the output rows padded: what the logits GEMM reads
    if head is None:  # tied: the logits GEMM reads the token embedding in full
        weights += _nbytes(model.output_embedding() if padded is None else padded)
    elif padded is not None and isinstance(head, nn.Linear):  # its weight, counted above: the padded rows'
        weights += _nbytes(padded) - _nbytes(head.weight)
    rows = sum(w.shape[1] * w.element_size() for w in tables)
    return DecodeBytes(weights, rows, kv_bytes_per_block(model, 1, kv_dtype))


# --- the device's read ceiling -----------------------------------------------------------------------


@dataclass(frozen=True)
class ReadCeiling:
    gbs: float  # GB/s (1e9 bytes per second)
    key: str  # the device, driver and versions it was measured with
    cached: bool  # read from the cache (False: measured now)


def _driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML: the CUDA driver API's version (e.g. 12080) is what torch can tell
        get = getattr(torch._C, "_cuda_getDriverVersion", None)
        try:
            return f"cuda driver api {get()}" if get is not None else "unknown"
        except Exception:
            return "unknown"


def device_key(device: torch.device) -> str:
    """What a cached ceiling is valid for: the device's name, the driver, torch and its CUDA."""
    return (f"{torch.cuda.get_device_name(device)} | driver {_driver_version()} | torch {torch.__version__} | "
            f"cuda {torch.version.cuda}")


def measure_read_gbs(device: torch.device, max_bytes: int = READ_BYTES, rounds: int = READ_ROUNDS,
                     calls: int = READ_CALLS) -> float:
    """The best rate (GB/s) of a streaming read of a buffer of up to ``max_bytes`` (and a quarter of
    the free device memory at most): ``rounds`` rounds of ``calls`` back-to-back reads timed with
    CUDA events; the fastest round counts."""
    from rosecli.kernels.stream_read import BLOCK, stream_read_sum

    free, _ = torch.cuda.mem_get_info(device)
    piece = BLOCK * 2  # float16: one block per program at least
    nbytes = min(max_bytes, free // 4) // (READ_PROGRAMS * piece) * (READ_PROGRAMS * piece)
    if nbytes < 64 << 20:
        raise RuntimeError(f"only {free >> 20} MiB of device memory is free: too little to measure its read rate")
    x = torch.ones(nbytes // 2, dtype=torch.float16, device=device)
    out = torch.empty(READ_PROGRAMS, dtype=torch.float32, device=device)
    try:
        stream_read_sum(x, out)  # compiles
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best_ms = float("inf")
        for _ in range(rounds):
            start.record()
            for _ in range(calls):
                stream_read_sum(x, out)
            end.record()
            end.synchronize()
            best_ms = min(best_ms, start.elapsed_time(end) / calls)
    finally:
        del x, out
        torch.cuda.empty_cache()
    return nbytes / (best_ms * 1e-3) / 1e9


def _load(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def read_ceiling(key: str, cache_root: Path, measure: Callable[[], float]) -> ReadCeiling:
    """The ceiling cached for ``key`` in ``cache_root``, else ``measure()`` now and cache it (a cache
    that cannot be read is measured again and rewritten; one that cannot be written is left as it is)."""
    path = Path(cache_root) / CEILING_FILE
    entries = _load(path)
    entry = entries.get(key)
    gbs = entry.get("read_gbs") if isinstance(entry, dict) else None
    if isinstance(gbs, (int, float)) and not isinstance(gbs, bool) and 0 < gbs < float("inf"):
        return ReadCeiling(float(gbs), key, cached=True)
    gbs = float(measure())
    if not 0 < gbs < float("inf"):
        raise RuntimeError(f"the read ceiling measured {gbs} GB/s")
    entries[key] = {"read_gbs": gbs, "measured": datetime.datetime.now(datetime.timezone.utc)
                    .isoformat(timespec="seconds"), "method": "rosecli.kernels.stream_read, best of "
                    f"{READ_ROUNDS} rounds of {READ_CALLS} reads"}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, path)
    except OSError:  # the next run measures again
        with contextlib.suppress(OSError):
            tmp.unlink()
    return ReadCeiling(gbs, key, cached=False)


def device_read_ceiling(device: torch.device, cache_root: Path,
                        on_measure: Optional[Callable[[str], None]] = None) -> Optional[ReadCeiling]:
    """The read ceiling of a CUDA ``device`` (cached, see `read_ceiling`); None on any other device.
    ``on_measure(key)`` is called before a measurement (not when the cache has it)."""
    if device.type != "cuda":
        return None
    key = device_key(device)

    def measure() -> float:
        if on_measure is not None:
            on_measure(key)
        return measure_read_gbs(device)

    return read_ceiling(key, cache_root, measure)
