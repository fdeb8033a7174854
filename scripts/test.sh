#!/usr/bin/env bash
# The whole test suite: set-up (with the CUDA/NVSHMEM extension wherever nvcc is, for the rung-3 compile tests;
# EPKIT_CUDA=0 skips it), lint, format check, every launch recorded for rung 3 (EP kernels on 1, 2, 4 and 8 CPU
# ranks, the ops, the GPU run's sizes; ~1 min; pytest's rung-3 tests read these records), pytest (no tests
# collected = failure), then rung 3 as launched under each Triton version users have: every record compiled for
# sm_90 under the Triton of each torch in pyproject.toml's [tool.epkit] (~1 min each; those other than .venv's
# installed once into .venv/tritons, which needs the package index the first time).
# The sweep fails on any failed compile or spill.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
. .venv/bin/activate
ruff check .
ruff format --check .
bash scripts/typecheck.sh
rm -rf build/launches
recorded=
if [ $# -eq 0 ]; then  # recorded once: pytest's rung-3 tests check the records the sweep compiles
    if python -m epkit.testing.rung3 record build/launches/records.json; then
        export EPKIT_LAUNCH_RECORDS=build/launches/records.json
        recorded=yes
    fi  # else pytest records (and its rung-3 tests say what fails); the run fails below
fi
python -m pytest -q --durations=15 "$@"
if [ $# -eq 0 ]; then
    [ -n "$recorded" ] || { echo "rung 3: recording the launches failed (above)" >&2; exit 1; }
    # the Triton of each torch epkit is tested beside ([tool.epkit] in pyproject.toml)
    tritons=$(python - <<'EOF'
try:
    import tomllib
except ImportError:  # Python 3.10: the TOML reader pip vendors
    from pip._vendor import tomli as tomllib
print(",".join(t["triton"] for t in tomllib.load(open("pyproject.toml", "rb"))["tool"]["epkit"]["tested"]))
EOF
)
    python -m epkit.testing.rung3 sweep build/launches/records.json --tritons "$tritons" --keep build/launches
fi
