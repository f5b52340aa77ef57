"""A whole decode step in process, greedy against sampled, and the sampler's kernels inside it (CUDA).

W1's shape through the scheduler (64 requests of a few prompt tokens decoding together, no stop on EOS, CUDA
graphs, overlap scheduling): after warm-up steps, the wall time of ``--steps`` decode steps (the device's step
time once the host keeps ahead of it), for each sampling setting; then, under the torch profiler, the
device time of each sampler kernel per step (its own time, and as a share of the step). This is where S1's
distance to W1 is seen without the benchmark's prefills, detokenizer and streaming around it.

    python scripts/bench_sampled_step.py [--model gpt2] [--rows 64] [--steps 224] [--pairs 2]
                                         [--only greedy S1 k50 p0.95]

For before/after figures run it from both trees alternately in one call (``PYTHONPATH=/other/tree``).
"""

import argparse
import os
import statistics
import time

import torch

from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.llm import LLMEngine

SETTINGS = {
    "greedy": dict(),
    "S1": dict(temperature=0.8, top_p=0.95, top_k=50),
    "k50": dict(temperature=0.8, top_k=50),
    "p0.95": dict(temperature=0.8, top_p=0.95),
}
SAMPLER = ("_pass1_kernel", "_pivot_kernel", "_compact_kernel", "_above_kernel", "_finish_kernel")


def _start(sched, rows: int, vocab: int, params: SamplingParams, seed: int) -> list[int]:
    ids = [sched.add_request([(1 + i + 7 * j + seed) % vocab for j in range(4)], params) for i in range(rows)]
    while sched.waiting or sched.prefilling or sched.last_step_kind != "decode":
        sched.step()
    return ids


def _stop(sched, ids) -> None:
    for rid in ids:
        sched.discard_request(rid)
    while sched.has_unfinished():
        sched.step()
    sched.pop_finished_ids()


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def step_us(engine, rows: int, settings: dict, steps: int, warm: int = 32) -> float:
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=steps + warm + 64, stop_on_eos=False, seed=1, **settings)
    ids = _start(sched, rows, engine.loaded.model.vocab_size, params, 0)
    for _ in range(warm):
        sched.step()
    _sync(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    _sync(engine)
    us = (time.perf_counter() - t0) * 1e6 / steps
    _stop(sched, ids)
    return us


def kernels_us(engine, rows: int, settings: dict, steps: int = 20) -> dict:
    """Device time per step of each sampler kernel and of all kernels, under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from rosecli.bench.profile import device_events

    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=steps + 96, stop_on_eos=False, seed=1, **settings)
    ids = _start(sched, rows, engine.loaded.model.vocab_size, params, 3)
    for _ in range(16):
        sched.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            sched.step()
        torch.cuda.synchronize()
    per: dict = {}
    for ev in device_events(prof):
        name = next((k for k in SAMPLER if k in ev.name), None)
        per[name or "other"] = per.get(name or "other", 0.0) + ev.device_time / steps
    _stop(sched, ids)
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=224, help="timed steps (after 32 warm-up ones: W1's 256 tokens)")
    ap.add_argument("--pairs", type=int, default=2, help="timings of each setting (alternating)")
    ap.add_argument("--only", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no kernel table)")
    a = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=a.model, load_format="dummy", device=a.device, max_batch_size=a.rows,
                                    prefill_max_batch_size=a.rows, enable_prefix_cache=False, show_progress=False,
                                    cache_dir=os.environ.get("ROSE_CACHE_DIR")))
    cuda = engine.device.type == "cuda"
    print(torch.cuda.get_device_name() if cuda else "cpu", "torch", torch.__version__, "model", a.model, "rows", a.rows)
    times: dict = {k: [] for k in a.only}
    for _ in range(a.pairs):
        for k in a.only:
            times[k].append(step_us(engine, a.rows, SETTINGS[k], a.steps))
    for k in a.only:
        ks = kernels_us(engine, a.rows, SETTINGS[k]) if cuda else {"other": 0.0}
        total = sum(ks.values())
        sampler = " ".join(f"{n.strip('_').replace('_kernel', '')} {ks[n]:.1f}" for n in SAMPLER if n in ks)
        print(f"{k:7s} step {' / '.join(f'{t:.1f}' for t in times[k])} us (median {statistics.median(times[k]):.1f})"
              f" | kernels {total:.1f} us a step; sampler {sum(v for n, v in ks.items() if n != 'other'):.1f}: "
              f"{sampler}", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
