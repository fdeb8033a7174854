"""DeepGEMM's K-grouped contiguous GEMMs for ``epkit.compat.deep_gemm`` (weight gradients): for each group ``g``
of rows ``[start_g, start_g + k_g)`` along K, ``d[g] = c[g] + a_g^T-or-not @ b_g`` accumulated in float32.

- ``k_grouped_fp8_gemm_nt_contiguous`` (DeepGEMM's SM90 form): ``a`` is the groups' K-major blocks one after the
  other, flat (``e4m3``, ``sum(ks) * M`` values, group ``g``'s ``[M, k_g]`` block at ``start_g * M``), its scales
  float32 ``[M, sum(ceil(k_g / 128))]`` (1x128 along K, the groups' columns one after the other); ``b`` likewise
  with N. ``d[g] = c[g] + a_g @ b_g.T``.
- ``k_grouped_fp8_gemm_tn_contiguous`` (DeepGEMM's SM100 form): ``a`` ``(e4m3 [sum_K, M], float32 [sum(ceil(k_g /
  gran_k)), M])``, MN-major, ``b`` likewise with N; ``d[g] = c[g] + a_g.T @ b_g``.
- ``k_grouped_bf16_gemm_tn_contiguous``: bf16 ``a [sum_K, M]``, ``b [sum_K, N]``; ``d[g] = c[g] + a_g.T @ b_g``.

The groups: ``ks_cpu`` (host ints, each a multiple of the K alignment, :func:`set_mk_alignment_for_contiguous_layout`)
with ``grouped_layout`` int32 ``[G]`` holding them; or, with ``use_psum_layout`` (tn forms), ``grouped_layout`` the
cumulative ends, each group starting at the previous end rounded up to the alignment (``ks_cpu`` may then be None,
empty or the aligned sizes; the ends are read on the host). An empty group writes ``c[g]`` (or zeros).

``d`` is float32 ``[G, M, N]``; ``c`` is None (epkit's extension: no accumulation) or like ``d`` (it may be ``d``).
Computed by a torch fallback on every device (epkit has no K-grouped kernel): each group's operands dequantized to
float32 (a last partial scale block covering only its elements), one float32 matmul per group.
"""

from __future__ import annotations

import torch

from epkit.compat._details.deep_gemm_operands import Pair, Recipe
from epkit.compat._details.deep_gemm_runtime import SETTINGS
from epkit.compat._details.deep_gemm_scales import check_flags, dequantize

__all__ = [
    "group_ranges",
    "k_grouped_fp8_gemm_nt_contiguous",
    "k_grouped_fp8_gemm_tn_contiguous",
    "k_grouped_bf16_gemm_tn_contiguous",
]


