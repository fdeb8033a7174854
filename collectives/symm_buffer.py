"""Symmetric memory: one buffer of the same size on every rank of a group, plus 64-bit signal words.

Transports
----------
``shm``      CPU ranks on one host. Each rank creates a POSIX shared-memory
             segment (mode 0600) named from a random 128-bit token that rank 0
             draws and broadcasts, every rank maps every peer's segment, and each
             segment's name is unlinked as soon as all ranks have attached: a
             killed rank leaves nothing in /dev/shm (one dying inside the
             bootstrap leaves a name the survivors remove, since every rank knows
             every name in advance). ``peer(r)`` is a direct view of rank r's
             buffer; puts are plain copies into it; signals are atomics in
             ``epkit._C`` and waits are timed.
``nvshmem``  CUDA ranks, one process per GPU (``collectives/_nvshmem.py``): one
             NVSHMEM job per process, one collective symmetric allocation per
             buffer; ``peer(r)`` views rank r's GPU memory where NVLink reaches
             it; signals and timed waits are device kernels on the current CUDA
             stream (``epkit._C_cuda``), so they order with the caller's kernels.
``torch``    torch.distributed exchanges for ranks on several hosts: ``local``
             exists but no peer is addressable, so one-sided ``peer``/``signal``
             raise; protocols use :meth:`SymmBuffer.all_to_all` instead.

Every wait has a timeout and a :class:`TimeoutError` names the silent peer. A rank that gives up on a
buffer (a local failure mid-protocol, or a peer that timed out) writes a notice into its NOTICE word at
every peer; every wait on a source also watches that source's NOTICE word, so the others raise
:class:`PeerFailedError` at once instead of each waiting out its own timeout, and pass the notice on.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from epkit.collectives._details.deferred import DeferredChecks

__all__ = ["PeerFailedError", "SymmBuffer", "TRANSPORTS"]

TRANSPORTS = ("shm", "torch", "nvshmem")
_DIRECT = ("shm", "nvshmem")  # transports with one-sided peer views and signal words
_ALIGN = 4096
# Reserved signal words per rank segment: data-ready, ack, barrier and gave-up notice words, one per source.
_READY, _ACK, _BARRIER, _NOTICE = 0, 1, 2, 3
_NUM_KINDS = 4
MASK64 = (1 << 64) - 1
# A gave-up notice (a NOTICE word): bit 63 set, bit 62 when the culprit went silent (rather than failed),
# bits 32-61 the rank that gave up (the reporter), bits 0-31 the culprit. The reporter writes it into its
# own NOTICE word at every peer and, for a silent culprit, into the culprit's; a rank that receives one
# passes it on in its own. Notices never overwrite a READY/ACK/BARRIER signal.
_GAVE_UP = 1 << 63
_GAVE_UP_SILENT = 1 << 62
_RANK_BITS = 0xFFFFFFFF


class PeerFailedError(TimeoutError):
    """A peer gave up on the buffer and said so: raised at once instead of after this rank's own timeout.

    A subclass of TimeoutError, so a handler for a silent peer handles it too; the buffer is unusable
    afterwards on every rank, as after a timeout.

    Attributes
    ----------
    peer : int
        The rank that failed, or (``silent``) the rank that went silent as seen by the reporting peer.
    silent : bool
        True when ``peer`` went silent (died or stopped calling); False when it failed itself.
    """

    def __init__(self, message: str, peer: int, silent: bool):
        super().__init__(message)
        self.peer, self.silent = peer, silent


def _view(addr: int, nbytes: int, owner=None) -> torch.Tensor:
    """``[nbytes]`` uint8 tensor over mapped memory; the tensor (and every view of it) keeps ``owner`` alive."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    arr = (ctypes.c_uint8 * nbytes).from_address(addr)
    arr._epkit_owner = owner  # torch.frombuffer holds the array, the array holds the mapping
    return torch.frombuffer(arr, dtype=torch.uint8)


def _unlink_names(names: list[str]) -> None:
    """Remove POSIX shared-memory names if they exist (the bootstrap's cleanup after a failure)."""
    for name in names:
        with contextlib.suppress(FileNotFoundError, OSError):
            os.unlink(f"/dev/shm/{name.lstrip('/')}")  # where Linux keeps POSIX shm names


