"""EPBuffer's low-latency pair on the device kernels (``kernels/triton/ep_low_latency.py``): four launches per
dispatch + combine, no host synchronisation, no host read of anything routing-dependent, no waiting for the
device, and only fixed addresses in the launches (the pair can be captured in a CUDA graph).

The low-latency path of a buffer that took the device kernels (``device_state``). Errors follow the
stream-ordered path's rules (``ep/ll_host.py``): a rank's invalid input is sent as a rejecting header and raised
by that rank at once; what the kernels find (rejections, overflowing slots, bad expert ids, a silent peer, handles of
different dispatches) is raised on every rank by the call that finds it (the next call, or ``synchronize()``,
on a GPU) and retires the buffer on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epkit.collectives.ep import ll_out as outputs
from epkit.collectives.ep import routing
from epkit.collectives.ep.context import EPContext
from epkit.collectives.ep.device_state import DeviceState
from epkit.collectives.ep.ll_layout import LLCombineResult, LLDispatchResult, LowLatencyHandle
from epkit.collectives.ep.ll_out import LLOut
from epkit.kernels.triton.ep_layout import check_aligned

if TYPE_CHECKING:
    from epkit.kernels.triton.ep_low_latency import LLGeometry

__all__ = ["DeviceLowLatencyPath"]


class DeviceLowLatencyPath:
    """The low-latency calls of an EPBuffer on the device kernels (``dev``: the buffer's DeviceState)."""

    def __init__(self, ctx: EPContext, dev: DeviceState) -> None:
        self.ctx, self.cfg, self.dev = ctx, ctx.cfg, dev
        self._geo: LLGeometry | None = None  # the kernels' fixed arguments, made at the first call

    def synchronize(self) -> None:
        """Wait for this rank's queued kernels (bounded) and raise what they recorded (``EPBuffer.synchronize``)."""
        self.ctx.buffer.synchronize()
        self.dev.poll(drain=True)

    def combine(
        self, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle,
        return_recv_hook: bool, out: torch.Tensor | None,
    ) -> LLCombineResult:  # fmt: skip
        """``EPBuffer.low_latency_combine`` on the kernels (same arguments and results)."""
        try:
            routing.check_ll_combine(self.cfg, self.ctx.device, y, topk_idx, topk_weights, handle, out, True, True)
        except ValueError as exc:
            self.ctx.reject_locally("low-latency combine", exc)
        with self.ctx.retire_on_failure("low-latency combine"):
            return self._combine(y, topk_weights, handle, return_recv_hook, out)

    def _geometry(self) -> LLGeometry:
        """The kernels' fixed arguments for this buffer (made once)."""
        dev = self.dev
        if self._geo is None:
            from epkit.kernels.triton.ep_low_latency import LLGeometry

            lay = dev.layout
            self._geo = LLGeometry(
                rank=self.cfg.rank,
                world=self.cfg.world_size,
                num_experts=self.cfg.num_experts,
                num_topk=self.cfg.num_topk,
                hidden=self.cfg.hidden,
                header=lay["header"],
                text=lay["text"],
                ctrl=dev.ctrl,
                notices=dev.notices,
                ctrl_table=dev.tables["ctrl"],
                dispatch_table=dev.tables["ll_dispatch"],
                combine_table=dev.tables["ll_combine"],
                dispatch_local=dev.local["ll_dispatch"],
                combine_local=dev.local["ll_combine"],
                dispatch_area=lay["ll_dispatch_area"],
                dispatch_msg=lay["ll_dispatch_msg"],
                combine_area=lay["ll_combine_area"],
                combine_msg=lay["ll_combine_msg"],
                status=dev.status.data_ptr(),
                clock=dev.clock,
                timeout_ns=dev.timeout_ns,
                device=self.ctx.device,
            )
        return self._geo

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, n_max: int, use_fp8: bool, return_recv_hook: bool, out: LLOut
    ) -> LLDispatchResult:
        """``low_latency_dispatch`` on the kernels (same arguments and results)."""
        from epkit.kernels.triton.ep_low_latency import ll_dispatch_recv, ll_dispatch_send

        self.ctx.buffer.check_usable()
        self.dev.poll()
        self.ctx.ll_dispatches += 1
        geo, dev = self._geometry(), self.ctx.device
        error = None
        try:
            routing.check_ll_dispatch(self.cfg, self.ctx.device, x, topk_idx, n_max, use_fp8, out, True)
            check_aligned("x", x)
            for i, part in enumerate(out if isinstance(out, (tuple, list)) else [out]):
                check_aligned("out" if not isinstance(out, (tuple, list)) else f"out[{i}]", part)
        except ValueError as exc:  # every rank must learn of it through the message header
            error = str(exc)
        if error is not None:  # nothing of this call is read: placeholders of the right kinds
            x = torch.empty((0, self.cfg.hidden), dtype=torch.bfloat16, device=dev)
            topk_idx = torch.empty((0, self.cfg.num_topk), dtype=torch.int64, device=dev)
            n_max = min(n_max, self.cfg.num_max_dispatch_tokens_per_rank) if isinstance(n_max, int) and n_max > 0 else 1
            out = None
        x = x.contiguous()
        route = torch.empty((3, x.shape[0], self.cfg.num_topk), dtype=torch.int32, device=dev)
        ll_dispatch_send(geo, x, topk_idx.contiguous(), route, self.dev.error_text(error), n_max, use_fp8, bool(error))
        L, slots = self.cfg.num_local_experts, n_max * self.cfg.world_size
        recv_x, recv_count = outputs.dispatch_outputs(self.ctx.ll_outputs, out, L, slots, self.cfg.hidden, use_fp8, dev)
        counts = torch.empty((self.cfg.world_size, self.cfg.num_local_experts), dtype=torch.int64, device=dev)
        handle = LowLatencyHandle(
            num_tokens=x.shape[0],
            dst_of=route[0],
            expert_of=route[1],
            pos_of=route[2],
            counts=counts,
            n_max=n_max,
            buffer_id=self.ctx.buffer.buffer_id,
            epoch=self.ctx.ll_dispatches,
            route=route,
        )
        state = {"outputs": (recv_x, recv_count)}  # let go once filled: a kept hook holds no receive tensor

        def hook() -> None:
            if "outputs" in state:
                xs, count = state.pop("outputs")
                parts = xs if use_fp8 else (xs, None)
                ll_dispatch_recv(geo, parts[0], parts[1], counts, count, self.ctx.device_load_counter(), n_max, use_fp8)
                self.dev.poll(wait=error is not None)  # a rejecting rank raises now, as every rank will

        if error is not None or not return_recv_hook:
            hook()
        return recv_x, recv_count, handle, hook

    def _combine(
        self, y: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle, return_recv_hook: bool,
        given: torch.Tensor | None,
    ) -> LLCombineResult:  # fmt: skip
        """``low_latency_combine`` on the kernels, after its validation (same results)."""
        from epkit.kernels.triton.ep_low_latency import ll_combine_recv, ll_combine_send

        self.ctx.buffer.check_usable()
        self.dev.poll()
        if handle.route is None:
            raise ValueError("this LowLatencyHandle comes from a buffer on the host-driven path")
        geo, n_max = self._geometry(), handle.n_max
        ident = (handle.buffer_id, handle.epoch)
        ll_combine_send(geo, y.contiguous(), handle.counts, n_max, ident)
        out: dict[str, torch.Tensor] = {}

        def hook() -> torch.Tensor:
            if "y" not in out:
                res = outputs.combine_output(
                    self.ctx.ll_outputs, given, handle.num_tokens, n_max, self.cfg.hidden, self.ctx.device
                )
                ll_combine_recv(geo, res, topk_weights.float().contiguous(), handle.route, n_max, ident)
                out["y"] = res
                self.dev.poll()
            return out["y"]

        if return_recv_hook:
            return None, hook
        return hook()
