#!/usr/bin/env bash
# The whole test suite: set-up, lint, format check, pytest (no tests collected = failure).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest -q --durations=15 "$@"
