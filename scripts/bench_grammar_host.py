"""Host time of a grammar step (docs/structured-output.md, "Host time per grammar step"): 64
requests under a JSON schema, GPT-2's vocabulary; each step advances every matcher with its last
token (read back one step late, as under overlap scheduling) and fills the batch's bitmask rows, as
`StructuredOutput.mask_logits` does, with the CPU apply op left out (on a GPU it is a device kernel).
The tokens are random among those the grammar allows. With ``--compare-with TREE`` the
`rosecli/engine/structured.py` of another checkout runs interleaved with this one, step by step, on
the same tokens (before/after figures from one process).

    python scripts/bench_grammar_host.py [--schema FILE] [--steps 100] [--rows 64] [--compare-with /path/to/main]
"""

import argparse
import importlib.util
import pathlib
import statistics
import sys
import time

import numpy as np
import torch
import xgrammar

from rosecli.engine.config import EngineConfig
from rosecli.engine.llm import LLMEngine

ROOT = pathlib.Path(__file__).resolve().parent.parent
PENDING = -1


def load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Seq:
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens")

    def __init__(self, rid):
        self.request_id, self.token_ids, self.num_prompt_tokens = rid, [1, 2, 3], 3


class TimedFill:
    def __init__(self, bm, into):
        self.bm, self.into = bm, into

    def batch_fill_next_token_bitmask(self, *a, **k):
        t = time.perf_counter()
        self.bm.batch_fill_next_token_bitmask(*a, **k)
        self.into[-1] += time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--schema", default=str(ROOT / "rosecli" / "bench" / "data" / "w1_schema.json"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--compare-with", default=None, metavar="TREE")
    a = ap.parse_args()
    trees = {"this": ROOT}
    if a.compare_with:
        trees["other"] = pathlib.Path(a.compare_with)
    xgrammar.apply_token_bitmask_inplace = lambda *args, **kw: None  # the device's part: left out
    engine = LLMEngine(EngineConfig(model="gpt2", load_format="dummy", device="cpu", show_progress=False,
                                    max_batch_size=a.rows))
    tok, V, eos = engine.tokenizer, engine.runner.sampler.vocab_size, engine.loaded.eos_token_ids
    schema = pathlib.Path(a.schema).read_text()
    B = a.rows
    impls, total, fill = {}, {}, {}
    for name, tree in trees.items():
        mod = load(tree / "rosecli" / "engine" / "structured.py", f"structured_{name}")
        so = mod.StructuredOutput(tok, V, eos, torch.device("cpu"), B)
        seqs = [Seq(i) for i in range(B)]
        spec = mod.GrammarSpec.json_schema(schema)
        for s in seqs:
            so.add(s.request_id, spec)
        total[name], fill[name] = [], []
        for attr in ("batch_matcher", "threaded_matcher"):
            if getattr(so, attr, None) is not None:
                setattr(so, attr, TimedFill(getattr(so, attr), fill[name]))
        impls[name] = (so, seqs)
    rng = np.random.default_rng(0)
    logits = torch.zeros(B, V)
    pend: dict[int, int] = {}
    names = list(impls)
    for step in range(a.steps):
        for name in (names if step % 2 else names[::-1]):
            so, seqs = impls[name]
            fill[name].append(0.0)
            t = time.perf_counter()
            so.mask_logits(seqs, logits, pend.__getitem__, PENDING)
            total[name].append(time.perf_counter() - t)
        so, _ = impls[names[0]]
        host = so._host[so._flip ^ 1].numpy()
        for i in range(B):
            bits = np.unpackbits(host[i].view(np.uint8), bitorder="little")[:V]
            t = int(rng.choice(np.flatnonzero(bits)))
            for _, seqs in impls.values():
                if seqs[i].token_ids[-1] == PENDING:
                    seqs[i].token_ids[-1] = pend[i]
                seqs[i].token_ids.append(PENDING)
            pend[i] = t
    engine.close()
    for name in names:
        v, f = total[name][2:], fill[name][2:]
        rest = [x - y for x, y in zip(v, f)]
        print(f"{name} ({trees[name]}): per step median {statistics.median(v) * 1e6:.0f} us, mean "
              f"{statistics.mean(v) * 1e6:.0f} us | batched fill median {statistics.median(f) * 1e6:.0f} us, mean "
              f"{statistics.mean(f) * 1e6:.0f} us | accept and the rest median {statistics.median(rest) * 1e6:.0f} us, "
              f"mean {statistics.mean(rest) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
