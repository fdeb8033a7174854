"""Compile TileLang prim_funcs: C target for CPU tensors, CUDA for GPU tensors, sm_90 lowering without a GPU.

Facts this module relies on (tilelang 0.1.15):
* the C target is built by g++ with no optimisation flag unless given, so -O3 is passed;
* the C target has no bfloat16: kernels that only move data take integer word views;
* the CPU grid is a serial loop; :func:`run_rows_parallel` splits rows across threads
  (the call releases the GIL), one contiguous chunk per thread;
* lowering for CUDA needs a ``tvm.target.Target`` context; the generated source
  compiles with ``nvcc -std=c++20`` against tilelang's templates and CUTLASS.
"""

from __future__ import annotations

import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import tilelang
import torch

CUDA_SM90 = {"kind": "cuda", "arch": "sm_90"}
_C_FLAGS = ["-O3"]

# A repeated compile of an identical function logs a WARNING through a handler
# pinned to DEBUG; keep tilelang's handlers at ERROR.
for _h in logging.getLogger("tilelang").handlers:
    _h.setLevel(logging.ERROR)


def language(dialect: str):
    """The TileLang language module for a dialect, and the ``T.Kernel`` keyword arguments it needs."""
    if dialect == "cpu":
        import tilelang.cpu.language as T

        return T, {}
    if dialect == "cuda":
        import tilelang.language as T

        return T, {"threads": 128}
    raise ValueError(f"unknown TileLang dialect {dialect!r}; expected 'cpu' or 'cuda'")


def build_c(prim_func):
    """Compile with the C target; the result is called with CPU tensors."""
    return tilelang.compile(prim_func, target="c", compile_flags=_C_FLAGS)


def build_cuda(prim_func):
    """Compile for the visible GPU; the result is called with CUDA tensors."""
    return tilelang.compile(prim_func, target="cuda")


def lower_cuda(prim_func, arch: str = "sm_90") -> str:
    """Lower for CUDA ``arch`` without a GPU; returns the generated CUDA C++ source."""
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": arch})
    with target:
        artifact = tilelang.lower(prim_func, target=target)
    return artifact.kernel_source


def cuda_include_dirs() -> tuple[str, ...]:
    """Include directories the generated CUDA source needs (tilelang templates, CUTLASS)."""
    from tilelang import env

    return (env.TILELANG_TEMPLATE_PATH, env.CUTLASS_INCLUDE_DIR)


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="epkit-tilelang")


def run_rows_parallel(kernel, num_rows: int, call, min_rows_per_thread: int = 256) -> None:
    """Run ``call(kernel, start, end)`` over row chunks on ``torch.get_num_threads()`` threads.

    Row chunks are disjoint and contiguous, so the result is identical to one call.
    """
    workers = max(1, min(torch.get_num_threads(), num_rows // max(min_rows_per_thread, 1)))
    if workers == 1:
        call(kernel, 0, num_rows)
        return
    step = -(-num_rows // workers)
    futures = [_pool(workers).submit(call, kernel, s, min(s + step, num_rows)) for s in range(0, num_rows, step)]
    for f in futures:
        f.result()


def _cpu_only_env() -> None:
    """tilelang's default target detector fails without a GPU; every epkit call passes a target."""
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")


_cpu_only_env()
