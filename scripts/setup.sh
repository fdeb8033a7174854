#!/usr/bin/env bash
# Creates .venv and installs epkit with its pinned CPU stack (pyproject.toml holds every pin), one timed step at
# a time: the virtual environment, the dependencies (resolved and downloaded by pip, whose progress shows),
# the C++ extension epkit._C, and the CUDA/NVSHMEM extension epkit._C_cuda when it is on.
#
# epkit._C_cuda (csrc/cuda, compiled by nvcc for sm_90 against the ~280 MB nvidia-nvshmem wheel):
#   EPKIT_CUDA=1   build it (needs nvcc)          EPKIT_CUDA=0   never build it
#   unset (auto)   build it when nvcc is on PATH and a CUDA device is present, when `--tests` asks for it (the
#                  test suite compiles it without a GPU: rung 3 of the verification ladder), or when .venv
#                  already has the NVSHMEM wheel from an earlier run.
#
# Idempotent and quiet when there is nothing to do: each step runs again only when what it installs from
# changed (pyproject.toml and the extras; setup.py and csrc/). Everything it prints goes to stderr, so
# `bash scripts/run.sh info --json` stays machine-readable on a first run.
set -euo pipefail
cd "$(dirname "$0")/.."
exec 1>&2

tests=0
for arg in "$@"; do
    case "$arg" in
        --tests) tests=1 ;;
        *) echo "usage: bash scripts/setup.sh [--tests]" && exit 2 ;;
    esac
done

PY=${PYTHON:-python3}
VPY=.venv/bin/python
STAMP=.venv/.epkit-install-stamp
PIP=("$VPY" -m pip --disable-pip-version-check)

stamp_of() { [ -f "$STAMP" ] && sed -n "s/^$1=//p" "$STAMP" || true; }
now() { echo "${EPOCHREALTIME:-$(date +%s)}"; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
say() { echo "epkit setup: $*"; }

# --- the CUDA/NVSHMEM decision, and the one line that says how to change it ------------------------------
nvcc_major=""
if command -v nvcc >/dev/null 2>&1; then
    nvcc_major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
fi
has_gpu() { [ -e /dev/nvidia0 ] || { command -v nvidia-smi >/dev/null 2>&1 && timeout 20 nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }; }
has_nvshmem() { [ -x "$VPY" ] && "$VPY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('nvidia.nvshmem') is None)" 2>/dev/null; }
flag=$(echo "${EPKIT_CUDA:-auto}" | tr '[:upper:]' '[:lower:]')
case "$flag" in
    1 | on | true | yes) cuda=1 why="EPKIT_CUDA=$EPKIT_CUDA" ;;
    0 | off | false | no) cuda=0 why="EPKIT_CUDA=$EPKIT_CUDA" ;;
    auto)
        if [ -z "$nvcc_major" ]; then cuda=0 why="no nvcc on PATH"
        elif has_gpu; then cuda=1 why="a CUDA device and nvcc $nvcc_major found"
        elif [ "$tests" = 1 ]; then cuda=1 why="nvcc $nvcc_major found: the tests compile csrc/cuda for sm_90 (rung 3)"
        elif [ -n "$(stamp_of cuda)" ] || has_nvshmem; then cuda=1 why=".venv already has it from an earlier run"
        else cuda=0 why="no CUDA device here"
        fi ;;
    *) echo "epkit setup: EPKIT_CUDA must be 1, 0 or unset (auto), got '$EPKIT_CUDA'" && exit 2 ;;
esac
EXTRAS=${EPKIT_EXTRAS:-cpu,kernels,tilelang,dev}
if [ "$cuda" = 1 ]; then
    case "$nvcc_major" in
        12 | 13) case ",$EXTRAS," in *,cuda1[23],*) ;; *) EXTRAS=$EXTRAS,cuda$nvcc_major ;; esac ;;
        "") echo "epkit setup: $why asks for the CUDA extension, but nvcc is not on PATH" && exit 2 ;;
        *) echo "epkit setup: nvcc $nvcc_major: no nvidia-nvshmem wheel is pinned for it (cuda12, cuda13)" && exit 2 ;;
    esac
    cuda_line="CUDA/NVSHMEM extension epkit._C_cuda: on ($why; EPKIT_CUDA=0 turns it off)"
else
    cuda_line="CUDA/NVSHMEM extension epkit._C_cuda: off ($why; EPKIT_CUDA=1 builds it: +280 MB NVSHMEM wheel, nvcc)"
fi

