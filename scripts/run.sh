#!/usr/bin/env bash
# epkit's main job: set-up, then `epkit info` and `epkit selfcheck`; with arguments, `epkit ARGS`.
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
