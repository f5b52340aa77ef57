#!/usr/bin/env bash
# Run on the lent GPU machine from the repo root: GPU tests, kernel and decode benchmarks,
# then the BENCHMARKS.md workloads. Writes logs under $OUT (or ./gpu-out). Usage:
#   bash scripts/gpu_suite.sh [tests] [kernels] [decode] [workloads] [profile] [serve]
set -uo pipefail
OUT="${OUT:-gpu-out}"; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 ROSE_CACHE_DIR="$PWD/.gpu/cache"
rose() { python3 -m rosecli "$@"; }
steps="${*:-tests kernels decode}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/device.txt"
for step in $steps; do
  echo "=== $step ==="
  case $step in
    tests) python3 -m pytest -q -x tests/test_kernels.py tests/test_cuda_graph.py 2>&1 | tail -15 ;;
    sweep) python3 scripts/bench_kernels.py --sweep 2>&1 | tee "$OUT/sweep.txt" ;;
    kernels) python3 scripts/bench_kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt" ;;
    decode) python3 scripts/bench_decode.py --batch-sizes 1 64 --new-tokens 256 --out "$OUT/decode.json" 2>&1 | grep -v '^\[transformers' | tee "$OUT/decode.txt" ;;
    workloads) bash scripts/workloads.sh 2>&1 | tee "$OUT/workloads.txt" ;;
    *) echo "unknown step $step" ;;
  esac
done
