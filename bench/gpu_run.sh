#!/usr/bin/env bash
# Rung 4 in one call on a lent GPU machine: build, warm Triton's cache, bench/gpu_check.py, GPU tests; logs + JSON
# to $OUT.
#
# Made for a machine that has a CUDA torch, nvcc, an nvidia-nvshmem wheel, einops, pybind11, setuptools
# (>= 77), pytest, pytest-timeout and hypothesis, but no network and no epkit: nothing is installed into
# its Python.
# epkit is compiled for that Python (epkit._C, and epkit._C_cuda against the NVSHMEM wheel its torch
# uses) into build/gpu_run/lib, and a package tree of this checkout's sources plus those libraries,
# assembled afresh at every run in build/gpu_run/site, goes first on PYTHONPATH. TileLang need not be
# there: its backends then say "unavailable" and its tests skip.
#
#   bash bench/gpu_run.sh          # typically ~1 min build, ~1 min warm, ~5 min checks, ~1.5 min tests
#   GPU_RUN_STEPS=check GPU_RUN_SECTIONS=nvshmem bash bench/gpu_run.sh   # rerun one section, libraries kept
#
# Knobs (environment):
#   PYTHON            the Python that holds the CUDA torch (default python3)
#   OUT               where logs, gpu_check.json and gpu_check.bench.{json,md} (epkit bench's report) go
#                     (default build/gpu_run/out; the device tool sets it)
#   GPU_RUN_STEPS     comma list of build,warm,check,tests (default all four, run in that order); warm compiles
#                     every Triton kernel at the run's sizes into Triton's cache first (compile.json: seconds
#                     and resources), so that the checks' timings hold no compile
#   GPU_RUN_SECTIONS  gpu_check sections in the order to run them (default: env and nvshmem first, bench last)
#   GPU_RUN_BUDGET    gpu_check's total seconds (default 300): nvshmem gets 150 s (the open issue's
#                     evidence, two child processes), the other sections share the rest in proportion
#   GPU_RUN_ARGS      more gpu_check arguments (e.g. --quick)
#   GPU_RUN_LIMIT     seconds for build, check and tests together (default 540): each step gets what is
#                     left, and a step with too little left is not started (a failure); the env and
#                     import probes before them take seconds
#   GPU_RUN_DEVICE    cuda (default), or cpu: a dry run of this script's flow on a machine without a GPU
# Exit status: 0 when every step that ran passed; otherwise the first failing step's status. No usable
# GPU, or no importable epkit._C, stops the run before the checks; a failed epkit._C_cuda build is
# retried without it, so that the kernel sections still run (the nvshmem section then fails).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/build/gpu_run/out}
STEPS=",${GPU_RUN_STEPS:-build,warm,check,tests},"
SECTIONS=${GPU_RUN_SECTIONS:-env,nvshmem,grouped_gemm,gather_rows,logical_to_physical,prepare_cp_mirror,engram_hash,bench}
BUDGET=${GPU_RUN_BUDGET:-300}
LIMIT=${GPU_RUN_LIMIT:-540}
DEVICE=${GPU_RUN_DEVICE:-cuda}
BUILD=$ROOT/build/gpu_run
SITE=$BUILD/site
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$BUILD"
status=0
START=$SECONDS
say() { echo "[gpu_run $(date +%H:%M:%S)] $*"; }
failed() {  # failed STEP RC: remember the first failure, keep going
    say "$1 failed (exit $2)"
    [ "$status" -ne 0 ] || status=$2
}
left() { echo $((LIMIT - (SECONDS - START))); }  # seconds left of GPU_RUN_LIMIT
time_for() {  # time_for STEP MIN: true when at least MIN seconds are left, else a failure of STEP
    [ "$(left)" -ge "$2" ] && return 0
    say "$1 not started: only $(left) s of GPU_RUN_LIMIT left (exit 5)"
    [ "$status" -ne 0 ] || status=5
    return 1
}
finish() {
    say "done in $((SECONDS - START)) s (exit $status); files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
    exit "$status"
}

