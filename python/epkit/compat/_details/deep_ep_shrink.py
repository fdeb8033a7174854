"""DeepEP's shrink mode (``Buffer(..., enable_shrink=True)``) for ``epkit.compat.deep_ep``'s low-latency calls:
the ranks masked on one Buffer, and how the unmasked ranks meet without the masked ones.

A rank that stops taking part in the low-latency calls (alive, but it never calls again) would hold every other
rank's all-gather forever. So in shrink mode each low-latency call (and ``clean_low_latency_buffer``) meets the
other ranks through the job's store instead (:meth:`RankMask.exchange`): every unmasked rank posts its row under
the call's number and waits, for the Buffer's timeout at most, for the rows of the ranks it has not masked. Who is
masked after that call is decided once, by the first rank to get there (an atomic ``compare_set`` of the call's
decision key): the ranks whose row that rank had not seen, plus every rank some posted row (or that rank) masks.
Every other rank adopts that decision, whatever it saw itself (a rank that posted just after the decision stays
masked on every rank, and finds itself masked: it raises). So the survivors mask the same ranks at the same call,
and the rows then move among them only (``EPBuffer.mask_ranks``, and buffers made over them alone: a
:class:`~epkit.collectives.bootstrap.SubGroup`, with the experts renumbered, :func:`sub_experts`).

The store holds two entries per rank and two decisions per Buffer (slot ``call % 2``), each starting with its call
number, and one "read up to call n" entry per rank; they are overwritten, never deleted, and read without waiting
(:func:`_peek`). A rank overwrites call ``n``'s entries at call ``n + 2`` once the ranks unmasked in call ``n`` have
read them (or after the timeout): a rank masked by hand at call ``n + 1`` still gets call ``n``'s result, and one that
stopped inside call ``n`` past the timeout finds later entries there and raises (a read of a deleted key would wait
for the store's timeout).

A rank masked by hand (``low_latency_update_mask_buffer``) is masked at the next call on every rank (its mask is in
this rank's row); a mask cleared by hand on every rank (``low_latency_clean_mask_buffer``) makes the next call wait
for that rank again (a silent one is masked again after the timeout). A rank left out of a buffer's exchanges never
rejoins that buffer (its exchanges fell behind): a new buffer is made over the unmasked ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from epkit.collectives.bootstrap import Rendezvous
from epkit.collectives.deadline import deadline_after

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["RankMask", "sub_experts", "widen"]

#: Longest pause between two looks at the store while waiting for the other ranks' rows.
_MAX_PAUSE = 0.01


def _flags(ranks: set[int], world_size: int) -> bytes:
    return bytes(int(r in ranks) for r in range(world_size))


def _ranks(flags: bytes) -> set[int]:
    return {r for r, f in enumerate(flags) if f}


#: What :func:`_peek` returns for a key not in the store: call 0 (no call has it), never a stored value.
_ABSENT = bytes(8)


def _call(value: bytes) -> int:
    """The call number a row or decision starts with (0: :data:`_ABSENT`)."""
    return int.from_bytes(value[:8], "little")


def _poll(ready: Callable[[], bool], deadline: float) -> None:
    """Call ``ready`` until it returns True or ``deadline`` (a ``time.monotonic()`` instant) passes, with pauses from
    0.1 ms doubling up to :data:`_MAX_PAUSE` between calls."""
    pause = 1e-4
    while not ready() and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(2 * pause, _MAX_PAUSE)


def _peek(store: Any, key: str) -> bytes:  # Any: torch's stubs type the values str, the binding takes bytes
    """``key``'s value, or :data:`_ABSENT` at once where it is not set (``store.get`` would wait for it): a
    compare-and-set that never matches a stored value (each starts with its call number, >= 1) and, for a key
    not set, an expected value that is not empty, neither of which writes anything."""
    got: bytes = store.compare_set(key, _ABSENT, _ABSENT)
    return got


class RankMask:
    """The ranks (group positions) masked on one Buffer, and the meeting of the others (module docstring); made
    with the Buffer on every rank, in the same order."""

    def __init__(self, group: ProcessGroup, rank: int, world_size: int, global_ranks: list[int]) -> None:
        self.rank, self.world_size, self.global_ranks = rank, world_size, global_ranks
        self.masked: set[int] = set()
        self._rv = Rendezvous(group, 30.0, "deep_ep Buffer shrink")  # its store prefix: no communication
        self._calls = 0
        self._decisions = [b"", b""]  # the last two calls' decisions as read (calls n % 2): compare_set's expected

    def unmasked(self) -> tuple[int, ...]:
        """The positions not masked, ascending (this rank's among them)."""
        return tuple(r for r in range(self.world_size) if r not in self.masked)

    def update(self, rank: int, mask: bool) -> None:
        """Mask (``mask``) or unmask ``rank`` here; the next call's meeting makes it every rank's (module docstring)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"low_latency_update_mask_buffer: rank_to_mask must be in [0, {self.world_size}), got {rank!r}"
            )
        if not isinstance(mask, bool):
            raise ValueError(f"low_latency_update_mask_buffer: mask must be a bool, got {mask!r}")
        if mask and rank == self.rank:
            raise ValueError(f"low_latency_update_mask_buffer: rank {rank} cannot mask itself")
        (self.masked.add if mask else self.masked.discard)(rank)

    def query(self, mask_status: torch.Tensor) -> None:
        """Write 1 for each masked rank, 0 for the others, into ``mask_status`` (``[num_ranks]`` int32)."""
        if not isinstance(mask_status, torch.Tensor) or mask_status.shape != (self.world_size,):
            raise ValueError(f"low_latency_query_mask_buffer: mask_status must be a [{self.world_size}] int32 tensor")
        if mask_status.dtype != torch.int32:
            raise ValueError(f"low_latency_query_mask_buffer: mask_status must be int32, got {mask_status.dtype}")
        flags = torch.tensor([int(r in self.masked) for r in range(self.world_size)], dtype=torch.int32)
        mask_status.copy_(flags)

    def exchange(self, payload: bytes, what: str, timeout: float) -> dict[int, bytes]:
        """Every unmasked rank's ``payload`` by position (this rank's too), once the ranks silent for ``timeout``
        seconds are masked on every rank alike (module docstring). Raises RuntimeError on a rank its peers masked,
        also one they masked at a later call while it was still in this one (it finds a later call's entries)."""
        self._calls += 1
        n, w, store, slot = self._calls, self.world_size, self._rv.store, self._calls % 2
        stamp = n.to_bytes(8, "little")
        self._await_readers(store, n, timeout)
        store.set(f"{slot}/{self.rank}", stamp + _flags(self.masked, w) + payload)
        others = [r for r in range(w) if r != self.rank and r not in self.masked]
        decided = f"{slot}/masked"
        rows: dict[int, bytes] = {}

        def arrived() -> bool:  # every row, or the call decided without some
            rows.update(self._read(store, [r for r in others if r not in rows], n, what, timeout))
            return len(rows) == len(others) or _call(_peek(store, decided)) >= n

        _poll(arrived, deadline_after(timeout))
        proposal = self.masked | (set(others) - set(rows))
        for row in rows.values():
            proposal |= _ranks(row[:w])
        # the first rank's decision wins: the slot holds call n - 2's decision (this rank read it) until then
        got = store.compare_set(decided, self._decisions[slot], stamp + _flags(proposal, w))
        if _call(got) != n:  # a later call's: the others went on without this rank
            raise self._masked_error(what, timeout)
        self._decisions[slot] = got
        masked = _ranks(got[8:])
        if self.rank in masked:
            raise self._masked_error(what, timeout)
        self.masked = masked
        need = [r for r in range(w) if r not in masked and r != self.rank and r not in rows]
        rows.update(self._read(store, need, n, what, timeout))  # posted: the deciding rank saw them
        store.set(f"done/{self.rank}", stamp)  # read: call n's entries may be overwritten at call n + 2
        rows[self.rank] = _flags(self.masked, w) + payload
        return {r: rows[r][w:] for r in sorted(rows) if r not in masked}

    def _await_readers(self, store: Any, n: int, timeout: float) -> None:
        """Before call ``n`` overwrites call ``n - 2``'s entries: wait, ``timeout`` at most, until every other rank
        unmasked in that call has read them (its ``done`` entry). A rank the others leave out of call ``n - 1`` (masked
        by hand) so still gets call ``n - 2``'s result; one stopped inside that call finds later entries, and raises."""
        prior = self._decisions[n % 2]  # call n - 2's decision, as read there
        if not prior:
            return
        late = [f"done/{r}" for r in range(self.world_size) if r != self.rank and r not in _ranks(prior[8:])]

        def read() -> bool:
            late[:] = [k for k in late if _call(_peek(store, k)) < n - 2]
            return not late

        _poll(read, deadline_after(timeout))

    def _read(self, store: Any, ranks: list[int], n: int, what: str, timeout: float) -> dict[int, bytes]:
        """The rows of ``ranks`` posted for call ``n`` (without the call number); ranks not yet there are left
        out. A row of a later call means the others went on without this rank: RuntimeError (masked)."""
        got: dict[int, bytes] = {}
        for r in ranks:
            row = _peek(store, f"{n % 2}/{r}")
            call = _call(row)
            if call == n:
                got[r] = row[8:]
            elif call > n:
                raise self._masked_error(what, timeout)
        return got

    def _masked_error(self, what: str, timeout: float) -> RuntimeError:
        return RuntimeError(
            f"rank {self.global_ranks[self.rank]}: {what}: the other ranks masked this rank (it did not come "
            f"within {timeout:g} s, or a rank masked it by hand); it takes no further part in this Buffer's "
            "low-latency calls"
        )

    def gather(self, mine: torch.Tensor, what: str, timeout: float, fill: int) -> torch.Tensor:
        """Every rank's ``mine`` (one shape and dtype on every rank), ``[W, *mine.shape]`` on the CPU: the masked
        ranks' rows ``fill``."""
        flat = mine.detach().contiguous().cpu().view(-1)
        got = self.exchange(flat.view(torch.uint8).numpy().tobytes(), what, timeout)
        out = torch.full((self.world_size, flat.numel()), fill, dtype=flat.dtype)
        for r, row in got.items():
            out[r] = torch.frombuffer(bytearray(row), dtype=torch.uint8).view(flat.dtype)
        return out.view(self.world_size, *mine.shape)


def sub_experts(topk_idx: torch.Tensor, members: tuple[int, ...], masked: set[int], num_local: int,
                num_experts: int) -> torch.Tensor:  # fmt: skip
    """``topk_idx [T, K]`` (DeepEP's global expert ids) as ids of a buffer over the ranks ``members`` (positions,
    ascending): expert ``e`` of rank ``e // num_local`` is ``members.index(that rank) * num_local + e % num_local``,
    -1 where that rank is masked (its experts are absent), ``num_local * len(members)`` (out of range, for the
    buffer to reject) where ``e`` is not an expert id, -1 stays -1. int64, on ``topk_idx``'s device."""
    where = torch.full((num_experts // num_local,), -1, dtype=torch.int64)
    for i, r in enumerate(members):
        if r not in masked:
            where[r] = i
    ids = topk_idx.long()
    bad = (ids < -1) | (ids >= num_experts)
    owner = where.to(ids.device)[(ids.clamp(0, num_experts - 1) // num_local)]
    sub = torch.where((ids >= 0) & (owner >= 0), owner * num_local + ids.clamp(min=0) % num_local, -1)
    return torch.where(bad, num_local * len(members), sub)


def widen(rows: torch.Tensor, slots: int) -> torch.Tensor:
    """A zeroed ``[L, slots, ...]`` tensor of ``rows``' dtype and device for ``rows [L, fewer slots, ...]`` (a
    buffer over fewer ranks than the Buffer's): DeepEP's receive layout, filled by copying ``rows`` in front."""
    return rows.new_zeros((rows.shape[0], slots, *rows.shape[2:]))
