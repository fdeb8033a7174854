"""The failure-notice protocol of symmetric buffers: how a rank that gives up tells its peers at once.

A rank that gives up on a buffer (a local failure mid-protocol, or a peer that timed out) writes a
*notice* into its own NOTICE word at every peer, and, when the culprit went silent, into the culprit's
NOTICE word too. Every wait on a source also watches that source's NOTICE word, so the other ranks
raise :class:`PeerFailedError` at once instead of each waiting out its own timeout, and pass the
notice on in their own NOTICE words (a peer waiting on them, not on the reporter, learns it too).
Notices never overwrite a READY/ACK/BARRIER signal.

A notice is one 64-bit word: bit 63 set, bit 62 when the culprit went silent (rather than failed),
bits 32-61 the rank that gave up (the reporter), bits 0-31 the culprit.
"""

from __future__ import annotations

__all__ = [
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


def encode_notice(reporter: int, culprit: int, silent: bool) -> int:
    """The notice word ``reporter`` writes when it gives up because of ``culprit`` (itself, or a silent peer)."""
    return _GAVE_UP | (_GAVE_UP_SILENT if silent else 0) | (reporter << 32) | (culprit & _RANK_BITS)


def is_notice(seen: int) -> bool:
    """Whether a word's value is a notice (a signal value never has bit 63 set)."""
    return bool(seen & _GAVE_UP)


def decode_notice(seen: int) -> tuple[int, int, bool]:
    """``(reporter, culprit, silent)`` of a notice word."""
    return (seen >> 32) & (_RANK_BITS >> 2), seen & _RANK_BITS, bool(seen & _GAVE_UP_SILENT)


def notice_error(rank: int, seen: int, what: str) -> PeerFailedError:
    """The error rank ``rank`` raises for a wait on ``what`` that ended on the notice ``seen``."""
    reporter, culprit, silent = decode_notice(seen)
    if silent:
        msg = (
            f"rank {rank}: {what} abandoned: rank {reporter} reports that rank {culprit} sent no signal "
            f"within its timeout (it died or stopped calling)"
        )
    else:
        msg = (
            f"rank {rank}: {what} abandoned: rank {culprit} gave up on this buffer after a failure on "
            f"its side (its own exception says why)"
        )
    return PeerFailedError(msg, culprit, silent)


def silence_error(rank: int, src: int, what: str, timeout: float, epoch: int) -> TimeoutError:
    """The error for a wait on rank ``src`` that timed out with no notice; ``.peer`` names ``src``."""
    exc = TimeoutError(
        f"rank {rank}: rank {src} sent no {what} signal within {timeout:g} s (epoch {epoch}); "
        "it died or stopped calling"
    )
    exc.peer = src
    return exc


def wait_judge(rank: int, first: int, what: str, timeout: float, epoch: int, on_notice):
    """The judge of a deferred (stream-ordered) wait on the sources from ``first``: maps the wait kernel's
    2-word result ``[value seen, 1 + index of the failed word (0: none; 2**64 - 1: skipped)]`` to None (the
    wait succeeded) or the error to raise. ``on_notice(seen, what)`` makes the error for a notice (and
    passes the notice on)."""
    mask = (1 << 64) - 1

    def judge(result):
        failed = result[1] & mask
        if failed == mask:  # the kernel skipped the wait: an earlier deferred wait had failed
            exc = TimeoutError(f"rank {rank}: {what} skipped: an earlier wait on this buffer failed")
            exc.skipped = True
            return exc
        if failed == 0:
            return None
        seen = result[0] & mask
        if is_notice(seen):
            return on_notice(seen, what)
        return silence_error(rank, first + failed - 1, what, timeout, epoch)

    return judge