say "python: $(command -v "$PY"); steps ${STEPS//,/ }; limit ${LIMIT} s; logs -> $OUT"
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
for dist in ("triton", "tilelang", "numpy", "einops", "pybind11", "setuptools", "pytest", "pytest-timeout", "hypothesis",
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

if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "torch sees no CUDA device: nothing here can run (env.txt says what the machine has)"
    status=4
    finish
fi

compile() {  # compile CUDA: the extensions for this Python into $BUILD/lib (nothing stale survives a failure)
    rm -rf "$BUILD/lib" "$SITE" &&
        EPKIT_CUDA=$1 timeout -k 10 $(($(left) - 90)) "$PY" setup.py -q build_ext \
            --build-temp "$BUILD/temp" --build-lib "$BUILD/lib" &&
        ls "$BUILD"/lib/epkit/_C.*.so &&
        { [ "$1" = 0 ] || ls "$BUILD"/lib/epkit/_C_cuda.*.so; }
}
assemble() {  # this checkout's Python sources + the compiled libraries, as one importable package
    rm -rf "$SITE" &&
        mkdir -p "$SITE" &&
        cp -r python/epkit "$SITE/epkit" &&
        rm -f "$SITE"/epkit/_C*.so &&
        cp -r kernels "$SITE/epkit/kernels" &&
        cp -r collectives "$SITE/epkit/collectives" &&
        cp "$BUILD"/lib/epkit/_C*.so "$SITE/epkit/"
}

if [[ $STEPS == *,build,* ]]; then
    time_for build 150 || finish
    say "build: epkit._C and epkit._C_cuda for this Python (log: $OUT/build.log)"
    compile 1 >"$OUT/build.log" 2>&1
    rc=$?
    tail -n 3 "$OUT/build.log"
    if [ "$rc" -ne 0 ]; then
        failed build "$rc"
        # A build stopped by its time limit would only be stopped again.
        [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] && time_for "build without epkit._C_cuda" 240 || finish
        say "build: again without epkit._C_cuda, so that the kernel sections still run (nvshmem will fail)"
        compile 0 >>"$OUT/build.log" 2>&1 || finish
    fi
fi
if ! assemble >>"$OUT/build.log" 2>&1; then
    say "no compiled libraries in $BUILD/lib to assemble: run the build step (log: $OUT/build.log)"
    [ "$status" -ne 0 ] || status=3
    finish
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import epkit, epkit._C; print('epkit from', epkit.__file__)" >>"$OUT/env.txt" 2>&1; then
    tail -n 5 "$OUT/env.txt"
    failed "importing epkit / epkit._C" 3
    finish
fi
"$PY" -c "import epkit._C_cuda" >>"$OUT/env.txt" 2>&1 || failed "importing epkit._C_cuda (see env.txt)" 3
tail -n 1 "$OUT/env.txt"

if [[ $STEPS == *,warm,* ]] && time_for warm 150; then
    say "warm: every Triton kernel at the run's sizes, compiled into Triton's cache (log: $OUT/warm.log)"
    timeout -k 10 120 "$PY" -m epkit.testing.rung3 warm --out "$OUT/compile.json" >"$OUT/warm.log" 2>&1
    rc=$?
    tail -n 5 "$OUT/warm.log"
    [ "$rc" -eq 0 ] || failed warm "$rc"
fi
if [[ $STEPS == *,check,* ]] && time_for check 90; then
    fixed=()
    [[ ",$SECTIONS," != *,nvshmem,* ]] || fixed=(--section-budget nvshmem=150)
    say "check: bench/gpu_check.py --device $DEVICE --sections $SECTIONS --budget $BUDGET ${fixed[*]} ${GPU_RUN_ARGS:-}"
    # shellcheck disable=SC2086  # GPU_RUN_ARGS is a list of words
    timeout -k 15 $(($(left) - 20)) "$PY" bench/gpu_check.py --device "$DEVICE" --sections "$SECTIONS" \
        --budget "$BUDGET" "${fixed[@]}" --out "$OUT/gpu_check.json" ${GPU_RUN_ARGS:-} 2>&1 | tee "$OUT/gpu_check.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || failed check "$rc"
fi
if [[ $STEPS == *,tests,* ]] && time_for tests 60; then
    say "tests: pytest -m gpu, $(left) s left (log: $OUT/pytest_gpu.log)"
    timeout -k 10 $(($(left) - 10)) "$PY" -m pytest -v -m gpu -rs -p no:cacheprovider --timeout 120 \
        --durations 10 tests >"$OUT/pytest_gpu.log" 2>&1 || failed tests $?
    tail -n 15 "$OUT/pytest_gpu.log"
fi
finish
