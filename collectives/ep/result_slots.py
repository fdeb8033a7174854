"""Result slots: a normal dispatch's senders write the rows straight into the receiver's result (CPU ranks on one
host, the ``shm`` transport).

Without them each peer's rows go into the receiver's region of the exchange, and the receiver copies them out into
a result tensor: a second pass over every row it receives (2 ranks, 4096 tokens of 4 KiB each: 15 MiB of the ~76
MiB a rank writes per dispatch + combine, ~17% of the time on a 2-core machine). With them a rank's symmetric
buffer also holds ``count`` slots, each with room for every row it can receive (``world_size *
num_max_tokens_per_rank`` rows of the x field, float32 wide, and of the scale field). Before the layout
agreement a rank takes a slot that no result of its own uses any more and names it in its agreement message,
together with how many rows it sends each rank; from those, every sender knows where its rows start in each
receiver's result (after the rows of the lower ranks) and writes its x and scale rows there, and the receiver
returns views of its slot as ``recv_x`` (and the scales). The routing fields (local ids, weights) still travel
in the region. A slot is free again once no tensor or view of its rows is alive (a lease on the memory the
result tensors are made from, ``ep.rows.leased_bytes``, as :class:`~epkit.collectives.ep.rows.RowPool`
does), which also keeps the shared memory mapped past the buffer's close. While the caller holds ``count``
results, a rank names no slot and its rows take the region and the copy, as before. The rows, their order and
every sum are the same.

A hierarchical buffer on CPU ranks (``ep/normal_hier``) has slots of the same kind in its ``intra`` buffer: the rank
that
forwards a rail row (or its own token) to another rank of its host writes the x and scale rows into that rank's
slot, where the row's source starts (2 hosts x 2 ranks, 4096 tokens: ~6% of a dispatch + combine).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from epkit.collectives.ep.rows import align_up, leased_bytes

if TYPE_CHECKING:
    from epkit.collectives.symm_buffer import SymmBuffer

__all__ = ["RESULT_SLOTS", "ResultSlots", "result_slot_count"]

#: Result slots per rank of a flat ``shm`` buffer (and of a hierarchy's ``intra`` buffer): results a caller may
#: hold with the next dispatch still writing straight into a free one. ``EPKIT_RESULT_SLOTS`` sets another number
#: (0: none, the rows go through the regions and a copy; each slot costs every row a rank can receive in shared
#: memory).
RESULT_SLOTS = 2


def result_slot_count() -> int:
    """The result slots a new ``shm`` EPBuffer (or hierarchy) makes: ``EPKIT_RESULT_SLOTS`` (an int >= 0) or
    :data:`RESULT_SLOTS`."""
    raw = os.environ.get("EPKIT_RESULT_SLOTS", str(RESULT_SLOTS)).strip()
    if not raw.isdigit():
        raise ValueError(f"EPKIT_RESULT_SLOTS must be an integer >= 0, got {raw!r}")
    return int(raw)


class ResultSlots:
    """``count`` result slots at byte ``offset`` of every rank's buffer (see the module docstring).

    Parameters
    ----------
    offset : int
        Where the first slot starts in each rank's data (past the regions).
    count : int
        Slots per rank.
    rows : int
        Rows a slot holds (every row a rank can receive).
    x_bytes, s_bytes : int
        The widest x row (float32) and scale row a dispatch moves.
    """

    def __init__(self, offset: int, count: int, rows: int, x_bytes: int, s_bytes: int):
        self.offset, self.count, self.rows = offset, count, rows
        self.x_area = align_up(rows * x_bytes, 4096)
        self.slot_bytes = self.x_area + align_up(rows * s_bytes, 4096)
        self.nbytes = count * self.slot_bytes
        self._busy = [False] * count
        self.buffer: SymmBuffer | None = None  # the buffer they are in: set by their maker before any call

    def take(self) -> int:
        """A slot no result uses (now reserved), or -1 when every one is held."""
        for k, busy in enumerate(self._busy):
            if not busy:
                self._busy[k] = True
                return k
        return -1

    def give_back(self, k: int) -> None:
        """Slot ``k`` is free again (its result tensors are gone, or the call that took it made none)."""
        if k >= 0:
            self._busy[k] = False

    def area(self, rank: int, k: int, field: int, first: int, n: int, width: int) -> torch.Tensor:
        """Rows ``[first, first + n)`` of field ``field`` (0: x, 1: scales) of rank ``rank``'s slot ``k``, as an
        ``[n, width]`` uint8 view of its memory (a peer's: one-sided writes)."""
        at = self.offset + k * self.slot_bytes + field * self.x_area + first * width
        assert self.buffer is not None  # attached by the maker before any call
        return self.buffer.peer(rank)[at : at + n * width].view(n, width)

    def results(self, k: int, total: int, xb: int, sb: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's slot ``k`` as its results, ``[total, xb]`` and ``[total, sb]`` uint8 (None without scales);
        the slot comes back when the last tensor or view of either is freed."""
        assert self.buffer is not None  # attached by the maker before any call
        hold = _Hold(self, k, self.buffer.local)
        base = self.buffer.local.data_ptr() + self.offset + k * self.slot_bytes
        out: list[torch.Tensor | None] = []
        for at, width in ((0, xb), (self.x_area, sb)):
            if width == 0:
                out.append(None)
                continue
            nbytes = total * width
            if nbytes == 0:  # no zero-length leases: an empty result holds nothing
                out.append(torch.empty((0, width), dtype=torch.uint8))
                continue
            out.append(leased_bytes(base + at, nbytes, hold).view(total, width))
        assert out[0] is not None  # xb > 0: every row has x bytes
        return out[0], out[1]


class _Hold:
    """Gives slot ``k`` back when freed (when every result tensor over it is); ``memory`` (the buffer's local
    tensor) keeps the shared memory mapped until then."""

    def __init__(self, slots: ResultSlots, k: int, memory: torch.Tensor):
        self.slots, self.k, self.memory = slots, k, memory

    def __del__(self) -> None:
        self.slots.give_back(self.k)
