"""DeepEP's normal-mode calls of ``epkit.compat.deep_ep.Buffer`` (``get_dispatch_layout``, ``dispatch`` with and
without top-k or a handle, ``combine``) over EPBuffer's normal mode.

Every call that moves rows first runs its checks into one agreement of the buffer's session (a rank never raises
alone: the same ``ValueError`` on every rank, before any row moves), then picks or makes the EPBuffer. A dispatch
also gathers every rank's routing (one small all-gather) for DeepEP's handle (``deep_ep_handles``), and, without
top-k, for the per-expert counts DeepEP returns: the senders' ``num_tokens_per_expert``, summed.

A dispatch with ``num_worst_tokens`` inside one domain is EPBuffer's worst-case dispatch, its routing ``topk_idx``'s
and its handle tensor ops, with no count read back; on an NCCL group, once an eager call made its EPBuffer, it and
the calls along its handle make no host agreement either (stream-ordered, as the low-latency calls there: a CUDA
graph can capture them); a call one rank rejects is then rejected by the EPBuffer's own call (``reject``): the same
ValueError on every rank, on CUDA at the others' next call, as EPBuffer's worst-case calls report. Any other call
that meets on the host is refused under capture (``refuse_capture_here``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from epkit.collectives.ep_reference import reference_layout
from epkit.collectives.transports.base import rank_name
from epkit.compat._details.deep_ep_agreement import FieldValue, size_of
from epkit.compat._details.deep_ep_config import (
    Config,
    EventOverlap,
    check_config,
    check_events,
    events,
    new_event,
    wait_for,
)
from epkit.compat._details.deep_ep_handles import NormalHandle, in_rank_of, normal_handle
from epkit.compat._details.deep_ep_internode import (
    check_internode_call,
    internode_handle,
    rdma_ranks,
    tokens_per_rdma_rank,
)
from epkit.compat._details.deep_ep_layouts import DeepEPRows, carry_scales, pad_rows, restore_scales
from epkit.compat._details.deep_ep_session import refuse_capture_here
from epkit.utils import check_topk_idx

if TYPE_CHECKING:
    from epkit.collectives.ep.handles import DispatchResult
    from epkit.collectives.ep_buffer import EPBuffer
    from epkit.compat._details.deep_ep_session import Session

__all__ = ["DispatchOutput", "NormalCalls"]

#: What a dispatch returns: ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
#: event)``; a cached dispatch (with a handle) returns only ``recv_x`` and the event, the rest None.
DispatchOutput = tuple[
    DeepEPRows, torch.Tensor | None, torch.Tensor | None, list[int] | None, NormalHandle | None, EventOverlap
]


def _rows(x: DeepEPRows, num_worst_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, scales or None)`` of a dispatch's ``x`` once it and ``num_worst_tokens`` are DeepEP's kinds."""
    x0, scales = x if isinstance(x, tuple) else (x, None)
    if not isinstance(x0, torch.Tensor) or x0.dim() != 2:
        raise ValueError(f"dispatch: x must be a [num_tokens, hidden] tensor or an (x, scales) pair, got {x!r:.60}")
    if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
        raise ValueError(f"dispatch: num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}")
    return x0, scales


def _rows_of(x0: torch.Tensor | None) -> int:
    return x0.shape[0] if x0 is not None else 0


def _dispatch_fields(x: object, topk_idx: object, per_expert: object) -> list[tuple[str, FieldValue]]:
    """What every rank's normal dispatch must share (``CallAgreement``'s fields): read from the arguments as they
    are, None where a rejected call has no such value."""
    x0, scales = x if isinstance(x, tuple) and len(x) == 2 else (x, None)
    tensor = isinstance(x0, torch.Tensor)
    experts = per_expert.numel() if isinstance(per_expert, torch.Tensor) else None
    return [
        ("x hidden size", size_of(x0, 1)),
        ("x dtype", x0.dtype if isinstance(x0, torch.Tensor) else None),
        ("x scales dtype", scales.dtype if isinstance(scales, torch.Tensor) else None),
        ("x scale columns", (size_of(scales, 1) if scales is not None else 0) if tensor else None),
        ("num_experts (num_tokens_per_expert's size)", experts),
        ("topk_idx columns (num_topk)", size_of(topk_idx, 1)),
        ("topk_idx given", int(topk_idx is not None)),
    ]


