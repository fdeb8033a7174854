"""Checks whose outcome the host learns later: the error reporting of stream-ordered (host-sync-free) calls.

A call that must not wait for the GPU (the low-latency dispatch/combine) still has to report a peer
that never signalled or an input that was invalid on some rank. It records what to check here and
returns; the outcome becomes readable once the CUDA stream passes the point where it was recorded:

- a timed device wait writes its 2-word result straight into pinned host memory (``host_slot``);
- a status computed on the device is stored into pinned memory by the row-copy kernel
  (``ep.rows.copy_rows_by_address``: a kernel's stores through the mapped address, not a device-to-host memcpy).

Neither synchronizes the host, and neither is a device-to-host copy. :meth:`DeferredChecks.poll`
(called at the start of every later collective on the buffer) raises the first failure among the
checks the stream has passed, and :meth:`DeferredChecks.drain` waits, with a deadline, for all of
them (``synchronize()``). On CPU the "stream" is the host itself: a check is complete as soon as
it is recorded, and the same code raises at the next poll, which is what lets the CPU tests
exercise the GPU semantics.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from epkit._details.host_memory import is_host_memory, mark_host_memory

#: Seconds beyond a check's own timeout before an unfinished stream counts as stuck.
STREAM_GRACE_S = 10.0


#: Checks of buffers that were dropped with work still queued: a wait kernel that has not run yet
#: still writes its pinned slot, so the slot must never return to torch's pinned-memory cache.
_ORPHANED: list = []


@dataclass
class _Check:
    event: object  # torch.cuda.Event, or None when complete on record (CPU)
    values: torch.Tensor  # host tensor (pinned on CUDA) holding the outcome once event completed
    judge: Callable[[list[int]], BaseException | None]
    timeout: float
    what: str
    head_since: float | None = None  # when this check became the oldest pending one


class DeferredChecks:
    """FIFO of pending checks for one buffer (see the module docstring).

    Parameters
    ----------
    device : torch.device
        Where the checked work runs (``cuda`` or ``cpu``).
    on_failure : callable(exception)
        Called with the failure before it is raised (``SymmBuffer`` retires itself): the ranks learn of a
        deferred failure at different calls, so their exchange counters can no longer be trusted.
    """

    def __init__(self, device: torch.device, on_failure: Callable[[BaseException], None] | None = None):
        self.device = device
        self.on_failure = on_failure
        self._pending: deque[_Check] = deque()
        # Checks dropped after a failure: their host slots stay allocated, since a wait kernel that has not
        # run yet still writes into its slot.
        self._retired: list[_Check] = []

    def __len__(self) -> int:
        return len(self._pending)

    def host_slot(self, n: int) -> torch.Tensor:
        """A fresh ``[n]`` int64 host tensor a device kernel may write (pinned, so mapped, on CUDA)."""
        return mark_host_memory(torch.zeros(n, dtype=torch.int64, pin_memory=self.device.type == "cuda"))

    def record(self, values: torch.Tensor, judge, timeout: float, what: str, portable: bool = False) -> None:
        """Check ``values`` once the current stream has passed this point.

        ``values`` is either a host tensor from :meth:`host_slot` that queued device work fills, or a
        device tensor (int64, a few words) that a copy kernel on the current stream stores into one here
        (the slot is pinned, so mapped: no device-to-host memcpy, and nothing waits). ``judge(list_of_ints)``
        returns the exception to raise, or None. ``portable``: CPU values are stored by the copy kernel too.
        """
        if not is_host_memory(values):
            host = self.host_slot(values.numel())
            self._store(host, values, portable)
            values = host
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._pending.append(_Check(event, values, judge, timeout, what))

    def _store(self, host: torch.Tensor, values: torch.Tensor, portable: bool) -> None:
        """``host[:] = values`` (int64): by the row-copy kernel for device data (or ``portable``)."""
        from epkit.collectives.ep import rows as ep_rows

        values = values.reshape(-1).to(torch.int64).contiguous()
        if values.device.type == "cpu" and not portable:
            host.copy_(values)
            return
        # (values and the address tensors may be freed at once: the allocator reuses their memory only for
        # later work on this stream, which runs after the kernel)
        dev, nbytes = values.device, 8 * values.numel()
        dst = torch.full((1,), host.data_ptr(), dtype=torch.int64, device=dev)  # a fill, not a copy
        src = torch.full((1,), values.data_ptr(), dtype=torch.int64, device=dev)
        ep_rows.copy_rows_by_address(dst, src, nbytes, [host.data_ptr(), values.data_ptr(), nbytes], portable=portable)

    def _fail(self, exc: BaseException) -> BaseException:
        if self.on_failure is not None:
            self.on_failure(exc)
        return exc

    def __del__(self):
        if self.device.type == "cuda":  # queued kernels may still write these slots
            _ORPHANED.extend(c for c in (*self._pending, *self._retired) if c.event is not None and not c.event.query())

    def _retire(self) -> None:
        self._retired.extend(self._pending)
        self._pending.clear()

    def poll(self) -> None:
        """Raise the first failure among the checks the stream has passed; never blocks."""
        while self._pending:
            chk = self._pending[0]
            if chk.event is not None and not chk.event.query():
                # The deadline runs from when the check became the oldest pending one, not from when it was
                # queued: a host far ahead of a healthy stream must not read as a stuck stream.
                now = time.monotonic()
                if chk.head_since is None:
                    chk.head_since = now
                if now > chk.head_since + chk.timeout + STREAM_GRACE_S:
                    self._retire()
                    raise self._fail(
                        TimeoutError(
                            f"{chk.what}: the CUDA stream has not reached this check {STREAM_GRACE_S:g} s past its "
                            f"timeout (stuck behind other work, or a kernel hung)"
                        )
                    )
                return
            self._pending.popleft()
            exc = chk.judge(chk.values.numpy().tolist())  # host memory: no device access, no sync
            if exc is not None:
                self._retire()  # later checks depend on this one; the failure is what matters
                raise self._fail(exc)

    def drain(self) -> None:
        """Wait until every pending check is complete (each with its own deadline), raising the first failure."""
        while self._pending:
            chk = self._pending[0]
            spins = 0
            if chk.head_since is None:
                chk.head_since = time.monotonic()
            while chk.event is not None and not chk.event.query():
                if time.monotonic() > chk.head_since + chk.timeout + STREAM_GRACE_S:
                    break  # poll() reports it
                spins += 1
                if spins > 2000:
                    time.sleep(50e-6)
            self.poll()
