"""EPBuffer's normal mode on the device kernels (``kernels/triton/ep_normal.py``, ``ep_normal_recv.py``,
``ep_combine.py``).

Dispatch: ``layout`` -> ``notify`` -> one host read of the summary (every rank's status and format, the rows
received: this is what sizes the outputs) -> ``dispatch_send`` -> ``dispatch_recv``; routing and handles stay
on the device. Combine and cached dispatch: ``agree`` -> one host read (every rank's call valid, every handle
from the same dispatch of this buffer: else the same ValueError on every rank, before any row moves, and the
buffer goes on) -> ``combine_send`` -> ``combine_reduce`` (or ``dispatch_send`` -> ``dispatch_recv``).

A worst-case dispatch (``num_worst_tokens``, ``ep/worst.py``) sizes its outputs from that and reads nothing back,
nor do its combine and cached dispatches: ``notify`` and ``agree`` judge on the device (a rejection is a recorded
failure, raised at the rank's next call), the receive and the combine kernels read the rows received from the
layout. A CUDA graph can capture these calls.

The normal-mode path of a buffer that took the device kernels (``device_state``). Results are bitwise those of
the host-driven paths.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from epkit.collectives.ep import routing
from epkit.collectives.ep.agreement import judge_agreement
from epkit.collectives.ep.context import EPContext
from epkit.collectives.ep.device_state import DeviceState
from epkit.collectives.ep.handles import DeviceRoute, DispatchHandle, DispatchResult, Rows
from epkit.collectives.ep.rows import Bias, format_code
from epkit.collectives.ep.worst import FORMAT_UNIT, REJECTED_WHAT, format_word, judge_notify, worst_shape
from epkit.kernels.triton.ep_layout import OK, REJECTED

if TYPE_CHECKING:
    from epkit.kernels.triton.ep_combine import CombineGeometry
    from epkit.kernels.triton.ep_normal import NormalGeometry

__all__ = ["DeviceNormalPath"]

#: Seconds past the buffer's timeout before the host calls its stream stuck while waiting for a summary.
_GRACE_S = 10.0


class _RecvRows(TypedDict):
    """The outputs ``dispatch_recv`` fills: rows, FP8 scales (None without), local expert ids, weights."""

    x: torch.Tensor
    s: torch.Tensor | None
    idx: torch.Tensor
    w: torch.Tensor


class _Outputs(_RecvRows, total=False):
    """... and with ``expand`` the expanded layout: received row per expanded row, expanded row per (row, k),
    expert per expanded row."""

    rows: torch.Tensor
    slot: torch.Tensor
    m: torch.Tensor


class DeviceNormalPath:
    """Normal-mode dispatch / combine (and ``fused_moe``) of an EPBuffer on the device kernels (``dev``: the
    buffer's :class:`DeviceState`)."""

    #: Whether dispatch and combine run as device kernels.
    on_device = True

    def __init__(self, ctx: EPContext, dev: DeviceState) -> None:
        self.ctx, self.cfg, self.dev = ctx, ctx.cfg, dev
        # the kernels' fixed arguments and host words, made at the first call
        self._geo: tuple[NormalGeometry, CombineGeometry, torch.Tensor, torch.Tensor] | None = None
        #: Exchanges of each kind so far (their parity picks the area; the count is the ready word).
        self.exchanges = {"notify": 0, "agree": 0}

    def dispatch(
        self, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None,
        alignment: int, expand: bool, worst: int = 0, error: str | None = None, num_sms: int | None = None,
    ) -> DispatchResult:  # fmt: skip
        """Normal dispatch on the kernels (see ``EPBuffer.dispatch``); ``worst``: its ``num_worst_tokens``,
        ``error``: the caller's own verdict on its arguments, ``num_sms``: the programs of its launches."""
        error = error or routing.num_sms_error(num_sms)
        sms = num_sms if error is None else None
        return self._dispatch(x, scales, topk_idx, topk_weights, alignment, expand, error, worst=worst, num_sms=sms)

    def dispatch_cached(
        self, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle, error: str | None = None
    ) -> DispatchResult:
        """A dispatch along an earlier one's routing: the handle agreement (one launch), then the rows."""
        error = error or routing.cached_dispatch_error(self.cfg, self.ctx.device, x, scales, handle)
        self.agree("cached dispatch", handle, error)
        return self.dispatch_cached_rows(x, scales, handle)

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None, bias: Bias,
        num_sms: int | None = None, error: str | None = None, order: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Combine on the kernels (see ``EPBuffer.combine``): the agreement (one launch), then the rows;
        ``num_sms``: the programs of its launches (None: the buffer's); ``error``: the caller's own verdict;
        ``order``: the per-token rank order (checked by the caller)."""
        found, biases, weights = routing.check_combine(self.cfg, self.ctx.device, y, handle, topk_weights, bias, True)
        error = error or found or routing.num_sms_error(num_sms)
        self.agree("combine", handle, error)
        with self.ctx.retire_on_failure("combine"):
            return self._combine(y, handle, weights, biases, num_sms, order)

    def bytes_across_hosts(self) -> int:
        return 0  # the kernels run inside one domain only

    def _geometries(self) -> tuple[NormalGeometry, CombineGeometry, torch.Tensor, torch.Tensor]:
        """(NormalGeometry, CombineGeometry, host summary, host agreement) for this buffer (made once)."""
        dev = self.dev
        if self._geo is None:
            from epkit.kernels.triton.ep_combine import CombineGeometry
            from epkit.kernels.triton.ep_normal import NormalGeometry, summary_words

            lay, w = dev.layout, self.cfg.world_size
            common: dict[str, Any] = {
                "rank": self.cfg.rank,
                "world": w,
                "num_topk": self.cfg.num_topk,
                "text": lay["text"],
                "ctrl": dev.ctrl,
                "notices": dev.notices,
                "ctrl_table": dev.tables["ctrl"],
                "rows_table": dev.tables["rows"],
                "rows_local": dev.local["rows"],
                "status": dev.status.data_ptr(),
                "clock": dev.clock,
                "timeout_ns": dev.timeout_ns,
                "device": self.ctx.device,
            }
            n = self.cfg.num_max_tokens_per_rank
            normal = NormalGeometry(
                num_experts=self.cfg.num_experts,
                cap=w * n,
                notify_table=dev.tables["notify"],
                notify_area=lay["notify_area"],
                notify_msg=lay["notify_msg"],
                **common,
            )
            combine = CombineGeometry(
                hidden=self.cfg.hidden,
                n_max=n,
                agree_table=dev.tables["agree"],
                agree_area=lay["agree_area"],
                agree_msg=lay["agree_msg"],
                **common,
            )
            pinned = self.ctx.device.type == "cuda"
            summary = torch.zeros(summary_words(w, self.cfg.num_local_experts), dtype=torch.int64, pin_memory=pinned)
            agreed = torch.zeros(4 * w + 2, dtype=torch.int64, pin_memory=pinned)  # + exchange and ready words
            self._geo = (normal, combine, summary, agreed)
        return self._geo

    def _read_back(self, host: torch.Tensor, ready: int) -> list[int]:
        """The words of ``host`` but its last (the one host read of the call), once the kernel that writes them
        has written ``ready`` into that last word, which it does after every other (a system-scope release):
        a busy poll of pinned memory, no stream synchronisation, bounded by the buffer's timeout and a grace."""
        words = host.numpy()
        if words[-1] != ready and self.ctx.device.type == "cuda":
            deadline = time.monotonic() + self.cfg.timeout + _GRACE_S
            while words[-1] != ready:
                if time.monotonic() > deadline:
                    me = self.cfg.rank_name(self.cfg.rank)
                    exc = TimeoutError(f"{me}: the CUDA stream did not reach the dispatch summary")
                    self.ctx.buffer.mark_broken(str(exc), culprit=self.cfg.rank)
                    raise exc
        values: list[int] = words.tolist()
        if values[-1] != ready:  # a kernel that ran without publishing: a fault of epkit's, never a peer's
            me = self.cfg.rank_name(self.cfg.rank)
            raise RuntimeError(f"{me}: the summary's ready word is {values[-1]}, expected {ready}")
        self.dev.poll()  # a wait that failed left its record; the summary is not to be trusted then
        return values[:-1]

    def _dispatch(
        self, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None,
        alignment: int, expand: bool, error: str | None = None, what: str | None = None, worst: int = 0,
        num_sms: int | None = None,
    ) -> DispatchResult:  # fmt: skip
        """``dispatch`` (not cached) on the kernels: same arguments and results. ``error``: the caller's own
        validation failed (``fused_moe``); ``what``: the caller's name in the rejection ("dispatch"); ``worst``:
        ``num_worst_tokens`` (0: none; else outputs of :func:`worst_shape`, no host read)."""
        from epkit.kernels.triton.ep_normal import layout, notify

        self.ctx.buffer.check_usable()
        self.dev.poll()
        self.ctx.dispatches += 1
        geo, summary = self._normal_geo(num_sms), self._geometries()[2]
        error = error or routing.dispatch_error(
            self.cfg, self.ctx.device, x, scales, topk_idx, topk_weights, alignment, True
        )
        dev, z = self.ctx.device, geo.sizes()
        if error is None:
            idx = topk_idx.to(dev).contiguous().clone()  # the handle's routing (a cached dispatch reuses it)
            fmt = format_code(x.dtype, scales is not None)
        else:
            idx, fmt, alignment = torch.empty((0, self.cfg.num_topk), dtype=torch.int64, device=dev), 0, 1
        counts = torch.empty((z["P_P2"], z["W_P2"] + z["E_P2"] + 1), dtype=torch.int32, device=dev)
        layout(geo, idx, counts)
        # a worst-case dispatch's load counts are read from the layout even where its notify failed: zeros then
        lay = (torch.zeros if worst else torch.empty)(geo.layout_words(), dtype=torch.int64, device=dev)
        code = OK if error is None else REJECTED
        self.exchanges["notify"] += 1
        ready = self.exchanges["notify"]
        shape = worst_shape(self.cfg, worst, alignment) if worst else (0, 0)
        notify(geo, counts, lay, self.dev.error_text(error), summary, code, format_word(fmt, worst), alignment, ready,
               shape)  # fmt: skip
        weights = None if topk_weights is None else topk_weights.float().to(dev).contiguous()
        if worst:
            if error is not None:  # this rank's own call was rejected: the device's verdict names it (and the others')
                self.dev.poll(wait=True)
            state, recv_n = self._worst_route(lay, idx, alignment, num_sms), list[int]()
        else:
            state, counts_l, recv_n = self._read_route(summary, ready, lay, idx, alignment, what)
            state.num_sms = num_sms
        with self.ctx.retire_on_failure("dispatch"):
            out = self._move(x, scales, weights, state, alignment, expand, shape if worst else None)
        if worst:
            self.ctx.count_load(self._received_counts(lay, num_sms).to(torch.int64))
        else:
            self.ctx.recv_tokens_per_expert_total += torch.tensor(counts_l, dtype=torch.int64)
        handle = DispatchHandle(
            send_tokens=[],
            recv_counts=recv_n,
            num_tokens=x.shape[0],
            recv_topk_idx=out["idx"],
            recv_topk_weights=out["w"],
            expand=expand,
            expert_alignment=alignment,
            expanded_rows=out.get("rows"),
            expanded_slot=out.get("slot"),
            device=dev,
            buffer_id=self.ctx.buffer.buffer_id,
            epoch=self.ctx.dispatches,
            kernel_state=state,
            worst=shape if worst else None,
        )
        state.m = out.get("m")
        x_out = (out["x"], out["s"]) if out["s"] is not None else out["x"]
        return DispatchResult(x_out, out["idx"], out["w"], state.aligned, handle)

    def _read_route(
        self, summary: torch.Tensor, ready: int, lay: torch.Tensor, idx: torch.Tensor, alignment: int, what: str | None
    ) -> tuple[DeviceRoute, list[int], list[int]]:
        """A plain dispatch's route from the summary (its one host read) once it is judged (the same ValueError on
        every rank else): the route, the unaligned counts per local expert and the rows from each source."""
        got, w = self._read_back(summary, ready), self.cfg.world_size
        codes, fmts, recv_n = got[2 : 2 + w], got[2 + w : 2 + 2 * w], got[2 + 2 * w : 2 + 3 * w]
        exchange = got[2 + 3 * w + self.cfg.num_local_experts]  # the device's number (graph replays count there)
        found = judge_notify(
            codes, fmts, None, None, None, self.cfg.ranks, lambda src: self.dev.notify_text(src, exchange)
        )
        if found is not None:
            if any(f >= FORMAT_UNIT for f in fmts):  # a worst-case peer judged it on the device and retired: so do we
                self.dev.retire(found)
            raise ValueError(str(found).replace(REJECTED_WHAT, what, 1)) if what else found
        counts = got[2 + 3 * w : 2 + 3 * w + self.cfg.num_local_experts]
        aligned = [-(-c // alignment) * alignment for c in counts]
        return DeviceRoute(lay, idx, got[0], got[1], aligned), counts, recv_n

    def _normal_geo(self, num_sms: int | None) -> NormalGeometry:
        """The dispatch kernels' geometry for a call with ``num_sms`` programs per launch (None: the buffer's)."""
        geo = self._geometries()[0]
        return geo if num_sms is None else dataclasses.replace(geo, ctas=num_sms, exact_ctas=True)

    def _received_counts(self, lay: torch.Tensor, num_sms: int | None) -> torch.Tensor:
        """``[L]`` int64 (pairs per local expert received), a view of the layout words on the device (whose
        extent depends on the dispatch's ``num_sms``)."""
        geo, local = self._normal_geo(num_sms), self.cfg.num_local_experts
        z = geo.sizes()
        at = geo.tail() + 2 * z["W_P2"] + z["L_P2"]
        return lay[at : at + local]

    def _worst_route(self, lay: torch.Tensor, idx: torch.Tensor, alignment: int, num_sms: int | None) -> DeviceRoute:
        """A worst-case dispatch's route: rows and expanded rows unknown to the host (-1), the aligned counts a
        ``[L]`` int32 tensor computed on the device from the layout (no host read)."""
        c = self._received_counts(lay, num_sms)
        aligned = ((c + alignment - 1) // alignment * alignment).to(torch.int32)
        return DeviceRoute(lay, idx, -1, -1, aligned, num_sms=num_sms)

    def dispatch_cached_rows(
        self, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle
    ) -> DispatchResult:
        """A cached dispatch's rows after the agreement: the handle's routing and layout, fresh rows."""
        assert handle.kernel_state is not None  # the agreement found the handle this buffer's: the kernels'
        state = dataclasses.replace(handle.kernel_state)
        with self.ctx.retire_on_failure("cached dispatch"):
            out = self._move(x, scales, None, state, handle.expert_alignment, handle.expand, handle.worst)
        x_out: Rows = (out["x"], out["s"]) if out["s"] is not None else out["x"]
        aligned = state.aligned.clone() if isinstance(state.aligned, torch.Tensor) else list(state.aligned)
        return DispatchResult(x_out, handle.recv_topk_idx, handle.recv_topk_weights, aligned, handle)

    def _move(
        self, x: torch.Tensor, scales: torch.Tensor | None, weights: torch.Tensor | None, state: DeviceRoute,
        alignment: int, expand: bool, worst: tuple[int, int] | None = None,
    ) -> _Outputs:  # fmt: skip
        """Send every row once per destination and receive into fresh outputs (two launches); ``worst``: a
        worst-case dispatch's output shape (rows, expanded rows), the rows received being unknown here."""
        from epkit.kernels.triton.ep_normal import dispatch_send
        from epkit.kernels.triton.ep_normal_recv import dispatch_recv

        geo = self._normal_geo(state.num_sms)  # the layout's chunks are the dispatch's programs
        dev, t, k, w, h = self.ctx.device, x.shape[0], self.cfg.num_topk, self.cfg.world_size, self.cfg.hidden
        send_pos = torch.empty((t, w), dtype=torch.int32, device=dev)
        x, scales = x.contiguous(), scales.contiguous() if scales is not None else None
        dispatch_send(geo, x, scales, state.idx, weights, state.lay, send_pos)
        state.send_pos = send_pos
        if worst is not None:  # the rows received are unknown here: outputs of the worst case's shape
            r, rows = worst[0], worst[1] if expand else worst[0]
        else:
            r, rows = state.rows, state.expanded if expand else state.rows
        g = scales.shape[1] if scales is not None else 0
        out: _Outputs = {
            "x": torch.empty((rows, h), dtype=x.dtype, device=dev),
            "s": torch.empty((rows, g), dtype=torch.float32, device=dev) if scales is not None else None,
            "idx": torch.empty((r, k), dtype=state.idx.dtype, device=dev),
            "w": torch.empty((r, k), dtype=torch.float32, device=dev),
        }
        if expand:
            out["rows"] = torch.empty(rows, dtype=torch.int64, device=dev)
            out["slot"] = torch.empty((r, k), dtype=torch.int64, device=dev)
            out["m"] = torch.empty(rows, dtype=torch.int32, device=dev)
        dispatch_recv(geo, out, state.lay, -1 if worst else r, alignment, h * x.element_size(), 4 * g)
        self.dev.poll()
        return out

    def agree(self, what: str, handle: DispatchHandle, error: str | None) -> None:
        """The device form of ``agree_on_handle`` (one launch, one host read): the same errors, raised on every
        rank before any row moves; the buffer goes on. After a worst-case dispatch (a valid ``handle`` with
        ``worst``) the kernel judges and nothing is read back: a rejection is raised at the rank's next call, on
        every rank, and retires the buffer (as a worst-case dispatch's own)."""
        from epkit.kernels.triton.ep_combine import agree

        self.ctx.buffer.check_usable()
        self.dev.poll()
        _, cgeo, _, agreed = self._geometries()
        ident = (handle.buffer_id, handle.epoch) if error is None else (0, 0)
        judged = 0 if error is not None or handle.worst is None else 1 + (what == "cached dispatch")
        self.exchanges["agree"] += 1
        ready = self.exchanges["agree"]
        agree(cgeo, self.dev.error_text(error), agreed, OK if error is None else REJECTED, ident, ready, judged)
        if judged:
            return
        got, w = self._read_back(agreed, ready), self.cfg.world_size
        heads = [[got[r], got[w + r], got[2 * w + r]] for r in range(w)]
        exchange = got[4 * w]  # the device's number (graph replays count there)
        try:
            judge_agreement(self.ctx, what, heads, lambda src: self.dev.message_text("agree", src, exchange, 32))
        except ValueError as exc:
            if any(got[3 * w : 4 * w]):  # a peer judged it on the device and retired: so does this rank
                self.dev.retire(exc)
            raise

    def fused(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, alignment: int,
        error: str | None, biases: list[torch.Tensor], experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:  # fmt: skip
        """``fused_moe`` on the kernels: dispatch (expanded, ``alignment``) -> ``experts(rows, m_indices)`` ->
        combine, with one host read (the dispatch's summary, which sizes the expert rows) and no host barrier;
        ``error``: the caller's validation failure (raised on every rank before any row moves)."""
        from epkit.kernels.triton.ep_combine import agree

        what = "fused_moe rejected on every rank before any row moved"
        recv, _, _, _, handle = self._dispatch(x, None, topk_idx, topk_weights, alignment, True, error, what)
        with self.ctx.retire_on_failure("fused_moe"):
            state = handle.kernel_state
            assert isinstance(recv, torch.Tensor) and state is not None and state.m is not None  # x only, expanded
            y = experts(recv, state.m)
            # An exchange between the dispatch's rows and the combine's, which share memory: the agreement,
            # whose verdict is known (every handle is this call's) and so never read back.
            _, cgeo, _, agreed = self._geometries()
            self.exchanges["agree"] += 1
            agree(cgeo, self.dev.error_text(None), agreed, 0, (handle.buffer_id, handle.epoch),
                  self.exchanges["agree"])  # fmt: skip
            return self._combine(y, handle, handle.recv_topk_weights, biases)

    def _combine(
        self, y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None, biases: list[torch.Tensor],
        num_sms: int | None = None, order: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``combine`` on the kernels after the agreement: expert side, then source side (two launches of
        ``num_sms`` programs, None: the buffer's; ``order``: the source side's per-token rank order)."""
        from epkit.kernels.triton.ep_combine import combine_reduce, combine_send

        cgeo = self._geometries()[1]
        if num_sms is not None:
            cgeo = dataclasses.replace(cgeo, ctas=num_sms, exact_ctas=True)
        state = handle.kernel_state
        assert state is not None  # a dispatch on the kernels made the handle (the agreement checked it)
        tail = self._normal_geo(state.num_sms).tail()  # where the dispatch's layout keeps its receive counts
        y = y.contiguous()
        if handle.expand:
            assert weights is not None  # the expanded mode's
            w = weights.float().to(self.ctx.device).contiguous()
            combine_send(cgeo, y, state.lay, tail, state.rows, handle.expanded_slot, w)
        else:
            combine_send(cgeo, y, state.lay, tail, state.rows)
        out = torch.empty((handle.num_tokens, self.cfg.hidden), dtype=y.dtype, device=self.ctx.device)
        biases = [b.to(self.ctx.device).contiguous() for b in biases]
        combine_reduce(cgeo, out, state.send_pos, biases, None if order is None else order.contiguous())
        self.dev.poll()
        return out
