"""DeepGEMM's ``deep_gemm.utils``: :mod:`.math` (the casts to FP8 / FP4 and UE8M0 packing) and :mod:`.layout` (the
scale layouts and the contiguous layout's alignment), whose names are here too, as in DeepGEMM.

DeepGEMM's ``utils.dist`` (``init_dist``, ``uneven_all_gather``: its multi-GPU test harness over NCCL) is not
provided; its names raise an ``AttributeError`` saying so.
"""

from __future__ import annotations

from typing import NoReturn

from epkit.compat._details.deep_gemm_coverage import missing_name
from epkit.compat.deep_gemm.utils import layout, math
from epkit.compat.deep_gemm.utils.layout import *  # noqa: F403  (DeepGEMM's utils binds its modules' names)
from epkit.compat.deep_gemm.utils.math import *  # noqa: F403

__all__ = ["layout", "math"]
__all__ += layout.__all__
__all__ += math.__all__


def __getattr__(name: str) -> NoReturn:
    """A DeepGEMM name this module lacks (``init_dist``, ``uneven_all_gather``, ...): why, and what to install."""
    raise missing_name(__name__, name)
