"""EPBuffer's normal mode on the device kernels (``kernels/triton/ep_normal.py``, ``ep_normal_recv.py``,
``ep_combine.py``).

Dispatch: ``layout`` -> ``notify`` -> one host read of the summary (every rank's status and format, the rows
received: this is what sizes the outputs) -> ``dispatch_send`` -> ``dispatch_recv``; routing and handles stay
on the device. Combine and cached dispatch: ``agree`` -> one host read (every rank's call valid, every handle
from the same dispatch of this buffer: else the same ValueError on every rank, before any row moves, and the
buffer goes on) -> ``combine_send`` -> ``combine_reduce`` (or ``dispatch_send`` -> ``dispatch_recv``).

Mixed into :class:`~epkit.collectives.ep_buffer.EPBuffer`; its ``dispatch`` / ``combine`` come here when the
buffer took the device path (``_dev``). Results are bitwise those of the host-driven path.
"""

from __future__ import annotations

import time

import torch

from epkit.collectives._details.ep_low_latency_layout import describe_header
from epkit.collectives._details.ep_normal import DispatchHandle
from epkit.collectives._details.ep_rows import META_MSG, check_formats, decode_error, format_code
from epkit.kernels.triton.ep_layout import OK, REJECTED, check_aligned

__all__ = ["DeviceNormalMixin"]

#: Seconds past the buffer's timeout before the host calls its stream stuck while waiting for a summary.
_GRACE_S = 10.0


