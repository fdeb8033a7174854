"""DeepEP V2's all-gather session (AGRS: ``ElasticBuffer.agrs_set_config`` / ``create_agrs_session`` /
``destroy_agrs_session`` / ``agrs_new_session`` / ``agrs_get_inplace_tensor`` / ``all_gather``) for
``epkit.compat.deep_ep``, over the group's ``all_gather_into_tensor``.

``agrs_set_config(num_max_session_bytes, n)`` makes the session area: ``num_max_session_bytes`` (32-byte aligned)
on every rank, the group's device (CPU on gloo, the current CUDA device on NCCL). A session hands it out from the
start: each gathered tensor of ``b`` bytes takes the next ``align(W * b, 32)`` bytes, rank ``r``'s part at
``r * b``, and at most ``n`` ``all_gather`` calls (a batched call is one) fit a session. ``all_gather`` returns views
of that area (``[W, *shape]``, the input's dtype), valid until the session ends; the next session reuses the area.
``agrs_get_inplace_tensor`` returns this rank's part of the next call's tensors: written there, ``all_gather`` of
those views moves no local copy (V2's in-place gather). The handle waits for the gather: the data are in the views
once it returns (V2's makes the compute stream wait).

Collective, in the same order on every rank (as V2's): ``agrs_set_config``, ``all_gather`` and
``destroy_agrs_session``; a bad call on one rank (outside a session, out of room, a tensor not contiguous, sizes
that differ across ranks) is the same ValueError on every rank before anything moves, and the session goes on.
``create_agrs_session`` and ``agrs_get_inplace_tensor`` are this rank's alone (their errors too). Every wait has the
buffer's timeout and names the ranks that went silent (the agreement's).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from epkit.collectives.ep.rows import align_up
from epkit.compat._details.deep_ep_agreement import FieldValue, all_gather_into
from epkit.compat._details.deep_ep_config import SIZE_ALIGN
from epkit.compat._details.deep_ep_session import Session

__all__ = ["ElasticAGRS", "Shapes", "agrs_buffer_size_hint", "agrs_num_max_session_bytes"]

#: One shape, or a sequence of them (batched).
Shapes = tuple[int, ...] | torch.Size | Sequence[tuple[int, ...] | torch.Size]
#: V2's bound on all-gathers per session (its workspace's signal slots).
MAX_PER_SESSION = 32
_ALIGN = 32


def _batch(shapes: Shapes) -> tuple[bool, list[tuple[int, ...]]]:
    """``(batched, shapes)``: V2's rule, a sequence whose first element is a tuple (a ``torch.Size`` too) is a batch."""
    batched = isinstance(shapes[0], tuple)
    seq: list[Sequence[int]] = list(shapes) if batched else [shapes]  # type: ignore[list-item,arg-type]
    return batched, [tuple(int(d) for d in s) for s in seq]


def agrs_num_max_session_bytes(num_ranks: int, shapes: Shapes, dtype: torch.dtype) -> int:
    """V2's ``get_agrs_num_max_session_bytes``: the session bytes the gathers of ``shapes`` (``[*shape]`` each, of
    ``dtype``, on ``num_ranks`` ranks) take: ``sum(align(num_ranks * numel * itemsize, 32))``."""
    return sum(align_up(num_ranks * math.prod(s) * dtype.itemsize, _ALIGN) for s in _batch(shapes)[1])


def agrs_buffer_size_hint(num_max_session_bytes: int) -> int:
    """V2's ``get_agrs_buffer_size_hint``: ``num_max_session_bytes`` aligned to 2 MiB."""
    return align_up(num_max_session_bytes, SIZE_ALIGN)


