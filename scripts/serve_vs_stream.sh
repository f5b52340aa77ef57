#!/usr/bin/env bash
# W1's shape (64 requests x 256 new tokens, all at once) through `rose bench serve` against a
# `rose serve-local` on the same engine and model, beside `rose bench stream` in-process: the
# HTTP/SSE cost per token and on TTFT. Extra arguments go to both engines (e.g. --device cpu).
#   [LOAD="--input-len 8 ..."] [NUM=64] [SERVE_EXTRA="--no-engine-process"] [CLIENT_EXTRA="--client-processes 4"] [TAG=x] \
#     bash scripts/serve_vs_stream.sh [--model gpt2] [--port 8123] [engine args...]
set -uo pipefail
OUT="${OUT:-gpu-out}"; mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
model=gpt2; port=8123
while [ $# -gt 0 ]; do
  case $1 in --model) model=$2; shift 2 ;; --port) port=$2; shift 2 ;; *) break ;; esac
done
engine=(--model "$model" --load-format dummy --max-batch-size 64 --no-prefix-cache "$@")
read -r -a load <<<"${LOAD:---input-len 8 --output-len 256 --warmup-runs 1 --repeat-runs 3}"
num=${NUM:-64}
echo "### bench stream (in process)"
python3 -m rosecli bench stream "${engine[@]}" "${load[@]}" --num-requests "$num" --no-stop-on-eos \
  --save-result "$OUT/w1_stream.json" | tail -12
echo "### bench serve (HTTP/SSE against rose serve-local)"
read -r -a serve_extra <<<"${SERVE_EXTRA:-}"
tag=${TAG:-}
python3 -m rosecli serve-local "${engine[@]}" "${serve_extra[@]}" --port "$port" >"$OUT/server$tag.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 1 120); do
  python3 -c "import httpx,sys; httpx.get('http://127.0.0.1:$port/health', timeout=1).raise_for_status()" 2>/dev/null && break
  sleep 1
done
read -r -a client_extra <<<"${CLIENT_EXTRA:-}"
python3 -m rosecli bench serve --base-url "http://127.0.0.1:$port" "${load[@]}" "${client_extra[@]}" --num-prompts "$num" \
  --save-result "$OUT/w1_serve$tag.json" | tail -60
python3 -m rosecli bench compare "$OUT/w1_stream.json" "$OUT/w1_serve$tag.json" | tail -30
