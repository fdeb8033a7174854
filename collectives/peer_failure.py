"""The failure-notice protocol of symmetric buffers: how a rank that gives up tells its peers at once.

A rank that gives up on a buffer (a local failure mid-protocol, or a peer that timed out) writes a
*notice* into its own NOTICE word at every peer, and, when the culprit went silent, into the culprit's
NOTICE word too. Every wait on a source also watches that source's NOTICE word, so the other ranks
raise :class:`PeerFailedError` at once instead of each waiting out its own timeout, and pass the
notice on in their own NOTICE words (a peer waiting on them, not on the reporter, learns it too).
Notices never overwrite a READY/ACK/BARRIER signal.

A notice is one 64-bit word: bit 63 set, bit 62 when the culprit went silent (rather than failed), bit 61
when the culprit is a global rank that is not in the buffer's group (learned from another buffer of the same
EPBuffer: a hierarchy's rail or intra-host buffer), bits 32-60 the rank that gave up (the reporter), bits 0-31
the culprit (a position in the group, or that global rank).

Every error a failed wait raises carries ``.culprit``, ``(global rank, silent)``: whom to name, which an
EPBuffer passes on to its other buffers when it retires them.
"""

from __future__ import annotations

import contextlib
import time

from epkit.collectives.transports.base import NOTICE

__all__ = [
    "FailureNotices",
    "PeerFailedError",
    "decode_notice",
    "encode_notice",
    "is_notice",
    "notice_error",
    "silence_error",
    "wait_judge",
]