class ElasticAGRS:
    """The all-gather session of one ElasticBuffer (module docstring), on its session ``s``; ``num_bytes``: the
    buffer's size (the session area must fit it, as V2's)."""

    def __init__(self, session: Session, num_bytes: int) -> None:
        self.s, self.num_bytes = session, num_bytes
        self.area: torch.Tensor | None = None  # uint8 [num_max_session_bytes] once configured
        self.max_calls = 0
        self.session, self.in_session = 0, False  # sessions begun so far; whether one is open
        self.offset = self.calls = 0  # the open session's next free byte and all_gather calls so far
        self.works: list[dist.Work] = []  # the open session's gathers

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """Make the session area of ``num_max_session_bytes`` (at most the buffer's ``num_bytes``) for up to
        ``num_max_all_gathers_per_session`` (1..32) gathers a session; collective (V2's includes a barrier)."""
        error = None
        for name, v in (("num_max_session_bytes", num_max_session_bytes),
                        ("num_max_all_gathers_per_session", num_max_all_gathers_per_session)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                error = error or f"{name} must be a positive int, got {v!r}"
        if self.s.group_size < 2:
            error = "the all-gather session needs a group of two ranks or more (as DeepEP's)"
        elif error is None and num_max_session_bytes > self.num_bytes:
            error = f"num_max_session_bytes={num_max_session_bytes} exceeds the buffer's num_bytes={self.num_bytes}"
        elif error is None and num_max_all_gathers_per_session > MAX_PER_SESSION:
            error = f"num_max_all_gathers_per_session={num_max_all_gathers_per_session} exceeds {MAX_PER_SESSION}"
        elif error is None and self.in_session:
            error = "called inside an all-gather session; destroy it first"
        ok = error is None
        fields: list[tuple[str, FieldValue]] = [
            ("num_max_session_bytes", num_max_session_bytes if ok else None),
            ("num_max_all_gathers_per_session", num_max_all_gathers_per_session if ok else None),
        ]
        self.s.agree("agrs_set_config", f"agrs_set_config: {error}" if error else None, fields)
        device = torch.device("cuda", torch.cuda.current_device()) if self.s.nccl else torch.device("cpu")
        self.area = None  # the old area first: both at once may not fit
        self.area = torch.empty(align_up(num_max_session_bytes, _ALIGN), dtype=torch.uint8, device=device)
        self.max_calls = num_max_all_gathers_per_session

    def create_agrs_session(self) -> None:
        """Open a session (this rank's; pair it with :meth:`destroy_agrs_session`): the area is handed out afresh."""
        if self.in_session:
            raise ValueError("create_agrs_session: a session is already open; destroy_agrs_session first")
        self.session, self.in_session, self.offset, self.calls, self.works = self.session + 1, True, 0, 0, []

    def destroy_agrs_session(self) -> None:
        """Close the session (collective): waits for its gathers, then for every rank to close it."""
        error = None if self.in_session else "destroy_agrs_session: no session is open"
        if error is None:
            for work in self.works:
                self._wait(work, "destroy_agrs_session")
        self.s.agree("destroy_agrs_session", error, [("session", self.session if error is None else None)])
        self.in_session, self.works = False, []

    @contextlib.contextmanager
    def agrs_new_session(self, enabled: bool = True) -> Iterator[None]:
        """``create_agrs_session`` ... ``destroy_agrs_session`` around the block; nothing when not ``enabled``."""
        if not enabled:
            yield
            return
        self.create_agrs_session()
        try:
            yield
        finally:
            self.destroy_agrs_session()

    def agrs_get_inplace_tensor(self, shapes: Shapes, dtype: torch.dtype) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """This rank's part of the area for the next ``all_gather`` of tensors of ``shapes`` and ``dtype``: one
        tensor ``[*shape]`` for one shape, a tuple for a sequence of shapes (batched). Inside a session."""
        batched, seq = _batch(shapes)
        error = self._room([math.prod(s) * dtype.itemsize for s in seq])
        if error is not None:
            raise ValueError(f"agrs_get_inplace_tensor: {error}")
        assert self.area is not None
        out, offset = [], self.offset
        for s in seq:
            nbytes = math.prod(s) * dtype.itemsize
            mine = self.area[offset + nbytes * self.s.rank : offset + nbytes * (self.s.rank + 1)]
            out.append(mine.view(dtype).view(s))
            offset += align_up(nbytes * self.s.group_size, _ALIGN)
        return tuple(out) if batched else out[0]

    def all_gather(self, t: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor | Callable[[], None], ...]:
        """Gather ``t`` (one contiguous tensor ``[*shape]``, or a sequence of them) from every rank: ``(gathered,
        handle)``, or ``(*gathered, handle)`` for a sequence; ``gathered`` is ``[W, *shape]`` of ``t``'s dtype, rank
        ``r``'s tensor at ``[r]``, a view of the session area; ``handle()`` waits until the data are there.
        Collective, inside a session."""
        tensors = [t] if isinstance(t, torch.Tensor) else list(t)
        error = self._gather_error(tensors)
        sizes = [x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0 for x in tensors]
        fields: list[tuple[str, FieldValue]] = [
            ("session", self.session if self.in_session else None), ("all_gather in the session", self.calls),
            ("tensors", len(tensors)), ("bytes", sum(sizes)),
            ("bytes by position", sum((i + 1) * b for i, b in enumerate(sizes))),
        ]  # fmt: skip
        self.s.agree("all_gather", f"all_gather: {error}" if error else None, fields)
        outs, works = self._start(tensors, sizes)
        session = self.session

        def handle() -> None:
            if not (self.in_session and self.session == session):
                raise RuntimeError(f"an all_gather handle of AGRS session {session} was called after it ended")
            for work in works:
                self._wait(work, "all_gather")

        return (outs[0], handle) if isinstance(t, torch.Tensor) else (*outs, handle)

    def _start(self, tensors: list[torch.Tensor], sizes: list[int]) -> tuple[list[torch.Tensor], list[dist.Work]]:
        """Start the gathers of an agreed call into the area (asynchronous): the views and the works."""
        assert self.area is not None
        outs, works, w = [], [], self.s.group_size
        for x, nbytes in zip(tensors, sizes, strict=True):
            region = self.area[self.offset : self.offset + nbytes * w]
            src = x.reshape(-1).view(torch.uint8)
            if self._inplace(x) and not self.s.nccl:
                src = src.clone()  # gloo's all-gather may not read and write one buffer; NCCL's may
            if nbytes:
                works.append(all_gather_into(region, src, group=self.s.group, async_op=True))
            outs.append(region.view(x.dtype).view(w, *x.shape))
            self.offset += align_up(nbytes * w, _ALIGN)
        self.calls += 1
        self.works += works
        return outs, works

    def _room(self, sizes: list[int]) -> str | None:
        """Why tensors of ``sizes`` bytes do not fit the open session's next call (None: they fit)."""
        if self.area is None:
            return "call agrs_set_config first"
        if not self.in_session:
            return "no session is open (create_agrs_session, or agrs_new_session)"
        if self.calls >= self.max_calls:
            return f"the session has had its {self.max_calls} all_gather calls (num_max_all_gathers_per_session)"
        end = self.offset + sum(align_up(b * self.s.group_size, _ALIGN) for b in sizes)
        if end > self.area.numel():
            return (
                f"the session needs {end} bytes with this call; num_max_session_bytes is {self.area.numel()} "
                "(did you forget to end the session?)"
            )
        return None

    def _gather_error(self, tensors: list[torch.Tensor]) -> str | None:
        """This rank's checks of an ``all_gather`` (None: fine)."""
        if not tensors:
            return "nothing to gather (an empty sequence)"
        for i, x in enumerate(tensors):
            if not isinstance(x, torch.Tensor) or not x.is_contiguous():
                return f"tensor {i} must be a contiguous tensor, got {type(x).__name__}"
            if self.area is not None and x.device != self.area.device:
                return f"tensor {i} is on {x.device}; the session area is on {self.area.device}"
        error = self._room([x.numel() * x.element_size() for x in tensors])
        offset = self.offset
        for i, x in enumerate(tensors):
            nbytes = x.numel() * x.element_size()
            if error is None and self._inplace(x) and x.data_ptr() != self._slot(offset, nbytes):
                return f"tensor {i} lies in the session area but not where agrs_get_inplace_tensor put it"
            offset += align_up(nbytes * self.s.group_size, _ALIGN)
        return error

    def _inplace(self, x: torch.Tensor) -> bool:
        """Whether ``x`` lies in the session area (an ``agrs_get_inplace_tensor`` view)."""
        if self.area is None or x.device != self.area.device:
            return False
        return 0 <= x.data_ptr() - self.area.data_ptr() < self.area.numel()

    def _slot(self, offset: int, nbytes: int) -> int:
        assert self.area is not None
        return self.area.data_ptr() + offset + nbytes * self.s.rank

    def _wait(self, work: dist.Work, fn: str) -> None:
        """Wait for a gather: the buffer's timeout naming the silent ranks (gloo), stream-ordered (NCCL)."""
        if self.s.nccl:
            work.wait()
        else:
            self.s.agreement.wait(work, fn, self.s.timeout)

    def close(self) -> None:
        """Drop the area and the open session (the buffer's destroy)."""
        self.area, self.in_session, self.works = None, False, []