def _with_scales(recv_x: torch.Tensor, recv_s: torch.Tensor | None, s: int, sdtype: torch.dtype | None) -> DeepEPRows:
    """DeepEP's recv_x: ``recv_x``, or ``(recv_x, scales)`` with the scales in the columns and dtype x's came in."""
    if recv_s is None:
        return recv_x
    assert sdtype is not None  # rows come back with scales only where x carried them (carry_scales set sdtype)
    return recv_x, restore_scales(recv_s, s, sdtype)


def _check_worst(session: Session, in_rank_all: torch.Tensor, num_worst_tokens: int) -> None:
    """Every rank's receive count is known from the gathered routing (``in_rank_all [W, T, W]``): a
    ``num_worst_tokens`` smaller than one is the same ValueError on every rank, before any row moves."""
    if not num_worst_tokens:
        return
    over = [(r, int(n)) for r, n in enumerate(in_rank_all.sum((0, 1)).tolist()) if n > num_worst_tokens]
    if over:
        ranks = session.agreement.global_ranks
        who = "; ".join(f"{rank_name(r, ranks)} receives {n}" for r, n in over)
        raise ValueError(f"dispatch: more rows than num_worst_tokens = {num_worst_tokens} ({who})")


def _layout(topk_idx: torch.Tensor, num_experts: int, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``get_dispatch_layout``'s counts (``reference_layout``'s) by tensor ops on ``topk_idx``'s device, no host
    read: ``(num_tokens_per_rank [W] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool)``; ids
    outside ``[0, num_experts)`` count nowhere."""
    ids = topk_idx.long()
    ok = (ids >= 0) & (ids < num_experts)
    bins = torch.where(ok, ids, num_experts).view(-1)  # the misses to one spare bin
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    per_expert.scatter_add_(0, bins, torch.ones_like(bins, dtype=torch.int32))
    in_rank = in_rank_of(topk_idx, num_experts, w)
    return in_rank.sum(0).to(torch.int32), per_expert[:num_experts], in_rank


def _channels(config: Config | None, default_sms: int) -> int:
    """DeepEP's channels for a call's ``config`` (its SMs over two), which the handle's channel matrices describe."""
    return max((config.num_sms if config is not None else default_sms) // 2, 1)


class NormalCalls:
    """The normal-mode calls of one Buffer, on its session ``s`` (module docstring); ``default_sms``: the SMs of
    a call without ``config`` (reads ``Buffer.num_sms``), for the handle's channels."""

    def __init__(self, session: Session, default_sms: Callable[[], int]) -> None:
        self.s, self.default_sms = session, default_sms

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """``(num_tokens_per_rank [W] int32, num_tokens_per_rdma_rank [W / 8] int32 or None, num_tokens_per_expert
        [E] int32, is_token_in_rank [T, W] bool, event)``, on ``topk_idx``'s device; ``-1`` ids are skipped. The
        per-RDMA-rank counts are DeepEP's internode answer, for a group of more than 8 ranks
        (``deep_ep_internode``); None on 8 ranks or fewer."""
        events("get_dispatch_layout", previous_event, async_finish, allocate_on_comm_stream)
        try:  # the shape and dtype (the values are counted below, -1 skipped)
            check_topk_idx(topk_idx, 0, check_values=False)  # num_experts is read by the value scan only
        except ValueError as exc:
            raise ValueError(f"get_dispatch_layout: {exc}") from None
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts % self.s.group_size:
            raise ValueError(
                f"get_dispatch_layout: num_experts must be a multiple of {self.s.group_size}, got {num_experts!r}"
            )
        per_rank, per_expert, in_rank = _layout(topk_idx, num_experts, self.s.group_size)
        per_rdma = tokens_per_rdma_rank(in_rank) if rdma_ranks(self.s.group_size) > 1 else None
        return per_rank, per_rdma, per_expert, in_rank, new_event(async_finish)

    def dispatch(
        self,
        x: DeepEPRows,
        handle: NormalHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> DispatchOutput:
        """``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``.

        ``x``: bf16 ``[T, hidden]``, or ``(e4m3 [T, hidden], scales [T, S])`` (float32 or int32, ``S <=
        ceil(hidden/128)``, any strides; returned ``[R, S]`` row-major). Rows come ordered by source rank, then
        token; ``recv_topk_idx`` holds local expert ids (-1 elsewhere) and ``recv_topk_weights`` 0 there. The
        per-expert counts are aligned to ``expert_alignment``; with ``num_worst_tokens > 0`` the outputs have that
        many rows (the rest padding: ids -1, weights 0) and the list is empty. With ``handle`` (cached dispatch)
        only ``recv_x`` is returned, the other four values None. On more than 8 ranks this is DeepEP's internode
        dispatch (``deep_ep_internode``: ``num_tokens_per_rdma_rank`` is then required, and the handle has ten
        tensors); ``num_worst_tokens`` pads there too (DeepEP's own Python refuses it on internode buffers).
        """
        return self._dispatch("dispatch", x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                              num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                              config, previous_event, async_finish, allocate_on_comm_stream)  # fmt: skip

    def internode_dispatch(
        self, x: DeepEPRows, handle: NormalHandle | None = None, num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None, is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, config: Config | None = None,
        previous_event: EventOverlap | None = None, async_finish: bool = False, allocate_on_comm_stream: bool = False,
    ) -> DispatchOutput:  # fmt: skip
        """DeepEP's internode dispatch, what :meth:`dispatch` runs on more than 8 ranks (its signature has no
        ``num_worst_tokens``); ``config`` must be given, as DeepEP asserts, and the group must span RDMA ranks."""
        return self._dispatch("internode_dispatch", x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                              is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, 0,
                              config, previous_event, async_finish, allocate_on_comm_stream)  # fmt: skip

    def _dispatch(
        self, fn: str, x: DeepEPRows, handle: NormalHandle | None, num_tokens_per_rank: torch.Tensor | None,
        num_tokens_per_rdma_rank: torch.Tensor | None, is_token_in_rank: torch.Tensor | None,
        num_tokens_per_expert: torch.Tensor | None, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None,
        expert_alignment: int, num_worst_tokens: int, config: Config | None, previous_event: EventOverlap | None,
        async_finish: bool, allocate_on_comm_stream: bool,
    ) -> DispatchOutput:  # fmt: skip
        """:meth:`dispatch` as ``fn`` (``dispatch`` or ``internode_dispatch``) names it."""
        self.s.settle()
        if handle is not None:
            return self._dispatch_cached(
                fn, x, handle, topk_idx, topk_weights, num_worst_tokens, config, previous_event, async_finish,
                allocate_on_comm_stream,
            )  # fmt: skip
        error: str | None = None
        words: torch.Tensor | None = None
        s, sdtype = 0, None
        x0: torch.Tensor | None = None
        # a worst-case dispatch inside one domain reads nothing back: EPBuffer's worst-case call judges it
        worst = bool(num_worst_tokens) and isinstance(num_worst_tokens, int) and rdma_ranks(self.s.group_size) == 1
        try:  # a call rejected on one rank is rejected on every rank (one agreement below)
            check_events(fn, previous_event, async_finish, allocate_on_comm_stream)
            check_config(fn, config)
            check_internode_call(fn, config, self.s.group_size)
            x0, scales = _rows(x, num_worst_tokens)
            self._check_layout(topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                               num_tokens_per_expert, x0.shape[0], not worst)  # fmt: skip
            if scales is not None:
                words, s, sdtype = carry_scales(scales, x0.shape[0], x0.shape[1])
        except ValueError as exc:
            error = str(exc)
        tokens = self._meet(fn, error, x, x0, topk_idx, num_tokens_per_expert, worst, num_worst_tokens)
        wait_for(previous_event)
        # the agreement raised unless every check passed on every rank: x and the routing arguments are all given
        assert x0 is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        num_experts = num_tokens_per_expert.numel()
        if worst:
            rows_in = (x0, words) if words is not None else x0
            got_x, got_s, got_idx, got_w, normal = self._dispatch_worst(
                rows_in, is_token_in_rank, num_experts, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                config, tokens,
            )  # fmt: skip
            return _with_scales(got_x, got_s, s, sdtype), got_idx, got_w, [], normal, new_event(async_finish)
        routes = self.s.routes("dispatch", is_token_in_rank, num_tokens_per_expert, tokens)
        _check_worst(self.s, routes[0], num_worst_tokens)
        with_topk = topk_idx is not None
        if topk_idx is None:  # route by is_token_in_rank: each token once to each of its ranks (their expert 0)
            first = torch.arange(self.s.group_size, device=x0.device) * (num_experts // self.s.group_size)
            topk_idx = torch.where(is_token_in_rank, first, -1)
        buf = self.s.epbuffer(x0.shape[1], num_experts, topk_idx.shape[1], x0.device, tokens)
        rows = (x0, words) if words is not None else x0
        recv_rows, recv_idx, recv_w, counts, h = buf.dispatch(rows, topk_idx, topk_weights, expert_alignment)
        assert isinstance(counts, list)  # a plain dispatch's (the shim pads the worst case itself)
        recv_x, recv_s = recv_rows if isinstance(recv_rows, tuple) else (recv_rows, None)
        channels = _channels(config, self.default_sms())
        make = internode_handle if rdma_ranks(self.s.group_size) > 1 else normal_handle
        tensors = make(routes[0], routes[1], self.s.rank, channels, is_token_in_rank)
        out = NormalHandle(tensors, buf, h, topk_idx.shape[1] if with_topk else None)
        if not with_topk:  # DeepEP: no top-k out; the counts are the sources' num_tokens_per_expert, summed
            counts = self._summed_counts(routes[2], num_experts, expert_alignment)
            recv_idx_out: torch.Tensor | None = None
            recv_w_out: torch.Tensor | None = None
        else:
            recv_w = torch.where(recv_idx >= 0, recv_w, torch.zeros_like(recv_w))  # DeepEP: 0 for another rank's
            recv_idx_out, recv_w_out = recv_idx, recv_w
        if num_worst_tokens:
            n = num_worst_tokens
            recv_x, recv_s = pad_rows(recv_x, n, 0), pad_rows(recv_s, n, 0)
            recv_idx_out, recv_w_out, counts = pad_rows(recv_idx_out, n, -1), pad_rows(recv_w_out, n, 0), []
        return _with_scales(recv_x, recv_s, s, sdtype), recv_idx_out, recv_w_out, counts, out, new_event(async_finish)

    def _meet(
        self, fn: str, error: str | None, x: DeepEPRows, x0: torch.Tensor | None, topk_idx: object,
        per_expert: object, worst: bool, num_worst_tokens: int,
    ) -> int:  # fmt: skip
        """A dispatch's meeting with the other ranks, before any row moves: the call's agreement (the largest token
        count of any rank, or the same ValueError on every rank), or, for a stream-ordered call (an NCCL group's
        worst-case one, :meth:`_stream_ordered`), none: its buffer's capacity, and a rejection of this rank's
        carried by the EPBuffer's own call (``reject``) to every rank, as an agreement would have."""
        ordered = self._stream_ordered(worst, x, topk_idx, per_expert)
        if ordered is None:
            refuse_capture_here(fn)
            # internode_dispatch is the call dispatch makes on RDMA ranks: one kind of call for the agreement
            return self.s.agree("dispatch", error, _dispatch_fields(x, topk_idx, per_expert), _rows_of(x0))
        tokens = int(ordered.num_max_tokens_per_rank)
        if error is None and x0 is not None and x0.shape[0] > tokens:
            error = f"dispatch: {x0.shape[0]} tokens, more than the {tokens} the Buffer's eager calls made room for"
        if error is not None:
            self.s.reject_worst_dispatch(ordered, error, tokens, num_worst_tokens)
        return tokens

    def _stream_ordered(self, worst: bool, x: object, topk_idx: object, per_expert: object) -> EPBuffer | None:
        """The EPBuffer a worst-case dispatch runs on with no host agreement: on an NCCL group (as the low-latency
        calls there), once an eager call made the session's buffer for its shapes; None where the call agrees on
        the host. From the arguments' shapes alone, whatever this rank's checks found: every rank decides alike,
        as its shapes are the same (DeepEP's contract; the agreement checks them on the calls that make it)."""
        x0 = x[0] if isinstance(x, tuple) and len(x) == 2 else x
        if not (worst and self.s.nccl) or not isinstance(x0, torch.Tensor) or x0.dim() != 2:
            return None
        if not isinstance(per_expert, torch.Tensor):
            return None
        k = topk_idx.shape[1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else self.s.group_size
        return self.s.current.get((x0.shape[1], per_expert.numel(), k))

    def _ordered_handle(self, handle: object) -> bool:
        """Whether a combine or cached dispatch along ``handle`` is stream-ordered (no host agreement): on an NCCL
        group, after a worst-case dispatch of this Buffer inside one domain."""
        if not self.s.nccl or not isinstance(handle, NormalHandle) or self.s.index_of(handle) is None:
            return False
        return handle.handle.worst is not None

    def _dispatch_worst(
        self, rows: DeepEPRows, is_token_in_rank: torch.Tensor, num_experts: int, topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None, alignment: int, num_worst_tokens: int, config: Config | None, tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, NormalHandle]:  # fmt: skip
        """A dispatch with ``num_worst_tokens`` inside one domain, with no host read (the call's agreement is the
        host's own values): EPBuffer's worst-case dispatch (on the device kernels it judges every rank's call on the
        device, ``EPBuffer.dispatch``), the routing (from ``topk_idx``, or ``is_token_in_rank`` without top-k) and the
        handle by tensor ops. ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, handle)``, padded to
        ``num_worst_tokens`` rows."""
        w, me = self.s.group_size, self.s.rank
        x0 = rows[0] if isinstance(rows, tuple) else rows
        local = num_experts // w
        with_topk = topk_idx is not None
        if topk_idx is not None:  # the routing the rows take (the layout's values are not read: no host read)
            in_rank = in_rank_of(topk_idx, num_experts, w)
        else:  # each token once to each of its ranks (their expert 0)
            in_rank = is_token_in_rank
            topk_idx = torch.where(in_rank, torch.arange(w, device=x0.device) * local, -1)
        in_rank_all, per_rank = self.s.device_routes("dispatch", in_rank, tokens)
        buf = self.s.epbuffer(x0.shape[1], num_experts, topk_idx.shape[1], x0.device, tokens)
        recv_rows, recv_idx, recv_w, _, h = buf.dispatch(
            rows, topk_idx, topk_weights, alignment, num_worst_tokens=num_worst_tokens
        )
        recv_x, recv_s = recv_rows if isinstance(recv_rows, tuple) else (recv_rows, None)
        channels = _channels(config, self.default_sms())
        tensors = normal_handle(in_rank_all, per_rank, me, channels, in_rank, num_rows=num_worst_tokens)
        handle = NormalHandle(tensors, buf, h, topk_idx.shape[1] if with_topk else None)
        if not with_topk:
            return recv_x, recv_s, None, None, handle
        recv_w = torch.where(recv_idx >= 0, recv_w, torch.zeros_like(recv_w))  # DeepEP: 0 for another rank's
        return recv_x, recv_s, recv_idx, recv_w, handle

    def _summed_counts(self, per_expert_all: torch.Tensor, num_experts: int, alignment: int) -> list[int]:
        """A dispatch without top-k's per-expert counts (DeepEP's): the senders' ``num_tokens_per_expert``
        (``per_expert_all [W, E]``) summed over this rank's experts, aligned up."""
        local = num_experts // self.s.group_size
        summed = per_expert_all[:, self.s.rank * local : (self.s.rank + 1) * local].sum(0)
        return [-(-int(c) // alignment) * alignment for c in summed.tolist()]

    def _check_layout(
        self,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        per_rank: torch.Tensor | None,
        per_rdma_rank: torch.Tensor | None,
        in_rank: torch.Tensor | None,
        per_expert: torch.Tensor | None,
        num_tokens: int,
        values: bool = True,
    ) -> None:
        """A non-cached dispatch's routing arguments: the layout given, and ``topk_idx``'s when top-k is given (a
        dispatch without top-k routes each token to the ranks ``is_token_in_rank`` names). ``values=False`` (a
        worst-case dispatch, which reads nothing back): shapes and dtypes only; the routing then comes from
        ``topk_idx`` alone and EPBuffer judges the expert ids."""
        w, domains = self.s.group_size, rdma_ranks(self.s.group_size)
        if domains == 1 and per_rdma_rank is not None:
            raise ValueError(
                f"dispatch: num_tokens_per_rdma_rank must be None on {w} ranks (one NVLink domain: DeepEP's intranode "
                "mode; pass what get_dispatch_layout returned)"
            )
        missing = [n for n, v in (("num_tokens_per_rank", per_rank), ("is_token_in_rank", in_rank),
                                  ("num_tokens_per_expert", per_expert)) if v is None]  # fmt: skip
        if domains > 1 and per_rdma_rank is None:
            missing.append("num_tokens_per_rdma_rank (internode)")
        if missing:
            raise ValueError(
                f"dispatch: {', '.join(missing)} must be given (from get_dispatch_layout) without a handle"
            )
        assert per_rank is not None and in_rank is not None and per_expert is not None  # none is missing
        for name, t, shape, dtypes in (
            ("num_tokens_per_rank", per_rank, (w,), (torch.int32, torch.int64)),
            ("is_token_in_rank", in_rank, (num_tokens, w), (torch.bool,)),
            ("num_tokens_per_expert", per_expert, None, (torch.int32, torch.int64)),
            *(
                [("num_tokens_per_rdma_rank", per_rdma_rank, (domains,), (torch.int32, torch.int64))]
                if per_rdma_rank is not None
                else []
            ),  # given only on RDMA ranks (checked above)
        ):
            if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or (shape is not None and t.shape != shape):
                want = f"{list(shape) if shape is not None else '[num_experts]'} {' or '.join(map(str, dtypes))}"
                raise ValueError(f"dispatch: {name} must be {want}, got {t!r:.60}")
        if per_expert.dim() != 1 or per_expert.numel() % w or per_expert.numel() == 0:
            raise ValueError(
                f"dispatch: num_tokens_per_expert has {per_expert.numel()} experts, not a positive multiple of the "
                f"{w} ranks"
            )
        if per_rdma_rank is not None and not torch.equal(
            tokens_per_rdma_rank(in_rank.cpu()), per_rdma_rank.cpu().to(torch.int32)
        ):  # given only on RDMA ranks (checked above)
            raise ValueError(
                "dispatch: num_tokens_per_rdma_rank is not is_token_in_rank's count of tokens per RDMA rank (8 ranks)"
            )
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("dispatch: topk_idx and topk_weights must both be given, or both None (no top-k)")
        if topk_idx is None:
            if values and not torch.equal(in_rank.sum(0).cpu(), per_rank.cpu().to(torch.int64)):
                raise ValueError("dispatch: num_tokens_per_rank is not is_token_in_rank's count of tokens per rank")
            return
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
            raise ValueError(f"dispatch: topk_idx must be [num_tokens = {num_tokens}, num_topk], got {topk_idx!r:.60}")
        check_topk_idx(topk_idx, per_expert.numel(), check_values=values)
        if not values:
            return
        want = reference_layout(topk_idx.cpu(), per_expert.numel(), w)  # get_dispatch_layout's answer
        for name, got, ref in zip(("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"),
                                  (per_rank, per_expert, in_rank), want):  # fmt: skip
            if got.shape != ref.shape or not torch.equal(got.cpu().to(ref.dtype), ref):
                raise ValueError(
                    f"dispatch: {name} does not match topk_idx's layout (pass what get_dispatch_layout returned for it)"
                )

    def _dispatch_cached(
        self,
        caller: str,
        x: DeepEPRows,
        handle: NormalHandle,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        num_worst_tokens: int,
        config: Config | None,
        previous_event: EventOverlap | None,
        async_finish: bool,
        allocate_on_comm_stream: bool,
    ) -> DispatchOutput:
        """A dispatch along ``handle``'s routing (``caller``: ``dispatch`` or ``internode_dispatch``): every check in
        the call's agreement, which also holds every rank to the same handle (the same buffer's same dispatch), so
        no rank enters another exchange."""
        fn = "cached dispatch"
        error: str | None = None
        words: torch.Tensor | None = None
        s, sdtype = 0, None
        x0: torch.Tensor | None = None
        try:
            check_events(caller, previous_event, async_finish, allocate_on_comm_stream)
            check_config(caller, config)
            check_internode_call(caller, config, self.s.group_size)
            x0, scales = _rows(x, num_worst_tokens)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("dispatch: with a handle (cached dispatch), topk_idx and topk_weights must be None")
            self._check_handle("dispatch", handle)
            if scales is not None:
                words, s, sdtype = carry_scales(scales, x0.shape[0], x0.shape[1])
        except ValueError as exc:
            error = str(exc)
        if self._ordered_handle(handle):
            if error is not None:  # rejected on every rank by the EPBuffer's call, as an agreement would have
                h = handle.handle
                handle.buffer.dispatch(torch.zeros((h.num_tokens, handle.buffer.hidden), dtype=torch.bfloat16,
                                                   device=handle.buffer.device), handle=h, reject=error)  # fmt: skip
                raise ValueError(error)
        else:
            refuse_capture_here(caller)
            self.s.agree(fn, error, self.s.handle_fields(handle) + _dispatch_fields(x, None, None)[:4])
        wait_for(previous_event)
        assert x0 is not None  # the agreement raised unless every rank's checks passed
        dispatched: DispatchResult = handle.buffer.dispatch(
            (x0, words) if words is not None else x0, handle=handle.handle
        )
        recv_rows = dispatched[0]
        recv_x, recv_s = recv_rows if isinstance(recv_rows, tuple) else (recv_rows, None)
        if num_worst_tokens:
            recv_x, recv_s = pad_rows(recv_x, num_worst_tokens, 0), pad_rows(recv_s, num_worst_tokens, 0)
        return _with_scales(recv_x, recv_s, s, sdtype), None, None, None, None, new_event(async_finish)

    def combine(
        self,
        x: torch.Tensor,
        handle: NormalHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """``(combined_x [T, hidden], combined_topk_weights [T, num_topk] or None, event)``: each token's rows summed
        over the ranks it went to (no weights applied: the rows are the expert outputs already weighted), plus
        ``bias`` (a tensor or two); ``topk_weights`` ``[R, num_topk]`` are summed the same way (in float32). On more
        than 8 ranks this is DeepEP's internode combine (with an internode handle)."""
        return self._combine("combine", x, handle, topk_weights, bias, config, previous_event, async_finish,
                             allocate_on_comm_stream)  # fmt: skip

    def internode_combine(
        self, x: torch.Tensor, handle: NormalHandle, topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None, config: Config | None = None,
        previous_event: EventOverlap | None = None, async_finish: bool = False, allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:  # fmt: skip
        """DeepEP's internode combine, what :meth:`combine` runs on more than 8 ranks; ``config`` must be given, as
        DeepEP asserts."""
        return self._combine("internode_combine", x, handle, topk_weights, bias, config, previous_event,
                             async_finish, allocate_on_comm_stream)  # fmt: skip

    def _combine(
        self, fn: str, x: torch.Tensor, handle: NormalHandle, topk_weights: torch.Tensor | None,
        bias: torch.Tensor | tuple[torch.Tensor, ...] | None, config: Config | None,
        previous_event: EventOverlap | None, async_finish: bool, allocate_on_comm_stream: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:  # fmt: skip
        """:meth:`combine` as ``fn`` (``combine`` or ``internode_combine``) names it."""
        self.s.settle()
        error: str | None = None
        try:  # every check in the call's agreement: a rank never raises alone
            check_events(fn, previous_event, async_finish, allocate_on_comm_stream)
            check_config(fn, config)
            check_internode_call(fn, config, self.s.group_size)
            self._check_handle(fn, handle)
            n, k = handle.num_recv, handle.num_topk
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] < n:
                raise ValueError(f"combine: x must be [{n} (or num_worst_tokens), hidden], got {x!r:.60}")
            if isinstance(bias, tuple) and len(bias) != 2:
                raise ValueError(f"combine: bias must be a tensor or a tuple of two, got a tuple of {len(bias)}")
            if topk_weights is not None:
                if k is None:
                    raise ValueError("combine: topk_weights given, but the handle's dispatch had no top-k")
                if (
                    not isinstance(topk_weights, torch.Tensor)
                    or topk_weights.shape[0] < n
                    or topk_weights.shape[1:] != (k,)
                ):
                    raise ValueError(f"combine: topk_weights must be [{n}, {k}], got {topk_weights!r:.60}")
                if k > handle.buffer.hidden:
                    raise ValueError(
                        f"combine: topk_weights has more columns ({k}) than hidden ({handle.buffer.hidden})"
                    )
        except ValueError as exc:
            error = str(exc)
        fields: list[tuple[str, FieldValue]] = [
            *self.s.handle_fields(handle),
            ("x hidden size", size_of(x, 1)),
            ("x dtype", x.dtype if isinstance(x, torch.Tensor) else None),
            ("topk_weights given", int(topk_weights is not None)),
        ]
        if self._ordered_handle(handle):
            if error is not None:  # rejected on every rank by the EPBuffer's call, as an agreement would have
                buf = handle.buffer
                none = torch.zeros((handle.num_recv, buf.hidden), dtype=torch.bfloat16, device=buf.device)
                buf.combine(none, handle.handle, reject=error)
                raise ValueError(error)
        else:
            refuse_capture_here(fn)
            self.s.agree("combine", error, fields)  # internode_combine too: the call combine makes on RDMA ranks
        wait_for(previous_event)
        buf, n = handle.buffer, handle.num_recv
        combined = buf.combine(x[:n], handle.handle, bias=bias)
        weights = None
        if topk_weights is not None:
            k = handle.num_topk
            assert k is not None  # checked above, on every rank
            rows = torch.zeros((n, buf.hidden), dtype=torch.float32, device=x.device)
            rows[:, :k] = topk_weights[:n].float()
            weights = buf.combine(rows, handle.handle)[:, :k].contiguous()
        return combined, weights, new_event(async_finish)

    def _check_handle(self, fn: str, handle: object) -> None:
        """``handle`` is a normal-mode handle of this Buffer's (ValueError)."""
        if not isinstance(handle, NormalHandle) or not any(handle.buffer is b for b in self.s.made):
            raise ValueError(f"{fn}: handle must be the handle a dispatch of this Buffer returned, got {handle!r:.60}")
