"""Structured output's cost at W1's shape (issue 22): the same batch unconstrained, every request
under a JSON schema, and mixed (some requests under the schema, the others free), at equal token
counts: the default schema (rosecli/bench/data/w1_schema.json) makes every output run to
``--max-new-tokens`` whatever the weights, and free requests ignore EOS.

Prints, per mode: output tokens (min/mean: each should be --max-new-tokens), wall time, tok/s, TPOT
p50 of the free and of the grammar requests, and the ratios that the issue's targets are about
(grammar tok/s over free tok/s; a free request's TPOT in the mixed batch over its TPOT alone).

    python scripts/bench_structured.py --device cuda [--schema FILE] [--grammar-requests 32]
        [--num-requests 64] [--max-new-tokens 256] [--repeat 3] [--modes free,grammar,mixed]

The grammar requests are greedy (as W1's); ``--temperature`` samples every request instead.
"""

import argparse
import os
import json
import pathlib
import statistics
import time

from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.llm import LLMEngine
from rosecli.engine.structured import GrammarSpec

DEFAULT_SCHEMA = pathlib.Path(__file__).resolve().parent.parent / "rosecli" / "bench" / "data" / "w1_schema.json"


def tpot(o) -> float:
    ts = o.timestamps
    if ts.first_token is None or ts.finish is None or o.output_tokens < 2:
        return float("nan")
    return (ts.finish - ts.first_token) / (o.output_tokens - 1) * 1e3


def run(engine, n, k, spec, max_new, temperature):
    """n requests, the first k (spread through the batch: every (n/k)th) under ``spec``."""
    step = n / k if k else 0
    grammar_rows = {int(i * step) for i in range(k)}
    params = []
    for i in range(n):
        if i in grammar_rows:
            params.append(SamplingParams(max_new_tokens=max_new, temperature=temperature, structured=spec))
        else:
            params.append(SamplingParams(max_new_tokens=max_new, temperature=temperature, stop_on_eos=False))
    prompts = [f"{i} Hello" for i in range(n)]
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    g = [o for i, o in enumerate(outs) if i in grammar_rows]
    f = [o for i, o in enumerate(outs) if i not in grammar_rows]
    return wall, outs, g, f


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--schema", default=str(DEFAULT_SCHEMA))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--grammar-requests", type=int, default=None, help="grammar requests in the mixed run "
                    "(default: half)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="free,grammar,mixed")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args()
    n = a.num_requests
    k_mixed = n // 2 if a.grammar_requests is None else a.grammar_requests
    cuda = a.device == "cuda"
    cfg = EngineConfig(model=a.model, load_format="dummy", device=a.device, max_batch_size=n,
                       enable_prefix_cache=False, show_progress=False,
                       paged_attn=True if cuda else None, cuda_graph=(not a.no_cuda_graph) if cuda else None,
                       overlap_schedule=False if a.no_overlap else None,
                       cache_dir=os.environ.get("ROSE_CACHE_DIR"))  # as the CLI's --cache-dir reads it
    engine = LLMEngine(cfg)
    spec = GrammarSpec.json_schema(pathlib.Path(a.schema).read_text(), "--schema")
    engine.structured.compile(spec)  # compiled once, before any timing
    modes = {"free": 0, "grammar": n, "mixed": k_mixed}
    rows = []
    try:
        run(engine, n, n, spec, 16, a.temperature)  # warm-up: graphs, kernels, the sampler's graphs
        run(engine, n, 0, spec, 16, a.temperature)
        run(engine, n, k_mixed, spec, 16, a.temperature)
        # the modes take turns within each repeat: a slow spell of the host (which a grammar step
        # waits on) falls on every mode alike instead of on one mode's runs
        modes_run = a.modes.split(",")
        got = {m: {"walls": [], "ftp": [], "gtp": [], "lens": []} for m in modes_run}
        for _ in range(a.repeat):
            for mode in modes_run:
                wall, outs, g, f = run(engine, n, modes[mode], spec, a.max_new_tokens, a.temperature)
                r = got[mode]
                r["walls"].append(wall)
                r["lens"] += [o.output_tokens for o in outs]
                r["ftp"] += [tpot(o) for o in f]
                r["gtp"] += [tpot(o) for o in g]
        for mode in modes_run:
            r = got[mode]
            wall = statistics.median(r["walls"])
            tokens = sum(r["lens"]) / a.repeat
            row = {"mode": mode, "grammar_requests": modes[mode], "tokens_min": min(r["lens"]),
                   "tokens_mean": sum(r["lens"]) / len(r["lens"]), "wall_s": wall, "tok_s": tokens / wall,
                   "free_tpot_ms_p50": statistics.median(r["ftp"]) if r["ftp"] else None,
                   "grammar_tpot_ms_p50": statistics.median(r["gtp"]) if r["gtp"] else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        engine.close()
    by = {r["mode"]: r for r in rows}
    if "free" in by and "grammar" in by:
        def rates(m):  # tok/s of each repeat
            r = got[m]
            return [sum(r["lens"][i * n:(i + 1) * n]) / w for i, w in enumerate(r["walls"])]

        each = [g / f for f, g in zip(rates("free"), rates("grammar"))]
        print(f"grammar / free throughput: {by['grammar']['tok_s'] / by['free']['tok_s']:.1%} (target >= 85%); "
              f"repeat by repeat {min(each):.1%} to {max(each):.1%}")
    if "free" in by and "mixed" in by:
        ratio = by['mixed']['free_tpot_ms_p50'] / by['free']['free_tpot_ms_p50']
        print(f"free request TPOT, mixed / alone: {ratio:.3f} (target <= 1.05)")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
