"""Layout helpers of EPBuffer's low-latency mode: the combine handle, header status codes, the slot grid.

A low-latency message to one destination is ``[header | x slots | scale slots]``: the header holds int32
``[status, n_max, use_fp8, count per local expert]`` and the sender's error text (``ep_rows.META_MSG``
bytes); then ``num_local_experts * n_max`` fixed slots of x rows (and of FP8 scales), expert-major.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "BAD_IDS",
    "OK",
    "OVERFLOW",
    "REJECTED",
    "LowLatencyHandle",
    "describe_header",
    "message_spacing",
    "slot_grid",
]

# Status word of a low-latency message header.
OK, REJECTED, BAD_IDS, OVERFLOW = 0, -1, -2, -3


@dataclass
class LowLatencyHandle:
    """State for :meth:`EPBuffer.low_latency_combine` (tensors on the buffer's device)."""

    num_tokens: int
    dst_of: torch.Tensor  # [T, K] destination rank per slot (-1: none)
    expert_of: torch.Tensor  # [T, K] local expert id on the destination
    pos_of: torch.Tensor  # [T, K] slot position within (source, expert) block
    counts: torch.Tensor  # [W, L] rows received from each source per local expert
    n_max: int = 0  # slots per (source, local expert) of the dispatch


def describe_header(src: int, code: int, n_used: int, fp8_used: int, text: str, n_max: int | None, use_fp8: bool):
    """The error one received header reports, or None."""
    if code == REJECTED:
        return f"rank {src}: {text}"
    if code == BAD_IDS:
        return f"rank {src}: topk_idx holds expert ids outside [-1, num_experts)"
    if code == OVERFLOW:
        return (
            f"rank {src}: an expert gets more (token, expert) pairs than its {n_used} slots "
            f"(duplicate expert ids within a token?)"
        )
    if code != OK:
        return f"rank {src}: corrupt low-latency header (status {code})"
    if n_max is not None and (n_used != n_max or fp8_used != int(use_fp8)):
        return (
            f"rank {src} used num_max_dispatch_tokens_per_rank={n_used}, use_fp8={bool(fp8_used)}"
            f" but this rank {n_max}, {use_fp8}"
        )
    return None


def slot_grid(counts: torch.Tensor, n_max: int):
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
