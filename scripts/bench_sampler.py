"""Time one sampling step at batch 64 on the GPU: greedy argmax and
`SamplerState` for several parameter sets, eager and replayed from a CUDA graph; S1 at batch 1 too,
and top-p alone on flat logits (nuclei beyond the candidate scratch: the whole-row search).

    python scripts/bench_sampler.py [--batch 64] [--vocab 50257 49152 128256] [--out results.json]
"""

import argparse
import json
import time
from types import SimpleNamespace as P

import torch

from rosecli.engine.sampling_state import SamplerState

CONFIGS = {
    "S1 (t0.8 p0.95 k50)": dict(temperature=0.8, top_p=0.95, top_k=50),
    "S1 + penalties + min_p": dict(temperature=0.8, top_p=0.95, top_k=50, min_p=0.05, repetition_penalty=1.1,
                                   presence_penalty=0.5, frequency_penalty=0.3),
    "S1 + logit_bias(300) + min_tokens": dict(temperature=0.8, top_p=0.95, top_k=50, min_tokens=1000,
                                              logit_bias={i * 7: 0.5 for i in range(300)}),
    "t0.8 only": dict(temperature=0.8),
    "t0.8 p0.95 (no top_k)": dict(temperature=0.8, top_p=0.95),
    "t0.8 k50 (no top_p)": dict(temperature=0.8, top_k=50),
    "greedy + penalties": dict(repetition_penalty=1.2, presence_penalty=0.5),
}
FLAT = ("t0.8 p0.95 (no top_k), flat logits", dict(temperature=0.8, top_p=0.95))


def gpu_us(fn, iters):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e6
    return start.elapsed_time(end) / iters * 1e3, wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, nargs="+", default=[50257, 49152, 128256])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for V in a.vocab:
        g = torch.Generator(device=dev).manual_seed(0)
        base_all = torch.randn(a.batch, V, device=dev, generator=g) * 3  # peaked enough that top-p nuclei are small
        prompt = list(range(0, 2000, 3))
        cases = [(a.batch, name, params, 3.0) for name, params in CONFIGS.items()]
        cases += [(1, "S1 (t0.8 p0.95 k50)", CONFIGS["S1 (t0.8 p0.95 k50)"], 3.0), (a.batch, FLAT[0], FLAT[1], 0.3)]
        B = a.batch
        base = base_all
        logits = base.clone()

        def row(name, B, fn, graph_fn=None):
            eager, wall = gpu_us(fn, a.iters)
            graphed = graph_fn() if graph_fn is not None else None
            rows.append(dict(vocab=V, batch=B, case=name, eager_gpu_us=round(eager, 1), eager_wall_us=round(wall, 1),
                             graph_us=None if graphed is None else round(graphed, 1)))
            print(rows[-1], flush=True)

        row("greedy argmax", B, lambda: logits.argmax(dim=-1))
        gen = torch.Generator(device=dev).manual_seed(0)
        for B, name, params, scale in cases:
            base = base_all[:B] * (scale / 3.0)
            logits = base.clone()
            st = SamplerState(B, V, dev, seed=0)
            slots = torch.tensor([st.acquire(P(**params, seed=i if i % 2 else None), prompt, [5, 6, 7],
                                             stop_ids=[V - 1, 3]) for i in range(B)], device=dev)
            st.flush()

            def step():
                logits.copy_(base)  # penalties work in place: the same input every step
                return st.sample(logits, slots)

            def graphed():
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        step()
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                return gpu_us(graph.replay, a.iters)[0]

            row(name, B, step, graphed)
            st.fallback_rows.zero_()
            step()
            rows[-1]["fallback_rows"] = int(st.fallback_rows.item())  # of B, searched their whole row
            if B == a.batch and name == FLAT[0]:
                copy_us, _ = gpu_us(lambda: logits.copy_(base), a.iters)
                rows.append(dict(vocab=V, batch=B, case="(logits.copy_ included above)",
                                 eager_gpu_us=round(copy_us, 1)))
                print(rows[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
