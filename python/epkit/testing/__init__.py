"""The verification ladder as shared test utilities (see ARCHITECTURE.md).

Rung 1-2 comparisons
    calc_diff, assert_diff, assert_bitwise_equal
Rung 2: kernel source on the CPU
    run_triton_interpreted (Triton interpreter), tilelang_build_c (TileLang C target)
Rung 3: compiled for sm_90 without a GPU
    epkit.testing.launches (every Triton launch as recorded, through Triton's own specialization),
    tilelang_compile_cuda (lowered source + nvcc)
Rung 4: executed on a GPU
    epkit.testing.markers.requires_cuda (skips with a reason where there is no GPU)
Multi-rank
    epkit.testing.multiprocess.run_ranks / ranks (real processes, gloo, timeouts)
    epkit.testing.hosts.run_hosts (ranks on emulated hosts: own network, UTS and mount namespaces; root)

Importing this module needs only torch; each helper imports its framework when called.
"""

from __future__ import annotations

import torch

from epkit.testing.hosts import namespaces_unavailable, run_hosts
from epkit.testing.ladder import (
    CompiledKernel,
    nvcc_compile,
    run_triton_interpreted,
    tilelang_build_c,
    tilelang_compile_cuda,
)
from epkit.testing.multiprocess import RankError, run_ranks
from epkit.utils import calc_diff

__all__ = [
    "calc_diff",
    "assert_diff",
    "assert_bitwise_equal",
    "run_triton_interpreted",
    "CompiledKernel",
    "nvcc_compile",
    "tilelang_build_c",
    "tilelang_compile_cuda",
    "run_ranks",
    "RankError",
    "run_hosts",
    "namespaces_unavailable",
    "how_it_ends",
]


def how_it_ends(fn, error: type[BaseException] = TimeoutError) -> tuple[str, float]:
    """``(message, seconds)`` of calling ``fn()``: the text of the ``error`` it raised (``"no error"`` if it
    returned) and how long it took: what a fault test's surviving rank reports."""
    import time

    t0 = time.monotonic()
    try:
        fn()
    except error as exc:
        return str(exc), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def assert_diff(actual: torch.Tensor, expected: torch.Tensor, max_diff: float, ctx: str = "") -> float:
    """Assert ``calc_diff(actual, expected) <= max_diff``; returns the diff. NaN/Inf fail."""
    if not torch.isfinite(actual.double()).all():
        raise AssertionError(f"{ctx}: actual holds NaN or Inf")
    d = calc_diff(actual, expected)
    if not d <= max_diff:
        raise AssertionError(f"{ctx}: calc_diff = {d:.3e} > {max_diff:.1e}")
    return d


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8).view(-1, t.element_size()) if t.numel() else t.reshape(-1, 1)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, ctx: str = "") -> None:
    """Assert equal dtype, shape and bytes (NaN payloads and signed zeros included).

    The message names ``ctx`` (pass the case, e.g. ``f"{m=} {k=}"``), the number
    of mismatching elements and the first one with both values.
    """
    where = f"{ctx}: " if ctx else ""
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{where}dtype {actual.dtype} != expected {expected.dtype}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{where}shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = _bits(actual.cpu()), _bits(expected.cpu())
    if torch.equal(a, e):
        return
    bad = (a != e).reshape(actual.numel(), -1).any(dim=1).nonzero().flatten()
    first = int(bad[0])
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(actual.shape))) if actual.dim() else ()
    av = actual.detach().cpu().reshape(-1)[first].item()
    ev = expected.detach().cpu().reshape(-1)[first].item()
    raise AssertionError(
        f"{where}{bad.numel()} of {actual.numel()} elements differ; first at {pos}: {av!r} != expected {ev!r}"
    )
