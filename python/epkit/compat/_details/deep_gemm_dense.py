"""DeepGEMM's dense GEMMs for ``epkit.compat.deep_gemm``: ``{fp8_fp4,bf16}_gemm_{nt,nn,tn,tt}`` (``fp8_gemm_*`` are
other names of the FP8 ones), ``d = a @ b.T (+ c)`` with each operand in the layout the name gives.

A layout ``xy`` names the operands as DeepGEMM does: ``x = n``: ``a [M, K]``, ``x = t``: ``a [K, M]`` (its scales
``[ceil(K / 128), M]``); ``y = t``: ``b [N, K]``, ``y = n``: ``b [K, N]`` (scales transposed the same way). Every
layout is checked as the caller passed it (errors quote those shapes), then read as nt through transposed views.

Which path computes:

- FP8 ``b`` with 128x128 block scales (``recipe=(1, 128, 128)``, the default) and FP8xFP4: epkit's grouped GEMM as
  one group of the masked layout (Triton on CUDA, epkit's CPU path on CPU). K need not be a multiple of 128: as in
  DeepGEMM, the last scale block covers the K % 128 elements left; the operands are zero-padded to the next
  multiple of 128 (zeros add nothing, the last block's scale still multiplies only the real elements) before the
  kernel, a copy of ``a`` and ``b`` per call.
- FP8 with 1x128 scales on both operands (``recipe=(1, 1, 128)``, DeepGEMM's weight-gradient recipe): a torch
  fallback on every device (both operands dequantized to float32, one float32 matmul); epkit has no kernel for
  per-row ``b`` scales.
- BF16: epkit's grouped GEMM as one group (an MN-major operand is copied K-major first).

With ``c``, ``d = a @ b.T + c`` rounded once to ``d``'s dtype (``c`` may be ``d`` itself). As in DeepGEMM, an empty
M or N writes nothing and K = 0 writes ``c`` (or zeros) to ``d``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Concatenate

import torch

from epkit import grouped_gemm as gemm
from epkit._details.grouped_gemm_checks import validate_operands
from epkit.compat._details.deep_gemm_operands import (
    Gran,
    Pair,
    Recipe,
    called_as,
    fp8_pairs,
    named,
    recipe_granularity,
)
from epkit.compat._details.deep_gemm_scales import (
    activation_scales,
    check_flags,
    dequantize,
    fp4_weights,
    unpack_ue8m0,
)
from epkit.quant import FP8_BLOCK

__all__ = [
    "layout_dims",
    "check_c",
    "early_return",
    "nt_views",
    # by layout: DeepGEMM's names for each
    *("fp8_fp4_gemm_nt", "fp8_gemm_nt", "bf16_gemm_nt"),
    *("fp8_fp4_gemm_nn", "fp8_gemm_nn", "bf16_gemm_nn"),
    *("fp8_fp4_gemm_tn", "fp8_gemm_tn", "bf16_gemm_tn"),
    *("fp8_fp4_gemm_tt", "fp8_gemm_tt", "bf16_gemm_tt"),
]


def _dims(layout: str, fp4: bool = False) -> tuple[tuple[str, str], tuple[str, str]]:
    """The caller's dims of ``a`` and ``b`` in ``layout``."""
    a_dims = ("M", "K") if layout[0] == "n" else ("K", "M")
    b_dims = ("N", "K/2" if fp4 else "K") if layout[1] == "t" else ("K", "N")
    return a_dims, b_dims


def _desc(name: str, t: torch.Tensor, dims: tuple[str, ...]) -> str:
    return f"{name} [{', '.join(dims)}] {tuple(t.shape)}"


