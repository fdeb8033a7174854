"""How ``epkit bench`` (and ``bench/gpu_check.py``) times a call.

A sample is one call, or ``calls`` back-to-back calls divided out (on a GPU the host's launch overhead then
overlaps the device's work, as in a real stream): ``time.perf_counter`` around it on the CPU, a pair of
CUDA events on a GPU, optionally after overwriting 256 MiB so that the sample starts with a cold L2 (the
first of ``calls`` back-to-back calls starts cold; the others find what it left there).
:func:`measure` interleaves contenders round by round in a seeded random order (a rotation would keep each
contender behind the same predecessor, whose memory churn would tax it every time); :func:`time_calls`
samples one function (``gpu_check``'s ``Ctx.time_op``). Every figure is milliseconds per call.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["L2Flusher", "measure", "quartiles", "summarize", "synchronize", "time_calls"]


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class L2Flusher:
    """Overwrites 256 MiB of device memory when called, evicting L2 before a sample is timed (CUDA only; with
    ``calls`` > 1 per sample only the first call of the sample starts cold)."""

    NBYTES = 256 << 20

    def __init__(self, device: torch.device):
        self.device = device
        self._buf: torch.Tensor | None = None

    def __call__(self) -> None:
        if self.device.type != "cuda":
            return
        if self._buf is None:
            self._buf = torch.empty(self.NBYTES, dtype=torch.uint8, device=self.device)
        self._buf.zero_()


def _sample(fn: Callable[[], object], device: torch.device, calls: int, flush: Callable[[], None] | None) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls of ``fn``."""
    if flush is not None:
        flush()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3 / calls


def summarize(samples: list[float]) -> dict:
    """``median_ms``, ``min_ms``, ``max_ms`` and ``n`` of per-call milliseconds."""
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples), "n": len(samples)}


def quartiles(values: list[float]) -> tuple[float, float]:
    """The lower and upper quartile (both the value itself when there is one)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def time_calls(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 3,
    iters: int = 20,
    flush: Callable[[], None] | None = None,
    min_iters: int = 3,
    calls: int = 1,
    deadline: float = math.inf,
) -> dict:
    """:func:`summarize` of ``iters`` samples of one function after ``warmup`` calls; stops early (after
    ``min_iters``) once ``time.perf_counter()`` passes ``deadline``, and says so in ``truncated``."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for i in range(iters):
        if i >= min_iters and time.perf_counter() > deadline:
            break
        samples.append(_sample(fn, device, calls, flush))
    return {**summarize(samples), "truncated": len(samples) < iters}


def measure(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    rounds: int,
    warmup: int = 1,
    flush: Callable[[], None] | None = None,
    calls: int = 1,
    before_each: Callable[[], None] | None = None,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Interleaved rounds: every round calls each contender once, in a fresh seeded random order.

    Returns milliseconds per call per round for every contender, aligned by round (sample ``i`` of each
    contender comes from round ``i``, so per-round ratios pair calls made moments apart). ``before_each``
    runs before every sample, untimed (a barrier, so that every rank of a collective starts together; the
    same ``seed`` on every rank gives every rank the same order).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    rng = random.Random(seed)
    names = list(fns)
    out: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        order = names[:]
        rng.shuffle(order)
        for name in order:
            if before_each is not None:
                before_each()
            out[name].append(_sample(fns[name], device, calls, flush))
    return out
