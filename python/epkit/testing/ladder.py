"""Rungs 2 and 3 of the verification ladder: run kernel sources on the CPU, compile them for sm_90.

Every helper imports its framework lazily and raises a clear error when the
framework or a tool (nvcc) is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

__all__ = [
    "CompiledKernel",
    "run_triton_interpreted",
    "nvcc_compile",
    "tilelang_build_c",
    "tilelang_compile_cuda",
]


def run_triton_interpreted(kernel, grid, *args, **kwargs):
    """Run a ``@triton.jit`` kernel on CPU tensors under the Triton interpreter.

    Equivalent to importing the kernel with ``TRITON_INTERPRET=1`` and calling
    ``kernel[grid](*args, **kwargs)``, without touching the environment.
    """
    from epkit.kernels.triton.launch import interpreted

    return interpreted(kernel)[grid](*args, **kwargs)


@dataclass
class CompiledKernel:
    """Artifacts of one ahead-of-time compile for a GPU that need not be present."""

    name: str
    target: str
    source: str  # PTX for Triton, CUDA C++ for TileLang
    ptx: str | None
    cubin: bytes | None
    sass: str | None
    shared: int | None = None  # bytes of shared memory per block (Triton's metadata), where known
    num_warps: int | None = None


def cuda_tool(name: str) -> str | None:
    try:
        import triton.backends.nvidia as nv

        bundled = os.path.join(os.path.dirname(nv.__file__), "bin", name)
        if os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    return shutil.which(name)


def disassemble(cubin: bytes) -> str | None:
    """SASS text of a cubin (cuobjdump from Triton's bundle or PATH), or None if no tool exists."""
    tool = cuda_tool("cuobjdump")
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([tool, "-sass", path], capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {res.stderr.strip()}")
    return res.stdout


def nvcc_compile(
    source: str,
    arch: str = "sm_90",
    include_dirs: tuple[str, ...] = (),
    extra_flags: tuple[str, ...] = (),
    timeout: float = 600,
) -> bytes:
    """Compile CUDA C++ ``source`` to a cubin with nvcc; returns the cubin bytes.

    Raises RuntimeError with nvcc's diagnostics on failure and when nvcc is missing.
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH; install the CUDA toolkit to compile for sm_90")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "kernel.cu")
        out = os.path.join(d, "kernel.cubin")
        with open(src, "w") as f:
            f.write(source)
        cmd = [
            nvcc,
            "-std=c++17",
            f"-arch={arch}",
            "-cubin",
            "-O3",
            "-w",
            *extra_flags,
            *[f"-I{i}" for i in include_dirs],
            src,
            "-o",
            out,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        with open(out, "rb") as f:
            return f.read()


def tilelang_build_c(prim_func):
    """Compile a TileLang ``prim_func`` with the C target; returns a callable taking CPU tensors."""
    from epkit.kernels.tilelang.build import build_c

    return build_c(prim_func)


def tilelang_compile_cuda(prim_func, arch: str = "sm_90", with_cubin: bool = True) -> CompiledKernel:
    """Lower a TileLang ``prim_func`` for CUDA ``arch`` and compile the generated source with nvcc."""
    from epkit.kernels.tilelang.build import cuda_include_dirs, lower_cuda

    source = lower_cuda(prim_func, arch)
    cubin = nvcc_compile(source, arch, cuda_include_dirs()) if with_cubin else None
    return CompiledKernel(
        name=getattr(prim_func, "__name__", "main"),
        target=arch,
        source=source,
        ptx=None,
        cubin=cubin,
        sass=disassemble(cubin) if cubin else None,
    )
