"""The interface every transport of :class:`~epkit.collectives.symm_buffer.SymmBuffer` implements, and the
layout of one rank's symmetric memory (written once here, used by every transport and by the protocol).

One rank's memory on a direct transport (``shm``, ``nvshmem``)::

    [ 64-bit signal words | padding to ALIGN | data (num_bytes) ]
      READY[w] ACK[w] BARRIER[w] NOTICE[w] user[num_signals]

Word ``(kind, src)`` of rank r is written by rank ``src`` (or, for NOTICE, by whoever reports on ``src``)
and read by rank r only. The ``torch`` transport has no signal words: its peers are not addressable, and
its exchanges are two-sided collectives (:meth:`Transport.all_to_all`).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence

import torch

__all__ = [
    "ACK",
    "ALIGN",
    "BARRIER",
    "MASK64",
    "NOTICE",
    "NOTICE_GRACE_S",
    "RUNNING_GRACE_S",
    "NUM_KINDS",
    "READY",
    "Transport",
    "layout",
    "rank_name",
    "user_word",
    "word",
]

#: Byte alignment of the data past the signal words.
ALIGN = 4096
#: Reserved signal words, one per source rank each: data ready, data consumed (ack), barrier, gave-up notice.
READY, ACK, BARRIER, NOTICE = 0, 1, 2, 3
NUM_KINDS = 4
MASK64 = (1 << 64) - 1


def layout(world_size: int, num_signals: int, num_bytes: int) -> tuple[int, int, int]:
    """Word and byte layout of one rank's symmetric memory.

    Parameters
    ----------
    world_size, num_signals, num_bytes : int
        Ranks in the group, user signal words, data bytes per rank.

    Returns
    -------
    (num_words, data_offset, alloc_bytes) : tuple of int
        64-bit signal words (``NUM_KINDS * world_size + num_signals``); byte offset of the data (a multiple
        of :data:`ALIGN` past the words); bytes to allocate (``data_offset + max(num_bytes, 1)``).
    """
    for name, v, lo in (("world_size", world_size, 1), ("num_signals", num_signals, 0), ("num_bytes", num_bytes, 0)):
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    num_words = NUM_KINDS * world_size + num_signals
    data_offset = -(-num_words * 8 // ALIGN) * ALIGN
    return num_words, data_offset, data_offset + max(num_bytes, 1)


def word(kind: int, src: int, world_size: int) -> int:
    """Byte offset of reserved word ``(kind, src)`` in a rank's signal words."""
    return (kind * world_size + src) * 8


def user_word(idx: int, world_size: int) -> int:
    """Byte offset of user signal word ``idx``."""
    return (NUM_KINDS * world_size + idx) * 8


#: Seconds a rank whose wait on a peer failed gives that peer to say that it gave up because of another rank
#: (a notice, or the torch transport's :meth:`Transport.tell`) before naming the peer itself: a live rank stuck
#: behind the one that failed times out at about the moment the ranks waiting on it do. A peer on another host
#: gets NOTICE_GRACE_S; one on this host seen running (surely stuck behind another, which it may itself be
#: giving a grace) RUNNING_GRACE_S; one seen stopped or gone none. Both keep a failed wait within its timeout
#: + 1.5 s.
NOTICE_GRACE_S, RUNNING_GRACE_S = 1.0, 1.4


def rank_name(r: int, global_ranks: Sequence[int]) -> str:
    """How every message of a buffer names position ``r`` of its group: ``"rank G"``, ``G`` its global rank (what a
    user of a sub-group can find; ``global_ranks[r]`` is position ``r``'s)."""
    return f"rank {global_ranks[r]}"


def _proc_is_ours() -> bool:
    """Whether ``/proc`` shows this process's pid namespace (a process in a namespace of its own with the machine's
    ``/proc`` mounted would read other processes' states under its peers' pids)."""
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False


