#!/usr/bin/env bash
# Before/after on the GPU machine: W4, W3, W1 and W5 of shared/BENCHMARKS.md from a baseline tree
# (default .base, e.g. `git archive <commit> | tar -x -C .base`) and from this checkout, back to
# back, then `rose bench compare` on each pair (and L1's Llama-3.2-1B shape, 128k context, in W1's form).
# Extra arguments go to every "after" command (e.g. --no-overlap-schedule). Results under $OUT
# (default ./gpu-out).
#   bash scripts/ab_workloads.sh [--base DIR] [--after DIR] [--only "W4 W3 W1 W5 L1"] [extra after-args...]
set -uo pipefail
OUT="${OUT:-gpu-out}"; mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
base=.base; after=.; only="W4 W3 W1"
while [ $# -gt 0 ]; do
  case $1 in --base) base=$2; shift 2 ;; --after) after=$2; shift 2 ;; --only) only=$2; shift 2 ;; *) break ;; esac
done
extra=("$@")
common="--load-format dummy --device cuda --prompt Hello"
declare -A W=(
  [W1]="stream --model gpt2 $common --num-requests 64 --max-new-tokens 256 --max-batch-size 64 --submit-interval-ms 0 --no-stop-on-eos --no-prefix-cache --paged-attn --cuda-graph --unique-prompts --warmup-runs 1 --repeat-runs 3"
  [W3]="sched --model gpt2 $common --num-requests 64 --max-new-tokens 512 --mode online --max-batch-size 64 --no-stop-on-eos --no-prefix-cache --pretok --warmup-runs 1 --repeat-runs 3 --paged-attn"
  [W5]="stream --model smollm2-135m $common --num-requests 64 --max-new-tokens 256 --max-batch-size 64 --submit-interval-ms 0 --no-stop-on-eos --no-prefix-cache --paged-attn --cuda-graph --unique-prompts --warmup-runs 1 --repeat-runs 3"
  [W4]="sched --model gpt2 --load-format dummy --device cuda --num-requests 1 --max-new-tokens 256 --mode online --no-stop-on-eos --warmup-runs 1 --repeat-runs 3"
  # BENCHMARKS.md's L1 shape (Llama-3.2-1B, 128k context) in W1's form: its block-table copy grows with the context
  [L1]="stream --model llama-3.2-1b $common --dtype bfloat16 --num-requests 64 --max-new-tokens 256 --max-batch-size 64 --submit-interval-ms 0 --no-stop-on-eos --no-prefix-cache --paged-attn --cuda-graph --unique-prompts --warmup-runs 1 --repeat-runs 3"
)
for w in $only; do
  echo "### $w before ($base)"
  (cd "$base" && PYTHONPATH="$PWD:${PYTHONPATH:-}" python3 -m rosecli bench ${W[$w]} --save-result "$OUT/${w}_before.json" | tail -4)
  echo "### $w after ($after) ${extra[*]}"
  (cd "$after" && PYTHONPATH="$PWD:${PYTHONPATH:-}" python3 -m rosecli bench ${W[$w]} "${extra[@]}" --save-result "$OUT/${w}_after.json" | tail -4)
  # the headline figures (a plain `tail` of the comparison cut them off for W1's many figures)
  python3 -m rosecli bench compare "$OUT/${w}_before.json" "$OUT/${w}_after.json" \
    | grep -E "^(Throughput \(completion\)|TTFT (p50|p99)|TPOT (p50|p99)|Decode step time|Share of the read ceiling):"
done
