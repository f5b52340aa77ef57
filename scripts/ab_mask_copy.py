"""Where a grammar bitmask's copy runs and what the masked argmax reads (issue 22), A/B in one process on one
engine: W1's shape (GPT-2,
dummy weights, 64 x 256 greedy, the default schema), a free, a mixed (half under the schema) and an
all-grammar run per strategy, the strategies taking turns for ``REPEATS`` repeats, so a slow spell of
the host falls on all of them alike (between processes the host's spells decide such figures).

Strategies: the copy inside the masked-argmax graph; beside the forward only when the host finds the
step before still running, through torch's stream switching (the engine's rule before f7f8815,
emulated with the same event query); always beside the forward, through the CUDA driver (now); the same,
with the masked argmax reading the float32 logits the decode step then writes (before the raw GEMM output).

    python scripts/ab_mask_copy.py [REPEATS [STRATEGY ...]]    # on a CUDA machine, xgrammar installed
"""

import os
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_structured as bs  # noqa: E402

import rosecli.engine.runner as R  # noqa: E402
from rosecli.engine.aside_copy import driver  # noqa: E402
from rosecli.engine.config import EngineConfig  # noqa: E402
from rosecli.engine.llm import LLMEngine  # noqa: E402
from rosecli.engine.structured import GrammarSpec  # noqa: E402

N = 64
# name -> (MASK_COPY_ASIDE or "when device-bound", copy through the driver, argmax of the raw GEMM output)
STRATEGIES = {"in the graph": (False, False, True), "beside when device-bound (torch)": ("rule", False, True),
              "always beside (driver)": (None, True, True), "always beside, float32 logits": (None, True, False)}


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    names = sys.argv[2:] or list(STRATEGIES)
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        sys.exit(f"unknown strategy {unknown[0]!r}: choose from {', '.join(map(repr, STRATEGIES))}")
    engine = LLMEngine(EngineConfig(model="gpt2", load_format="dummy", device="cuda", max_batch_size=N,
                                    enable_prefix_cache=False, show_progress=False, paged_attn=True, cuda_graph=True,
                                    cache_dir=os.environ.get("ROSE_CACHE_DIR")))
    spec = GrammarSpec.json_schema(pathlib.Path(bs.DEFAULT_SCHEMA).read_text(), "--schema")
    so = engine.structured
    so.compile(spec)
    rule = [False]
    reader = R.ModelRunner._pending_reader

    def rule_reader(self, last_rows, prev_flip):  # the old rule: beside when the step before still runs
        read, event, first = reader(self, last_rows, prev_flip), self._events[prev_flip], [rule[0]]

        def r(request_id):
            if first[0]:
                first[0] = False
                R.MASK_COPY_ASIDE = event is not None and not event.query()
            return read(request_id)
        return r

    R.ModelRunner._pending_reader = rule_reader

    def use(name):
        aside, via_driver, raw = STRATEGIES[name]
        if engine.runner._raw_for_grammar != raw:  # (the masked graphs read the other buffer: captured again)
            engine.runner._raw_for_grammar = raw and all(g.raw is not None for g in engine.runner.graphs.values())
            engine.runner._masked_replays.clear()
        rule[0] = aside == "rule"
        R.MASK_COPY_ASIDE = False if rule[0] else aside
        if so._aside is not None:
            so._aside.lib = driver() if via_driver else None

    try:
        for name in names:  # graphs and kernels of every strategy before any timing
            use(name)
            for k in (N, 0, N // 2):
                bs.run(engine, N, k, spec, 16, 0.0)
        got = {name: {"free": [], "mixed": [], "free_tps": [], "grammar_tps": []} for name in names}
        for rep in range(repeats):
            for name in (names if rep % 2 == 0 else names[::-1]):
                use(name)
                wall_f, outs_f, _, free = bs.run(engine, N, 0, spec, 256, 0.0)
                _, _, _, beside = bs.run(engine, N, N // 2, spec, 256, 0.0)
                wall_g, outs_g, _, _ = bs.run(engine, N, N, spec, 256, 0.0)
                r = got[name]
                r["free"].append(statistics.median(bs.tpot(o) for o in free))
                r["mixed"].append(statistics.median(bs.tpot(o) for o in beside))
                r["free_tps"].append(sum(o.output_tokens for o in outs_f) / wall_f)
                r["grammar_tps"].append(sum(o.output_tokens for o in outs_g) / wall_g)
    finally:
        R.ModelRunner._pending_reader = reader
        engine.close()
    for name, r in got.items():
        ratios = [m / f for m, f in zip(r["mixed"], r["free"])]
        share = [g / f for g, f in zip(r["grammar_tps"], r["free_tps"])]
        print(f"{name:34s} free TPOT {statistics.median(r['free']):.4f} ms | beside grammar rows "
              f"{statistics.median(r['mixed']):.4f} ms | mixed / alone {statistics.median(ratios):.3f} (target <= 1.05; "
              f"{min(ratios):.3f}-{max(ratios):.3f}) | grammar / free {statistics.median(share):.1%} (target >= 85%; "
              f"{min(share):.1%}-{max(share):.1%})")


if __name__ == "__main__":
    main()
