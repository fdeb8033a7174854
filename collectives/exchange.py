"""One all-to-all of byte payloads in flight on a :class:`~epkit.collectives.symm_buffer.SymmBuffer`.

Made by :meth:`SymmBuffer.exchange`; every rank begins its exchanges in the same order, and each gets
a number (the epoch). Source rank s owns region s (``region_bytes``) of every receiver's buffer. Two
ways to move the payloads, chosen by the transport's capability:

- :class:`OneSidedExchange` (transports with signal words, ``direct``): the sender writes straight
  into the receiver's region (``send_region`` is a view of the peer's memory, or, for a peer out of
  reach, a staging tensor that ``commit`` puts with a signal), after the receiver acknowledged the
  previous epoch's message (ACK); ``commit`` raises READY; ``receive`` waits for every source's READY
  and returns views of the local regions; ``release`` acknowledges.
- :class:`TwoSidedExchange` (``torch``): payloads are staged and ``receive`` is one timed
  ``all_to_all`` of the transport.

Ranks the buffer masks (:meth:`SymmBuffer.mask`, one-sided only) are left out: their send regions are scratch,
nothing is posted to them or awaited from them, and their receive views are empty.

Only the public protocol primitives of the buffer are used (``post``, ``wait_for_peer``,
``wait_for_all``, ``mark_broken``, ``is_open``, ``impl``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from epkit.collectives.deadline import deadline_after
from epkit.collectives.transports.base import ACK, READY, word

__all__ = ["Exchange", "OneSidedExchange", "TwoSidedExchange", "exchange_payloads"]


class Exchange:
    """One all-to-all in flight (see the module docstring and :meth:`SymmBuffer.exchange`).

    Attributes
    ----------
    buf : SymmBuffer
    epoch : int
        This exchange's number on the buffer (1 for the first).
    region_bytes, tag, timeout, deferred, guarded
        As passed to :meth:`SymmBuffer.exchange`.
    skip : frozenset of int
        The ranks left out (``SymmBuffer.mask``; one-sided exchanges only, none elsewhere).
    """

    skip: frozenset[int] = frozenset()

    def __init__(
        self,
        buf,
        epoch: int,
        region_bytes: int,
        tag: str,
        timeout: float,
        deferred: bool,
        guarded: bool,
        on_done: Callable[[Exchange], None],
    ):
        self.buf, self.epoch, self.region_bytes, self.tag, self.timeout = buf, epoch, region_bytes, tag, timeout
        self.deferred, self.guarded = deferred, guarded
        self._on_done = on_done
        w = buf.world_size
        self._sizes: list[int | None] = [None] * w
        self._splits = [0] * w
        self._staging: list[torch.Tensor | None] = [None] * w
        self._recv = None

    @property
    def guard(self) -> torch.Tensor | None:
        """Stream-ordered (deferred) exchanges: the buffer's sticky word (``[1]`` int64 on the device), nonzero
        once a stream-ordered wait failed; copies that take it as their guard write nothing then. None
        otherwise (the waits end on the host, which raises before any write)."""
        return self.buf.impl.sticky_word if self.deferred else None

    def write(self, dst: int, data: torch.Tensor, offset: int = 0, portable: bool = False) -> None:
        """Copy ``data`` (uint8, 1-D) into :meth:`send_region` ``(dst)`` at ``offset``, guarded (see :attr:`guard`).

        The same bytes as ``send_region(dst)[offset:offset + n].copy_(data)``; in a stream-ordered exchange
        the copy is skipped on the stream when a wait before it failed. ``portable``: CPU rows take the device
        path's copy kernel too (``ep.rows.copy_rows_by_address``).
        """
        n = data.numel()
        if data.dtype != torch.uint8 or data.dim() != 1 or not 0 <= offset <= self.region_bytes - n:
            raise ValueError(
                f"write needs a 1-D uint8 tensor fitting the {self.region_bytes}-byte region at offset {offset}, got "
                f"{data.dtype} {tuple(data.shape)}"
            )
        region = self.send_region(dst)
        if n == 0:
            return
        guard = self.guard
        if guard is None:
            region[offset : offset + n].copy_(data)
            return
        from epkit.collectives.ep.rows import copy_rows_by_address

        src = data.contiguous()
        if src.device != region.device:  # from pinned memory, asynchronously: the host does not wait for the stream
            src = src.pin_memory().to(region.device, non_blocking=True)
        dst_addr = torch.full((1,), region.data_ptr() + offset, dtype=torch.int64, device=region.device)
        src_addr = torch.full((1,), src.data_ptr(), dtype=torch.int64, device=region.device)
        copy_rows_by_address(
            dst_addr, src_addr, n, [region.data_ptr(), offset, src.data_ptr()], guard=guard, portable=portable
        )

    def send_region(self, dst: int) -> torch.Tensor:
        """``[region_bytes]`` uint8 view to fill with the payload for ``dst``."""
        raise NotImplementedError

    def commit(self, dst: int, nbytes: int, split: int = 0) -> None:
        """The payload for ``dst`` (``nbytes`` at the start of its region) is complete. ``split`` (two-sided
        transports): its first ``split`` bytes travel as a part of their own, which ``dst`` receives into memory of
        its choosing (:meth:`receive`'s ``into``)."""
        if not 0 <= nbytes <= self.region_bytes or not 0 <= split <= nbytes:
            raise ValueError(f"payload of {nbytes} bytes for rank {dst} (split {split}) exceeds the region or itself")
        if split and not isinstance(self, TwoSidedExchange):
            raise ValueError(f"{self.tag}: a payload in two parts needs a two-sided transport")
        self._send(dst, nbytes)
        self._sizes[dst], self._splits[dst] = nbytes, split

    def _send(self, dst: int, nbytes: int) -> None:
        raise NotImplementedError

    def receive(self, recv_bytes: list[int], at_most: bool = False, into=None, meanwhile=None) -> list[torch.Tensor]:
        """Wait for every source's payload; ``recv_bytes[r]`` bytes from rank r. Views valid until release().

        ``into[r]`` (two-sided transports, not ``at_most``; None, or contiguous uint8 memory): rank r committed its
        payload split after ``into[r].numel()`` bytes (:meth:`commit`), and that first part is received straight
        there, not into the buffer's memory; rank r's view holds the rest.

        ``meanwhile``: work of the caller's to run while the payloads move (called once, before the wait; on a
        two-sided transport with every receive already posted, so ``recv_bytes`` must be sizes every rank agreed on
        before, not ``at_most``).

        ``at_most``: ``recv_bytes[r]`` only bounds what rank r sends (a message that says its own size, as a
        low-latency one whose header holds its counts). A two-sided transport then returns views of exactly the
        bytes each source committed (a larger message is an error naming the source), so only those cross the
        network; a one-sided one returns its ``recv_bytes[r]``-byte region views as always, so the caller reads
        what a message holds from the message itself (and checks it against the view's length).
        """
        missing = [r for r, s in enumerate(self._sizes) if s is None]
        if missing:
            raise RuntimeError(f"receive() before commit() for ranks {missing}")
        if into is not None and any(t is not None for t in into) and not isinstance(self, TwoSidedExchange):
            raise ValueError(f"{self.tag}: receiving into the caller's memory needs a two-sided transport")
        self._recv = self._receive(recv_bytes, at_most, into, meanwhile)
        return self._recv

    def _receive(self, recv_bytes: list[int], at_most: bool, into, meanwhile) -> list[torch.Tensor]:
        raise NotImplementedError

    def release(self) -> None:
        """Done reading the received views: let every source reuse its region."""
        self._recv = None
        self._on_done(self)

    def abandon(self, reason: str) -> None:
        """The protocol failed mid-exchange on this rank: the buffer can no longer be trusted (peers are told)."""
        self.buf.mark_broken(reason, culprit=self.buf.rank)
        self._on_done(self)


class OneSidedExchange(Exchange):
    """Payloads written straight into the receivers' regions, READY/ACK signal words (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._acked = [False] * self.buf.world_size
        #: The ranks this exchange leaves out (``SymmBuffer.mask``): their regions are scratch, their words unread.
        self.skip: frozenset[int] = self.buf.masked
        if self.skip and self.deferred:
            raise RuntimeError(f"{self.tag}: masked ranks need the host's waits, not a stream-ordered exchange")

    def send_region(self, dst: int) -> torch.Tensor:
        buf = self.buf
        if dst in self.skip:  # written, never sent
            if self._staging[dst] is None:
                self._staging[dst] = torch.empty(self.region_bytes, dtype=torch.uint8, device=buf.local.device)
            return self._staging[dst]
        if self.epoch > 1 and not self._acked[dst]:
            # dst must have consumed our previous message before we overwrite its region.
            what = f"{self.tag} consumed"
            buf.wait_for_peer(ACK, dst, self.epoch - 1, what, self.timeout, self.deferred, self.guarded)
            self._acked[dst] = True
        view = buf.impl.peer_view(dst)
        if view is None:  # a peer out of reach: staged, put by commit()
            if self._staging[dst] is None:
                self._staging[dst] = buf.impl.staging(dst, self.region_bytes)
            return self._staging[dst]
        off = buf.rank * self.region_bytes
        return view[off : off + self.region_bytes]

    def _send(self, dst: int, nbytes: int) -> None:
        buf = self.buf
        if dst in self.skip:
            return
        if nbytes and self.epoch > 1 and not self._acked[dst]:
            raise RuntimeError("commit() of a payload without send_region(): nothing was written for this epoch")
        guarded = self.guard is not None
        if buf.impl.peer_view(dst) is not None:
            # A zero-byte message writes nothing, so it needs no acknowledgement of the previous one.
            buf.post(READY, dst, self.epoch, guarded=guarded)
            return
        if nbytes and self._staging[dst] is None:
            raise RuntimeError("commit() of a payload without send_region(): nothing was written")
        # Data and READY in one put-with-signal: the signal lands after the bytes.
        ready = word(READY, buf.rank, buf.world_size)
        buf.impl.put_signal(dst, buf.rank * self.region_bytes, self._staging[dst], nbytes, ready, self.epoch, guarded)

    def _receive(self, recv_bytes: list[int], at_most: bool, into, meanwhile) -> list[torch.Tensor]:
        buf = self.buf
        if meanwhile is not None:
            meanwhile()
        if not self.skip:
            buf.wait_for_all(READY, self.epoch, f"{self.tag} data", self.timeout, self.deferred)
        else:  # the others one by one, within one deadline
            deadline = deadline_after(self.timeout)
            for src in sorted(set(range(buf.world_size)) - self.skip):
                left = max(deadline - time.monotonic(), 1e-3)
                buf.wait_for_peer(READY, src, self.epoch, f"{self.tag} data", left)
        out = []
        for src, n in enumerate(recv_bytes):
            if n > self.region_bytes:
                raise ValueError(f"rank {src} is said to send {n} bytes, more than the {self.region_bytes}-byte region")
            at = src * self.region_bytes
            out.append(buf.local[at : at + (0 if src in self.skip else n)])
        return out

    def release(self) -> None:
        buf = self.buf
        if buf.is_open():
            for src in set(range(buf.world_size)) - self.skip:
                buf.post(ACK, src, self.epoch)
        super().release()


class TwoSidedExchange(Exchange):
    """Payloads staged on the sender and moved by the transport's timed ``all_to_all`` in :meth:`receive`."""

    def send_region(self, dst: int) -> torch.Tensor:
        if self._staging[dst] is None:  # kept by the transport: the last exchange's sends have completed
            self._staging[dst] = self.buf.impl.staging(dst, self.region_bytes)
        return self._staging[dst]

    def _send(self, dst: int, nbytes: int) -> None:
        if nbytes and self._staging[dst] is None:
            raise RuntimeError("commit() of a payload without send_region(): nothing was written")

    def _receive(self, recv_bytes: list[int], at_most: bool, into, meanwhile) -> list[torch.Tensor]:
        empty = torch.empty(0, dtype=torch.uint8)
        send = [self._staging[r][:n] if n else empty for r, n in enumerate(self._sizes)]
        try:
            impl, args = self.buf.impl, (list(recv_bytes), self.timeout, self.tag, not at_most)
            return impl.all_to_all(send, *args, into=into, split=self._splits, meanwhile=meanwhile)
        except (TimeoutError, ValueError) as exc:  # a silent peer, or ranks out of step: the buffer is done
            # whom the error names is passed on, so that a rank whose wait on this one fails learns it too
            self.buf.mark_broken(str(exc), blame=getattr(exc, "culprit", None))
            raise


def exchange_payloads(buf, send, recv_bytes, region_bytes: int, tag: str, timeout: float | None, meanwhile=None):
    """:meth:`SymmBuffer.all_to_all`: one exchange of ``send[r]`` to rank r; copies of what arrived."""
    w = buf.world_size
    if len(send) != w or len(recv_bytes) != w:
        raise ValueError(f"all_to_all needs {w} send payloads and {w} receive sizes")
    for r, part in enumerate(send):
        if part.dtype != torch.uint8 or part.numel() > region_bytes:
            raise ValueError(
                f"payload for rank {r} must be uint8 of at most {region_bytes} bytes, got {part.dtype} x {part.numel()}"
            )
    if any(not 0 <= n <= region_bytes for n in recv_bytes):
        raise ValueError(f"receive sizes {recv_bytes} must lie in [0, {region_bytes}]")
    ex = buf.exchange(region_bytes, tag, timeout)
    for k in range(w):
        dst = (buf.rank + k) % w
        n = send[dst].numel()
        if n:
            ex.send_region(dst)[:n].copy_(send[dst].reshape(-1))
        ex.commit(dst, n)
    out = [v.clone() for v in ex.receive(recv_bytes, meanwhile=meanwhile)]
    ex.release()
    return out
