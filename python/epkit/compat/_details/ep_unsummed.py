"""Rows back to their source unsummed (``EPBuffer.combine_unsummed``), placed for a caller's own sum: the compat
layers that sum in their peer's order (DeepEP V2's combine, DeepGEMM's Mega MoE) share these two steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from epkit.collectives.ep.handles import DispatchHandle
    from epkit.collectives.ep_buffer import EPBuffer

__all__ = ["rows_in_rank", "slot_rows_back"]


def rows_in_rank(send_tokens: list[torch.Tensor], num_tokens: int) -> torch.Tensor:
    """``[T, W]`` int64: which row of rank r's returned rows token t is (``send_tokens[r]``: the tokens this rank
    sent rank r, ascending, as the rows come back); 0 where t did not go to r."""
    rows = torch.zeros((num_tokens, len(send_tokens)), dtype=torch.int64)
    for r, toks in enumerate(send_tokens):
        rows[toks, r] = torch.arange(toks.numel())
    return rows


def slot_rows_back(
    ep: EPBuffer, handle: DispatchHandle, y: torch.Tensor, owner: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every (token, top-k slot) row of an expanded dispatch back at its source, one ``combine_unsummed`` per slot.

    ``y [X, H]``: one row per expanded row; ``owner [T, K]``: the rank holding each slot's expert (-1: none).
    Returns ``(terms, src_of [T, K], row_of [T, K])``: float32 CPU row blocks, and for token t's slot j which block
    and row hold it (``src_of`` -1: no row), for ``sum_indexed_rows`` (k ascending)."""
    assert handle.expanded_rows is not None and handle.expanded_slot is not None  # an expanded dispatch's handle
    n_exp, n_recv = int(handle.expanded_rows.numel()), int(handle.recv_topk_idx.shape[0])
    num_tokens, k = owner.shape
    row_in_rank = rows_in_rank(handle.send_tokens, num_tokens)
    terms: list[torch.Tensor] = []
    src_of = torch.full((num_tokens, k), -1, dtype=torch.int64)
    row_of = torch.zeros((num_tokens, k), dtype=torch.int64)
    ones = torch.ones((n_recv, k), dtype=torch.float32)  # the expert side adds the slot's row alone, unscaled
    for j in range(k):
        lane = torch.zeros((n_exp, y.shape[1]), dtype=y.dtype, device=y.device)
        slot = handle.expanded_slot[:, j]
        mine = slot[slot >= 0].to(y.device)
        lane[mine] = y[mine]
        base = len(terms)
        terms += [rows.float().cpu() for rows in ep.combine_unsummed(lane, handle, ones)]
        hit = owner[:, j] >= 0
        src_of[hit, j] = base + owner[hit, j]
        row_of[hit, j] = row_in_rank[hit, owner[hit, j]]
    return terms, src_of, row_of
