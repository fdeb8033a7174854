"""The low-latency half of ``epkit.compat.deep_ep.Buffer``: DeepEP's ``low_latency_dispatch`` /
``low_latency_combine`` / ``clean_low_latency_buffer`` / ``get_next_low_latency_combine_buffer`` over
EPBuffer's low-latency mode.

On the Buffer's session (``deep_ep_session``), shared with its normal-mode calls. On CPU ranks every dispatch and
combine agrees with the other ranks on its arguments before it picks a buffer or moves a row (a rejection or
arguments that differ: the same ValueError on every rank); on an NCCL group it makes no host agreement. A dispatch
gathers every rank's ``topk_idx`` for DeepEP's handle (an all-gather: stream-ordered on NCCL). Nothing here reads
device data on the host: a CUDA call stays stream-ordered as EPBuffer's is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epkit.compat._details.deep_ep_agreement import FieldValue, size_of
from epkit.compat._details.deep_ep_config import EventHandle, EventOverlap
from epkit.compat._details.deep_ep_handles import LowLatencyHandle, low_latency_handle
from epkit.compat._details.deep_ep_layouts import DeepEPRows, LowLatencyOutputs
from epkit.compat._details.deep_ep_session import Hook, Session
from epkit.compat._details.deep_ep_shrink import RankMask, sub_experts, widen
from epkit.quant import FP8_BLOCK

if TYPE_CHECKING:
    from epkit.collectives.ep.ll_layout import LLCombineResult, LLDispatchResult
    from epkit.collectives.ep_buffer import EPBuffer

__all__ = ["LowLatencyCalls"]


def _flags(fn: str, **flags: object) -> None:
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise ValueError(f"{fn}: {name} must be a bool, got {v!r}")
    if flags.get("async_finish") and flags.get("return_recv_hook"):
        raise ValueError(f"{fn}: async_finish and return_recv_hook cannot both be True (as in DeepEP)")


def _parts(rows: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return rows if isinstance(rows, tuple) else (rows,)


def _positive(fn: str, name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{fn}: {name} must be a positive int, got {v!r}")
    return v


def _check_tensors(
    fn: str, x: object, topk_idx: object, num_experts: object, stats: object, group_size: int, fp8_blocks: int
) -> str | None:
    """A low-latency dispatch's tensors checked on this rank: the error text, or None (``fp8_blocks``: 0 without
    FP8, else the 128-column blocks ``hidden`` must be a multiple of)."""
    try:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ValueError(f"{fn}: x must be a bf16 [num_tokens, hidden] tensor, got {x!r:.60}")
        if fp8_blocks and x.shape[1] % (fp8_blocks * FP8_BLOCK):
            raise ValueError(f"{fn}: use_fp8 needs hidden % 128 == 0 (% 512 with use_ue8m0), got hidden = {x.shape[1]}")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise ValueError(f"{fn}: topk_idx must be a [num_tokens, num_topk] tensor, got {topk_idx!r:.60}")
        local = _positive(fn, "num_experts", num_experts) // group_size
        if stats is not None and (not isinstance(stats, torch.Tensor) or stats.shape != (local,)):
            raise ValueError(f"{fn}: cumulative_local_expert_recv_stats must be [{local}] int32 (num_local_experts)")
    except ValueError as exc:
        return str(exc)
    return None


def _fields(x: object, topk_idx: object, num_experts: object, n_max: int | None) -> list[tuple[str, FieldValue]]:
    """What every rank's low-latency dispatch must share (the agreement's fields; None: no such value here)."""
    return [
        ("x hidden size", size_of(x, 1)),
        ("x dtype", x.dtype if isinstance(x, torch.Tensor) else None),
        ("num_experts", num_experts if isinstance(num_experts, int) else None),
        ("topk_idx columns (num_topk)", size_of(topk_idx, 1)),
        ("num_max_dispatch_tokens_per_rank", n_max),
    ]


class LowLatencyCalls:
    """The low-latency calls of one Buffer, on its session ``s`` (module docstring); ``low_latency_mode``: the
    Buffer's (DeepEP refuses low-latency calls without it)."""

    def __init__(self, session: Session, low_latency_mode: bool) -> None:
        self.s, self.low_latency_mode = session, low_latency_mode

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: each of epkit's low-latency messages carries its own header (the arguments are
        checked), so a low-latency call may follow a normal one directly. In shrink mode the unmasked ranks meet
        (as DeepEP's clean does): a rank silent past the timeout is masked, arguments that differ are the same
        ValueError on every rank."""
        fn = "clean_low_latency_buffer"
        args = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        error: str | None = None
        try:
            for name, v in zip(("num_max_dispatch_tokens_per_rank", "hidden"), args):
                _positive(fn, name, v)
            if _positive(fn, "num_experts", num_experts) % self.s.group_size:
                raise ValueError(f"{fn}: num_experts ({num_experts}) must be a multiple of the group size")
        except ValueError as exc:
            if self.s.agreement.shrink is None:
                raise
            error = str(exc)
        if self.s.agreement.shrink is not None:
            names = ("num_max_dispatch_tokens_per_rank", "hidden", "num_experts")
            self.s.settle()
            self.s.agree(fn, error, [(n, v if isinstance(v, int) else None) for n, v in zip(names, args)])

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask ``rank_to_mask`` (shrink mode): a masked rank is neither sent to nor waited
        for in the low-latency calls. Takes effect on every rank at the next call (``deep_ep_shrink``)."""
        self._shrink("low_latency_update_mask_buffer").update(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write into ``mask_status`` (``[num_ranks]`` int32) 1 for each masked rank, 0 for the others (shrink
        mode)."""
        self._shrink("low_latency_query_mask_buffer").query(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank here (shrink mode; call it on every rank): the next call waits for all of them again."""
        self._shrink("low_latency_clean_mask_buffer").masked.clear()

    def _shrink(self, fn: str) -> RankMask:
        shrink = self.s.agreement.shrink
        if shrink is None:
            raise RuntimeError(f"{fn}: the Buffer was made without enable_shrink=True (as DeepEP, it needs it)")
        return shrink

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[DeepEPRows, torch.Tensor, LowLatencyHandle, EventOverlap, Hook | None]:
        """``(recv_x, recv_count, handle, event, hook)``: each (token, expert) pair into the expert's rank's slots.

        ``recv_x``: ``[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden]`` bf16, or with
        ``use_fp8`` ``(e4m3, scales)`` with the scales column-major (float32 ``[..., hidden / 128]``, or packed
        UE8M0 int32 ``[..., hidden / 512]`` with ``use_ue8m0``; ``round_scale`` rounds them to powers of two).
        Rows of expert ``e`` past ``recv_count[e]`` are unspecified. ``cumulative_local_expert_recv_stats``
        (``[num_local_experts]`` int32) is added the counts. ``hook`` (with ``return_recv_hook``) receives the
        data; else None.
        """
        fn = "low_latency_dispatch"
        # every check feeds the agreement: a rank never raises alone (its peers would wait)
        error: str | None = None
        n_max: int | None = None
        try:
            _flags(fn, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=async_finish,
                   return_recv_hook=return_recv_hook)  # fmt: skip
            if not self.low_latency_mode:
                raise ValueError(f"{fn}: the Buffer was made with low_latency_mode=False (as DeepEP, it needs True)")
            if dispatch_wait_recv_cost_stats is not None:
                raise ValueError(f"{fn}: dispatch_wait_recv_cost_stats (per-rank wait times) is not supported")
            if use_ue8m0 and not round_scale:
                raise ValueError(f"{fn}: use_ue8m0=True needs round_scale=True (as in DeepEP)")
            n_max = _positive(fn, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        except ValueError as exc:
            error = str(exc)
        self.s.settle()
        stats = cumulative_local_expert_recv_stats
        if error is None:
            fp8_blocks = use_fp8 and (1 + 3 * use_ue8m0)
            error = _check_tensors(fn, x, topk_idx, num_experts, stats, self.s.group_size, fp8_blocks)
        if self.s.nccl:  # CUDA ranks: no host agreement (the call stays stream-ordered)
            if error is not None:
                raise ValueError(error)
        else:  # the same buffer on every rank, or the same ValueError (a rejection, or arguments that differ)
            self.s.agree(fn, error, _fields(x, topk_idx, num_experts, n_max))
        assert n_max is not None  # set by the checks, which passed on every rank (else a ValueError came above)
        hidden, shrink = x.shape[1], self.s.agreement.shrink is not None
        padded = topk_idx.new_full((n_max, topk_idx.shape[1]), -1, dtype=torch.int64)  # one dtype on every rank
        padded[: topk_idx.shape[0]] = topk_idx
        # every rank's routing (DeepEP's handle); in shrink mode before any row moves, so that the ranks masked
        # for the rows are the handle's too (a masked rank's routing: none)
        topk_all = self.s.gather(padded, fn, -1) if shrink else None
        mode = "bf16" if not use_fp8 else ("round" if round_scale else "fp8")
        buf, dispatched, wide = self._move(x, topk_idx, n_max, num_experts, mode, return_recv_hook)
        recv_x, recv_count, h, ll_hook = dispatched
        out = LowLatencyOutputs(mode, use_ue8m0, recv_x if wide is None else wide, recv_count)  # no copy (but shrink's)

        def receive() -> None:
            ll_hook()
            if wide is not None:  # a buffer over fewer ranks (shrink mode): its rows in front of DeepEP's layout
                for full, got in zip(_parts(wide), _parts(recv_x)):
                    full[:, : got.shape[1]].copy_(got)
            out.fill()
            if stats is not None:
                stats.add_(out.count.to(stats.dtype))

        hook = self.s.deferred(receive, return_recv_hook)
        if topk_all is None:
            topk_all = self.s.gather(padded, fn)
        src_info, layout_range = low_latency_handle(topk_all, self.s.rank, num_experts // self.s.group_size, n_max)
        handle = LowLatencyHandle((src_info, layout_range, n_max, hidden, num_experts), buf, h)
        event = EventOverlap(EventHandle() if async_finish else None, (x, topk_idx) if async_finish else None)
        return out.result(), out.count, handle, event, hook

    def _move(
        self, x: torch.Tensor, topk_idx: torch.Tensor, n_max: int, num_experts: int, mode: str, recv_hook: bool
    ) -> tuple[EPBuffer, LLDispatchResult, DeepEPRows | None]:
        """The dispatch's rows moved by its EPBuffer: ``(buffer, its result, None)``; in shrink mode over the ranks
        not masked (``Session.shrink_buffer``), the experts renumbered, and where the buffer has fewer ranks than
        the Buffer, DeepEP's wider receive tensors to copy its rows into (``[L, N * W, ...]``, zeros)."""
        hidden, k, fp8 = x.shape[1], topk_idx.shape[1], mode == "fp8"
        shrink = self.s.agreement.shrink
        if shrink is None:
            buf = self.s.epbuffer(hidden, num_experts, k, x.device, 0, n_max)
            return buf, buf.low_latency_dispatch(x, topk_idx, n_max, use_fp8=fp8, return_recv_hook=recv_hook), None
        buf = self.s.shrink_buffer(hidden, num_experts, k, n_max)
        members = self.s.members[id(buf)]
        ids = sub_experts(topk_idx, members, shrink.masked, num_experts // self.s.group_size, num_experts)
        dispatched: LLDispatchResult = buf.low_latency_dispatch(x, ids, n_max, use_fp8=fp8, return_recv_hook=recv_hook)
        if len(members) == self.s.group_size:
            return buf, dispatched, None
        slots = n_max * self.s.group_size
        rows = dispatched[0]
        return (
            buf,
            dispatched,
            (widen(rows[0], slots), widen(rows[1], slots)) if isinstance(rows, tuple) else widen(rows, slots),
        )

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Hook | None]:
        """``(combined_x [num_tokens, hidden] bf16, event, hook)``: every pair's row back to its token, summed with
        ``topk_weights`` in float32 (k ascending). ``x`` is the dispatch's layout ``[num_local_experts, N * W,
        hidden]`` bf16; with ``zero_copy`` the rows are taken from :meth:`get_next_low_latency_combine_buffer`'s
        tensor instead. ``out`` receives the result. ``use_logfmt`` is accepted with no effect: the rows travel as
        bf16 (DeepEP's 10-bit LogFMT saves bytes at a precision epkit keeps)."""
        fn = "low_latency_combine"
        self.s.settle()
        error: str | None = None
        try:  # every check in the call's agreement (CPU ranks): a rank never raises alone
            _flags(fn, use_logfmt=use_logfmt, zero_copy=zero_copy, async_finish=async_finish,
                   return_recv_hook=return_recv_hook)  # fmt: skip
            if combine_wait_recv_cost_stats is not None:
                raise ValueError(
                    f"{fn}: combine_wait_recv_cost_stats (per-rank wait times) is not supported; pass None"
                )
            if not isinstance(handle, LowLatencyHandle) or not any(handle.buffer is b for b in self.s.made):
                raise ValueError(f"{fn}: handle must be the handle a low_latency_dispatch of this Buffer returned")
            if zero_copy and "y" not in handle.staging:
                raise ValueError(f"{fn}: zero_copy=True needs get_next_low_latency_combine_buffer(handle) filled first")
            if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
                raise ValueError(f"{fn}: topk_idx must be a [num_tokens, num_topk] tensor, got {topk_idx!r:.60}")
            if not isinstance(topk_weights, torch.Tensor) or topk_weights.shape != topk_idx.shape:
                raise ValueError(f"{fn}: topk_weights must be a tensor shaped as topk_idx {tuple(topk_idx.shape)}")
        except ValueError as exc:
            error = str(exc)
        if self.s.nccl:  # CUDA ranks: no host agreement (the call stays stream-ordered)
            if error is not None:
                raise ValueError(error)
        else:  # the same handle (buffer and dispatch) on every rank, or the same ValueError everywhere
            self.s.agree(fn, error, self.s.handle_fields(handle))
        if zero_copy:
            x = handle.staging["y"]
        buf = handle.buffer
        if self.s.agreement.shrink is not None:  # the ranks masked now, a buffer over fewer ranks: its rows of x
            self.s.apply_mask(buf)
            slots = handle.num_max_dispatch_tokens_per_rank * len(self.s.members[id(buf)])
            if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] > slots:
                x = x[:, :slots].contiguous()
        if out is None:  # a wrong y or out is EPBuffer's to reject: the same ValueError on every rank
            out = torch.empty((topk_idx.shape[0], handle.hidden), dtype=torch.bfloat16, device=buf.device)
        weights = topk_weights.float() if isinstance(topk_weights, torch.Tensor) else topk_weights
        res: LLCombineResult = buf.low_latency_combine(
            x, topk_idx, weights, handle.handle, return_recv_hook=return_recv_hook, out=out
        )

        def receive() -> None:  # EPBuffer writes into out
            if return_recv_hook:
                assert isinstance(res, tuple)  # with return_recv_hook EPBuffer returns (None, hook)
                res[1]()

        hook = self.s.deferred(receive, return_recv_hook)
        keep = (x, topk_idx, topk_weights) if async_finish else None
        return out, EventOverlap(EventHandle() if async_finish else None, keep), hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """A bf16 ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]`` tensor to write the
        expert outputs into, for ``low_latency_combine(..., zero_copy=True)`` (one per handle)."""
        if not isinstance(handle, LowLatencyHandle):
            raise ValueError("get_next_low_latency_combine_buffer: handle must be a low_latency_dispatch handle")
        if "y" not in handle.staging:
            shape = (
                handle.buffer.num_local_experts,
                self.s.group_size * handle.num_max_dispatch_tokens_per_rank,
                handle.hidden,
            )
            handle.staging["y"] = torch.empty(shape, dtype=torch.bfloat16, device=handle.buffer.device)
        return handle.staging["y"]
