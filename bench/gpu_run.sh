#!/usr/bin/env bash
# Rung 4 in one call on a lent GPU machine: build, bench/gpu_check.py, GPU tests; logs + JSON to $OUT.
#
# Made for a machine that has a CUDA torch, nvcc, an nvidia-nvshmem wheel and pytest, but no network
# and no epkit: nothing is installed into its Python. epkit is built for that Python (epkit._C, and
# epkit._C_cuda against the NVSHMEM wheel its torch uses) into build/gpu_run/, and a package tree
# there goes first on PYTHONPATH. TileLang need not be there: its backends then say "unavailable".
#
#   bash bench/gpu_run.sh                                   # build ~1 min, checks <= 5.5 min, tests <= 3 min
#   GPU_RUN_STEPS=check GPU_RUN_SECTIONS=nvshmem bash bench/gpu_run.sh   # rerun one section, build kept
#
# Knobs (environment):
#   PYTHON            the Python that holds the CUDA torch (default python3)
#   OUT               where logs and gpu_check.json go (default build/gpu_run/out; the device tool sets it)
#   GPU_RUN_STEPS     comma list of build,check,tests (default all three, run in that order)
#   GPU_RUN_SECTIONS  gpu_check sections in the order to run them (default: env and nvshmem first)
#   GPU_RUN_BUDGET    gpu_check's total seconds (default 300): nvshmem gets 150 s (the open issue's
#                     evidence, two child processes), the other sections share the rest in proportion
#   GPU_RUN_ARGS      more gpu_check arguments (e.g. --quick)
# Exit status: 0 when every step that ran passed; otherwise the first failing step's status.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/build/gpu_run/out}
STEPS=",${GPU_RUN_STEPS:-build,check,tests},"
SECTIONS=${GPU_RUN_SECTIONS:-env,nvshmem,grouped_gemm,gather_rows,logical_to_physical,prepare_cp_mirror,engram_hash}
BUDGET=${GPU_RUN_BUDGET:-300}
BUILD=$ROOT/build/gpu_run
SITE=$BUILD/site
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$BUILD"
status=0
say() { echo "[gpu_run $(date +%H:%M:%S)] $*"; }
failed() {  # failed STEP RC: remember the first failure, keep going
    say "$1 failed (exit $2)"
    [ "$status" -ne 0 ] || status=$2
}

say "python: $(command -v "$PY"); steps ${STEPS//,/ }; logs -> $OUT"
"$PY" - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import importlib.metadata as md
import platform
import shutil
import subprocess

import torch

print("python", platform.python_version(), platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs", p.total_memory >> 30, "GiB")
for dist in ("triton", "tilelang", "numpy", "pybind11", "setuptools", "pytest", "pytest-timeout", "hypothesis",
             "nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "absent")
try:
    wanted = [r for r in (md.requires("torch") or []) if "nvshmem" in r]
    print("torch wants", wanted or "no nvidia-nvshmem wheel")
except md.PackageNotFoundError:
    pass
nvcc = shutil.which("nvcc")
release = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout if nvcc else ""
major = release.split("release ")[1].split(".")[0] if "release " in release else None
print("nvcc", nvcc, "CUDA", major)
if major and torch.version.cuda and torch.version.cuda.split(".")[0] != major:
    print(f"WARNING: nvcc is CUDA {major} but torch is built for CUDA {torch.version.cuda}: epkit._C_cuda "
          "links libcudart of nvcc's CUDA and the NVSHMEM wheel of torch's; expect the build or the load to fail")
EOF

if [[ $STEPS == *,build,* ]]; then
    say "build: epkit._C and epkit._C_cuda for this Python (log: $OUT/build.log)"
    (
        set -e
        EPKIT_CUDA=${EPKIT_CUDA:-1} "$PY" setup.py -q build_ext --build-temp "$BUILD/temp" --build-lib "$BUILD/lib"
        rm -rf "$SITE"
        mkdir -p "$SITE"
        cp -r python/epkit "$SITE/epkit"
        rm -f "$SITE"/epkit/_C*.so  # this checkout's own builds may be for another Python
        cp -r kernels "$SITE/epkit/kernels"
        cp -r collectives "$SITE/epkit/collectives"
        cp "$BUILD"/lib/epkit/_C*.so "$SITE/epkit/"
    ) >"$OUT/build.log" 2>&1 || failed build $?
    tail -n 3 "$OUT/build.log"
fi
if [ -d "$SITE/epkit" ]; then
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    "$PY" -c "import epkit, epkit._C; print('epkit from', epkit.__file__); import epkit._C_cuda" 2>&1 | tee -a "$OUT/env.txt"
else
    say "no package tree at $SITE: run the build step first"
    [ "$status" -ne 0 ] || status=3
fi

if [[ $STEPS == *,check,* ]] && [ -d "$SITE/epkit" ]; then
    say "check: bench/gpu_check.py --sections $SECTIONS --budget $BUDGET ${GPU_RUN_ARGS:-}"
    # shellcheck disable=SC2086  # GPU_RUN_ARGS is a list of words
    timeout $((${BUDGET%.*} + 150)) "$PY" bench/gpu_check.py --sections "$SECTIONS" --budget "$BUDGET" \
        --section-budget nvshmem=150 --out "$OUT/gpu_check.json" ${GPU_RUN_ARGS:-} 2>&1 | tee "$OUT/gpu_check.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || failed check "$rc"
fi
if [[ $STEPS == *,tests,* ]] && [ -d "$SITE/epkit" ]; then
    say "tests: pytest -m gpu (log: $OUT/pytest_gpu.log)"
    timeout 180 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider --durations 10 tests \
        >"$OUT/pytest_gpu.log" 2>&1 || failed tests $?
    tail -n 15 "$OUT/pytest_gpu.log"
fi

say "done (exit $status); files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit "$status"
