"""Symmetric memory: one buffer of the same size on every rank of a group, plus 64-bit signal words.

The memory and the primitives come from a transport (``collectives/transports/``: ``shm`` for CPU ranks
on one host, ``nvshmem`` for CUDA ranks, ``torch`` for any layout of hosts); the protocol on top is
written here once, against the transport's capabilities: user signals and timed waits, barriers,
exchanges (``collectives/exchange.py``), and the failure notices (``collectives/peer_failure.py``).

Every wait has a timeout and a :class:`TimeoutError` names the silent peer. A rank that gives up on a
buffer tells its peers through their NOTICE words, so their waits on it end at once with
:class:`PeerFailedError` instead of each waiting out its own timeout.
"""

from __future__ import annotations

import contextlib

import torch

from epkit.collectives import transports
from epkit.collectives._details.deferred import DeferredChecks
from epkit.collectives.bootstrap import Rendezvous, group_info
from epkit.collectives.deadline import within
from epkit.collectives.exchange import Exchange, OneSidedExchange, TwoSidedExchange, exchange_payloads
from epkit.collectives.peer_failure import FailureNotices, PeerFailedError, wait_judge
from epkit.collectives.transports.base import ACK, BARRIER, NOTICE, READY, user_word, word

__all__ = ["PeerFailedError", "SymmBuffer", "TRANSPORTS"]

#: Every transport's name.
TRANSPORTS = tuple(transports.TRANSPORTS)
#: The reserved signal words a protocol wait may name (READY, ACK, BARRIER).
_PROTOCOL_KINDS = (READY, ACK, BARRIER)


