#!/usr/bin/env bash
# Make .venv with jetlora, its trainer and its tests. Without an NVIDIA GPU, take torch's CPU build
# first (on this workplace's machines `pip install torch==2.13.0` finds it on local disk); with one,
# pip chooses the CUDA build that pyproject's range allows. Debian's chromium is for the dashboard test.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1 && ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0" || python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
python -m pip install -q -e ".[train,test,tracking]"
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; } \
    || echo "could not install chromium: the dashboard's browser test will be skipped" >&2
fi