def layout_dims(
    fn: str, layout: str, a: object, b: object, d: object, fp4: bool = False, d_dtypes: tuple[torch.dtype, ...] = ()
) -> tuple[int, int, int]:
    """``(M, N, K)`` of ``a`` and ``b`` as passed in ``layout`` (``nt``, ``nn``, ``tn``, ``tt``) and ``d [M, N]``;
    a ``ValueError`` quoting the caller's shapes (and dims) where they disagree."""
    a_dims, b_dims = _dims(layout, fp4)
    for name, t, dims in (("a", a, a_dims), ("b", b, b_dims), ("d", d, ("M", "N"))):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{fn}: {name} must be a 2-D [{', '.join(dims)}] tensor, got {got}")
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(d, torch.Tensor)
    seen: dict[str, tuple[int, str]] = {}
    for name, t, dims in (("a", a, a_dims), ("b", b, b_dims)):
        for dim, size in zip(dims, t.shape):
            key, size = ("K", size * 2) if dim == "K/2" else (dim, size)
            if key in seen and seen[key][0] != size:
                raise ValueError(f"{fn}: {seen[key][1]} and {_desc(name, t, dims)} disagree on {key}")
            seen.setdefault(key, (size, _desc(name, t, dims)))
    m, n, k = seen["M"][0], seen["N"][0], seen["K"][0]
    if tuple(d.shape) != (m, n):
        raise ValueError(
            f"{fn}: d must be [M, N] = ({m}, {n}) for {_desc('a', a, a_dims)} and {_desc('b', b, b_dims)}, "
            f"got {tuple(d.shape)}"
        )
    if d_dtypes and d.dtype not in d_dtypes:
        raise ValueError(f"{fn}: d must be {' or '.join(str(x) for x in d_dtypes)}, got {d.dtype}")
    return m, n, k


def check_c(fn: str, c: object, d: torch.Tensor) -> None:
    """``c`` is None or a tensor of ``d``'s shape and dtype (it may be ``d`` itself)."""
    if c is not None and (not isinstance(c, torch.Tensor) or c.shape != d.shape or c.dtype != d.dtype):
        raise ValueError(f"{fn}: c must be None or a tensor like d ({d.dtype} {tuple(d.shape)}), got {c!r:.80}")


def early_return(m: int, n: int, k: int, d: torch.Tensor, c: torch.Tensor | None) -> bool:
    """DeepGEMM's trivial cases: nothing to write for an empty M or N; for K = 0, ``d = c`` (or zeros). True when
    handled."""
    if m == 0 or n == 0:
        return True
    if k == 0:
        if c is None:
            d.zero_()
        elif c is not d:
            d.copy_(c)
        return True
    return False


def nt_views(layout: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a as [M, K], b as [N, K])`` of operands passed in ``layout`` (``"nt"``, ``"nn"``, ``"tn"``, ``"tt"``):
    views, transposed where the layout says so."""
    return (a.T if layout[0] == "t" else a), (b.T if layout[1] == "n" else b)


def _no_alpha(fn: str, alpha: object) -> None:
    if alpha is not None:
        raise ValueError(
            f"{fn}: alpha={alpha!r} is not supported (DeepGEMM's output scale, which its SM90 FP8 kernels refuse "
            "too; epkit's dense GEMMs have none): pass None and scale d afterwards"
        )


def _write(d: torch.Tensor, out: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    """``d = out (+ c)``, one rounding to ``d``'s dtype."""
    d.copy_(out if c is None else out + c.float())
    return d


def _one_group(
    fn: str, kind: str, a: torch.Tensor | Pair, b: torch.Tensor | Pair, d: torch.Tensor, c: torch.Tensor | None
) -> torch.Tensor:
    """``d = a @ b.T (+ c)`` (nt, K-major, contiguous operands in epkit's formats) as the masked grouped GEMM of one
    group: float32 accumulation, written to ``d`` or, with ``c``, to a float32 buffer added to ``c`` once."""
    a0 = a[0] if isinstance(a, tuple) else a
    one = (lambda t: t.unsqueeze(0)) if kind == "bf16" else (lambda p: (p[0].unsqueeze(0), p[1].unsqueeze(0)))
    out = d.unsqueeze(0) if c is None else torch.empty((1, *d.shape), dtype=torch.float32, device=d.device)
    counts = torch.full((1,), a0.shape[0], dtype=torch.int32, device=a0.device)
    with called_as(fn):
        validate_operands(kind, a, b, out[0], masked=False, dense=True)
        getattr(gemm, f"m_grouped_{kind}_gemm_nt_masked")(one(a), one(b), out, counts, a0.shape[0])
    return d if c is None else _write(d, out[0], c)


