"""EPBuffer's normal mode (prefill) on a flat host-driven buffer.

The normal-mode path of a flat host-driven buffer (``shm`` or ``torch`` over the whole group): the layout
agreement, the row moves, and the fixed-order combine.

A normal-mode message to one destination holds, per row sent there (source token order), the row's
bytes, its FP8 scales, its local expert ids (-1 where the expert lives elsewhere) and its weights, each
field block aligned to ``FIELD_ALIGN``; a rank's rows for itself go through no message (nor do the
combine rows it returns to itself). Result rows on the CPU come from a :class:`RowPool` (pages already
mapped). The layout message before it carries
the row format, the row count and the rows per local expert, or the sender's error text.
"""

from __future__ import annotations

import torch

from epkit.collectives.ep import routing
from epkit.collectives.ep.agreement import agree_on_handle, agree_rows
from epkit.collectives.ep.context import EPContext
from epkit.collectives.ep.handles import DispatchHandle, DispatchResult
from epkit.collectives.ep.hier_rows import sum_by_host
from epkit.collectives.ep.results import cached_result, finish_dispatch
from epkit.collectives.ep.rows import Bias, align_up, check_formats, format_code, row_bytes, sum_indexed_rows
from epkit.collectives.exchange import Exchange

__all__ = ["FlatNormalPath"]

#: Rows as ``_send_rows`` moves them: ``(x, scales or None, local ids int32, weights float32)``.
_Fields = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]


