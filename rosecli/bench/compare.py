"""Compare result documents (`results.load_result`) figure by figure: ``rose bench compare``.

    rows = compare_results([baseline_doc, other_doc, ...])
    diffs = config_differences([baseline_doc, other_doc, ...])

For each summary figure (the median over measured runs) a `CompareRow` holds the baseline
value and, per other document, a `CompareCell`: value, change (other - baseline), percent
(change / baseline * 100) and a verdict:

- ``noise``: |change| is smaller than the spread between repeat runs, where spread = max - min
  of that figure over the measured runs, the larger of the two documents' spreads. A
  document with one measured run has no spread; when neither has one the change is not
  judged (``n/a``).
- ``better`` / ``worse``: outside the spread, by the figure's direction: throughput up is
  better, every time figure (TTFT, TPOT, ITL, latency, waits, wall) down is better.
- ``same``: no change; ``missing``: the figure is absent (null) in one of the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from rosecli.bench.metrics import FIGURE_LABELS, SERVE_LABELS
from rosecli.engine.errors import ConfigError

# The first figures, in this order; the others follow in the baseline's order.
_FIRST = ("throughput_completion", "throughput_total", "throughput_decode", "decode_s", "total_s", "ttft_p50",
          "ttft_p95", "ttft_p99", "tpot_p50", "tpot_p95", "tpot_p99", "itl_p50", "itl_p95", "itl_p99",
          "latency_p50", "latency_p95", "latency_p99")
_RATE_LABELS = {"throughput_completion": "Throughput (completion)", "throughput_total": "Throughput (total)",
                "throughput_decode": "Throughput (completion,decode)",
                "throughput_direct": "Throughput (scheduler directly)"}
_SECONDS_LABELS = {"wall_s": "Wall", "submit_wall_s": "Submit wall", "decode_s": "Decode time",
                   "total_s": "Total time", "prefill_s": "Prefill time"}


# Kinds whose figures mean the same things and may be compared: bench stream (in process) and
# bench serve (over HTTP) both report TTFT, TPOT, ITL, latency and token throughput.
COMPARABLE = ({"stream", "serve"},)
_REQUEST_RATES = {"throughput_requests": "Request throughput", "throughput_goodput": "Request goodput",
                  "throughput_achieved_rate": "Request rate achieved"}


def comparable(kinds: set) -> bool:
    return len(kinds) <= 1 or any(kinds <= group for group in COMPARABLE)


def higher_is_better(figure: str) -> bool:
    return figure.startswith("throughput") or figure == "goodput_share"


def unit_of(figure: str) -> str:
    """Display unit: "tokens/s" for rates, "s" for whole-run times, "ms" for per-request times."""
    if figure in _REQUEST_RATES:
        return "req/s"
    if figure == "goodput_share":
        return "share"
    if higher_is_better(figure):
        return "tokens/s"
    return "s" if figure in _SECONDS_LABELS else "ms"


def label_of(figure: str) -> str:
    """``ttft_p99`` -> ``TTFT p99``; ``throughput_total`` -> ``Throughput (total)``."""
    if figure in _RATE_LABELS:
        return _RATE_LABELS[figure]
    if figure in _REQUEST_RATES:
        return _REQUEST_RATES[figure]
    if figure == "throughput_peak_output":
        return "Peak output throughput (1 s)"
    if figure == "goodput_share":
        return "Requests meeting every SLO"
    if figure in _SECONDS_LABELS:
        return _SECONDS_LABELS[figure]
    name, _, stat = figure.rpartition("_")
    return f"{FIGURE_LABELS.get(name, SERVE_LABELS.get(name, name))} {stat}" if name else figure


@dataclass
class CompareCell:
    value: Optional[float]
    change: Optional[float]  # value - baseline
    percent: Optional[float]  # change / baseline * 100 (None when the baseline is 0 or absent)
    spread: Optional[float]  # the noise threshold used (None: no repeat runs in either file)
    verdict: str  # "better" | "worse" | "noise" | "same" | "n/a" | "missing"


@dataclass
class CompareRow:
    figure: str  # flat key, e.g. "ttft_p99"; values in seconds or tokens/s
    label: str  # "TTFT p99"
    unit: str  # display unit: "ms" | "s" | "tokens/s"
    higher_is_better: bool
    base: Optional[float]
    cells: list[CompareCell] = field(default_factory=list)  # one per other document, in order


def _num(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def spread(doc: dict, figure: str) -> Optional[float]:
    """max - min of ``figure`` over the measured runs of ``doc``; None with fewer than two."""
    vals = [_num(r.get("figures", {}).get(figure)) for r in doc["runs"] if not r.get("warmup")]
    vals = [v for v in vals if v is not None]
    return max(vals) - min(vals) if len(vals) >= 2 else None


def _cell(base_doc: dict, doc: dict, figure: str, base: Optional[float]) -> CompareCell:
    value = _num(doc["summary"].get(figure))
    if base is None or value is None:
        return CompareCell(value, None, None, None, "missing")
    change = value - base
    percent = 100.0 * change / base if base != 0 else None
    spreads = [s for s in (spread(base_doc, figure), spread(doc, figure)) if s is not None]
    noise = max(spreads) if spreads else None
    if change == 0:
        verdict = "same"
    elif noise is None:
        verdict = "n/a"
    elif abs(change) < noise:
        verdict = "noise"
    else:
        verdict = "better" if (change > 0) == higher_is_better(figure) else "worse"
    return CompareCell(value, change, percent, noise, verdict)


def compare_results(docs: Sequence[dict]) -> list[CompareRow]:
    """One row per figure of the baseline ``docs[0]``'s summary; all documents must be of
    the same kind (ConfigError otherwise)."""
    if len(docs) < 2:
        raise ConfigError("compare needs at least two result files: the baseline first")
    kinds = {d["kind"] for d in docs}
    if not comparable(kinds):
        raise ConfigError(f"cannot compare results of different benchmarks ({', '.join(sorted(kinds))})")
    base_doc = docs[0]
    names = list(base_doc["summary"])
    order = [f for f in _FIRST if f in base_doc["summary"]] + [f for f in names if f not in _FIRST]
    rows = []
    for fig in order:
        base = _num(base_doc["summary"][fig])
        rows.append(CompareRow(fig, label_of(fig), unit_of(fig), higher_is_better(fig), base,
                               [_cell(base_doc, d, fig, base) for d in docs[1:]]))
    return rows


def config_differences(docs: Sequence[dict]) -> dict[str, list]:
    """Options and environment entries (GPU, versions, commit) whose values differ between the
    documents: key -> one value per document. A comparison across these is not like for like."""
    out: dict[str, list] = {}
    for section, skip in (("config", ()), ("environment", ("time", "platform"))):
        keys: list[str] = []
        for d in docs:
            keys += [k for k in d.get(section, {}) if k not in keys and k not in skip]
        for k in keys:
            vals = [d.get(section, {}).get(k) for d in docs]
            if any(v != vals[0] for v in vals[1:]):
                out[k if section == "config" else f"{section}.{k}"] = vals
    return out
