"""Workloads of `rose bench serve`: what each HTTP request asks for, and when it is sent.

Datasets (``--dataset``):

- ``random`` (default): ``--input-len`` random token ids per prompt and ``--output-len`` new
  tokens, each varying uniformly within +- ``--range-ratio`` (the lengths `bench stream`'s
  `WorkloadSpec` draws). On ``/v1/completions`` the prompt is sent as token ids, so the server
  sees exactly that many tokens; on ``/v1/chat/completions`` the ids are decoded to text
  (the server's count then differs a little, and its ``usage`` is what the report uses).
- ``sharegpt``: a ShareGPT-format JSON file given by ``--dataset-path`` (read locally; nothing
  is downloaded): a list of ``{"conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}, ...]}``. As vLLM: the first turn is the prompt, the second
  turn's length in tokens is the output length (``--output-len`` overrides it); pairs with
  fewer than 4 prompt or output tokens, a prompt over 1024 tokens or prompt + output over
  2048 are skipped; the rest are shuffled with ``--seed``.
- ``prefix``: ``--prefix-groups`` groups, each with its own shared prefix of ``--prefix-len``
  random tokens (a long system prompt), followed by a per-request suffix of ``--input-len``
  tokens: the workload for prefix caching. Requests are assigned to groups round robin, then
  shuffled. On chat endpoints the prefix is the system message and the suffix the user's.

Arrivals (`arrival_offsets`), as vLLM's ``get_request``: with ``--request-rate R`` the gaps
between requests are gamma-distributed with shape ``--burstiness`` B and scale 1/(R*B) (B = 1:
Poisson, exponential gaps; B < 1 burstier; B > 1 more even), drawn from ``--seed``, summed,
and rescaled so that the last request is due at exactly num_prompts / R. No rate (or
``inf``): every request is due at once.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from rosecli.engine.errors import ConfigError

DATASETS = ("random", "sharegpt", "prefix")
Prompt = Union[str, list[int], list[dict]]  # text, token ids, or chat messages

# vLLM's ShareGPT filter
_MIN_LEN, _MAX_PROMPT, _MAX_TOTAL = 4, 1024, 2048


@dataclass
class ServeRequest:
    prompt: Prompt  # completions: text or token ids; chat: a list of messages
    prompt_len: int  # tokens by the client's tokenizer (the server's usage figure replaces it)
    output_len: int  # max_tokens asked for


@dataclass
class ServeDataset:
    name: str = "random"
    path: Optional[str] = None
    num_prompts: int = 16
    input_len: int = 128
    output_len: Optional[int] = 128
    range_ratio: float = 0.0
    prefix_groups: int = 4
    prefix_len: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ConfigError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.name!r}")
        if self.num_prompts < 1:
            raise ConfigError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        for flag, v in (("--input-len", self.input_len), ("--output-len", self.output_len),
                        ("--prefix-groups", self.prefix_groups), ("--prefix-len", self.prefix_len)):
            if v is not None and v < 1:
                raise ConfigError(f"{flag} must be >= 1, got {v}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ConfigError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.name == "sharegpt" and not self.path:
            raise ConfigError("--dataset sharegpt needs --dataset-path FILE.json (a ShareGPT-format file; "
                              "nothing is downloaded)")
        if self.name != "sharegpt" and self.path:
            raise ConfigError(f"--dataset-path is read by --dataset sharegpt only (got --dataset {self.name})")
        if self.name != "sharegpt" and self.output_len is None:
            raise ConfigError(f"--dataset {self.name} needs --output-len")


def _lengths(mean: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)] if hi > lo else [mean] * n


def _vocab(tokenizer) -> int:
    return len(tokenizer) if tokenizer is not None else 32000


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    # ordinary ids: skip the first few (special tokens in most vocabularies)
    return rng.integers(16, max(17, vocab), size=n).tolist()


def _text(tokenizer, ids: list[int]) -> str:
    if tokenizer is None:
        raise ConfigError("a chat endpoint needs text prompts: pass --tokenizer (a local tokenizer directory) "
                          "to turn random token ids into text")
    return tokenizer.decode(ids, skip_special_tokens=True)


def _random(spec: ServeDataset, tokenizer, chat: bool, rng: np.random.Generator) -> list[ServeRequest]:
    n = spec.num_prompts
    ins = _lengths(spec.input_len, spec.range_ratio, n, rng)
    outs = _lengths(spec.output_len, spec.range_ratio, n, rng)
    vocab = _vocab(tokenizer)
    out = []
    for i, o in zip(ins, outs):
        ids = _ids(rng, i, vocab)
        prompt: Prompt = [{"role": "user", "content": _text(tokenizer, ids)}] if chat else ids
        out.append(ServeRequest(prompt, i, o))
    return out


def _prefix(spec: ServeDataset, tokenizer, chat: bool, rng: np.random.Generator) -> list[ServeRequest]:
    vocab = _vocab(tokenizer)
    prefixes = [_ids(rng, spec.prefix_len, vocab) for _ in range(spec.prefix_groups)]
    n = spec.num_prompts
    ins = _lengths(spec.input_len, spec.range_ratio, n, rng)
    outs = _lengths(spec.output_len, spec.range_ratio, n, rng)
    out = []
    for i in range(n):
        prefix, suffix = prefixes[i % spec.prefix_groups], _ids(rng, ins[i], vocab)
        if chat:
            prompt: Prompt = [{"role": "system", "content": _text(tokenizer, prefix)},
                              {"role": "user", "content": _text(tokenizer, suffix)}]
        else:
            prompt = prefix + suffix
        out.append(ServeRequest(prompt, len(prefix) + len(suffix), outs[i]))
    order = rng.permutation(n)
    return [out[j] for j in order]


def _sharegpt(spec: ServeDataset, tokenizer, chat: bool, rng: np.random.Generator) -> list[ServeRequest]:
    path = spec.path
    if tokenizer is None:
        raise ConfigError("--dataset sharegpt counts tokens on the client: pass --tokenizer")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"--dataset-path {path}: cannot read it: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"--dataset-path {path} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ConfigError(f"--dataset-path {path}: a ShareGPT file is a JSON list of conversations, "
                          f"got a {type(data).__name__}")
    pairs = []
    for entry in data:
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        first, second = conv[0], conv[1]
        if not (isinstance(first, dict) and isinstance(second, dict) and isinstance(first.get("value"), str)
                and isinstance(second.get("value"), str)):
            continue
        pairs.append((first["value"], second["value"]))
    if not pairs:
        raise ConfigError(f"--dataset-path {path}: no conversation with two turns "
                          '({"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]})')
    order = rng.permutation(len(pairs))
    out: list[ServeRequest] = []
    for j in order:
        prompt, completion = pairs[j]
        plen = len(tokenizer.encode(prompt, add_special_tokens=False))
        olen = spec.output_len if spec.output_len is not None else \
            len(tokenizer.encode(completion, add_special_tokens=False))
        if plen < _MIN_LEN or olen < _MIN_LEN or plen > _MAX_PROMPT or plen + olen > _MAX_TOTAL:
            continue
        out.append(ServeRequest([{"role": "user", "content": prompt}] if chat else prompt, plen, olen))
        if len(out) == spec.num_prompts:
            break
    if not out:
        raise ConfigError(f"--dataset-path {path}: every conversation was filtered out (prompt and answer need "
                          f"{_MIN_LEN}..{_MAX_PROMPT} tokens, together at most {_MAX_TOTAL})")
    while len(out) < spec.num_prompts:  # fewer usable conversations than prompts asked: reuse them in order
        out.append(out[len(out) % len(out)])
    return out


def build_requests(spec: ServeDataset, tokenizer, chat: bool) -> list[ServeRequest]:
    """The requests of one run (every run sends the same ones)."""
    if spec.path is not None and not os.path.isfile(spec.path):
        raise ConfigError(f"--dataset-path {spec.path} is not a file")
    rng = np.random.default_rng(spec.seed)
    return {"random": _random, "sharegpt": _sharegpt, "prefix": _prefix}[spec.name](spec, tokenizer, chat, rng)


def arrival_offsets(n: int, request_rate: Optional[float], burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each of ``n`` requests is due, seconds after the run's start (see the module doc)."""
    if not burstiness > 0:
        raise ConfigError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate is not None and not request_rate > 0:
        raise ConfigError(f"--request-rate must be > 0 requests/s (leave it out or pass inf for all at once), "
                          f"got {request_rate}")
    if request_rate is None or math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    due = np.cumsum(gaps)
    if due[-1] > 0:
        due *= (n / request_rate) / due[-1]
    return due.tolist()
