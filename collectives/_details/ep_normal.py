"""EPBuffer's normal mode (prefill): the layout agreement, row moves and the fixed-order combine.

Mixed into :class:`~epkit.collectives.ep_buffer.EPBuffer`, whose ``dispatch`` / ``combine`` validate and
document the calls; this file holds what they run once every rank agreed. It uses the buffer's
``buffer`` (SymmBuffer), sizes, ``region_bytes``, ``retire_on_failure`` / ``_reject_locally`` and
``validate_dispatch``.

A normal-mode message to one destination holds, per row sent there (source token order), the row's
bytes, its FP8 scales, its local expert ids (-1 where the expert lives elsewhere) and its weights, each
field block aligned to ``FIELD_ALIGN``; a rank's rows for itself go through no message (nor do the
combine rows it returns to itself). Result rows on the CPU come from a :class:`RowPool` (pages already
mapped). The layout message before it carries
the row format, the row count and the rows per local expert, or the sender's error text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epkit.collectives._details.ep_hier_rows import sum_by_host
from epkit.collectives._details.ep_rows import (
    META_MSG,
    RowPool,
    align_up,
    check_formats,
    decode_error,
    encode_error,
    expanded_layout,
    format_code,
    reduce_indexed,
)

__all__ = ["DispatchHandle", "NormalModeMixin"]


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
    kernel_state: dict | None = None  # device kernels: the dispatch's layout, routing and row maps (on the device)


class NormalModeMixin:
    """The row-moving half of :class:`~epkit.collectives.ep_buffer.EPBuffer`'s dispatch and combine."""

    def _agree_rows(self, error: str | None, rows: list[torch.Tensor], num_words: int, meanwhile=None):
        """Send each destination its int64 meta row (or this rank's error); raise if any rank failed. ``meanwhile``:
        work of this rank's to do while the messages move (``Exchange.receive``'s). Returns the rows received."""
        w = self.world_size
        nbytes = num_words * 8 + META_MSG
        send = []
        for r in range(w):
            msg = torch.zeros(nbytes, dtype=torch.uint8)
            if error is None:
                msg[: num_words * 8].copy_(rows[r].view(torch.uint8))
            else:
                msg[:8].view(torch.int64)[0] = -1
                msg[num_words * 8 :].copy_(encode_error(error))
            send.append(msg)
        got = self.buffer.all_to_all(send, [nbytes] * w, self.region_bytes, tag="layout", meanwhile=meanwhile)
        errors = []
        for src, g in enumerate(got):
            if int(g[:8].view(torch.int64)[0]) == -1:
                errors.append(f"rank {src}: {decode_error(g[num_words * 8 :])}")
        if errors:
            raise ValueError("dispatch rejected on every rank before any data moved: " + "; ".join(errors))
        return [g[: num_words * 8].view(torch.int64) for g in got]

    def _flat_dispatch(self, error, x, scales, topk_idx, topk_weights, alignment: int, expand: bool):
        """Normal dispatch on a flat buffer; ``error``: this rank's validation verdict (None: valid). The layout
        agreement tells each destination the row format, the rows and the rows per local expert it gets from here;
        with result slots (``self.result_slots``, ``ep_result_slots``) also the slot this rank's results take (-1: none
        free) and the rows this rank sends every rank, so that a sender knows where its rows start in each
        receiver's result."""
        w, L, me = self.world_size, self.num_local_experts, self.rank
        slot = self.result_slots.take() if self.result_slots is not None else -1
        try:
            meta_rows, tokens = [], []
            if error is None:
                # Routing metadata lives on the CPU (one copy of topk per call); rows stay on self.device.
                topk_idx = topk_idx.cpu()
                topk_weights = topk_weights.cpu() if topk_weights is not None else None
                fmt = format_code(x.dtype, scales is not None)  # word 0: the row format every rank must share
                per_rank, per_expert, in_rank = self.get_dispatch_layout(topk_idx)
                tokens = [in_rank[:, r].nonzero().flatten() for r in range(w)]
                sent = per_rank.tolist()
                extra = torch.tensor([slot, *sent] if self.result_slots is not None else [], dtype=torch.int64)
                for r in range(w):  # rank r's experts' counts: every (token, slot) naming one was sent there
                    counts = per_expert[r * L : (r + 1) * L].long()
                    meta_rows.append(torch.cat([torch.tensor([fmt, sent[r]]), counts, extra]))
            # The layout exchange doubles as the validation agreement: a bad call fails on every rank here.
            got = self._agree_rows(error, meta_rows, 2 + L + (1 + w if self.result_slots is not None else 0))
            check_formats([int(g[0]) for g in got])
            recv_counts = [int(g[1]) for g in got]
            place = matrix = None
            if self.result_slots is not None:
                matrix = torch.stack([g[3 + L :] for g in got])  # [source, destination] rows
                place = ([int(g[2 + L]) for g in got], matrix[:me].sum(0).tolist())
        except BaseException:  # rejected on every rank (or a peer failed): no row moved, no result took the slot
            if self.result_slots is not None:
                self.result_slots.give_back(slot)
            raise
        if topk_weights is None:
            topk_weights = torch.zeros(topk_idx.shape, dtype=torch.float32)
        with self.retire_on_failure("dispatch"):
            if matrix is not None and matrix[:, me].tolist() != recv_counts:  # peers may write into the slot now:
                raise RuntimeError(f"rank {me}: the layout messages disagree on the rows sent here")  # retired
            recv = self._send_rows(x, scales, topk_idx, topk_weights.float(), tokens, recv_counts, place)
        recv_x, recv_scales, recv_idx, recv_w = recv
        recv_idx = recv_idx.to(topk_idx.dtype)
        return self._finish_dispatch(
            recv_x, recv_scales, recv_idx, recv_w, tokens, recv_counts, x.shape[0], expand, alignment
        )

    def _host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A result tensor for rows on the buffer's device; on the CPU from the buffer's :class:`RowPool`."""
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=self.device)
        pool = self.__dict__.get("_row_pool")
        if pool is None:
            pool = self.__dict__["_row_pool"] = RowPool()
        return pool.empty(shape, dtype)

    def _pack(self, dst, t, x_bytes, s_bytes, ids, topk_weights, out_x, out_s, out_i, out_w):
        """The fields of the rows of tokens ``t`` for rank ``dst`` (x bytes, scale bytes, local ids int32 with
        -1 where the expert lives elsewhere, weights float32), written into the four given views."""
        L = self.num_local_experts
        t_dev = t.to(x_bytes.device)
        torch.index_select(x_bytes, 0, t_dev, out=out_x)
        if s_bytes is not None:
            torch.index_select(s_bytes, 0, t_dev, out=out_s)
        loc = ids[t] - dst * L  # an id of -1 lands below 0 too
        out_i.copy_(torch.where((loc >= 0) & (loc < L), loc, -1))
        out_w.copy_(topk_weights[t])  # the views may be on the rows' device; the routing is on the CPU

    def _send_rows(self, x, scales, topk_idx, topk_weights, tokens, recv_counts, place=None):
        """Move rows; returns (recv_x, recv_scales, recv_idx int32, recv_w float32), rows by source then token.

        Each peer's rows are written into its region (one copy) and copied out by it into the results (the
        second); this rank's own rows go from ``x`` straight into the results, through no region. ``place``:
        ``(slots, starts)``, each rank's result slot (-1: none) and where this rank's rows start in each rank's
        result: a peer with a slot gets the x and scale rows written straight into it (``ep_result_slots``)."""
        w, K, h, me = self.world_size, self.num_topk, self.hidden, self.rank
        xb, sb = x.element_size() * h, (4 * scales.shape[1] if scales is not None else 0)
        x_bytes = x.contiguous().view(torch.uint8).view(x.shape[0], xb)
        s_bytes = scales.contiguous().view(torch.uint8).view(x.shape[0], sb) if scales is not None else None
        ids, topk_weights = topk_idx.long(), topk_weights.float().contiguous()
        total = sum(recv_counts)
        offs = [sum(recv_counts[:r]) for r in range(w + 1)]
        slots, starts = place if place is not None else ([-1] * w, None)
        if slots[me] >= 0:  # the senders write the x and scale rows straight into these
            recv_x, recv_s = self.result_slots.results(slots[me], total, xb, sb)
        else:
            recv_x = self._host_empty((total, xb), torch.uint8)
            recv_s = self._host_empty((total, sb), torch.uint8) if s_bytes is not None else None
        recv_i = torch.empty((total, K), dtype=torch.int32)
        recv_w = torch.empty((total, K), dtype=torch.float32)

        def blocks(n, slot):  # byte offsets of the field blocks of an n-row message, and its end
            xw, sw = (0, 0) if slot >= 0 else (xb, sb)  # with a slot: the routing fields only
            o_s = align_up(n * xw)
            o_i = align_up(o_s + n * sw)
            o_w = align_up(o_i + n * 4 * K)
            return o_s, o_i, o_w, align_up(o_w + n * 4 * K)

        def fields(buf_x, buf_s, buf_i, buf_w, lo, n):  # rows [lo, lo + n) of the results
            s = buf_s[lo : lo + n] if buf_s is not None else None
            return buf_x[lo : lo + n], s, buf_i[lo : lo + n], buf_w[lo : lo + n]

        def in_region(v, n, slot):  # the field views of an n-row message in region (or view) v
            o_s, o_i, o_w, _ = blocks(n, slot)
            s = v[o_s : o_s + n * sb].view(n, sb) if s_bytes is not None and slot < 0 else None
            i = v[o_i : o_i + n * 4 * K].view(torch.int32).view(n, K)
            x_rows = v[: n * xb].view(n, xb) if slot < 0 else None
            return x_rows, s, i, v[o_w : o_w + n * 4 * K].view(torch.float32).view(n, K)

        ex = self.buffer.exchange(self.region_bytes, tag="dispatch")
        for step in range(1, w + 1):  # the peers first: they can start copying out sooner
            dst = (me + step) % w
            n = tokens[dst].numel()
            if n == 0 or dst == me:
                ex.commit(dst, 0)
                continue
            end = blocks(n, slots[dst])[3]
            o_x, o_s, o_i, o_w = in_region(ex.send_region(dst)[:end], n, slots[dst])
            if slots[dst] >= 0:  # x and scales into the peer's result
                o_x = self.result_slots.area(dst, slots[dst], 0, starts[dst], n, xb)
                o_s = self.result_slots.area(dst, slots[dst], 1, starts[dst], n, sb) if s_bytes is not None else None
            self._pack(dst, tokens[dst], x_bytes, s_bytes, ids, topk_weights, o_x, o_s, o_i, o_w)
            ex.commit(dst, end)
        if recv_counts[me]:
            own = fields(recv_x, recv_s, recv_i, recv_w, offs[me], recv_counts[me])
            self._pack(me, tokens[me], x_bytes, s_bytes, ids, topk_weights, *own)
        sizes = [blocks(n, slots[me])[3] if n and src != me else 0 for src, n in enumerate(recv_counts)]
        views = ex.receive(sizes)
        for src, v in enumerate(views):
            n = recv_counts[src]
            if n and src != me:
                got = in_region(v, n, slots[me])
                for out, part in zip(fields(recv_x, recv_s, recv_i, recv_w, offs[src], n), got):
                    if part is not None:
                        out.copy_(part)
        ex.release()
        recv_x = recv_x.view(x.dtype).view(total, h)
        recv_s = recv_s.view(torch.float32).view(total, sb // 4) if recv_s is not None else None
        return recv_x, recv_s, recv_i, recv_w

    def _finish_dispatch(
        self, recv_x, recv_scales, recv_idx, recv_w, tokens, recv_counts, num_tokens, expand, alignment
    ):
        L = self.num_local_experts
        counts = torch.bincount(recv_idx.reshape(-1).long() + 1, minlength=L + 1)[1:]  # bin 0: the -1 entries
        self.recv_tokens_per_expert_total += counts
        aligned = [int(-(-c // alignment) * alignment) for c in counts.tolist()]
        rows = slot = None
        x_out = (recv_x, recv_scales) if recv_scales is not None else recv_x
        if expand:
            rows, slot = expanded_layout(recv_idx, counts, alignment)
            x_out = self._expanded(recv_x, recv_scales, rows)
        handle = DispatchHandle(
            send_tokens=tokens,
            recv_counts=recv_counts,
            num_tokens=num_tokens,
            recv_topk_idx=recv_idx,
            recv_topk_weights=recv_w,
            expand=expand,
            expert_alignment=alignment,
            expanded_rows=rows,
            expanded_slot=slot,
            device=self.device,
            buffer_id=self.buffer.buffer_id,
            epoch=self._dispatches,
        )
        return x_out, recv_idx.to(self.device), recv_w.to(self.device), aligned, handle

    def _expanded(self, recv_x, recv_s, rows: torch.Tensor):
        """The expanded rows (``rows``: received row per expanded row, -1 = a zero padding row), as dispatch
        returns them: ``x`` or ``(x, scales)``."""
        from epkit.gather import gather_rows

        rows_dev = rows.to(self.device)
        out = [
            gather_rows(part, rows_dev, out=self._host_empty((rows.numel(), part.shape[1]), part.dtype))
            for part in (recv_x, recv_s)
            if part is not None
        ]
        return tuple(out) if len(out) == 2 else out[0]

    def agree_on_handle(self, what: str, handle, error: str | None, meanwhile=None) -> None:
        """Before any row of a combine or cached dispatch moves: every rank tells every rank which dispatch its
        handle comes from, or why its call is invalid (one small exchange; on the device path one kernel).
        Raises the same ValueError on every rank unless every call is valid and every handle is this buffer's,
        from one and the same dispatch (a handle of another buffer, or a stale one on some ranks, would pair
        rows that do not belong together). The buffer stays usable either way. ``meanwhile``: work of this rank's
        to do while the messages move."""
        if self._dev is not None:
            if meanwhile is not None:
                meanwhile()
            self._dev_agree(what, handle, error)
            return
        w = self.world_size
        head = torch.zeros(3, dtype=torch.int64)
        if error is None:
            head[:] = torch.tensor([0, handle.buffer_id, handle.epoch])
        else:
            head[0] = -1
        msg = torch.cat([head.view(torch.uint8), encode_error(error or "")])
        got = self.buffer.all_to_all(
            [msg] * w, [msg.numel()] * w, self.region_bytes, tag=f"{what} agreement", meanwhile=meanwhile
        )
        heads = [g[:24].view(torch.int64).tolist() for g in got]
        self.judge_agreement(what, heads, lambda r: decode_error(got[r][24:]))

    def judge_agreement(self, what: str, heads: list[list[int]], text_of) -> None:
        """The agreement's verdict from every rank's ``[status (0: valid), buffer id, dispatch epoch]``;
        ``text_of(rank)`` reads a rejecting rank's error text. The same ValueError on every rank, or None."""
        errors = [f"rank {r}: {text_of(r)}" for r, h in enumerate(heads) if h[0] != 0]
        if errors:
            raise ValueError(f"{what} rejected on every rank before any row moved: " + "; ".join(errors))
        if any(h[1:] != heads[0][1:] for h in heads) or heads[0][1] != self.buffer.buffer_id:
            desc = "; ".join(
                f"rank {r}: {'this buffer' if h[1] == self.buffer.buffer_id else f'another buffer ({h[1]:x})'}"
                f"'s dispatch {h[2]}"
                for r, h in enumerate(heads)
            )
            raise ValueError(
                f"{what} rejected on every rank before any row moved: the handles do not come from one dispatch of "
                f"this buffer ({desc}); give every rank the handle its matching dispatch returned"
            )

    def _dispatch_cached(self, x, scales, handle: DispatchHandle):
        error = None
        try:
            if not isinstance(handle, DispatchHandle):
                raise ValueError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
            if not isinstance(x, torch.Tensor) or x.dim() != 2:
                raise ValueError(f"x must be [num_tokens, {self.hidden}]")
            self.validate_dispatch(
                x,
                scales,
                torch.zeros((x.shape[0], self.num_topk), dtype=torch.int64),
                None,
                self.num_max_tokens_per_rank,
            )
            if x.shape[0] != handle.num_tokens:
                raise ValueError(
                    f"cached dispatch: x has {x.shape[0]} tokens, the handle was made for {handle.num_tokens}"
                )
        except Exception as exc:  # noqa: BLE001 -- every rank must learn of it in the agreement
            error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        self.agree_on_handle("cached dispatch", handle, error)
        if self._dev is not None:
            return self._dev_dispatch_cached(x, scales, handle)
        dummy_idx = torch.full((x.shape[0], self.num_topk), -1, dtype=torch.int64)
        dummy_w = torch.zeros((x.shape[0], self.num_topk), dtype=torch.float32)
        with self.retire_on_failure("cached dispatch"):
            recv_x, recv_s, _, _ = self._send_rows(
                x, scales, dummy_idx, dummy_w, handle.send_tokens, handle.recv_counts
            )
        x_out = (recv_x, recv_s) if recv_s is not None else recv_x
        if handle.expand:
            x_out = self._expanded(recv_x, recv_s, handle.expanded_rows)
        L, a = self.num_local_experts, handle.expert_alignment
        counts = torch.bincount(handle.recv_topk_idx[handle.recv_topk_idx >= 0].long(), minlength=L)
        aligned = [int(-(-c // a) * a) for c in counts.tolist()]
        return x_out, handle.recv_topk_idx.to(self.device), handle.recv_topk_weights.to(self.device), aligned, handle

    def _expert_side(self, out, y, handle: DispatchHandle, weights, lo: int, n: int) -> None:
        """Combine's expert side for received rows ``[lo, lo + n)`` (one source rank's): their rows of ``y``, or
        with ``expand`` the weighted sum over this rank's experts, written into ``out [n, hidden]``."""
        if not handle.expand:
            out.copy_(y[lo : lo + n])
            return
        slot = handle.expanded_slot[lo : lo + n]
        reduce_indexed(out, [y], torch.where(slot >= 0, 0, -1), slot.clamp(min=0), weights[lo : lo + n])

    def _combine_rows(self, y, handle: DispatchHandle, weights, biases) -> torch.Tensor:
        """Each source rank's rows written into its region; this rank's own read where they are (``y``, or the
        expert-side sum); then the source-side sum (:func:`~epkit.collectives._details.ep_hier_rows.sum_by_host`:
        ranks ascending on one host, ep_reference's two-level order on several)."""
        w, h, me = self.world_size, self.hidden, self.rank
        y = y.contiguous()
        row_bytes = h * y.element_size()
        counts = handle.recv_counts
        offs = [sum(counts[:r]) for r in range(w + 1)]
        ex = self.buffer.exchange(self.region_bytes, tag="combine")
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
            own = self._host_empty((counts[me], h), y.dtype)
            self._expert_side(own, y, handle, weights, offs[me], counts[me])
        views = ex.receive([t.numel() * row_bytes if r != me else 0 for r, t in enumerate(handle.send_tokens)])
        sources = [own if r == me else v.view(y.dtype).view(-1, h) for r, v in enumerate(views)]
        out = self._host_empty((handle.num_tokens, h), y.dtype)
        sum_by_host(out, sources, handle.send_tokens, biases, self.hosts, lambda t: self._host_empty(t.shape, t.dtype))
        ex.release()
        return out
