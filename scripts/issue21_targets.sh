#!/usr/bin/env bash
# Where issue 21's targets stand, in one call on the GPU machine (run from the repo root after
# `bash scripts/gpu_env.sh` has what it needs: carried wheels in .whl, the dummy models' tokenizer in
# $ROSE_CACHE_DIR). Prints, and writes under $OUT (default ./gpu-out):
#   - the decode step against the read floor at 1 and 64 rows for Llama-3.2-1B, Qwen2.5-1.5B and Llama-3.1-8B
#     (bf16 dummy weights, `rose profile --decode-step`): targets >= 85% (1-1.5B), >= 90% / 85% (8B);
#   - GPT-2's W4 TPOT (target <= 0.25 ms), W1 (>= 150,000 tok/s) and S1 (>= 90% of W1), W1 and S1 alternating
#     twice; W1-cold's TTFT against W1's (<= 1.5x) and the start-up's compile time.
# Each section is skipped when fewer than its seconds are left of LIMIT_S (default 560), so the call
# returns what it measured inside the device's per-command limit.
#   bash scripts/issue21_targets.sh [--only "steps w4 w1s1 cold"]
set -uo pipefail
source scripts/gpu_env.sh
only="steps w4 w1s1 cold"
[ "${1:-}" = "--only" ] && only=$2
start=$SECONDS; limit=${LIMIT_S:-560}
left() { [ $((limit - (SECONDS - start))) -ge "$1" ] || { echo "### skipped $2: under $1 s left"; return 1; }; }
rose() { python3 -m rosecli "$@"; }
common="--load-format dummy --device cuda --prompt Hello"
w1="--num-requests 64 --max-new-tokens 256 --max-batch-size 64 --submit-interval-ms 0 --no-stop-on-eos --no-prefix-cache
    --paged-attn --cuda-graph --unique-prompts"
s1="--temperature 0.8 --top-p 0.95 --top-k 50"
summary() { sed -n '/=== summary/,$p' | grep -E "TTFT|TPOT|Throughput|Startup|Share of" ; }
for part in $only; do
  case $part in
    steps)
      for m in llama-3.2-1b qwen2.5-1.5b llama-3.1-8b; do
        left 90 "step $m" || continue
        echo "### decode step: $m"
        rose profile --decode-step --model "$m" --load-format dummy --device cuda --dtype bfloat16 \
          --decode-batch-sizes 1,64 > "$OUT/step_$m.txt" 2>&1
        grep -E "^B=|floor:|one layer|^ +[0-9]+\. " "$OUT/step_$m.txt"
      done ;;
    w4)
      left 60 W4 || continue
      echo "### W4"
      rose bench sched --model gpt2 --load-format dummy --device cuda --num-requests 1 --max-new-tokens 256 \
        --mode online --no-stop-on-eos --warmup-runs 1 --repeat-runs 3 --save-result "$OUT/w4.json" | tail -9 ;;
    w1s1)
      for i in 1 2; do
        left 60 "W1 $i" || continue
        echo "### W1 ($i)"
        rose bench stream --model gpt2 $common $w1 --warmup-runs 1 --repeat-runs 3 --save-result "$OUT/w1_$i.json" \
          | summary
        left 60 "S1 $i" || continue
        echo "### S1 ($i)"
        rose bench stream --model gpt2 $common $w1 $s1 --warmup-runs 1 --repeat-runs 3 \
          --save-result "$OUT/s1_$i.json" | summary
      done ;;
    cold)
      left 60 W1-cold || continue
      echo "### W1-cold"
      rose bench stream --model gpt2 $common $w1 --warmup-runs 0 --repeat-runs 1 --save-result "$OUT/w1cold.json" \
        | summary ;;
  esac
done
echo "### done in $((SECONDS - start)) s"
