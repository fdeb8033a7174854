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

Not provided: FP4 activations, and DeepGEMM's names in the tables of ``epkit.compat._details.deep_gemm_coverage``
(``epkit info`` lists them): the ``tn``/``tt`` and k-grouped GEMMs, einsum, mega-MoE and cuBLASLt kernels are
not yet provided; the attention-indexer and hyper-connection kernels are outside epkit's scope. Such a name
raises an ``AttributeError`` saying which it is and what to install for it (DeepGEMM itself, on an sm_90 or
sm_100 GPU); a name DeepGEMM does not have says that instead.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Concatenate, NoReturn, ParamSpec, TypeVar

import torch

from epkit import grouped_gemm as gemm
from epkit._details.grouped_gemm_checks import validate_operands
from epkit.compat._details.deep_gemm_coverage import missing_name_error
from epkit.compat._details.deep_gemm_runtime import (
    SETTINGS,
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
    DEFAULT_ALIGNMENT,
    activation_scales,
    check_flags,
    fp4_weights,
    fp8_weight_scales,
    rows_of_psum,
    transform_sf_into_required_layout,
)
from epkit.compat.deep_gemm import testing, utils
from epkit.compat.deep_gemm.utils import (  # DeepGEMM's top level has them too (``from .utils import *``)
    align,
    cast_back_from_fp4,
    ceil_div,
    ceil_to_ue8m0,
    get_k_alignment_for_contiguous_layout,
    get_m_alignment_for_contiguous_layout,
    get_mk_alignment_for_contiguous_layout,
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_theoretical_mk_alignment_for_contiguous_layout,
    get_tma_aligned_size,
    pack_ue8m0_to_int,
    per_block_cast_to_fp8,
    per_channel_cast_to_fp8,
    per_custom_dims_cast_to_fp8,
    per_token_cast_to_fp4,
    per_token_cast_to_fp8,
    set_mk_alignment_for_contiguous_layout,
    transpose_packed_fp4,
    unpack_ue8m0_from_int,
)

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
    "fp8_gemm_nt",
    "fp8_gemm_nn",
    "bf16_gemm_nt",
    "bf16_gemm_nn",
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
]

#: DeepGEMM's FP8 / FP4 operands: ``(values, scales)``.
_Pair = tuple[torch.Tensor, torch.Tensor]
#: DeepGEMM's scale granularities: ``recipe`` ``(mn of a, mn of b, k)``, ``recipe_a`` / ``recipe_b`` ``(mn, k)``.
_Recipe = tuple[int, int, int]
_Gran = tuple[int, int]
_P = ParamSpec("_P")
_R = TypeVar("_R")


def __getattr__(name: str) -> NoReturn:
    """A DeepGEMM name this module lacks: an ``AttributeError`` saying whether epkit means to provide it and what to
    install meanwhile (module-level ``__getattr__``: called only for names not found here)."""
    raise missing_name_error(__name__, name)


# Errors in the caller's terms


def _named(name: str, impl: Callable[Concatenate[str, _P], _R], alias_of: str | None = None) -> Callable[_P, _R]:
    """DeepGEMM's function ``name``: ``impl`` called with ``name`` first, which its errors start with, so that a GEMM
    DeepGEMM has several names for (``fp8_gemm_nt`` is ``fp8_fp4_gemm_nt``) names the one the caller called. Its
    signature is ``impl``'s without that first parameter; ``alias_of`` names the function it is another name of."""

    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return impl(name, *args, **kwargs)

    sig = inspect.signature(impl)
    call.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])  # type: ignore[attr-defined]
    call.__name__ = call.__qualname__ = name
    call.__doc__ = (
        impl.__doc__ if alias_of is None else f"DeepGEMM's other name for :func:`{alias_of}` (its errors name {name})."
    )
    return call


#: epkit.grouped_gemm's names for DeepGEMM's arguments, as the caller knows them.
_CALLERS_NAMES = {"m_indices": "grouped_layout"}


@contextlib.contextmanager
def _called_as(fn: str) -> Iterator[None]:
    """A ``ValueError`` from epkit's GEMMs in the caller's terms: starting with the function it called (as this
    module's own errors do) and naming DeepGEMM's argument (``grouped_layout``, where epkit says ``m_indices``)."""
    try:
        yield
    except ValueError as exc:
        msg = re.sub(r"\b(" + "|".join(_CALLERS_NAMES) + r")\b", lambda m: _CALLERS_NAMES[m.group(1)], str(exc))
        raise ValueError(f"{fn}: {msg}").with_traceback(exc.__traceback__) from None


