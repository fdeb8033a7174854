"""Small shared helpers: argument checks, a device-aware timer, the GEMMs' similarity measure."""

from __future__ import annotations

import operator
import time
from collections.abc import Callable

import torch

__all__ = ["ROW_ALIGN", "calc_diff", "check_int", "check_topk_idx", "time_per_call"]

#: Row block of the CPU matrix products that must give a row the same bits whatever rows share its product.
#: The CPU BLAS computes a row with other arithmetic for some small row counts (seen with MKL on an AVX2 EPYC:
#: 1-3 rows, and with two threads also 5-7 and 9-11), so a row's bits would depend on how many rows share its
#: product (two-batch overlap halves them, a CP rank holds a share of them, an expert gets other tokens).
#: Products taken in whole blocks of this many rows (zero-padded) compute every row alike; the grouped GEMM's
#: CPU path and the reference model's dense layers do.
ROW_ALIGN = 8


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - 2*sum(x*y) / sum(x*x + y*y)`` in float64: 0 for equal tensors, scale-free (DeepGEMM's measure; the
    GEMMs' self-checks and the tests compare with it).

    Two all-zero tensors give 0.0. The sums run over chunks of 2**22 elements, so memory stays bounded for any size
    (a whole-tensor float64 copy of a [8192, 8, 4096] output took 2 GiB per temporary).
    """
    if x.shape != y.shape:
        raise ValueError(f"calc_diff: shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
    xf, yf = x.reshape(-1), y.reshape(-1)
    denom = torch.zeros((), dtype=torch.float64, device=x.device)
    cross = torch.zeros((), dtype=torch.float64, device=x.device)
    step = 1 << 22
    for start in range(0, xf.numel(), step):
        xc, yc = xf[start : start + step].double(), yf[start : start + step].double()
        denom += (xc * xc + yc * yc).sum()
        cross += (xc * yc).sum()
    if float(denom) == 0.0:
        return 0.0
    return float(1 - 2 * cross / denom)


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


def check_topk_idx(topk_idx, num_experts: int, num_topk: int | None = None, check_values: bool = True) -> None:
    """Validate a ``[num_tokens, top_k]`` int32/int64 expert-id matrix with values in ``[-1, num_experts)``.

    The message names the first offending entry (``topk_idx[t, k] = v``). ``check_values=False``
    skips the value scan (one device->host sync on GPU).
    """
    if (
        not isinstance(topk_idx, torch.Tensor)
        or topk_idx.dim() != 2
        or topk_idx.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"topk_idx must be a 2-D [num_tokens, top_k] int32 or int64 tensor, got "
            f"{getattr(topk_idx, 'dtype', type(topk_idx).__name__)} of shape "
            f"{tuple(getattr(topk_idx, 'shape', ()))}"
        )
    if num_topk is not None and topk_idx.shape[1] != num_topk:
        raise ValueError(f"topk_idx has shape {tuple(topk_idx.shape)}, expected ({topk_idx.shape[0]}, {num_topk})")
    if check_values and topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            t, k = (int(i) for i in (topk_idx == bad).nonzero()[0])
            raise ValueError(f"topk_idx[{t}, {k}] = {bad} is outside [-1, {num_experts})")