# --- what each step installs from, against what the last run installed -----------------------------------
read_reqs() {
    # build-system.requires + dependencies + the extras' requirements, straight from pyproject.toml, then the
    # versions of [tool.epkit]'s `ci` entry pinned: the torch CI tests beside, exactly the Triton (and, with the
    # cuda13 extra, the NVSHMEM wheel) that torch requires on the public index.
    "$VPY" - "$EXTRAS" <<'EOF'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10: the TOML reader pip vendors
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    meta = tomllib.load(f)
project, extras = meta["project"], meta["project"]["optional-dependencies"]
reqs = [*meta["build-system"]["requires"], *project["dependencies"]]
names = sys.argv[1].split(",")
for name in names:
    if name not in extras:
        sys.exit(f"epkit setup: unknown extra {name!r} (EPKIT_EXTRAS); pyproject.toml has {sorted(extras)}")
    reqs += extras[name]
(ci,) = [entry for entry in meta["tool"]["epkit"]["tested"] if entry.get("ci")]
for key, extra in {"torch": "cpu", "triton": "kernels", "nvshmem-cu13": "cuda13"}.items():
    if "cpu" in names and extra in names:  # the torch is ours to choose: it and what it requires
        reqs.append(f"{'nvidia-' if key.startswith('nvshmem') else ''}{key}=={ci[key]}")
print("\n".join(dict.fromkeys(reqs)))
EOF
}
# epkit._C: setup.py, its build requirements and csrc/ but csrc/cuda; epkit._C_cuda: setup.py, csrc/cuda, the arch.
c_key() {
    (sed -n '/^\[build-system\]/,/^\[project\]/p' pyproject.toml; cat setup.py
        find csrc -path csrc/cuda -prune -o -type f -print | sort | xargs cat) | sha256sum | cut -d' ' -f1
}
cuda_key() { (echo "${EPKIT_CUDA_ARCH:-sm_90}"; cat setup.py; find csrc/cuda -type f | sort | xargs cat) | sha256sum | cut -d' ' -f1; }
write_stamp() { { echo "deps=$1"; echo "c=$2"; echo "cuda=$3"; } > "$STAMP"; }

if [ ! -x "$VPY" ]; then
    t=$(now)
    "$PY" -m venv .venv
    say "[venv] created .venv with $("$VPY" --version) ($(since "$t"))"
fi
# A clone folder named `epkit` must not shadow the install when Python runs from the clone's parent directory:
# setuptools' editable finder runs after the path scan, which takes that folder for a namespace package.
site=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cmp -s scripts/epkit-finder-first.pth "$site/epkit-finder-first.pth" || cp scripts/epkit-finder-first.pth "$site/"
reqs_text=$(read_reqs)
mapfile -t REQS <<<"$reqs_text"
deps_key=$(echo "$reqs_text" | sha256sum | cut -d' ' -f1)
want_c=$(c_key)
want_cuda=""
[ "$cuda" = 1 ] && want_cuda=$(cuda_key)
# the extensions that do not import, asked of one interpreter (importing epkit imports torch: seconds)
broken=$("$VPY" -c '
import importlib
for name in ("epkit._C", "epkit._C_cuda"):
    try:
        importlib.import_module(name)
    except ImportError:
        print(name)
' 2>/dev/null || echo "epkit._C epkit._C_cuda")
broken=" $(echo $broken) "  # one line, each name between spaces
need_c=0 need_cuda=0
{ [ "$(stamp_of c)" != "$want_c" ] || [[ "$broken" == *" epkit._C "* ]]; } && need_c=1
[ "$cuda" = 1 ] && { [ "$(stamp_of cuda)" != "$want_cuda" ] || [[ "$broken" == *" epkit._C_cuda "* ]]; } && need_cuda=1
if [ "$(stamp_of deps)" = "$deps_key" ] && [ "$need_c" = 0 ] && [ "$need_cuda" = 0 ]; then
    exit 0
fi
say "$cuda_line"

if [ "$(stamp_of deps)" != "$deps_key" ]; then
    t=$(now)
    say "[dependencies] epkit[$EXTRAS]: resolving, downloading and installing ${#REQS[@]} pinned requirements (pip's progress follows)"
    "${PIP[@]}" install --progress-bar on "${REQS[@]}"
    say "[dependencies] done ($(since "$t"))"
    write_stamp "$deps_key" "$(stamp_of c)" "$(stamp_of cuda)"
fi
if [ "$need_c" = 1 ]; then
    jobs=${EPKIT_BUILD_JOBS:-0}
    [ "$jobs" = 0 ] && jobs=$(nproc 2>/dev/null || echo 1)
    t=$(now)
    say "[build epkit._C] compiling csrc/*.cpp (C++17, $jobs parallel jobs) and installing epkit in editable mode ..."
    # pip's verbose output to a log; setup.py's `epkit build: [k/n] compiling ...` lines from it to the screen
    log=.venv/epkit-build.log
    set +e
    EPKIT_CUDA=0 "${PIP[@]}" install -v --no-build-isolation --no-deps -e . 2>&1 | tee "$log" |
        { grep --line-buffered 'epkit build: \[' | sed -u 's/.*epkit build: /epkit setup: [build epkit._C]   /'; true; }
    status=${PIPESTATUS[0]}
    set -e
    if [ "$status" != 0 ]; then
        tail -n 40 "$log"
        say "[build epkit._C] failed: pip exited $status (its whole output: $log)"
        exit "$status"
    fi
    say "[build epkit._C] done ($(since "$t"))"
    write_stamp "$deps_key" "$want_c" "$(stamp_of cuda)"
fi
if [ "$need_cuda" = 1 ]; then
    t=$(now)
    say "[build epkit._C_cuda] compiling csrc/cuda/*.cu with nvcc for ${EPKIT_CUDA_ARCH:-sm_90} against NVSHMEM ..."
    # in place, next to epkit._C (where the editable install looks), without building epkit._C again
    EPKIT_CUDA=only "$VPY" setup.py -q build_ext --inplace
    say "[build epkit._C_cuda] done ($(since "$t"))"
    write_stamp "$deps_key" "$want_c" "$want_cuda"
fi

say "ready: $("$VPY" -c 'import epkit; print("epkit", epkit.__version__)' 2>&1 | tail -1) in .venv"