# Operands


def _fp8_operands(
    fn: str,
    a: _Pair,
    b: _Pair,
    recipe: _Recipe | None,
    recipe_a: _Gran | None,
    recipe_b: _Gran | None,
    nn: bool = False,
) -> tuple[str, _Pair, _Pair]:
    """``(kind, a pair, b pair)`` in epkit's formats from DeepGEMM's FP8 / FP8xFP4 operands (``b`` still in the
    caller's layout: :func:`_as_nt` makes an nn one nt after its checks)."""
    for name, x in (("a", a), ("b", b)):
        if not (isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x)):
            raise ValueError(f"{fn}: {name} must be a (tensor, scales) pair, got {type(x).__name__}")
    (a0, sfa), (b0, sfb) = a, b
    if a0.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{fn}: a must be float8_e4m3fn (epkit's FP8 GEMMs take FP8 activations), got {a0.dtype}")
    fp4 = b0.dtype in (torch.int8, torch.uint8)
    if fp4 and nn:
        raise ValueError(f"{fn}: b as packed FP4 needs the nt layout (b [G, N, K/2]); the nn form is for FP8 b")
    gran_b = _recipe(fn, recipe, recipe_a, recipe_b, fp4)
    sfa = activation_scales(fn, sfa, a0.shape[-1])
    if fp4:
        return "fp8_fp4", (a0, sfa), fp4_weights(fn, b0, sfb, gran_b)
    return "fp8", (a0, sfa), (b0, fp8_weight_scales(fn, sfb))


def _recipe(
    fn: str, recipe: _Recipe | None, recipe_a: _Gran | None, recipe_b: _Gran | None, fp4: bool
) -> tuple[int, int]:
    """The weight-scale granularity (MN, K) of a call's recipe, after checking epkit takes it."""
    if (recipe_a is None) != (recipe_b is None) or (recipe is not None and recipe_a is not None):
        raise ValueError(
            f"{fn}: give either recipe or both recipe_a and recipe_b, got {recipe=}, {recipe_a=}, {recipe_b=}"
        )
    want_b = (1, 32) if fp4 else (128, 128)
    if recipe is not None:
        got_a, got_b = (recipe[0], recipe[2]), (recipe[1], recipe[2])
    else:
        got_a, got_b = recipe_a or (1, 128), recipe_b or want_b
    if tuple(got_a) != (1, 128) or tuple(got_b) != want_b:
        raise ValueError(
            f"{fn}: recipe={recipe}, recipe_a={recipe_a}, recipe_b={recipe_b}: epkit takes 1x128 activation scales "
            f"with {'1x32 MXFP4' if fp4 else '128x128 FP8'} weight scales "
            f"({'recipe_a=(1, 128), recipe_b=(1, 32)' if fp4 else 'recipe=(1, 128, 128), the default'})"
        )
    return want_b


def _contiguous_layout(
    fn: str, a0: torch.Tensor, grouped_layout: torch.Tensor, use_psum_layout: bool, g: int
) -> tuple[torch.Tensor, bool]:
    """``(layout for epkit, use_psum_layout)``: a psum layout aligned to other than 128 becomes per-row ids (device
    ops, no host read)."""
    alignment = SETTINGS.alignment
    if not isinstance(grouped_layout, torch.Tensor) or grouped_layout.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: grouped_layout must be an int32 tensor, got {getattr(grouped_layout, 'dtype', None)}")
    if use_psum_layout and alignment != DEFAULT_ALIGNMENT:
        if tuple(grouped_layout.shape) != (g,):
            raise ValueError(f"{fn}: grouped_layout (psum) must be [G] = ({g},), got {tuple(grouped_layout.shape)}")
        return rows_of_psum(grouped_layout, a0.shape[0], alignment), False
    return grouped_layout, bool(use_psum_layout)


def _as_nt(
    fn: str, kind: str, a: torch.Tensor | _Pair, b: torch.Tensor | _Pair, d: torch.Tensor, nn: bool, dense: bool
) -> torch.Tensor | _Pair:
    """``b`` in the nt layout epkit's GEMMs take: an nn ``b`` (``[..., K, N]``, scales ``[..., K/128, N/128]``) is
    checked as the caller passed it, then transposed (a copy); an nt one is returned as it is."""
    if not nn:
        return b
    with _called_as(fn):
        validate_operands(kind, a, b, d, masked=False, dense=dense, b_kn=True)

    def nt(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(-1, -2).contiguous()

    return (nt(b[0]), nt(b[1])) if isinstance(b, tuple) else nt(b)


# Grouped GEMMs


def _m_grouped_fp8_fp4_gemm_nt_contiguous(
    fn: str, a: _Pair, b: _Pair, d: torch.Tensor, grouped_layout: torch.Tensor, recipe: _Recipe | None = None,
    recipe_a: _Gran | None = None, recipe_b: _Gran | None = None, compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False, use_psum_layout: bool = False, ensure_zero_padding: bool = True,
    expected_m_for_psum_layout: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``d[i] = a[i] @ b[grouped_layout[i]].T``: FP8 ``a`` (``(e4m3 [M, K], scales)``) with FP8 ``b`` (``(e4m3 [G, N,
    K], float32 [G, N/128, K/128])``) or packed FP4 ``b`` (``(int8 [G, N, K/2], int32 [G, N, K/128] packed UE8M0 or
    float32 [G, N, K/32])``); ``grouped_layout [M]`` int32 (-1 padding; each group starting a multiple of the
    alignment) or, with ``use_psum_layout``, ``[G]`` cumulative row ends. ``d [M, N]`` bf16/float32 is written."""
    check_flags(fn, compiled_dims, disable_ue8m0_cast, use_psum_layout, ensure_zero_padding, expected_m_for_psum_layout)
    return _grouped(fn, a, b, d, grouped_layout, recipe, recipe_a, recipe_b, use_psum_layout, nn=False)


def _m_grouped_fp8_fp4_gemm_nn_contiguous(
    fn: str, a: _Pair, b: _Pair, d: torch.Tensor, grouped_layout: torch.Tensor, recipe: _Recipe | None = None,
    recipe_a: _Gran | None = None, recipe_b: _Gran | None = None, compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False, use_psum_layout: bool = False, ensure_zero_padding: bool = True,
) -> torch.Tensor:  # fmt: skip
    """:func:`m_grouped_fp8_fp4_gemm_nt_contiguous` with ``b`` given as ``[G, K, N]`` (scales ``[G, K/128, N/128]``),
    FP8 only; it is transposed (a copy) first."""
    check_flags(fn, compiled_dims, disable_ue8m0_cast, use_psum_layout, ensure_zero_padding)
    return _grouped(fn, a, b, d, grouped_layout, recipe, recipe_a, recipe_b, use_psum_layout, nn=True)


m_grouped_fp8_fp4_gemm_nt_contiguous = _named(
    "m_grouped_fp8_fp4_gemm_nt_contiguous", _m_grouped_fp8_fp4_gemm_nt_contiguous
)
m_grouped_fp8_fp4_gemm_nn_contiguous = _named(
    "m_grouped_fp8_fp4_gemm_nn_contiguous", _m_grouped_fp8_fp4_gemm_nn_contiguous
)


def _grouped(
    fn: str, a: _Pair, b: _Pair, d: torch.Tensor, grouped_layout: torch.Tensor, recipe: _Recipe | None,
    recipe_a: _Gran | None, recipe_b: _Gran | None, use_psum_layout: bool, nn: bool,
) -> torch.Tensor:  # fmt: skip
    kind, aa, b_pair = _fp8_operands(fn, a, b, recipe, recipe_a, recipe_b, nn=nn)
    bb = _as_nt(fn, kind, aa, b_pair, d, nn, dense=False)
    layout, psum = _contiguous_layout(fn, aa[0], grouped_layout, use_psum_layout, bb[0].shape[0])
    with _called_as(fn):
        getattr(gemm, f"m_grouped_{kind}_gemm_nt_contiguous")(aa, bb, d, layout, psum)
    return d


def _m_grouped_fp8_fp4_gemm_nt_masked(
    fn: str, a: _Pair, b: _Pair, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
    recipe: _Recipe | None = None, recipe_a: _Gran | None = None, recipe_b: _Gran | None = None,
    compiled_dims: str = "nk", disable_ue8m0_cast: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T`` with ``a`` ``(e4m3 [G, M_max, K], scales)`` and ``b`` as in
    :func:`m_grouped_fp8_fp4_gemm_nt_contiguous`; rows past ``masked_m[g]`` are left untouched."""
    check_flags(fn, compiled_dims, disable_ue8m0_cast)
    kind, aa, bb = _fp8_operands(fn, a, b, recipe, recipe_a, recipe_b)
    with _called_as(fn):
        getattr(gemm, f"m_grouped_{kind}_gemm_nt_masked")(aa, bb, d, masked_m, expected_m)
    return d


m_grouped_fp8_fp4_gemm_nt_masked = _named("m_grouped_fp8_fp4_gemm_nt_masked", _m_grouped_fp8_fp4_gemm_nt_masked)


def _m_grouped_bf16_gemm_nt_contiguous(
    fn: str, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, grouped_layout: torch.Tensor, compiled_dims: str = "nk",
    use_psum_layout: bool = False, ensure_zero_padding: bool = True, expected_m_for_psum_layout: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``d[i] = a[i] @ b[grouped_layout[i]].T`` in bf16 (``a [M, K]``, ``b [G, N, K]``), layouts as for FP8."""
    check_flags(fn, compiled_dims, False, use_psum_layout, ensure_zero_padding, expected_m_for_psum_layout)
    layout, psum = _contiguous_layout(fn, a, grouped_layout, use_psum_layout, b.shape[0])
    with _called_as(fn):
        # epkit.grouped_gemm's wrappers are unannotated (that module is not held to strict typing yet)
        gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout, psum)  # type: ignore[no-untyped-call]
    return d


m_grouped_bf16_gemm_nt_contiguous = _named("m_grouped_bf16_gemm_nt_contiguous", _m_grouped_bf16_gemm_nt_contiguous)


def m_grouped_bf16_gemm_nn_contiguous(
    a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, grouped_layout: torch.Tensor, compiled_dims: str = "nk",
    use_psum_layout: bool = False, ensure_zero_padding: bool = True,
) -> torch.Tensor:  # fmt: skip
    """:func:`m_grouped_bf16_gemm_nt_contiguous` with ``b`` given as ``[G, K, N]`` (transposed first, a copy)."""
    fn = "m_grouped_bf16_gemm_nn_contiguous"
    b_nt = _as_nt(fn, "bf16", a, b, d, nn=True, dense=False)
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
    with _called_as(fn):
        # epkit.grouped_gemm's wrappers are unannotated (that module is not held to strict typing yet)
        gemm.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m)  # type: ignore[no-untyped-call]
    return d


m_grouped_bf16_gemm_nt_masked = _named("m_grouped_bf16_gemm_nt_masked", _m_grouped_bf16_gemm_nt_masked)


# Dense GEMMs: one group of the masked layout


def _no_alpha(fn: str, alpha: object) -> None:
    if alpha is not None:
        raise ValueError(
            f"{fn}: alpha={alpha!r} is not supported (DeepGEMM's output scale, which its SM90 FP8 kernels refuse "
            "too; epkit's dense GEMMs have none): pass None and scale d afterwards"
        )


def _dense(
    fn: str, kind: str, a: torch.Tensor | _Pair, b: torch.Tensor | _Pair, d: torch.Tensor, c: torch.Tensor | None,
    nn: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``d = a @ b.T (+ c)`` as the masked grouped GEMM of one group (float32 accumulation; with ``c``, one rounding
    of ``a @ b.T + c`` to ``d``'s dtype); ``nn``: ``b`` is ``[K, N]``."""
    a0 = a[0] if isinstance(a, tuple) else a
    if not isinstance(d, torch.Tensor) or d.dim() != 2:
        raise ValueError(f"{fn}: d must be a 2-D [M, N] tensor, got {tuple(getattr(d, 'shape', ()))}")
    if c is not None and (not isinstance(c, torch.Tensor) or c.shape != d.shape or c.dtype != d.dtype):
        raise ValueError(f"{fn}: c must be a tensor like d ({d.dtype} {tuple(d.shape)}), got {c!r:.80}")
    one = (lambda t: t.unsqueeze(0)) if kind == "bf16" else (lambda p: (p[0].unsqueeze(0), p[1].unsqueeze(0)))
    out = d.unsqueeze(0) if c is None else torch.empty((1, *d.shape), dtype=torch.float32, device=d.device)
    counts = torch.full((1,), a0.shape[0], dtype=torch.int32, device=a0.device)
    b = _as_nt(fn, kind, a, b, out[0], nn, dense=True)
    with _called_as(fn):
        validate_operands(kind, a, b, out[0], masked=False, dense=True)  # first: in the caller's 2-D shapes
        getattr(gemm, f"m_grouped_{kind}_gemm_nt_masked")(one(a), one(b), out, counts, a0.shape[0])
    if c is not None:
        d.copy_(out[0] + c.float())
    return d


def _fp8_fp4_gemm_nt(
    fn: str, a: _Pair, b: _Pair, d: torch.Tensor, c: torch.Tensor | None = None, recipe: _Recipe | None = None,
    recipe_a: _Gran | None = None, recipe_b: _Gran | None = None, compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False, alpha: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """``d = a @ b.T (+ c)``: ``a`` ``(e4m3 [M, K], scales [M, K/128])``, ``b`` ``(e4m3 [N, K], float32 [N/128,
    K/128])`` or packed FP4 as in :func:`m_grouped_fp8_fp4_gemm_nt_contiguous` (without the group dim).
    ``alpha`` (DeepGEMM's output scale, SM100-only for FP8) must be None."""
    check_flags(fn, compiled_dims, disable_ue8m0_cast)
    _no_alpha(fn, alpha)
    kind, aa, bb = _fp8_operands(fn, a, b, recipe, recipe_a, recipe_b)
    return _dense(fn, kind, aa, bb, d, c)


def _fp8_fp4_gemm_nn(
    fn: str, a: _Pair, b: _Pair, d: torch.Tensor, c: torch.Tensor | None = None, recipe: _Recipe | None = None,
    recipe_a: _Gran | None = None, recipe_b: _Gran | None = None, compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False, alpha: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """:func:`fp8_fp4_gemm_nt` with ``b`` given as ``[K, N]`` (scales ``[K/128, N/128]``), FP8 only."""
    check_flags(fn, compiled_dims, disable_ue8m0_cast)
    _no_alpha(fn, alpha)
    kind, aa, bb = _fp8_operands(fn, a, b, recipe, recipe_a, recipe_b, nn=True)
    return _dense(fn, kind, aa, bb, d, c, nn=True)


fp8_fp4_gemm_nt = _named("fp8_fp4_gemm_nt", _fp8_fp4_gemm_nt)
fp8_fp4_gemm_nn = _named("fp8_fp4_gemm_nn", _fp8_fp4_gemm_nn)


def bf16_gemm_nt(
    a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None, compiled_dims: str = "nk",
    alpha: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """``d = a @ b.T (+ c)`` in bf16: ``a [M, K]``, ``b [N, K]``, ``d [M, N]`` bf16/float32; ``alpha`` must be
    None."""
    check_flags("bf16_gemm_nt", compiled_dims, False)
    _no_alpha("bf16_gemm_nt", alpha)
    return _dense("bf16_gemm_nt", "bf16", a, b, d, c)


def bf16_gemm_nn(
    a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None, compiled_dims: str = "nk",
    alpha: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """:func:`bf16_gemm_nt` with ``b`` given as ``[K, N]``."""
    check_flags("bf16_gemm_nn", compiled_dims, False)
    _no_alpha("bf16_gemm_nn", alpha)
    return _dense("bf16_gemm_nn", "bf16", a, b, d, c, nn=True)


# DeepGEMM's other names: the same calls, their errors naming the name called
fp8_gemm_nt = _named("fp8_gemm_nt", _fp8_fp4_gemm_nt, "fp8_fp4_gemm_nt")
fp8_gemm_nn = _named("fp8_gemm_nn", _fp8_fp4_gemm_nn, "fp8_fp4_gemm_nn")
m_grouped_fp8_gemm_nt_contiguous = _named(
    "m_grouped_fp8_gemm_nt_contiguous", _m_grouped_fp8_fp4_gemm_nt_contiguous, "m_grouped_fp8_fp4_gemm_nt_contiguous"
)
m_grouped_fp8_gemm_nn_contiguous = _named(
    "m_grouped_fp8_gemm_nn_contiguous", _m_grouped_fp8_fp4_gemm_nn_contiguous, "m_grouped_fp8_fp4_gemm_nn_contiguous"
)
m_grouped_fp8_gemm_nt_masked = _named(
    "m_grouped_fp8_gemm_nt_masked", _m_grouped_fp8_fp4_gemm_nt_masked, "m_grouped_fp8_fp4_gemm_nt_masked"
)
fp8_m_grouped_gemm_nt_masked = _named(
    "fp8_m_grouped_gemm_nt_masked", _m_grouped_fp8_fp4_gemm_nt_masked, "m_grouped_fp8_fp4_gemm_nt_masked"
)
bf16_m_grouped_gemm_nt_masked = _named(
    "bf16_m_grouped_gemm_nt_masked", _m_grouped_bf16_gemm_nt_masked, "m_grouped_bf16_gemm_nt_masked"
)