def _default_transport(group) -> str:
    backend = dist.get_backend(group)
    if "nccl" in str(backend):
        from epkit.collectives import _nvshmem

        return "nvshmem" if _nvshmem.auto_ready(group) else "torch"
    if backend == "gloo" and _all_on_one_host(group):
        return "shm"
    return "torch"


def _all_on_one_host(group) -> bool:
    host = os.uname().nodename
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, host, group=group)
    return len(set(hosts)) == 1


class SymmBuffer:
    """A buffer of ``num_bytes`` on every rank of ``group``, with signal words.

    Parameters
    ----------
    group : ProcessGroup
        A gloo group (shm/torch transports), or a gloo or NCCL group of CUDA ranks (nvshmem).
        Creation is collective over it.
    num_bytes : int
        Size of each rank's buffer (``local``).
    transport : {"auto", "shm", "torch", "nvshmem"}
        ``auto`` picks ``nvshmem`` for an NCCL group when every rank has CUDA and ``epkit._C_cuda``,
        ``shm`` for a gloo group on this host, else ``torch``. ``nvshmem`` where it cannot run raises
        :class:`~epkit.backends.BackendUnavailableError` saying what is missing. Its memory comes from
        torch's symmetric memory (NVSHMEM backend) where torch has it, else from epkit's own NVSHMEM
        binding; ``EPKIT_NVSHMEM_PROVIDER=auto|torch|epkit`` chooses (``collectives/_nvshmem.py``).
    num_signals : int
        User signal words per rank (``signal``/``wait_until`` indices).
    timeout : float
        Default seconds for every wait.

    Attributes
    ----------
    local : Tensor [num_bytes] uint8
        This rank's buffer (on shm, views kept past :meth:`close` stay valid memory; on nvshmem, where
        the symmetric heap is freed, they must not be used); on the rank's GPU for nvshmem.
    rank, world_size : int
        Position in ``group``.
    nvshmem_provider : {"torch", "epkit"} or None
        nvshmem transport: where the symmetric memory came from; None on other transports.
    nvshmem_note : str
        nvshmem transport: why torch's symmetric memory was not used ("" when it was).
    """

    def __init__(self, group, num_bytes: int, transport: str = "auto", num_signals: int = 64, timeout: float = 30.0):
        if not isinstance(num_bytes, int) or num_bytes < 0:
            raise ValueError(f"num_bytes must be a non-negative int, got {num_bytes!r}")
        if not isinstance(num_signals, int) or num_signals < 0:
            raise ValueError(f"num_signals must be a non-negative int, got {num_signals!r}")
        if transport not in ("auto", *TRANSPORTS):
            raise ValueError(f"transport must be 'auto' or one of {TRANSPORTS}, got {transport!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.num_bytes = num_bytes
        self.num_signals = num_signals
        self.timeout = timeout
        self.transport = _default_transport(group) if transport == "auto" else transport
        self._segments: list = []
        self._peers: list[torch.Tensor] = []
        self._epochs = {"barrier": 0}
        self._broken: str | None = None
        self._closed = False
        self._open: Exchange | None = None
        self._nv = None  # nvshmem transport state (collectives/_nvshmem.py)
        self.nvshmem_provider, self.nvshmem_note = None, ""
        self._staging: dict[tuple[int, int], torch.Tensor] = {}  # nvshmem: per (peer, region) put sources
        if self.transport == "shm":
            self._init_shm()
        elif self.transport == "nvshmem":
            self._init_nvshmem()
        else:
            self.local = torch.zeros(num_bytes, dtype=torch.uint8)
        #: Outcomes of stream-ordered waits and device-side checks, raised by the next collective call.
        self.deferred = DeferredChecks(self.local.device, self._deferred_failed)

    # shm transport

    def _init_shm(self) -> None:
        from epkit import _C

        w = self.world_size
        self._num_words = _NUM_KINDS * w + self.num_signals
        self._data_offset = -(-self._num_words * 8 // _ALIGN) * _ALIGN
        seg_bytes = self._data_offset + max(self.num_bytes, 1)
        # One random 128-bit token per buffer, drawn by rank 0 before any segment exists: every rank knows
        # every segment's name in advance, so if a rank dies between creating its segment and the unlink
        # below, the survivors remove its name when the bootstrap fails.
        token = [secrets.token_hex(16) if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(self.group, 0), group=self.group)
        names = [f"/epkit-{token[0]}-{r}" for r in range(w)]
        mine = _C.ShmSegment(names[self.rank], seg_bytes, True)
        try:
            sizes = [None] * w
            dist.all_gather_object(sizes, seg_bytes, group=self.group)
            if len(set(sizes)) != 1:  # every rank sees the same list, so every rank raises
                raise ValueError(
                    f"SymmBuffer sizes differ across ranks (segment bytes per rank: {sizes}); every rank "
                    f"must pass the same num_bytes and num_signals"
                )
            segs = [mine if r == self.rank else _C.ShmSegment(names[r], seg_bytes, False) for r in range(w)]
            # Every rank has attached every segment once this barrier passes: unlink the names now.
            dist.barrier(group=self.group)
        except BaseException:
            _unlink_names(names)  # a peer may have died holding its name: remove every name of this buffer
            raise
        finally:
            mine.unlink()
        self._segments = segs
        self._peers = [_view(s.addr + self._data_offset, self.num_bytes, s) for s in segs]
        self.local = self._peers[self.rank]

    # nvshmem transport

    def _init_nvshmem(self) -> None:
        from epkit.collectives._nvshmem import NvshmemState

        self._nv = NvshmemState(self.group, self.rank, self.world_size, self.num_bytes, self.num_signals)
        self.nvshmem_provider, self.nvshmem_note = self._nv.provider, self._nv.note
        self._peers = self._nv.views  # None where a peer is not directly addressable
        self.local = self._nv.local

    def _nv_wait(
        self, off: int, count: int, cmp: str, value: int, timeout: float, abort_words: int = 0
    ) -> tuple[int, int | None]:
        try:
            return self._nv.wait(off, count, cmp, value, timeout, abort_words)
        except TimeoutError as exc:  # the stream never reached the wait's end: its result word is unreliable
            self.mark_broken(str(exc), culprit=self.rank)
            raise

    def mark_broken(self, reason: str, culprit: int | None = None, silent: bool = False) -> None:
        """Make every later collective call raise: after a failure mid-protocol the ranks' counters disagree.

        Parameters
        ----------
        reason : str
            What went wrong (repeated by every later call on this rank).
        culprit : int, optional
            Tell the peers (shm, nvshmem) that this rank gave up because rank ``culprit`` failed (this rank
            itself) or, with ``silent``, went silent: their waits on this rank end at once with
            :class:`PeerFailedError`. None (the default) tells nobody, for failures every rank finds by
            itself (an invalid input reported in the messages) or learned from a peer.
        silent : bool
            ``culprit`` stopped signalling, rather than failing itself.
        """
        if self._broken is not None:
            return
        self._broken = reason
        if culprit is not None:
            notice = _GAVE_UP | (_GAVE_UP_SILENT if silent else 0) | (self.rank << 32) | (culprit & _RANK_BITS)
            self._spread(notice, [self.rank] + ([culprit] if silent and culprit != self.rank else []))

    def _spread(self, notice: int, sources: list[int]) -> None:
        """Write ``notice`` into the NOTICE words of ``sources`` at every other peer. Best effort: one-sided
        stores with no waits (on nvshmem on a stream of their own, not behind this rank's stuck work)."""
        if self.transport not in _DIRECT or not self._is_open():
            return
        for dst in range(self.world_size):
            for src in sources:
                if dst in (self.rank, src):
                    continue
                with contextlib.suppress(Exception):  # a peer that is gone cannot be told; nothing to do
                    if self.transport == "nvshmem":
                        self._nv.post(self._word(_NOTICE, src), notice, "set", dst, urgent=True)
                    else:
                        self._segments[dst].store(self._word(_NOTICE, src), notice)

    def _gave_up(self, seen: int, what: str) -> PeerFailedError:
        """The error for a wait that found the gave-up notice ``seen``; retires this buffer and
        passes the notice on (a peer waiting on this rank, not on the reporter, learns it too)."""
        culprit, reporter = seen & _RANK_BITS, (seen >> 32) & (_RANK_BITS >> 2)
        silent = bool(seen & _GAVE_UP_SILENT)
        if silent:
            msg = (
                f"rank {self.rank}: {what} abandoned: rank {reporter} reports that rank {culprit} sent no signal "
                f"within its timeout (it died or stopped calling)"
            )
        else:
            msg = (
                f"rank {self.rank}: {what} abandoned: rank {culprit} gave up on this buffer after a failure on "
                f"its side (its own exception says why)"
            )
        if self._broken is None:
            self.mark_broken(msg)
            self._spread(seen, [self.rank])
        return PeerFailedError(msg, culprit, silent)

    def _deferred_failed(self, exc: BaseException) -> None:
        """A deferred check failed: retire the buffer, telling the peers when they cannot learn it otherwise."""
        if isinstance(exc, PeerFailedError) or getattr(exc, "skipped", False):  # told / judged earlier
            self.mark_broken(str(exc))
        elif getattr(exc, "peer", None) is not None:  # a silent peer (see _silence)
            self.mark_broken(str(exc), culprit=exc.peer, silent=True)
        elif isinstance(exc, TimeoutError):  # this rank's stream is stuck
            self.mark_broken(str(exc), culprit=self.rank)
        else:  # an input error every rank finds in the same messages
            self.mark_broken(str(exc))

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: this SymmBuffer is closed")
        if self._broken is not None:
            raise RuntimeError(
                f"rank {self.rank}: this SymmBuffer is unusable after an earlier failure ({self._broken});"
                f" create a new one on every rank"
            )
        self.deferred.poll()

    def synchronize(self) -> None:
        """Wait for every deferred (stream-ordered) wait and check of earlier calls; raise the first failure.

        Calls made with ``deferred=True`` exchanges (the low-latency path) return before their waits end; their
        timeouts and rejected inputs are raised here or at the start of the next collective call.
        """
        self.deferred.drain()

    def _wait_work(self, work, what: str, timeout: float) -> None:
        """Wait for a torch.distributed request; gloo reports a timeout as RuntimeError."""
        try:
            ok = work.wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as exc:
            self.mark_broken(f"{what} failed: {exc}")
            raise TimeoutError(f"rank {self.rank}: {what} did not complete within {timeout:g} s ({exc})") from None
        if ok is False:
            self.mark_broken(f"{what} timed out")
            raise TimeoutError(f"rank {self.rank}: {what} did not complete within {timeout:g} s")

    def _is_open(self) -> bool:
        if self._closed:
            return False
        return self._nv is not None if self.transport == "nvshmem" else bool(self._segments)

    def _check_shm(self, what: str) -> None:
        if self.transport not in _DIRECT:
            raise RuntimeError(
                f"SymmBuffer.{what} needs a directly addressable transport (shm or nvshmem); this buffer uses "
                f"{self.transport!r}: use all_to_all instead"
            )
        if not self._is_open():
            raise RuntimeError("SymmBuffer is closed")

    def _check_rank(self, rank: int) -> int:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        return rank

    def is_within_domain(self) -> bool:
        """True when every peer is directly addressable (one host for shm, one NVLink domain for nvshmem)."""
        if self.transport == "nvshmem":
            return self._nv is not None and self._nv.within_domain
        return self.transport == "shm"

    def peer(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s buffer as a ``[num_bytes]`` uint8 view (shm, nvshmem); writes are one-sided puts.

        On nvshmem a peer outside this GPU's NVLink domain has no view: RuntimeError says so.
        """
        self._check_shm("peer")
        if self.transport == "nvshmem":
            return self._nv.peer(self._check_rank(rank))
        return self._peers[self._check_rank(rank)]

    # signals

    def _word(self, kind: int, idx: int) -> int:
        return (kind * self.world_size + idx) * 8

    def _to_notice(self, kind: int) -> int:
        """Words from word (kind, src) to src's NOTICE word: the waits' abort offset."""
        return (_NOTICE - kind) * self.world_size

    def _user_word(self, idx: int) -> int:
        if not isinstance(idx, int) or not 0 <= idx < self.num_signals:
            raise ValueError(f"signal index must be in [0, {self.num_signals}), got {idx!r}")
        return (_NUM_KINDS * self.world_size + idx) * 8

    def signal(self, rank: int, idx: int, value: int, op: str = "set") -> None:
        """Set or add ``value`` to user signal word ``idx`` of rank ``rank`` (release ordering after prior puts).

        On nvshmem the signal is a kernel on the current CUDA stream, ordered after the stream's earlier writes.
        """
        self._check_shm("signal")
        if self.transport == "nvshmem":
            self._nv.post(self._user_word(idx), value, op, self._check_rank(rank))
            return
        seg = self._segments[self._check_rank(rank)]
        off = self._user_word(idx)
        if op == "set":
            seg.store(off, value)
        elif op == "add":
            seg.fetch_add(off, value)
        else:
            raise ValueError(f"op must be 'set' or 'add', got {op!r}")

    def read_signal(self, idx: int) -> int:
        """Current value of this rank's user signal word ``idx``."""
        self._check_shm("read_signal")
        if self.transport == "nvshmem":
            return self._nv.read(self._user_word(idx))
        return self._segments[self.rank].load(self._user_word(idx))

    def wait_until(self, idx: int, cmp: str, value: int, timeout: float | None = None) -> int:
        """Wait until this rank's user signal ``idx`` satisfies ``cmp value``; returns the value seen.

        On nvshmem a timed wait kernel runs on the current CUDA stream and the host waits for it.
        """
        self._check_shm("wait_until")
        t = self.timeout if timeout is None else timeout
        if self.transport == "nvshmem":
            off = self._user_word(idx)
            seen, failed = self._nv_wait(off, 1, cmp, value, t)
            if failed is not None:
                raise TimeoutError(
                    f"rank {self.rank}: signal word {idx} did not satisfy {cmp} {value} within {t:g} s "
                    f"(last seen {seen})"
                )
            return seen
        return self._segments[self.rank].wait_until(self._user_word(idx), cmp, value, t)

    def _post(self, kind: int, dst: int, value: int, guarded: bool = False) -> None:
        """Set word ``kind`` of this rank at ``dst`` (``guarded``, nvshmem: not after a failed stream-ordered wait)."""
        if self._broken is not None:  # a rank that gave up signals nothing more (its peers read its notice)
            return
        if self.transport == "nvshmem":
            self._nv.post(self._word(kind, self.rank), value, "set", dst, guarded=guarded)
            return
        self._segments[dst].store(self._word(kind, self.rank), value)

    def _silence(self, src: int, what: str, t: float, value: int) -> TimeoutError:
        exc = TimeoutError(
            f"rank {self.rank}: rank {src} sent no {what} signal within {t:g} s "
            f"(epoch {value}); it died or stopped calling"
        )
        exc.peer = src  # read by _deferred_failed
        return exc

    def _silent(self, src: int, what: str, t: float, value: int) -> NoReturn:
        self.mark_broken(f"no {what} signal from rank {src}", culprit=src, silent=True)
        raise self._silence(src, what, t, value)

    def _failed_wait(self, src: int, seen: int, what: str, t: float, value: int) -> NoReturn:
        """A wait on ``src`` ended without its signal: the peer's gave-up notice, or silence."""
        if seen & _GAVE_UP:
            raise self._gave_up(seen, what)
        self._silent(src, what, t, value)

    def _wait_deferred(
        self, kind: int, first: int, count: int, value: int, what: str, t: float, guarded: bool = False
    ) -> None:
        """nvshmem: a stream-ordered wait on ``count`` sources from ``first``, judged later (see DeferredChecks).

        ``guarded``: an acknowledgement wait of an exchange whose writes all take the exchange's guard."""

        def judge(result):
            failed = result[1] & MASK64
            if failed == MASK64:  # the kernel skipped the wait: an earlier deferred wait had failed
                exc = TimeoutError(f"rank {self.rank}: {what} skipped: an earlier wait on this buffer failed")
                exc.skipped = True
                return exc
            if failed == 0:
                return None
            src = first + failed - 1
            seen = result[0] & MASK64
            return self._gave_up(seen, what) if seen & _GAVE_UP else self._silence(src, what, t, value)

        # An ACK wait guards this rank's writes into the peer's memory. Where the stream would perform them
        # whatever the wait's outcome (writes made straight into send regions), it is never skipped after an
        # earlier failure and no notice ends it (a third rank may have called the peer silent while it is only
        # slow, still reading): only the peer's acknowledgement, or the timeout, ends it. Where every write
        # behind it takes the guard, a failed or skipped wait stops them, so it may end like any other wait.
        trusted = kind != _ACK or guarded
        self._nv.wait_deferred(
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

    def _wait_from(
        self,
        kind: int,
        src: int,
        value: int,
        what: str,
        timeout: float | None = None,
        deferred: bool = False,
        guarded: bool = False,
    ) -> None:
        t = self.timeout if timeout is None else timeout
        if self.transport == "nvshmem" and deferred:
            self._wait_deferred(kind, src, 1, value, what, t, guarded)
            return
        if self.transport == "nvshmem":
            seen, failed = self._nv_wait(self._word(kind, src), 1, ">=", value, t, self._to_notice(kind))
            if failed is not None:
                self._failed_wait(src, seen, what, t, value)
            return
        notice = self._shm_wait(kind, src, value, t)
        if notice is not None:
            self._failed_wait(src, notice, what, t, value)

    def _shm_wait(self, kind: int, src: int, value: int, t: float) -> int | None:
        """shm: wait for word (kind, src) >= value while watching src's NOTICE word (one wait in epkit._C);
        None when the word got there, else the notice (0 on timeout)."""
        status, seen = self._segments[self.rank].wait_until_or_abort(
            self._word(kind, src), ">=", value, self._word(_NOTICE, src), t
        )
        return None if status == 0 else (seen if status == 1 else 0)

    def _wait_all_sources(
        self, kind: int, value: int, what: str, timeout: float | None = None, deferred: bool = False
    ) -> None:
        """Wait for word ``kind`` of every source rank to reach ``value`` (nvshmem: one device wait, one sync;
        with ``deferred`` no sync: the outcome is checked later)."""
        if self.transport != "nvshmem":
            for src in range(self.world_size):
                self._wait_from(kind, src, value, what, timeout)
            return
        t = self.timeout if timeout is None else timeout
        if deferred:
            self._wait_deferred(kind, 0, self.world_size, value, what, t)
            return
        seen, failed = self._nv_wait(self._word(kind, 0), self.world_size, ">=", value, t, self._to_notice(kind))
        if failed is not None:
            self._failed_wait(failed, seen, what, t, value)

    def barrier(self, timeout: float | None = None) -> None:
        """All ranks of the group reach this point (signals on shm/nvshmem, torch.distributed otherwise)."""
        self._check_usable()
        if self.transport == "torch":
            work = dist.barrier(group=self.group, async_op=True)
            self._wait_work(work, "barrier", self.timeout if timeout is None else timeout)
            return
        self._check_shm("barrier")
        self._epochs["barrier"] += 1
        e = self._epochs["barrier"]
        for r in range(self.world_size):
            self._post(_BARRIER, r, e)
        self._wait_all_sources(_BARRIER, e, "barrier", timeout)

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
                f"rank {self.rank}: exchange {self._open.tag!r} is still open (call its hook / "
                f"release it before the next collective on this buffer)"
            )
        if self.transport in _DIRECT:
            self._check_shm("exchange")
            if region_bytes * w > self.num_bytes:
                raise ValueError(
                    f"{w} regions of {region_bytes} bytes exceed the {self.num_bytes}-byte buffer; "
                    f"create the buffer with num_bytes >= {region_bytes * w}"
                )
        self._epochs["a2a"] = self._epochs.get("a2a", 0) + 1
        self._open = Exchange(
            self,
            self._epochs["a2a"],
            region_bytes,
            tag,
            self.timeout if timeout is None else timeout,
            deferred,
            guarded and deferred,
        )
        return self._open

    def all_to_all(
        self,
        send: list[torch.Tensor],
        recv_bytes: list[int],
        region_bytes: int,
        tag: str = "exchange",
        timeout: float | None = None,
    ) -> list[torch.Tensor]:
        """Exchange byte payloads: ``send[r]`` (uint8, 1-D) goes to rank r; returns copies of what each rank sent.

        ``recv_bytes[r]`` is the size rank r sends here (known from an earlier exchange
        or fixed by the protocol).
        """
        w = self.world_size
        if len(send) != w or len(recv_bytes) != w:
            raise ValueError(f"all_to_all needs {w} send payloads and {w} receive sizes")
        for r, part in enumerate(send):
            if part.dtype != torch.uint8 or part.numel() > region_bytes:
                raise ValueError(
                    f"payload for rank {r} must be uint8 of at most {region_bytes} bytes, got "
                    f"{part.dtype} x {part.numel()}"
                )
        if any(not 0 <= n <= region_bytes for n in recv_bytes):
            raise ValueError(f"receive sizes {recv_bytes} must lie in [0, {region_bytes}]")
        ex = self.exchange(region_bytes, tag, timeout)
        for k in range(w):
            dst = (self.rank + k) % w
            n = send[dst].numel()
            if n:
                ex.send_region(dst)[:n].copy_(send[dst].reshape(-1))
            ex.commit(dst, n)
        out = [v.clone() for v in ex.receive(recv_bytes)]
        ex.release()
        return out

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
        if collective and self._nv is not None:
            try:
                self.barrier()  # every rank is here: the free below cannot wait forever
            except Exception as exc:  # noqa: BLE001 -- raised below, after releasing what is local
                late, collective = exc, False
        self._closed = True
        self._peers = []
        self._staging = {}
        self.local = torch.empty(0, dtype=torch.uint8)
        if self._nv is not None:
            nv, self._nv = self._nv, None
            nv.free(collective=collective)
        # A segment is unmapped when its last reference goes; views hold one, so a view kept past
        # close() never points at an unmapped page.
        self._segments = []
        if late is not None:
            raise late

    def __enter__(self) -> SymmBuffer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self._broken is None and not self._closed:
            # The exception may be leaving the block on this rank only: tell the peers (their waits on this
            # rank, the close's barrier too, end at once naming it), and wait for none of them.
            with contextlib.suppress(Exception):
                self.mark_broken(f"rank {self.rank} left its block by {exc_type.__name__}", culprit=self.rank)
        self._close(collective=exc_type is None and self._broken is None)

    def __del__(self):
        with contextlib.suppress(Exception):
            if getattr(self, "_nv", None) is None:  # freeing nvshmem memory is collective: only close() does it
                self.close()


class Exchange:
    """One all-to-all in flight on a :class:`SymmBuffer` (see :meth:`SymmBuffer.exchange`)."""

    def __init__(
        self,
        buf: SymmBuffer,
        epoch: int,
        region_bytes: int,
        tag: str,
        timeout: float,
        deferred: bool,
        guarded: bool = False,
    ):
        self.buf, self.epoch, self.region_bytes, self.tag, self.timeout = buf, epoch, region_bytes, tag, timeout
        self.deferred, self.guarded = deferred, guarded
        w = buf.world_size
        self._sizes = [None] * w
        self._staging: list[torch.Tensor | None] = [None] * w
        self._recv = None
        self._acked = [False] * w

    @property
    def guard(self) -> torch.Tensor | None:
        """Stream-ordered (deferred) nvshmem exchanges: the buffer's sticky word (``[1]`` int64 on the device),
        nonzero once a stream-ordered wait failed; copies that take it as their guard write nothing then.
        None otherwise (the waits end on the host, which raises before any write)."""
        if self.deferred and self.buf.transport == "nvshmem":
            return self.buf._nv._sticky
        return None

    def write(self, dst: int, data: torch.Tensor, offset: int = 0) -> None:
        """Copy ``data`` (uint8, 1-D) into :meth:`send_region` ``(dst)`` at ``offset``, guarded (see :attr:`guard`).

        The same bytes as ``send_region(dst)[offset:offset + n].copy_(data)``; in a stream-ordered exchange
        the copy is skipped on the stream when a wait before it failed.
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
        from epkit.collectives._details.ep_rows import move_rows

        src = data.contiguous()
        if src.device != region.device:  # from pinned memory, asynchronously: the host does not wait for the stream
            src = src.pin_memory().to(region.device, non_blocking=True)
        dst_addr = torch.full((1,), region.data_ptr() + offset, dtype=torch.int64, device=region.device)
        src_addr = torch.full((1,), src.data_ptr(), dtype=torch.int64, device=region.device)
        move_rows(dst_addr, src_addr, n, [region.data_ptr(), offset, src.data_ptr()], guard=guard)

    def send_region(self, dst: int) -> torch.Tensor:
        """``[region_bytes]`` uint8 view to fill with the payload for ``dst``."""
        buf = self.buf
        if buf.transport == "torch":
            if self._staging[dst] is None:
                self._staging[dst] = torch.empty(self.region_bytes, dtype=torch.uint8)
            return self._staging[dst]
        if self.epoch > 1 and not self._acked[dst]:
            # dst must have consumed our previous message before we overwrite its region.
            buf._wait_from(_ACK, dst, self.epoch - 1, f"{self.tag} consumed", self.timeout, self.deferred, self.guarded)
            self._acked[dst] = True
        if buf._peers[dst] is None:  # nvshmem peer outside the NVLink domain: staged, put by commit()
            if self._staging[dst] is None:
                # Kept by the buffer, so the address is the same every call: the put of an earlier exchange
                # ran before anything later on the stream can overwrite it.
                key = (dst, self.region_bytes)
                if key not in buf._staging:
                    buf._staging[key] = torch.empty(self.region_bytes, dtype=torch.uint8, device=buf.local.device)
                self._staging[dst] = buf._staging[key]
            return self._staging[dst]
        off = buf.rank * self.region_bytes
        return buf._peers[dst][off : off + self.region_bytes]

    def commit(self, dst: int, nbytes: int) -> None:
        """The payload for ``dst`` (``nbytes`` at the start of its region) is complete."""
        if not 0 <= nbytes <= self.region_bytes:
            raise ValueError(f"payload of {nbytes} bytes for rank {dst} exceeds the {self.region_bytes}-byte region")
        buf = self.buf
        if nbytes and buf.transport in _DIRECT and self.epoch > 1 and not self._acked[dst]:
            raise RuntimeError("commit() of a payload without send_region(): nothing was written for this epoch")
        staged = buf.transport == "torch" or (buf.transport == "nvshmem" and buf._peers[dst] is None)
        if nbytes and staged and self._staging[dst] is None:
            raise RuntimeError("commit() of a payload without send_region(): nothing was written")
        if buf.transport == "nvshmem" and staged:
            # Data and READY in one NVSHMEM put-with-signal: the signal lands after the bytes.
            buf._nv.put_signal(
                buf.rank * self.region_bytes,
                self._staging[dst],
                nbytes,
                buf._word(_READY, buf.rank),
                self.epoch,
                dst,
                guarded=self.guard is not None,
            )
        elif buf.transport in _DIRECT:
            # A zero-byte message writes nothing, so it needs no acknowledgement of the previous one.
            buf._post(_READY, dst, self.epoch, guarded=self.guard is not None)
        self._sizes[dst] = nbytes

    def receive(self, recv_bytes: list[int]) -> list[torch.Tensor]:
        """Wait for every source's payload; ``recv_bytes[r]`` bytes from rank r. Views valid until release()."""
        buf = self.buf
        w = buf.world_size
        if any(s is None for s in self._sizes):
            missing = [r for r, s in enumerate(self._sizes) if s is None]
            raise RuntimeError(f"receive() before commit() for ranks {missing}")
        if buf.transport == "torch":
            send = torch.cat(
                [self._staging[r][:n] if n else torch.empty(0, dtype=torch.uint8) for r, n in enumerate(self._sizes)]
            )
            recv = torch.empty(sum(recv_bytes), dtype=torch.uint8)
            work = dist.all_to_all_single(
                recv,
                send,
                output_split_sizes=list(recv_bytes),
                input_split_sizes=list(self._sizes),
                group=buf.group,
                async_op=True,
            )
            buf._wait_work(work, f"{self.tag} all-to-all", self.timeout)
            self._recv = list(torch.split(recv, list(recv_bytes)))
            return self._recv
        out = []
        buf._wait_all_sources(_READY, self.epoch, f"{self.tag} data", self.timeout, self.deferred)
        for src in range(w):
            n = recv_bytes[src]
            if n > self.region_bytes:
                raise ValueError(f"rank {src} is said to send {n} bytes, more than the {self.region_bytes}-byte region")
            out.append(buf.local[src * self.region_bytes : src * self.region_bytes + n])
        self._recv = out
        return out

    def release(self) -> None:
        """Done reading the received views: let every source reuse its region."""
        buf = self.buf
        if buf.transport in _DIRECT and buf._is_open():
            for src in range(buf.world_size):
                buf._post(_ACK, src, self.epoch)
        self._recv = None
        if buf._open is self:
            buf._open = None

    def abandon(self, reason: str) -> None:
        """The protocol failed mid-exchange on this rank: the buffer can no longer be trusted (peers are told)."""
        self.buf.mark_broken(reason, culprit=self.buf.rank)
        if self.buf._open is self:
            self.buf._open = None
