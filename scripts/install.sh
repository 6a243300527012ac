#!/usr/bin/env bash
# Install PyTorch (the CPU build where no NVIDIA GPU is present) and then fastweights.
#   bash scripts/install.sh          # the library
#   bash scripts/install.sh dev      # with the test tools (pytest, hypothesis, ruff)
#   bash scripts/install.sh dev,gpu  # with Triton too (the test suite needs it: kernel tests run under its interpreter)
#   bash scripts/install.sh dev,gpu,hf,eval  # + transformers and lm-evaluation-harness (what CI installs)
# Why: a plain `pip install torch` on a machine without a GPU pulls a multi-GB CUDA build.
# Order: an already-installed torch is kept; else a local torch wheel (machines that ship one,
# e.g. this project's CI, where `pip install torch==2.13.0` is the CPU build); else the CUDA
# build from PyPI when `nvidia-smi` sees a GPU; else the CPU build from PyTorch's CPU index.
set -euo pipefail
extras="${1:-}"
py="${PYTHON:-python3}"
cd "$(dirname "$0")/.."
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  wheels="$(mktemp -d)"
  if "$py" -m pip download -q --no-index --no-deps torch==2.13.0 -d "$wheels" >/dev/null 2>&1; then
    # the local file itself; its own dependencies (sympy, networkx, ...) come from the index
    "$py" -m pip install -q "$wheels"/torch-*.whl
    echo "installed torch 2.13.0 from a local wheel"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install -q torch
  else
    "$py" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$py" -m pip install -q -e ".${extras:+[$extras]}"
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
"$py" -c "import torch, fastweights; print(f'fastweights {fastweights.__version__} with torch {torch.__version__}')"