_GAVE_UP = 1 << 63
_GAVE_UP_SILENT = 1 << 62
_GLOBAL_CULPRIT = 1 << 61
_RANK_BITS = 0xFFFFFFFF
_REPORTER_BITS = (1 << 29) - 1


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
    culprit : tuple of (int, bool)
        ``(global rank, silent)`` of the rank the message names (``peer``'s, or one outside the buffer's group).
    """

    def __init__(self, message: str, peer: int, silent: bool):
        super().__init__(message)
        self.peer, self.silent = peer, silent
        self.culprit: tuple[int, bool] = (peer, silent)


def encode_notice(reporter: int, culprit: int, silent: bool, outside: bool = False) -> int:
    """The notice word ``reporter`` writes when it gives up because of ``culprit`` (itself, or a silent peer;
    ``outside``: ``culprit`` is a global rank that is not in the buffer's group)."""
    flags = _GAVE_UP | (_GAVE_UP_SILENT if silent else 0) | (_GLOBAL_CULPRIT if outside else 0)
    return flags | ((reporter & _REPORTER_BITS) << 32) | (culprit & _RANK_BITS)


def is_notice(seen: int) -> bool:
    """Whether a word's value is a notice (a signal value never has bit 63 set)."""
    return bool(seen & _GAVE_UP)


def decode_notice(seen: int) -> tuple[int, int, bool]:
    """``(reporter, culprit, silent)`` of a notice word (see :func:`notice_outside` for the culprit's kind)."""
    return (seen >> 32) & _REPORTER_BITS, seen & _RANK_BITS, bool(seen & _GAVE_UP_SILENT)


def notice_outside(seen: int) -> bool:
    """Whether a notice's culprit is a global rank outside the buffer's group (else a position in it)."""
    return bool(seen & _GLOBAL_CULPRIT)


def _named(ranks, r: int) -> int:
    """Rank ``r`` (a position in the buffer's group) as messages name it: its global rank where ``ranks`` (the
    members' global ranks, by position) is given."""
    return r if ranks is None else ranks[r]


def notice_error(rank: int, seen: int, what: str, ranks=None) -> PeerFailedError:
    """The error rank ``rank`` raises for a wait on ``what`` that ended on the notice ``seen``. Ranks are
    positions in the buffer's group; ``ranks`` (the members' global ranks) names them in the message, and
    ``.peer`` stays a position."""
    reporter, culprit, silent = decode_notice(seen)
    me, by = _named(ranks, rank), _named(ranks, reporter)
    who = culprit if notice_outside(seen) else _named(ranks, culprit)
    if silent:
        msg = (
            f"rank {me}: {what} abandoned: rank {by} reports that rank {who} sent no signal "
            f"within its timeout (it died or stopped calling)"
        )
    else:
        msg = (
            f"rank {me}: {what} abandoned: rank {who} gave up on this buffer after a failure on "
            f"its side (its own exception says why)"
        )
    exc = PeerFailedError(msg, reporter if notice_outside(seen) else culprit, silent)
    exc.culprit = (who, silent)
    return exc


def silence_error(rank: int, src: int, what: str, timeout: float, epoch: int, ranks=None) -> TimeoutError:
    """The error for a wait on rank ``src`` that timed out with no notice; ``.peer`` is ``src`` (a position; the
    message names global ranks where ``ranks`` is given)."""
    exc = TimeoutError(
        f"rank {_named(ranks, rank)}: rank {_named(ranks, src)} sent no {what} signal within {timeout:g} s "
        f"(epoch {epoch}); it died or stopped calling"
    )
    exc.peer = src
    exc.culprit = (_named(ranks, src), True)  # type: ignore[attr-defined]
    return exc


def wait_judge(rank: int, first: int, what: str, timeout: float, epoch: int, on_notice, ranks=None):
    """The judge of a deferred (stream-ordered) wait on the sources from ``first``: maps the wait kernel's
    2-word result ``[value seen, 1 + index of the failed word (0: none; 2**64 - 1: skipped)]`` to None (the
    wait succeeded) or the error to raise. ``on_notice(seen, what)`` makes the error for a notice (and
    passes the notice on)."""
    mask = (1 << 64) - 1

    def judge(result):
        failed = result[1] & mask
        if failed == mask:  # the kernel skipped the wait: an earlier deferred wait had failed
            exc = TimeoutError(f"rank {_named(ranks, rank)}: {what} skipped: an earlier wait on this buffer failed")
            exc.skipped = True
            return exc
        if failed == 0:
            return None
        seen = result[0] & mask
        if is_notice(seen):
            return on_notice(seen, what)
        return silence_error(rank, first + failed - 1, what, timeout, epoch, ranks)

    return judge


class FailureNotices:
    """The notice protocol as :class:`~epkit.collectives.symm_buffer.SymmBuffer` runs it (mixed into it): giving
    up (``mark_broken``), telling the peers, and turning a failed wait into the error to raise. Uses the
    buffer's ``rank``, ``world_size``, ``global_ranks``, ``impl`` (the transport), ``is_open()``, ``_word()`` and
    ``_broken``."""

    _broken: str | None = None
    #: The other buffers of one EPBuffer (a hierarchy's flat, intra-host and rail buffers), retired with this one.
    siblings: tuple[FailureNotices, ...] = ()

    @property
    def broken(self) -> str | None:
        """Why this buffer was retired by a failure (see :meth:`mark_broken`), or None while it is usable."""
        return self._broken

    def mark_broken(
        self, reason: str, culprit: int | None = None, silent: bool = False, blame: tuple[int, bool] | None = None
    ) -> None:
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
        blame : (int, bool), optional
            Instead of ``culprit`` and ``silent``: a global rank and whether it went silent, as an error's
            ``.culprit`` names them (a failure found on another buffer of the same EPBuffer, whose culprit may
            not be in this buffer's group).
        """
        if self._broken is not None:
            return
        self._broken = reason
        if blame is None and culprit is not None:
            blame = (self.global_ranks[culprit], silent)
        if blame is not None:
            g, silent = blame
            inside = g in self.global_ranks  # else a rank of another buffer's group: named by its global rank
            at = self.global_ranks.index(g) if inside else g
            notice = encode_notice(self.rank, at, silent, outside=not inside)
            self._spread(notice, [self.rank] + ([at] if inside and silent and at != self.rank else []))
            if not self.impl.direct:
                self.impl.tell(g, silent)
        for other in self.siblings:  # the other buffers of one EPBuffer: their peers learn whom to name too
            with contextlib.suppress(ReferenceError):  # (weak references: one already collected is gone)
                other.mark_broken(reason, blame=blame)

    def _spread(self, notice: int, sources: list[int]) -> None:
        """Write ``notice`` into the NOTICE words of ``sources`` at every other peer. Best effort: one-sided
        stores with no waits (urgent: on a stream of their own, not behind this rank's stuck work)."""
        if not self.impl.direct or not self.is_open():
            return
        for dst in range(self.world_size):
            for src in sources:
                if dst in (self.rank, src):
                    continue
                with contextlib.suppress(Exception):  # a peer that is gone cannot be told; nothing to do
                    self.impl.store(dst, self._word(NOTICE, src), notice, urgent=True)

    def _gave_up(self, seen: int, what: str) -> PeerFailedError:
        """The error for a wait that found the gave-up notice ``seen``; retires this buffer and
        passes the notice on (a peer waiting on this rank, not on the reporter, learns it too)."""
        exc = notice_error(self.rank, seen, what, self.global_ranks)
        self.mark_broken(str(exc), blame=exc.culprit)  # passed on as this rank's notice naming the same rank
        return exc

    def _deferred_failed(self, exc: BaseException) -> None:
        """A deferred check failed: retire the buffer, telling the peers when they cannot learn it otherwise."""
        if isinstance(exc, PeerFailedError) or getattr(exc, "skipped", False):  # told / judged earlier
            self.mark_broken(str(exc))
        elif getattr(exc, "peer", None) is not None:  # a silent peer (see silence_error)
            self.mark_broken(str(exc), culprit=exc.peer, silent=True)
        elif isinstance(exc, TimeoutError):  # this rank's stream is stuck
            self.mark_broken(str(exc), culprit=self.rank)
        else:  # an input error every rank finds in the same messages
            self.mark_broken(str(exc))

    def _failed_wait(self, src: int, seen: int, what: str, t: float, value: int):
        """A wait on ``src`` ended without its signal: the peer's gave-up notice, or silence."""
        if is_notice(seen):
            raise self._gave_up(seen, what)
        grace = self.impl.grace(src)
        for buf in (self, *self.siblings):  # peers reading a torch buffer's notices then listen as long
            with contextlib.suppress(ReferenceError):
                buf.impl.waiting(grace)
        end = time.monotonic() + grace  # a live peer stuck behind the failed rank says so now
        while self.is_open() and time.monotonic() < end:
            late = self.impl.load(self._word(NOTICE, src))
            if is_notice(late):
                raise self._gave_up(late, what)
            time.sleep(0.01)
        self.mark_broken(f"no {what} signal from rank {self.global_ranks[src]}", culprit=src, silent=True)
        raise silence_error(self.rank, src, what, t, value, self.global_ranks)
