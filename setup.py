"""Build script for epkit.

Layout (see ARCHITECTURE.md): python/epkit -> epkit, kernels -> epkit.kernels,
collectives -> epkit.collectives, csrc -> the pybind11 extension epkit._C.

CUDA sources in csrc/cuda/*.cu build into epkit._C_cuda with nvcc for sm_90
when EPKIT_CUDA=1, or automatically when nvcc and an nvidia-nvshmem wheel are
found (EPKIT_CUDA=0 turns that off; EPKIT_CUDA=only builds epkit._C_cuda alone, which
``scripts/setup.sh`` uses to build and time it as a step of its own with ``setup.py build_ext --inplace``).
A missing CUDA toolchain never breaks the CPU build. ``py.typed`` ships with the package (PEP 561:
epkit's annotations are for type checkers).
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import subprocess
import sys
import sysconfig
import threading

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, has_flag
from pybind11.setup_helpers import build_ext as _pybind_build_ext
from setuptools import Extension, find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIR = {"epkit": "python/epkit", "epkit.kernels": "kernels", "epkit.collectives": "collectives"}


def _packages() -> list[str]:
    pkgs = []
    for name, path in PACKAGE_DIR.items():
        pkgs.append(name)
        pkgs += [f"{name}.{sub}" for sub in find_packages(os.path.join(ROOT, path))]
    return pkgs


def _find_nvshmem() -> str | None:
    """Root of an installed nvidia-nvshmem wheel (has include/ and lib/), or None."""
    roots = [os.environ.get("NVSHMEM_HOME", "")]
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        roots.append(os.path.join(site, "nvidia", "nvshmem"))
        roots += glob.glob(os.path.join(site, "nvidia", "cu*", "nvshmem"))
    for root in roots:
        if root and os.path.exists(os.path.join(root, "include", "nvshmem.h")):
            return root
    return None


def _cuda_wanted() -> tuple[bool, str]:
    flag = os.environ.get("EPKIT_CUDA", "auto").lower()
    nvcc = shutil.which("nvcc")
    nvshmem = _find_nvshmem()
    if flag in ("0", "off", "false", "no"):
        return False, "EPKIT_CUDA=0"
    missing = [what for what, ok in (("nvcc", nvcc), ("nvidia-nvshmem wheel", nvshmem)) if not ok]
    if flag in ("1", "on", "true", "yes", "only"):
        if missing:
            raise RuntimeError(
                f"EPKIT_CUDA={'only' if flag == 'only' else 1} but no {' and no '.join(missing)} found; "
                "install CUDA and `pip install -e .[cuda12]` (or cuda13)"
            )
        return True, "EPKIT_CUDA=only" if flag == "only" else "EPKIT_CUDA=1"
    return (not missing), ("auto: found nvcc and nvshmem" if not missing else f"auto: no {', '.join(missing)}")


def _build_jobs() -> int:
    """Parallel compile jobs: EPKIT_BUILD_JOBS (1 = one at a time), else, or when 0, every core."""
    raw = os.environ.get("EPKIT_BUILD_JOBS", "")
    try:
        jobs = int(raw) if raw else 0
    except ValueError:
        raise SystemExit(f"EPKIT_BUILD_JOBS must be a whole number, got {raw!r}") from None
    return jobs if jobs > 0 else (os.cpu_count() or 1)


# csrc/*.cpp compile side by side, and epkit._C_cuda's nvcc build runs beside them.
ParallelCompile(default=_build_jobs()).install()


class CUDAExtension(Extension):
    """Marker: sources compiled with nvcc -rdc=true for sm_90 and device-linked with NVSHMEM."""


class build_ext(_pybind_build_ext):
    def finalize_options(self):
        if self.parallel is None and _build_jobs() > 1:
            self.parallel = _build_jobs()
        super().finalize_options()

    def build_extension(self, ext):
        if isinstance(ext, CUDAExtension):
            return self._build_cuda(ext)
        if ext.name == "epkit._C" and has_flag(self.compiler, "-fopenmp"):
            # csrc/parallel.h: the CPU kernels' threads are then an OpenMP team (torch's libgomp at run time)
            ext.extra_compile_args = [*ext.extra_compile_args, "-fopenmp"]
            ext.extra_link_args = [*ext.extra_link_args, "-fopenmp"]
        if ext.name == "epkit._C":
            self._say_each_compile(len(ext.sources))
        return super().build_extension(ext)

    def _say_each_compile(self, total: int) -> None:
        """One ``epkit build: [k/n] compiling csrc/x.cpp`` line on stderr as each source starts (the compile
        takes about a minute on 2 cores; scripts/setup.sh shows these lines out of pip's verbose output)."""
        compile_one, started, lock = self.compiler._compile, itertools.count(1), threading.Lock()

        def _compile(obj, src, *args, **kwargs):
            with lock:  # the compiles run in threads: one whole line at a time
                sys.stderr.write(f"epkit build: [{next(started)}/{total}] compiling {src}\n")
                sys.stderr.flush()
            return compile_one(obj, src, *args, **kwargs)

        self.compiler._compile = _compile

    def _build_cuda(self, ext: CUDAExtension) -> None:
        import pybind11

        nvcc = shutil.which("nvcc")
        nvshmem = _find_nvshmem()
        out = self.get_ext_fullpath(ext.name)
        tmp = os.path.join(self.build_temp, "cuda")
        os.makedirs(tmp, exist_ok=True)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        arch = os.environ.get("EPKIT_CUDA_ARCH", "sm_90")
        inc = [f"-I{nvshmem}/include", f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
        common = ["-std=c++17", f"-arch={arch}", "-O3", "-Xcompiler", "-fPIC", "-rdc=true"]
        objs = []
        for src in ext.sources:
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            self._run([nvcc, *common, *inc, "-c", src, "-o", obj])
            objs.append(obj)
        lib = os.path.join(nvshmem, "lib")
        dlink = os.path.join(tmp, "dlink.o")
        self._run(
            [
                nvcc,
                f"-arch={arch}",
                "-Xcompiler",
                "-fPIC",
                "-dlink",
                *objs,
                os.path.join(lib, "libnvshmem_device.a"),
                "-o",
                dlink,
            ]
        )
        self._run(
            [
                nvcc,
                "-shared",
                f"-arch={arch}",
                *objs,
                dlink,
                os.path.join(lib, "libnvshmem_device.a"),
                f"-L{lib}",
                "-l:libnvshmem_host.so.3",
                "-lcudart",
                "-Xlinker",
                f"-rpath,{lib}",
                "-o",
                out,
            ]
        )

    @staticmethod
    def _run(cmd: list[str]) -> None:
        print(" ".join(cmd), file=sys.stderr)
        subprocess.check_call(cmd)


def _extensions():
    exts = []
    if os.environ.get("EPKIT_CUDA", "").lower() != "only":
        exts.append(
            Pybind11Extension(
                "epkit._C",
                sorted(glob.glob("csrc/*.cpp")),
                depends=sorted(glob.glob("csrc/*.h")),
                cxx_std=17,
                # No FMA contraction: the fused reductions must round like their torch formulation.
                extra_compile_args=["-O3", "-ffp-contract=off"],
            )
        )
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    want, why = _cuda_wanted()
    print(f"epkit: CUDA extension {'enabled' if want and cuda_sources else 'skipped'} ({why})", file=sys.stderr)
    if want and cuda_sources:
        exts.append(CUDAExtension("epkit._C_cuda", cuda_sources))
    return exts


setup(
    package_dir=PACKAGE_DIR,
    packages=_packages(),
    package_data={"epkit": ["py.typed"]},
    ext_modules=_extensions(),
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
