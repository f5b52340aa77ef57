"""Decode step time and output tokens/s of our engine against transformers' generate().

GPT-2 124M shape with random weights (fp16 on CUDA), 4-token prompts, 256 new tokens, EOS
ignored. For each batch size, ours with CUDA graphs on and off, then transformers
`generate()` with a static cache (and dynamic), back to back in this process.

Decode time per step (TPOT) for ours: the median duration of decode steps (host clock around
`scheduler.step()`, which ends with the device-to-host copy of the sampled ids, so it includes
the device time). Transformers: (time of generate(N) - time of generate(1)) / (N - 1).

    python scripts/bench_decode.py --batch-sizes 1 64 --new-tokens 256 [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def build_ours(hf_config, state_dict, device, dtype, batch, graphs, paged):
    from rosecli.engine.config import EngineConfig
    from rosecli.engine.models import model_class
    from rosecli.engine.runner import ModelRunner
    from rosecli.engine.scheduler import Scheduler

    model = model_class(hf_config)(hf_config)
    model.load_weights(state_dict.items())
    model = model.to(device=device, dtype=dtype).eval()
    config = EngineConfig(device=device.type, max_batch_size=max(batch, 1), prefill_max_batch_size=max(batch, 1),
                          cuda_graph=graphs, paged_attn=paged, enable_prefix_cache=False,
                          num_gpu_blocks=4096).resolved(device.type)
    runner = ModelRunner(config, model, hf_config.n_positions, device, dtype)
    runner.prepare()
    return Scheduler(config, runner, [], hf_config.n_positions)


def run_ours(sched, batch, new_tokens, repeats=3):
    from rosecli.engine.config import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, stop_on_eos=False)
    results = []
    for _ in range(repeats + 1):  # first is a warm-up
        prompts = [[10 + i, 11, 12, 13] for i in range(batch)]
        ids = [sched.add_request(p, params) for p in prompts]
        steps = []
        t0 = time.perf_counter()
        while sched.has_unfinished():
            s = time.perf_counter()
            sched.step()
            if sched.last_step_kind == "decode":
                steps.append(time.perf_counter() - s)
        total = time.perf_counter() - t0
        sched.pop_finished_ids()
        for rid in ids:
            sched.pop_request(rid)
        results.append((statistics.median(steps), total))
    step = statistics.median(r[0] for r in results[1:])
    total = statistics.median(r[1] for r in results[1:])
    return {"tpot_ms": step * 1e3, "decode_tok_s": batch / step, "e2e_tok_s": batch * new_tokens / total}


def run_hf(hf, batch, new_tokens, device, cache, repeats=3):
    ids = torch.tensor([[10 + i, 11, 12, 13] for i in range(batch)], device=device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"

    def timed(n):
        torch.cuda.synchronize() if device.type == "cuda" else None
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize() if device.type == "cuda" else None
        return time.perf_counter() - t

    timed(new_tokens)  # warm-up (static cache compiles nothing by default, but allocates)
    full = statistics.median(timed(new_tokens) for _ in range(repeats))
    one = statistics.median(timed(1) for _ in range(repeats))
    tpot = (full - one) / (new_tokens - 1)
    return {"tpot_ms": tpot * 1e3, "decode_tok_s": batch / tpot, "e2e_tok_s": batch * new_tokens / full}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--model", choices=["gpt2", "smollm2-135m"], default="gpt2")
    ap.add_argument("--out")
    args = ap.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    if args.model == "gpt2":
        cfg = GPT2Config()  # 124M: 12 layers, d=768, 12 heads, vocab 50257, 1024 positions
        hf = GPT2LMHeadModel(cfg).eval()
    else:  # SmolLM2-135M shape
        cfg = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, intermediate_size=1536, vocab_size=49152, max_position_embeddings=2048,
                          tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)
        hf = LlamaForCausalLM(cfg).eval()
    cfg.n_positions = getattr(cfg, "n_positions", None) or cfg.max_position_embeddings
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    hf = hf.to(device=device, dtype=dtype)
    rows = []
    for batch in args.batch_sizes:
        variants = [("rose graphs+paged", True, True), ("rose eager+paged", False, True)]
        if device.type != "cuda":
            variants = [("rose (cpu)", False, False)]
        for name, graphs, paged in variants:
            sched = build_ours(cfg, state, device, dtype, batch, graphs, paged)
            r = run_ours(sched, batch, args.new_tokens)
            sched.runner.close()
            rows.append({"impl": name, "model": args.model, "batch": batch, **r})
            print(json.dumps(rows[-1]), flush=True)
        if not args.no_hf:
            for cache in ("static", "dynamic"):
                try:
                    r = run_hf(hf, batch, args.new_tokens, device, cache)
                except Exception as e:  # report, keep going
                    print(f"transformers {cache} failed: {e}", file=sys.stderr)
                    continue
                rows.append({"impl": f"transformers {cache}", "model": args.model, "batch": batch, **r})
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'impl':<24}{'batch':>6}{'TPOT ms':>10}{'decode tok/s':>14}{'e2e tok/s':>12}")
    for r in rows:
        print(f"{r['impl']:<24}{r['batch']:>6}{r['tpot_ms']:>10.3f}{r['decode_tok_s']:>14.0f}{r['e2e_tok_s']:>12.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
