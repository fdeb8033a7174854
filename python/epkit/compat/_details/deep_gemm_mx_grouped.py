"""DeepGEMM's m-grouped contiguous FP8xFP4 GEMM with 1x32 activation scales (``recipe=(1, 1, 32)``, SM100's MXFP8 x
MXFP4 recipe, the one Mega MoE's composed reference path calls) for ``epkit.compat.deep_gemm``.

epkit's grouped GEMM kernels take 1x128 activation scales, so this recipe runs on a torch fallback on every device:
per group, the group's rows of ``a`` and the group's weights dequantized to float32 (each exact: an FP8 or FP4 value
times a power of two), one float32 matmul, rounded once to ``d``'s dtype. A group's rows depend on that group's rows
alone (not on ``M`` or on the other groups), so the same rows give the same bits however many padding rows surround
them. Padding rows (in no group) are written as zeros, as epkit's kernels write them.
"""

from __future__ import annotations

import torch

from epkit.compat._details.deep_gemm_operands import Gran, Pair, Recipe, fp8_pairs
from epkit.compat._details.deep_gemm_runtime import SETTINGS
from epkit.compat._details.deep_gemm_scales import fp4_weights, rows_of_psum, unpack_ue8m0
from epkit.quant import MXFP4_BLOCK, dequant_mxfp4

__all__ = ["is_mx_recipe", "m_grouped_fp8_fp4_mx_contiguous"]


def is_mx_recipe(recipe: Recipe | None, recipe_a: Gran | None, recipe_b: Gran | None) -> bool:
    """Whether a call's recipe gives ``a`` 1x32 scales and ``b`` 1x32 scales (``(1, 1, 32)``, or ``recipe_a=(1, 32),
    recipe_b=(1, 32)``): the recipe this module computes."""
    if recipe is not None:
        return recipe_a is None and recipe_b is None and tuple(recipe) == (1, 1, MXFP4_BLOCK)
    return recipe_a is not None and tuple(recipe_a) == (1, MXFP4_BLOCK) and tuple(recipe_b or ()) == (1, MXFP4_BLOCK)


def _activations(fn: str, a0: torch.Tensor, sfa: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float32 ``[M, K / 32]`` scales of ``a`` (packed UE8M0 int32 ``[M, K / 128]``, any strides, or float32 ``[M, K /
    32]``), after the shape checks of ``a`` and ``d``."""
    if a0.dim() != 2 or d.dim() != 2 or d.shape[0] != a0.shape[0]:
        raise ValueError(f"{fn}: a must be [M, K] and d [M, N], got a {tuple(a0.shape)} and d {tuple(d.shape)}")
    if d.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{fn}: d must be bfloat16 or float32, got {d.dtype}")
    m, k = a0.shape
    if k % (4 * MXFP4_BLOCK):
        raise ValueError(f"{fn}: K = {k} must be a multiple of 128 with recipe (1, 1, 32) (a {tuple(a0.shape)})")
    groups = k // MXFP4_BLOCK
    want = {torch.int32: (m, groups // 4), torch.float32: (m, groups)}.get(sfa.dtype)
    if want is None or tuple(sfa.shape) != want:
        raise ValueError(
            f"{fn}: a's 1x32 scales must be packed UE8M0 int32 [M, K/128] = [{m}, {groups // 4}] or float32 "
            f"[M, K/32] = [{m}, {groups}], got {sfa.dtype} {tuple(sfa.shape)}"
        )
    return unpack_ue8m0(sfa, groups) if sfa.dtype == torch.int32 else sfa.float()


def m_grouped_fp8_fp4_mx_contiguous(
    fn: str, a: Pair, b: Pair, d: torch.Tensor, grouped_layout: torch.Tensor, use_psum_layout: bool
) -> torch.Tensor:
    """``d[i] = a[i] @ b[group of row i].T`` with ``a`` ``(e4m3 [M, K], 1x32 scales)`` and packed FP4 ``b`` ``(int8 [G,
    N, K/2], packed UE8M0 int32 [G, N, K/128] or float32 [G, N, K/32])``; ``grouped_layout`` per-row group ids ``[M]``
    (-1 padding) or, with ``use_psum_layout``, ``[G]`` cumulative row ends (each group starting at the previous end
    rounded up to the contiguous layout's alignment). Read on the host (a fallback: see the module docstring)."""
    (a0, sfa), (b0, sfb) = fp8_pairs(fn, a, b)
    if b0.dtype not in (torch.int8, torch.uint8) or b0.dim() != 3:
        raise ValueError(f"{fn}: recipe (1, 1, 32) takes packed FP4 b (int8 [G, N, K/2]), got {b0.dtype} {b0.shape}")
    scales = _activations(fn, a0, sfa, d)
    g, n, half_k = b0.shape
    m, k = a0.shape
    if half_k * 2 != k or n != d.shape[1]:
        raise ValueError(f"{fn}: b must be [G, N, K/2] = [G, {d.shape[1]}, {k // 2}], got {tuple(b0.shape)}")
    codes, e8m0 = fp4_weights(fn, b0, sfb, (1, MXFP4_BLOCK))
    if not isinstance(grouped_layout, torch.Tensor) or grouped_layout.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: grouped_layout must be an int32 tensor, got {getattr(grouped_layout, 'dtype', None)}")
    want = (g,) if use_psum_layout else (m,)
    if tuple(grouped_layout.shape) != want:
        raise ValueError(f"{fn}: grouped_layout must be {list(want)}, got {list(grouped_layout.shape)}")
    ids = rows_of_psum(grouped_layout, m, SETTINGS.alignment) if use_psum_layout else grouped_layout
    ids = ids.cpu().long()
    if bool(((ids < -1) | (ids >= g)).any()):
        raise ValueError(f"{fn}: grouped_layout names groups outside [-1, {g})")
    d[(ids < 0).to(d.device)] = 0
    for grp in torch.unique(ids[ids >= 0]).tolist():
        rows = (ids == grp).nonzero().flatten().to(a0.device)
        x = a0[rows].float() * scales[rows].repeat_interleave(MXFP4_BLOCK, dim=-1)
        w = dequant_mxfp4(codes[grp], e8m0[grp])
        d[rows] = (x @ w.T).to(d.dtype)
    return d
