"""Layout helpers of EPBuffer's low-latency mode: the combine handle, header status codes, the slot grid.

A low-latency message to one destination is ``[header | x slots | scale slots]``: the header holds int32
``[status, n_max, use_fp8, count per local expert]`` and the sender's error text (``ep.rows.META_MSG``
bytes); then ``num_local_experts * n_max`` fixed slots of x rows (and of FP8 scales), expert-major. That is
the stream-ordered mode's layout; the host-checked mode packs the same header and rows without the empty
slots (``ep/ll_packed``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# The status words of a message header (shared with the device kernels).
from epkit.collectives.ep.ll_out import LLRows
from epkit.collectives.ep.rows import copy_rows_by_address, rank_name
from epkit.kernels.triton.ep_layout import BAD_IDS, COMBINE_HEAD, OK, OVERFLOW, REJECTED

__all__ = [
    "BAD_IDS",
    "COMBINE_HEADER",
    "OK",
    "OVERFLOW",
    "REJECTED",
    "REJECTED_HANDLE",
    "LLCombineResult",
    "LLDispatchResult",
    "LowLatencyHandle",
    "describe_handles",
    "describe_header",
    "describe_parameters",
    "judge_headers",
    "route_pairs",
    "message_spacing",
    "slot_grid",
    "unpack_slots",
]


@dataclass
class LowLatencyHandle:
    """State for :meth:`EPBuffer.low_latency_combine` (tensors on the buffer's device)."""

    num_tokens: int
    dst_of: torch.Tensor  # [T, K] destination rank per slot (-1: none)
    expert_of: torch.Tensor  # [T, K] local expert id on the destination
    pos_of: torch.Tensor  # [T, K] slot position within (source, expert) block
    counts: torch.Tensor  # [W, L] rows received from each source per local expert
    n_max: int = 0  # slots per (source, local expert) of the dispatch
    buffer_id: int = 0  # the EPBuffer's SymmBuffer.buffer_id: a handle is only valid on the buffer that made it
    epoch: int = 0  # which low-latency dispatch of that buffer made it (1 for the first)
    route: torch.Tensor | None = None  # device kernels: [3, T, K] int32 destination, local expert, slot (-1: none)


#: What a low-latency dispatch returns: ``(recv_x, recv_count, handle, hook)``.
LLDispatchResult = tuple[LLRows, torch.Tensor, LowLatencyHandle, Callable[[], None]]
#: What a low-latency combine returns: the ``[T, hidden]`` result, or with ``return_recv_hook`` ``(None, hook)``.
LLCombineResult = torch.Tensor | tuple[None, Callable[[], torch.Tensor]]


#: Bytes before the rows of a low-latency combine message: int64 [buffer id, dispatch epoch] of the handle.
COMBINE_HEADER = COMBINE_HEAD
#: The buffer id of a combine header whose sender rejected its own call (its error text follows the header);
#: buffer ids are positive.
REJECTED_HANDLE = -1


def describe_handles(heads: list[list[int]], buffer_id: int, what: str, ranks: Sequence[int]) -> str | None:
    """The error (the same on every rank) when the ranks' ``[buffer id, epoch]`` handle headers do not all
    name one dispatch of buffer ``buffer_id``; None when they do. ``ranks``: the global rank of each position."""
    if all(h == heads[0] for h in heads) and heads[0][0] == buffer_id:
        return None
    desc = "; ".join(
        f"{rank_name(r, ranks)}: {'this buffer' if h[0] == buffer_id else f'another buffer ({h[0]:x})'}'s "
        f"dispatch {h[1]}"
        for r, h in enumerate(heads)
    )
    return (
        f"{what} rejected on every rank: the handles do not come from one dispatch of this buffer ({desc}); give "
        f"every rank the handle its matching dispatch returned"
    )


def describe_header(src: int, code: int, n_used: int, text: str, ranks: Sequence[int]) -> str | None:
    """The error one received header's status reports, or None (``n_used``: the sender's slots per expert;
    ``ranks``: the global rank of each position)."""
    who = rank_name(src, ranks)
    if code == REJECTED:
        return f"{who}: {text}"
    if code == BAD_IDS:
        return f"{who}: topk_idx holds expert ids outside [-1, num_experts)"
    if code == OVERFLOW:
        return (
            f"{who}: an expert gets more (token, expert) pairs than its {n_used} slots "
            f"(duplicate expert ids within a token?)"
        )
    if code != OK:
        return f"{who}: corrupt low-latency header (status {code})"
    return None


def describe_parameters(heads: list[list[int]], ranks: Sequence[int]) -> str | None:
    """The error (the same on every rank) when the ranks' headers ``[status, n_max, use_fp8]`` name different
    ``num_max_dispatch_tokens_per_rank`` / ``use_fp8``; None when they agree."""
    if len({(h[1], h[2]) for h in heads}) <= 1:
        return None
    return (
        "the ranks' parameters differ ("
        + "; ".join(
            f"{rank_name(r, ranks)}: num_max_dispatch_tokens_per_rank={h[1]}, use_fp8={bool(h[2])}"
            for r, h in enumerate(heads)
        )
        + ")"
    )


def judge_headers(
    heads: list[list[int]], text_of: Callable[[int], str], check_params: bool, ranks: Sequence[int]
) -> list[str]:
    """Every error the ranks' dispatch headers ``[status, n_max, use_fp8]`` report, worded alike on every rank;
    ``text_of(src)`` reads a rejecting rank's error text; ``check_params``: also compare the parameters; ``ranks``:
    the global rank of each position."""
    found = [
        describe_header(src, code, n_used, text_of(src) if code == REJECTED else "", ranks)
        for src, (code, n_used, _) in enumerate(heads)
    ]
    errors = [e for e in found if e is not None]
    if not errors and check_params:
        mismatch = describe_parameters(heads, ranks)
        if mismatch is not None:
            errors.append(mismatch)
    return errors


def route_pairs(
    topk_idx: torch.Tensor, num_experts: int, n_max: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fixed-shape routing of a low-latency dispatch, on ``topk_idx``'s device (no host read).

    Returns ``key [T*K]`` (global expert, ``num_experts`` for none), ``pos [T*K]`` (slot among this
    rank's pairs for that expert: token order, then k), ``per_expert [E]`` (pairs per expert) and
    ``status`` (a 0-dim int32 tensor: OK, BAD_IDS or OVERFLOW).
    """
    E, dev = num_experts, topk_idx.device
    ids = topk_idx.long().reshape(-1)
    n = ids.numel()
    bad = (ids < -1) | (ids >= E)
    key = torch.where((ids >= 0) & ~bad, ids, E)
    per = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    sorted_key, perm = torch.sort(key, stable=True)
    starts = torch.cumsum(per, 0) - per
    pos = torch.empty_like(key).scatter_(0, perm, torch.arange(n, device=dev) - starts[sorted_key])
    over = (per[:E] > n_max).any()
    status = torch.where(bad.any(), BAD_IDS, torch.where(over, OVERFLOW, OK)).to(torch.int32)
    return key, pos, per[:E], status


def slot_grid(counts: torch.Tensor, n_max: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``[W, L, n_max]`` grid of low-latency slots (source, local expert, index), for ``counts [W, L]``.

    Returns ``(src, live, slot, row)``: the source index (``[W, 1, 1]``, broadcastable), which slots hold a
    row, each slot's position in its message (``e * n_max + i``) and its row in the masked layout (expert
    ``e``'s rows ordered by source, then slot). Fixed shapes: no host read.
    """
    w, L = counts.shape
    dev = counts.device
    starts = torch.cumsum(counts, 0) - counts  # [W, L]: where each source's rows start per expert
    src = torch.arange(w, device=dev).view(w, 1, 1)
    e = torch.arange(L, device=dev).view(1, L, 1)
    i = torch.arange(n_max, device=dev).view(1, 1, n_max)
    return src, i < counts[:, :, None], e * n_max + i, e * (n_max * w) + starts[:, :, None] + i


def message_spacing(views: list[torch.Tensor]) -> tuple[int, int]:
    """(address of the first received message, bytes between consecutive sources' messages).

    Direct transports receive into fixed regions of the local buffer and the torch transport into
    one tensor split evenly (every low-latency message has the same size), so the spacing is uniform.
    """
    ptrs = [v.data_ptr() for v in views]
    stride = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
    if any(b - a != stride for a, b in zip(ptrs, ptrs[1:])) or stride < 0:
        raise RuntimeError(f"low-latency messages are not evenly spaced in memory ({ptrs})")
    return ptrs[0], stride


def unpack_slots(
    views: list[torch.Tensor], recv_x: LLRows, counts: torch.Tensor, n_max: int, hdr: int, xb: int, sb: int,
    portable: bool = False,
) -> None:  # fmt: skip
    """Received slot messages -> the masked layout: expert e's rows ordered by source, then slot (fixed-shape:
    the stream-ordered mode's unpacking; ``counts [W, L]``, ``recv_x`` as ``low_latency_dispatch`` returns it)."""
    L = counts.shape[1]
    src, live, slot, row = slot_grid(counts, n_max)
    first, stride = message_spacing(views)
    x_dst = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).data_ptr()
    msg = first + src * stride
    copy_rows_by_address(
        torch.where(live, x_dst + row * xb, 0),
        torch.where(live, msg + hdr + slot * xb, 0),
        xb,
        [first, stride, hdr, x_dst],
        portable=portable,
    )
    if sb:
        s_dst, off = recv_x[1].data_ptr(), hdr + L * n_max * xb
        copy_rows_by_address(
            torch.where(live, s_dst + row * sb, 0),
            torch.where(live, msg + off + slot * sb, 0),
            sb,
            [first, stride, off, s_dst],
            portable=portable,
        )
