#!/usr/bin/env bash
# epkit's main job: set-up, then `epkit info` and `epkit selfcheck`; with arguments, `epkit ARGS`.
# The set-up (scripts/setup.sh) writes to stderr only and builds the CUDA/NVSHMEM extension only where a CUDA
# device is or EPKIT_CUDA=1 asks for it (EPKIT_CUDA=0: never).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ $# -gt 0 ]; then
    exec epkit "$@"
fi
epkit info
echo
epkit selfcheck
