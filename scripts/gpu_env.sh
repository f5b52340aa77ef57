# Sourced by the GPU scripts (gpu_suite.sh, families_gpu.sh) from the repo root on the lent GPU
# machine: $OUT made, carried wheels (.whl, packages the GPU image lacks) installed, this checkout on
# PYTHONPATH, and the device, versions and commit written to $OUT/device.txt.
OUT="${OUT:-gpu-out}"; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/device.txt"
