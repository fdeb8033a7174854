"""What a host-driven normal dispatch returns, once its rows have arrived (flat and hierarchical paths alike):
the per-expert counts, the expanded rows, the handle."""

from __future__ import annotations

import torch

from epkit.collectives.ep.context import EPContext
from epkit.collectives.ep.handles import DispatchHandle, DispatchResult, HierRoute, Rows
from epkit.collectives.ep.rows import expanded_layout

__all__ = ["aligned_counts", "cached_result", "finish_dispatch", "gather_expanded"]


def aligned_counts(recv_topk_idx: torch.Tensor, num_local: int, alignment: int) -> list[int]:
    """Received (token, local expert) pairs per local expert, each rounded up to ``alignment``."""
    ids = recv_topk_idx
    counts = torch.bincount(ids[ids >= 0].long(), minlength=num_local).tolist()
    return [int(-(-c // alignment) * alignment) for c in counts]


def gather_expanded(ctx: EPContext, recv_x: torch.Tensor, recv_s: torch.Tensor | None, rows: torch.Tensor) -> Rows:
    """The expanded rows (``rows``: received row per expanded row, -1 = a zero padding row), as dispatch
    returns them: ``x`` or ``(x, scales)``."""
    from epkit.gather import gather_rows

    rows_dev = rows.to(ctx.device)
    out = [
        gather_rows(part, rows_dev, out=ctx.host_empty((rows.numel(), part.shape[1]), part.dtype))
        for part in (recv_x, recv_s)
        if part is not None
    ]
    return tuple(out) if len(out) == 2 else out[0]


def finish_dispatch(
    ctx: EPContext,
    recv: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor],
    tokens: list[torch.Tensor],
    recv_counts: list[int],
    num_tokens: int,
    expand: bool,
    alignment: int,
    hier: HierRoute | None,
) -> DispatchResult:
    """Dispatch's results from the received ``(x, scales or None, local ids, weights)`` (rows by source, then
    source token): counts the load, expands if asked, makes the handle."""
    recv_x, recv_scales, recv_idx, recv_w = recv
    L = ctx.cfg.num_local_experts
    counts = torch.bincount(recv_idx.reshape(-1).long() + 1, minlength=L + 1)[1:]  # bin 0: the -1 entries
    ctx.recv_tokens_per_expert_total += counts
    aligned = [int(-(-c // alignment) * alignment) for c in counts.tolist()]
    rows: torch.Tensor | None = None
    slot: torch.Tensor | None = None
    x_out: Rows = (recv_x, recv_scales) if recv_scales is not None else recv_x
    if expand:
        rows, slot = expanded_layout(recv_idx, counts, alignment)
        x_out = gather_expanded(ctx, recv_x, recv_scales, rows)
    handle = DispatchHandle(
        send_tokens=tokens,
        recv_counts=recv_counts,
        num_tokens=num_tokens,
        recv_topk_idx=recv_idx,
        recv_topk_weights=recv_w,
        expand=expand,
        expert_alignment=alignment,
        expanded_rows=rows,
        expanded_slot=slot,
        device=ctx.device,
        buffer_id=ctx.buffer.buffer_id,
        epoch=ctx.dispatches,
        hier=hier,
    )
    return DispatchResult(x_out, recv_idx.to(ctx.device), recv_w.to(ctx.device), aligned, handle)


def cached_result(
    ctx: EPContext, recv_x: torch.Tensor, recv_s: torch.Tensor | None, handle: DispatchHandle
) -> DispatchResult:
    """A cached dispatch's results from the rows it received along ``handle``'s routing (expanded as the handle's
    dispatch was; the ids, weights and counts are the handle's)."""
    x_out: Rows = recv_x if recv_s is None else (recv_x, recv_s)
    if handle.expand:
        assert handle.expanded_rows is not None  # an expanded dispatch's handle holds its rows
        x_out = gather_expanded(ctx, recv_x, recv_s, handle.expanded_rows)
    aligned = aligned_counts(handle.recv_topk_idx, ctx.cfg.num_local_experts, handle.expert_alignment)
    idx, w = handle.recv_topk_idx.to(ctx.device), handle.recv_topk_weights.to(ctx.device)
    return DispatchResult(x_out, idx, w, aligned, handle)
