"""DeepGEMM's ``deep_gemm.utils.layout``: the scale-layout helpers and the contiguous layout's alignment, the same
functions as ``epkit.compat.deep_gemm``'s top level (DeepGEMM binds them in both places)."""

from __future__ import annotations

from typing import NoReturn

from epkit.compat._details.deep_gemm_coverage import missing_name
from epkit.compat._details.deep_gemm_runtime import (
    get_k_alignment_for_contiguous_layout,
    get_m_alignment_for_contiguous_layout,
    get_mk_alignment_for_contiguous_layout,
    get_theoretical_mk_alignment_for_contiguous_layout,
    set_mk_alignment_for_contiguous_layout,
)
from epkit.compat._details.deep_gemm_scales import (
    get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_tma_aligned_size,
)

__all__ = [
    "get_tma_aligned_size",
    "get_mn_major_tma_aligned_tensor",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor",
    "set_mk_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout",
    "get_theoretical_mk_alignment_for_contiguous_layout",
    "get_m_alignment_for_contiguous_layout",
    "get_k_alignment_for_contiguous_layout",
]


def __getattr__(name: str) -> NoReturn:
    """A DeepGEMM name this module lacks: why, and what to install meanwhile."""
    raise missing_name(__name__, name)
