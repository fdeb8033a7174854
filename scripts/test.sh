#!/usr/bin/env bash
# The whole test suite: set-up (with the CUDA/NVSHMEM extension wherever nvcc is, for the rung-3 compile tests;
# EPKIT_CUDA=0 skips it), lint, format check, pytest (no tests collected = failure), then rung 3 as launched under
# each Triton version users have: every launch recorded (EP kernels on 1, 2, 4 and 8 CPU ranks, the ops, the GPU
# run's sizes; ~2 min), compiled for sm_90 under each version (~2.5 min each; the older ones installed once into
# .venv/tritons, which needs the package index the first time). The sweep fails on any failed compile or spill.
set -euo pipefail
cd "$(dirname "$0")/.."
# The GPU image's Triton (torch 2.11), the one torch 2.13 pins, and .venv's (the newest).
RUNG3_TRITONS=3.6.0,3.7.1,newest
bash scripts/setup.sh --tests
. .venv/bin/activate
ruff check .
ruff format --check .
rm -rf build/launches
python -m pytest -q --durations=15 "$@"
if [ $# -eq 0 ]; then
    python -m epkit.testing.rung3 record build/launches/records.json
    newest=$(python -c 'import triton; print(triton.__version__)')
    python -m epkit.testing.rung3 sweep build/launches/records.json --tritons "${RUNG3_TRITONS/newest/$newest}" \
        --keep build/launches
fi
