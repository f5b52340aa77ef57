#!/usr/bin/env bash
# Issue 20 on one H100, from the repo root. Steps (default "tests bench", about 6 minutes):
#   tests  the GPU tests of the model families, the dummy shapes (all named shapes at full size) and the kernels
#   bench  scripts/bench_families.py: llama-3.2-1b, qwen2.5-1.5b, llama-3.1-8b with dummy bfloat16 weights:
#          start-up, KV tokens, decode ms/step at B=1 and B=64, TTFT of 64 x 128-token prompts, beside
#          transformers' compiled static-cache generate() (8B first; the rest while its deadline allows)
#   sweep  decode launch sweep at head_dim 128 (Llama-3-8B 32:8, Qwen2.5-7B 28:4, 8:1 GQA 32:4), ~2.5 min
# Writes under $OUT: device.txt, gpu_tests.txt, families.txt, families.json (and sweep128.txt/.json). Usage:
#   OUT=/some/dir bash scripts/families_gpu.sh [tests] [bench] [sweep]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
steps="${*:-tests bench}"
for step in $steps; do
  echo "=== $step ==="
  case $step in
    tests) timeout 120 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/test_families.py \
             tests/test_dummy_shapes.py tests/test_kernels.py 2>&1 | grep -v "^\[" | tail -40 | tee "$OUT/gpu_tests.txt" ;;
    bench) timeout 290 python3 scripts/bench_families.py --out "$OUT" --shapes-dir /tmp/rose-shapes --deadline-s 170 2>&1 \
             | grep -v "^\[transformers\|UserWarning\|warnings.warn" | tee "$OUT/families.txt" | tail -40 ;;
    sweep) timeout 200 python3 scripts/bench_kernels.py --quick-sweep --budget-s 120 --head-dim 128 \
             --shapes llama8b=32:8 qwen7b=28:4 gqa8=32:4 --out "$OUT/sweep128.json" 2>&1 | tee "$OUT/sweep128.txt" | tail -30 ;;
    *) echo "unknown step $step" ;;
  esac
done