class FlatNormalPath:
    """Normal-mode dispatch and combine over ``ctx.buffer`` (every rank one region per source; with result slots,
    ``ctx.result_slots``, the senders write x and scale rows straight into the receivers' results)."""

    #: Whether dispatch and combine run as device kernels.
    on_device = False

    def __init__(self, ctx: EPContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg

    def dispatch(
        self, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None,
        alignment: int, expand: bool, error: str | None = None,
    ) -> DispatchResult:  # fmt: skip
        """Normal dispatch (see ``EPBuffer.dispatch``). The layout agreement tells each destination the row
        format, the rows and the rows per local expert it gets from here (or this rank's error: then every rank
        raises it); with result slots also the slot this rank's results take (-1: none free) and the rows this
        rank sends every rank, so that a sender knows where its rows start in each receiver's result."""
        ctx, cfg = self.ctx, self.cfg
        ctx.dispatches += 1  # on every rank at every call, rejected ones too: the ranks' handles stay comparable
        # ``error``: the caller's verdict on its other arguments (``num_sms``), agreed as this call's own
        error = routing.dispatch_error(cfg, ctx.device, x, scales, topk_idx, topk_weights, alignment, False) or error
        w, L, me = cfg.world_size, cfg.num_local_experts, cfg.rank
        slots = ctx.result_slots
        slot = slots.take() if slots is not None else -1
        try:
            meta_rows: list[torch.Tensor] = []
            tokens: list[torch.Tensor] = []
            if error is None:
                # Routing metadata lives on the CPU (one copy of topk per call); rows stay on the buffer's device.
                topk_idx = topk_idx.cpu()
                topk_weights = topk_weights.cpu() if topk_weights is not None else None
                fmt = format_code(x.dtype, scales is not None)  # word 0: the row format every rank must share
                per_rank, per_expert, in_rank = routing.dispatch_layout(cfg, topk_idx)
                tokens = [in_rank[:, r].nonzero().flatten() for r in range(w)]
                sent = per_rank.tolist()
                extra = torch.tensor([slot, *sent] if slots is not None else [], dtype=torch.int64)
                for r in range(w):  # rank r's experts' counts: every (token, slot) naming one was sent there
                    counts = per_expert[r * L : (r + 1) * L].long()
                    meta_rows.append(torch.cat([torch.tensor([fmt, sent[r]]), counts, extra]))
            # The layout exchange doubles as the validation agreement: a bad call fails on every rank here.
            got = agree_rows(ctx, error, meta_rows, 2 + L + (1 + w if slots is not None else 0))
            check_formats([int(g[0]) for g in got], self.cfg.ranks)
            recv_counts = [int(g[1]) for g in got]
            place: tuple[list[int], list[int]] | None = None
            matrix: torch.Tensor | None = None
            if slots is not None:
                matrix = torch.stack([g[3 + L :] for g in got])  # [source, destination] rows
                place = ([int(g[2 + L]) for g in got], matrix[:me].sum(0).tolist())
        except BaseException:  # rejected on every rank (or a peer failed): no row moved, no result took the slot
            if slots is not None:
                slots.give_back(slot)
            raise
        if topk_weights is None:
            topk_weights = torch.zeros(topk_idx.shape, dtype=torch.float32)
        with ctx.retire_on_failure("dispatch"):
            if matrix is not None and matrix[:, me].tolist() != recv_counts:  # peers may write into the slot now:
                raise RuntimeError(f"{self.cfg.rank_name(me)}: the layout messages disagree on the rows sent here")
            recv = self._send_rows(x, scales, topk_idx, topk_weights.float(), tokens, recv_counts, place)
        recv = (*recv[:2], recv[2].to(topk_idx.dtype), recv[3])
        return finish_dispatch(ctx, recv, tokens, recv_counts, x.shape[0], expand, alignment, None)

    def dispatch_cached(
        self, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle, error: str | None = None
    ) -> DispatchResult:
        """A dispatch along an earlier one's routing (``handle``), after the handle agreement."""
        ctx, cfg = self.ctx, self.cfg
        error = error or routing.cached_dispatch_error(cfg, ctx.device, x, scales, handle)
        agree_on_handle(ctx, "cached dispatch", handle, error, fmt=(x.dtype, scales is not None) if not error else None)
        dummy_idx = torch.full((x.shape[0], cfg.num_topk), -1, dtype=torch.int64)
        dummy_w = torch.zeros((x.shape[0], cfg.num_topk), dtype=torch.float32)
        with ctx.retire_on_failure("cached dispatch"):
            recv_x, recv_s, _, _ = self._send_rows(
                x, scales, dummy_idx, dummy_w, handle.send_tokens, handle.recv_counts
            )
        return cached_result(ctx, recv_x, recv_s, handle)

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None, bias: Bias,
        error: str | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Combine (see ``EPBuffer.combine``): the handle agreement, then the rows."""
        ctx = self.ctx
        found, biases, weights = routing.check_combine(self.cfg, ctx.device, y, handle, topk_weights, bias, False)
        error = found or error  # ``error``: the caller's verdict on its other arguments (``num_sms``)
        agree_on_handle(ctx, "combine", handle, error, fmt=(y.dtype, False) if not error else None)
        with ctx.retire_on_failure("combine"):
            return self._combine_rows(y, handle, weights, biases)

    def bytes_across_hosts(self) -> int:
        """Bytes this rank has sent to ranks on other hosts through the flat buffer (headers and payloads on
        ``torch``; 0 on ``shm``)."""
        host_of = {r: h for h, g in enumerate(self.cfg.hosts) for r in g}
        me = host_of[self.cfg.rank]
        sent = getattr(self.ctx.buffer.impl, "bytes_sent", None) or []
        return sum(b for r, b in enumerate(sent) if host_of[r] != me)

    def _pack(
        self, dst: int, t: torch.Tensor, x_bytes: torch.Tensor, s_bytes: torch.Tensor | None, ids: torch.Tensor,
        topk_weights: torch.Tensor, out_x: torch.Tensor, out_s: torch.Tensor | None, out_i: torch.Tensor,
        out_w: torch.Tensor,
    ) -> None:  # fmt: skip
        """The fields of the rows of tokens ``t`` for rank ``dst`` (x bytes, scale bytes, local ids int32 with
        -1 where the expert lives elsewhere, weights float32), written into the four given views."""
        L = self.cfg.num_local_experts
        t_dev = t.to(x_bytes.device)
        torch.index_select(x_bytes, 0, t_dev, out=out_x)
        if s_bytes is not None:
            torch.index_select(s_bytes, 0, t_dev, out=out_s)
        loc = ids[t] - dst * L  # an id of -1 lands below 0 too
        out_i.copy_(torch.where((loc >= 0) & (loc < L), loc, -1))
        out_w.copy_(topk_weights[t])  # the views may be on the rows' device; the routing is on the CPU

    def _send_rows(
        self, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
        tokens: list[torch.Tensor], recv_counts: list[int], place: tuple[list[int], list[int]] | None = None,
    ) -> _Fields:  # fmt: skip
        """Move rows; returns (recv_x, recv_scales, recv_idx int32, recv_w float32), rows by source then token.

        Each peer's rows are written into its region (one copy) and copied out by it into the results (the
        second); this rank's own rows go from ``x`` straight into the results, through no region. ``place``:
        ``(slots, starts)``, each rank's result slot (-1: none) and where this rank's rows start in each rank's
        result: a peer with a slot gets the x and scale rows written straight into it (``ep/result_slots``)."""
        w, K, h, me = self.cfg.world_size, self.cfg.num_topk, self.cfg.hidden, self.cfg.rank
        xb, sb = x.element_size() * h, (4 * scales.shape[1] if scales is not None else 0)
        x_bytes = row_bytes(x)
        s_bytes = row_bytes(scales) if scales is not None else None
        ids, topk_weights = topk_idx.long(), topk_weights.float().contiguous()
        total = sum(recv_counts)
        offs = [sum(recv_counts[:r]) for r in range(w + 1)]
        slots, starts = place if place is not None else ([-1] * w, None)
        if slots[me] >= 0:  # the senders write the x and scale rows straight into these
            assert self.ctx.result_slots is not None  # the slot is one of them
            recv_x, recv_s = self.ctx.result_slots.results(slots[me], total, xb, sb)
        else:
            recv_x = self.ctx.host_empty((total, xb), torch.uint8)
            recv_s = self.ctx.host_empty((total, sb), torch.uint8) if s_bytes is not None else None
        recv_i = torch.empty((total, K), dtype=torch.int32)
        recv_w = torch.empty((total, K), dtype=torch.float32)

        # byte offsets of the field blocks of an n-row message, and its end
        def blocks(n: int, slot: int) -> tuple[int, int, int, int]:
            xw, sw = (0, 0) if slot >= 0 else (xb, sb)  # with a slot: the routing fields only
            o_s = align_up(n * xw)
            o_i = align_up(o_s + n * sw)
            o_w = align_up(o_i + n * 4 * K)
            return o_s, o_i, o_w, align_up(o_w + n * 4 * K)

        def in_region(  # the field views of an n-row message in region (or view) v
            v: torch.Tensor, n: int, slot: int
        ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
            o_s, o_i, o_w, _ = blocks(n, slot)
            s = v[o_s : o_s + n * sb].view(n, sb) if s_bytes is not None and slot < 0 else None
            i = v[o_i : o_i + n * 4 * K].view(torch.int32).view(n, K)
            x_rows = v[: n * xb].view(n, xb) if slot < 0 else None
            return x_rows, s, i, v[o_w : o_w + n * 4 * K].view(torch.float32).view(n, K)

        ex = self.ctx.buffer.exchange(self.ctx.region_bytes, tag="dispatch")
        for step in range(1, w + 1):  # the peers first: they can start copying out sooner
            dst = (me + step) % w
            n = tokens[dst].numel()
            if n == 0 or dst == me:
                ex.commit(dst, 0)
                continue
            end = blocks(n, slots[dst])[3]
            o_x, o_s, o_i, o_w = in_region(ex.send_region(dst)[:end], n, slots[dst])
            if slots[dst] >= 0:  # x and scales into the peer's result
                assert self.ctx.result_slots is not None and starts is not None  # the slot is one of them
                o_x = self.ctx.result_slots.area(dst, slots[dst], 0, starts[dst], n, xb)
                o_s = (
                    self.ctx.result_slots.area(dst, slots[dst], 1, starts[dst], n, sb) if s_bytes is not None else None
                )
            assert o_x is not None  # in the region, or in the peer's slot
            self._pack(dst, tokens[dst], x_bytes, s_bytes, ids, topk_weights, o_x, o_s, o_i, o_w)
            ex.commit(dst, end)
        if recv_counts[me]:
            own = _result_rows(recv_x, recv_s, recv_i, recv_w, offs[me], recv_counts[me])
            self._pack(me, tokens[me], x_bytes, s_bytes, ids, topk_weights, *own)
        sizes = [blocks(n, slots[me])[3] if n and src != me else 0 for src, n in enumerate(recv_counts)]
        views = ex.receive(sizes)
        for src, v in enumerate(views):
            n = recv_counts[src]
            if n and src != me:
                got = in_region(v, n, slots[me])
                for out, part in zip(_result_rows(recv_x, recv_s, recv_i, recv_w, offs[src], n), got):
                    if part is not None:
                        assert out is not None  # a field that came has its place in the results
                        out.copy_(part)
        ex.release()
        recv_x = recv_x.view(x.dtype).view(total, h)
        recv_s = recv_s.view(torch.float32).view(total, sb // 4) if recv_s is not None else None
        return recv_x, recv_s, recv_i, recv_w

    def _expert_side(
        self, out: torch.Tensor, y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None, lo: int, n: int
    ) -> None:
        """Combine's expert side for received rows ``[lo, lo + n)`` (one source rank's): their rows of ``y``, or
        with ``expand`` the weighted sum over this rank's experts, written into ``out [n, hidden]``."""
        if not handle.expand:
            out.copy_(y[lo : lo + n])
            return
        assert handle.expanded_slot is not None and weights is not None  # the expanded mode's
        slot = handle.expanded_slot[lo : lo + n]
        keep = torch.where(slot >= 0, 0, -1)
        sum_indexed_rows(out, [y], keep, slot.clamp(min=0), weights[lo : lo + n], portable=self.cfg.portable)

    def combine_unsummed(
        self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """Combine without the source-side sum (see ``EPBuffer.combine_unsummed``): the handle agreement, then the
        rows each rank sends back, copied out of the exchange."""
        ctx = self.ctx
        error, _, weights = routing.check_combine(self.cfg, ctx.device, y, handle, topk_weights, None, False)
        agree_on_handle(ctx, "combine", handle, error, fmt=(y.dtype, False) if not error else None)
        with ctx.retire_on_failure("combine"):
            ex, sources = self._rows_back(y, handle, weights)
            rows = [s.clone() for s in sources]
            ex.release()
        return rows

    def _combine_rows(
        self, y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None, biases: list[torch.Tensor]
    ) -> torch.Tensor:
        """The rows back (:meth:`_rows_back`), then the source-side sum
        (:func:`~epkit.collectives.ep.hier_rows.sum_by_host`: ranks ascending on one host, ep_reference's two-level
        order on several)."""
        ex, sources = self._rows_back(y, handle, weights)
        out = self.ctx.host_empty((handle.num_tokens, self.cfg.hidden), y.dtype)
        sum_by_host(
            out,
            sources,
            handle.send_tokens,
            biases,
            self.cfg.host_lists,
            lambda t: self.ctx.host_empty(t.shape, t.dtype),
            self.cfg.portable,
        )
        ex.release()
        return out

    def _rows_back(
        self, y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None
    ) -> tuple[Exchange, list[torch.Tensor]]:
        """Each source rank's rows written into its region; this rank's own read where they are (``y``, or the
        expert-side sum). Returns the exchange (release it once the rows are read) and, per source rank ``r``,
        ``[len(handle.send_tokens[r]), hidden]`` rows in that order."""
        w, h, me = self.cfg.world_size, self.cfg.hidden, self.cfg.rank
        y = y.contiguous()
        row_bytes = h * y.element_size()
        counts = handle.recv_counts
        offs = [sum(counts[:r]) for r in range(w + 1)]
        ex = self.ctx.buffer.exchange(self.ctx.region_bytes, tag="combine")
        for step in range(1, w):  # the peers; this rank's own rows go through no region
            dst = (me + step) % w
            n = counts[dst]
            if n:
                region = ex.send_region(dst)[: n * row_bytes].view(y.dtype).view(n, h)
                self._expert_side(region, y, handle, weights, offs[dst], n)
            ex.commit(dst, n * row_bytes)
        ex.commit(me, 0)
        own = y[offs[me] : offs[me + 1]]
        if handle.expand:
            own = self.ctx.host_empty((counts[me], h), y.dtype)
            self._expert_side(own, y, handle, weights, offs[me], counts[me])
        views = ex.receive([t.numel() * row_bytes if r != me else 0 for r, t in enumerate(handle.send_tokens)])
        return ex, [own if r == me else v.view(y.dtype).view(-1, h) for r, v in enumerate(views)]


def _result_rows(
    buf_x: torch.Tensor, buf_s: torch.Tensor | None, buf_i: torch.Tensor, buf_w: torch.Tensor, lo: int, n: int
) -> _Fields:
    """Rows ``[lo, lo + n)`` of the results (``_send_rows``'s)."""
    s = buf_s[lo : lo + n] if buf_s is not None else None
    return buf_x[lo : lo + n], s, buf_i[lo : lo + n], buf_w[lo : lo + n]
