"""DeepEP V2's pipeline-parallel send and receive (``ElasticBuffer.pp_set_config`` / ``pp_send`` / ``pp_recv``) for
``epkit.compat.deep_ep``, over the group's point-to-point ``isend`` / ``irecv``.

V2 arranges the group's ranks in a ring: rank ``r`` sends to and receives from its previous ``(r - 1) % W`` and next
``(r + 1) % W`` rank only (group positions, V2's ``rank_idx``). Each (sender, receiver) pair is a queue: the ``i``-th
tensor ``r`` sends to ``d`` is the one ``d``'s ``i``-th receive from ``r`` gets. A send copies the tensor and returns
(the caller may reuse it); at most ``num_max_inflight_tensors`` sends to one rank are in flight (not yet taken by
its receive), and a further send first waits for the oldest, as V2's waits for a free slot. A receive waits until its
tensor has come. Each tensor travels as a one-word header (its byte count) and its bytes, so a receive of another
size is a ValueError on the receiving rank (and its queue stays in step). ``pp_set_config`` is collective (V2's
includes a barrier): the same ValueError on every rank for a bad configuration. ``pp_send`` / ``pp_recv`` are
point-to-point: their errors are the calling rank's.

Every wait has the buffer's timeout (``num_cpu_timeout_secs``) and its TimeoutError names the global rank that sent
nothing (or took nothing). On an NCCL group the tensors are CUDA tensors and the waits NCCL's own (stream-ordered;
a receive reads the header's byte count on the host).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from epkit.collectives.ep.rows import align_up
from epkit.collectives.transports.base import rank_name
from epkit.compat._details.deep_ep_agreement import FieldValue
from epkit.compat._details.deep_ep_config import SIZE_ALIGN

if TYPE_CHECKING:
    from epkit.compat._details.deep_ep_session import Session

__all__ = ["ElasticPP", "pp_buffer_size_hint"]

#: The tag of the pipeline's messages on the group (gloo matches a receive by source and tag).
_TAG = 0x5050
#: V2's alignment of one tensor's slot.
_SLOT_ALIGN = 32


def pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
    """V2's ``get_pp_buffer_size_hint``: bytes (2 MiB aligned) for ``num_max_inflight_tensors`` slots of
    ``num_max_tensor_bytes`` (32-byte aligned) in each direction (send, receive) to each ring neighbour (prev, next)."""
    slot = align_up(num_max_tensor_bytes, _SLOT_ALIGN)
    return align_up(slot * num_max_inflight_tensors * 2 * 2, SIZE_ALIGN)


def _positive(name: str, v: object) -> str | None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        return f"{name} must be a positive int, got {v!r}"
    return None


class ElasticPP:
    """The pipeline send/receive of one ElasticBuffer (module docstring), on its session ``s``; ``num_bytes``: the
    buffer's size (the slots must fit it, as V2's)."""

    def __init__(self, session: Session, num_bytes: int) -> None:
        self.s, self.num_bytes = session, num_bytes
        self.num_max_tensor_bytes = self.num_max_inflight_tensors = 0
        self.ring: tuple[int, ...] = ()  # (prev, next) group positions once configured
        self.sending: dict[int, deque[list[dist.Work]]] = {}  # destination -> its sends in flight, oldest first
        self.to_self: deque[torch.Tensor] = deque()  # a group of one: prev and next are this rank

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Set the largest tensor (bytes) and the sends in flight per destination (collective, like V2's barrier:
        every rank passes the same values; a bad value on one rank is the same ValueError on every rank).
        ``num_max_tensor_bytes * num_max_inflight_tensors * 4`` must fit the buffer's ``num_bytes``."""
        error = _positive("num_max_tensor_bytes", num_max_tensor_bytes) or _positive(
            "num_max_inflight_tensors", num_max_inflight_tensors
        )
        if error is None and num_max_tensor_bytes * num_max_inflight_tensors * 4 > self.num_bytes:
            error = (
                f"{num_max_inflight_tensors} tensors of {num_max_tensor_bytes} bytes to and from both ring neighbours "
                f"need {num_max_tensor_bytes * num_max_inflight_tensors * 4} bytes; the buffer has num_bytes="
                f"{self.num_bytes} (see get_pp_buffer_size_hint)"
            )
        ok = error is None
        fields: list[tuple[str, FieldValue]] = [
            ("num_max_tensor_bytes", num_max_tensor_bytes if ok else None),
            ("num_max_inflight_tensors", num_max_inflight_tensors if ok else None),
        ]
        self.s.agree("pp_set_config", f"pp_set_config: {error}" if error else None, fields)
        w, r = self.s.group_size, self.s.rank
        self.ring = ((r - 1) % w, (r + 1) % w)
        self.num_max_tensor_bytes = align_up(num_max_tensor_bytes, _SLOT_ALIGN)
        self.num_max_inflight_tensors = num_max_inflight_tensors

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """Send ``t`` (any shape and dtype, contiguous, at most ``num_max_tensor_bytes``) to ``dst_rank_idx``, the
        previous or next rank of the ring; returns once it is copied (first waiting for the oldest send to that rank
        when ``num_max_inflight_tensors`` are in flight). ``num_sms``: accepted, no effect."""
        self._check("pp_send", t, dst_rank_idx, "dst_rank_idx")
        data = t.detach().clone().reshape(-1).view(torch.uint8)
        if dst_rank_idx == self.s.rank:
            self.to_self.append(data)
            return
        queue = self.sending.setdefault(dst_rank_idx, deque())
        while len(queue) >= self.num_max_inflight_tensors:
            for work in queue.popleft():
                self._wait(work, "pp_send", dst_rank_idx, "take the tensor (call pp_recv)")
        head = torch.tensor([data.numel()], dtype=torch.int64, device=data.device)
        queue.append([self._post(dist.isend, part, dst_rank_idx) for part in (head, data) if part.numel()])

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """Receive into ``t`` (contiguous, at most ``num_max_tensor_bytes``) the next tensor ``src_rank_idx`` (the
        previous or next rank of the ring) sent to this rank; waits until it has come. A tensor of another byte size
        is taken off the queue and a ValueError says both sizes. ``num_sms``: accepted, no effect."""
        self._check("pp_recv", t, src_rank_idx, "src_rank_idx")
        mine = t.reshape(-1).view(torch.uint8)
        if src_rank_idx == self.s.rank:
            if not self.to_self:
                raise ValueError("pp_recv: this rank (a group of one) has sent itself nothing to receive")
            got = self.to_self.popleft()
        else:
            head = torch.empty(1, dtype=torch.int64, device=t.device)
            self._wait(self._post(dist.irecv, head, src_rank_idx), "pp_recv", src_rank_idx, "send a tensor")
            size = int(head.item())
            got = mine if size == mine.numel() else torch.empty(size, dtype=torch.uint8, device=t.device)
            if size:
                self._wait(self._post(dist.irecv, got, src_rank_idx), "pp_recv", src_rank_idx, "send its bytes")
        if got.numel() != mine.numel():
            raise ValueError(
                f"pp_recv: {rank_name(src_rank_idx, self.s.agreement.global_ranks)} sent a tensor of {got.numel()} "
                f"bytes; the receiving tensor has {mine.numel()} (it was taken off the queue)"
            )
        if got is not mine:
            mine.copy_(got)

    def _check(self, fn: str, t: object, peer: object, name: str) -> None:
        """This rank's checks of a send or receive (V2's: configured, contiguous, fits, a ring neighbour)."""
        if not self.ring:
            raise ValueError(f"{fn}: call pp_set_config first")
        if not isinstance(t, torch.Tensor) or not t.is_contiguous():
            raise ValueError(f"{fn}: t must be a contiguous tensor, got {type(t).__name__}")
        if t.numel() * t.element_size() > self.num_max_tensor_bytes:
            raise ValueError(
                f"{fn}: t has {t.numel() * t.element_size()} bytes; pp_set_config allows "
                f"{self.num_max_tensor_bytes} (num_max_tensor_bytes, 32-byte aligned)"
            )
        if isinstance(peer, bool) or not isinstance(peer, int) or peer not in self.ring:
            raise ValueError(
                f"{fn}: {name}={peer!r} is not a ring neighbour of rank index {self.s.rank} (previous "
                f"{self.ring[0]}, next {self.ring[1]})"
            )

    def _post(self, op: Callable[..., dist.Work | None], t: torch.Tensor, peer: int) -> dist.Work:
        """``op`` (``dist.isend`` / ``dist.irecv``) of ``t`` with ``peer`` (a group position) on the pipeline's tag."""
        work = op(t, self.s.agreement.global_ranks[peer], group=self.s.group, tag=_TAG)
        assert work is not None  # None only on a rank outside the group
        return work

    def _wait(self, work: dist.Work, fn: str, peer: int, what: str) -> None:
        """Wait for a point-to-point ``work`` with ``peer`` (a group position): up to the buffer's timeout on a
        gloo group (the TimeoutError names ``peer``'s global rank), stream-ordered on an NCCL group."""
        if self.s.nccl:
            work.wait()
            return
        try:
            work.wait(timedelta(seconds=self.s.timeout))
        except RuntimeError as exc:  # gloo: a timeout, or the connection to the peer closed
            who = self.s.agreement.global_ranks
            text = str(exc).strip().splitlines()[0][:200]
            why = f"did not {what} within {self.s.timeout:g} s" if "timed out" in text.lower() else f"is gone ({text})"
            raise TimeoutError(
                f"{rank_name(self.s.rank, who)}: {fn}: {rank_name(peer, who)} {why}; it died, or stopped calling"
            ) from None

    def close(self) -> None:
        """Forget the sends in flight and the configuration (the buffer's destroy)."""
        self.sending.clear()
        self.to_self.clear()
        self.ring = ()