def _align(x: int, y: int) -> int:
    return -(-x // y) * y


def group_ranges(
    fn: str, ks_cpu: object, grouped_layout: object, use_psum_layout: bool, k_alignment: int
) -> list[tuple[int, int]]:
    """``[(start_g, k_g)]`` of each group's K rows: from ``ks_cpu`` (consecutive groups) or, with
    ``use_psum_layout``, from ``grouped_layout``'s cumulative ends (read on the host)."""
    if not isinstance(grouped_layout, torch.Tensor) or grouped_layout.dtype != torch.int32 or grouped_layout.dim() != 1:
        raise ValueError(f"{fn}: grouped_layout must be a 1-D int32 tensor [G], got {grouped_layout!r:.80}")
    g = grouped_layout.numel()
    given = list(ks_cpu) if isinstance(ks_cpu, (list, tuple)) else None
    if ks_cpu is not None and given is None:
        raise ValueError(f"{fn}: ks_cpu must be None or a list of ints, got {type(ks_cpu).__name__}")
    if given and (len(given) != g or not all(isinstance(k, int) and k >= 0 for k in given)):
        raise ValueError(f"{fn}: ks_cpu must hold {g} ints >= 0 (one per group of grouped_layout), got {given}")
    if use_psum_layout:
        ends = [int(e) for e in grouped_layout.tolist()]
        ranges, prev = [], 0
        for end in ends:
            start = _align(prev, k_alignment)
            if end < start:
                raise ValueError(f"{fn}: grouped_layout (psum) must hold non-decreasing ends, got {ends}")
            ranges.append((start, end - start))
            prev = end
        return ranges
    if not given:
        raise ValueError(f"{fn}: ks_cpu must list the groups' K sizes unless use_psum_layout, got {ks_cpu!r}")
    if any(k % k_alignment for k in given):
        raise ValueError(f"{fn}: every K in ks_cpu must be a multiple of the K alignment {k_alignment}, got {given}")
    starts = [sum(given[:i]) for i in range(g)]
    return list(zip(starts, given))


def _check_d_c(fn: str, d: object, c: object, g: int, m: int, n: int) -> None:
    if not isinstance(d, torch.Tensor) or d.dtype != torch.float32 or tuple(d.shape) != (g, m, n):
        got = (d.dtype, tuple(d.shape)) if isinstance(d, torch.Tensor) else type(d).__name__
        raise ValueError(f"{fn}: d must be float32 [G, M, N] = ({g}, {m}, {n}), got {got}")
    if not d.is_contiguous():
        raise ValueError(f"{fn}: d must be contiguous, got strides {d.stride()}")
    if c is not None and (not isinstance(c, torch.Tensor) or c.shape != d.shape or c.dtype != d.dtype):
        raise ValueError(f"{fn}: c must be None or a tensor like d (float32 {tuple(d.shape)}), got {c!r:.80}")


def _accumulate(
    d: torch.Tensor, c: torch.Tensor | None, g: int, product: torch.Tensor | None
) -> None:  # product [M, N] float32, or None for an empty group
    base = c[g] if c is not None else None
    if product is None:
        d[g].copy_(base) if base is not None else d[g].zero_()
    else:
        d[g].copy_(product if base is None else product + base)


def _recipe_gran(fn: str, recipe: object, allowed: tuple[int, ...]) -> int:
    if not (isinstance(recipe, tuple) and len(recipe) == 3 and recipe[:2] == (1, 1) and recipe[2] in allowed):
        grans = " or ".join(f"(1, 1, {x})" for x in allowed)
        raise ValueError(f"{fn}: recipe must be {grans} (1xK scales on both operands), got {recipe!r}")
    return int(recipe[2])


def _fp8_pairs(fn: str, a: object, b: object) -> tuple[Pair, Pair]:
    for name, x in (("a", a), ("b", b)):
        if not (isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x)):
            raise ValueError(f"{fn}: {name} must be a (tensor, scales) pair, got {type(x).__name__}")
        if x[0].dtype != torch.float8_e4m3fn or x[1].dtype != torch.float32:
            raise ValueError(
                f"{fn}: {name} must be (float8_e4m3fn values, float32 scales), got ({x[0].dtype}, {x[1].dtype})"
            )
    assert isinstance(a, (tuple, list)) and isinstance(b, (tuple, list))
    return (a[0], a[1]), (b[0], b[1])


