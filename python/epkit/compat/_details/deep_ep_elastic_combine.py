"""DeepEP V2's ``ElasticBuffer.combine`` for ``epkit.compat.deep_ep``: each token's rows summed at the source in
V2's order in float32 (``deep_ep_elastic`` says which) — by the device kernels in that order, or on a host path
brought back unsummed (``EPBuffer.combine_unsummed``) and summed here — and the top-k weights routed back to their
slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epkit.collectives.ep.rows import sum_indexed_rows
from epkit.compat._details.deep_ep_config import EventHandle, EventOverlap, wait_for
from epkit.compat._details.deep_ep_elastic_dispatch import sms_budget
from epkit.compat._details.deep_ep_handles import EPHandle
from epkit.compat._details.deep_ep_session import Session, new_v2_event, refuse_capture_here
from epkit.compat._details.ep_unsummed import rows_in_rank, slot_rows_back

if TYPE_CHECKING:
    from epkit.collectives.ep_buffer import EPBuffer

__all__ = ["ElasticCombine", "rank_order"]


def rank_order(topk_idx: torch.Tensor, local: int, w: int) -> torch.Tensor:
    """V2's summation order of a token's ranks: ``[T, W]`` int32, per token the ranks holding one of its experts
    ordered by the last top-k slot naming one of theirs, then -1; by tensor ops on ``topk_idx``'s device."""
    ids = topk_idx.long()
    owner = torch.where(ids >= 0, ids // local, -1)
    lanes = torch.arange(ids.shape[1], device=ids.device).view(1, -1, 1)
    last = torch.where(owner.unsqueeze(-1) == torch.arange(w, device=ids.device), lanes, -1).amax(1)  # [T, W]
    order = torch.sort(torch.where(last >= 0, last, ids.shape[1]), dim=1, stable=True).indices
    return torch.where(torch.gather(last, 1, order) >= 0, order, -1).to(torch.int32)


class ElasticCombine:
    """The combine of one ElasticBuffer, on its session ``s``; ``allow_multiple_reduction``: the buffer's (without
    it, expanded rows come back one by one and are added k ascending)."""

    def __init__(self, session: Session, allow_multiple_reduction: bool) -> None:
        self.s, self.allow_multiple_reduction = session, allow_multiple_reduction

    # V2's signature: its stream arguments are dispatch's, two to a line here
    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        num_sms: int = 0, num_qps: int = 0,
        previous_event: EventHandle | None = None, previous_event_before_epilogue: EventHandle | None = None,
        async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:  # fmt: skip
        """``(combined_x [T, hidden] bf16, combined_topk_weights [T, K] float32 or None, event)``.

        ``x``: ``[R, hidden]`` bf16, one row per received token (the dispatch's worst-case row count is taken too),
        or with an expanded handle ``[X, hidden]``, one per expanded row; ``topk_weights``: ``[R, K]`` (expanded:
        ``[X]``) routed back to their top-k slots, not applied; ``bias``: ``[T, hidden]`` or a pair, added first.
        The sum's order is V2's (module docstring), so the bits are V2's reference's.
        """
        s = self.s
        s.settle()
        error: str | None = None
        try:
            if not isinstance(handle, EPHandle) or s.index_of(handle) is None:
                raise ValueError(
                    f"handle must be an EPHandle a dispatch of this ElasticBuffer returned, got {handle!r:.60}"
                )
            assert handle.handle is not None
            h = handle.handle
            n_recv = len(h.recv_topk_idx)
            rows = int(h.expanded_rows.numel()) if handle.do_expand and h.expanded_rows is not None else n_recv
            hidden = handle.buffer.hidden if handle.buffer is not None else 0
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] < rows or x.shape[1] != hidden:
                raise ValueError(f"x must be [{rows} (or more), {hidden}], got {x!r:.60}")
            if x.dtype != torch.bfloat16:
                raise ValueError(f"x must be bfloat16, got {x.dtype}")
            want_w = (rows,) if handle.do_expand else (n_recv, handle.topk_idx.shape[1])
            if topk_weights is not None and (
                not isinstance(topk_weights, torch.Tensor)
                or topk_weights.dim() != len(want_w)
                or topk_weights.shape[0] < want_w[0]
                or topk_weights.shape[1:] != want_w[1:]
            ):
                raise ValueError(f"topk_weights must be {list(want_w)} (or more rows), got {topk_weights!r:.60}")
            t_num = handle.topk_idx.shape[0]
            for b in bias if isinstance(bias, tuple) else (() if bias is None else (bias,)):
                if not isinstance(b, torch.Tensor) or tuple(b.shape) != (t_num, hidden) or b.device != x.device:
                    raise ValueError(f"bias must be [{t_num}, {hidden}] on x's device (or a pair), got {b!r:.60}")
            if topk_weights is not None and handle.topk_idx.shape[1] > hidden:
                raise ValueError(f"topk_weights has more columns ({handle.topk_idx.shape[1]}) than hidden ({hidden})")
            if isinstance(bias, tuple) and len(bias) != 2:
                raise ValueError(f"bias must be a tensor or a pair, got a tuple of {len(bias)}")
        except ValueError as exc:
            error = f"combine: {exc}"
        ordered = self._stream_ordered(handle)
        if ordered is None:
            refuse_capture_here("combine")
            fields = [*s.handle_fields(handle), ("topk_weights given", int(topk_weights is not None))]
            s.agree("combine", error, fields)
        elif error is not None:  # the EPBuffer's combine carries this rank's rejection to every rank
            assert handle.handle is not None  # _stream_ordered found it this buffer's
            none = torch.zeros((0, ordered.hidden), dtype=torch.bfloat16, device=ordered.device)
            ordered.combine(none, handle.handle, reject=error)
            raise ValueError(error)  # (the EPBuffer raised every rank's verdict first)
        wait_for(None if previous_event is None else EventOverlap(previous_event))
        assert handle.buffer is not None
        if handle.buffer.uses_device_kernels:
            combined = self._rows_on_kernels(x, handle, bias, num_sms)
            weights = self._weights_on_kernels(topk_weights, handle, num_sms) if topk_weights is not None else None
        else:
            combined = self._combine_rows(x, handle, bias)
            weights = self._combine_weights(topk_weights, handle) if topk_weights is not None else None
        return combined, weights, new_v2_event()

    def _stream_ordered(self, handle: object) -> EPBuffer | None:
        """The EPBuffer a combine runs on with no host agreement: on an NCCL group, along the handle of a
        ``do_cpu_sync=False`` dispatch on the device kernels (``ElasticDispatch._stream_ordered``); else None."""
        if not self.s.nccl or not isinstance(handle, EPHandle) or self.s.index_of(handle) is None:
            return None
        buf = handle.buffer
        return buf if handle.worst_case and buf is not None and buf.uses_device_kernels else None

    def _rows_on_kernels(
        self, x: torch.Tensor, handle: EPHandle, bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
        num_sms: int,
    ) -> torch.Tensor:  # fmt: skip
        """The rows back on the device kernels, summed there in V2's order (``EPBuffer.combine(order=)``: the
        biases, then each rank's row by :func:`rank_order`); an expanded row's slots summed on the expert side
        unweighted, k ascending. No host read."""
        assert handle.buffer is not None and handle.handle is not None
        if handle.do_expand and not self.allow_multiple_reduction:
            return self._slots_on_kernels(x, handle, bias, num_sms)
        buf, h = handle.buffer, handle.handle
        rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
        ones = torch.ones(h.recv_topk_idx.shape, dtype=torch.float32, device=x.device) if handle.do_expand else None
        order = rank_order(handle.topk_idx.to(x.device), handle.num_experts // self.s.group_size, self.s.group_size)
        return buf.combine(x[:rows].contiguous(), h, ones, bias, sms_budget(num_sms), order=order)

    def _slots_on_kernels(
        self, x: torch.Tensor, handle: EPHandle, bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
        num_sms: int,
    ) -> torch.Tensor:  # fmt: skip
        """Without ``allow_multiple_reduction``, on the device kernels: every (token, k) row back on its own, one
        combine per top-k slot k (its expanded rows alone: each token's sum there has one term, its row exactly),
        then at the source ``bias0 + bias1`` and the slots k ascending in float32, rounded once (V2's order, as
        ``slot_rows_back`` on a host path); tensor ops, no host read, K combines."""
        buf, h = handle.buffer, handle.handle
        assert buf is not None and h is not None and h.expanded_slot is not None  # an expanded dispatch's handle
        dev, n_exp = x.device, handle.num_expanded_tokens
        slot = h.expanded_slot.to(dev).long()
        ones = torch.ones(h.recv_topk_idx.shape, dtype=torch.float32, device=dev)
        rows = torch.cat([x[:n_exp], x.new_zeros((1, x.shape[1]))])  # a zero row for the slots naming none
        acc = torch.zeros((handle.topk_idx.shape[0], x.shape[1]), dtype=torch.float32, device=dev)
        for b in bias if isinstance(bias, tuple) else (() if bias is None else (bias,)):
            acc += b.float()
        for j in range(slot.shape[1]):
            lane = torch.zeros_like(rows)
            at = torch.where(slot[:, j] >= 0, slot[:, j], n_exp)
            lane[at] = rows[at]
            acc += buf.combine(lane[:n_exp], h, ones, num_sms=sms_budget(num_sms)).float()
        return acc.to(x.dtype)

    def _weights_on_kernels(self, topk_weights: torch.Tensor, handle: EPHandle, num_sms: int) -> torch.Tensor:
        """The top-k weights back on the device kernels: a float32 combine of rows holding each slot's weight in
        its column (the expert rank's slots only, others 0), so each token's column j sums one nonzero term, its
        expert's rank's. No host read (a second combine, float32 rows of ``hidden`` columns)."""
        assert handle.buffer is not None and handle.handle is not None
        buf, h = handle.buffer, handle.handle
        dev, k = topk_weights.device, handle.topk_idx.shape[1]
        ids = h.recv_topk_idx.to(dev)
        if handle.do_expand:
            assert h.expanded_slot is not None  # an expanded dispatch's handle holds its slots
            n_exp, slot = handle.num_expanded_tokens, h.expanded_slot.to(dev).long()
            y = torch.zeros((n_exp + 1, buf.hidden), dtype=torch.float32, device=dev)
            vals = topk_weights[:n_exp].float()[slot.clamp(min=0)]  # each slot's expanded row's weight
            lanes = torch.arange(k, device=dev).expand_as(slot)
            y.index_put_((torch.where(slot >= 0, slot, n_exp).reshape(-1), lanes.reshape(-1)), vals.reshape(-1))
            y, ones = y[:n_exp], torch.ones(ids.shape, dtype=torch.float32, device=dev)
        else:
            y = torch.zeros((ids.shape[0], buf.hidden), dtype=torch.float32, device=dev)
            y[:, :k] = torch.where(ids >= 0, topk_weights[: ids.shape[0]].float(), 0.0)
            ones = None
        return buf.combine(y, h, ones, num_sms=sms_budget(num_sms))[:, :k].contiguous()

    def _combine_rows(
        self, x: torch.Tensor, handle: EPHandle, bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """The rows back, summed in V2's order (module docstring): float32 terms, one rounding."""
        assert handle.buffer is not None and handle.handle is not None
        buf, h = handle.buffer, handle.handle
        w, local = self.s.group_size, handle.num_experts // self.s.group_size
        ids = handle.topk_idx.cpu().long()
        t_num, k = ids.shape
        owner = torch.where(ids >= 0, ids // local, -1)
        biases = bias if isinstance(bias, tuple) else (() if bias is None else (bias,))
        terms: list[torch.Tensor] = []  # float32 [T, H] sources; src_of / row_of index them
        if biases:
            total = biases[0].float() + biases[1].float() if len(biases) == 2 else biases[0].float()
            terms.append(total.cpu().contiguous())
        first = len(terms)
        n_recv = len(h.recv_topk_idx)
        if not handle.do_expand or self.allow_multiple_reduction:
            y = x[: h.expanded_rows.numel()] if handle.do_expand and h.expanded_rows is not None else x[:n_recv]
            ones = torch.ones((n_recv, k), dtype=torch.float32) if handle.do_expand else None
            back = buf.combine_unsummed(y.contiguous(), h, ones)
            terms += [r.float().cpu() for r in back]
            order = rank_order(ids, local, w).long()
            src_of = torch.where(order >= 0, first + order, -1)
            row_of = torch.gather(rows_in_rank(handle.send_tokens, t_num), 1, order.clamp(min=0))
        else:  # every (token, k) row back, added k ascending
            slot_terms, src_of, row_of = slot_rows_back(buf, h, x, owner)
            src_of = torch.where(src_of >= 0, src_of + len(terms), -1)
            terms += slot_terms
        if biases:
            src_of = torch.cat([torch.zeros((t_num, 1), dtype=torch.int64), src_of], 1)
            row_of = torch.cat([torch.arange(t_num).unsqueeze(1), row_of], 1)
        out = torch.empty((t_num, x.shape[1]), dtype=torch.bfloat16)
        if not terms:
            return out.zero_().to(x.device)
        return sum_indexed_rows(out, terms, src_of, row_of.clamp(min=0)).to(x.device)

    def _combine_weights(self, topk_weights: torch.Tensor, handle: EPHandle) -> torch.Tensor:
        """Each top-k weight back from the rank that holds its expert (V2's combined_topk_weights: the weights as
        sent, 0 where ``topk_idx`` is -1)."""
        assert handle.buffer is not None and handle.handle is not None
        buf, h = handle.buffer, handle.handle
        ids = handle.topk_idx.cpu().long()
        t_num, k = ids.shape
        assert k <= buf.hidden  # checked in the agreement: the weights travel in a row's first k columns
        n_recv = len(h.recv_topk_idx)
        if handle.do_expand:
            assert h.expanded_slot is not None and h.expanded_rows is not None
            y = torch.zeros((h.expanded_rows.numel(), buf.hidden), dtype=torch.float32)
            slot = h.expanded_slot
            lanes = torch.arange(k).expand(n_recv, k)
            y[slot[slot >= 0], lanes[slot >= 0]] = topk_weights.cpu().float()[slot[slot >= 0]]
            back = buf.combine_unsummed(y.to(buf.device), h, torch.ones((n_recv, k), dtype=torch.float32))
        else:
            y = torch.zeros((n_recv, buf.hidden), dtype=torch.float32)
            y[:, :k] = topk_weights[:n_recv].float().cpu()
            back = buf.combine_unsummed(y.to(buf.device), h)
        local = handle.num_experts // self.s.group_size
        owner = torch.where(ids >= 0, ids // local, -1)
        rows_of = rows_in_rank(handle.send_tokens, t_num)
        out = torch.zeros((t_num, k), dtype=torch.float32)
        for r, rows in enumerate(back):
            rows = rows.cpu()
            for j in range(k):
                hit = owner[:, j] == r
                out[hit, j] = rows[rows_of[hit, r], j]
        return out.to(topk_weights.device)
