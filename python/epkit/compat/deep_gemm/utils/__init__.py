"""DeepGEMM's ``deep_gemm.utils``: :mod:`.math` (the casts to FP8 / FP4 and UE8M0 packing) and :mod:`.layout` (the
scale layouts and the contiguous layout's alignment), whose names are here too, as in DeepGEMM, and :mod:`.dist`
(its multi-rank test helpers: ``init_dist`` and ``uneven_all_gather`` here too; gloo on the CPU, NCCL with CUDA).
"""

from __future__ import annotations

from typing import NoReturn

from epkit.compat._details.deep_gemm_coverage import missing_name
from epkit.compat.deep_gemm.utils import dist, layout, math
from epkit.compat.deep_gemm.utils.dist import init_dist, uneven_all_gather
from epkit.compat.deep_gemm.utils.layout import *  # noqa: F403  (DeepGEMM's utils binds its modules' names)
from epkit.compat.deep_gemm.utils.math import *  # noqa: F403

__all__ = ["dist", "layout", "math", "init_dist", "uneven_all_gather"]
__all__ += layout.__all__
__all__ += math.__all__


def __getattr__(name: str) -> NoReturn:
    """A DeepGEMM name this module lacks: why, and what to install."""
    raise missing_name(__name__, name)
