"""CPU decode speed: our engine (cpu_weights int8 and float) against transformers' generate().

Both load the same weights: by default the default model (SmolLM2-135M-Instruct: our loader
converts its GGUF into a Hugging Face directory under the cache dir, and transformers loads
that directory); with ``--random-weights``, a random model of the SmolLM2 shape saved to a
temporary Hugging Face directory that both load.

Decode speed, measured the same way for every system: for each prompt (chat template applied,
greedy, EOS ignored), time a generation of N new tokens and one of 1 new token (prefill plus
the first token); decode tok/s = sum over prompts of (N - 1) / sum of (t_N - t_1). One warm-up
generation per system first; the systems take turns within each run; the table shows the
median of the runs. Prefix caching is off so every generation prefills its whole prompt.

    python scripts/bench_cpu_generate.py [--random-weights] [--new-tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rosecli.engine.config import EngineConfig, SamplingParams  # noqa: E402
from rosecli.engine.llm import LLMEngine  # noqa: E402

PROMPTS = ["What is the capital of France?",
           "Write a short poem about the sea.",
           "Explain in two sentences why the sky is blue."]


def _random_model_dir(out: Path, seed: int) -> Path:
    """A random SmolLM2-shaped Llama in Hugging Face layout, with the SmolLM2 tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rosecli.engine.loader import dummy_tokenizer

    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                      tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=1,
                      eos_token_id=2)
    LlamaForCausalLM(cfg).eval().save_pretrained(str(out))
    dummy_tokenizer(EngineConfig()).save_pretrained(str(out))
    return out


class Ours:
    def __init__(self, model: str, cpu_weights: str, cache_dir):
        self.name = f"rosecli {cpu_weights}"
        self.engine = LLMEngine(EngineConfig(model=model, device="cpu", cpu_weights=cpu_weights, max_batch_size=1,
                                             enable_prefix_cache=False, cache_dir=cache_dir, show_progress=False))

    def generate(self, ids: list[int], n: int) -> list[int]:
        seq = self.engine.generate([ids], SamplingParams(max_new_tokens=n, stop_on_eos=False))[0]
        return seq.output_token_ids


class HF:
    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.name = "transformers fp32"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def generate(self, ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids])
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()


def decode_rate(system, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    decode_s, outs = 0.0, []
    for ids in prompts:
        t0 = time.perf_counter()
        outs.append(system.generate(ids, n))
        t1 = time.perf_counter()
        system.generate(ids, 1)
        decode_s += (t1 - t0) - (time.perf_counter() - t1)
    return len(prompts) * (n - 1) / decode_s, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random-weights", action="store_true", help="random SmolLM2-shaped weights, no GGUF needed")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cache-dir", default=None, help="rosecli cache dir (default ~/.cache/rosecli)")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory() if args.random_weights else None
    model = str(_random_model_dir(Path(tmp.name), 0)) if tmp else EngineConfig().model
    t0 = time.perf_counter()
    systems = [Ours(model, "int8", args.cache_dir), Ours(model, "float", args.cache_dir)]
    model_dir = systems[0].engine.loaded.source if not tmp else model
    systems.insert(0, HF(model_dir))
    print(f"model: {model_dir}  ({time.perf_counter() - t0:.1f} s to load all)  torch threads: "
          f"{torch.get_num_threads()}")
    prompts = [systems[1].engine.apply_chat_template(p) for p in PROMPTS]
    for s in systems:
        s.generate(prompts[0], 8)  # warm-up

    rates: dict[str, list[float]] = {s.name: [] for s in systems}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.runs):
        for s in systems:
            rate, outputs[s.name] = decode_rate(s, prompts, args.new_tokens)
            rates[s.name].append(rate)

    hf_name = systems[0].name
    hf_rate = statistics.median(rates[hf_name])
    ref = outputs[hf_name]
    print(f"\n{len(prompts)} chat prompts ({', '.join(str(len(p)) for p in prompts)} tokens), greedy, "
          f"{args.new_tokens} new tokens, decode tok/s = sum(N-1) / sum(t_N - t_1), median of {args.runs} runs")
    print(f"{'system':<20} {'decode tok/s':>12} {'ms/token':>9} {'vs HF':>7}  {'runs':<24} same tokens as HF")
    for s in systems:
        r = statistics.median(rates[s.name])
        same = sum(a == b for o, h in zip(outputs[s.name], ref) for a, b in zip(o, h))
        runs = " ".join(f"{x:.1f}" for x in rates[s.name])
        print(f"{s.name:<20} {r:>12.1f} {1000 / r:>9.1f} {r / hf_rate:>6.2f}x  {runs:<24} "
              f"{same}/{sum(len(h) for h in ref)}")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
