"""The operands of ``epkit.compat.deep_gemm``'s GEMMs in epkit's terms, and errors in the caller's: DeepGEMM's FP8 /
FP4 ``(values, scales)`` pairs and recipes checked and converted to :mod:`epkit.grouped_gemm`'s formats, its nn
``b`` made nt, its contiguous layouts, and the wrapper that makes every error start with the function the caller
called (DeepGEMM has several names for one GEMM).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Concatenate, ParamSpec, TypeVar

import torch

from epkit._details.grouped_gemm_checks import validate_operands
from epkit.compat._details.deep_gemm_runtime import SETTINGS
from epkit.compat._details.deep_gemm_scales import (
    DEFAULT_ALIGNMENT,
    activation_scales,
    fp4_weights,
    fp8_weight_scales,
    rows_of_psum,
)

__all__ = [
    "Pair",
    "Recipe",
    "Gran",
    "named",
    "called_as",
    "fp8_pairs",
    "fp8_operands",
    "recipe_granularity",
    "contiguous_layout",
    "as_nt",
]

#: DeepGEMM's FP8 / FP4 operands: ``(values, scales)``.
Pair = tuple[torch.Tensor, torch.Tensor]
#: DeepGEMM's scale granularities: ``recipe`` ``(mn of a, mn of b, k)``, ``recipe_a`` / ``recipe_b`` ``(mn, k)``.
Recipe = tuple[int, int, int]
Gran = tuple[int, int]
_P = ParamSpec("_P")
_R = TypeVar("_R")


# Errors in the caller's terms


def named(name: str, impl: Callable[Concatenate[str, _P], _R], alias_of: str | None = None) -> Callable[_P, _R]:
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
def called_as(fn: str) -> Iterator[None]:
    """A ``ValueError`` from epkit's GEMMs in the caller's terms: starting with the function it called (as this
    module's own errors do) and naming DeepGEMM's argument (``grouped_layout``, where epkit says ``m_indices``)."""
    try:
        yield
    except ValueError as exc:
        msg = re.sub(r"\b(" + "|".join(_CALLERS_NAMES) + r")\b", lambda m: _CALLERS_NAMES[m.group(1)], str(exc))
        raise ValueError(f"{fn}: {msg}").with_traceback(exc.__traceback__) from None


# Operands


def fp8_pairs(fn: str, a: object, b: object) -> tuple[Pair, Pair]:
    """``a`` and ``b`` as DeepGEMM's ``(values, scales)`` pairs, ``a``'s values FP8 e4m3 (``b``'s are checked by the
    caller: FP8 or packed FP4)."""
    for name, x in (("a", a), ("b", b)):
        if not (isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x)):
            raise ValueError(f"{fn}: {name} must be a (tensor, scales) pair, got {type(x).__name__}")
    assert isinstance(a, (tuple, list)) and isinstance(b, (tuple, list))
    if a[0].dtype != torch.float8_e4m3fn:
        raise ValueError(f"{fn}: a must be float8_e4m3fn (epkit's FP8 GEMMs take FP8 activations), got {a[0].dtype}")
    return (a[0], a[1]), (b[0], b[1])


def fp8_operands(
    fn: str,
    a: Pair,
    b: Pair,
    recipe: Recipe | None,
    recipe_a: Gran | None,
    recipe_b: Gran | None,
    nn: bool = False,
) -> tuple[str, Pair, Pair]:
    """``(kind, a pair, b pair)`` in epkit's formats from DeepGEMM's FP8 / FP8xFP4 operands (``b`` still in the
    caller's layout: :func:`as_nt` makes an nn one nt after its checks)."""
    (a0, sfa), (b0, sfb) = fp8_pairs(fn, a, b)
    fp4 = b0.dtype in (torch.int8, torch.uint8)
    if fp4 and nn:
        raise ValueError(f"{fn}: b as packed FP4 needs the nt layout (b [G, N, K/2]); the nn form is for FP8 b")
    gran_b = recipe_granularity(fn, recipe, recipe_a, recipe_b, fp4)
    sfa = activation_scales(fn, sfa, a0.shape[-1])
    if fp4:
        return "fp8_fp4", (a0, sfa), fp4_weights(fn, b0, sfb, gran_b)
    return "fp8", (a0, sfa), (b0, fp8_weight_scales(fn, sfb))


def recipe_granularity(
    fn: str, recipe: Recipe | None, recipe_a: Gran | None, recipe_b: Gran | None, fp4: bool, per_row_b: bool = False
) -> tuple[int, int]:
    """The weight-scale granularity (MN, K) of a call's recipe, after checking epkit takes it. ``per_row_b``: the
    caller also takes FP8 ``b`` with 1x128 scales (``recipe=(1, 1, 128)``, DeepGEMM's weight-gradient recipe)."""
    if (recipe_a is None) != (recipe_b is None) or (recipe is not None and recipe_a is not None):
        raise ValueError(
            f"{fn}: give either recipe or both recipe_a and recipe_b, got {recipe=}, {recipe_a=}, {recipe_b=}"
        )
    want_b = (1, 32) if fp4 else (128, 128)
    if recipe is not None:
        got_a, got_b = (recipe[0], recipe[2]), (recipe[1], recipe[2])
    else:
        got_a, got_b = recipe_a or (1, 128), recipe_b or want_b
    if per_row_b and not fp4 and tuple(got_a) == (1, 128) and tuple(got_b) == (1, 128):
        return (1, 128)
    if tuple(got_a) != (1, 128) or tuple(got_b) != want_b:
        raise ValueError(
            f"{fn}: recipe={recipe}, recipe_a={recipe_a}, recipe_b={recipe_b}: epkit takes 1x128 activation scales "
            f"with {'1x32 MXFP4' if fp4 else '128x128 FP8'} weight scales "
            f"({'recipe_a=(1, 128), recipe_b=(1, 32)' if fp4 else 'recipe=(1, 128, 128), the default'})"
            + ("" if fp4 or not per_row_b else ", or 1x128 scales on both (recipe=(1, 1, 128))")
        )
    return want_b


def contiguous_layout(
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


def as_nt(
    fn: str, kind: str, a: torch.Tensor | Pair, b: torch.Tensor | Pair, d: torch.Tensor, nn: bool, dense: bool
) -> torch.Tensor | Pair:
    """``b`` in the nt layout epkit's GEMMs take: an nn ``b`` (``[..., K, N]``, scales ``[..., K/128, N/128]``) is
    checked as the caller passed it, then transposed (a copy); an nt one is returned as it is."""
    if not nn:
        return b
    with called_as(fn):
        validate_operands(kind, a, b, d, masked=False, dense=dense, b_kn=True)

    def nt(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(-1, -2).contiguous()

    return (nt(b[0]), nt(b[1])) if isinstance(b, tuple) else nt(b)
