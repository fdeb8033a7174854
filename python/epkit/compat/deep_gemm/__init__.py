"""DeepGEMM's Python interface (deepseek-ai/DeepGEMM, ``deep_gemm``) on epkit's GEMMs: ``import
epkit.compat.deep_gemm as deep_gemm`` where an engine had ``import deep_gemm``.

Names, parameter names and order, defaults and layouts are DeepGEMM's; each call runs on
:mod:`epkit.grouped_gemm` (CPU tensors run too). The semantics are DeepGEMM's on SM90 (Hopper, epkit's GPU
target): float32 scales are used as given, ``disable_ue8m0_cast`` changes nothing, and int32 scales are packed
UE8M0 exponents (four per int32, byte ``j`` for the ``j``-th group, DeepGEMM's ``pack_ue8m0_to_int``), taken
for activations (``sfa``: a scale is ``2 ** (byte - 127)``, as DeepGEMM's ``unpack_ue8m0_from_int`` reads
it) and for MXFP4 weights (one byte per 32 values).

Supported (refusals raise ``ValueError`` naming DeepGEMM's parameter):

- ``recipe`` / ``recipe_a`` / ``recipe_b``: 1x128 activation scales with 128x128 FP8 weight scales
  (``(1, 128, 128)``, the default) or 1x32 MXFP4 weight scales (``recipe_a=(1, 128), recipe_b=(1, 32)``);
- ``compiled_dims`` (which dims DeepGEMM's JIT fixes), ``ensure_zero_padding`` (epkit always writes zeros
  to padding rows) and ``expected_m_for_psum_layout`` (a hint) are checked and have no effect on results;
- the M alignment of the contiguous layout (:func:`set_mk_alignment_for_contiguous_layout`): any multiple of
  128 (epkit's kernels read a 128-row block's group from its first row);
- DeepGEMM's runtime settings (``set_num_sms``, ``set_tc_util``, ``set_pdl``, ``set_ignore_compile_dims``,
  ``set_block_size_multiple_of`` and their getters) are recorded and read back; they steer DeepGEMM's JIT
  kernels and change nothing in epkit's (``epkit.compat._details.deep_gemm_runtime``);
- ``deep_gemm.utils`` (``utils.math``, ``utils.layout``: the casts to FP8 / FP4 of DeepGEMM's tests, bit for
  bit) and ``deep_gemm.testing`` (``calc_diff``, ``bench_kineto`` timed on the host, ...) as submodules; the
  casts and layout helpers are here at the top level too, as in DeepGEMM.

- every layout of the dense GEMMs (``nt``, ``nn``, ``tn``, ``tt``), FP8 K not a multiple of 128 (the last scale
  block covering what is left, as in DeepGEMM) and ``recipe=(1, 1, 128)`` with ``c`` accumulation
  (``epkit.compat._details.deep_gemm_dense``); the K-grouped weight-gradient GEMMs and their packed scales
  (``deep_gemm_k_grouped``); ``cublaslt_gemm_*`` over torch (``deep_gemm_cublaslt``); ``einsum`` / ``fp8_einsum``
  in DeepGEMM's expressions (``deep_gemm_einsum``). Which run on epkit's kernels and which on a torch fallback:
  ``deep_gemm_coverage.PATHS``, shown by ``epkit info``.

- ``m_grouped_fp8_fp4_gemm_nt_contiguous`` with ``recipe=(1, 1, 32)`` (1x32 activation scales, DeepGEMM's SM100
  MXFP8xMXFP4 recipe): a torch fallback (``deep_gemm_mx_grouped``); ``compiled_dims=''`` is taken;
- the Mega MoE interface (:mod:`.mega`: ``get_symm_buffer_for_mega_moe``, ``transform_weights_for_mega_moe``,
  ``fp8_fp4_mega_moe``, ``bf16_mega_moe``) over EPBuffer and the GEMMs above, and ``utils.dist`` (``init_dist``,
  ``uneven_all_gather``, ``dist_print``: gloo on the CPU).

Not provided: FP4 activations, and DeepGEMM's names in the tables of ``epkit.compat._details.deep_gemm_coverage``
(``epkit info`` lists them): the attention-indexer and hyper-connection kernels are outside epkit's scope. Such a
name raises an ``AttributeError`` saying which it is and what to install for it (DeepGEMM itself, on an sm_90 or
sm_100 GPU), an ``ImportError`` with that message under ``from ... import``; a name DeepGEMM does not have says that
instead.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from epkit import grouped_gemm as gemm
from epkit.compat._details.deep_gemm_coverage import missing_name
from epkit.compat._details.deep_gemm_cublaslt import (
    cublaslt_gemm_nn,
    cublaslt_gemm_nt,
    cublaslt_gemm_tn,
    cublaslt_gemm_tt,
)
from epkit.compat._details.deep_gemm_dense import (
    bf16_gemm_nn,
    bf16_gemm_nt,
    bf16_gemm_tn,
    bf16_gemm_tt,
    fp8_fp4_gemm_nn,
    fp8_fp4_gemm_nt,
    fp8_fp4_gemm_tn,
    fp8_fp4_gemm_tt,
    fp8_gemm_nn,
    fp8_gemm_nt,
    fp8_gemm_tn,
    fp8_gemm_tt,
)
from epkit.compat._details.deep_gemm_einsum import einsum, fp8_einsum
from epkit.compat._details.deep_gemm_k_grouped import (
    k_grouped_bf16_gemm_tn_contiguous,
    k_grouped_fp8_gemm_nt_contiguous,
    k_grouped_fp8_gemm_tn_contiguous,
)
from epkit.compat._details.deep_gemm_mx_grouped import is_mx_recipe, m_grouped_fp8_fp4_mx_contiguous
from epkit.compat._details.deep_gemm_operands import (
    Gran,
    Pair,
    Recipe,
    as_nt,
    called_as,
    contiguous_layout,
    fp8_operands,
    named,
)
from epkit.compat._details.deep_gemm_runtime import (
    get_num_sms,
    get_pdl,
    get_tc_util,
    set_block_size_multiple_of,
    set_ignore_compile_dims,
    set_num_sms,
    set_pdl,
    set_tc_util,
)
from epkit.compat._details.deep_gemm_scales import (
    check_flags,
    transform_sf_into_required_layout,
)
from epkit.compat.deep_gemm import mega, testing, utils
from epkit.compat.deep_gemm.mega import (
    SymmBuffer,
    bf16_mega_moe,
    fp8_fp4_mega_moe,
    get_symm_buffer_for_mega_moe,
    transform_weights_for_mega_moe,
)
from epkit.compat.deep_gemm.utils import (  # DeepGEMM's top level has them too (``from .utils import *``)
    align,
    cast_back_from_fp4,
    ceil_div,
    ceil_to_ue8m0,
    get_k_alignment_for_contiguous_layout,
    get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_m_alignment_for_contiguous_layout,
    get_mk_alignment_for_contiguous_layout,
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_theoretical_mk_alignment_for_contiguous_layout,
    get_tma_aligned_size,
    init_dist,
    pack_ue8m0_to_int,
    per_block_cast_to_fp8,
    per_channel_cast_to_fp8,
    per_custom_dims_cast_to_fp8,
    per_token_cast_to_fp4,
    per_token_cast_to_fp8,
    set_mk_alignment_for_contiguous_layout,
    transpose_packed_fp4,
    uneven_all_gather,
    unpack_ue8m0_from_int,
)

#: The DeepGEMM release whose interface this module follows.
__version__ = "2.6.1"

__all__ = [
    "set_num_sms",
    "get_num_sms",
    "set_tc_util",
    "get_tc_util",
    "set_ignore_compile_dims",
    "set_block_size_multiple_of",
    "set_pdl",
    "get_pdl",
    "transform_sf_into_required_layout",
    "fp8_fp4_gemm_nt",
    "fp8_fp4_gemm_nn",
    "fp8_fp4_gemm_tn",
    "fp8_fp4_gemm_tt",
    "fp8_gemm_nt",
    "fp8_gemm_nn",
    "fp8_gemm_tn",
    "fp8_gemm_tt",
    "bf16_gemm_nt",
    "bf16_gemm_nn",
    "bf16_gemm_tn",
    "bf16_gemm_tt",
    "k_grouped_fp8_gemm_nt_contiguous",
    "k_grouped_fp8_gemm_tn_contiguous",
    "k_grouped_bf16_gemm_tn_contiguous",
    "cublaslt_gemm_nt",
    "cublaslt_gemm_nn",
    "cublaslt_gemm_tn",
    "cublaslt_gemm_tt",
    "einsum",
    "fp8_einsum",
    "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "m_grouped_fp8_fp4_gemm_nn_contiguous",
    "m_grouped_fp8_fp4_gemm_nt_masked",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nn_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "m_grouped_bf16_gemm_nt_contiguous",
    "m_grouped_bf16_gemm_nn_contiguous",
    "m_grouped_bf16_gemm_nt_masked",
    "fp8_m_grouped_gemm_nt_masked",
    "bf16_m_grouped_gemm_nt_masked",
    "mega",
    "SymmBuffer",
    "get_symm_buffer_for_mega_moe",
    "transform_weights_for_mega_moe",
    "fp8_fp4_mega_moe",
    "bf16_mega_moe",
    "utils",
    "testing",
    # deep_gemm.utils's names
    "align",
    "cast_back_from_fp4",
    "ceil_div",
    "ceil_to_ue8m0",
    "get_k_alignment_for_contiguous_layout",
    "get_m_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout",
    "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_mn_major_tma_aligned_tensor",
    "get_theoretical_mk_alignment_for_contiguous_layout",
    "get_tma_aligned_size",
    "pack_ue8m0_to_int",
    "per_block_cast_to_fp8",
    "per_channel_cast_to_fp8",
    "per_custom_dims_cast_to_fp8",
    "per_token_cast_to_fp4",
    "per_token_cast_to_fp8",
    "set_mk_alignment_for_contiguous_layout",
    "transpose_packed_fp4",
    "unpack_ue8m0_from_int",
    "init_dist",
    "uneven_all_gather",
]


def __getattr__(name: str) -> NoReturn:
    """A DeepGEMM name this module lacks: an ``AttributeError`` saying whether epkit means to provide it and what to
    install meanwhile (module-level ``__getattr__``: called only for names not found here)."""
    raise missing_name(__name__, name)


# Grouped GEMMs


def _m_grouped_fp8_fp4_gemm_nt_contiguous(
    fn: str, a: Pair, b: Pair, d: torch.Tensor, grouped_layout: torch.Tensor, recipe: Recipe | None = None,
    recipe_a: Gran | None = None, recipe_b: Gran | None = None, compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False, use_psum_layout: bool = False, ensure_zero_padding: bool = True,
    expected_m_for_psum_layout: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``d[i] = a[i] @ b[grouped_layout[i]].T``: FP8 ``a`` (``(e4m3 [M, K], scales)``) with FP8 ``b`` (``(e4m3 [G, N,
    K], float32 [G, N/128, K/128])``) or packed FP4 ``b`` (``(int8 [G, N, K/2], int32 [G, N, K/128] packed UE8M0 or
    float32 [G, N, K/32])``); ``grouped_layout [M]`` int32 (-1 padding; each group starting a multiple of the
    alignment) or, with ``use_psum_layout``, ``[G]`` cumulative row ends. ``d [M, N]`` bf16/float32 is written.
    ``recipe=(1, 1, 32)`` (1x32 activation scales, FP4 ``b``): a torch fallback (``deep_gemm_mx_grouped``)."""
    check_flags(fn, compiled_dims, disable_ue8m0_cast, use_psum_layout, ensure_zero_padding, expected_m_for_psum_layout)
    if is_mx_recipe(recipe, recipe_a, recipe_b):
        return m_grouped_fp8_fp4_mx_contiguous(fn, a, b, d, grouped_layout, use_psum_layout)
    return _grouped(fn, a, b, d, grouped_layout, recipe, recipe_a, recipe_b, use_psum_layout, nn=False)


