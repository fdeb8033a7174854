"""DeepEP V2's ``ElasticBuffer.dispatch`` for ``epkit.compat.deep_ep`` (``deep_ep_elastic`` says how V2's calls map):
the checks in the call's agreement, every rank's ``is_token_in_rank`` gathered for the handle's source indices and
slots, the rows through an EPBuffer of the buffer's session, and V2's handle (``EPHandle``) and shapes (expanded,
cached, worst-case without a host sync).
"""

from __future__ import annotations

from typing import Any

import torch

from epkit.collectives.ep.rows import align_up
from epkit.compat._details.deep_ep_agreement import FieldValue, size_of
from epkit.compat._details.deep_ep_config import EventHandle, EventOverlap, wait_for
from epkit.compat._details.deep_ep_handles import EPHandle, normal_handle
from epkit.compat._details.deep_ep_layouts import carry_scales, pad_rows, restore_scales, tma_scales
from epkit.compat._details.deep_ep_session import Session, new_v2_event
from epkit.utils import check_topk_idx

__all__ = ["ElasticDispatch"]


class ElasticDispatch:
    """The dispatch of one ElasticBuffer, on its session ``s``; ``num_max_tokens_per_rank`` / ``num_allocated_qps``:
    the buffer's (the default N, the QP bound)."""

    def __init__(self, session: Session, num_max_tokens_per_rank: int, num_allocated_qps: int) -> None:
        self.s, self.num_max_tokens_per_rank, self.num_allocated_qps = (
            session,
            num_max_tokens_per_rank,
            num_allocated_qps,
        )

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
        x0, sf, topk_idx, num_experts, n_max, expert_alignment = call.fields()
        fields = [
            *(s.handle_fields(handle) if handle is not None else []),
            *_fields(x0, sf, num_experts, topk_idx, topk_weights, do_expand, expert_alignment),
        ]
        if handle is None:
            fields.append(("num_max_tokens_per_rank", n_max if error is None else None))
        s.agree(fn, error, fields, x0.shape[0] if x0 is not None else 0)
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
        check_topk_idx(topk_idx, num_experts)
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
        s = self.s
        w, me = s.group_size, s.rank
        x0 = rows[0] if isinstance(rows, tuple) else rows
        k, local = topk_idx.shape[1], num_experts // w
        owner = torch.where(topk_idx >= 0, topk_idx // local, -1).cpu()
        in_rank = (owner.unsqueeze(-1) == torch.arange(w)).any(1)
        routes = s.routes("dispatch", in_rank, torch.zeros(0, dtype=torch.int32), n_max)
        weights = topk_weights if topk_weights is not None else torch.zeros(topk_idx.shape, dtype=torch.float32)
        buf = s.epbuffer(x0.shape[1], num_experts, k, x0.device, n_max, flat=True)  # combine_unsummed's path
        recv_rows, recv_idx, recv_w, aligned, h = buf.dispatch(
            rows, topk_idx, weights.to(x0.device), expert_alignment=alignment, expand=do_expand
        )
        recv_x, recv_s = recv_rows if isinstance(recv_rows, tuple) else (recv_rows, None)
        tensors = normal_handle(routes[0], routes[1], me, 1, in_rank)
        recv_src, send_head = tensors[3].long(), tensors[5].to(x0.device)
        n_recv = recv_src.numel()
        src_rank = torch.repeat_interleave(torch.arange(w), torch.tensor(h.recv_counts))
        idx_cpu = recv_idx.cpu().long()
        unaligned = torch.bincount(idx_cpu[idx_cpu >= 0], minlength=local).to(torch.int32)
        assert isinstance(aligned, list)  # a plain dispatch's (the shim pads the worst case itself)
        aligned_t = torch.tensor(aligned, dtype=torch.int32)
        meta = torch.full((n_recv, k + 2), -1, dtype=torch.int32)
        meta[:, 0] = (src_rank * n_max + recv_src).to(torch.int32)
        first = torch.where(idx_cpu >= 0, torch.arange(k).expand(n_recv, k), k).min(1).values
        meta[:, 1] = (src_rank * k + first).to(torch.int32)
        if do_expand:
            assert h.expanded_slot is not None  # an expanded dispatch's handle holds its slots
            meta[:, 2:] = h.expanded_slot.to(torch.int32)
            starts = aligned_t.long().cumsum(0) - aligned_t.long()
            psum_expert = (starts + unaligned).to(torch.int32)
            n_exp = int(recv_x.shape[0])
            exp_w = torch.zeros(n_exp, dtype=torch.float32)
            slot = h.expanded_slot
            exp_w[slot[slot >= 0]] = h.recv_topk_weights[slot >= 0]
            out_w: torch.Tensor | None = exp_w.to(x0.device) if topk_weights is not None else None
            out_idx: torch.Tensor | None = None
        else:
            psum_expert = aligned_t.cumsum(0).to(torch.int32)
            n_exp = 0
            out_w = recv_w if topk_weights is not None else None
            out_idx = recv_idx
        dev = x0.device
        handle = EPHandle(
            do_expand, num_experts, alignment, n_max, num_sms,
            topk_idx.clone() if do_handle_copy else topk_idx,
            n_recv, n_exp, aligned if do_cpu_sync else [],
            torch.tensor(h.recv_counts).cumsum(0).to(dev, torch.int32), psum_expert.to(dev), unaligned.to(dev),
            meta.to(dev), send_head, None, None,
        )  # fmt: skip
        handle.buffer, handle.handle = buf, h
        handle.send_tokens = [t.clone() for t in h.send_tokens]
        if not do_cpu_sync:  # V2's worst-case shapes: the valid rows first
            rows_cap = n_max * w
            worst = (
                rows_cap if not do_expand else align_up(rows_cap * min(k, local) + (alignment - 1) * local, alignment)
            )
            recv_x, recv_s = pad_rows(recv_x, worst, 0), pad_rows(recv_s, worst, 0)
            out_idx, out_w = pad_rows(out_idx, rows_cap, -1), pad_rows(out_w, worst if do_expand else rows_cap, 0)
            handle.recv_src_metadata = pad_rows(handle.recv_src_metadata, rows_cap, -1)
            handle.num_recv_tokens, handle.num_expanded_tokens = rows_cap, worst if do_expand else 0
            handle.worst_case = True
        return recv_x, recv_s, out_idx, out_w, handle

    def _cached(
        self, rows: Any, handle: EPHandle, topk_weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, EPHandle]:
        assert handle.buffer is not None and handle.handle is not None  # a dispatch of this buffer made it
        h = handle.handle
        recv_rows = handle.buffer.dispatch(rows, handle=h)[0]
        recv_x, recv_s = recv_rows if isinstance(recv_rows, tuple) else (recv_rows, None)
        out_w: torch.Tensor | None = None
        if topk_weights is not None:  # new weights travel too: every rank's, gathered, picked by source token
            n_max, w = handle.num_max_tokens_per_rank, self.s.group_size
            padded = torch.zeros((n_max, topk_weights.shape[1]), dtype=torch.float32, device=topk_weights.device)
            padded[: topk_weights.shape[0]] = topk_weights
            every = self.s.gather(padded, "cached dispatch").cpu().view(w * n_max, -1)
            n_recv = len(h.recv_topk_idx)
            got = every[handle.recv_src_metadata[:n_recv, 0].long().cpu()]
            if handle.do_expand:
                assert h.expanded_slot is not None
                slot = h.expanded_slot
                exp_w = torch.zeros(recv_x.shape[0], dtype=torch.float32)
                exp_w[slot[slot >= 0]] = got[slot >= 0]
                out_w = exp_w.to(recv_x.device)
            else:
                out_w = got.to(recv_x.device)
        recv_idx = None if handle.do_expand else h.recv_topk_idx.to(recv_x.device)
        if handle.worst_case:  # the handle's dispatch had worst-case shapes (no host sync): so has this one
            num_rows = handle.num_recv_tokens
            worst = handle.num_expanded_tokens if handle.do_expand else num_rows
            recv_x, recv_s = pad_rows(recv_x, worst, 0), pad_rows(recv_s, worst, 0)
            recv_idx, out_w = (
                pad_rows(recv_idx, num_rows, -1),
                pad_rows(out_w, worst if handle.do_expand else num_rows, 0),
            )
        return recv_x, recv_s, recv_idx, out_w, handle


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
        d._check_dispatch(self.x0, self.topk_idx, topk_weights, self.num_experts, self.n_max, self.alignment,
                          num_sms, num_qps, stats, previous_event)  # fmt: skip

    def fields(self) -> tuple[torch.Tensor | None, torch.Tensor | None, Any, Any, Any, Any]:
        """``(x, scales, topk_idx, num_experts, num_max_tokens_per_rank, expert_alignment)`` as resolved."""
        return self.x0, self.sf, self.topk_idx, self.num_experts, self.n_max, self.alignment


def _fields(
    x0: torch.Tensor | None,
    sf: torch.Tensor | None,
    num_experts: object,
    topk_idx: object,
    topk_weights: object,
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
        ("topk_weights given", int(topk_weights is not None)),
        ("do_expand", int(bool(do_expand))),
        ("expert_alignment", expert_alignment if isinstance(expert_alignment, int) else None),
    ]
