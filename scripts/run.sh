#!/usr/bin/env bash
# epkit's main job: set-up, then `epkit info`, `epkit selfcheck` and `epkit bench --quick`'s table (every op family
# against its same-run peer and roof, ~1-2 minutes on 2 cores; it writes no file); with arguments, `epkit ARGS`.
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
echo
epkit bench --quick