def k_grouped_fp8_gemm_nt_contiguous(
    a: Pair, b: Pair, d: torch.Tensor, ks_cpu: list[int] | None, grouped_layout: torch.Tensor,
    c: torch.Tensor | None = None, recipe: Recipe = (1, 1, 128), compiled_dims: str = "mn",
    use_psum_layout: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``d[g] = c[g] + a_g @ b_g.T`` with ``a_g`` the ``[M, k_g]`` K-major block of group ``g`` in the flat FP8 ``a``
    (scales float32 ``[M, sum(ceil(k_g/128))]``), ``b_g`` likewise ``[N, k_g]``; ``recipe=(1, 1, 128)``, no psum
    layout (as DeepGEMM). See :mod:`epkit.compat._details.deep_gemm_k_grouped`."""
    fn = "k_grouped_fp8_gemm_nt_contiguous"
    check_flags(fn, compiled_dims, False, use_psum_layout)
    gran = _recipe_gran(fn, recipe, (128,))
    if use_psum_layout:
        raise ValueError(f"{fn}: use_psum_layout is not supported in the nt form (as in DeepGEMM); use the tn form")
    (a0, sfa), (b0, sfb) = _fp8_pairs(fn, a, b)
    ranges = group_ranges(fn, ks_cpu, grouped_layout, False, gran)
    if not isinstance(d, torch.Tensor) or d.dim() != 3:
        raise ValueError(f"{fn}: d must be a float32 [G, M, N] tensor, got {getattr(d, 'shape', type(d).__name__)}")
    g, m, n = d.shape
    _check_d_c(fn, d, c, len(ranges), m, n)
    sum_k = sum(k for _, k in ranges)
    kbs = [-(-k // gran) for _, k in ranges]
    for name, x, sf, mn in (("a", a0, sfa, m), ("b", b0, sfb, n)):
        if x.numel() != sum_k * mn or not x.is_contiguous():
            raise ValueError(
                f"{fn}: {name} must be contiguous with sum(ks) * {'M' if name == 'a' else 'N'} = {sum_k} * {mn} "
                f"values, got {tuple(x.shape)}"
            )
        if tuple(sf.shape) != (mn, sum(kbs)):
            raise ValueError(f"{fn}: {name}'s scales must be [{mn}, {sum(kbs)}] (1x128 along K), got {tuple(sf.shape)}")
    a_flat, b_flat = a0.reshape(-1), b0.reshape(-1)
    kb_off = 0
    for i, ((start, k), kb) in enumerate(zip(ranges, kbs)):
        if k == 0:
            _accumulate(d, c, i, None)
            continue
        a_g = dequantize(a_flat[start * m : (start + k) * m].view(m, k), sfa[:, kb_off : kb_off + kb], 1, gran)
        b_g = dequantize(b_flat[start * n : (start + k) * n].view(n, k), sfb[:, kb_off : kb_off + kb], 1, gran)
        _accumulate(d, c, i, a_g @ b_g.T)
        kb_off += kb
    return d


def _tn_operands(
    fn: str, a0: torch.Tensor, b0: torch.Tensor, d: object, ranges: list[tuple[int, int]]
) -> tuple[int, int]:
    if a0.dim() != 2 or b0.dim() != 2 or a0.shape[0] != b0.shape[0]:
        raise ValueError(
            f"{fn}: a [sum_K, M] and b [sum_K, N] must share sum_K, got a {tuple(a0.shape)}, b {tuple(b0.shape)}"
        )
    end = max((s + k for s, k in ranges), default=0)
    if end > a0.shape[0]:
        raise ValueError(f"{fn}: the groups need {end} rows along K but a {tuple(a0.shape)} has {a0.shape[0]}")
    return a0.shape[1], b0.shape[1]


def k_grouped_fp8_gemm_tn_contiguous(
    a: Pair, b: Pair, d: torch.Tensor, ks_cpu: list[int] | None, grouped_layout: torch.Tensor,
    c: torch.Tensor | None = None, recipe: Recipe = (1, 1, 128), compiled_dims: str = "mn",
    use_psum_layout: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``d[g] = c[g] + a_g.T @ b_g`` with FP8 ``a`` ``(e4m3 [sum_K, M], float32 [sum(ceil(k_g/gran_k)), M])`` and
    ``b`` likewise with N; ``recipe=(1, 1, 128)`` or ``(1, 1, 32)``; psum layout allowed. See
    :mod:`epkit.compat._details.deep_gemm_k_grouped`."""
    fn = "k_grouped_fp8_gemm_tn_contiguous"
    check_flags(fn, compiled_dims, False, use_psum_layout)
    gran = _recipe_gran(fn, recipe, (32, 128))
    (a0, sfa), (b0, sfb) = _fp8_pairs(fn, a, b)
    ranges = group_ranges(fn, ks_cpu, grouped_layout, use_psum_layout, SETTINGS.alignment)
    m, n = _tn_operands(fn, a0, b0, d, ranges)
    _check_d_c(fn, d, c, len(ranges), m, n)
    kbs = [-(-k // gran) for _, k in ranges]
    for name, sf, mn in (("a", sfa, m), ("b", sfb, n)):
        if tuple(sf.shape) != (sum(kbs), mn):
            raise ValueError(
                f"{fn}: {name}'s scales must be [sum(ceil(k_g / {gran})), {'M' if name == 'a' else 'N'}] = "
                f"[{sum(kbs)}, {mn}], got {tuple(sf.shape)}"
            )
    kb_off = 0
    for i, ((start, k), kb) in enumerate(zip(ranges, kbs)):
        if k == 0:
            _accumulate(d, c, i, None)
            continue
        a_g = dequantize(a0[start : start + k].T, sfa[kb_off : kb_off + kb].T, 1, gran)  # [M, k]
        b_g = dequantize(b0[start : start + k].T, sfb[kb_off : kb_off + kb].T, 1, gran)  # [N, k]
        _accumulate(d, c, i, a_g @ b_g.T)
        kb_off += kb
    return d


def k_grouped_bf16_gemm_tn_contiguous(
    a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, ks_cpu: list[int] | None, grouped_layout: torch.Tensor,
    c: torch.Tensor | None = None, compiled_dims: str = "mn", use_psum_layout: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``d[g] = c[g] + a_g.T @ b_g`` with bf16 ``a [sum_K, M]`` and ``b [sum_K, N]``, float32 accumulation. See
    :mod:`epkit.compat._details.deep_gemm_k_grouped`."""
    fn = "k_grouped_bf16_gemm_tn_contiguous"
    check_flags(fn, compiled_dims, False, use_psum_layout)
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
            raise ValueError(f"{fn}: {name} must be a bfloat16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    ranges = group_ranges(fn, ks_cpu, grouped_layout, use_psum_layout, SETTINGS.alignment)
    m, n = _tn_operands(fn, a, b, d, ranges)
    _check_d_c(fn, d, c, len(ranges), m, n)
    for i, (start, k) in enumerate(ranges):
        product = a[start : start + k].T.float() @ b[start : start + k].float() if k else None
        _accumulate(d, c, i, product)
    return d
