"""EPBuffer's low-latency mode (decode): fixed-slot dispatch into the masked layout and its combine.

Every message has a fixed size, so shapes never depend on the routing. Mixed into
:class:`~epkit.collectives.ep_buffer.EPBuffer`; it uses the buffer's ``buffer`` (SymmBuffer),
sizes, ``_guard``/``_reject_locally``, ``_check_topk`` and ``_ll_cache``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epkit.collectives._details.ep_rows import _META_MSG, _al, _block_rows, _copy_rows, reduce_indexed


@dataclass
class LowLatencyHandle:
    """State for :meth:`EPBuffer.low_latency_combine`."""

    num_tokens: int
    dst_of: torch.Tensor  # [T, K] destination rank per slot (-1: none)
    expert_of: torch.Tensor  # [T, K] local expert id on the destination
    pos_of: torch.Tensor  # [T, K] slot position within (source, expert) block
    counts: torch.Tensor  # [W, L] rows received from each source per local expert
    n_max: int = 0  # slots per (source, local expert) of the dispatch


class LowLatencyMixin:
    """``low_latency_dispatch`` / ``low_latency_combine`` of :class:`~epkit.collectives.ep_buffer.EPBuffer`."""

    def _ll_row(self, use_fp8: bool) -> tuple[int, int]:
        """(x bytes, scale bytes) of one low-latency row."""
        h = self.hidden
        return (h, 4 * -(-h // 128)) if use_fp8 else (2 * h, 0)

    def _ll_header(self) -> int:
        """Header of a low-latency message: int32 [status, n_max, use_fp8, count per local expert], error text."""
        return _al(4 * (3 + self.num_local_experts)) + _META_MSG

    @staticmethod
    def _ll_errors(views, hdr: int, n_max: int | None, use_fp8: bool) -> list[str]:
        """Rejections and parameter mismatches seen in the received headers (identical on every rank)."""
        errors = []
        for src, v in enumerate(views):
            head = v[:12].view(torch.int32).tolist()
            if head[0] == -1:
                text = bytes(v[hdr - _META_MSG : hdr].tolist()).rstrip(b"\0").decode(errors="replace")
                errors.append(f"rank {src}: {text}")
            elif n_max is not None and (head[1] != n_max or head[2] != int(use_fp8)):
                errors.append(
                    f"rank {src} used num_max_dispatch_tokens_per_rank={head[1]}, use_fp8={bool(head[2])}"
                    f" but this rank {n_max}, {use_fp8}"
                )
        return errors

    def _ll_outputs(self, n_max: int, use_fp8: bool):
        """Persistent low-latency receive tensors (as DeepEP: valid until the next low-latency dispatch)."""
        key = (n_max, use_fp8)
        if key not in self._ll_cache:
            L, w, h = self.num_local_experts, self.world_size, self.hidden
            if use_fp8:
                recv_x = (
                    torch.zeros((L, n_max * w, h), dtype=torch.float8_e4m3fn, device=self.device),
                    torch.zeros((L, n_max * w, -(-h // 128)), dtype=torch.float32, device=self.device),
                )
            else:
                recv_x = torch.zeros((L, n_max * w, h), dtype=torch.bfloat16, device=self.device)
            self._ll_cache[key] = (recv_x, torch.zeros(L, dtype=torch.int32, device=self.device))
        return self._ll_cache[key]

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        use_fp8: bool = True,
        return_recv_hook: bool = False,
    ):
        """Fixed-slot dispatch into the masked layout (decode).

        Each (token, expert) pair goes to the expert's rank; every message has a
        fixed size, so shapes never depend on the routing.

        Parameters
        ----------
        x : Tensor [T, hidden] bfloat16, T <= num_max_dispatch_tokens_per_rank
        topk_idx : Tensor [T, num_topk] int32/int64 in [-1, num_experts)
        num_max_dispatch_tokens_per_rank : int
            Slots per (source rank, local expert); at most the buffer's capacity.
        use_fp8 : bool
            Send e4m3 rows with float32 per-128 scales (the grouped GEMM's activation format).
        return_recv_hook : bool
            Only send now; ``hook()`` waits and fills the outputs.

        Returns
        -------
        recv_x : Tensor [num_local_experts, N * W, hidden] bf16, or (e4m3 tensor, scales [L, N*W, hidden/128])
            Rows of expert e ordered by source rank, then source token order; rows past
            ``recv_count[e]`` are unspecified. Like DeepEP's, these tensors are owned by the
            buffer and reused: they stay valid until the next low-latency dispatch (clone to keep).
        recv_count : Tensor [num_local_experts] int32
        handle : LowLatencyHandle
        hook : callable; waits for the data (a no-op when ``return_recv_hook`` is False). Call it
            before the next collective on this buffer.
        """
        n_max = num_max_dispatch_tokens_per_rank
        w, L, K, h = self.world_size, self.num_local_experts, self.num_topk, self.hidden
        xb, sb = self._ll_row(use_fp8)
        hdr = self._ll_header()
        # Every message has the same size on every rank (the buffer's capacity, bf16 rows), so a rank that
        # rejects its input still takes part in the exchange, whatever it passed.
        msg_bytes = min(self._region, hdr + L * self.num_max_dispatch_tokens_per_rank * 2 * h)
        error = None
        try:
            if (
                isinstance(n_max, bool)
                or not isinstance(n_max, int)
                or not 0 < n_max <= self.num_max_dispatch_tokens_per_rank
            ):
                raise ValueError(
                    f"num_max_dispatch_tokens_per_rank must be in [1, "
                    f"{self.num_max_dispatch_tokens_per_rank}], got {n_max!r}"
                )
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h or x.dtype != torch.bfloat16:
                raise ValueError(
                    f"x must be bfloat16 [num_tokens, {h}], got {getattr(x, 'dtype', None)} "
                    f"{tuple(getattr(x, 'shape', ()))}"
                )
            if x.device != self.device:
                raise ValueError(f"x is on {x.device} but this EPBuffer moves rows on {self.device}")
            if x.shape[0] > n_max:
                raise ValueError(f"{x.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank = {n_max}")
            self._check_topk(topk_idx, x.shape[0])
            t_num = x.shape[0]
            ids = topk_idx.long().cpu()  # routing metadata on the CPU; rows stay on self.device
            flat = ids.reshape(-1)
            sel = (flat >= 0).nonzero().flatten()  # (t, k) pairs in token order
            order = torch.sort(flat[sel], stable=True).indices
            pairs = sel[order]  # grouped by expert, token order within
            e_sorted = flat[pairs]
            counts_e = torch.bincount(e_sorted, minlength=self.num_experts)
            if counts_e.numel() and int(counts_e.max()) > n_max:
                e = int(counts_e.argmax())
                raise ValueError(
                    f"expert {e} gets {int(counts_e[e])} (token, expert) pairs from this rank, more than "
                    f"its {n_max} slots (duplicate expert ids within a token?)"
                )
            if hdr + L * n_max * (xb + sb) > msg_bytes:
                raise ValueError(f"low-latency message exceeds the {self._region}-byte region")
        except Exception as exc:  # every rank must learn of it through the message header
            error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        ex = self.buffer.exchange(self._region, tag="ll_dispatch")
        if error is not None:
            for dst in range(w):  # tell every rank, finish the exchange so the counters stay in step, then fail
                region = ex.send_region(dst)
                region[:4].view(torch.int32)[0] = -1
                raw = error.encode()[: _META_MSG - 1]
                region[hdr - _META_MSG : hdr - _META_MSG + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
                ex.commit(dst, msg_bytes)
            errors = self._ll_errors(ex.receive([msg_bytes] * w), hdr, None, use_fp8)
            ex.release()
            raise ValueError("low-latency dispatch rejected on every rank: " + "; ".join(errors))
        starts = torch.cumsum(counts_e, 0) - counts_e
        pos_sorted = torch.arange(pairs.numel()) - starts[e_sorted]
        pos_of = torch.full((t_num * K,), -1, dtype=torch.int64)
        pos_of[pairs] = pos_sorted
        dst_of = torch.where(ids >= 0, ids // L, torch.full_like(ids, -1))
        expert_of = torch.where(ids >= 0, ids % L, torch.full_like(ids, -1))
        with self._guard("low-latency dispatch"):
            if use_fp8:
                from epkit.quant import per_token_group_cast_to_fp8

                xq, xs = per_token_group_cast_to_fp8(x, 128)
                x_bytes = xq.view(torch.uint8)
                s_bytes = xs.contiguous().view(torch.uint8).view(t_num, sb)
            else:
                x_bytes = x.contiguous().view(torch.uint8).view(t_num, xb)
                s_bytes = None
            tok_sorted = pairs // K
            counts_by_rank = counts_e.view(w, L)
            for step in range(w):
                dst = (self.rank + step) % w
                region = ex.send_region(dst)
                head = region[: 4 * (3 + L)].view(torch.int32)
                head[0], head[1], head[2] = 0, n_max, int(use_fp8)
                head[3:].copy_(counts_by_rank[dst])
                lo, hi = int(starts[dst * L]), int(starts[dst * L] + counts_by_rank[dst].sum())
                if hi > lo:
                    el = e_sorted[lo:hi] - dst * L
                    slot = el * n_max + pos_sorted[lo:hi]
                    rows = region[hdr : hdr + L * n_max * xb].view(L * n_max, xb)
                    _copy_rows(rows, slot, x_bytes, tok_sorted[lo:hi])
                    if s_bytes is not None:
                        base = hdr + L * n_max * xb
                        srows = region[base : base + L * n_max * sb].view(L * n_max, sb)
                        _copy_rows(srows, slot, s_bytes, tok_sorted[lo:hi])
                ex.commit(dst, msg_bytes)
        recv_x, recv_count = self._ll_outputs(n_max, use_fp8)
        handle = LowLatencyHandle(
            num_tokens=t_num,
            dst_of=dst_of,
            expert_of=expert_of,
            pos_of=pos_of.view(t_num, K),
            counts=torch.zeros((w, L), dtype=torch.int64),
            n_max=n_max,
        )
        state = {"done": False}

        def hook():
            if state["done"]:
                return
            with self._guard("low-latency dispatch receive"):
                views = ex.receive([msg_bytes] * w)
            errors = self._ll_errors(views, hdr, n_max, use_fp8)
            if errors:
                ex.release()
                raise ValueError("low-latency dispatch rejected on every rank: " + "; ".join(errors))
            counts = torch.stack([v[12 : 4 * (3 + L)].view(torch.int32).long() for v in views]).cpu()  # [W, L]
            handle.counts = counts
            xv = recv_x[0] if use_fp8 else recv_x
            x_dst = xv.view(torch.uint8).view(L * n_max * w, xb)
            s_dst = recv_x[1].view(torch.uint8).view(L * n_max * w, sb) if use_fp8 else None
            starts = torch.cumsum(counts, 0) - counts  # [W, L]: where each source's rows start per expert
            for src in range(w):
                src_rows, dst_rows = _block_rows(counts[src], starts[src], n_max, n_max * w)
                if src_rows.numel():
                    v = views[src]
                    _copy_rows(x_dst, dst_rows, v[hdr : hdr + L * n_max * xb].view(L * n_max, xb), src_rows)
                    if s_dst is not None:
                        base = hdr + L * n_max * xb
                        _copy_rows(s_dst, dst_rows, v[base : base + L * n_max * sb].view(L * n_max, sb), src_rows)
            recv_count.copy_(counts.sum(0).to(torch.int32))
            ex.release()
            self.recv_tokens_per_expert_total += counts.sum(0)
            state["done"] = True

        if not return_recv_hook:
            hook()
        return recv_x, recv_count, handle, hook

    def low_latency_combine(
        self,
        y: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        return_recv_hook: bool = False,
    ):
        """Send expert outputs back and reduce them at the source.

        Parameters
        ----------
        y : Tensor [num_local_experts, N * W, hidden] bfloat16 (the masked layout of the dispatch)
        topk_idx, topk_weights : Tensor [T, num_topk] as given to the dispatch (weights float32)
        handle : LowLatencyHandle

        Returns
        -------
        Tensor [T, hidden] bfloat16: ``sum over k ascending of w[t, k] * y_row(t, k)`` in float32
        (and the hook, if ``return_recv_hook``).
        """
        w, L, K, h = self.world_size, self.num_local_experts, self.num_topk, self.hidden
        t_num = handle.num_tokens
        n_max = handle.n_max
        try:
            want = (L, n_max * w, h)
            if (
                not isinstance(y, torch.Tensor)
                or y.dtype != torch.bfloat16
                or tuple(y.shape) != want
                or y.device != self.device
            ):
                raise ValueError(
                    f"y must be bfloat16 {want} on {self.device} (the dispatch's masked layout), got "
                    f"{getattr(y, 'dtype', None)} {tuple(getattr(y, 'shape', ()))} on {getattr(y, 'device', None)}"
                )
            if tuple(topk_idx.shape) != (t_num, K) or tuple(topk_weights.shape) != (t_num, K):
                raise ValueError(f"topk_idx and topk_weights must be [{t_num}, {K}]")
        except ValueError as exc:
            self._reject_locally("low-latency combine", exc)
        row = 2 * h
        msg_bytes = L * n_max * row
        with self._guard("low-latency combine"):
            return self._ll_combine(y, topk_weights, handle, msg_bytes, row, return_recv_hook)

    def _ll_combine(self, y, topk_weights, handle: LowLatencyHandle, msg_bytes: int, row: int, return_recv_hook):
        w, L, h = self.world_size, self.num_local_experts, self.hidden
        t_num, n_max = handle.num_tokens, handle.n_max
        ex = self.buffer.exchange(self._region, tag="ll_combine")
        yb = y.contiguous().view(torch.uint8).view(L, n_max * w, row)
        starts = torch.cumsum(handle.counts, 0) - handle.counts  # [W, L] offset of each source within expert rows
        y_rows = yb.view(L * n_max * w, row)
        for step in range(w):
            src = (self.rank + step) % w
            region = ex.send_region(src)[:msg_bytes].view(L * n_max, row)
            slots, rows = _block_rows(handle.counts[src], starts[src], n_max, n_max * w)
            if slots.numel():
                _copy_rows(region, slots, y_rows, rows)
            ex.commit(src, msg_bytes)
        out = {}

        def hook():
            if "y" in out:
                return out["y"]
            with self._guard("low-latency combine receive"):
                views = ex.receive([msg_bytes] * w)
                sources = [v[: L * n_max * row].view(torch.bfloat16).view(L * n_max, h) for v in views]
                slot = handle.expert_of.clamp(min=0) * n_max + handle.pos_of.clamp(min=0)
                res = torch.empty((t_num, h), dtype=torch.bfloat16, device=y.device)
                reduce_indexed(res, sources, handle.dst_of, slot, topk_weights.float())
                ex.release()
            out["y"] = res
            return out["y"]

        if return_recv_hook:
            return None, hook
        return hook()
