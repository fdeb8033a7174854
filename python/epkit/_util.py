"""Small shared helpers: argument checks and a device-aware timer for the kernel scripts."""

from __future__ import annotations

import operator
import time
from collections.abc import Callable

import torch


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as an int ``>= minimum``; ValueError naming ``name`` otherwise (bools rejected)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def time_per_call(fn: Callable[[], object], device: str | torch.device, reps: int = 10) -> float:
    """Seconds per call of ``fn`` after one warm-up call (synchronising CUDA around the loop)."""
    cuda = torch.device(device).type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps
