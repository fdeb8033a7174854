#!/usr/bin/env bash
# The whole test suite: set-up (with the CUDA/NVSHMEM extension wherever nvcc is, for the rung-3 compile tests;
# EPKIT_CUDA=0 skips it), lint, format check, pytest (no tests collected = failure).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
. .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest -q --durations=15 "$@"
