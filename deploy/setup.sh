#!/usr/bin/env bash
# Make .venv with jetlora and its trainer. Without an NVIDIA GPU, take torch's CPU build first
# (on this workplace's machines `pip install torch==2.13.0` finds it on local disk); with one,
# let pip choose the CUDA build that pyproject's range allows.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1 && ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0" || python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
python -m pip install -q -e ".[train,test]"
