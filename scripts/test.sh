#!/usr/bin/env bash
# The whole test suite: set-up (with the CUDA/NVSHMEM extension wherever nvcc is, for the rung-3 compile tests;
# EPKIT_CUDA=0 skips it), lint, format check, type check, every launch recorded for rung 3 (EP kernels on 1, 2, 4
# and 8 CPU ranks, the ops, the GPU run's sizes; ~1 min), rung 3 as launched under each Triton version users have
# (every record compiled for sm_90 under the Triton of each torch in pyproject.toml's [tool.epkit], .venv's own
# first; ~1 min each; those other than .venv's installed once into .venv/tritons, which needs the package index
# the first time), then pytest (no tests collected = failure), whose rung-3 tests check those records and the
# sweep's compiles under .venv's Triton, kept whole in build/launches, instead of compiling them again.
# The sweep fails the run, after pytest, on any failed compile or spill.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
. .venv/bin/activate
ruff check .
ruff format --check .
bash scripts/typecheck.sh
rm -rf build/launches
recorded=
swept=0
if [ $# -eq 0 ]; then  # recorded and compiled once: pytest's rung-3 tests check these records and compiles
    if python -m epkit.testing.rung3 record build/launches/records.json; then
        export EPKIT_LAUNCH_RECORDS=build/launches/records.json
        recorded=yes
        # the Triton of each torch epkit is tested beside ([tool.epkit] in pyproject.toml)
        tritons=$(python - <<'EOF'
try:
    import tomllib
except ImportError:  # Python 3.10: the TOML reader pip vendors
    from pip._vendor import tomli as tomllib
print(",".join(t["triton"] for t in tomllib.load(open("pyproject.toml", "rb"))["tool"]["epkit"]["tested"]))
EOF
)
        # a failed compile or spill (each named by the sweep) fails the run, after pytest
        python -m epkit.testing.rung3 sweep build/launches/records.json --tritons "$tritons" --keep build/launches ||
            swept=$?
        export EPKIT_LAUNCH_COMPILED=build/launches  # missing or stale compiles fail those tests, never pass
    fi  # else pytest records and compiles (and its rung-3 tests say what fails); the run fails below
fi
python -m pytest -q --durations=15 "$@"
if [ $# -eq 0 ]; then
    [ -n "$recorded" ] || { echo "rung 3: recording the launches failed (above)" >&2; exit 1; }
    [ "$swept" -eq 0 ] || { echo "rung 3: the sweep failed (above): a compile failed or spilled" >&2; exit 1; }
fi
