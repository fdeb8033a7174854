"""DeepEP's tensor layouts for ``epkit.compat.deep_ep``, converted from and to EPBuffer's (the handles are in
``deep_ep_handles``).

- Normal-mode FP8 scales: DeepEP moves any ``[T, S]`` float32 or int32 (packed UE8M0) scales, in any strides,
  and returns them ``[R, S]`` row-major in the same dtype; EPBuffer moves float32 ``[T, ceil(hidden / 128)]``.
  Scales of ``S <= ceil(hidden / 128)`` 4-byte words travel as bytes in those columns (padded with zeros),
  bit for bit.
- Low-latency FP8 scales: ``[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden // 128]``
  float32, or with ``use_ue8m0`` packed UE8M0 int32 ``[..., hidden // 512]`` (byte ``j`` of an int32 is the
  ``j``-th of four consecutive groups); both column-major in the last two dims (stride 1 along the tokens),
  for TMA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

import torch

from epkit.collectives.ep.rows import align_up
from epkit.quant import FP8_BLOCK, cast_groups_to_fp8

if TYPE_CHECKING:
    from epkit.collectives.ep.ll_out import LLRows

__all__ = [
    "pad_rows",
    "DeepEPRows",
    "carry_scales",
    "restore_scales",
    "column_major",
    "tma_scales",
    "LowLatencyOutputs",
]

#: Token-dimension padding of V2's TMA-aligned column-major scales (``use_tma_aligned_col_major_sf``): 16 bytes of
#: 4-byte packs.
SF_PACK = 4

#: Rows as DeepEP's calls take and return them: bf16 ``x``, or ``(x e4m3, scales)``.
DeepEPRows = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@overload
def pad_rows(t: torch.Tensor, n: int, fill: int) -> torch.Tensor: ...
@overload
def pad_rows(t: torch.Tensor | None, n: int, fill: int) -> torch.Tensor | None: ...
def pad_rows(t: torch.Tensor | None, n: int, fill: int) -> torch.Tensor | None:
    """Received rows ``t`` padded to ``n`` rows of ``fill`` (DeepEP's ``num_worst_tokens``, V2's worst-case shapes:
    ids -1, weights and rows 0); None stays None."""
    if t is None:
        return None
    have = t.shape[0]
    if have > n:
        raise ValueError(f"dispatch: {have} rows were received, more than num_worst_tokens = {n}")
    return torch.cat([t, t.new_full((n - have, *t.shape[1:]), fill)])


def carry_scales(x_scales: torch.Tensor, num_tokens: int, hidden: int) -> tuple[torch.Tensor, int, torch.dtype]:
    """``(float32 [T, ceil(hidden / 128)] words to send, S, dtype)`` of DeepEP-style dispatch scales ``[T, S]``."""
    slots = -(-hidden // FP8_BLOCK)
    if (
        not isinstance(x_scales, torch.Tensor)
        or x_scales.dim() != 2
        or x_scales.shape[0] != num_tokens
        or x_scales.dtype not in (torch.float32, torch.int32)
    ):
        raise ValueError(
            f"dispatch: x must be (x_fp8 [T, hidden], scales [T, S]) with float32 or int32 scales, T = {num_tokens}; "
            f"got scales {getattr(x_scales, 'dtype', type(x_scales).__name__)} {tuple(getattr(x_scales, 'shape', ()))}"
        )
    s = x_scales.shape[1]
    if s > slots:
        raise ValueError(
            f"dispatch: x's scales have {s} columns; epkit carries at most ceil(hidden / 128) = {slots} 4-byte "
            "scales per token (per-128 float32, or packed UE8M0 int32)"
        )
    words = x_scales.contiguous().view(torch.float32)
    return torch.nn.functional.pad(words, (0, slots - s)) if s < slots else words, s, x_scales.dtype


def restore_scales(recv: torch.Tensor, s: int, dtype: torch.dtype) -> torch.Tensor:
    """The received ``[R, S]`` scales in their dtype, row-major (DeepEP's recv_x_scales)."""
    return recv[:, :s].contiguous().view(dtype)


def column_major(rows_first: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty ``[L, N, C]`` tensor stored as ``[L, C, N]`` (column-major in its last two dims)."""
    num_local, n, c = rows_first
    return torch.empty((num_local, c, n), dtype=dtype, device=device).transpose(1, 2)


class LowLatencyOutputs:
    """DeepEP's low-latency receive tensors over EPBuffer's ``recv_x`` and ``recv_count`` (from its pool, which never
    hands out memory the caller still holds: DeepEP's fresh-per-call tensors in all but their addresses), completed
    by :meth:`fill` once they are received (the receive hook calls it).

    ``mode``: ``"bf16"`` (EPBuffer's bf16 rows, as they are), ``"fp8"`` (EPBuffer's FP8 rows as they are, its
    per-128 scales copied column-major), or ``"round"`` (``round_scale``: EPBuffer sent bf16 rows, quantized here
    with power-of-two scales, as DeepEP quantizes each token before sending; the scales are the same, the codes the
    same bits).
    """

    def __init__(self, mode: str, use_ue8m0: bool, recv_x: LLRows, recv_count: torch.Tensor) -> None:
        self.mode, self.use_ue8m0 = mode, use_ue8m0
        self._received: LLRows | None = recv_x  # EPBuffer's, filled by its receive hook
        self.count = recv_count
        rows = recv_x[0] if isinstance(recv_x, tuple) else recv_x  # (e4m3, scales) exactly when mode is "fp8"
        num_local, slots, hidden = rows.shape
        self.x = rows
        self.scales: torch.Tensor | None = None
        if mode == "round":
            self.x = torch.empty((num_local, slots, hidden), dtype=torch.float8_e4m3fn, device=rows.device)
        if mode != "bf16":
            groups = hidden // FP8_BLOCK
            shape = (num_local, slots, groups // 4 if use_ue8m0 else groups)
            self.scales = column_major(shape, torch.int32 if use_ue8m0 else torch.float32, rows.device)

    def fill(self) -> None:
        """Lay out (and for ``round``, quantize) EPBuffer's received rows as DeepEP's, then let go of them."""
        recv_x, self._received = self._received, None
        if self.mode == "bf16":
            return
        # the receive hook runs fill once (after that recv_x is None), and every mode but bf16 made scales
        assert recv_x is not None and self.scales is not None
        if self.mode == "fp8":
            s = recv_x[1]
        else:
            assert isinstance(recv_x, torch.Tensor)  # round: EPBuffer sent bf16 rows
            q, s = cast_groups_to_fp8(recv_x, FP8_BLOCK, ue8m0=True)
            self.x.copy_(q)
        if self.use_ue8m0:  # the exponent bytes of the power-of-two scales, four to an int32
            s = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).contiguous().view(torch.int32)
        self.scales.copy_(s)

    def result(self) -> DeepEPRows:
        return (self.x, self.scales) if self.scales is not None else self.x


def tma_scales(scales: torch.Tensor, tma_aligned: bool) -> torch.Tensor:
    """``[R, S]`` scales (a dispatch's received ones, or V2's fetched Engram factors) row-major, or with
    ``tma_aligned`` column-major with the rows padded to a multiple of 4 (V2's ``use_tma_aligned_col_major_sf``
    strides: ``(1, align_up(R, 4))``)."""
    if not tma_aligned:
        return scales
    rows = scales.shape[0]
    tma = torch.empty((scales.shape[1], align_up(rows, SF_PACK)), dtype=scales.dtype, device=scales.device)
    return tma.T[:rows].copy_(scales)
