"""EPBuffer's low-latency mode (decode): fixed-slot dispatch into the masked layout and its combine.

Every message has a fixed size and every row move is described by fixed-length address lists
built with tensor ops (a 0 address skips a row), so neither shapes nor the host's work depend
on the routing. Two ways to run it, one protocol:

- **host-checked** (CPU rows): the routing and the received headers are read on the host, so a bad
  input raises ``ValueError`` on every rank in the same call; rows move through ``epkit._C``, and a message
  holds only its rows (``ep_low_latency_packed``: the torch transport sends those bytes, not the region).
- **stream-ordered** (CUDA rows; on CPU when ``ep_rows.PORTABLE`` is set, which is how the tests run
  it): no host read of any routing-dependent value and no waiting for the device. Waits for peers are
  timed device waits (``SymmBuffer.exchange(deferred=True)``); rows move through the Triton
  address-list kernel; invalid expert ids, slot overflow and peers' rejections are found on the
  device, carried in the message headers, and raised as ``ValueError`` on every rank by a later call
  (or by :meth:`EPBuffer.synchronize`), the rows of the failing call being unspecified. Since the
  ranks learn of it at different calls, such a failure retires the buffer on every rank (later calls
  raise RuntimeError naming it): create a new EPBuffer. The header status words (3 per source)
  reach the host through pinned (mapped) memory, stored there by the row-copy kernel on the stream
  (no device-to-host memcpy), and a later call reads them once the stream has passed them.

Mixed into :class:`~epkit.collectives.ep_buffer.EPBuffer`; it uses the buffer's ``buffer`` (SymmBuffer),
sizes, ``region_bytes``, ``retire_on_failure``/``_reject_locally``, ``_check_topk`` and ``_ll_cache`` (the pool of
the tensors the calls return, ``ep_low_latency_out``).
"""

from __future__ import annotations

import torch

from epkit.collectives._details import ep_low_latency_out as outputs
from epkit.collectives._details import ep_low_latency_packed as packed
from epkit.collectives._details import ep_rows
from epkit.collectives._details.ep_low_latency_layout import (
    COMBINE_HEADER,
    OK,
    REJECTED,
    LowLatencyHandle,
    describe_handles,
    judge_headers,
    message_spacing,
    route_pairs,
    slot_grid,
    unpack_slots,
)
from epkit.collectives._details.ep_rows import (
    META_MSG,
    align_up,
    decode_error,
    device_table,
    encode_error,
    move_rows,
    reduce_gathered,
    reduce_indexed,
)
from epkit.kernels.triton.ep_layout import check_aligned

__all__ = ["LowLatencyMixin"]


