"""DeepEP V2's ``ElasticBuffer.dispatch`` for ``epkit.compat.deep_ep`` (``deep_ep_elastic`` says how V2's calls map):
the checks in the call's agreement, every rank's ``is_token_in_rank`` gathered for the handle's source indices and
slots, the rows through an EPBuffer of the buffer's session, and V2's handle (``EPHandle``) and shapes (expanded,
cached, worst-case without a host sync).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import torch

from epkit.collectives.ep.rows import align_up
from epkit.compat._details.deep_ep_agreement import FieldValue, size_of
from epkit.compat._details.deep_ep_config import EventHandle, EventOverlap, wait_for
from epkit.compat._details.deep_ep_handles import EPHandle, in_rank_of, normal_handle
from epkit.compat._details.deep_ep_layouts import carry_scales, pad_rows, restore_scales, tma_scales
from epkit.compat._details.deep_ep_session import Session, new_v2_event, refuse_capture_here
from epkit.utils import check_topk_idx

if TYPE_CHECKING:
    from epkit.collectives.ep_buffer import EPBuffer

__all__ = ["ElasticDispatch"]


class ElasticDispatch:
    """The dispatch of one ElasticBuffer, on its session ``s``; ``num_max_tokens_per_rank`` / ``num_allocated_qps``:
    the buffer's (the default N, the QP bound)."""

    def __init__(self, session: Session, num_max_tokens_per_rank: int, num_allocated_qps: int) -> None:
        self.s = session
        self.num_max_tokens_per_rank, self.num_allocated_qps = num_max_tokens_per_rank, num_allocated_qps

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: EventHandle | None = None,
        previous_event_before_epilogue: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap]:
        """``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``.

        ``x``: bf16 ``[T, hidden]`` or ``(e4m3 [T, hidden], scales [T, S])`` (float32, or int32 packed UE8M0);
        ``topk_idx [T, K]`` in ``[-1, num_experts)``, ``topk_weights [T, K]`` float32 or None; ``T <= N``
        (``num_max_tokens_per_rank``, the constructor's by default). Returns ``recv_x [R, hidden]`` (the same form as
        ``x``), ``recv_topk_idx [R, K]`` local expert ids (-1: another rank's), ``recv_topk_weights [R, K]`` (None
        without weights); with ``do_expand`` ``recv_x [X, hidden]``, ``recv_topk_idx`` None, ``recv_topk_weights
        [X]``. With ``handle`` (cached: ``topk_idx`` None; ``topk_weights`` may come again) the handle's routing is
        reused and the same handle returned. ``cumulative_local_expert_recv_stats [L]`` int32 gains the unaligned
        per-expert counts.
        """
        fn = "dispatch" if handle is None else "cached dispatch"
        s = self.s
        s.settle()
        n_given = num_max_tokens_per_rank
        call = _Call(
            x, topk_idx, num_experts, self.num_max_tokens_per_rank if n_given is None else n_given, expert_alignment
        )
        error: str | None = None
        try:
            call.check(self, handle, topk_weights, do_cpu_sync, do_expand, n_given, num_sms, num_qps,
                       cumulative_local_expert_recv_stats, previous_event)  # fmt: skip
        except ValueError as exc:
            error = f"dispatch: {exc}"
        self._meet(fn, error, call, handle, topk_weights is not None, do_expand, do_cpu_sync)
        x0, _, topk_idx, num_experts, n_max, expert_alignment = call.fields()
        wait_for(None if previous_event is None else EventOverlap(previous_event))
        assert x0 is not None and isinstance(topk_idx, torch.Tensor) and isinstance(num_experts, int)
        assert isinstance(expert_alignment, int)  # the agreement raised unless every check passed on every rank
        words, cols, sdtype = call.words, call.cols, call.sdtype
        rows = (x0, words) if words is not None else x0
        if handle is not None:
            out = self._cached(rows, handle, topk_weights)
        else:
            sync = True if do_cpu_sync is None else bool(do_cpu_sync)
            out = self._dispatch(rows, topk_idx, topk_weights, num_experts, n_max, expert_alignment, num_sms,
                                 do_handle_copy, sync, do_expand)  # fmt: skip
        recv_x, recv_s, recv_idx, recv_w, h = out
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            stats += h.num_unaligned_recv_tokens_per_expert.to(stats.device, stats.dtype)
        if recv_s is not None:
            scales = tma_scales(restore_scales(recv_s, cols, sdtype), use_tma_aligned_col_major_sf)
            return (recv_x, scales), recv_idx, recv_w, h, new_v2_event()
        return recv_x, recv_idx, recv_w, h, new_v2_event()

    def _meet(
        self, fn: str, error: str | None, call: _Call, handle: EPHandle | None, weights_given: bool, do_expand: object,
        do_cpu_sync: object,
    ) -> None:  # fmt: skip
        """The call's meeting with the other ranks before any row moves: the agreement (the same ValueError on every
        rank unless every rank's call is valid and their fields are the same), or, for a stream-ordered call
        (:meth:`_stream_ordered`), none, a rejection of this rank's carried by the EPBuffer's own call."""
        s = self.s
        x0, sf, topk_idx, num_experts, n_max, alignment = call.fields()
        ordered = self._stream_ordered(call.x, call.topk_idx, call.num_experts, do_cpu_sync, handle)
        if ordered is None:
            refuse_capture_here(fn)
            fields = [
                *(s.handle_fields(handle) if handle is not None else []),
                *_fields(x0, sf, num_experts, topk_idx, weights_given, do_expand, alignment),
            ]
            if handle is None:
                fields.append(("num_max_tokens_per_rank", n_max if error is None else None))
            s.agree(fn, error, fields, x0.shape[0] if x0 is not None else 0)
            return
        cap = ordered.num_max_tokens_per_rank
        if error is None and handle is None and isinstance(n_max, int) and n_max > cap:
            error = (
                f"dispatch: num_max_tokens_per_rank = {n_max} exceeds the {cap} this ElasticBuffer's eager calls made "
                "room for (on an NCCL group a do_cpu_sync=False dispatch after them is stream-ordered: make the "
                "first one with the largest num_max_tokens_per_rank)"
            )
        if error is not None:
            self._reject(ordered, error, handle, weights_given)

    def _stream_ordered(
        self, x: object, topk_idx: object, num_experts: object, do_cpu_sync: object, handle: object
    ) -> EPBuffer | None:
        """The EPBuffer a call runs on with no host agreement: on an NCCL group (as the legacy Buffer's worst-case
        calls there), a ``do_cpu_sync=False`` dispatch once an eager call made the session's buffer for its shapes
        on the device kernels, and a cached dispatch along its handle; None where the call agrees on the host. From
        the arguments' shapes alone: every rank decides alike, as its shapes are the same (V2's contract; the
        agreement checks them on the calls that make the buffer)."""
        if not self.s.nccl:
            return None
        if handle is not None:
            if not isinstance(handle, EPHandle) or self.s.index_of(handle) is None or not handle.worst_case:
                return None
            return handle.buffer if handle.buffer is not None and handle.buffer.uses_device_kernels else None
        x0 = x[0] if isinstance(x, tuple) and len(x) == 2 else x
        if do_cpu_sync is None or do_cpu_sync or not isinstance(x0, torch.Tensor) or x0.dim() != 2:
            return None
        if not self.on_kernels(x0, topk_idx, num_experts):
            return None
        assert isinstance(topk_idx, torch.Tensor) and isinstance(num_experts, int)  # on_kernels checked them
        return self.s.current[(x0.shape[1], num_experts, topk_idx.shape[1])]

    def _reject(self, buf: EPBuffer, error: str, handle: object, weights_given: bool) -> NoReturn:
        """A stream-ordered call this rank rejects: its part of the call's collectives with no rows (the routing
        or weights gather, then the EPBuffer's call, which carries ``error`` to every rank as its own rejection:
        there the same ValueError, on CUDA at the rank's next call), then the ValueError here."""
        s, cap, dev = self.s, buf.num_max_tokens_per_rank, buf.device
        if not isinstance(handle, EPHandle):
            s.reject_worst_dispatch(buf, error, cap, cap * s.group_size)
        assert handle.handle is not None  # a dispatch of this buffer made it (_stream_ordered)
        if weights_given:
            n, k = handle.num_max_tokens_per_rank, handle.topk_idx.shape[1]
            s.gather(torch.zeros((n, k), dtype=torch.float32, device=dev), "cached dispatch")
        buf.dispatch(torch.zeros((0, buf.hidden), dtype=torch.bfloat16, device=dev), handle=handle.handle, reject=error)
        raise ValueError(error)  # (the EPBuffer raised every rank's verdict first)

    def on_kernels(self, x0: torch.Tensor, topk_idx: object, num_experts: object) -> bool:
        """Whether a dispatch of these shapes takes the device kernels: an earlier call made the session's EPBuffer
        for them (the same on every rank) and it took them."""
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or not isinstance(num_experts, int):
            return False
        buf = self.s.current.get((x0.shape[1], num_experts, topk_idx.shape[1]))
        return buf is not None and buf.uses_device_kernels

    def _check_cached(
        self,
        handle: object,
        topk_idx: object,
        do_cpu_sync: object,
        do_expand: object,
        num_experts: object,
        expert_alignment: object,
        num_max_tokens_per_rank: object,
    ) -> None:
        if not isinstance(handle, EPHandle) or self.s.index_of(handle) is None:
            raise ValueError(
                f"handle must be an EPHandle a dispatch of this ElasticBuffer returned, got {handle!r:.60}"
            )
        if topk_idx is not None:
            raise ValueError("with a handle (cached dispatch), topk_idx must be None (it comes from the handle)")
        if do_cpu_sync:
            raise ValueError("with a handle (cached dispatch), do_cpu_sync must be None or False (as in DeepEP)")
        if bool(do_expand) != handle.do_expand:
            raise ValueError(f"do_expand={do_expand!r}, but the handle's dispatch had do_expand={handle.do_expand}")
        for name, given, have in (
            ("num_experts", num_experts, handle.num_experts),
            ("expert_alignment", expert_alignment, handle.expert_alignment),
            ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
        ):
            if given is not None and given != have:
                raise ValueError(f"{name}={given!r} differs from the handle's {have}")

    def _check_dispatch(
        self,
        x0: torch.Tensor,
        topk_idx: object,
        topk_weights: object,
        num_experts: object,
        n_max: object,
        expert_alignment: object,
        num_sms: object,
        num_qps: object,
        stats: object,
        previous_event: object,
        values: bool,
    ) -> None:
        w = self.s.group_size
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0 or num_experts % w:
            raise ValueError(f"num_experts must be a positive multiple of the {w} ranks, got {num_experts!r}")
        if isinstance(n_max, bool) or not isinstance(n_max, int) or n_max < x0.shape[0] or n_max <= 0:
            raise ValueError(
                f"num_max_tokens_per_rank must be an int >= the {x0.shape[0]} tokens of x (and > 0), got {n_max!r}"
            )
        if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment <= 0:
            raise ValueError(f"expert_alignment must be a positive int, got {expert_alignment!r}")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.shape[0] != x0.shape[0]:
            raise ValueError(f"topk_idx must be [num_tokens = {x0.shape[0]}, num_topk], got {topk_idx!r:.60}")
        check_topk_idx(topk_idx, num_experts, check_values=values)
        if topk_weights is not None and (
            not isinstance(topk_weights, torch.Tensor)
            or topk_weights.shape != topk_idx.shape
            or topk_weights.dtype != torch.float32
        ):
            raise ValueError(f"topk_weights must be float32 {list(topk_idx.shape)} or None, got {topk_weights!r:.60}")
        for name, v in (("num_sms", num_sms), ("num_qps", num_qps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if isinstance(num_qps, int) and num_qps > self.num_allocated_qps:
            raise ValueError(f"num_qps = {num_qps} exceeds the {self.num_allocated_qps} allocated QPs")
        local = num_experts // w
        if stats is not None and (
            not isinstance(stats, torch.Tensor) or stats.shape != (local,) or stats.dtype != torch.int32
        ):
            raise ValueError(f"cumulative_local_expert_recv_stats must be int32 [{local}], got {stats!r:.60}")
        if previous_event is not None and not isinstance(previous_event, EventHandle):
            raise ValueError(
                f"previous_event must be an EventHandle (ElasticBuffer.capture()) or None, got {previous_event!r}"
            )

    def _dispatch(
        self,
        rows: Any,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None,
        num_experts: int,
        n_max: int,
        alignment: int,
        num_sms: int,
        do_handle_copy: bool,
        do_cpu_sync: bool,
        do_expand: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, EPHandle]:
        """The rows through the session's EPBuffer and V2's handle by tensor ops. On the device kernels without
        ``do_cpu_sync`` EPBuffer's worst-case call (``num_worst_tokens = N * W``: V2's worst-case shapes, sized
        and padded by the kernels, nothing read back); elsewhere a plain dispatch, padded here without it."""
        s = self.s
        w = s.group_size
        x0 = rows[0] if isinstance(rows, tuple) else rows
        dev, k, local, rows_cap = x0.device, topk_idx.shape[1], num_experts // w, n_max * w
        in_rank = in_rank_of(topk_idx, num_experts, w)
        weights = topk_weights if topk_weights is not None else torch.zeros(topk_idx.shape, device=dev)
        buf = s.epbuffer(x0.shape[1], num_experts, k, dev, n_max, summable=True)
        routes = s.device_routes("dispatch", in_rank, buf.num_max_tokens_per_rank)  # one size on every rank
        worst = buf.uses_device_kernels and not do_cpu_sync
        recv_rows, recv_idx, recv_w, aligned, h = buf.dispatch(
            rows, topk_idx, weights.to(dev), expert_alignment=alignment, expand=do_expand,
            num_worst_tokens=rows_cap if worst else 0, num_sms=sms_budget(num_sms),
        )  # fmt: skip
        recv_x, recv_s = recv_rows if isinstance(recv_rows, tuple) else (recv_rows, None)
        aligned_t = aligned.to(dev) if isinstance(aligned, torch.Tensor) else torch.tensor(aligned, device=dev)
        n_rows, n_exp = recv_idx.shape[0], recv_x.shape[0] if do_expand else 0
        meta, psum_rank, psum_expert, unaligned, send_head = route_tensors(
            routes, s.rank, in_rank, recv_idx, h.expanded_slot, aligned_t.int(), n_max, local
        )
        if do_expand:
            assert h.expanded_slot is not None  # an expanded dispatch's handle holds its slots
            out_w = expanded_weights(h.expanded_slot.to(dev), recv_w, n_exp) if topk_weights is not None else None
            out_idx: torch.Tensor | None = None
        else:
            out_w, out_idx = (recv_w if topk_weights is not None else None), recv_idx
        counts = aligned if isinstance(aligned, list) and do_cpu_sync else []  # a plain dispatch's list
        handle = EPHandle(
            do_expand, num_experts, alignment, n_max, num_sms, topk_idx.clone() if do_handle_copy else topk_idx,
            n_rows, n_exp, counts, psum_rank, psum_expert, unaligned, meta, send_head, None, None,
        )  # fmt: skip
        handle.buffer, handle.handle = buf, h
        handle.send_tokens = [t.clone() for t in h.send_tokens]  # (none on the device kernels)
        handle.worst_case = not do_cpu_sync
        if not do_cpu_sync and not worst:  # V2's worst-case shapes, the valid rows first
            x_cap = align_up(rows_cap * min(k, local) + (alignment - 1) * local, alignment) if do_expand else rows_cap
            recv_x, recv_s = pad_rows(recv_x, x_cap, 0), pad_rows(recv_s, x_cap, 0)
            out_idx, out_w = pad_rows(out_idx, rows_cap, -1), pad_rows(out_w, x_cap if do_expand else rows_cap, 0)
            handle.recv_src_metadata = pad_rows(handle.recv_src_metadata, rows_cap, -1)
            handle.num_recv_tokens, handle.num_expanded_tokens = rows_cap, x_cap if do_expand else 0
        return recv_x, recv_s, out_idx, out_w, handle

    def _cached(
        self, rows: Any, handle: EPHandle, topk_weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, EPHandle]:
        assert handle.buffer is not None and handle.handle is not None  # a dispatch of this buffer made it
        h = handle.handle
        every: torch.Tensor | None = None
        if topk_weights is not None:  # new weights travel too: every rank's, gathered (first: _reject's order)
            n_max, w = handle.num_max_tokens_per_rank, self.s.group_size
            padded = torch.zeros((n_max, topk_weights.shape[1]), dtype=torch.float32, device=topk_weights.device)
            padded[: topk_weights.shape[0]] = topk_weights
            every = self.s.gather(padded, "cached dispatch").view(w * n_max, -1)
        recv_rows = handle.buffer.dispatch(rows, handle=h)[0]
        recv_x, recv_s = recv_rows if isinstance(recv_rows, tuple) else (recv_rows, None)
        dev = recv_x.device
        out_w: torch.Tensor | None = None
        if every is not None:  # picked by source token
            every = every.to(dev)
            src = handle.recv_src_metadata[: h.recv_topk_idx.shape[0], 0].long().to(dev)
            got = torch.where((src >= 0).unsqueeze(1), every[src.clamp(min=0)], 0.0)
            if handle.do_expand:
                assert h.expanded_slot is not None
                out_w = expanded_weights(h.expanded_slot.to(dev), got, recv_x.shape[0])
            else:
                out_w = got
        recv_idx = None if handle.do_expand else h.recv_topk_idx.to(dev)
        if handle.worst_case:  # the handle's dispatch had worst-case shapes (no host sync): so has this one
            num_rows = handle.num_recv_tokens
            worst = handle.num_expanded_tokens if handle.do_expand else num_rows
            recv_x, recv_s = pad_rows(recv_x, worst, 0), pad_rows(recv_s, worst, 0)
            recv_idx, out_w = (
                pad_rows(recv_idx, num_rows, -1),
                pad_rows(out_w, worst if handle.do_expand else num_rows, 0),
            )
        return recv_x, recv_s, recv_idx, out_w, handle


def sms_budget(num_sms: int) -> int | None:
    """EPBuffer's ``num_sms`` for V2's (0: the buffer's; the kernels' multi-program launches need 2 or more)."""
    return max(num_sms, 2) if num_sms else None


def route_tensors(
    routes: tuple[torch.Tensor, torch.Tensor], me: int, in_rank: torch.Tensor, recv_idx: torch.Tensor,
    slot: torch.Tensor | None, aligned: torch.Tensor, n_max: int, local: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """V2's handle tensors by tensor ops on ``recv_idx``'s device (no host read): ``(recv_src_metadata [R, K + 2],
    psum_num_recv_tokens_per_scaleup_rank [W], psum_num_recv_tokens_per_expert [L], num_unaligned_recv_tokens_per
    _expert [L], dst_buffer_slot_idx [T, W])``, all int32 (``EPHandle`` says what each holds).

    ``routes``: every rank's routing (``Session.device_routes``); ``in_rank [T, W]`` this rank's; ``recv_idx [R, K]``
    the received rows' local expert ids (-1 past the rows received: ``R`` may be a worst case); ``slot [R, K]`` the
    expanded row of each slot (None: not expanded); ``aligned [L]`` the aligned per-expert counts."""
    dev, (n_rows, k) = recv_idx.device, recv_idx.shape
    tensors = normal_handle(routes[0], routes[1], me, 1, in_rank, num_rows=n_rows)
    # DeepEP's rank_prefix_matrix's column: the rows from each source, inclusive (contiguous: kernels read it)
    psum_rank = tensors[0][:, me].to(dev).contiguous()
    recv_src = tensors[3].to(dev).long()  # -1 past the rows received
    src_rank = torch.searchsorted(psum_rank.long(), torch.arange(n_rows, device=dev), right=True)
    got = recv_src >= 0
    first = torch.where(recv_idx >= 0, torch.arange(k, device=dev), k).amin(1)
    meta = torch.full((n_rows, k + 2), -1, dtype=torch.int32, device=dev)
    meta[:, 0] = torch.where(got, src_rank * n_max + recv_src, -1)
    meta[:, 1] = torch.where(got, src_rank * k + first, -1)
    bins = torch.where(recv_idx >= 0, recv_idx.long(), local).view(-1)
    unaligned = torch.zeros(local + 1, dtype=torch.int32, device=dev).scatter_add_(0, bins, torch.ones_like(bins).int())
    unaligned = unaligned[:local]
    if slot is not None:
        meta[:, 2:] = slot.to(dev)
        psum_expert = aligned.cumsum(0) - aligned + unaligned  # each expert's aligned start plus its count
    else:
        psum_expert = aligned.cumsum(0)
    return meta, psum_rank, psum_expert.int(), unaligned, tensors[5].to(dev).contiguous()


def expanded_weights(slot: torch.Tensor, weights: torch.Tensor, n_exp: int) -> torch.Tensor:
    """``[X]`` float32: each expanded row's top-k weight (``slot [R, K]`` its row of each (row, slot), -1 none;
    ``weights [R, K]``), 0 on padding; by tensor ops (no host read)."""
    out = torch.zeros(n_exp + 1, dtype=torch.float32, device=weights.device)
    out.scatter_(0, torch.where(slot >= 0, slot, n_exp).view(-1).long(), weights.float().reshape(-1))
    return out[:n_exp]


def _rows(x: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, scales or None)`` of a V2 dispatch's ``x``: bf16 ``[T, H]``, or ``(e4m3 [T, H], scales [T, S])``."""
    x0, sf = x if isinstance(x, tuple) and len(x) == 2 else (x, None)
    if not isinstance(x0, torch.Tensor) or x0.dim() != 2:
        raise ValueError(f"dispatch: x must be a [num_tokens, hidden] tensor or an (x, scales) pair, got {x!r:.60}")
    if sf is None and x0.dtype != torch.bfloat16:
        raise ValueError(f"dispatch: x must be bfloat16 (or an (e4m3, scales) pair), got {x0.dtype}")
    if sf is not None and x0.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dispatch: an (x, scales) pair needs e4m3 x, got {x0.dtype}")
    if sf is not None and not isinstance(sf, torch.Tensor):
        raise ValueError(f"dispatch: scales must be a tensor, got {sf!r:.60}")
    return x0, sf


class _Call:
    """One dispatch's arguments as its checks resolve them (the handle's routing and sizes for a cached one, the
    defaults filled in); what a rejected call could not tell stays None."""

    def __init__(self, x: object, topk_idx: object, num_experts: object, n_max: object, alignment: object) -> None:
        self.x, self.topk_idx, self.num_experts, self.n_max = x, topk_idx, num_experts, n_max
        self.given_alignment, self.alignment = alignment, 1 if alignment is None else alignment
        self.x0: torch.Tensor | None = None
        self.sf: torch.Tensor | None = None
        self.words: torch.Tensor | None = None  # the scales as EPBuffer carries them (carry_scales)
        self.cols, self.sdtype = 0, torch.float32

    def check(
        self, d: ElasticDispatch, handle: EPHandle | None, topk_weights: object, do_cpu_sync: object, do_expand: object,
        given_n_max: object, num_sms: object, num_qps: object, stats: object, previous_event: object,
    ) -> None:  # fmt: skip
        """Every check of the call (ValueError), resolving the arguments."""
        self.x0, self.sf = _rows(self.x)
        if self.sf is not None:
            self.words, self.cols, self.sdtype = carry_scales(self.sf, self.x0.shape[0], self.x0.shape[1])
        if handle is not None:
            d._check_cached(handle, self.topk_idx, do_cpu_sync, do_expand, self.num_experts, self.given_alignment,
                            given_n_max)  # fmt: skip
            self.num_experts, self.alignment = handle.num_experts, handle.expert_alignment
            self.n_max, self.topk_idx = handle.num_max_tokens_per_rank, handle.topk_idx
        # the ids' values: on the host unless the device kernels check them (a worst-case call there reads nothing
        # back) or they are a handle's, checked at its dispatch
        worst = do_cpu_sync is not None and not do_cpu_sync
        values = handle is None and not (worst and d.on_kernels(self.x0, self.topk_idx, self.num_experts))
        d._check_dispatch(self.x0, self.topk_idx, topk_weights, self.num_experts, self.n_max, self.alignment,
                          num_sms, num_qps, stats, previous_event, values)  # fmt: skip

    def fields(self) -> tuple[torch.Tensor | None, torch.Tensor | None, Any, Any, Any, Any]:
        """``(x, scales, topk_idx, num_experts, num_max_tokens_per_rank, expert_alignment)`` as resolved."""
        return self.x0, self.sf, self.topk_idx, self.num_experts, self.n_max, self.alignment


def _fields(
    x0: torch.Tensor | None,
    sf: torch.Tensor | None,
    num_experts: object,
    topk_idx: object,
    weights_given: bool,
    do_expand: object,
    expert_alignment: object,
) -> list[tuple[str, FieldValue]]:
    """What every rank's dispatch must share (the agreement's fields; None: a value a rejected call could not tell)."""
    return [
        ("x hidden size", x0.shape[1] if x0 is not None else None),
        ("x dtype", x0.dtype if x0 is not None else None),
        ("x scale columns", (size_of(sf, 1) if sf is not None else 0) if x0 is not None else None),
        ("x scales dtype", sf.dtype if sf is not None else None),
        ("num_experts", num_experts if isinstance(num_experts, int) else None),
        ("topk_idx columns (num_topk)", topk_idx.shape[1] if isinstance(topk_idx, torch.Tensor) else None),
        ("topk_weights given", int(weights_given)),
        ("do_expand", int(bool(do_expand))),
        ("expert_alignment", expert_alignment if isinstance(expert_alignment, int) else None),
    ]
