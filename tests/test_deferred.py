"""``collectives/_details/deferred.py``: ``DeferredChecks``, the queue of checks whose outcome the host learns
later, behind the error reports of the stream-ordered (host-sync-free) low-latency calls.

A call records a check and returns; ``poll()`` raises the first failure among the checks the stream has passed,
``drain()`` waits for all of them. These tests pin, on CPU with stand-in CUDA events: the first failure raises
once, is passed to the buffer's failure callback and retires the checks queued after it; a check whose stream
has not got there yet says nothing; a check's timeout (plus ``STREAM_GRACE_S``) counts from the moment it
becomes the head of the queue, not from when it was recorded; and a stream that never reaches the head check
ends in a ``TimeoutError`` naming it. The calls that use the checks are ``test_ll_stream_ordered.py``'s.
"""

import pytest
import torch

from epkit.collectives._details.deferred import DeferredChecks


def test_deferred_checks_raise_once_complete_and_retire():
    failures = []
    checks = DeferredChecks(torch.device("cpu"), lambda exc: failures.append(str(exc)))
    checks.record(torch.tensor([0, 0]), lambda v: None, 1.0, "fine")
    checks.record(torch.tensor([3, 7]), lambda v: ValueError(f"saw {v}") if v[0] else None, 1.0, "bad")
    checks.record(torch.tensor([1]), lambda v: TimeoutError("later"), 1.0, "after")
    with pytest.raises(ValueError, match=r"saw \[3, 7\]"):
        checks.poll()
    assert failures == ["saw [3, 7]"] and len(checks) == 0  # later checks retired with the failure
    checks.drain()  # nothing left


class _FakeEvent:
    """Stands in for a CUDA event whose stream has not got there yet."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_deferred_checks_wait_for_the_stream_and_time_out_from_the_head(monkeypatch):
    import epkit.collectives._details.deferred as deferred

    failures = []
    checks = DeferredChecks(torch.device("cpu"), lambda exc: failures.append(str(exc)))
    first, second = _FakeEvent(), _FakeEvent()
    checks.record(torch.tensor([0]), lambda v: None, 0.2, "a")
    checks.record(torch.tensor([1]), lambda v: ValueError("b failed"), 0.2, "b")
    checks._pending[0].event, checks._pending[1].event = first, second
    monkeypatch.setattr(deferred, "STREAM_GRACE_S", 0.1)
    now = [100.0]
    monkeypatch.setattr(deferred.time, "monotonic", lambda: now[0])
    checks.poll()  # the stream has not reached "a": nothing to say yet ("a" is the head from now on)
    now[0] += 0.25
    first.done = True
    checks.poll()  # "a" passes; "b" becomes the head now
    now[0] += 0.25  # 0.5 s after "b" was queued, past its timeout + grace, but only 0.25 s as the head
    checks.poll()
    assert len(checks) == 1 and failures == []
    second.done = True
    with pytest.raises(ValueError, match="b failed"):
        checks.poll()
    assert failures == ["b failed"]
    stuck = DeferredChecks(torch.device("cpu"), lambda exc: failures.append(str(exc)))
    stuck.record(torch.tensor([0]), lambda v: None, 0.2, "never reached")
    stuck._pending[0].event = _FakeEvent()
    stuck.poll()
    now[0] += 0.31  # timeout + grace past becoming the head, still not reached
    with pytest.raises(TimeoutError, match="never reached: the CUDA stream has not reached"):
        stuck.poll()
