#!/usr/bin/env bash
# Creates .venv and installs epkit with its pinned CPU stack (pyproject.toml holds every pin).
# Idempotent: reinstalls only when pyproject.toml, setup.py or csrc/ changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -z "${EPKIT_EXTRAS:-}" ]; then
    EXTRAS=cpu,kernels,dev
    # With nvcc present, also take the NVSHMEM wheel so csrc/cuda compiles and links for sm_90 (rung 3).
    if command -v nvcc >/dev/null 2>&1; then
        case "$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')" in
            12) EXTRAS=$EXTRAS,cuda12 ;;
            13) EXTRAS=$EXTRAS,cuda13 ;;
        esac
    fi
else
    EXTRAS=$EPKIT_EXTRAS
fi
if [ ! -x .venv/bin/python ]; then
    echo "epkit setup: creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
stamp=.venv/.epkit-install-stamp
want=$( (echo "$EXTRAS"; cat pyproject.toml setup.py; find csrc -type f | sort | xargs cat) | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import epkit._C" 2>/dev/null; then
    exit 0
fi
echo "epkit setup: installing epkit[$EXTRAS] (pinned; CPU torch 2.13.0)"
# Build requirements first, so the editable build can run without isolation (no network needed for it).
.venv/bin/python -m pip install -q --disable-pip-version-check "setuptools==84.2.1" "pybind11==3.1.0" wheel
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[$EXTRAS]"
# The NVSHMEM wheel arrives with the extras, after setup.py looked for it: build again to compile csrc/cuda.
case ",$EXTRAS," in *,cuda1[23],*)
    if ! .venv/bin/python -c "import epkit._C_cuda" 2>/dev/null; then
        echo "epkit setup: building the CUDA/NVSHMEM extension (csrc/cuda, sm_90)"
        .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
    fi ;;
esac
echo "$want" > "$stamp"
