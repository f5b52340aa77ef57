"""xgrammar's batched fill and accept at one batch's size, by the library's thread count
(docs/structured-output.md, "On the H100"): 64 matchers under a JSON schema, GPT-2's vocabulary,
driven through 120 steps of tokens the grammar allows; prints the mean time per step of each call.

    python scripts/bench_grammar_threads.py [--schema FILE] [--rows 64] [--steps 120] [--threads 1,2,4,8]
"""

import argparse
import json
import os
import pathlib
import time

import numpy as np
import torch

from rosecli.engine.config import EngineConfig
from rosecli.engine.llm import LLMEngine
from rosecli.engine.structured import GrammarSpec

DEFAULT_SCHEMA = pathlib.Path(__file__).resolve().parent.parent / "rosecli" / "bench" / "data" / "w1_schema.json"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schema", default=str(DEFAULT_SCHEMA))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--threads", default="1,2,4,8")
    a = ap.parse_args()
    engine = LLMEngine(EngineConfig(model="gpt2", load_format="dummy", device="cpu", show_progress=False,
                                    cache_dir=os.environ.get("ROSE_CACHE_DIR")))
    so = engine.structured
    spec = GrammarSpec.json_schema(pathlib.Path(a.schema).read_text(), "--schema")
    so.compile(spec)
    xgr, B, V = so.xgr, a.rows, so.vocab_size
    mask = torch.full((B, (V + 31) // 32), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
    rows = list(range(B))
    for threads in [int(t) for t in a.threads.split(",")]:
        ids = [10_000 + i for i in range(B)]
        for rid in ids:
            so.add(rid, spec)
        matchers = [so._requests[rid].matcher for rid in ids]
        bm = xgr.BatchGrammarMatcher(max_threads=threads)
        rng = np.random.default_rng(0)
        fill = accept = 0.0
        for step in range(a.steps):
            t = time.perf_counter()
            bm.batch_fill_next_token_bitmask(matchers, mask, rows)
            fill += time.perf_counter() - t
            bits = mask.numpy().view(np.uint32)
            tokens = []
            for r in range(B):  # the lowest allowed token every other step, else one of the first three
                allowed = np.flatnonzero(np.unpackbits(bits[r].view(np.uint8), bitorder="little")[:V])
                tokens.append(int(allowed[rng.integers(min(3, len(allowed))) if step % 2 else 0]))
            t = time.perf_counter()
            xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
            accept += time.perf_counter() - t
        for rid in ids:
            so.release(rid)
        print(f"threads {threads}: fill {fill / a.steps * 1e6:.0f} us, accept {accept / a.steps * 1e6:.0f} us "
              f"per step of {B} rows", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