def _m_grouped_fp8_fp4_gemm_nn_contiguous(
    fn: str, a: Pair, b: Pair, d: torch.Tensor, grouped_layout: torch.Tensor, recipe: Recipe | None = None,
    recipe_a: Gran | None = None, recipe_b: Gran | None = None, compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False, use_psum_layout: bool = False, ensure_zero_padding: bool = True,
) -> torch.Tensor:  # fmt: skip
    """:func:`m_grouped_fp8_fp4_gemm_nt_contiguous` with ``b`` given as ``[G, K, N]`` (scales ``[G, K/128, N/128]``),
    FP8 only; it is transposed (a copy) first."""
    check_flags(fn, compiled_dims, disable_ue8m0_cast, use_psum_layout, ensure_zero_padding)
    return _grouped(fn, a, b, d, grouped_layout, recipe, recipe_a, recipe_b, use_psum_layout, nn=True)


m_grouped_fp8_fp4_gemm_nt_contiguous = named(
    "m_grouped_fp8_fp4_gemm_nt_contiguous", _m_grouped_fp8_fp4_gemm_nt_contiguous
)
m_grouped_fp8_fp4_gemm_nn_contiguous = named(
    "m_grouped_fp8_fp4_gemm_nn_contiguous", _m_grouped_fp8_fp4_gemm_nn_contiguous
)