def _pad_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x [R, K]`` (any strides) as a contiguous ``[R, k]`` with zeros past K."""
    if x.shape[1] == k:
        return x.contiguous()
    out = x.new_zeros((x.shape[0], k))
    out[:, : x.shape[1]] = x
    return out


def _scales_as_passed(fn: str, name: str, sf: torch.Tensor, want_nt: tuple[int, int], transposed: bool) -> None:
    """float32 scales must have ``want_nt`` (nt dims), given transposed when the operand is."""
    want = want_nt[::-1] if transposed else want_nt
    if sf.dtype == torch.float32 and tuple(sf.shape) != want:
        raise ValueError(f"{fn}: {name}'s scales must be {want} for these operands, got {tuple(sf.shape)}")


def _fp8_fp4(
    fn: str, layout: str, a: Pair, b: Pair, d: torch.Tensor, c: torch.Tensor | None, recipe: Recipe | None,
    recipe_a: Gran | None, recipe_b: Gran | None, compiled_dims: str, disable_ue8m0_cast: bool, alpha: float | None,
) -> torch.Tensor:  # fmt: skip
    check_flags(fn, compiled_dims, disable_ue8m0_cast)
    _no_alpha(fn, alpha)
    (a0, sfa), (b0, sfb) = fp8_pairs(fn, a, b)
    fp4 = b0.dtype in (torch.int8, torch.uint8)
    if fp4 and layout != "nt":
        raise ValueError(f"{fn}: b as packed FP4 needs the nt layout (fp8_fp4_gemm_nt, b [N, K/2])")
    if not fp4 and b0.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{fn}: b must be float8_e4m3fn or packed FP4 (int8), got {b0.dtype}")
    gran_b = recipe_granularity(fn, recipe, recipe_a, recipe_b, fp4, per_row_b=True)
    m, n, k = layout_dims(fn, layout, a0, b0, d, fp4, (torch.bfloat16, torch.float32))
    check_c(fn, c, d)
    ta, tb = layout[0] == "t", layout[1] == "n"
    (a_nt, b_nt), (sfa_nt, sfb_nt) = nt_views(layout, a0, b0), nt_views(layout, sfa, sfb)
    kb = -(-k // FP8_BLOCK)
    _scales_as_passed(fn, "a", sfa, (m, kb), ta)
    sfa_f = activation_scales(fn, sfa_nt, k)
    if early_return(m, n, k, d, c):
        return d
    if fp4:
        return _one_group(fn, "fp8_fp4", (a_nt.contiguous(), sfa_f), fp4_weights(fn, b_nt, sfb_nt, gran_b), d, c)
    if gran_b == (FP8_BLOCK, FP8_BLOCK):
        if sfb.dtype != torch.float32:
            raise ValueError(f"{fn}: b's 128x128 block scales must be float32, got {sfb.dtype}")
        _scales_as_passed(fn, "b", sfb, (-(-n // FP8_BLOCK), kb), tb)
        kp = kb * FP8_BLOCK
        aa, bb = (_pad_k(a_nt, kp), sfa_f), (_pad_k(b_nt, kp), sfb_nt.contiguous())
        return _one_group(fn, "fp8", aa, bb, d, c)
    # recipe (1, 1, 128): per-row scales on b too (torch fallback)
    if sfb.dtype == torch.int32:
        if sfb_nt.shape != (n, -(-kb // 4)):
            raise ValueError(f"{fn}: b's packed UE8M0 scales need {-(-kb // 4)} int32 per row, got {tuple(sfb.shape)}")
        sfb_f = unpack_ue8m0(sfb_nt, kb)
    else:
        _scales_as_passed(fn, "b", sfb, (n, kb), tb)
        sfb_f = sfb_nt
    out = dequantize(a_nt, sfa_f, 1, FP8_BLOCK) @ dequantize(b_nt, sfb_f, 1, FP8_BLOCK).T
    return _write(d, out, c)


def _bf16(
    fn: str, layout: str, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None,
    compiled_dims: str, alpha: float | None,
) -> torch.Tensor:  # fmt: skip
    check_flags(fn, compiled_dims, False)
    _no_alpha(fn, alpha)
    m, n, k = layout_dims(fn, layout, a, b, d, d_dtypes=(torch.bfloat16, torch.float32))
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{fn}: {name} must be bfloat16, got {t.dtype}")
    check_c(fn, c, d)
    if early_return(m, n, k, d, c):
        return d
    a_nt, b_nt = nt_views(layout, a, b)
    return _one_group(fn, "bf16", a_nt.contiguous(), b_nt.contiguous(), d, c)


_FP8_DOC = (
    "``d = a @ b.T (+ c)`` with FP8 ``a`` ``(e4m3 {a}, scales)`` and FP8 ``b`` ``(e4m3 {b}, scales)``{fp4}, ``d [M, "
    "N]`` bf16/float32, ``c`` None or like ``d``. ``a``'s scales are 1x128 per row along K (float32 ``[M, "
    "ceil(K/128)]`` or packed UE8M0 int32, transposed as ``a`` is); ``b``'s 128x128 blocks (float32 ``[ceil(N/128), "
    "ceil(K/128)]``, the default recipe) or 1x128 per row (``recipe=(1, 1, 128)``), transposed as ``b`` is. K need "
    "not be a multiple of 128: the last scale block covers the elements left. ``alpha`` must be None. Which path "
    "computes: see :mod:`epkit.compat._details.deep_gemm_dense`."
)


def _fp8_fp4_form(layout: str) -> Callable[Concatenate[str, ...], torch.Tensor]:
    """DeepGEMM's FP8 GEMM in ``layout``, with its signature (``named`` binds its name): ``compiled_dims``
    defaults to ``"nk"`` where ``a`` is ``[M, K]``, ``"mn"`` where it is ``[K, M]``, as DeepGEMM's."""
    dims = "nk" if layout[0] == "n" else "mn"

    def form(
        fn: str, a: Pair, b: Pair, d: torch.Tensor, c: torch.Tensor | None = None, recipe: Recipe | None = None,
        recipe_a: Gran | None = None, recipe_b: Gran | None = None, compiled_dims: str = dims,
        disable_ue8m0_cast: bool = False, alpha: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return _fp8_fp4(fn, layout, a, b, d, c, recipe, recipe_a, recipe_b, compiled_dims, disable_ue8m0_cast, alpha)

    a_dims = "[M, K]" if layout[0] == "n" else "[K, M]"
    b_dims = "[N, K]" if layout[1] == "t" else "[K, N]"
    fp4 = " or packed FP4 ``(int8 [N, K/2], scales)``" if layout == "nt" else ""
    form.__doc__ = _FP8_DOC.format(a=a_dims, b=b_dims, fp4=fp4)
    return form


_fp8_fp4_gemm_nt, _fp8_fp4_gemm_nn = _fp8_fp4_form("nt"), _fp8_fp4_form("nn")
_fp8_fp4_gemm_tn, _fp8_fp4_gemm_tt = _fp8_fp4_form("tn"), _fp8_fp4_form("tt")

fp8_fp4_gemm_nt = named("fp8_fp4_gemm_nt", _fp8_fp4_gemm_nt)
fp8_fp4_gemm_nn = named("fp8_fp4_gemm_nn", _fp8_fp4_gemm_nn)
fp8_fp4_gemm_tn = named("fp8_fp4_gemm_tn", _fp8_fp4_gemm_tn)
fp8_fp4_gemm_tt = named("fp8_fp4_gemm_tt", _fp8_fp4_gemm_tt)
# DeepGEMM's other names: the same calls, their errors naming the name called
fp8_gemm_nt = named("fp8_gemm_nt", _fp8_fp4_gemm_nt, "fp8_fp4_gemm_nt")
fp8_gemm_nn = named("fp8_gemm_nn", _fp8_fp4_gemm_nn, "fp8_fp4_gemm_nn")
fp8_gemm_tn = named("fp8_gemm_tn", _fp8_fp4_gemm_tn, "fp8_fp4_gemm_tn")
fp8_gemm_tt = named("fp8_gemm_tt", _fp8_fp4_gemm_tt, "fp8_fp4_gemm_tt")


def bf16_gemm_nt(
    a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None, compiled_dims: str = "nk",
    alpha: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """``d = a @ b.T (+ c)`` in bf16 with float32 accumulation: ``a [M, K]``, ``b [N, K]`` (either may be MN-major),
    ``d [M, N]`` bf16/float32, ``c`` None or like ``d``; epkit's grouped GEMM as one group. ``alpha`` must be None."""
    return _bf16("bf16_gemm_nt", "nt", a, b, d, c, compiled_dims, alpha)


def bf16_gemm_nn(
    a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None, compiled_dims: str = "nk",
    alpha: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """:func:`bf16_gemm_nt` with ``b`` given as ``[K, N]``."""
    return _bf16("bf16_gemm_nn", "nn", a, b, d, c, compiled_dims, alpha)


def bf16_gemm_tn(
    a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None, compiled_dims: str = "mn",
    alpha: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """:func:`bf16_gemm_nt` with ``a`` given as ``[K, M]`` and ``b`` as ``[K, N]`` (weight gradients)."""
    return _bf16("bf16_gemm_tn", "tn", a, b, d, c, compiled_dims, alpha)


def bf16_gemm_tt(
    a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None, compiled_dims: str = "mn",
    alpha: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """:func:`bf16_gemm_nt` with ``a`` given as ``[K, M]``."""
    return _bf16("bf16_gemm_tt", "tt", a, b, d, c, compiled_dims, alpha)
