#!/usr/bin/env bash
# Run on the lent GPU machine from the repo root: GPU tests, kernel and decode benchmarks,
# then the BENCHMARKS.md workloads. Writes logs under $OUT (or ./gpu-out). Usage:
#   bash scripts/gpu_suite.sh [tests] [gpu-tests] [ab] [kernels] [decode] [workloads] [profile] [serve]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export ROSE_CACHE_DIR="$PWD/.gpu/cache"
rose() { python3 -m rosecli "$@"; }
steps="${*:-tests kernels decode}"
for step in $steps; do
  echo "=== $step ==="
  case $step in
    tests) python3 -m pytest -q -x tests/test_kernels.py tests/test_cuda_graph.py 2>&1 | tail -15 ;;
    gpu-tests) python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_cuda_graph.py 2>&1 | tail -15 ;;
    ab) bash scripts/ab_workloads.sh 2>&1 | tee "$OUT/ab.txt" ;;
    sweep) python3 scripts/bench_kernels.py --sweep 2>&1 | tee "$OUT/sweep.txt" ;;
    kernels) python3 scripts/bench_kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt" ;;
    decode) python3 scripts/bench_decode.py --batch-sizes 1 64 --new-tokens 256 --out "$OUT/decode.json" 2>&1 | grep -v '^\[transformers' | tail -9 | tee "$OUT/decode.txt" ;;
    decode-smollm2) python3 scripts/bench_decode.py --model smollm2-135m --batch-sizes 1 64 --new-tokens 256 --out "$OUT/decode_smollm2.json" 2>&1 | grep -v '^\[transformers' | tail -9 | tee "$OUT/decode_smollm2.txt" ;;
    workloads) bash scripts/workloads.sh 2>&1 | tee "$OUT/workloads.txt" ;;
    serve) timeout 300 python3 scripts/load_test.py --model gpt2 --load-format dummy --device cuda --num-requests 500 \
             --concurrency 64 --max-tokens 128 2>&1 | grep -v "^INFO" | tee "$OUT/load.txt" ;;
    nsys)
      NSYS=$(ls /opt/nvidia/nsight-systems/*/bin/nsys /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -1)
      echo "nsys: $NSYS"; ls -d /opt/nvidia/* 2>/dev/null
      timeout 240 "$NSYS" profile -t cuda,nvtx --capture-range=cudaProfilerApi -o /tmp/rose -f true \
        python3 -m rosecli profile --nvtx --model gpt2 --load-format dummy --device cuda --num-requests 32 \
        --max-new-tokens 64 --no-stop-on-eos 2>&1 | tail -30
      python3 -m rosecli profile --model gpt2 --load-format dummy --device cuda --num-requests 32 --max-new-tokens 64 --no-stop-on-eos --torch-trace /tmp/trace 2>&1 | tail -22
      ls -la /tmp/rose* 2>&1
      timeout 120 "$NSYS" stats --report nvtx_sum /tmp/rose.nsys-rep 2>&1 | tail -30 || true
      QI=$(find /opt/nvidia -name QdstrmImporter 2>/dev/null | head -1); echo "importer: $QI"
      if [ -d .gpu/debs ]; then  # libdw/libelf for the importer, unpacked outside /
        mkdir -p /tmp/dw && for f in .gpu/debs/*.deb; do dpkg -x "$f" /tmp/dw; done
        export LD_LIBRARY_PATH="$(dirname "$(find /tmp/dw -name 'libdw.so.1' | head -1)"):${LD_LIBRARY_PATH:-}"
      fi
      if [ ! -f /tmp/rose.nsys-rep ] && [ -n "$QI" ] && ls /tmp/rose*.qdstrm >/dev/null 2>&1; then
        timeout 120 "$QI" -i /tmp/rose.qdstrm 2>&1 | tail -5; ls -la /tmp/rose* 2>&1
        timeout 120 "$NSYS" stats --report nvtx_sum /tmp/rose.nsys-rep 2>&1 | tail -30 || true
      fi ;;
    *) echo "unknown step $step" ;;
  esac
done