class SymmBuffer(FailureNotices):
    """A buffer of ``num_bytes`` on every rank of ``group``, with signal words.

    Parameters
    ----------
    group : ProcessGroup or :class:`~epkit.collectives.bootstrap.SubGroup`
        A gloo group (shm/torch transports), or a gloo or NCCL group of CUDA ranks (nvshmem).
        Creation is collective over it.
    num_bytes : int
        Size of each rank's buffer (``local``).
    transport : {"auto", "shm", "torch", "nvshmem"}
        ``auto`` picks ``nvshmem`` for an NCCL group when every rank has CUDA and ``epkit._C_cuda``,
        ``shm`` for a gloo group on this host, else ``torch``. ``nvshmem`` where it cannot run raises
        :class:`~epkit.backends.BackendUnavailableError` saying what is missing. Its memory comes from
        torch's symmetric memory (NVSHMEM backend) where torch has it, else from epkit's own NVSHMEM
        binding; ``EPKIT_NVSHMEM_PROVIDER=auto|torch|epkit`` chooses (``transports/nvshmem_job.py``).
    num_signals : int
        User signal words per rank (``signal``/``wait_until`` indices).
    timeout : float
        Default seconds for every wait, construction included: a rank that does not come to make the
        buffer is named by a TimeoutError after ``timeout`` seconds on every other rank.
    memory_hint : str
        Appended to the ValueError raised when the buffer needs more memory than the host (or the GPU) has
        (EPBuffer names its sizing parameters there).

    Attributes
    ----------
    local : Tensor [num_bytes] uint8
        This rank's buffer (on shm, views kept past :meth:`close` stay valid memory; on nvshmem, where
        the symmetric heap is freed, they must not be used); on the rank's GPU for nvshmem.
    rank, world_size : int
        Position in ``group``.
    buffer_id : int
        Random, agreed at construction, the same on every rank: the protocol's messages carry it.
    nvshmem_provider : {"torch", "epkit"} or None
        nvshmem transport: where the symmetric memory came from; None on other transports.
    nvshmem_note : str
        nvshmem transport: why torch's symmetric memory was not used ("" when it was).
    transport : str
        The transport's name.
    impl : Transport
        The transport itself (``collectives/transports/``): the memory and the primitives the protocol
        below is built from.
    """

    def __init__(
        self,
        group,
        num_bytes: int,
        transport: str = "auto",
        num_signals: int = 64,
        timeout: float = 30.0,
        memory_hint: str = "",
    ):
        if not isinstance(num_bytes, int) or num_bytes < 0:
            raise ValueError(f"num_bytes must be a non-negative int, got {num_bytes!r}")
        if not isinstance(num_signals, int) or num_signals < 0:
            raise ValueError(f"num_signals must be a non-negative int, got {num_signals!r}")
        if transport not in ("auto", *TRANSPORTS):
            raise ValueError(f"transport must be 'auto' or one of {TRANSPORTS}, got {transport!r}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.group = group
        #: The members' global ranks, by position (``rank`` is this rank's position): messages name these.
        self.rank, self.world_size, self.global_ranks, backend = group_info(group)
        self.num_bytes = num_bytes
        self.num_signals = num_signals
        self.timeout = timeout
        with within(timeout):  # every wait of the construction together: one timeout, end to end
            self._rendezvous = rv = Rendezvous(group, timeout, "SymmBuffer")
            rv.memory_hint = memory_hint
            me = {**transports.hello("nccl" in str(backend)), "args": [num_bytes, num_signals, transport]}
            hellos = rv.gather("hello", me)
            args = [h["args"] for h in hellos]
            if len({tuple(a) for a in args}) != 1:  # every rank sees the same list, so every rank raises
                detail = "; ".join(
                    f"rank {r}: num_bytes={a[0]}, num_signals={a[1]}, transport={a[2]!r}" for r, a in enumerate(args)
                )
                raise ValueError(f"SymmBuffer arguments differ across ranks ({detail}); every rank must pass the same")
            #: This buffer's identity: random, agreed at construction, the same on every rank.
            self.buffer_id: int = rv.buffer_id
            name = transport if transport != "auto" else transports.choose(hellos, backend, rv)
            self.impl = transports.create(name, rv, hellos, num_bytes, num_signals)
        self.nvshmem_provider, self.nvshmem_note = self.impl.provider, self.impl.note
        self.local = self.impl.local
        self._epochs = {"barrier": 0, "a2a": 0}
        self._broken: str | None = None
        self._closed = False
        self._open: Exchange | None = None
        #: Positions left out of every later exchange (:meth:`mask`): nothing sent to them, nothing awaited.
        self.masked: frozenset[int] = frozenset()
        #: Outcomes of stream-ordered waits and device-side checks, raised by the next collective call.
        self.deferred = DeferredChecks(self.local.device, self._deferred_failed)

    @property
    def transport(self) -> str:
        """The transport's name: ``"shm"``, ``"torch"`` or ``"nvshmem"``."""
        return self.impl.name

    def check_usable(self) -> None:
        """RuntimeError if the buffer is closed or retired by an earlier failure; raises a failed deferred check.
        Every collective call starts with it (device kernels that bypass :meth:`exchange` call it themselves)."""
        self._check_usable()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.global_rank}: this SymmBuffer is closed")
        if self._broken is not None:
            raise RuntimeError(
                f"rank {self.global_rank}: this SymmBuffer is unusable after an earlier failure ({self._broken});"
                f" create a new one on every rank"
            )
        self.deferred.poll()

    def synchronize(self) -> None:
        """Wait for every deferred (stream-ordered) wait and check of earlier calls; raise the first failure.

        Calls made with ``deferred=True`` exchanges (the low-latency path) return before their waits end; their
        timeouts and rejected inputs are raised here or at the start of the next collective call.
        """
        self.deferred.drain()

    @property
    def global_rank(self) -> int:
        """This rank's global rank (``rank`` is its position in the buffer's group): what messages name."""
        return self.global_ranks[self.rank]

    def is_open(self) -> bool:
        """The buffer is not closed and its memory is still there."""
        return not self._closed and self.impl.is_open()

    def _check_direct(self, what: str) -> None:
        if not self.impl.direct:
            raise RuntimeError(
                f"SymmBuffer.{what} needs a directly addressable transport (shm or nvshmem); this buffer uses "
                f"{self.transport!r}: use all_to_all instead"
            )
        if not self.is_open():
            raise RuntimeError("SymmBuffer is closed")

    def _check_rank(self, rank: int) -> int:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        return rank

    def is_within_domain(self) -> bool:
        """True when every peer is directly addressable (one host for shm, one NVLink domain for nvshmem)."""
        return self.is_open() and self.impl.within_domain()

    def peer(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s buffer as a ``[num_bytes]`` uint8 view (shm, nvshmem); writes are one-sided puts.

        On nvshmem a peer outside this GPU's NVLink domain has no view: RuntimeError says so.
        """
        self._check_direct("peer")
        view = self.impl.peer_view(self._check_rank(rank))
        if view is None:
            raise RuntimeError(self.impl.unreachable(rank))
        return view

    # signals

    def _word(self, kind: int, idx: int) -> int:
        return word(kind, idx, self.world_size)

    def _user_word(self, idx: int) -> int:
        if not isinstance(idx, int) or not 0 <= idx < self.num_signals:
            raise ValueError(f"signal index must be in [0, {self.num_signals}), got {idx!r}")
        return user_word(idx, self.world_size)

    def signal(self, rank: int, idx: int, value: int, op: str = "set") -> None:
        """Set or add ``value`` to user signal word ``idx`` of rank ``rank`` (release ordering after prior puts).

        On nvshmem the signal is a kernel on the current CUDA stream, ordered after the stream's earlier writes.
        """
        self._check_direct("signal")
        if op not in ("set", "add"):
            raise ValueError(f"op must be 'set' or 'add', got {op!r}")
        self.impl.store(self._check_rank(rank), self._user_word(idx), value, op)

    def read_signal(self, idx: int) -> int:
        """Current value of this rank's user signal word ``idx``."""
        self._check_direct("read_signal")
        return self.impl.load(self._user_word(idx))

    def wait_until(self, idx: int, cmp: str, value: int, timeout: float | None = None) -> int:
        """Wait until this rank's user signal ``idx`` satisfies ``cmp value``; returns the value seen.

        On nvshmem a timed wait kernel runs on the current CUDA stream and the host waits for it.
        """
        self._check_direct("wait_until")
        t = self.timeout if timeout is None else timeout
        seen, failed = self._wait(self._user_word(idx), 1, cmp, value, t)
        if failed is not None:
            raise TimeoutError(
                f"rank {self.global_rank}: signal word {idx} did not satisfy {cmp} {value} within {t:g} s "
                f"(last seen {seen})"
            )
        return seen

    def _wait(self, off: int, count: int, cmp: str, value: int, t: float, abort_words: int = 0):
        """The transport's host-side wait; a stuck stream (TimeoutError) retires the buffer, telling the peers."""
        try:
            return self.impl.wait(off, count, cmp, value, t, abort_words)
        except TimeoutError as exc:  # the stream never reached the wait's end: its result word is unreliable
            self.mark_broken(str(exc), culprit=self.rank)
            raise

    # the protocol's reserved words (exchanges and barriers; see collectives/exchange.py)

    def post(self, kind: int, dst: int, value: int, guarded: bool = False) -> None:
        """Set this rank's reserved word ``kind`` (READY, ACK or BARRIER) at rank ``dst`` to ``value``.

        ``guarded`` (stream-ordered transports): not after a failed stream-ordered wait. A rank that gave
        up signals nothing more (its peers read its notice instead).
        """
        if self._broken is not None:
            return
        self.impl.store(dst, self._word(kind, self.rank), value, guarded=guarded)

    def wait_for_peer(
        self,
        kind: int,
        src: int,
        value: int,
        what: str,
        timeout: float | None = None,
        deferred: bool = False,
        guarded: bool = False,
    ) -> None:
        """Wait until rank ``src``'s word ``kind`` here reaches ``value``, watching ``src``'s NOTICE word.

        Raises :class:`PeerFailedError` for a notice, TimeoutError naming ``src`` for silence (both retire the
        buffer). ``deferred`` (stream-ordered transports): queued on the stream and judged later; ``guarded``:
        an acknowledgement wait whose exchange's writes all take the guard (see :meth:`exchange`).
        """
        t = self.timeout if timeout is None else timeout
        if deferred and self.impl.stream_ordered:
            self._wait_deferred(kind, src, 1, value, what, t, guarded)
            return
        seen, failed = self._wait(self._word(kind, src), 1, ">=", value, t, self._to_notice(kind))
        if failed is not None:
            self._failed_wait(src, seen, what, t, value)

    def wait_for_all(self, kind: int, value: int, what: str, timeout: float | None = None, deferred: bool = False):
        """:meth:`wait_for_peer` for every source rank at once (one deadline; on nvshmem one device wait)."""
        t = self.timeout if timeout is None else timeout
        if deferred and self.impl.stream_ordered:
            self._wait_deferred(kind, 0, self.world_size, value, what, t)
            return
        seen, failed = self._wait(self._word(kind, 0), self.world_size, ">=", value, t, self._to_notice(kind))
        if failed is not None:
            self._failed_wait(failed, seen, what, t, value)

    def _to_notice(self, kind: int) -> int:
        """Words from word (kind, src) to src's NOTICE word: the waits' abort offset."""
        if kind not in _PROTOCOL_KINDS:
            raise ValueError(f"kind must be READY, ACK or BARRIER ({_PROTOCOL_KINDS}), got {kind!r}")
        return (NOTICE - kind) * self.world_size

    def _wait_deferred(
        self, kind: int, first: int, count: int, value: int, what: str, t: float, guarded: bool = False
    ) -> None:
        """A stream-ordered wait on ``count`` sources from ``first``, judged later (see DeferredChecks).

        ``guarded``: an acknowledgement wait of an exchange whose writes all take the exchange's guard."""

        judge = wait_judge(self.rank, first, what, t, value, self._gave_up, self.global_ranks)

        # An ACK wait guards this rank's writes into the peer's memory. Where the stream would perform them
        # whatever the wait's outcome (writes made straight into send regions), it is never skipped after an
        # earlier failure and no notice ends it (a third rank may have called the peer silent while it is only
        # slow, still reading): only the peer's acknowledgement, or the timeout, ends it. Where every write
        # behind it takes the guard, a failed or skipped wait stops them, so it may end like any other wait.
        trusted = kind != ACK or guarded
        self.impl.wait_deferred(
            self._word(kind, first),
            count,
            ">=",
            value,
            t,
            self.deferred,
            judge,
            what,
            abort_words=self._to_notice(kind) if trusted else 0,
            skip_on_sticky=trusted,
        )

    def barrier(self, timeout: float | None = None) -> None:
        """All ranks of the group reach this point (signals on shm/nvshmem, torch.distributed otherwise)."""
        self._check_usable()
        t = self.timeout if timeout is None else timeout
        if not self.impl.direct:
            try:
                self.impl.barrier(t)
            except TimeoutError as exc:
                self.mark_broken(str(exc))
                raise
            return
        self._check_direct("barrier")
        self._epochs["barrier"] += 1
        e = self._epochs["barrier"]
        for r in range(self.world_size):
            self.post(BARRIER, r, e)
        self.wait_for_all(BARRIER, e, "barrier", t)

    def mask(self, ranks) -> None:
        """Leave the ranks at positions ``ranks`` out of every later :meth:`exchange` (an empty set: none): nothing
        is sent to them (their send regions are scratch memory of this rank's), no signal of theirs is awaited and
        none is posted to them, and their receive views are empty (``[0]`` uint8). For ranks that stopped taking
        part (DeepEP's shrink mode): every other rank must mask the same ranks before the same exchange, and a
        masked rank never exchanges on this buffer again (its epochs fell behind). Direct transports (shm,
        nvshmem) on the host's waits only."""
        masked = frozenset(self._check_rank(int(r)) for r in ranks)
        if masked and not self.impl.direct:
            raise RuntimeError(
                f"SymmBuffer.mask needs a directly addressable transport (shm, nvshmem), not {self.transport!r}"
            )
        if self.rank in masked:
            raise ValueError(f"rank {self.global_rank} cannot mask itself")
        self.masked = masked

    # collective exchange used by the dispatch/combine protocol

    def exchange(
        self,
        region_bytes: int,
        tag: str = "exchange",
        timeout: float | None = None,
        deferred: bool = False,
        guarded: bool = False,
    ) -> Exchange:
        """Begin one all-to-all of byte payloads (collective: every rank calls it in the same order).

        Each source rank owns a region of ``region_bytes`` in every receiver's buffer.
        Write the payload for rank ``r`` into ``ex.send_region(r)`` (on shm that is rank r's
        memory: a one-sided put with no staging copy), call ``ex.commit(r, nbytes)``,
        then ``ex.receive(recv_bytes)`` returns per-source views of what arrived, valid
        until ``ex.release()``. See :meth:`all_to_all` for the one-call form.

        ``deferred=True`` (nvshmem): the waits for peers are kernels on the current stream whose outcome
        is checked later (:meth:`synchronize`, or the next collective call), so the exchange never blocks
        the host; everything that reads received data must then run on that stream. Other transports wait
        on the host as usual. After a failure the later data waits of the buffer are skipped, but never the
        waits for a peer's acknowledgement, which guard the writes into its region; and no notice ends one,
        only the acknowledgement or the timeout. If such a wait times out (the peer died, or is alive but
        slower than ``timeout``), the writes queued behind it must not land: write through
        :meth:`Exchange.write` (or kernels that take :attr:`Exchange.guard`), and the commit's signal and
        put are skipped as well, so a merely slow peer keeps reading its old bytes and then times out on
        this rank's missing signal. Stores made directly into :meth:`Exchange.send_region` views are not
        guarded. This rank raises the timeout at its next call.

        ``guarded=True`` (with ``deferred``): the caller promises that every write into the send regions takes
        the guard. The acknowledgement waits then end like the others: skipped after an earlier failure and
        ended by a peer's gave-up notice, so a dead peer costs the stream one timeout, not one per queued wait.
        """
        w = self.world_size
        self._check_usable()
        if self._open is not None:
            raise RuntimeError(
                f"rank {self.global_rank}: exchange {self._open.tag!r} is still open (call its hook / "
                f"release it before the next collective on this buffer)"
            )
        if self.impl.direct:
            self._check_direct("exchange")
            if region_bytes * w > self.num_bytes:
                raise ValueError(
                    f"{w} regions of {region_bytes} bytes exceed the {self.num_bytes}-byte buffer; "
                    f"create the buffer with num_bytes >= {region_bytes * w}"
                )
        self._epochs["a2a"] += 1
        kind = OneSidedExchange if self.impl.direct else TwoSidedExchange
        self._open = kind(
            self,
            self._epochs["a2a"],
            region_bytes,
            tag,
            self.timeout if timeout is None else timeout,
            deferred,
            guarded and deferred,
            self._exchange_done,
        )
        return self._open

    def _exchange_done(self, ex: Exchange) -> None:
        if self._open is ex:
            self._open = None

    def all_to_all(
        self,
        send: list[torch.Tensor],
        recv_bytes: list[int],
        region_bytes: int,
        tag: str = "exchange",
        timeout: float | None = None,
        meanwhile=None,
    ) -> list[torch.Tensor]:
        """Exchange byte payloads: ``send[r]`` (uint8, 1-D) goes to rank r; returns copies of what each rank sent.

        ``recv_bytes[r]`` is the size rank r sends here (known from an earlier exchange
        or fixed by the protocol). ``meanwhile``: the caller's work, run while the payloads move
        (:meth:`Exchange.receive`).
        """
        return exchange_payloads(self, send, recv_bytes, region_bytes, tag, timeout, meanwhile)

    def close(self) -> None:
        """Release the buffer: it cannot be used afterwards. On shm, views taken before stay valid memory
        until they are dropped (each segment is unmapped once no view of it remains).

        nvshmem: frees the symmetric allocation, a collective call (every rank must close its buffer). It
        first meets the other ranks in a timed barrier, since NVSHMEM's free waits for every rank without a
        timeout: a rank that does not come within the buffer's timeout gets a ``TimeoutError`` raised here,
        and the memory stays allocated. So does a buffer made unusable by a failure (a peer timed out);
        that memory returns when the process exits. (A rank that passes the barrier just as a peer's wait on
        it times out still enters the free; the barrier narrows that window, it cannot close it.)
        Closing twice is harmless; any other call on a closed buffer raises ``RuntimeError``.
        Also ``with SymmBuffer(...) as buf:`` closes on leaving the block; leaving it by an exception
        (perhaps on this rank alone) skips the collective free, as after a failure.
        """
        self._close(collective=self._broken is None)

    def _close(self, collective: bool) -> None:
        if self._closed:
            return
        late = None
        if collective and self.impl.collective_free:
            try:
                self.barrier()  # every rank is here: the free below cannot wait forever
            except Exception as exc:  # noqa: BLE001 -- raised below, after releasing what is local
                late, collective = exc, False
        self._closed = True
        self.local = torch.empty(0, dtype=torch.uint8)
        self.impl.close(collective=collective)
        self._rendezvous.forget(wait=self._broken is None and late is None)  # no wait on a broken job's store
        if late is not None:
            raise late

    def __enter__(self) -> SymmBuffer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self._broken is None and not self._closed:
            # The exception may be leaving the block on this rank only: tell the peers (their waits on this
            # rank, the close's barrier too, end at once naming it), and wait for none of them.
            with contextlib.suppress(Exception):
                self.mark_broken(f"rank {self.global_rank} left its block by {exc_type.__name__}", culprit=self.rank)
        self._close(collective=exc_type is None and self._broken is None)

    def __del__(self):
        with contextlib.suppress(Exception):
            if not self.impl.collective_free:  # a collective free (nvshmem) is only close()'s to make
                self.close()
