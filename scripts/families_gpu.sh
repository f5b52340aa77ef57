#!/usr/bin/env bash
# Issue 20 on one H100, about 6 minutes, from the repo root: the GPU tests of the model families and
# the dummy shapes, then the report figures (scripts/bench_families.py: llama-3.2-1b, qwen2.5-1.5b and
# llama-3.1-8b with dummy bfloat16 weights: start-up, KV tokens, decode ms/step at B=1 and B=64, TTFT
# of 64 x 128-token prompts, beside transformers' compiled static-cache generate()).
# Writes under $OUT: gpu_tests.txt, families.txt, families.json, device.txt. Usage:
#   OUT=/some/dir bash scripts/families_gpu.sh
set -uo pipefail
OUT="${OUT:-gpu-out}"; mkdir -p "$OUT"
if [ -d .whl ]; then  # packages missing from the GPU image (optional: the script runs without them)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/device.txt"
echo "=== gpu tests ==="
timeout 120 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/test_families.py tests/test_dummy_shapes.py \
  tests/test_kernels.py 2>&1 | grep -v "^\[" | tail -40 | tee "$OUT/gpu_tests.txt"
echo "=== families bench ==="
timeout 290 python3 scripts/bench_families.py --out "$OUT" --shapes-dir /tmp/rose-shapes --deadline-s 170 2>&1 \
  | grep -v "^\[transformers\|UserWarning\|warnings.warn" | tee "$OUT/families.txt" | tail -40
