"""Normal-mode dispatch, the receiver's half (``ep_normal.py`` has the layout, notify and send kernels): wait for
every source, then copy the received rows (already in the receive layout: source rank, then source token
order) into the outputs, or expand them (one row per slot whose expert is local, grouped by local expert, each
group padded to ``expert_alignment`` with zero rows) with ``m_indices`` and both row maps. A worst-case dispatch's
outputs are sized before the rows received are known: this kernel reads them from the layout and pads the rest
(rows past the received ones: expert ids -1, weights 0, zero x and scale rows, ``m_indices`` -1). 16-byte copies;
Triton for the reasons ``ep_common.py`` gives.
"""

from __future__ import annotations

import triton
import triton.language as tl

from epkit.kernels.triton.ep_common import (
    alive,
    copy_rows,
    copy_rows_at,
    end_exchange,
    launch,
    ptr,
    row_words,
    sent_epoch,
    shared_target,
    wait_sources,
    wide,
    zero_rows_at,
)
from epkit.kernels.triton.ep_layout import KINDS
from epkit.kernels.triton.ep_normal import NormalGeometry, layout_tail, row_fields
from epkit.kernels.triton.launch import launcher

__all__ = ["dispatch_recv"]

_DATA = tl.constexpr(KINDS.index("dispatch"))


