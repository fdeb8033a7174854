"""What a normal-mode dispatch hands back for its combine (and for a cached dispatch): the routing every path
keeps, plus the state of the path that made it, typed (:class:`HierRoute`, :class:`DeviceRoute`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, NoReturn

import torch

__all__ = ["DeviceRoute", "DispatchHandle", "DispatchResult", "HierRoute", "Rows"]


@dataclass
class HierRoute:
    """What a rank of a hierarchical buffer forwarded and sent in one dispatch. ``host_tokens``: per host, the
    source tokens sent there, in their rail message's order; ``in_host`` ``[T, N]`` bool; ``rail_counts``: rows
    received from each rail peer; ``hit``: per rail peer, ``[rows, P]`` bool, which ranks of this host got each
    row; ``tok_order``: per rail peer, its message's rows in token order (None: the message was in token order)."""

    in_host: torch.Tensor | None = None
    host_tokens: list[torch.Tensor] = field(default_factory=list)
    rail_counts: list[int] = field(default_factory=list)
    hit: list[torch.Tensor | None] = field(default_factory=list)
    tok_order: list[torch.Tensor | None] = field(default_factory=list)

    def hits(self) -> list[torch.Tensor]:
        """``hit`` once every rail peer's is known (after the dispatch's forwarding: a combine, a cached dispatch)."""
        hits = [h for h in self.hit if h is not None]
        assert len(hits) == len(self.hit), "a rail peer's hit is not known yet"
        return hits


@dataclass
class DeviceRoute:
    """A dispatch on the device kernels, on the device: ``lay`` the layout words ``notify`` wrote, ``idx`` the
    routing, ``rows`` / ``expanded`` the rows received and expanded (-1 for a worst-case dispatch, whose host never
    read them: the kernels read them from ``lay``), ``aligned`` the per-expert counts dispatch returned (a device
    tensor for a worst-case dispatch), ``send_pos`` ``[T, W]`` where each token went, ``m`` the expanded rows'
    expert ids (``m_indices``), ``num_sms`` the programs its launches ran (the layout's chunks depend on them)."""

    lay: torch.Tensor
    idx: torch.Tensor
    rows: int
    expanded: int
    aligned: list[int] | torch.Tensor
    send_pos: torch.Tensor | None = None
    m: torch.Tensor | None = None
    num_sms: int | None = None  # the dispatch's programs per launch (None: the buffer's): its layout's chunks


@dataclass
class DispatchHandle:
    """State that combine (and a cached dispatch) needs. Returned by :meth:`EPBuffer.dispatch`."""

    send_tokens: list[torch.Tensor]  # per destination rank: source token indices, ascending
    recv_counts: list[int]  # rows received from each source rank
    num_tokens: int
    recv_topk_idx: torch.Tensor  # [R, K] local ids
    recv_topk_weights: torch.Tensor  # [R, K] float32
    expand: bool
    expert_alignment: int
    expanded_rows: torch.Tensor | None  # [X] received row per expanded row, -1 = padding
    expanded_slot: torch.Tensor | None  # [R, K] expanded row of (j, k), -1 if not local
    device: torch.device = torch.device("cpu")  # where the rows live (the metadata above is on the CPU)
    buffer_id: int = 0  # the EPBuffer's SymmBuffer.buffer_id: a handle is only valid on the buffer that made it
    epoch: int = 0  # which normal dispatch of that buffer made it (1 for the first)
    hier: HierRoute | None = None  # a hierarchical buffer's routing
    kernel_state: DeviceRoute | None = None  # the device kernels' layout, routing and row maps
    worst: tuple[int, int] | None = None  # a worst-case dispatch's (rows, expanded rows) (``ep/worst.py``)

    def __getattr__(self, name: str) -> NoReturn:
        if name in ("current_stream_wait", "wait", "event", "register_hook_after_wait"):
            raise AttributeError(
                f"DispatchHandle has no {name!r}: this is the handle, not an event. EPBuffer.dispatch returns (recv_x, "
                "recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, handle); for DeepEP V2's (recv_x, "
                "recv_topk_idx, recv_topk_weights, handle, event) use epkit.compat.deep_ep.ElasticBuffer"
            )
        raise AttributeError(f"'DispatchHandle' object has no attribute {name!r}")


#: Rows as a normal dispatch returns them: ``x``, or ``(x, scales)`` for FP8 rows.
Rows = torch.Tensor | tuple[torch.Tensor, ...]


class DispatchResult(NamedTuple):
    """What a normal dispatch returns (a tuple: unpack it, or read the fields by name). Its fourth value is the
    per-expert count list and its fifth the handle; code written for DeepEP V2's five values (``recv_x,
    recv_topk_idx, recv_topk_weights, handle, event``) would take the list for the handle: the handle then refuses
    to be used as an event, and combine refuses a list, each saying so."""

    recv_x: Rows
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    num_recv_tokens_per_expert: list[int] | torch.Tensor  # a [L] int32 tensor for a worst-case dispatch
    handle: DispatchHandle