class LowLatencyMixin:
    """``low_latency_dispatch`` / ``low_latency_combine`` of :class:`~epkit.collectives.ep_buffer.EPBuffer`."""

    def _ll_stream_ordered(self) -> bool:
        """Whether low-latency calls run without host reads of routing data (CUDA rows, PORTABLE on CPU, or the
        device kernels)."""
        return self.device.type != "cpu" or ep_rows.PORTABLE[0] or self._dev is not None

    def _ll_row(self, use_fp8: bool) -> tuple[int, int]:
        """(x bytes, scale bytes) of one low-latency row."""
        h = self.hidden
        return (h, 4 * -(-h // 128)) if use_fp8 else (2 * h, 0)

    def _ll_header(self) -> int:
        """Header of a low-latency message: int32 [status, n_max, use_fp8, count per local expert], error text."""
        return align_up(4 * (3 + self.num_local_experts)) + META_MSG

    def _ll_heads(self, views) -> torch.Tensor:
        """The received headers' int words ``[W, 3 + L]`` (a copy: the views are reused by later messages)."""
        n = 3 + self.num_local_experts
        return torch.stack([v[: 4 * n].view(torch.int32) for v in views])

    def _ll_errors(self, heads: torch.Tensor, views, hdr: int, check_params: bool) -> list[str]:
        """Rejections (and, with ``check_params``, parameter mismatches) in the received headers
        (``_ll_heads``), read on the host; worded alike on every rank."""
        return judge_headers(
            heads[:, :3].tolist(), lambda src: decode_error(views[src][hdr - META_MSG : hdr]), check_params
        )

    def _ll_defer_errors(self, heads: torch.Tensor, views, hdr: int, n_max: int, use_fp8: bool) -> torch.Tensor:
        """Stream-ordered check of the headers (``_ll_heads``): recorded for a later call; returns the ``[W]``
        rows-are-valid mask."""
        texts = torch.stack([v[hdr - META_MSG : hdr] for v in views])  # read on the host only if rejected
        w = self.world_size

        def judge(values):
            heads3 = [values[3 * src : 3 * src + 3] for src in range(w)]
            errors = judge_headers(heads3, lambda src: decode_error(texts[src]), True)
            if errors:
                return ValueError("low-latency dispatch rejected on every rank: " + "; ".join(errors))
            return None

        self.buffer.deferred.record(heads[:, :3].long().reshape(-1), judge, self.timeout, "low-latency dispatch")
        return (heads[:, 0] == OK) & (heads[:, 1] == n_max) & (heads[:, 2] == int(use_fp8))

    def _addresses(self, values: list[int]) -> torch.Tensor:
        """``values`` (addresses of regions, a handle's identity) as a cached int64 table on the rows' device."""
        return device_table(self.__dict__.setdefault("_addr_tables", {}), values, self.device)

    def _ll_check_host(self, x, topk_idx, n_max: int, use_fp8: bool, out) -> None:
        """Validation needing no data (every mode), then, host-checked mode only, the data checks."""
        h, cap = self.hidden, self.num_max_dispatch_tokens_per_rank
        if isinstance(n_max, bool) or not isinstance(n_max, int) or not 0 < n_max <= cap:
            raise ValueError(f"num_max_dispatch_tokens_per_rank must be in [1, {cap}], got {n_max!r}")
        outputs.check_dispatch_out(out, self.num_local_experts, n_max * self.world_size, h, use_fp8, self.device)
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h or x.dtype != torch.bfloat16:
            raise ValueError(
                f"x must be bfloat16 [num_tokens, {h}], got {getattr(x, 'dtype', None)} "
                f"{tuple(getattr(x, 'shape', ()))}"
            )
        if x.device != self.device:
            raise ValueError(f"x is on {x.device} but this EPBuffer moves rows on {self.device}")
        if x.shape[0] > n_max:
            raise ValueError(f"{x.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank = {n_max}")
        if not isinstance(topk_idx, torch.Tensor) or tuple(topk_idx.shape) != (x.shape[0], self.num_topk):
            raise ValueError(
                f"topk_idx must be [{x.shape[0]}, {self.num_topk}], got {tuple(getattr(topk_idx, 'shape', ()))}"
            )
        if topk_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
        if self._ll_stream_ordered():
            if topk_idx.device != self.device:
                raise ValueError(f"topk_idx is on {topk_idx.device}; the low-latency path needs it on {self.device}")
        else:
            self._check_topk(topk_idx, x.shape[0])

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        use_fp8: bool = True,
        return_recv_hook: bool = False,
        out=None,
    ):
        """Fixed-slot dispatch into the masked layout (decode).

        Each (token, expert) pair goes to the expert's rank into fixed slots, so shapes never
        depend on the routing (on CUDA rows neither do the messages' sizes). On CUDA rows the call never
        waits for the device (see the module docstring: errors found on the device are
        raised by a later call on every rank, or by :meth:`EPBuffer.synchronize`).

        Parameters
        ----------
        x : Tensor [T, hidden] bfloat16, T <= num_max_dispatch_tokens_per_rank
        topk_idx : Tensor [T, num_topk] int32/int64 in [-1, num_experts), on the buffer's device
        num_max_dispatch_tokens_per_rank : int
            Slots per (source rank, local expert); at most the buffer's capacity.
        use_fp8 : bool
            Send e4m3 rows with float32 per-128 scales (the grouped GEMM's activation format).
        return_recv_hook : bool
            Only send now; ``hook()`` waits and fills the outputs.
        out : the receive tensor(s) to fill and return, contiguous on the buffer's device, as ``recv_x`` below
            (N = num_max_dispatch_tokens_per_rank, L local experts, W ranks); a wrong one: ValueError on every rank.
            Without it they come from the buffer's pool, whose memory is reused only once the caller holds no
            tensor or view of it: a kept result is never overwritten (``ep_low_latency_out``).

        Returns
        -------
        recv_x : Tensor [L, N * W, hidden] bf16, or (e4m3 tensor, scales [L, N * W, hidden/128]) (``out`` if given)
            Rows of expert e ordered by source rank, then source token order; rows past
            ``recv_count[e]`` are unspecified.
        recv_count : Tensor [num_local_experts] int32
        handle : LowLatencyHandle
        hook : callable; receives the data (a no-op when ``return_recv_hook`` is False). Call it
            before the next collective on this buffer.
        """
        n_max = num_max_dispatch_tokens_per_rank
        if self._dev is not None:
            return self._dev_ll_dispatch(x, topk_idx, n_max, use_fp8, return_recv_hook, out)
        # Counted on every rank at every call, rejected ones too, so that the ranks' handles stay comparable.
        self._ll_dispatches += 1
        w, L, h = self.world_size, self.num_local_experts, self.hidden
        xb, sb = self._ll_row(use_fp8)
        hdr = self._ll_header()
        streamed = self._ll_stream_ordered()
        # Every message has the same bound on every rank (the buffer's capacity, bf16 rows: a stream-ordered
        # message's size, a packed one's limit), so a rank that rejects its input still takes part, whatever it passed.
        msg_bytes = min(self.region_bytes, align_up(hdr + L * self.num_max_dispatch_tokens_per_rank * 2 * h))
        too_big = hdr + L * n_max * (xb + sb) > msg_bytes
        error, route = self._ll_prepare(x, topk_idx, n_max, use_fp8, out, too_big, streamed)
        ex = self.buffer.exchange(self.region_bytes, tag="ll_dispatch", deferred=streamed, guarded=True)
        if error is not None:
            self._ll_reject(ex, error, hdr, msg_bytes, use_fp8)
        key, pos, per_expert, status = route
        counts = per_expert.clamp(max=n_max).view(w, L)  # what each destination expert gets from here
        with self.retire_on_failure("low-latency dispatch"):
            live = self._ll_send(ex, x, key, pos, counts, status, n_max, use_fp8, hdr, msg_bytes)
        recv_x, recv_count = outputs.dispatch_outputs(self._ll_cache, out, L, n_max * w, h, use_fp8, self.device)
        handle = self._ll_handle(x.shape[0], key, pos, live, n_max)
        state = {"outputs": (recv_x, recv_count)}  # let go once filled: a kept hook holds no receive tensor

        def hook():
            if "outputs" in state:
                self._ll_receive(ex, handle, *state["outputs"], msg_bytes, use_fp8)
                del state["outputs"]

        if not return_recv_hook:
            hook()
        return recv_x, recv_count, handle, hook

    def _ll_prepare(self, x, topk_idx, n_max: int, use_fp8: bool, out, too_big: bool, streamed: bool):
        """Validation and routing of a low-latency dispatch: ``(error or None, route)``; no exception escapes,
        since every rank must take part in the exchange whatever this rank passed (see ``route_pairs``)."""
        route = None
        try:
            self._ll_check_host(x, topk_idx, n_max, use_fp8, out)
            if too_big:
                raise ValueError(f"low-latency message exceeds the {self.region_bytes}-byte region")
            route = route_pairs(topk_idx.to(self.device), self.num_experts, n_max)
            if not streamed and route[2].numel() and int(route[2].max()) > n_max:
                e = int(route[2].argmax())
                raise ValueError(
                    f"expert {e} gets {int(route[2][e])} (token, expert) pairs from this rank, more than "
                    f"its {n_max} slots (duplicate expert ids within a token?)"
                )
        except Exception as exc:  # every rank must learn of it through the message header
            return (str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"), route
        return None, route

    def _ll_send(self, ex, x, key, pos, counts, status, n_max: int, use_fp8: bool, hdr: int, msg_bytes: int):
        """Header, rows and scales of every (token, expert) pair into its destination's region, then commit;
        every write takes the exchange's guard (none lands behind a failed wait). Returns the ``[T*K]`` mask
        of pairs that got a slot."""
        w, L, K = self.world_size, self.num_local_experts, self.num_topk
        xb, sb = self._ll_row(use_fp8)
        if use_fp8:
            from epkit.quant import cast_groups_to_fp8

            xq, xs = cast_groups_to_fp8(x, 128)
            x_src, s_src = xq.view(torch.uint8), xs.contiguous().view(torch.uint8)
        else:
            x_src, s_src = x.contiguous().view(torch.uint8), None
        regions = [ex.send_region(dst) for dst in range(w)]  # waits (stream-ordered when streamed) for acks
        dev = self.device
        heads = torch.cat(
            [
                status.expand(w, 1),
                torch.full((w, 1), n_max, dtype=torch.int32, device=dev),
                torch.full((w, 1), int(use_fp8), dtype=torch.int32, device=dev),
                counts.to(torch.int32),
            ],
            dim=1,
        )
        E, guard = self.num_experts, ex.guard
        bases = [r.data_ptr() for r in regions]
        region_addr = self._addresses(bases)
        head_bytes = 4 * (3 + L)
        head_src = heads.data_ptr() + torch.arange(w, device=dev) * head_bytes
        move_rows(region_addr, head_src, head_bytes, [*bases, heads.data_ptr(), head_bytes], guard)
        # One address list per field covers every destination: pair i (token i // K) goes to row `at` of its
        # destination's message - slot expert * n_max + pos, or packed (host-checked: ep_low_latency_packed) the
        # expert's first row + pos - unless it has no expert or no slot.
        dst_of = key.clamp(max=E - 1) // L
        base_of = region_addr[dst_of]
        live = (key < E) & (pos < n_max)
        if self._ll_stream_ordered():
            at = (key % L) * n_max + pos.clamp(max=n_max - 1)
            scale_off, sizes = hdr + L * n_max * xb, [msg_bytes] * w
        else:
            at = packed.first_rows(counts).view(-1)[key.clamp(max=E - 1)] + pos  # key = destination * L + expert
            scale_off, sizes = packed.dispatch_layout(counts, hdr, xb, sb)
            scale_off = scale_off[dst_of]
        tok = torch.arange(key.numel(), device=dev) // K
        fields = [(x_src, xb, hdr)] + ([(s_src, sb, scale_off)] if s_src is not None else [])
        for src, nbytes, off in fields:
            move_rows(
                torch.where(live, base_of + off + at * nbytes, 0),
                torch.where(live, src.data_ptr() + tok * nbytes, 0),
                nbytes,
                [*bases, hdr + L * n_max * xb, src.data_ptr()],
                guard,
            )
        for dst in range(w):
            ex.commit(dst, sizes[dst])
        return live

    def _ll_handle(self, t_num: int, key, pos, live, n_max: int) -> LowLatencyHandle:
        """The combine's state for a dispatch of ``t_num`` tokens (counts filled by the receive)."""
        L, K = self.num_local_experts, self.num_topk
        ids = key.view(t_num, K)
        live = live.view(t_num, K)
        return LowLatencyHandle(
            num_tokens=t_num,
            dst_of=torch.where(live, ids // L, -1),
            expert_of=torch.where(live, ids % L, -1),
            pos_of=torch.where(live, pos.view(t_num, K), -1),
            counts=torch.zeros((self.world_size, L), dtype=torch.int64, device=self.device),
            n_max=n_max,
            buffer_id=self.buffer.buffer_id,
            epoch=self._ll_dispatches,
        )

    def _ll_receive(self, ex, handle: LowLatencyHandle, recv_x, recv_count, msg_bytes: int, use_fp8: bool):
        """The dispatch hook: wait for every message, judge the headers (now on the host, or on the stream),
        unpack the slots into the masked layout, release the regions."""
        w, n_max = self.world_size, handle.n_max
        xb, sb = self._ll_row(use_fp8)
        hdr = self._ll_header()
        streamed = self._ll_stream_ordered()
        with self.retire_on_failure("low-latency dispatch receive"):
            views = ex.receive([msg_bytes] * w, at_most=not streamed)
            packed.check_lengths(views, [hdr] * w, "low-latency dispatch")
            heads = self._ll_heads(views)
        if streamed:
            ok = self._ll_defer_errors(heads, views, hdr, n_max, use_fp8)
        else:
            errors = self._ll_errors(heads, views, hdr, True)
            if errors:
                ex.release()
                raise ValueError("low-latency dispatch rejected on every rank: " + "; ".join(errors))
            ok = torch.ones(w, dtype=torch.bool)
        with self.retire_on_failure("low-latency dispatch receive"):
            got = heads[:, 3:].long().clamp(0, n_max)  # a corrupt header cannot overrun
            got = torch.where(ok[:, None], got, 0)  # [W, L]
            if streamed:
                unpack_slots(views, recv_x, got, n_max, hdr, xb, sb)
            else:
                packed.unpack_rows(views, recv_x, got, n_max, hdr, xb, sb)
            recv_count.copy_(got.sum(0).to(torch.int32))
            handle.counts = got
            ex.release()  # after the reads above on the stream
        self._count_load(got.sum(0))

    def _ll_reject(self, ex, error: str, hdr: int, msg_bytes: int, use_fp8: bool):
        """Tell every rank, finish the exchange so the counters stay in step, then raise."""
        text = encode_error(error)
        status = torch.tensor([REJECTED], dtype=torch.int32).view(torch.uint8)
        streamed = self._ll_stream_ordered()
        for dst in range(self.world_size):  # guarded writes: none lands behind a failed acknowledgement wait
            ex.write(dst, status, 0)
            ex.write(dst, text, hdr - META_MSG)
            ex.commit(dst, msg_bytes if streamed else hdr)  # packed: a header with no rows
        views = ex.receive([msg_bytes] * self.world_size, at_most=not streamed)
        packed.check_lengths(views, [hdr] * self.world_size, "low-latency dispatch")
        self.buffer.synchronize()  # error path: wait for the data (and surface a silent peer first)
        errors = self._ll_errors(self._ll_heads(views), views, hdr, False)
        ex.release()
        exc = ValueError("low-latency dispatch rejected on every rank: " + "; ".join(errors))
        if self._ll_stream_ordered():  # the peers learn of it at a later call: the buffer is done on every rank
            self.buffer.mark_broken(str(exc))
        raise exc

    def _count_load(self, per_expert: torch.Tensor) -> None:
        """Add to the EPLB load counter without a host read (a device accumulator on CUDA rows)."""
        if per_expert.device == self.recv_tokens_per_expert_total.device:
            self.recv_tokens_per_expert_total += per_expert
            return
        acc = self.__dict__.get("_device_load")
        if acc is None:
            acc = self._device_load = torch.zeros_like(per_expert)
        acc += per_expert

    def low_latency_combine(
        self,
        y: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        return_recv_hook: bool = False,
        out=None,
    ):
        """Send expert outputs back and reduce them at the source.

        Parameters
        ----------
        y : Tensor [num_local_experts, N * W, hidden] bfloat16 (the masked layout of the dispatch)
        topk_idx, topk_weights : Tensor [T, num_topk] as given to the dispatch (weights float32, on the
            buffer's device)
        handle : LowLatencyHandle
        out : Tensor [T, hidden] bfloat16, contiguous on the buffer's device, optional
            Written and returned (as DeepEP's ``out``); without it, a tensor of the buffer's pool (see
            ``low_latency_dispatch``). A wrong one is rejected as a bad ``y`` is.

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
            if self._ll_stream_ordered() and topk_weights.device != self.device:
                raise ValueError(f"topk_weights is on {topk_weights.device}; the low-latency path needs {self.device}")
            outputs.check_combine_out(out, t_num, h, self.device)
            if self._dev is not None:
                check_aligned("y", y)
                check_aligned("out", out)
        except ValueError as exc:
            self._reject_locally("low-latency combine", exc)
        with self.retire_on_failure("low-latency combine"):
            if self._dev is not None:
                return self._dev_ll_combine(y, topk_weights, handle, return_recv_hook, out)
            return self._ll_combine(y, topk_weights, handle, return_recv_hook, out)

    def _ll_combine(self, y, topk_weights, handle: LowLatencyHandle, return_recv_hook, given):
        w, L, h, n_max = self.world_size, self.num_local_experts, self.hidden, handle.n_max
        row, head = 2 * h, COMBINE_HEADER
        msg_bytes = head + L * n_max * row
        streamed = self._ll_stream_ordered()
        ex = self.buffer.exchange(self.region_bytes, tag="ll_combine", deferred=streamed, guarded=True)
        y = y.contiguous()
        if streamed:
            src, live, slot, y_row = slot_grid(handle.counts.to(self.device), n_max)
            at, sizes = head + slot * row, [msg_bytes] * w
        else:  # packed (ep_low_latency_packed): only the rows each source's pairs get back
            live, y_row, at, sizes = packed.combine_rows(handle.counts, n_max, head, row)
            src = torch.arange(w).view(w, 1, 1)
        bases = [ex.send_region(s).data_ptr() for s in range(w)]
        region_addr = self._addresses(bases)
        # The handle's identity first, so the receivers can tell rows of another dispatch from this one's.
        ident = self._addresses([handle.buffer_id, handle.epoch])  # a cached device table: no host sync
        move_rows(region_addr, torch.full_like(region_addr, ident.data_ptr()), 16, [*bases, ident.data_ptr()], ex.guard)
        move_rows(
            torch.where(live, region_addr[src] + at, 0),
            torch.where(live, y.data_ptr() + y_row * row, 0),
            row,
            [*bases, head, y.data_ptr()],
            ex.guard,
        )
        for s in range(w):
            ex.commit(s, sizes[s])
        out = {}

        def hook():
            if "y" not in out:
                out["y"] = self._ll_combine_receive(ex, handle, topk_weights, msg_bytes, given)
            return out["y"]

        if return_recv_hook:
            return None, hook
        return hook()

    def _ll_combine_receive(self, ex, handle: LowLatencyHandle, topk_weights, msg_bytes: int, given):
        """The combine hook: wait for every message, check that every rank sent rows of the same dispatch of this
        buffer (on the host, or on the stream), and reduce at the source in the fixed order."""
        w, L, h, n_max = self.world_size, self.num_local_experts, self.hidden, handle.n_max
        row, head = 2 * h, COMBINE_HEADER
        streamed = self._ll_stream_ordered()
        with self.retire_on_failure("low-latency combine receive"):
            views = ex.receive([msg_bytes] * w, at_most=not streamed)
            packed.check_lengths(views, [head] * w, "low-latency combine")
            idents = torch.stack([v[:16].view(torch.int64) for v in views])  # [W, 2] buffer id, epoch
        if not streamed:  # the handles first: a foreign one's rows need not even fit
            error = describe_handles(idents.tolist(), self.buffer.buffer_id, "low-latency combine")
            if error is not None:
                ex.release()
                raise ValueError(error)
        with self.retire_on_failure("low-latency combine receive"):
            if streamed:
                slot = handle.expert_of.clamp(min=0) * n_max + handle.pos_of.clamp(min=0)
                _, stride = message_spacing(views)
                table = views[0][head:].as_strided((w, L * n_max, row), (stride, row, 1)).view(torch.bfloat16)
                res = outputs.combine_output(self._ll_cache, given, handle.num_tokens, n_max, h, self.device)
                res.copy_(reduce_gathered(table, handle.dst_of, slot, topk_weights.float()))  # rounded as .to()
            else:
                sent = packed.sent_counts(handle.dst_of, handle.expert_of, w, L)
                per_src = sent.sum(1).tolist()
                packed.check_lengths(views, [head + n * row for n in per_src], "low-latency combine")
                at = packed.first_rows(sent)[handle.dst_of.clamp(min=0), handle.expert_of.clamp(min=0)]
                at = at + handle.pos_of.clamp(min=0)
                sources = [v[head : head + n * row].view(torch.bfloat16).view(n, h) for v, n in zip(views, per_src)]
                res = outputs.combine_output(self._ll_cache, given, handle.num_tokens, n_max, h, self.device)
                reduce_indexed(res, sources, handle.dst_of, at, topk_weights.float())
        if streamed:  # judged once the stream has passed it; a mismatch retires the buffer on every rank
            buffer_id = self.buffer.buffer_id

            def judge(values):
                msg = describe_handles([values[2 * r : 2 * r + 2] for r in range(w)], buffer_id, "low-latency combine")
                return None if msg is None else ValueError(msg)

            self.buffer.deferred.record(idents.reshape(-1).clone(), judge, self.timeout, "low-latency combine")
        ex.release()
        return res
