"""The ``torch`` transport: torch.distributed point-to-point messages, for ranks on several hosts (any gloo layout).

``local`` exists but no peer is addressable, so the one-sided primitives are absent (``direct`` is
False). Each buffer has a gloo process group of its own, made over the buffer's rendezvous prefix in
the job's store: the messages of another buffer (a retired one, whose rank was stopped and resumed)
travel in another group and can never pair with this buffer's. An exchange is one message per peer,
a 24-byte header (buffer id, exchange number, payload bytes) and the payload, sent and received point
to point with the buffer's timeout: a peer that does not send within it is named, and a header that is
not this exchange's (another buffer, another exchange, another size) is an error naming its sender,
never data. A payload of at most :data:`INLINE_BYTES` travels in its header's message (the agreements:
one message per peer instead of two, and no second wait); a larger one follows its header, and its
receive is posted only once the header is checked, because gloo ends the process (``terminate``) when
a message is longer than the receive posted for it (seen with torch 2.13's gloo). The header's receive
is always posted with room for a header and an inline payload, which no sender exceeds. Since the size
travels in the header, a receiver may also take a message whose size it only bounds (``exact=False``:
a low-latency message, whose own header says how many rows follow), so that only the bytes a sender
filled cross the network, not its whole region.

``bytes_sent[r]`` counts the bytes this rank has sent rank ``r`` (headers and payloads; 0 for itself, whose
message is a local copy): what crosses the network, for tests and benchmarks of what a protocol moves.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from epkit.collectives.transports.base import Transport

__all__ = ["INLINE_BYTES", "TorchTransport"]

_HEADER_WORDS = 3  # buffer id, exchange number, payload bytes
_HEAD = 8 * _HEADER_WORDS
#: Payloads up to this many bytes travel inside their header's message (see the module docstring).
INLINE_BYTES = 16384
_TAGS = 1 << 20
# Groups and tensors of buffers retired with requests still posted: gloo may still write into a receive
# posted before a timeout, so its memory (and the group) must never be freed. Kept for the process's life.
_RETIRED: list = []


class TorchTransport(Transport):
    """Host memory for ``local`` plus a gloo group of the buffer's own (see the module docstring)."""

    name = "torch"

    def __init__(self, rv, hello: list[dict], num_bytes: int, num_signals: int):
        super().__init__(rv, hello, num_bytes, num_signals)
        # local, the staging of one message per peer and the receive space, each kept between exchanges
        self.check_memory(hello, 3 * num_bytes, "the local buffer, the per-peer staging and the receive space")
        self.buffer_id = rv.buffer_id
        self._exchanges = 0
        try:
            store = dist.PrefixStore("pg/", rv.store)
            self.pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, timedelta(seconds=rv.timeout))
        except RuntimeError as exc:
            why = rv.abandoned()  # a rank that gave up on the buffer after the hello says why
            why = why or (str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
            raise TimeoutError(
                f"rank {self.rank}: the torch transport's own gloo group could not be made within {rv.timeout:g} s "
                f"({why})"
            ) from None
        self.local = torch.zeros(num_bytes, dtype=torch.uint8)
        #: Bytes sent to each rank of the group so far (headers and payloads; see the module docstring).
        self.bytes_sent = [0] * self.world_size
        self._recv = torch.empty(0, dtype=torch.uint8)
        self._heads = None  # [world, header + INLINE_BYTES] uint8: each peer's header message, kept
        self._closed = False

    def _wait(self, work, deadline: float, timeout: float, src: int, what: str) -> None:
        left = max(deadline - time.monotonic(), 1e-3)
        try:
            work.wait(timedelta(seconds=left))
        except RuntimeError as exc:  # gloo: a timeout, or the connection to a peer that died
            cause = "timed out" if "Timed out" in str(exc) else str(exc).strip().splitlines()[0][:200]
            raise TimeoutError(
                f"rank {self.rank}: rank {src} sent no {what} message within {timeout:g} s ({cause}); it died "
                f"or stopped calling"
            ) from None

    def barrier(self, timeout: float) -> None:
        self.all_to_all(
            [torch.empty(0, dtype=torch.uint8)] * self.world_size, [0] * self.world_size, timeout, "barrier"
        )

    def all_to_all(self, send: list[torch.Tensor], recv_bytes: list[int], timeout: float, what: str, exact=True):
        """``send[r]`` (uint8, 1-D) to rank r; returns views of one receive tensor, ``recv_bytes[r]`` from rank r
        (evenly spaced when the sizes are equal). ``exact`` False: ``recv_bytes[r]`` bounds what rank r sends and
        its view holds what it sent (the header's size; each view starts where it would with the bounds).
        TimeoutError names a silent peer; ValueError a peer whose message was not this exchange's (or larger
        than its bound)."""
        own = send[self.rank].numel()
        if own > recv_bytes[self.rank] or (exact and own != recv_bytes[self.rank]):
            raise ValueError(
                f"rank {self.rank}: its own {what} payload has {own} bytes, its receive {recv_bytes[self.rank]}"
            )
        deadline = time.monotonic() + timeout
        self._exchanges += 1
        n, me, w = self._exchanges, self.rank, self.world_size
        tag = 2 * (n % _TAGS)
        recv = self._receive_space(sum(recv_bytes))
        views = list(torch.split(recv, list(recv_bytes)))
        if self._heads is None:
            self._heads = torch.empty((w, _HEAD + INLINE_BYTES), dtype=torch.uint8)
        heads = self._heads
        got = {src: self.pg.recv([heads[src]], src, tag) for src in range(w) if src != me}
        sent = []
        for k in range(1, w):
            dst = (me + k) % w
            nbytes = send[dst].numel()
            head = torch.tensor([self.buffer_id, n, nbytes], dtype=torch.int64).view(torch.uint8)
            if nbytes <= INLINE_BYTES:  # one message: the header and the payload
                msg = torch.cat([head, send[dst].reshape(-1)]) if nbytes else head
                sent.append((dst, msg, self.pg.send([msg], dst, tag)))
            else:
                sent.append((dst, head, self.pg.send([head], dst, tag)))
                payload = send[dst].contiguous()
                sent.append((dst, payload, self.pg.send([payload], dst, tag + 1)))
            self.bytes_sent[dst] += _HEAD + nbytes
        views[me] = views[me][:own]
        if own:
            views[me].copy_(send[me])
        try:
            for src, work in got.items():
                self._wait(work, deadline, timeout, src, what)
                nbytes = self._check_header(
                    heads[src][:_HEAD].view(torch.int64).tolist(), src, n, recv_bytes[src], exact, what
                )
                views[src] = views[src][:nbytes]
                if nbytes and nbytes <= INLINE_BYTES:
                    views[src].copy_(heads[src][_HEAD : _HEAD + nbytes])
                elif nbytes:
                    self._wait(self.pg.recv([views[src]], src, tag + 1), deadline, timeout, src, what)
            for dst, _, work in sent:
                self._wait(work, deadline, timeout, dst, f"{what} (receipt of this rank's)")
        except BaseException:
            _RETIRED.append((self.pg, recv, heads, sent))  # requests may still be posted into (or from) these
            self._recv = torch.empty(0, dtype=torch.uint8)
            self._heads = None
            self._staging.clear()  # a send may still read its staging: a later exchange gets fresh memory
            raise
        return views

    def _receive_space(self, nbytes: int) -> torch.Tensor:
        """``[nbytes]`` uint8 for one exchange's incoming payloads, kept between exchanges (the views of one are
        read before the next begins: :class:`~epkit.collectives.exchange.Exchange` releases them first), so a
        large message does not fault in fresh pages on every call."""
        if self._recv.numel() < nbytes:
            self._recv = torch.empty(nbytes, dtype=torch.uint8)
        return self._recv[:nbytes]

    def _check_header(self, head: list[int], src: int, n: int, nbytes: int, exact: bool, what: str) -> int:
        """The payload bytes a header announces, checked: this buffer's, this exchange's, ``nbytes`` (``exact``)
        or at most ``nbytes``."""
        buffer_id, epoch, size = head
        if buffer_id != self.buffer_id or epoch != n or not (size == nbytes if exact else 0 <= size <= nbytes):
            expected = f"{nbytes} bytes" if exact else f"at most {nbytes} bytes"
            raise ValueError(
                f"rank {self.rank}: rank {src}'s {what} message is not this exchange's (buffer {buffer_id:x}, exchange "
                f"{epoch}, {size} bytes; expected buffer {self.buffer_id:x}, exchange {n}, {expected}): the ranks' "
                f"calls on this buffer are out of step"
            )
        return size

    def is_open(self) -> bool:
        return not self._closed

    def close(self, collective: bool) -> None:
        self._closed = True
        self.local = self._recv = torch.empty(0, dtype=torch.uint8)
        self._staging.clear()