def _grouped(
    fn: str, a: Pair, b: Pair, d: torch.Tensor, grouped_layout: torch.Tensor, recipe: Recipe | None,
    recipe_a: Gran | None, recipe_b: Gran | None, use_psum_layout: bool, nn: bool,
) -> torch.Tensor:  # fmt: skip
    kind, aa, b_pair = fp8_operands(fn, a, b, recipe, recipe_a, recipe_b, nn=nn)
    bb = as_nt(fn, kind, aa, b_pair, d, nn, dense=False)
    layout, psum = contiguous_layout(fn, aa[0], grouped_layout, use_psum_layout, bb[0].shape[0])
    with called_as(fn):
        getattr(gemm, f"m_grouped_{kind}_gemm_nt_contiguous")(aa, bb, d, layout, psum)
    return d


def _m_grouped_fp8_fp4_gemm_nt_masked(
    fn: str, a: Pair, b: Pair, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
    recipe: Recipe | None = None, recipe_a: Gran | None = None, recipe_b: Gran | None = None,
    compiled_dims: str = "nk", disable_ue8m0_cast: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T`` with ``a`` ``(e4m3 [G, M_max, K], scales)`` and ``b`` as in
    :func:`m_grouped_fp8_fp4_gemm_nt_contiguous`; rows past ``masked_m[g]`` are left untouched."""
    check_flags(fn, compiled_dims, disable_ue8m0_cast)
    kind, aa, bb = fp8_operands(fn, a, b, recipe, recipe_a, recipe_b)
    with called_as(fn):
        getattr(gemm, f"m_grouped_{kind}_gemm_nt_masked")(aa, bb, d, masked_m, expected_m)
    return d


m_grouped_fp8_fp4_gemm_nt_masked = named("m_grouped_fp8_fp4_gemm_nt_masked", _m_grouped_fp8_fp4_gemm_nt_masked)


def _m_grouped_bf16_gemm_nt_contiguous(
    fn: str, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, grouped_layout: torch.Tensor, compiled_dims: str = "nk",
    use_psum_layout: bool = False, ensure_zero_padding: bool = True, expected_m_for_psum_layout: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``d[i] = a[i] @ b[grouped_layout[i]].T`` in bf16 (``a [M, K]``, ``b [G, N, K]``), layouts as for FP8."""
    check_flags(fn, compiled_dims, False, use_psum_layout, ensure_zero_padding, expected_m_for_psum_layout)
    layout, psum = contiguous_layout(fn, a, grouped_layout, use_psum_layout, b.shape[0])
    with called_as(fn):
        # epkit.grouped_gemm's wrappers are unannotated (that module is not held to strict typing yet)
        gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout, psum)  # type: ignore[no-untyped-call]
    return d


