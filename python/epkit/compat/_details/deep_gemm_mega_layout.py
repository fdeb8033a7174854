"""DeepGEMM's Mega MoE weight layout for ``epkit.compat.deep_gemm``: :func:`transform_weights_for_mega_moe` and its
inverse, which the layer applies before it runs on epkit's GEMMs (they take gate and up as two halves).

The layout (DeepGEMM's, so that weights an engine prepared for DeepGEMM's kernel read the same here):

- L1 (gate/up, ``[G, 2I, ...]``): the gate and up halves interleaved in runs of 8 rows (gate 0..7, up 0..7, gate
  8..15, ...), the weights and, for FP4 weights, their scales;
- FP4 scales of L1 (after the interleave) and of L2: within each block of 128 rows, row ``32 * j + i`` moved to ``4 * i
  + j`` (DeepGEMM's transpose for the tensor cores' scale copy); DeepGEMM's packed UE8M0 int32 ``[G, N, K/128]`` and
  epkit's float32 ``[G, N, K/32]`` scales (what :func:`transform_sf_into_required_layout` returns) alike;
- BF16 L2 is unchanged.
"""

from __future__ import annotations

import torch

__all__ = ["Weights", "transform_weights_for_mega_moe", "plain_weights"]

#: One expert GEMM's weights: BF16 ``[G, N, K]``, or FP4 ``(int8 [G, N, K/2], scales)``.
Weights = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
_RUN = 8  # rows of gate, then of up, in the interleaved L1
_SF_BLOCK, _SF_LANES = 128, 4  # the scale transpose: 128-row blocks, read as 4 x 32


def _interleave(t: torch.Tensor) -> torch.Tensor:
    g, n, *rest = t.shape
    halves = t.reshape(g, 2, n // (2 * _RUN), _RUN, *rest)  # [G, gate/up, run, row in run, ...]
    return halves.transpose(1, 2).reshape(g, n, *rest).contiguous()


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    g, n, *rest = t.shape
    runs = t.reshape(g, n // (2 * _RUN), 2, _RUN, *rest)  # [G, run, gate/up, row in run, ...]
    return runs.transpose(1, 2).reshape(g, n, *rest).contiguous()


def _sf_transpose(sf: torch.Tensor, inverse: bool) -> torch.Tensor:
    g, mn, k = sf.shape
    lanes = (_SF_BLOCK // _SF_LANES, _SF_LANES) if inverse else (_SF_LANES, _SF_BLOCK // _SF_LANES)
    return sf.reshape(g, mn // _SF_BLOCK, *lanes, k).transpose(2, 3).reshape(g, mn, k).contiguous()


def _check(fn: str, name: str, w: object, l1: bool) -> None:
    """``w`` a BF16 tensor or an FP4 ``(int8, int32 or float32 scales)`` pair, with the row counts the layout needs."""
    if isinstance(w, tuple):
        if not (len(w) == 2 and all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in w)):
            raise ValueError(f"{fn}: {name} must be a (weights, scales) pair of [G, N, ...] tensors, got {w!r:.80}")
        values, sf = w
        if values.dtype not in (torch.int8, torch.uint8) or sf.dtype not in (torch.int32, torch.float32):
            raise ValueError(f"{fn}: {name} must be packed FP4 (int8) with int32 or float32 scales")
        if values.shape[1] % _SF_BLOCK or sf.shape[:2] != values.shape[:2]:
            raise ValueError(
                f"{fn}: {name}'s N = {values.shape[1]} must be a multiple of {_SF_BLOCK} and its scales [G, N, ...], "
                f"got weights {tuple(values.shape)} and scales {tuple(sf.shape)}"
            )
    elif isinstance(w, torch.Tensor) and w.dim() == 3 and w.dtype == torch.bfloat16:
        values = w
    else:
        raise ValueError(f"{fn}: {name} must be a bfloat16 [G, N, K] tensor or an FP4 (weights, scales) pair")
    if l1 and values.shape[1] % (2 * _RUN):
        raise ValueError(f"{fn}: l1_weights' N = {values.shape[1]} (gate and up) must be a multiple of {2 * _RUN}")


def transform_weights_for_mega_moe(
    l1_weights: Weights, l2_weights: Weights, activation: str = "swiglu"
) -> tuple[Weights, Weights]:
    """``(l1, l2)`` in DeepGEMM's Mega MoE layout (module docstring): ``l1_weights`` ``[G, 2I, H]`` (gate rows, then
    up rows) and ``l2_weights`` ``[G, H, I]``, both BF16 or both FP4 ``(int8 [G, N, K/2], scales)``. New tensors."""
    fn = "transform_weights_for_mega_moe"
    if activation != "swiglu":
        raise ValueError(f"{fn}: only activation='swiglu' is supported, got {activation!r}")
    _check(fn, "l1_weights", l1_weights, l1=True)
    _check(fn, "l2_weights", l2_weights, l1=False)
    if isinstance(l1_weights, tuple) != isinstance(l2_weights, tuple):
        raise ValueError(f"{fn}: l1_weights and l2_weights must both be BF16 or both FP4 (weights, scales) pairs")
    if isinstance(l1_weights, tuple) and isinstance(l2_weights, tuple):
        l1 = (_interleave(l1_weights[0]), _sf_transpose(_interleave(l1_weights[1]), inverse=False))
        return l1, (l2_weights[0], _sf_transpose(l2_weights[1], inverse=False))
    assert isinstance(l1_weights, torch.Tensor)
    return _interleave(l1_weights), l2_weights


def plain_weights(fn: str, l1_weights: Weights, l2_weights: Weights, fp4: bool) -> tuple[Weights, Weights]:
    """The inverse of :func:`transform_weights_for_mega_moe` (after its checks): gate and up as two halves, scales in
    row order, as epkit's GEMMs take them (copies)."""
    for name, w in (("l1_weights", l1_weights), ("l2_weights", l2_weights)):
        _check(fn, name, w, l1=name == "l1_weights")
        if isinstance(w, tuple) != fp4:
            raise ValueError(f"{fn}: {name} must be {'an FP4 (weights, scales) pair' if fp4 else 'a bfloat16 tensor'}")
    if isinstance(l1_weights, tuple) and isinstance(l2_weights, tuple):
        l1 = (_deinterleave(l1_weights[0]), _deinterleave(_sf_transpose(l1_weights[1], inverse=True)))
        return l1, (l2_weights[0], _sf_transpose(l2_weights[1], inverse=True))
    assert isinstance(l1_weights, torch.Tensor)
    return _deinterleave(l1_weights), l2_weights
