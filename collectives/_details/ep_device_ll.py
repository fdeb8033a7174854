"""EPBuffer's low-latency pair on the device kernels (``kernels/triton/ep_low_latency.py``): four launches per
dispatch + combine, no host synchronisation, no host read of anything routing-dependent, no waiting for the
device, and only fixed addresses in the launches (the pair can be captured in a CUDA graph).

Mixed into :class:`~epkit.collectives.ep_buffer.EPBuffer` (``low_latency_dispatch`` / ``low_latency_combine``
come here when the buffer took the device path, ``_dev``). Errors follow the stream-ordered path's rules
(``_details/ep_low_latency.py``): a rank's invalid input is sent as a rejecting header and raised by that rank
at once; what the kernels find (rejections, overflowing slots, bad expert ids, a silent peer, handles of
different dispatches) is raised on every rank by the call that finds it (the next call, or ``synchronize()``,
on a GPU) and retires the buffer on every rank.
"""

from __future__ import annotations

import torch

from epkit.collectives._details import ep_low_latency_out as outputs
from epkit.collectives._details.ep_low_latency_layout import LowLatencyHandle
from epkit.kernels.triton.ep_layout import check_aligned

__all__ = ["DeviceLowLatencyMixin"]


class DeviceLowLatencyMixin:
    """The low-latency calls of an EPBuffer on the device path (its ``_dev``: a DeviceState)."""

    def _ll_geometry(self):
        """The kernels' fixed arguments for this buffer (made once)."""
        dev = self._dev
        if getattr(dev, "ll", None) is None:
            from epkit.kernels.triton.ep_low_latency import LLGeometry

            lay = dev.layout
            dev.ll = LLGeometry(
                rank=self.rank,
                world=self.world_size,
                num_experts=self.num_experts,
                num_topk=self.num_topk,
                hidden=self.hidden,
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
                device=self.device,
            )
        return dev.ll

    def _device_load_counter(self) -> torch.Tensor:
        """Tokens received per local expert, counted on the device (``take_expert_load`` adds it in)."""
        acc = self.__dict__.get("_device_load")
        if acc is None:
            acc = self._device_load = torch.zeros(self.num_local_experts, dtype=torch.int64, device=self.device)
        return acc

    def _dev_ll_dispatch(self, x, topk_idx, n_max: int, use_fp8: bool, return_recv_hook: bool, out):
        """``low_latency_dispatch`` on the kernels (same arguments and results)."""
        from epkit.kernels.triton.ep_low_latency import ll_dispatch_recv, ll_dispatch_send

        self.buffer.check_usable()
        self._dev.poll()
        self._ll_dispatches += 1
        geo, dev = self._ll_geometry(), self.device
        error = None
        try:
            self._ll_check_host(x, topk_idx, n_max, use_fp8, out)
            check_aligned("x", x)
            for i, part in enumerate(out if isinstance(out, (tuple, list)) else [out]):
                check_aligned("out" if not isinstance(out, (tuple, list)) else f"out[{i}]", part)
        except ValueError as exc:  # every rank must learn of it through the message header
            error = str(exc)
        if error is not None:  # nothing of this call is read: placeholders of the right kinds
            x = torch.empty((0, self.hidden), dtype=torch.bfloat16, device=dev)
            topk_idx = torch.empty((0, self.num_topk), dtype=torch.int64, device=dev)
            n_max = min(n_max, self.num_max_dispatch_tokens_per_rank) if isinstance(n_max, int) and n_max > 0 else 1
            out = None
        x = x.contiguous()
        route = torch.empty((3, x.shape[0], self.num_topk), dtype=torch.int32, device=dev)
        ll_dispatch_send(geo, x, topk_idx.contiguous(), route, self._dev.error_text(error), n_max, use_fp8, bool(error))
        L, slots = self.num_local_experts, n_max * self.world_size
        recv_x, recv_count = outputs.dispatch_outputs(self._ll_cache, out, L, slots, self.hidden, use_fp8, dev)
        counts = torch.empty((self.world_size, self.num_local_experts), dtype=torch.int64, device=dev)
        handle = LowLatencyHandle(
            num_tokens=x.shape[0],
            dst_of=route[0],
            expert_of=route[1],
            pos_of=route[2],
            counts=counts,
            n_max=n_max,
            buffer_id=self.buffer.buffer_id,
            epoch=self._ll_dispatches,
            route=route,
        )
        state = {"outputs": (recv_x, recv_count)}  # let go once filled: a kept hook holds no receive tensor

        def hook():
            if "outputs" in state:
                xs, count = state.pop("outputs")
                xs = xs if use_fp8 else (xs, None)
                ll_dispatch_recv(geo, xs[0], xs[1], counts, count, self._device_load_counter(), n_max, use_fp8)
                self._dev.poll(wait=error is not None)  # a rejecting rank raises now, as every rank will

        if error is not None or not return_recv_hook:
            hook()
        return recv_x, recv_count, handle, hook

    def _dev_ll_combine(self, y, topk_weights, handle: LowLatencyHandle, return_recv_hook: bool, given):
        """``low_latency_combine`` on the kernels, after its validation (same results)."""
        from epkit.kernels.triton.ep_low_latency import ll_combine_recv, ll_combine_send

        self.buffer.check_usable()
        self._dev.poll()
        if handle.route is None:
            raise ValueError("this LowLatencyHandle comes from a buffer on the host-driven path")
        geo, n_max = self._ll_geometry(), handle.n_max
        ident = (handle.buffer_id, handle.epoch)
        ll_combine_send(geo, y.contiguous(), handle.counts, n_max, ident)
        out = {}

        def hook():
            if "y" not in out:
                res = outputs.combine_output(self._ll_cache, given, handle.num_tokens, n_max, self.hidden, self.device)
                ll_combine_recv(geo, res, topk_weights.float().contiguous(), handle.route, n_max, ident)
                out["y"] = res
                self._dev.poll()
            return out["y"]

        if return_recv_hook:
            return None, hook
        return hook()
