"""Where a step's time and bytes go: a per-op timer the model reports into, and a ledger of the collectives
that actually ran, recorded by wrapping the transports (never computed from a formula).

:class:`StepTimer` collects seconds per op name (``attention``, ``gate``, ``logical_to_physical``,
``dispatch``, ``experts``, ``combine``, ``engram_fetch``, ``lockstep``, ...); the model calls it around
each stage. On CUDA rows it synchronizes the device at each boundary, so the split is honest (and the
step slower): profiling is opt-in.

:class:`CollectiveLedger` wraps, while it is active, every ``torch.distributed`` collective and
point-to-point call this process makes and every :meth:`SymmBuffer.exchange` (counting the bytes each
``commit`` sends), and records ``(kind, bytes)`` per call: the data one rank sent.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict

import torch
import torch.distributed as dist

__all__ = ["NULL_TIMER", "CollectiveLedger", "StepTimer"]


class StepTimer:
    """Seconds per op name, summed until :meth:`take`."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` under ``name`` (time measured elsewhere, e.g. exchanges in flight)."""
        self.seconds[name] += seconds

    def take(self) -> dict[str, float]:
        """The seconds so far, by op; starts again from zero."""
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


class _NullTimer:
    """The default: times nothing, costs one context manager per stage."""

    @contextlib.contextmanager
    def __call__(self, name: str):
        yield

    def add(self, name: str, seconds: float) -> None:
        pass

    def take(self) -> dict[str, float]:
        return {}


NULL_TIMER = _NullTimer()

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter_tensor",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)


def _nbytes(args) -> int:
    """The tensor bytes among a call's arguments (the first tensor or list of tensors: what it sends)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.numel() * a.element_size()
        if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            return sum(t.numel() * t.element_size() for t in a)
    return 0


class CollectiveLedger:
    """Record the collectives of a region of code (a context manager; not reentrant).

    Attributes
    ----------
    calls : list of (kind, bytes)
        In call order. Kinds: ``dist.<function>`` for torch.distributed calls, ``exchange:<tag>`` for
        SymmBuffer exchanges (bytes: what this rank committed to all peers, itself included).
    """

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self._undo: list = []
        self._depth = 0  # a collective implemented by another (all_gather_object -> all_gather) counts once

    def summary(self) -> dict[str, dict[str, int]]:
        """``{kind: {"count": n, "bytes": b}}``."""
        out: dict[str, dict[str, int]] = {}
        for kind, nbytes in self.calls:
            entry = out.setdefault(kind, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += nbytes
        return out

    def _wrap(self, owner, name: str, kind: str, record_bytes=_nbytes):
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            outer = self._depth == 0
            self._depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth -= 1
            if outer:
                self.calls.append((kind, record_bytes(args)))
            return result

        setattr(owner, name, wrapped)
        self._undo.append((owner, name, original))

    def _wrap_exchange(self) -> None:
        from epkit.collectives.symm_buffer import SymmBuffer

        original = SymmBuffer.exchange
        ledger = self

        @functools.wraps(original)
        def exchange(buf, region_bytes, tag="exchange", *args, **kwargs):
            ex = original(buf, region_bytes, tag, *args, **kwargs)
            entry = [f"exchange:{tag}", 0]
            ledger.calls.append(entry)  # type: ignore[arg-type]  # filled in as the payloads are committed
            commit = ex.commit

            def counted(dst, nbytes, split=0):
                entry[1] += int(nbytes)
                return commit(dst, nbytes, split)

            ex.commit = counted
            return ex

        SymmBuffer.exchange = exchange
        self._undo.append((SymmBuffer, "exchange", original))

    def __enter__(self) -> CollectiveLedger:
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                self._wrap(dist, name, f"dist.{name}")
        self._wrap_exchange()
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo = []
        self.calls = [tuple(c) for c in self.calls]
