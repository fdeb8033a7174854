"""One deadline for a whole call: the waits inside a :func:`within` block end by its deadline, however many there are.

A buffer's construction is several waits in a row (the host probe, the segment exchange, a gloo group), and a
call of ``epkit.compat.deep_ep`` is an agreement, perhaps a first buffer's construction, a routing gather and the
rows' exchange. Each wait has the buffer's timeout; back to back, a rank that comes late to the first and then
stops would cost the others a timeout per wait. So every wait computes its deadline with :func:`deadline_after`,
which is the earlier of its own timeout and the enclosing block's deadline: the caller's timeout then holds end to
end. Outside any block a wait keeps its own timeout. The deadline is a context variable: each thread (and each
asyncio task) has its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

__all__ = ["deadline_after", "within"]

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("epkit_call_deadline", default=None)


def deadline_after(timeout: float) -> float:
    """``time.monotonic() + timeout``, or the enclosing :func:`within` block's deadline where that comes first."""
    mine = time.monotonic() + timeout
    outer = _DEADLINE.get()
    return mine if outer is None else min(mine, outer)


@contextlib.contextmanager
def within(timeout: float) -> Iterator[float]:
    """A block whose waits all end within ``timeout`` seconds from now (or by the enclosing block's deadline, if
    that is earlier); yields the deadline (a ``time.monotonic()`` instant)."""
    token = _DEADLINE.set(deadline_after(timeout))
    try:
        yield _DEADLINE.get()  # type: ignore[misc]  # set just above
    finally:
        _DEADLINE.reset(token)
