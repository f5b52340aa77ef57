#!/usr/bin/env bash
# The workloads of shared/BENCHMARKS.md (W1, W1-cold, W2, W3, W4, W5), one rose process each.
# Run from the repo root on a CUDA machine; results go to $OUT (default ./gpu-out) as JSON.
set -uo pipefail
OUT="${OUT:-gpu-out}"; mkdir -p "$OUT"
rose() { python3 -m rosecli "$@"; }
common="--load-format dummy --device cuda --prompt Hello"
w1="--num-requests 64 --max-new-tokens 256 --max-batch-size 64 --submit-interval-ms 0 --no-stop-on-eos --no-prefix-cache --paged-attn --cuda-graph --unique-prompts"
echo "### W1"; rose bench stream --model gpt2 $common $w1 --warmup-runs 1 --repeat-runs 3 --save-result "$OUT/w1.json" | tail -14
echo "### W1-cold"; rose bench stream --model gpt2 $common $w1 --warmup-runs 0 --repeat-runs 1 --save-result "$OUT/w1cold.json" | grep -E "Start-up|TTFT|TPOT|Throughput" | tail -4
echo "### W2"; rose bench stream --model gpt2 $common --pretok --tokenize-workers 0 --stream-interval 8 --num-requests 64 --warmup-runs 1 --repeat-runs 1 --submit-interval-ms 20 --submit-schedule absolute --max-batch-size 64 --prefill-max-batch-size 64 --max-new-tokens 128 --no-stop-on-eos --no-prefix-cache --paged-attn --cuda-graph --save-result "$OUT/w2.json" | tail -12
echo "### W3"; rose bench sched --model gpt2 $common --num-requests 64 --max-new-tokens 512 --mode online --max-batch-size 64 --no-stop-on-eos --no-prefix-cache --pretok --warmup-runs 1 --repeat-runs 3 --paged-attn | tail -9
echo "### W4"; rose bench sched --model gpt2 --load-format dummy --device cuda --num-requests 1 --max-new-tokens 256 --mode online --no-stop-on-eos --warmup-runs 1 --repeat-runs 3 | tail -9
echo "### W5"; rose bench stream --model smollm2-135m $common $w1 --warmup-runs 1 --repeat-runs 3 --save-result "$OUT/w5.json" | tail -3
