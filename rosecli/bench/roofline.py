"""Every GPU benchmark run's distance to the floor: the bytes its decode steps read, the rate they
read them at, and that rate's share of the device's read ceiling (docs/bench-metrics.md).

The counts come from the engine (`ModelRunner.decode_counts`: decode steps launched, sequences
decoded, their context tokens; `StreamingManager.decode_s` or `bench sched`'s decode time), read
before and after a run; the bytes from `rosecli.engine.roofline.DecodeBytes`. `bench serve` reads
the same counts from a rose server's ``GET /roofline`` before and after each run; another server
has none and gets no figures.

Per run (`DecodeRoofline.figures`, flat keys of the result file):

- ``decode_bytes_per_step``: bytes the run's decode steps read / decode steps (weights + KV)
- ``decode_kv_bytes_per_step``: the KV cache's part of it
- ``decode_step_time``: decode time / decode steps (s)
- ``decode_read_gbs``: bytes / decode time (GB/s, 1e9 bytes/s)
- ``roofline_share``: decode_read_gbs / the device's read ceiling (1.0 = at the floor)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

FIGURES = ("decode_bytes_per_step", "decode_kv_bytes_per_step", "decode_step_time", "decode_read_gbs",
           "roofline_share")


@dataclass
class DecodeRoofline:
    steps: int  # decode steps of the run
    bytes: int  # what they read (weights + KV)
    kv_bytes: int  # the KV cache's part
    seconds: float  # decode time
    ceiling_gbs: float  # the device's read ceiling

    @property
    def bytes_per_step(self) -> float:
        return self.bytes / self.steps if self.steps else float("nan")

    @property
    def step_s(self) -> float:
        return self.seconds / self.steps if self.steps else float("nan")

    @property
    def gbs(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")

    @property
    def share(self) -> float:
        return self.gbs / self.ceiling_gbs if self.ceiling_gbs > 0 else float("nan")

    def figures(self) -> dict[str, float]:
        return {"decode_bytes_per_step": self.bytes_per_step,
                "decode_kv_bytes_per_step": self.kv_bytes / self.steps if self.steps else float("nan"),
                "decode_step_time": self.step_s, "decode_read_gbs": self.gbs, "roofline_share": self.share}


def of_counts(weights: dict, before: dict, after: dict, seconds: float, ceiling_gbs: float) -> Optional[DecodeRoofline]:
    """The figures of the decode steps between two snapshots of the counts (``decode_steps``,
    ``decode_sequences``, ``decode_context_tokens``); ``weights``: `DecodeBytes.as_dict`. None
    when no decode step ran."""
    steps = after["decode_steps"] - before["decode_steps"]
    if steps <= 0:
        return None
    seqs = after["decode_sequences"] - before["decode_sequences"]
    kv = (after["decode_context_tokens"] - before["decode_context_tokens"]) * weights["kv_bytes_per_token"]
    total = steps * weights["weight_bytes_per_step"] + seqs * weights["embedding_row_bytes"] + kv
    return DecodeRoofline(steps, total, kv, seconds, ceiling_gbs)


def _counts(runner) -> dict:
    return dict(zip(("decode_steps", "decode_sequences", "decode_context_tokens"), runner.decode_counts()))


class EngineProbe:
    """Counts of one in-process engine (`bench stream`, `bench sched`) with its read ceiling."""

    def __init__(self, engine, ceiling_gbs: float):
        from rosecli.engine.roofline import decode_bytes

        self.runner = engine.runner
        self.weights = decode_bytes(engine.loaded.model, engine.dtype).as_dict()
        self.ceiling_gbs = ceiling_gbs

    def snapshot(self, manager=None) -> dict:
        """The counts now, with ``decode_s`` of ``manager`` (a StreamingManager) when given."""
        snap = _counts(self.runner)
        if manager is not None:
            snap["decode_s"] = manager.decode_s
        return snap

    def between(self, before: dict, after: dict, seconds: Optional[float] = None) -> Optional[DecodeRoofline]:
        """The run between two snapshots; ``seconds``: its decode time (default: the managers' decode_s
        difference)."""
        if seconds is None:
            seconds = after["decode_s"] - before["decode_s"]
        return of_counts(self.weights, before, after, seconds, self.ceiling_gbs)


def engine_probe(engine, log=None) -> Optional[EngineProbe]:
    """On a CUDA engine, its probe with the device's read ceiling (measured once per device and
    cached under the engine's cache root; ``log(message)`` says so when it measures); else None:
    no figures and no cost on CPU."""
    if engine.device.type != "cuda":
        return None
    from rosecli.engine.config import cache_root
    from rosecli.engine.roofline import device_read_ceiling

    def note(key: str) -> None:
        if log is not None:
            log(f"measuring the read ceiling of {key} (once; cached in {cache_root(engine.config)})")

    try:
        ceiling = device_read_ceiling(engine.device, cache_root(engine.config), note)
    except Exception as e:  # the benchmark runs without the figures rather than not at all
        if log is not None:
            log(f"note: the device's read ceiling was not measured ({type(e).__name__}: {e}): no roofline figures")
        return None
    return EngineProbe(engine, ceiling.gbs)


# --- bench serve: a rose server's counts over HTTP ---------------------------------------------------

ROOFLINE_PATH = "/roofline"


def server_stats(base_url: str, headers: dict, timeout: float = 10.0) -> Optional[dict]:
    """``GET /roofline`` of a rose server: None when the server has none (another server) or its
    device has no read ceiling (CPU)."""
    import httpx

    try:
        with httpx.Client(timeout=timeout) as client:
            r = client.get(f"{base_url}{ROOFLINE_PATH}", headers=headers)
        doc = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    need = ("read_ceiling_gbs", "weight_bytes_per_step", "embedding_row_bytes", "kv_bytes_per_token",
            "decode_steps", "decode_sequences", "decode_context_tokens", "decode_s")
    if not all(isinstance(doc.get(k), (int, float)) and not isinstance(doc.get(k), bool) for k in need):
        return None
    return doc


def server_between(before: Optional[dict], after: Optional[dict]) -> Optional[DecodeRoofline]:
    if before is None or after is None:
        return None
    return of_counts(after, before, after, after["decode_s"] - before["decode_s"], after["read_ceiling_gbs"])


# --- report lines --------------------------------------------------------------------------------------


def _ok(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def line(figures: dict, ceiling_gbs: Optional[float] = None) -> Optional[str]:
    """``Decode roofline: 2471.3 MB/step (KV 71.3 MB), 1.940 ms/step, 1273.9 GB/s = 42.8% of the read
    ceiling (2975 GB/s)`` from flat figures; None without them."""
    b, kv, t, gbs, share = (figures.get(k) for k in FIGURES)
    if not _ok(b) or not _ok(gbs):
        return None
    out = f"Decode roofline: {b / 1e6:.1f} MB/step"
    if _ok(kv):
        out += f" (KV {kv / 1e6:.1f} MB)"
    if _ok(t):
        out += f", {t * 1e3:.3f} ms/step"
    out += f", {gbs:.1f} GB/s"
    if _ok(share):
        out += f" = {share * 100:.1f}% of the read ceiling"
        if _ok(ceiling_gbs):
            out += f" ({ceiling_gbs:.0f} GB/s)"
    return out
