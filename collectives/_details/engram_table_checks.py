"""What ShardedEngramTable checks of a lookup before anything is sent, and the error every rank raises when a
rank's lookup failed them (the same words on every rank, whichever path the lookups take)."""

from __future__ import annotations

import torch

__all__ = ["fetch_error", "rejection"]


def fetch_error(row_ids, out, num_rows: int, dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why ``fetch(row_ids, out)`` on a table of ``num_rows x dim`` ``dtype`` rows on ``device`` is invalid, or None.

    ``row_ids``: a tensor of int32 or int64 global rows in ``[0, num_rows)``, on ``device``; ``out`` (optional):
    a contiguous ``[*row_ids.shape, dim]`` tensor of ``dtype`` on ``device``.
    """
    if not isinstance(row_ids, torch.Tensor):
        return f"row_ids must be a tensor, got {type(row_ids).__name__}"
    if row_ids.dtype not in (torch.int32, torch.int64):
        return f"row_ids must be int32 or int64, got {row_ids.dtype}"
    if row_ids.device != device:
        return f"row_ids is on {row_ids.device} but the table is on {device}"
    if row_ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(row_ids))
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            pos = int((row_ids.reshape(-1) == bad).nonzero()[0])
            return f"row_ids[flat {pos}] = {bad} is outside [0, num_rows = {num_rows})"
    if out is None:
        return None
    want = (*row_ids.shape, dim)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != dtype:
        return (
            f"out must be a {dtype} tensor of shape {want}, got {getattr(out, 'dtype', type(out).__name__)} "
            f"of shape {tuple(getattr(out, 'shape', ()))}"
        )
    if out.device != device or not out.is_contiguous():
        return f"out must be contiguous on {device}, got {out.device} (contiguous={out.is_contiguous()})"
    return None


def rejection(group_ranks: list[int], errors: list[tuple[int, str]]) -> ValueError | None:
    """The ValueError every rank raises when some ranks' ``fetch`` was invalid (``errors``: (group rank, text))."""
    if not errors:
        return None
    text = "; ".join(f"rank {group_ranks[i]}: {msg}" for i, msg in errors)
    return ValueError(f"ShardedEngramTable.fetch rejected on every rank before any row id was sent: {text}")
