"""EPBuffer's normal mode (prefill): the layout agreement, row moves and the fixed-order combine.

Mixed into :class:`~epkit.collectives.ep_buffer.EPBuffer`, whose ``dispatch`` / ``combine`` validate and
document the calls; this file holds what they run once every rank agreed. It uses the buffer's
``buffer`` (SymmBuffer), sizes, ``region_bytes``, ``retire_on_failure`` / ``_reject_locally`` and
``validate_dispatch``.

A normal-mode message to one destination holds, per row sent there (source token order), the row's
bytes, its FP8 scales, its local expert ids (-1 where the expert lives elsewhere), its weights and its
source token index, each field block aligned to ``FIELD_ALIGN``. The layout message before it carries
the row format, the row count and the rows per local expert, or the sender's error text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epkit.collectives._details.ep_rows import (
    META_MSG,
    align_up,
    decode_error,
    encode_error,
    expanded_layout,
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

    def _agree_rows(self, error: str | None, rows: list[torch.Tensor], num_words: int) -> list[torch.Tensor]:
        """Send each destination its int64 meta row (or this rank's error); raise if any rank failed."""
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
        got = self.buffer.all_to_all(send, [nbytes] * w, self.region_bytes, tag="layout")
        errors = []
        for src, g in enumerate(got):
            if int(g[:8].view(torch.int64)[0]) == -1:
                errors.append(f"rank {src}: {decode_error(g[num_words * 8 :])}")
        if errors:
            raise ValueError("dispatch rejected on every rank before any data moved: " + "; ".join(errors))
        return [g[: num_words * 8].view(torch.int64) for g in got]

    def _send_rows(self, x, scales, topk_idx, topk_weights, tokens, recv_counts):
        """Move rows; returns (recv_x, recv_scales, recv_idx int32, recv_w float32), rows by source then token."""
        w, L, K, h = self.world_size, self.num_local_experts, self.num_topk, self.hidden
        xb, sb = x.element_size() * h, (4 * scales.shape[1] if scales is not None else 0)
        x_bytes = x.contiguous().view(torch.uint8).view(x.shape[0], xb)
        s_bytes = scales.contiguous().view(torch.uint8).view(x.shape[0], sb) if scales is not None else None
        ids = topk_idx.long()
        ex = self.buffer.exchange(self.region_bytes, tag="dispatch")

        def blocks(n):  # byte offsets of the field blocks of an n-row message
            o_x = 0
            o_s = align_up(o_x + n * xb)
            o_i = align_up(o_s + n * sb)
            o_w = align_up(o_i + n * 4 * K)
            o_t = align_up(o_w + n * 4 * K)
            return o_x, o_s, o_i, o_w, o_t, align_up(o_t + n * 4)

        for step in range(w):
            dst = (self.rank + step) % w
            t = tokens[dst]
            n = t.numel()
            if n == 0:
                ex.commit(dst, 0)
                continue
            o_x, o_s, o_i, o_w, o_t, end = blocks(n)
            region = ex.send_region(dst)
            t_dev = t.to(x_bytes.device)
            torch.index_select(x_bytes, 0, t_dev, out=region[o_x : o_x + n * xb].view(n, xb))
            if s_bytes is not None:
                torch.index_select(s_bytes, 0, t_dev, out=region[o_s : o_s + n * sb].view(n, sb))
            loc = ids[t] - dst * L
            loc = torch.where((ids[t] >= 0) & (loc >= 0) & (loc < L), loc, -1)
            region[o_i : o_i + n * 4 * K].view(torch.int32).view(n, K).copy_(loc)
            region[o_w : o_w + n * 4 * K].view(torch.float32).view(n, K).copy_(topk_weights[t])
            region[o_t : o_t + n * 4].view(torch.int32).copy_(t)
            ex.commit(dst, end)
        total = sum(recv_counts)
        recv_x = torch.empty((total, xb), dtype=torch.uint8, device=self.device)
        recv_s = torch.empty((total, sb), dtype=torch.uint8, device=self.device) if s_bytes is not None else None
        recv_i = torch.empty((total, K), dtype=torch.int32)
        recv_w = torch.empty((total, K), dtype=torch.float32)
        views = ex.receive([blocks(n)[5] if n else 0 for n in recv_counts])
        row = 0
        for src, v in enumerate(views):
            n = recv_counts[src]
            if n:
                o_x, o_s, o_i, o_w, _, _ = blocks(n)
                recv_x[row : row + n].copy_(v[o_x : o_x + n * xb].view(n, xb))
                if recv_s is not None:
                    recv_s[row : row + n].copy_(v[o_s : o_s + n * sb].view(n, sb))
                recv_i[row : row + n].copy_(v[o_i : o_i + n * 4 * K].view(torch.int32).view(n, K))
                recv_w[row : row + n].copy_(v[o_w : o_w + n * 4 * K].view(torch.float32).view(n, K))
            row += n
        ex.release()
        recv_x = recv_x.view(x.dtype).view(total, h)
        recv_s = recv_s.view(torch.float32).view(total, sb // 4) if recv_s is not None else None
        return recv_x, recv_s, recv_i, recv_w

    def _finish_dispatch(
        self, recv_x, recv_scales, recv_idx, recv_w, tokens, recv_counts, num_tokens, expand, alignment
    ):
        L = self.num_local_experts
        valid = recv_idx >= 0
        counts = torch.bincount(recv_idx[valid].long(), minlength=L)
        self.recv_tokens_per_expert_total += counts
        aligned = [int(-(-c // alignment) * alignment) for c in counts.tolist()]
        rows = slot = None
        out_x, out_s = recv_x, recv_scales
        if expand:
            rows, slot = expanded_layout(recv_idx, counts, alignment)
            from epkit.gather import gather_rows

            rows_dev = rows.to(self.device)
            out_x = gather_rows(recv_x, rows_dev)
            out_s = gather_rows(recv_scales, rows_dev) if recv_scales is not None else None
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
        x_out = (out_x, out_s) if out_s is not None else out_x
        return x_out, recv_idx.to(self.device), recv_w.to(self.device), aligned, handle

    def agree_on_handle(self, what: str, handle, error: str | None) -> None:
        """Before any row of a combine or cached dispatch moves: every rank tells every rank which dispatch its
        handle comes from, or why its call is invalid (one small exchange; on the device path one kernel).
        Raises the same ValueError on every rank unless every call is valid and every handle is this buffer's,
        from one and the same dispatch (a handle of another buffer, or a stale one on some ranks, would pair
        rows that do not belong together). The buffer stays usable either way."""
        if self._dev is not None:
            self._dev_agree(what, handle, error)
            return
        w = self.world_size
        head = torch.zeros(3, dtype=torch.int64)
        if error is None:
            head[:] = torch.tensor([0, handle.buffer_id, handle.epoch])
        else:
            head[0] = -1
        msg = torch.cat([head.view(torch.uint8), encode_error(error or "")])
        got = self.buffer.all_to_all([msg] * w, [msg.numel()] * w, self.region_bytes, tag=f"{what} agreement")
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
        out_x, out_s = recv_x, recv_s
        if handle.expand:
            from epkit.gather import gather_rows

            rows_dev = handle.expanded_rows.to(self.device)
            out_x = gather_rows(recv_x, rows_dev)
            out_s = gather_rows(recv_s, rows_dev) if recv_s is not None else None
        x_out = (out_x, out_s) if out_s is not None else out_x
        L, a = self.num_local_experts, handle.expert_alignment
        counts = torch.bincount(handle.recv_topk_idx[handle.recv_topk_idx >= 0].long(), minlength=L)
        aligned = [int(-(-c // a) * a) for c in counts.tolist()]
        return x_out, handle.recv_topk_idx.to(self.device), handle.recv_topk_weights.to(self.device), aligned, handle

    def _combine_rows(self, y, handle: DispatchHandle, weights, biases) -> torch.Tensor:
        w, h = self.world_size, self.hidden
        y = y.contiguous()
        es = y.element_size()
        row_bytes = h * es
        ex = self.buffer.exchange(self.region_bytes, tag="combine")
        offs = [0]
        for c in handle.recv_counts:
            offs.append(offs[-1] + c)
        y_bytes = y.view(torch.uint8).view(-1, row_bytes)
        for step in range(w):
            dst = (self.rank + step) % w
            n = handle.recv_counts[dst]
            if n:
                region = ex.send_region(dst)[: n * row_bytes]
                if handle.expand:
                    # Expert side: the weighted sum over this rank's experts, written straight into dst's region.
                    slot = handle.expanded_slot[offs[dst] : offs[dst] + n]
                    reduce_indexed(
                        region.view(y.dtype).view(n, h),
                        [y],
                        torch.where(slot >= 0, 0, -1),
                        slot.clamp(min=0),
                        weights[offs[dst] : offs[dst] + n],
                    )
                else:
                    region.view(n, row_bytes).copy_(y_bytes[offs[dst] : offs[dst] + n])
            ex.commit(dst, n * row_bytes)
        views = ex.receive([t.numel() * row_bytes for t in handle.send_tokens])
        # Source side: sum over destination ranks ascending, reading the received rows in place.
        src_of = torch.full((handle.num_tokens, w), -1, dtype=torch.int64)
        row_of = torch.zeros((handle.num_tokens, w), dtype=torch.int64)
        for r in range(w):
            t = handle.send_tokens[r]
            if t.numel():
                src_of[t, r] = r
                row_of[t, r] = torch.arange(t.numel(), dtype=torch.int64)
        sources = [v.view(y.dtype).view(-1, h) for v in views]
        out = torch.empty((handle.num_tokens, h), dtype=y.dtype, device=y.device)
        reduce_indexed(out, sources, src_of, row_of, None, biases)
        ex.release()
        return out