@triton.jit
def _expand_block(rows, R, rows_addr, out_x_addr, out_s_addr, exp_rows_ptr, slot_ptr, m_ptr, cap, K: tl.constexpr,
                  K_P2: tl.constexpr, XB: tl.constexpr, SB: tl.constexpr, BLOCK_R: tl.constexpr,
                  BW_X: tl.constexpr, BW_S: tl.constexpr):  # fmt: skip
    """Received rows ``rows`` into their expanded rows (one per slot whose expert is local), with ``m_indices``,
    the expanded row -> received row map and the (row, slot) -> expanded row map. ``BW_X`` / ``BW_S``: words per
    copy step of a pair (a ``BLOCK_R * K_P2``-row tile: kept to 4096 words, so that it stays in registers)."""
    o_s, o_i, _, o_p = row_fields(cap, XB, SB, K)
    kk = tl.arange(0, K_P2)
    inside = (rows < R)[:, None] & (kk < K)[None, :]
    r64 = wide(rows)[:, None] + kk[None, :] * 0
    ep = tl.load(ptr(rows_addr + o_p, tl.int32) + r64 * K + kk[None, :], mask=inside, other=-1)
    loc = tl.load(ptr(rows_addr + o_i, tl.int32) + r64 * K + kk[None, :], mask=inside, other=-1)
    tl.store(slot_ptr + r64 * K + kk[None, :], ep.to(tl.int64), mask=inside)
    live = inside & (ep >= 0)
    e64 = wide(ep)
    tl.store(m_ptr + e64, loc, mask=live)
    tl.store(exp_rows_ptr + e64, r64, mask=live)
    pe, pr, pl = (
        tl.reshape(e64, [BLOCK_R * K_P2]),
        tl.reshape(r64, [BLOCK_R * K_P2]),
        tl.reshape(live, [BLOCK_R * K_P2]),
    )
    copy_rows_at(out_x_addr + pe * XB, rows_addr + pr * XB, pl, XB // 4, BW_X, 16)
    if SB > 0:
        copy_rows_at(out_s_addr + pe * SB, rows_addr + o_s + pr * SB, pl, SB // 4, BW_S, 4)


@triton.jit
def _pad_experts(layout_ptr, out_x_addr, out_s_addr, exp_rows_ptr, m_ptr, align, L, W_P2: tl.constexpr,
                 E_P2: tl.constexpr, P_P2: tl.constexpr, L_P2: tl.constexpr, XB: tl.constexpr, SB: tl.constexpr,
                 BW_X: tl.constexpr, BW_S: tl.constexpr):  # fmt: skip
    """The padding rows of each local expert's group (this program's experts): zero rows, -1 entries."""
    tail = layout_ptr + layout_tail(W_P2, E_P2, P_P2)
    r = tl.arange(0, 16)
    for le in range(tl.program_id(0), L, tl.num_programs(0)):
        c = tl.load(tail + 2 * W_P2 + L_P2 + le)
        first = tl.load(tail + 2 * W_P2 + le) + c
        end = first - c + (c + align - 1) // align * align
        for r0 in range(first, end, 16):
            rows = wide(r0 + r)
            live = rows < end
            zero_rows_at(out_x_addr + rows * XB, live, XB // 4, BW_X, 16)
            if SB > 0:
                zero_rows_at(out_s_addr + rows * SB, live, SB // 4, BW_S, 4)
            tl.store(m_ptr + rows, -1, mask=live)
            tl.store(exp_rows_ptr + rows, -1, mask=live)


@triton.jit
def _pad_worst(R, RW, X, XW, out_x_addr, out_s_addr, out_idx_ptr, out_w_ptr, exp_rows_ptr, slot_ptr, m_ptr,
               K: tl.constexpr, K_P2: tl.constexpr, XB: tl.constexpr, SB: tl.constexpr, EXPAND: tl.constexpr,
               BLOCK_R: tl.constexpr, BW_X: tl.constexpr, BW_S: tl.constexpr):  # fmt: skip
    """A worst-case dispatch's rows past the received ones: rows ``[R, RW)`` get expert ids and expanded slots -1
    and weights 0, x rows ``[X, XW)`` zeros (and scales), -1 in ``m_indices`` and the expanded row map."""
    kk = tl.arange(0, K_P2)
    p0, step = tl.program_id(0) * BLOCK_R, tl.num_programs(0) * BLOCK_R
    for r0 in range(R + p0, RW, step):
        rows = r0 + tl.arange(0, BLOCK_R)
        inside = (rows < RW)[:, None] & (kk < K)[None, :]
        at = wide(rows)[:, None] * K + kk[None, :]
        tl.store(out_idx_ptr + at, tl.full([BLOCK_R, K_P2], -1, tl.int32), mask=inside)
        tl.store(out_w_ptr + at, tl.full([BLOCK_R, K_P2], 0.0, tl.float32), mask=inside)
        if EXPAND:
            tl.store(slot_ptr + at, tl.full([BLOCK_R, K_P2], -1, tl.int64), mask=inside)
    for r0 in range(X + p0, XW, step):
        rows = wide(r0 + tl.arange(0, BLOCK_R))
        live = rows < XW
        zero_rows_at(out_x_addr + rows * XB, live, XB // 4, BW_X, 16)
        if SB > 0:
            zero_rows_at(out_s_addr + rows * SB, live, SB // 4, BW_S, 4)
        if EXPAND:
            tl.store(m_ptr + rows, -1, mask=live)
            tl.store(exp_rows_ptr + rows, -1, mask=live)


@triton.jit(do_not_specialize=["timeout_ns", "W", "R", "RW", "XW", "cap", "align", "L"])
def _dispatch_recv(out_x_addr, out_s_addr, out_idx_ptr, out_w_ptr, exp_rows_ptr, slot_ptr, m_ptr, layout_ptr,
                   status_addr, rows_addr, ctrl_addr, notice_addr, clock_addr, timeout_ns, W, R, RW, XW, cap, align,
                   L, K: tl.constexpr, K_P2: tl.constexpr, XB: tl.constexpr, SB: tl.constexpr,
                   EXPAND: tl.constexpr, W_P2: tl.constexpr, E_P2: tl.constexpr, P_P2: tl.constexpr,
                   L_P2: tl.constexpr, BLOCK_R: tl.constexpr, BW_X: tl.constexpr, BW_E: tl.constexpr,
                   BW_S: tl.constexpr, HW_TIMER: tl.constexpr):  # fmt: skip
    ctrl = ptr(ctrl_addr, tl.int64)
    if alive(ctrl, W):
        e = sent_epoch(ctrl, _DATA, W)
        if wait_sources(
            ctrl, _DATA, W, shared_target(e), e, notice_addr, status_addr, clock_addr, timeout_ns, HW_TIMER
        ):
            tail = layout_ptr + layout_tail(W_P2, E_P2, P_P2) + 2 * W_P2 + 2 * L_P2  # rows, expanded rows received
            R = tl.where(R < 0, tl.load(tail).to(tl.int32), R)  # -1: a worst-case dispatch's, from the layout
            o_s, o_i, o_w, _ = row_fields(cap, XB, SB, K)
            kk = tl.arange(0, K_P2)
            for r0 in range(tl.program_id(0) * BLOCK_R, R, tl.num_programs(0) * BLOCK_R):
                rows = r0 + tl.arange(0, BLOCK_R)
                inside = (rows < R)[:, None] & (kk < K)[None, :]
                at = wide(rows)[:, None] * K + kk[None, :]
                tl.store(out_idx_ptr + at, tl.load(ptr(rows_addr + o_i, tl.int32) + at, mask=inside), mask=inside)
                tl.store(out_w_ptr + at, tl.load(ptr(rows_addr + o_w, tl.float32) + at, mask=inside), mask=inside)
                if EXPAND:
                    _expand_block(rows, R, rows_addr, out_x_addr, out_s_addr, exp_rows_ptr, slot_ptr, m_ptr, cap, K,
                                  K_P2, XB, SB, BLOCK_R, BW_E, BW_S)  # fmt: skip
                else:
                    copy_rows(out_x_addr, rows_addr, rows, R, XB, XB, XB // 4, BW_X, 16)
                    if SB > 0:
                        copy_rows(out_s_addr, rows_addr + o_s, rows, R, SB, SB, SB // 4, BW_S, 4)
            if EXPAND:
                _pad_experts(layout_ptr, out_x_addr, out_s_addr, exp_rows_ptr, m_ptr, align, L, W_P2, E_P2, P_P2,
                             L_P2, XB, SB, BW_X, BW_S)  # fmt: skip
                X = tl.load(tail + 1).to(tl.int32)
            else:
                X = R
            _pad_worst(R, RW, X, XW, out_x_addr, out_s_addr, out_idx_ptr, out_w_ptr, exp_rows_ptr, slot_ptr, m_ptr,
                       K, K_P2, XB, SB, EXPAND, BLOCK_R, BW_X, BW_S)  # fmt: skip
        if tl.program_id(0) == 0:
            end_exchange(ctrl, _DATA, W, e)


@launcher
def dispatch_recv(geo: NormalGeometry, out, lay, num_rows: int, align: int, xb: int, sb: int) -> None:
    """Wait for every source and copy the ``num_rows`` received rows into ``out``: a dict of ``x`` (rows, or
    expanded rows), ``s`` (scales or None), ``idx`` / ``w`` ``[R, K]``, and for the expanded layout ``rows``
    ``[X]`` int64, ``slot`` ``[R, K]`` int64, ``m`` ``[X]`` int32. ``num_rows=-1``: a worst-case dispatch (the
    kernel reads the rows received from ``lay``; the outputs' rows past them are padding)."""
    z = geo.sizes()
    expand = out.get("rows") is not None
    block_r = 4 if geo.hw_timer() else 16  # on CUDA 8 rows a step reach 255 registers and spill under Triton 3.6
    dummy = out["idx"]
    launch(
        _dispatch_recv, (geo.programs(),), geo.device, out["x"].data_ptr(),
        (out["s"] if out["s"] is not None else out["x"]).data_ptr(), out["idx"], out["w"],
        out["rows"] if expand else dummy, out["slot"] if expand else dummy, out["m"] if expand else dummy, lay,
        geo.status, geo.rows_local, geo.ctrl, geo.notices, geo.clock, geo.timeout_ns, geo.world, num_rows,
        out["idx"].shape[0] if num_rows < 0 else 0, out["x"].shape[0] if num_rows < 0 else 0, geo.cap, align,
        geo.num_experts // geo.world,
        K=geo.num_topk, K_P2=z["K_P2"], XB=xb, SB=sb, EXPAND=expand, W_P2=z["W_P2"], E_P2=z["E_P2"],
        P_P2=z["P_P2"], L_P2=z["L_P2"], BLOCK_R=block_r, BW_X=row_words(xb),
        BW_E=max(4, min(row_words(xb), (2048 if geo.hw_timer() else 4096) // (block_r * z["K_P2"]))),
        BW_S=row_words(sb),
        HW_TIMER=geo.hw_timer(),
    )  # fmt: skip
