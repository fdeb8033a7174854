"""The ``shm`` transport: CPU ranks on one host, over POSIX shared memory (``csrc/shm_transport.cpp``).

Each rank creates a segment (mode 0600) named from a random 128-bit token that rank 0 draws and
broadcasts, every rank maps every peer's segment, and each segment's name is unlinked as soon as all
ranks have attached: a killed rank leaves nothing in /dev/shm (one dying inside the bootstrap leaves a
name the survivors remove, since every rank knows every name in advance). ``peer_view(r)`` is a direct
view of rank r's data; puts are plain copies into it; signal words are atomics in ``epkit._C`` and waits
are timed (the GIL released while they spin).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import time

import torch
import torch.distributed as dist

from epkit.collectives.transports.base import Transport, layout

__all__ = ["ShmTransport", "host_view", "wait_word"]


def host_view(addr: int, nbytes: int, owner=None) -> torch.Tensor:
    """``[nbytes]`` uint8 tensor over mapped host memory; the tensor (and every view of it) keeps ``owner`` alive."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    arr = (ctypes.c_uint8 * nbytes).from_address(addr)
    arr._epkit_owner = owner  # torch.frombuffer holds the array, the array holds the mapping
    return torch.frombuffer(arr, dtype=torch.uint8)


def wait_word(seg, off: int, cmp: str, value: int, deadline: float, abort_off: int | None = None) -> tuple[int, int]:
    """One timed wait in ``epkit._C`` (GIL released) until word ``off`` of segment ``seg`` satisfies ``cmp value``,
    watching the word at ``abort_off`` (None: none): ``(0, value)`` when it did, ``(1, abort word)`` when the
    abort word turned nonzero first, ``(2, last value)`` at ``deadline`` (``time.monotonic()``)."""
    left = max(0.0, deadline - time.monotonic())
    if abort_off is not None:
        return seg.wait_until_or_abort(off, cmp, value, abort_off, left)
    try:
        return 0, seg.wait_until(off, cmp, value, left)
    except TimeoutError:
        return 2, seg.load(off)


def _unlink_names(names: list[str]) -> None:
    """Remove POSIX shared-memory names if they exist (the bootstrap's cleanup after a failure)."""
    for name in names:
        with contextlib.suppress(FileNotFoundError, OSError):
            os.unlink(f"/dev/shm/{name.lstrip('/')}")  # where Linux keeps POSIX shm names


class ShmTransport(Transport):
    """One rank's segments: its own (created) and every peer's (attached). See the module docstring."""

    name = "shm"
    direct = True

    def __init__(self, group, rank: int, world_size: int, num_bytes: int, num_signals: int):
        super().__init__(group, rank, world_size, num_bytes, num_signals)
        from epkit import _C

        _, self.data_offset, seg_bytes = layout(world_size, num_signals, num_bytes)
        # One random 128-bit token per buffer, drawn by rank 0 before any segment exists: every rank knows
        # every segment's name in advance, so if a rank dies between creating its segment and the unlink
        # below, the survivors remove its name when the bootstrap fails.
        token = [secrets.token_hex(16) if rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        names = [f"/epkit-{token[0]}-{r}" for r in range(world_size)]
        mine = _C.ShmSegment(names[rank], seg_bytes, True)
        try:
            sizes = [None] * world_size
            dist.all_gather_object(sizes, seg_bytes, group=group)
            if len(set(sizes)) != 1:  # every rank sees the same list, so every rank raises
                raise ValueError(
                    f"SymmBuffer sizes differ across ranks (segment bytes per rank: {sizes}); every rank "
                    f"must pass the same num_bytes and num_signals"
                )
            segs = [mine if r == rank else _C.ShmSegment(names[r], seg_bytes, False) for r in range(world_size)]
            # Every rank has attached every segment once this barrier passes: unlink the names now.
            dist.barrier(group=group)
        except BaseException:
            _unlink_names(names)  # a peer may have died holding its name: remove every name of this buffer
            raise
        finally:
            mine.unlink()
        #: Every rank's mapped segment (signal words first, data at ``data_offset``).
        self.segments = segs
        self._views = [host_view(s.addr + self.data_offset, num_bytes, s) for s in segs]
        self.local = self._views[rank]

    def peer_view(self, rank: int) -> torch.Tensor:
        return self._views[rank]

    def within_domain(self) -> bool:
        return True

    def store(self, dst: int, off: int, value: int, op: str = "set", guarded: bool = False, urgent: bool = False):
        seg = self.segments[dst]
        if op == "set":
            seg.store(off, value)
        elif op == "add":
            seg.fetch_add(off, value)
        else:
            raise ValueError(f"op must be 'set' or 'add', got {op!r}")

    def load(self, off: int) -> int:
        return self.segments[self.rank].load(off)

    def wait(
        self, off: int, count: int, cmp: str, value: int, timeout: float, abort_words: int = 0
    ) -> tuple[int, int | None]:
        seg = self.segments[self.rank]
        deadline = time.monotonic() + timeout
        seen = 0
        for i in range(count):
            o = off + 8 * i
            status, seen = wait_word(seg, o, cmp, value, deadline, o + 8 * abort_words if abort_words else None)
            if status:
                return seen, i
        return seen, None

    def is_open(self) -> bool:
        return bool(self.segments)

    def close(self, collective: bool) -> None:
        # A segment is unmapped when its last reference goes; views hold one, so a view kept past
        # close() never points at an unmapped page.
        self.segments, self._views, self._staging = [], [], {}
        self.local = torch.empty(0, dtype=torch.uint8)