class DeviceNormalMixin:
    """Normal-mode dispatch / combine of an EPBuffer on the device path (its ``_dev``: a DeviceState)."""

    def _normal_geometries(self):
        """(NormalGeometry, CombineGeometry, host summary, host agreement) for this buffer (made once)."""
        dev = self._dev
        if getattr(dev, "normal", None) is None:
            from epkit.kernels.triton.ep_combine import CombineGeometry
            from epkit.kernels.triton.ep_normal import NormalGeometry, summary_words

            lay, w = dev.layout, self.world_size
            common = {
                "rank": self.rank,
                "world": w,
                "num_topk": self.num_topk,
                "text": lay["text"],
                "ctrl": dev.ctrl,
                "notices": dev.notices,
                "ctrl_table": dev.tables["ctrl"],
                "rows_table": dev.tables["rows"],
                "rows_local": dev.local["rows"],
                "status": dev.status.data_ptr(),
                "clock": dev.clock,
                "timeout_ns": dev.timeout_ns,
                "device": self.device,
            }
            n = self.num_max_tokens_per_rank
            normal = NormalGeometry(
                num_experts=self.num_experts,
                cap=w * n,
                notify_table=dev.tables["notify"],
                notify_area=lay["notify_area"],
                notify_msg=lay["notify_msg"],
                **common,
            )
            combine = CombineGeometry(
                hidden=self.hidden,
                n_max=n,
                agree_table=dev.tables["agree"],
                agree_area=lay["agree_area"],
                agree_msg=lay["agree_msg"],
                **common,
            )
            pinned = self.device.type == "cuda"
            summary = torch.zeros(summary_words(w, self.num_local_experts), dtype=torch.int64, pin_memory=pinned)
            agreed = torch.zeros(3 * w + 1, dtype=torch.int64, pin_memory=pinned)  # + the ready word
            dev.normal = (normal, combine, summary, agreed)
            dev.exchanges = {"notify": 0, "agree": 0}
        return dev.normal

    def _read_back(self, host: torch.Tensor, ready: int) -> list[int]:
        """The words of ``host`` but its last (the one host read of the call), once the kernel that writes them
        has written ``ready`` into that last word, which it does after every other (a system-scope release):
        a busy poll of pinned memory, no stream synchronisation, bounded by the buffer's timeout and a grace."""
        words = host.numpy()
        if words[-1] != ready and self.device.type == "cuda":
            deadline = time.monotonic() + self.timeout + _GRACE_S
            while words[-1] != ready:
                if time.monotonic() > deadline:
                    exc = TimeoutError(f"rank {self.rank}: the CUDA stream did not reach the dispatch summary")
                    self.buffer.mark_broken(str(exc), culprit=self.rank)
                    raise exc
        values = words.tolist()
        if values[-1] != ready:  # a kernel that ran without publishing: a fault of epkit's, never a peer's
            raise RuntimeError(f"rank {self.rank}: the summary's ready word is {values[-1]}, expected {ready}")
        self._dev.poll()  # a wait that failed left its record; the summary is not to be trusted then
        return values[:-1]

    def _slot_text(self, area: str, src: int, offset: int) -> str:
        """The error text of source ``src``'s latest ``area`` message ("notify" / "agree"), from this rank's area."""
        dev = self._dev
        lay = dev.layout
        at = lay[area] + (dev.exchanges[area] % 2) * lay[f"{area}_area"] + src * lay[f"{area}_msg"] + offset
        mem = self.buffer.local[dev.area_offset :]
        return decode_error(mem[at : at + META_MSG].cpu())

    def _dev_validate(self, x, scales, topk_idx, topk_weights, alignment) -> str | None:
        """The host-side checks of a dispatch (no data read): the error text, or None."""
        try:
            if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
                raise ValueError(f"expert_alignment must be an int >= 1, got {alignment!r}")
            self.validate_dispatch(x, scales, topk_idx, topk_weights, self.num_max_tokens_per_rank, False)
            check_aligned("x", x)
            if topk_weights is not None and not isinstance(topk_weights, torch.Tensor):
                raise ValueError(f"topk_weights must be a tensor, got {type(topk_weights).__name__}")
        except Exception as exc:  # noqa: BLE001 -- every rank must learn of it in the notify exchange
            return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        return None

    def _dev_dispatch(self, x, scales, topk_idx, topk_weights, alignment: int, expand: bool, error=None, what=None):
        """``dispatch`` (not cached) on the kernels: same arguments and results. ``error``: the caller's own
        validation failed (``fused_moe``); ``what``: the caller's name in the rejection ("dispatch")."""
        from epkit.kernels.triton.ep_normal import layout, notify

        self.buffer.check_usable()
        self._dev.poll()
        self._dispatches += 1
        geo, _, summary, _ = self._normal_geometries()
        error = error or self._dev_validate(x, scales, topk_idx, topk_weights, alignment)
        dev, z = self.device, geo.sizes()
        if error is None:
            idx = topk_idx.to(dev).contiguous().clone()  # the handle's routing (a cached dispatch reuses it)
            fmt = format_code(x.dtype, scales is not None)
        else:
            idx, fmt, alignment = torch.empty((0, self.num_topk), dtype=torch.int64, device=dev), 0, 1
        counts = torch.empty((z["P_P2"], z["W_P2"] + z["E_P2"] + 1), dtype=torch.int32, device=dev)
        layout(geo, idx, counts)
        lay = torch.empty(geo.layout_words(), dtype=torch.int64, device=dev)
        code = OK if error is None else REJECTED
        self._dev.exchanges["notify"] += 1
        ready = self._dev.exchanges["notify"]
        notify(geo, counts, lay, self._dev.error_text(error), summary, code, fmt, alignment, ready)
        got = self._read_back(summary, ready)
        w = self.world_size
        num_rows, num_expanded = got[0], got[1]
        codes, fmts, recv_n = got[2 : 2 + w], got[2 + w : 2 + 2 * w], got[2 + 2 * w : 2 + 3 * w]
        counts_l = got[2 + 3 * w :]
        errors = []
        for src, c in enumerate(codes):
            if c != OK:
                text = self._slot_text("notify", src, 8 * (2 + w + self.num_experts)) if c == REJECTED else ""
                errors.append(describe_header(src, c, 0, text))
        if errors:
            what = what or "dispatch rejected on every rank before any data moved"
            raise ValueError(f"{what}: " + "; ".join(errors))
        check_formats(fmts)
        weights = None if topk_weights is None else topk_weights.float().to(dev).contiguous()
        aligned = [-(-c // alignment) * alignment for c in counts_l]
        state = {"lay": lay, "idx": idx, "rows": num_rows, "expanded": num_expanded, "aligned": aligned}
        with self.retire_on_failure("dispatch"):
            out = self._dev_move(x, scales, weights, state, alignment, expand)
        self.recv_tokens_per_expert_total += torch.tensor(counts_l, dtype=torch.int64)
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
            buffer_id=self.buffer.buffer_id,
            epoch=self._dispatches,
            kernel_state=state,
        )
        state["m"] = out.get("m")
        x_out = (out["x"], out["s"]) if out["s"] is not None else out["x"]
        return x_out, out["idx"], out["w"], aligned, handle

    def _dev_dispatch_cached(self, x, scales, handle: DispatchHandle):
        """A cached dispatch's rows after the agreement: the handle's routing and layout, fresh rows."""
        state = dict(handle.kernel_state)
        with self.retire_on_failure("cached dispatch"):
            out = self._dev_move(x, scales, None, state, handle.expert_alignment, handle.expand)
        x_out = (out["x"], out["s"]) if out["s"] is not None else out["x"]
        return x_out, handle.recv_topk_idx, handle.recv_topk_weights, list(state["aligned"]), handle

    def _dev_move(self, x, scales, weights, state: dict, alignment: int, expand: bool) -> dict:
        """Send every row once per destination and receive into fresh outputs (two launches)."""
        from epkit.kernels.triton.ep_normal import dispatch_send
        from epkit.kernels.triton.ep_normal_recv import dispatch_recv

        geo, _, _, _ = self._normal_geometries()
        dev, t, k, w, h = self.device, x.shape[0], self.num_topk, self.world_size, self.hidden
        send_pos = torch.empty((t, w), dtype=torch.int32, device=dev)
        x, scales = x.contiguous(), scales.contiguous() if scales is not None else None
        dispatch_send(geo, x, scales, state["idx"], weights, state["lay"], send_pos)
        state["send_pos"] = send_pos
        r, rows = state["rows"], state["expanded"] if expand else state["rows"]
        g = scales.shape[1] if scales is not None else 0
        out = {
            "x": torch.empty((rows, h), dtype=x.dtype, device=dev),
            "s": torch.empty((rows, g), dtype=torch.float32, device=dev) if scales is not None else None,
            "idx": torch.empty((r, k), dtype=state["idx"].dtype, device=dev),
            "w": torch.empty((r, k), dtype=torch.float32, device=dev),
        }
        if expand:
            out["rows"] = torch.empty(rows, dtype=torch.int64, device=dev)
            out["slot"] = torch.empty((r, k), dtype=torch.int64, device=dev)
            out["m"] = torch.empty(rows, dtype=torch.int32, device=dev)
        dispatch_recv(geo, out, state["lay"], r, alignment, h * x.element_size(), 4 * g)
        self._dev.poll()
        return out

    def _dev_agree(self, what: str, handle, error: str | None) -> None:
        """The device form of ``agree_on_handle`` (one launch, one host read): the same errors, raised on every
        rank before any row moves; the buffer goes on."""
        from epkit.kernels.triton.ep_combine import agree

        self.buffer.check_usable()
        self._dev.poll()
        _, cgeo, _, agreed = self._normal_geometries()
        ident = (handle.buffer_id, handle.epoch) if error is None else (0, 0)
        self._dev.exchanges["agree"] += 1
        ready = self._dev.exchanges["agree"]
        agree(cgeo, self._dev.error_text(error), agreed, OK if error is None else REJECTED, ident, ready)
        got, w = self._read_back(agreed, ready), self.world_size
        heads = [[got[r], got[w + r], got[2 * w + r]] for r in range(w)]
        self.judge_agreement(what, heads, lambda src: self._slot_text("agree", src, 32))

    def run_fused(self, x, topk_idx, topk_weights, alignment: int, error: str | None, biases, experts):
        """``fused_moe`` on the kernels: dispatch (expanded, ``alignment``) -> ``experts(rows, m_indices)`` ->
        combine, with one host read (the dispatch's summary, which sizes the expert rows) and no host barrier;
        ``error``: the caller's validation failure (raised on every rank before any row moves)."""
        from epkit.kernels.triton.ep_combine import agree

        what = "fused_moe rejected on every rank before any row moved"
        recv, _, _, _, handle = self._dev_dispatch(x, None, topk_idx, topk_weights, alignment, True, error, what)
        with self.retire_on_failure("fused_moe"):
            y = experts(recv, handle.kernel_state["m"])
            # An exchange between the dispatch's rows and the combine's, which share memory: the agreement,
            # whose verdict is known (every handle is this call's) and so never read back.
            _, cgeo, _, agreed = self._normal_geometries()
            self._dev.exchanges["agree"] += 1
            agree(cgeo, self._dev.error_text(None), agreed, 0, (handle.buffer_id, handle.epoch),
                  self._dev.exchanges["agree"])  # fmt: skip
            return self._dev_combine(y, handle, handle.recv_topk_weights, biases)

    def _dev_combine(self, y, handle, weights, biases) -> torch.Tensor:
        """``combine`` on the kernels after the agreement: expert side, then source side (two launches)."""
        from epkit.kernels.triton.ep_combine import combine_reduce, combine_send

        _, cgeo, _, _ = self._normal_geometries()
        state = handle.kernel_state
        tail = self._dev.normal[0].tail()
        y = y.contiguous()
        if handle.expand:
            w = weights.float().to(self.device).contiguous()
            combine_send(cgeo, y, state["lay"], tail, state["rows"], handle.expanded_slot, w)
        else:
            combine_send(cgeo, y, state["lay"], tail, state["rows"])
        out = torch.empty((handle.num_tokens, self.hidden), dtype=y.dtype, device=self.device)
        combine_reduce(cgeo, out, state["send_pos"], [b.to(self.device).contiguous() for b in biases])
        self._dev.poll()
        return out
