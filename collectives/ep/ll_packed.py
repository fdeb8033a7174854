"""Packed low-latency messages: the layout of the host-checked mode (CPU rows).

The stream-ordered mode (CUDA rows) sends every destination a message of fixed slots, ``num_local_experts *
n_max`` rows whatever the routing, because its host reads no count (``ep/ll_layout``). The host-checked
mode reads the counts anyway, so its messages hold only the rows they carry:

* dispatch, to one destination: ``[header | x rows | FP8 scales]``; the header is the slot layout's (its count
  words say how many rows follow for each local expert), the rows are expert-major, expert ``e``'s from row
  ``sum(counts[:e])`` on, in slot order; the scales block starts at ``header + align_up(rows * x bytes)``;
* combine, to one source: ``[header (the handle's identity, COMBINE_HEADER bytes) | rows]``, for each local
  expert in order the rows of that source's pairs, in slot order (the counts both ends hold: what the
  dispatch's header said).

A one-sided transport writes the same bytes into the region either way; a two-sided one (``torch``) sends only
what a message holds (``Exchange.receive(..., at_most=True)``) instead of its whole region: at 128 tokens per
rank, hidden 2048 and 32 local experts, 1 MiB per peer instead of 16 MiB. The received rows, their order and
every sum are the slot layout's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epkit.collectives.ep.ll_layout import slot_grid
from epkit.collectives.ep.ll_out import LLRows
from epkit.collectives.ep.rows import align_up, copy_rows_by_address, rank_name

__all__ = ["check_lengths", "combine_layout", "dispatch_layout", "first_rows", "sent_counts", "unpack_rows"]


def first_rows(counts: torch.Tensor) -> torch.Tensor:
    """``[W, L]``: each expert's first row in its message (the counts of the experts before it, per message)."""
    return torch.cumsum(counts, 1) - counts


def dispatch_layout(counts: torch.Tensor, hdr: int, xb: int, sb: int) -> tuple[torch.Tensor, list[int]]:
    """Per destination (``counts [W, L]``: the rows each gets per local expert): the scale block's offset
    (``[W]`` int64) and the message's bytes (a list: the host commits them)."""
    total = counts.sum(1)
    scale_off = hdr + align_up(total * xb)
    return scale_off, (scale_off + total * sb).tolist()


def check_lengths(views: list[torch.Tensor], need: list[int], what: str, ranks: Sequence[int]) -> None:
    """Every received message holds the ``need[src]`` bytes its header (or the handle) says it does (``ranks``:
    the global rank of each position, for the message)."""
    short = [(src, v.numel(), n) for src, (v, n) in enumerate(zip(views, need)) if v.numel() < n]
    if short:
        raise RuntimeError(
            f"{what}: messages shorter than their counts say ("
            + "; ".join(f"{rank_name(s, ranks)}: {got} of {n} bytes" for s, got, n in short)
            + "): the ranks are out of step"
        )


def unpack_rows(
    views: list[torch.Tensor], recv_x: LLRows, got: torch.Tensor, n_max: int, hdr: int, xb: int, sb: int,
    ranks: Sequence[int], portable: bool = False,
) -> None:  # fmt: skip
    """Received packed messages -> the masked layout (expert ``e``'s rows by source, then slot); ``got [W, L]``:
    the headers' counts, already judged; ``ranks``: the global rank of each position."""
    w = got.shape[0]
    scale_off, need = dispatch_layout(got, hdr, xb, sb)
    check_lengths(views, need, "low-latency dispatch", ranks)
    _, live, _, row = slot_grid(got, n_max)  # which slots hold a row, and its row in the masked layout
    at = first_rows(got)[:, :, None] + torch.arange(n_max)  # its row within its message
    msg = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64).view(w, 1, 1)
    x_dst = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).data_ptr()
    x_src = torch.where(live, msg + hdr + at * xb, 0)
    copy_rows_by_address(torch.where(live, x_dst + row * xb, 0), x_src, xb, [hdr, x_dst], portable=portable)
    if sb:
        s_dst = recv_x[1].data_ptr()
        src = torch.where(live, msg + scale_off.view(w, 1, 1) + at * sb, 0)
        copy_rows_by_address(torch.where(live, s_dst + row * sb, 0), src, sb, [s_dst], portable=portable)


def sent_counts(dst_of: torch.Tensor, expert_of: torch.Tensor, w: int, L: int) -> torch.Tensor:
    """``[W, L]`` int64: the pairs a source sent each (destination, local expert) (its handle's live pairs):
    the counts the destination's combine message is packed by."""
    live = dst_of >= 0
    key = (dst_of * L + expert_of)[live]
    return torch.bincount(key, minlength=w * L).view(w, L)


def combine_layout(
    counts: torch.Tensor, n_max: int, head: int, row_bytes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Where an expert rank's combine rows go: ``(live, y_row, dst_row, sizes)`` over the ``[W, L, n_max]`` slot
    grid of ``counts [W, L]`` (rows received from each source per local expert): which slots hold a row, its
    row in the masked ``y``, its byte offset in the message to its source, and each message's bytes."""
    _, live, _, y_row = slot_grid(counts, n_max)
    at = head + (first_rows(counts)[:, :, None] + torch.arange(n_max)) * row_bytes
    return live, y_row, at, (head + counts.sum(1) * row_bytes).tolist()