m_grouped_bf16_gemm_nt_contiguous = named("m_grouped_bf16_gemm_nt_contiguous", _m_grouped_bf16_gemm_nt_contiguous)


def m_grouped_bf16_gemm_nn_contiguous(
    a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, grouped_layout: torch.Tensor, compiled_dims: str = "nk",
    use_psum_layout: bool = False, ensure_zero_padding: bool = True,
) -> torch.Tensor:  # fmt: skip
    """:func:`m_grouped_bf16_gemm_nt_contiguous` with ``b`` given as ``[G, K, N]`` (transposed first, a copy)."""
    fn = "m_grouped_bf16_gemm_nn_contiguous"
    b_nt = as_nt(fn, "bf16", a, b, d, nn=True, dense=False)
    assert isinstance(b_nt, torch.Tensor)
    return _m_grouped_bf16_gemm_nt_contiguous(
        fn, a, b_nt, d, grouped_layout, compiled_dims, use_psum_layout, ensure_zero_padding
    )


def _m_grouped_bf16_gemm_nt_masked(
    fn: str,
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    compiled_dims: str = "nk",
) -> torch.Tensor:
    """The masked layout in bf16 (``a [G, M_max, K]``, ``b [G, N, K]``); rows past ``masked_m[g]`` untouched."""
    check_flags(fn, compiled_dims, False)
    with called_as(fn):
        # epkit.grouped_gemm's wrappers are unannotated (that module is not held to strict typing yet)
        gemm.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m)  # type: ignore[no-untyped-call]
    return d


m_grouped_bf16_gemm_nt_masked = named("m_grouped_bf16_gemm_nt_masked", _m_grouped_bf16_gemm_nt_masked)


# DeepGEMM's other names: the same calls, their errors naming the name called
m_grouped_fp8_gemm_nt_contiguous = named(
    "m_grouped_fp8_gemm_nt_contiguous", _m_grouped_fp8_fp4_gemm_nt_contiguous, "m_grouped_fp8_fp4_gemm_nt_contiguous"
)
m_grouped_fp8_gemm_nn_contiguous = named(
    "m_grouped_fp8_gemm_nn_contiguous", _m_grouped_fp8_fp4_gemm_nn_contiguous, "m_grouped_fp8_fp4_gemm_nn_contiguous"
)
m_grouped_fp8_gemm_nt_masked = named(
    "m_grouped_fp8_gemm_nt_masked", _m_grouped_fp8_fp4_gemm_nt_masked, "m_grouped_fp8_fp4_gemm_nt_masked"
)
fp8_m_grouped_gemm_nt_masked = named(
    "fp8_m_grouped_gemm_nt_masked", _m_grouped_fp8_fp4_gemm_nt_masked, "m_grouped_fp8_fp4_gemm_nt_masked"
)
bf16_m_grouped_gemm_nt_masked = named(
    "bf16_m_grouped_gemm_nt_masked", _m_grouped_bf16_gemm_nt_masked, "m_grouped_bf16_gemm_nt_masked"
)
