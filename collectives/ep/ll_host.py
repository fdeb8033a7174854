"""EPBuffer's low-latency mode (decode): fixed-slot dispatch into the masked layout and its combine.

Every message has a fixed size and every row move is described by fixed-length address lists
built with tensor ops (a 0 address skips a row), so neither shapes nor the host's work depend
on the routing. Two ways to run it, one protocol:

- **host-checked** (CPU rows): the routing and the received headers are read on the host, so a bad
  input raises ``ValueError`` on every rank in the same call; rows move through ``epkit._C``, and a message
  holds only its rows (``ep/ll_packed``: the torch transport sends those bytes, not the region).
- **stream-ordered** (CUDA rows; on CPU rows of a buffer made with ``portable=True``, which is how the tests run
  it): no host read of any routing-dependent value and no waiting for the device. Waits for peers are
  timed device waits (``SymmBuffer.exchange(deferred=True)``); rows move through the Triton
  address-list kernel; invalid expert ids, slot overflow and peers' rejections are found on the
  device, carried in the message headers, and raised as ``ValueError`` on every rank by a later call
  (or by :meth:`EPBuffer.synchronize`), the rows of the failing call being unspecified. Since the
  ranks learn of it at different calls, such a failure retires the buffer on every rank (later calls
  raise RuntimeError naming it): create a new EPBuffer. The header status words (3 per source)
  reach the host through pinned (mapped) memory, stored there by the row-copy kernel on the stream
  (no device-to-host memcpy), and a later call reads them once the stream has passed them.

The low-latency path of every buffer that does not run the device kernels (``ll_device``); the tensors the calls
return come from the context's pool (``ep/ll_out``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch

from epkit.collectives.ep import ll_out as outputs
from epkit.collectives.ep import ll_packed as packed
from epkit.collectives.ep import routing
from epkit.collectives.ep.context import EPContext
from epkit.collectives.ep.ll_layout import (
    COMBINE_HEADER,
    OK,
    REJECTED,
    REJECTED_HANDLE,
    LLCombineResult,
    LLDispatchResult,
    LowLatencyHandle,
    describe_handles,
    judge_headers,
    message_spacing,
    route_pairs,
    slot_grid,
    unpack_slots,
)
from epkit.collectives.ep.ll_out import LLOut, LLRows
from epkit.collectives.ep.rows import (
    META_MSG,
    align_up,
    copy_rows_by_address,
    decode_error,
    encode_error,
    sum_indexed_rows,
    sum_table_rows,
)
from epkit.collectives.exchange import Exchange

__all__ = ["HostLowLatencyPath"]

#: A low-latency dispatch's routing (``route_pairs``): ``(key, pos, per_expert, status)``.
_Route = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _stand_in(views: list[torch.Tensor], ex: Exchange, words: list[int], nbytes: int) -> list[torch.Tensor]:
    """``views`` with each masked source's (``SymmBuffer.mask``: it sent nothing) replaced by a message of ``nbytes``
    that sends nothing either: ``words`` (int64) at its start, zeros after (a dispatch header with no rows, a
    combine header naming the expected dispatch)."""
    skip = ex.skip
    if not skip:
        return views
    msg = torch.zeros(nbytes, dtype=torch.uint8)
    msg[: 8 * len(words)] = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
    return [msg.to(v.device) if src in skip else v for src, v in enumerate(views)]


def _dispatch_words(n_max: int, use_fp8: bool) -> list[int]:
    """The int64 words whose bytes are the int32 header ``[OK, n_max, use_fp8, 0, ...]`` of a message with no rows."""
    return [OK | (n_max << 32), int(use_fp8)]


class HostLowLatencyPath:
    """``low_latency_dispatch`` / ``low_latency_combine`` driven by the host (host-checked on CPU rows,
    stream-ordered on CUDA rows: the module docstring)."""

    def __init__(self, ctx: EPContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg

    def synchronize(self) -> None:
        """Wait for this rank's stream-ordered work; raise what it found (``EPBuffer.synchronize``)."""
        self.ctx.buffer.synchronize()

    def _stream_ordered(self) -> bool:
        """Whether low-latency calls run without host reads of routing data (CUDA rows, or portable)."""
        return self.ctx.device.type != "cpu" or self.cfg.portable

    def _row(self, use_fp8: bool) -> tuple[int, int]:
        """(x bytes, scale bytes) of one low-latency row."""
        h = self.cfg.hidden
        return (h, 4 * -(-h // 128)) if use_fp8 else (2 * h, 0)

    def _header(self) -> int:
        """Header of a low-latency message: int32 [status, n_max, use_fp8, count per local expert], error text."""
        return align_up(4 * (3 + self.cfg.num_local_experts)) + META_MSG

    def _heads(self, views: list[torch.Tensor]) -> torch.Tensor:
        """The received headers' int words ``[W, 3 + L]`` (a copy: the views are reused by later messages)."""
        n = 3 + self.cfg.num_local_experts
        return torch.stack([v[: 4 * n].view(torch.int32) for v in views])

    def _errors(self, heads: torch.Tensor, views: list[torch.Tensor], hdr: int, check_params: bool) -> list[str]:
        """Rejections (and, with ``check_params``, parameter mismatches) in the received headers
        (``_heads``), read on the host; worded alike on every rank."""
        return judge_headers(
            heads[:, :3].tolist(),
            lambda src: decode_error(views[src][hdr - META_MSG : hdr]),
            check_params,
            self.cfg.ranks,
        )

    def _defer_errors(
        self, heads: torch.Tensor, views: list[torch.Tensor], hdr: int, n_max: int, use_fp8: bool
    ) -> torch.Tensor:
        """Stream-ordered check of the headers (``_heads``): recorded for a later call; returns the ``[W]``
        rows-are-valid mask."""
        texts = torch.stack([v[hdr - META_MSG : hdr] for v in views])  # read on the host only if rejected
        w, ranks = self.cfg.world_size, self.cfg.ranks

        def judge(values: list[int]) -> ValueError | None:
            heads3 = [values[3 * src : 3 * src + 3] for src in range(w)]
            errors = judge_headers(heads3, lambda src: decode_error(texts[src]), True, ranks)
            if errors:
                return ValueError("low-latency dispatch rejected on every rank: " + "; ".join(errors))
            return None

        self.ctx.buffer.deferred.record(
            heads[:, :3].long().reshape(-1), judge, self.cfg.timeout, "low-latency dispatch", self.cfg.portable
        )
        return (heads[:, 0] == OK) & (heads[:, 1] == n_max) & (heads[:, 2] == int(use_fp8))

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, n_max: int, use_fp8: bool, return_recv_hook: bool, out: LLOut
    ) -> LLDispatchResult:
        """``EPBuffer.low_latency_dispatch`` (same arguments and results)."""
        # Counted on every rank at every call, rejected ones too, so that the ranks' handles stay comparable.
        self.ctx.ll_dispatches += 1
        w, L, h = self.cfg.world_size, self.cfg.num_local_experts, self.cfg.hidden
        xb, sb = self._row(use_fp8)
        hdr = self._header()
        streamed = self._stream_ordered()
        # Every message has the same bound on every rank (the buffer's capacity, bf16 rows: a stream-ordered
        # message's size, a packed one's limit), so a rank that rejects its input still takes part, whatever it passed.
        msg_bytes = min(self.ctx.region_bytes, align_up(hdr + L * self.cfg.num_max_dispatch_tokens_per_rank * 2 * h))
        too_big = hdr + L * n_max * (xb + sb) > msg_bytes
        error, route = self._prepare(x, topk_idx, n_max, use_fp8, out, too_big, streamed)
        ex = self.ctx.buffer.exchange(self.ctx.region_bytes, tag="ll_dispatch", deferred=streamed, guarded=True)
        if error is not None:
            self._reject(ex, error, hdr, msg_bytes, use_fp8)
        assert route is not None  # no error: the routing was made
        key, pos, per_expert, status = route
        counts = per_expert.clamp(max=n_max).view(w, L)  # what each destination expert gets from here
        with self.ctx.retire_on_failure("low-latency dispatch"):
            live = self._send(ex, x, key, pos, counts, status, n_max, use_fp8, hdr, msg_bytes)
        recv_x, recv_count = outputs.dispatch_outputs(
            self.ctx.ll_outputs, out, L, n_max * w, h, use_fp8, self.ctx.device
        )
        handle = self._handle(x.shape[0], key, pos, live, n_max)
        state = {"outputs": (recv_x, recv_count)}  # let go once filled: a kept hook holds no receive tensor

        def hook() -> None:
            if "outputs" in state:
                self._receive(ex, handle, *state["outputs"], msg_bytes, use_fp8)
                del state["outputs"]

        if not return_recv_hook:
            hook()
        return recv_x, recv_count, handle, hook

    def _prepare(
        self, x: torch.Tensor, topk_idx: torch.Tensor, n_max: int, use_fp8: bool, out: LLOut, too_big: bool,
        streamed: bool,
    ) -> tuple[str | None, _Route | None]:  # fmt: skip
        """Validation and routing of a low-latency dispatch: ``(error or None, route)``; no exception escapes,
        since every rank must take part in the exchange whatever this rank passed (see ``route_pairs``)."""
        route: _Route | None = None
        try:
            routing.check_ll_dispatch(
                self.cfg, self.ctx.device, x, topk_idx, n_max, use_fp8, out, self._stream_ordered()
            )
            if too_big:
                raise ValueError(f"low-latency message exceeds the {self.ctx.region_bytes}-byte region")
            route = route_pairs(topk_idx.to(self.ctx.device), self.cfg.num_experts, n_max)
            if not streamed and route[2].numel() and int(route[2].max()) > n_max:
                e = int(route[2].argmax())
                raise ValueError(
                    f"expert {e} gets {int(route[2][e])} (token, expert) pairs from this rank, more than "
                    f"its {n_max} slots (duplicate expert ids within a token?)"
                )
        except Exception as exc:  # every rank must learn of it through the message header
            return (str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"), route
        return None, route

    def _send(
        self, ex: Exchange, x: torch.Tensor, key: torch.Tensor, pos: torch.Tensor, counts: torch.Tensor,
        status: torch.Tensor, n_max: int, use_fp8: bool, hdr: int, msg_bytes: int,
    ) -> torch.Tensor:  # fmt: skip
        """Header, rows and scales of every (token, expert) pair into its destination's region, then commit;
        every write takes the exchange's guard (none lands behind a failed wait). Returns the ``[T*K]`` mask
        of pairs that got a slot."""
        w, L, K = self.cfg.world_size, self.cfg.num_local_experts, self.cfg.num_topk
        xb, sb = self._row(use_fp8)
        if use_fp8:
            from epkit.quant import cast_groups_to_fp8

            xq, xs = cast_groups_to_fp8(x, 128)
            x_src, s_src = xq.view(torch.uint8), xs.contiguous().view(torch.uint8)
        else:
            x_src, s_src = x.contiguous().view(torch.uint8), None
        regions = [ex.send_region(dst) for dst in range(w)]  # waits (stream-ordered when streamed) for acks
        dev = self.ctx.device
        heads = torch.cat(
            [
                status.expand(w, 1),
                torch.full((w, 1), n_max, dtype=torch.int32, device=dev),
                torch.full((w, 1), int(use_fp8), dtype=torch.int32, device=dev),
                counts.to(torch.int32),
            ],
            dim=1,
        )
        E, guard = self.cfg.num_experts, ex.guard
        bases = [r.data_ptr() for r in regions]
        region_addr = self.ctx.addresses(bases)
        head_bytes = 4 * (3 + L)
        head_src = heads.data_ptr() + torch.arange(w, device=dev) * head_bytes
        copy_rows_by_address(
            region_addr, head_src, head_bytes, [*bases, heads.data_ptr(), head_bytes], guard, self.cfg.portable
        )
        # One address list per field covers every destination: pair i (token i // K) goes to row `at` of its
        # destination's message - slot expert * n_max + pos, or packed (host-checked: ep_low_latency_packed) the
        # expert's first row + pos - unless it has no expert or no slot.
        dst_of = key.clamp(max=E - 1) // L
        base_of = region_addr[dst_of]
        live = (key < E) & (pos < n_max)
        scale_off: int | torch.Tensor  # where each pair's scale row goes: one offset, or one per pair
        if self._stream_ordered():
            at = (key % L) * n_max + pos.clamp(max=n_max - 1)
            scale_off, sizes = hdr + L * n_max * xb, [msg_bytes] * w
        else:
            at = packed.first_rows(counts).view(-1)[key.clamp(max=E - 1)] + pos  # key = destination * L + expert
            scale_off, sizes = packed.dispatch_layout(counts, hdr, xb, sb)
            scale_off = scale_off[dst_of]
        tok = torch.arange(key.numel(), device=dev) // K
        fields = [(x_src, xb, hdr)] + ([(s_src, sb, scale_off)] if s_src is not None else [])
        for src, nbytes, off in fields:
            copy_rows_by_address(
                torch.where(live, base_of + off + at * nbytes, 0),
                torch.where(live, src.data_ptr() + tok * nbytes, 0),
                nbytes,
                [*bases, hdr + L * n_max * xb, src.data_ptr()],
                guard,
                self.cfg.portable,
            )
        for dst in range(w):
            ex.commit(dst, sizes[dst])
        return live

    def _handle(
        self, t_num: int, key: torch.Tensor, pos: torch.Tensor, live: torch.Tensor, n_max: int
    ) -> LowLatencyHandle:
        """The combine's state for a dispatch of ``t_num`` tokens (counts filled by the receive)."""
        L, K = self.cfg.num_local_experts, self.cfg.num_topk
        ids = key.view(t_num, K)
        live = live.view(t_num, K)
        return LowLatencyHandle(
            num_tokens=t_num,
            dst_of=torch.where(live, ids // L, -1),
            expert_of=torch.where(live, ids % L, -1),
            pos_of=torch.where(live, pos.view(t_num, K), -1),
            counts=torch.zeros((self.cfg.world_size, L), dtype=torch.int64, device=self.ctx.device),
            n_max=n_max,
            buffer_id=self.ctx.buffer.buffer_id,
            epoch=self.ctx.ll_dispatches,
        )

    def _receive(
        self, ex: Exchange, handle: LowLatencyHandle, recv_x: LLRows, recv_count: torch.Tensor, msg_bytes: int,
        use_fp8: bool,
    ) -> None:  # fmt: skip
        """The dispatch hook: wait for every message, judge the headers (now on the host, or on the stream),
        unpack the slots into the masked layout, release the regions."""
        w, n_max = self.cfg.world_size, handle.n_max
        xb, sb = self._row(use_fp8)
        hdr = self._header()
        streamed = self._stream_ordered()
        with self.ctx.retire_on_failure("low-latency dispatch receive"):
            views = ex.receive([msg_bytes] * w, at_most=not streamed)
            views = _stand_in(views, ex, _dispatch_words(n_max, use_fp8), hdr)
            packed.check_lengths(views, [hdr] * w, "low-latency dispatch", self.cfg.ranks)
            heads = self._heads(views)
        if streamed:
            ok = self._defer_errors(heads, views, hdr, n_max, use_fp8)
        else:
            errors = self._errors(heads, views, hdr, True)
            if errors:
                ex.release()
                raise ValueError("low-latency dispatch rejected on every rank: " + "; ".join(errors))
            ok = torch.ones(w, dtype=torch.bool)
        with self.ctx.retire_on_failure("low-latency dispatch receive"):
            got = heads[:, 3:].long().clamp(0, n_max)  # a corrupt header cannot overrun
            got = torch.where(ok[:, None], got, 0)  # [W, L]
            if streamed:
                unpack_slots(views, recv_x, got, n_max, hdr, xb, sb, self.cfg.portable)
            else:
                packed.unpack_rows(views, recv_x, got, n_max, hdr, xb, sb, self.cfg.ranks, self.cfg.portable)
            recv_count.copy_(got.sum(0).to(torch.int32))
            handle.counts = got
            ex.release()  # after the reads above on the stream
        self.ctx.count_load(got.sum(0))

    def _reject(self, ex: Exchange, error: str, hdr: int, msg_bytes: int, use_fp8: bool) -> NoReturn:
        """Tell every rank, finish the exchange so the counters stay in step, then raise."""
        text = encode_error(error)
        status = torch.tensor([REJECTED], dtype=torch.int32).view(torch.uint8)
        streamed = self._stream_ordered()
        for dst in range(self.cfg.world_size):  # guarded writes: none lands behind a failed acknowledgement wait
            ex.write(dst, status, 0, self.cfg.portable)
            ex.write(dst, text, hdr - META_MSG, self.cfg.portable)
            ex.commit(dst, msg_bytes if streamed else hdr)  # packed: a header with no rows
        views = ex.receive([msg_bytes] * self.cfg.world_size, at_most=not streamed)
        views = _stand_in(views, ex, _dispatch_words(0, use_fp8), hdr)
        packed.check_lengths(views, [hdr] * self.cfg.world_size, "low-latency dispatch", self.cfg.ranks)
        self.ctx.buffer.synchronize()  # error path: wait for the data (and surface a silent peer first)
        errors = self._errors(self._heads(views), views, hdr, False)
        ex.release()
        exc = ValueError("low-latency dispatch rejected on every rank: " + "; ".join(errors))
        if self._stream_ordered():  # the peers learn of it at a later call: the buffer is done on every rank
            self.ctx.buffer.mark_broken(str(exc))
        raise exc

    def combine(
        self, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle,
        return_recv_hook: bool, out: torch.Tensor | None,
    ) -> LLCombineResult:  # fmt: skip
        """``EPBuffer.low_latency_combine`` (same arguments and results)."""
        try:
            routing.check_ll_combine(self.cfg, self.ctx.device, y, topk_idx, topk_weights, handle, out,
                                     self._stream_ordered(), False)  # fmt: skip
        except ValueError as exc:
            if self._stream_ordered():  # the peers cannot learn of it in this call: the buffer is done
                self.ctx.reject_locally("low-latency combine", exc)
            self._reject_combine(str(exc))
        with self.ctx.retire_on_failure("low-latency combine"):
            hook = self._combine(y, topk_weights, handle, out)
        # the receive retires the buffer itself on a failure, but not on the agreed ValueErrors (a rank's
        # rejection, handles of different dispatches): every rank raises those in step, and the buffer goes on
        return (None, hook) if return_recv_hook else hook()

    def _reject_combine(self, error: str) -> NoReturn:
        """A host-checked combine this rank cannot make: send every rank a header naming no dispatch
        (:data:`REJECTED_HANDLE`) and the error, take the peers' messages so the exchanges stay in step, and raise
        what every rank raises (:meth:`_combine_receive` reads the same headers): no row is summed anywhere and the
        buffer goes on."""
        w, head = self.cfg.world_size, COMBINE_HEADER
        ex = self.ctx.buffer.exchange(self.ctx.region_bytes, tag="ll_combine", deferred=False, guarded=True)
        ident = torch.tensor([REJECTED_HANDLE, 0], dtype=torch.int64).view(torch.uint8)
        text = encode_error(error)
        with self.ctx.retire_on_failure("low-latency combine"):
            for dst in range(w):
                ex.write(dst, ident, 0)
                ex.write(dst, text, head)
                ex.commit(dst, head + META_MSG)
            views = ex.receive([self.ctx.region_bytes] * w, at_most=True)
            views = _stand_in(views, ex, [0, 0], head)
            packed.check_lengths(views, [head] * w, "low-latency combine", self.cfg.ranks)
            rejected = self._rejections(views)
        ex.release()
        raise ValueError(rejected)

    def _rejections(self, views: list[torch.Tensor]) -> str | None:
        """The error every rank raises when some rank rejected its own combine (its header names no dispatch and
        carries its error), else None."""
        head = COMBINE_HEADER
        errors = [
            f"{self.cfg.rank_name(src)}: {decode_error(v[head : head + META_MSG])}"
            for src, v in enumerate(views)
            if int(v[:8].view(torch.int64)[0]) == REJECTED_HANDLE and v.numel() >= head + META_MSG
        ]
        if not errors:
            return None
        return "low-latency combine rejected on every rank before any row was summed: " + "; ".join(errors)

    def _combine(
        self, y: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle, given: torch.Tensor | None
    ) -> Callable[[], torch.Tensor]:
        """Send ``y``'s rows to their sources; returns the receive hook (once: the result)."""
        w, L, h, n_max = self.cfg.world_size, self.cfg.num_local_experts, self.cfg.hidden, handle.n_max
        row, head = 2 * h, COMBINE_HEADER
        msg_bytes = head + L * n_max * row
        streamed = self._stream_ordered()
        ex = self.ctx.buffer.exchange(self.ctx.region_bytes, tag="ll_combine", deferred=streamed, guarded=True)
        y = y.contiguous()
        if streamed:
            src, live, slot, y_row = slot_grid(handle.counts.to(self.ctx.device), n_max)
            at, sizes = head + slot * row, [msg_bytes] * w
        else:  # packed (ep_low_latency_packed): only the rows each source's pairs get back
            live, y_row, at, sizes = packed.combine_layout(handle.counts, n_max, head, row)
            src = torch.arange(w).view(w, 1, 1)
        bases = [ex.send_region(s).data_ptr() for s in range(w)]
        region_addr = self.ctx.addresses(bases)
        # The handle's identity first, so the receivers can tell rows of another dispatch from this one's.
        ident = self.ctx.addresses([handle.buffer_id, handle.epoch])  # a cached device table: no host sync
        portable = self.cfg.portable
        copy_rows_by_address(
            region_addr,
            torch.full_like(region_addr, ident.data_ptr()),
            16,
            [*bases, ident.data_ptr()],
            ex.guard,
            portable,
        )
        copy_rows_by_address(
            torch.where(live, region_addr[src] + at, 0),
            torch.where(live, y.data_ptr() + y_row * row, 0),
            row,
            [*bases, head, y.data_ptr()],
            ex.guard,
            portable,
        )
        for s in range(w):
            ex.commit(s, sizes[s])
        out: dict[str, torch.Tensor] = {}

        def hook() -> torch.Tensor:
            if "y" not in out:
                out["y"] = self._combine_receive(ex, handle, topk_weights, msg_bytes, given)
            return out["y"]

        return hook

    def _combine_receive(
        self, ex: Exchange, handle: LowLatencyHandle, topk_weights: torch.Tensor, msg_bytes: int,
        given: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """The combine hook: wait for every message, check that every rank sent rows of the same dispatch of this
        buffer (on the host, or on the stream), and reduce at the source in the fixed order."""
        w, L, h, n_max = self.cfg.world_size, self.cfg.num_local_experts, self.cfg.hidden, handle.n_max
        row, head = 2 * h, COMBINE_HEADER
        streamed = self._stream_ordered()
        with self.ctx.retire_on_failure("low-latency combine receive"):
            bound = msg_bytes if streamed else max(msg_bytes, head + META_MSG)  # a rejection's header and text
            views = ex.receive([bound] * w, at_most=not streamed)
            views = _stand_in(views, ex, [self.ctx.buffer.buffer_id, handle.epoch], head)
            packed.check_lengths(views, [head] * w, "low-latency combine", self.cfg.ranks)
            idents = torch.stack([v[:16].view(torch.int64) for v in views])  # [W, 2] buffer id, epoch
        if not streamed:  # the handles first: a foreign one's rows need not even fit
            error = self._rejections(views) or describe_handles(
                idents.tolist(), self.ctx.buffer.buffer_id, "low-latency combine", self.cfg.ranks
            )
            if error is not None:
                ex.release()
                raise ValueError(error)
        with self.ctx.retire_on_failure("low-latency combine receive"):
            if streamed:
                slot = handle.expert_of.clamp(min=0) * n_max + handle.pos_of.clamp(min=0)
                _, stride = message_spacing(views)
                table = views[0][head:].as_strided((w, L * n_max, row), (stride, row, 1)).view(torch.bfloat16)
                res = outputs.combine_output(self.ctx.ll_outputs, given, handle.num_tokens, n_max, h, self.ctx.device)
                res.copy_(sum_table_rows(table, handle.dst_of, slot, topk_weights.float()))  # rounded as .to()
            else:
                dst_of = handle.dst_of  # a masked rank's experts are absent (SymmBuffer.mask): no term of theirs
                skip = sorted(ex.skip)
                if skip:
                    dst_of = torch.where(torch.isin(dst_of, torch.tensor(skip, device=dst_of.device)), -1, dst_of)
                sent = packed.sent_counts(dst_of, handle.expert_of, w, L)
                per_src = sent.sum(1).tolist()
                packed.check_lengths(views, [head + n * row for n in per_src], "low-latency combine", self.cfg.ranks)
                at = packed.first_rows(sent)[dst_of.clamp(min=0), handle.expert_of.clamp(min=0)]
                at = at + handle.pos_of.clamp(min=0)
                sources = [v[head : head + n * row].view(torch.bfloat16).view(n, h) for v, n in zip(views, per_src)]
                res = outputs.combine_output(self.ctx.ll_outputs, given, handle.num_tokens, n_max, h, self.ctx.device)
                sum_indexed_rows(res, sources, dst_of, at, topk_weights.float(), portable=self.cfg.portable)
        if streamed:  # judged once the stream has passed it; a mismatch retires the buffer on every rank
            buffer_id, ranks = self.ctx.buffer.buffer_id, self.cfg.ranks

            def judge(values: list[int]) -> ValueError | None:
                msg = describe_handles(
                    [values[2 * r : 2 * r + 2] for r in range(w)], buffer_id, "low-latency combine", ranks
                )
                return None if msg is None else ValueError(msg)

            self.ctx.buffer.deferred.record(
                idents.reshape(-1).clone(), judge, self.cfg.timeout, "low-latency combine", self.cfg.portable
            )
        ex.release()
        return res