class Transport(abc.ABC):
    """One rank's part of a symmetric buffer: the memory, and the primitives the protocol is built from.

    Creation is collective over the group. Offsets (``off``) are byte offsets into the signal words
    (:func:`word`, :func:`user_word`); ``dst`` / ``src`` are ranks of the group.

    Attributes
    ----------
    name : str
        ``"shm"``, ``"torch"`` or ``"nvshmem"``.
    direct : bool
        Signal words exist and peers' memory can be written one-sidedly (``peer_view``, ``store``, ``wait``);
        False: only :meth:`all_to_all` and :meth:`barrier` move anything.
    stream_ordered : bool
        Waits can be queued on the device stream and judged later (:meth:`wait_deferred`).
    local : Tensor [num_bytes] uint8
        This rank's data.
    collective_free : bool
        :meth:`close` with ``collective=True`` frees with every rank (nvshmem): the buffer meets the peers in
        a timed barrier first, and never frees from a finalizer.
    provider, note : str or None, str
        Where the memory came from and why (nvshmem); None and "" elsewhere.
    """

    name: str = ""
    direct: bool = False
    stream_ordered: bool = False
    collective_free: bool = False
    provider: str | None = None
    note: str = ""

    def __init__(self, rv, hello: list[dict], num_bytes: int, num_signals: int):
        """``rv``: the buffer's :class:`~epkit.collectives.bootstrap.Rendezvous` (collective steps go through it,
        bounded by its timeout); ``hello``: every rank's first rendezvous record (``host``, ``pid``, ``mem``)."""
        self.group, self.rank, self.world_size = rv.group, rv.rank, rv.world_size
        self.global_ranks: tuple[int, ...] = tuple(getattr(rv, "global_ranks", range(rv.world_size)))
        self.num_bytes, self.num_signals = num_bytes, num_signals
        self.memory_hint = getattr(rv, "memory_hint", "")
        self.local = torch.empty(0, dtype=torch.uint8)
        self._staging: dict[tuple[int, int], torch.Tensor] = {}
        # the process of each rank that shares this rank's host (and pid namespace), to tell a stopped or dead peer
        # from one stuck behind another (peer_state)
        mine = hello[self.rank].get("host") if len(hello) == self.world_size and _proc_is_ours() else None
        self._local_pids = {
            r: h.get("pid")
            for r, h in enumerate(hello)
            if mine is not None and h.get("host") == mine and r != self.rank
        }

    def check_memory(self, hello: list[dict], need: int, what: str) -> None:
        """ValueError (the same on every rank) if ``need`` bytes exceed the memory the ranks report available
        (the lowest over the ranks; unknown counts as enough)."""
        known = [h["mem"] for h in hello if h.get("mem") is not None]
        if known and need > min(known):
            hint = f"; {self.memory_hint}" if self.memory_hint else ""
            raise ValueError(
                f"SymmBuffer({self.name}) of num_bytes={self.num_bytes} per rank needs {need} bytes ({what}), more "
                f"than the {min(known)} bytes of memory available (MemAvailable or the cgroup limit, lowest over "
                f"the ranks){hint}"
            )

    @property
    def device(self) -> torch.device:
        return self.local.device

    # memory

    def tell(self, culprit: int, silent: bool) -> None:
        """Transports without signal words: tell the peers that this rank gave up on the buffer because of global
        rank ``culprit`` (this rank itself, or with ``silent`` a peer that went silent), so that a peer whose wait
        on this rank fails learns whom to name. A no-op here (the signal-word transports spread notices)."""
        return None

    def waiting(self, grace: float) -> None:
        """Transports without signal words: say that a wait of this rank (on this buffer or another of the same
        EPBuffer) failed and that it gives its peer ``grace`` seconds before telling whom it names, so that a peer
        whose wait on this rank fails meanwhile listens that long too. A no-op here (a signal-word peer on this
        host sees this process running and gives it :data:`RUNNING_GRACE_S`)."""
        return None

    def peer_state(self, rank: int) -> str | None:
        """``"running"``, ``"stopped"`` or ``"gone"`` for a rank on this host (its process as ``/proc`` shows it:
        stopped by a signal or a debugger, or exited); None for one elsewhere. A wait on a peer that timed out
        names a stopped or gone peer at once, and gives a running one :data:`NOTICE_GRACE_S` to say whom it
        is stuck behind."""
        pid = self._local_pids.get(rank)
        if not pid:
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "gone"
        return "stopped" if state in "tT" else "gone" if state in "ZXx" else "running"

    def grace(self, rank: int) -> float:
        """Seconds to wait for a notice from ``rank`` after a wait on it failed (see :meth:`peer_state`)."""
        state = self.peer_state(rank)
        return NOTICE_GRACE_S if state is None else RUNNING_GRACE_S if state == "running" else 0.0

    def rank_name(self, rank: int) -> str:
        """``"rank G"``: position ``rank`` of the group by its global rank (how every message names a rank)."""
        return rank_name(rank, self.global_ranks)

    def peer_view(self, rank: int) -> torch.Tensor | None:
        """Rank ``rank``'s data as a ``[num_bytes]`` uint8 view writable from here, or None if not addressable."""
        return self.local if rank == self.rank else None

    def unreachable(self, rank: int) -> str:
        """Why :meth:`peer_view` gives no view of ``rank`` (the text of the error one-sided access raises)."""
        me, peer = self.rank_name(self.rank), self.rank_name(rank)
        return f"{peer} is not directly addressable from {me} on the {self.name} transport"

    def within_domain(self) -> bool:
        """Every peer is directly addressable (one host for shm, one NVLink domain for nvshmem)."""
        return False

    def word_address(self, off: int) -> int | None:
        """The address, as this rank's kernels see it, of this rank's own signal word at byte offset ``off``
        (device kernels watch the NOTICE words there); None for a transport without signal words."""
        return None

    def staging(self, dst: int, nbytes: int) -> torch.Tensor:
        """A ``[nbytes]`` uint8 source for puts to ``dst`` on this rank's device, kept for the buffer's life (the
        same address every call: a put queued earlier runs before anything later on the stream rewrites it)."""
        key = (dst, nbytes)
        if key not in self._staging:
            self._staging[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._staging[key]

    # one-sided signals (direct transports)

    def store(self, dst: int, off: int, value: int, op: str = "set", guarded: bool = False, urgent: bool = False):
        """Set (``op="set"``) or add to word ``off`` of rank ``dst``, ordered after this rank's earlier writes.

        ``guarded`` (stream-ordered transports): skipped if a deferred wait of this buffer failed before it.
        ``urgent``: not queued behind this rank's pending work (the gave-up notices).
        """
        raise NotImplementedError(f"the {self.name} transport has no signal words")

    def load(self, off: int) -> int:
        """Current value of this rank's word ``off``."""
        raise NotImplementedError(f"the {self.name} transport has no signal words")

    def wait(
        self, off: int, count: int, cmp: str, value: int, timeout: float, abort_words: int = 0
    ) -> tuple[int, int | None]:
        """Wait, with one deadline, until the ``count`` words from ``off`` all satisfy ``cmp value``.

        Returns ``(value seen, None)`` when they did; ``(value seen, i)`` for the first word ``i`` (0-based from
        ``off``) that did not within ``timeout``, or whose abort word (``abort_words`` words further; 0: none)
        turned nonzero first (the value is then the abort word's). Raises TimeoutError only when this rank's
        own device work did not get to the wait (a stuck stream).
        """
        raise NotImplementedError(f"the {self.name} transport has no signal words")

    def wait_deferred(self, off, count, cmp, value, timeout, checks, judge, what, abort_words=0, skip_on_sticky=True):
        """:meth:`wait` queued on the stream, its 2-word result judged later by ``judge`` through ``checks`` (a
        DeferredChecks); ``what`` names the wait; ``skip_on_sticky``: return at once after a failed deferred wait."""
        raise NotImplementedError(f"the {self.name} transport has no stream-ordered waits")

    def put_signal(self, dst: int, dst_off: int, src: torch.Tensor, nbytes: int, sig_off: int, value: int, guarded):
        """Copy ``nbytes`` of ``src`` to data offset ``dst_off`` at ``dst``, then set its word ``sig_off``."""
        raise NotImplementedError(f"the {self.name} transport has no one-sided puts to unaddressable peers")

    @property
    def sticky_word(self) -> torch.Tensor | None:
        """Stream-ordered transports: the ``[1]`` int64 device word that turns nonzero once a deferred wait
        failed (copies taking it as their guard then write nothing); None elsewhere."""
        return None

    # two-sided collectives (transports without signal words)

    def barrier(self, timeout: float) -> None:
        """Group barrier bounded by ``timeout`` (TimeoutError) for transports without signal words (direct
        transports meet through their BARRIER words instead, in the protocol)."""
        raise NotImplementedError(f"the {self.name} transport meets through its signal words")

    def all_to_all(self, send, recv_bytes, timeout, what: str, exact=True, into=None, split=None, meanwhile=None):
        """Two-sided exchange of uint8 payloads (transports without one-sided puts); returns per-source views
        (``exact`` False: ``recv_bytes[r]`` bounds rank r's payload, and its view has the size rank r sent;
        ``split[r]``: the first bytes of ``send[r]`` travel as a part of their own; ``into[r]``: the caller's
        memory for the first part of rank r's payload, the view then holds the rest; ``meanwhile``: called with
        every receive posted, before the wait)."""
        raise NotImplementedError(f"the {self.name} transport exchanges one-sidedly")

    # lifetime

    @abc.abstractmethod
    def is_open(self) -> bool:
        """The memory is still mapped / allocated."""

    @abc.abstractmethod
    def close(self, collective: bool) -> None:
        """Release the memory; ``collective`` when every rank closes in step (nvshmem frees then)."""
