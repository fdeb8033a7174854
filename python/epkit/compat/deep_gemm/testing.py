"""DeepGEMM's ``deep_gemm.testing``: the helpers its tests import (comparison, byte counts, timing, test filters).

The comparisons are DeepGEMM's. The timers are host-side stand-ins: DeepGEMM's profile CUDA kernels (events,
kineto) on a GPU; these time whole calls with ``time.perf_counter`` on any device (synchronising CUDA around
them when a GPU is present), so a test that prints a kernel's time runs on a CPU too, with figures that include
launch overheads.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import ParamSpec

import torch

from epkit.utils import calc_diff

__all__ = [
    "bench",
    "bench_kineto",
    "calc_diff",
    "count_bytes",
    "assert_bitwise_equal",
    "get_arch_major",
    "test_filter",
    "ignore_env",
]

_P = ParamSpec("_P")
#: The compute capability major whose semantics epkit.compat.deep_gemm follows (SM90, Hopper).
_EPKIT_ARCH_MAJOR = 9


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(fn: Callable[[], object], num_warmups: int = 5, num_tests: int = 10, high_precision: bool = False) -> float:
    """Seconds per call of ``fn``: ``num_warmups`` calls, then ``num_tests`` calls timed together with
    ``time.perf_counter`` (CUDA synchronised before and after). A stand-in for DeepGEMM's CUDA-event timer, which
    also flushes the L2 cache first; ``high_precision`` (its warm-up GEMM) changes nothing here."""
    for _ in range(num_warmups):
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(num_tests):
        fn()
    _sync()
    return (time.perf_counter() - start) / max(num_tests, 1)


def bench_kineto(
    fn: Callable[[], object],
    kernel_names: str | tuple[str, ...],
    num_tests: int = 30,
    suppress_kineto_output: bool = False,
    trace_path: str | None = None,
    flush_l2: bool = True,
    with_multiple_kernels: bool = False,
    barrier: Callable[[], object] | None = None,
) -> float | tuple[float, ...]:
    """Seconds per call of ``fn``, timed on the host: one warm-up call, then ``num_tests`` calls, each timed alone
    with ``time.perf_counter`` (CUDA synchronised around it; ``barrier``, when given, called before it, outside the
    time). Returns a float, or for a tuple of ``kernel_names`` a tuple with that same figure for each name.

    A stand-in for DeepGEMM's ``bench_kineto``, which profiles the GPU with kineto and returns the mean time of
    each named kernel: this cannot split a call into kernels, so every name gets the whole call's time.
    ``suppress_kineto_output``, ``flush_l2`` and ``with_multiple_kernels`` change nothing and no trace is written
    to ``trace_path``. With ``DG_USE_NVIDIA_TOOLS`` set to a nonzero int, ``fn`` is not run and every name gets 1,
    as in DeepGEMM.
    """
    if not isinstance(kernel_names, (str, tuple)):
        raise ValueError(f"bench_kineto: kernel_names must be a str or a tuple of them, got {kernel_names!r}")
    count = len(kernel_names) if isinstance(kernel_names, tuple) else 0
    if int(os.environ.get("DG_USE_NVIDIA_TOOLS", 0)):
        return (1.0,) * count if count else 1.0
    fn()
    total = 0.0
    for _ in range(num_tests):
        if barrier is not None:
            barrier()
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        total += time.perf_counter() - start
    per_call = total / max(num_tests, 1)
    return (per_call,) * count if count else per_call


def count_bytes(*tensors: object) -> int:
    """Bytes held by the tensors given, tuples and lists of them counted through, None skipped."""
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def assert_bitwise_equal(x: torch.Tensor, y: torch.Tensor, label: str = "") -> None:
    """Raise ``AssertionError`` unless ``x`` and ``y`` have one shape, one dtype and the same bytes; the message
    names the first differing byte, its element's coordinate and both values."""
    where = f" ({label})" if label else ""
    if x.shape != y.shape or x.dtype != y.dtype:
        raise AssertionError(f"bitwise mismatch{where}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}")
    xb, yb = (t.contiguous().reshape(-1).view(torch.uint8) for t in (x, y))
    differ = xb != yb
    if not bool(differ.any()):
        return
    first = int(differ.nonzero()[0])
    elem = first // x.element_size()
    coord = tuple(int(i) for i in torch.unravel_index(torch.tensor(elem), tuple(x.shape)))
    raise AssertionError(
        f"bitwise mismatch{where}: {int(differ.sum())} of {xb.numel()} bytes differ; the first is byte {first}, "
        f"byte {first % x.element_size()} of element {elem} at {coord}: {int(xb[first])} vs {int(yb[first])} "
        f"(values {x.reshape(-1)[elem].item()} vs {y.reshape(-1)[elem].item()})"
    )


def get_arch_major() -> int:
    """The CUDA device's compute capability major (9 on an H100); without a CUDA device, 9: the architecture whose
    semantics epkit.compat.deep_gemm follows (SM90), so DeepGEMM's tests pick the SM90 cases."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability()[0]
    return _EPKIT_ARCH_MAJOR


def test_filter(condition: Callable[[], object]) -> Callable[[Callable[_P, object]], Callable[_P, None]]:
    """Decorator: the function runs only when ``condition()`` is true; otherwise its name and the condition are
    printed. (A test helper, not a pytest test.)"""

    def decorator(func: Callable[_P, object]) -> Callable[_P, None]:
        @functools.wraps(func)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> None:
            if condition():
                func(*args, **kwargs)
            else:
                print(f"{func.__name__}:\n > Filtered by {condition}\n")

        return wrapper

    return decorator


test_filter.__test__ = False  # type: ignore[attr-defined]  # pytest: a helper whose name starts with test_


def ignore_env(name: str, condition: Callable[[], object]) -> Callable[[Callable[_P, object]], Callable[_P, None]]:
    """Decorator: while the function runs, environment variable ``name`` is unset if ``condition()`` is true (and put
    back afterwards, also when the function raises)."""

    def decorator(func: Callable[_P, object]) -> Callable[_P, None]:
        @functools.wraps(func)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> None:
            saved = os.environ.pop(name, None) if condition() else None
            try:
                func(*args, **kwargs)
            finally:
                if saved is not None:
                    os.environ[name] = saved

        return wrapper

    return decorator
