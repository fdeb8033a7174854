"""Normal-mode combine kernels (and the agreement before a combine or cached dispatch) for ranks whose memory is
all addressable. Triton for the reasons ``ep_common.py`` gives.

- ``agree`` (one program): every rank's ``[status, buffer id, dispatch epoch, judged]`` and error text go to every
  rank; the host reads them all (one read) and raises the same error on every rank unless every call is valid and
  every handle comes from the same dispatch of this buffer: no row moves before that. After a worst-case
  dispatch (``judged``) the kernel judges instead, with no host read: a failure recorded with every rank's words
  (``CODE_AGREE``), after which no kernel of the rank moves a row; the host raises it at its next call.
- ``combine_send`` (expert side): each received row's output goes back into its source's memory (region of
  this rank, row = its index among the rows that source sent here); in the expanded layout the row is first
  reduced over its local slots, ``sum over k ascending of w[j, k] * y[slot(j, k)]`` in float32, rounded to
  ``y``'s dtype (weights applied on the expert rank, as the CPU path does).
- ``combine_reduce`` (source side): ``out[t] = sum over destination ranks ascending of row(t, r)`` in float32,
  then up to two biases in order, rounded once: the CPU path's fixed order, bit for bit. With a per-token
  ``order`` (``[T, W]`` ranks, -1 skipped) the biases come first, then the rows in that order (DeepEP V2's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from epkit.kernels.triton import ep_common
from epkit.kernels.triton.ep_common import (
    alive,
    begin_send,
    copy_rows_at,
    end_exchange,
    launch,
    load_f32,
    next_epoch,
    programs,
    ptr,
    publish_ready,
    record_verdict,
    row_words,
    sent_epoch,
    shared_target,
    signal_peers,
    signal_share,
    store_f32,
    vsum,
    wait_sources,
    wide,
)
from epkit.kernels.triton.ep_layout import CODE_AGREE, KINDS, OK
from epkit.kernels.triton.launch import launcher, target

__all__ = ["DTYPE_CODES", "CombineGeometry", "agree", "combine_reduce", "combine_send"]

_AGREE = tl.constexpr(KINDS.index("agree"))
_COMBINE = tl.constexpr(KINDS.index("combine"))
_OK, _JUDGED = tl.constexpr(OK), tl.constexpr(CODE_AGREE)
#: Row dtypes the combine kernels read and write, by the code they take.
DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}


@triton.jit
def _judge_agreement(words, status_addr, ctrl, W, e, code, ident0, ident1, what, W_P2: tl.constexpr):
    """The agreement's verdict on the device from every rank's words (``words``: ``[W_P2]`` pointers to them): a
    failure, recorded with every rank's ``[status, buffer id, epoch]``, unless every call is valid and every
    handle is this rank's (``what``: 0 for a combine, 1 for a cached dispatch, for the host's error text)."""
    s = tl.arange(0, W_P2)
    live = s < W
    st = tl.load(words, mask=live, other=_OK)
    i0 = tl.load(words + 1, mask=live, other=0)
    i1 = tl.load(words + 2, mask=live, other=0)
    bad = live & ((st != _OK) | (i0 != ident0) | (i1 != ident1) | (code != _OK))
    nbad = vsum(bad.to(tl.int32), 0)
    if nbad != 0:
        record_verdict(ctrl, W, status_addr, _JUDGED, _AGREE, nbad, 0, what, e, st, i0, i1, i1, 3, W_P2)


@triton.jit(do_not_specialize=["timeout_ns", "me", "W", "code", "ident0", "ident1", "judged", "ready"])
def _agree(text_ptr, agree_table, ctrl_table, ctrl_addr, notice_addr, status_addr, clock_addr, host_addr,
           ready_addr, ready, timeout_ns, me, W, code, ident0, ident1, judged, area_bytes, msg_bytes,
           W_P2: tl.constexpr, TEXT: tl.constexpr, TEXT_P2: tl.constexpr, HW_TIMER: tl.constexpr):  # fmt: skip
    ctrl = ptr(ctrl_addr, tl.int64)
    if alive(ctrl, W):
        e = next_epoch(ctrl, _AGREE, W)
        off = (e % 2) * area_bytes
        tj = tl.arange(0, TEXT_P2)
        text = tl.load(ptr(text_ptr, tl.int8) + tj, mask=tj < TEXT)
        for d in range(W):
            slot = tl.load(agree_table + d) + off + wide(me) * msg_bytes
            w = ptr(slot, tl.int64)
            tl.store(ptr(slot + 32, tl.int8) + tj, text, mask=tj < TEXT)
            tl.store(w + 1, wide(ident0))
            tl.store(w + 2, wide(ident1))
            tl.store(w + 3, wide(judged))
            tl.store(w, wide(code))
        signal_peers(ctrl_table, W, _AGREE * W + wide(me), 1)
        if wait_sources(ctrl, _AGREE, W, e, e, notice_addr, status_addr, clock_addr, timeout_ns, HW_TIMER):
            s = tl.arange(0, W_P2)
            at = ptr(tl.load(agree_table + me) + off + wide(s) * msg_bytes, tl.int64)
            h = ptr(host_addr, tl.int64)
            for j in tl.static_range(4):
                tl.store(h + j * W + s, tl.load(at + j, mask=s < W), mask=s < W)
            tl.store(h + 4 * W, e)  # the exchange's number: its parity picks the area (the error texts)
            if judged != 0:
                _judge_agreement(at, status_addr, ctrl, W, e, code, ident0, ident1, judged - 1, W_P2)
        end_exchange(ctrl, _AGREE, W, e)
    publish_ready(ready_addr, ready)


@triton.jit
def _source_of(j, rs, rn, s):
    """The source of received row ``j`` (``rs`` / ``rn``: rows per source start / count) and ``j``'s index
    among that source's rows (blocks of rows)."""
    hit = (rs[None, :] <= j[:, None]) & (j[:, None] < rs[None, :] + rn[None, :])
    src = vsum(tl.where(hit, s[None, :], 0), 1)
    return src, j - vsum(tl.where(hit, rs[None, :], 0), 1)


@triton.jit(do_not_specialize=["me", "W", "R", "n_max", "tail"])
def _combine_send(y_addr, slot_ptr, w_ptr, layout_ptr, rows_table, ctrl_table, ctrl_addr, me, W, R, n_max, tail,
                  K: tl.constexpr, K_P2: tl.constexpr, H: tl.constexpr, DT: tl.constexpr, EXPAND: tl.constexpr,
                  W_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BW: tl.constexpr):  # fmt: skip
    ctrl = ptr(ctrl_addr, tl.int64)
    if alive(ctrl, W):
        begin_send(ctrl, _COMBINE, W)
        es: tl.constexpr = 2 if DT != 1 else 4
        row: tl.constexpr = H * es
        s = tl.arange(0, W_P2)
        rs = tl.load(layout_ptr + tail + s, mask=s < W, other=0)
        rn = tl.load(layout_ptr + tail + W_P2 + s, mask=s < W, other=0)
        bases = tl.load(rows_table + s, mask=s < W, other=0)
        R = tl.where(R < 0, vsum(rn, 0).to(tl.int32), R)  # -1: a worst-case dispatch's (the host never read R)
        for r0 in range(tl.program_id(0) * BLOCK_R, R, tl.num_programs(0) * BLOCK_R):
            j = wide(r0 + tl.arange(0, BLOCK_R))
            src, i = _source_of(j, rs, rn, s)
            dst = vsum(tl.where(src[:, None] == s[None, :], bases[None, :], 0), 1) + (wide(me) * n_max + i) * row
            if EXPAND:
                kk = tl.arange(0, K_P2)
                inside = (j < R)[:, None] & (kk < K)[None, :]
                slots = tl.load(slot_ptr + j[:, None] * K + kk[None, :], mask=inside, other=-1)
                wts = tl.load(w_ptr + j[:, None] * K + kk[None, :], mask=inside, other=0.0)
                for h0 in range(0, H, BLOCK_H):  # not unrolled: one chunk's addresses live at a time
                    cols = h0 + tl.arange(0, BLOCK_H)
                    acc = tl.full([BLOCK_R, BLOCK_H], 0.0, tl.float32)
                    for k in tl.static_range(K):
                        sl = vsum(tl.where(kk[None, :] == k, slots, 0), 1)
                        live = (sl[:, None] + cols[None, :] * 0 >= 0) & (cols < H)[None, :]
                        y = load_f32(y_addr + wide(sl) * row, cols, live, DT)
                        acc += tl.where(live, vsum(tl.where(kk[None, :] == k, wts, 0.0), 1)[:, None] * y, 0.0)
                    m = (j < R)[:, None] & (cols < H)[None, :]
                    store_f32(dst, cols, acc, m, DT)
            else:
                copy_rows_at(dst, y_addr + j * row, j < R, row // 4, BW, 16)
        signal_peers(ctrl_table, W, _COMBINE * W + wide(me), signal_share())


@triton.jit(do_not_specialize=["T", "timeout_ns", "W", "n_max"])
def _combine_reduce(out_ptr, send_pos_ptr, order_ptr, b1_ptr, b2_ptr, status_addr, rows_addr, ctrl_addr,
                    notice_addr, clock_addr, T, timeout_ns, W, n_max, H: tl.constexpr, DT: tl.constexpr,
                    NB: tl.constexpr, BDT: tl.constexpr, BDT2: tl.constexpr, ORDER: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HW_TIMER: tl.constexpr):  # fmt: skip
    ctrl = ptr(ctrl_addr, tl.int64)
    if alive(ctrl, W):
        e = sent_epoch(ctrl, _COMBINE, W)
        if wait_sources(
            ctrl, _COMBINE, W, shared_target(e), e, notice_addr, status_addr, clock_addr, timeout_ns, HW_TIMER
        ):
            es: tl.constexpr = 2 if DT != 1 else 4
            bs: tl.constexpr = 2 if BDT != 1 else 4
            bs2: tl.constexpr = 2 if BDT2 != 1 else 4
            for t0 in range(tl.program_id(0) * BLOCK_T, T, tl.num_programs(0) * BLOCK_T):
                t = wide(t0 + tl.arange(0, BLOCK_T))
                for h0 in tl.static_range(0, H, BLOCK_H):
                    cols = h0 + tl.arange(0, BLOCK_H)
                    m = (t < T)[:, None] & (cols < H)[None, :]
                    acc = tl.full([BLOCK_T, BLOCK_H], 0.0, tl.float32)
                    if ORDER:  # the biases first, then each token's ranks in its order
                        if NB > 0:
                            acc += load_f32(ptr(b1_ptr, tl.int8).to(tl.int64) + t * (H * bs), cols, m, BDT)
                        if NB > 1:
                            acc += load_f32(ptr(b2_ptr, tl.int8).to(tl.int64) + t * (H * bs2), cols, m, BDT2)
                        for i in range(W):
                            r = tl.load(order_ptr + t * W + i, mask=t < T, other=-1)
                            pos = tl.load(send_pos_ptr + t * W + r, mask=(t < T) & (r >= 0) & (r < W), other=-1)
                            live = m & (pos[:, None] >= 0)
                            at = rows_addr + (wide(r) * n_max + pos) * (H * es)
                            acc += tl.where(live, load_f32(at, cols, live, DT), 0.0)
                    else:
                        for r in range(W):  # destination ranks ascending: the CPU path's order
                            pos = tl.load(send_pos_ptr + t * W + r, mask=t < T, other=-1)
                            live = m & (pos[:, None] >= 0)
                            at = rows_addr + (wide(r) * n_max + pos) * (H * es)
                            acc += tl.where(live, load_f32(at, cols, live, DT), 0.0)
                        if NB > 0:
                            acc += load_f32(ptr(b1_ptr, tl.int8).to(tl.int64) + t * (H * bs), cols, m, BDT)
                        if NB > 1:
                            acc += load_f32(ptr(b2_ptr, tl.int8).to(tl.int64) + t * (H * bs2), cols, m, BDT2)
                    store_f32(ptr(out_ptr, tl.int8).to(tl.int64) + t * (H * es), cols, acc, m, DT)
        if tl.program_id(0) == 0:
            end_exchange(ctrl, _COMBINE, W, e)


# launchers


@dataclass(frozen=True)
class CombineGeometry:
    """The combine kernels' fixed arguments: ``n_max`` rows per source region (``num_max_tokens_per_rank``);
    ``agree_*`` the agreement areas; the rest as ``NormalGeometry``."""

    rank: int
    world: int
    num_topk: int
    hidden: int
    n_max: int
    text: int
    ctrl: int
    notices: int
    ctrl_table: torch.Tensor
    agree_table: torch.Tensor
    rows_table: torch.Tensor
    rows_local: int
    agree_area: int
    agree_msg: int
    status: int
    clock: int
    timeout_ns: int
    device: torch.device
    #: Programs of each multi-program launch on CUDA (the SMs the exchange takes; per rank and per call, e.g. a
    #: combine's ``num_sms``). :func:`~epkit.kernels.triton.ep_common.programs`.
    ctas: int = ep_common.DEFAULT_CTAS
    #: ``ctas`` was chosen for the call: the interpreter runs that many programs too (else 2).
    exact_ctas: bool = False

    def programs(self) -> int:
        """Programs of each multi-program launch."""
        return programs(self.device, self.ctas, self.exact_ctas)


@launcher
def agree(geo: CombineGeometry, text, host, code: int, ident: tuple[int, int], ready: int, judged: int = 0) -> None:
    """The agreement exchange (one program): ``host`` gets ``[status[W], buffer id[W], epoch[W], judged[W], exchange,
    ready]`` (``exchange``: the exchange's number on the device; ``ready``, the caller's call number, written after
    every other word). ``judged``: 0, the host reads and
    judges; 1 (a combine) or 2 (a cached dispatch), the kernel judges (after a worst-case dispatch)."""
    launch(
        _agree, (1,), geo.device, text, geo.agree_table, geo.ctrl_table, geo.ctrl, geo.notices, geo.status, geo.clock,
        host.data_ptr(), host[-1:].data_ptr(), ready, geo.timeout_ns, geo.rank, geo.world, code, ident[0], ident[1],
        judged, geo.agree_area, geo.agree_msg,
        W_P2=triton.next_power_of_2(geo.world), TEXT=geo.text, TEXT_P2=triton.next_power_of_2(geo.text),
        HW_TIMER=target(geo.device) == "cuda",
    )  # fmt: skip


def _rows_per_step(device, expand: bool) -> int:
    """Rows a program moves per step: on CUDA 8 (8 rows of 16-byte moves in flight per thread), 4 for the
    expanded layout, whose weights and slots per row would spill at 8; 16 under the interpreter."""
    return (4 if expand else 8) if target(device) == "cuda" else 16


@launcher
def combine_send(geo: CombineGeometry, y, lay, tail: int, num_rows: int, slot=None, weights=None) -> None:
    """Expert side (one launch): ``y [R or X, hidden]`` back to the sources; ``slot`` / ``weights`` ``[R, K]`` for
    the expanded layout; ``lay`` the dispatch's layout words, whose ``recv_start`` / ``recv_n`` start at ``tail``;
    ``num_rows`` the rows received (-1: read them from ``lay``, for a worst-case dispatch's padded ``y``)."""
    expand = slot is not None
    row = geo.hidden * y.element_size()
    launch(
        _combine_send, (geo.programs(),), geo.device, y.data_ptr(), slot if expand else lay,
        weights if expand else lay, lay, geo.rows_table, geo.ctrl_table, geo.ctrl, geo.rank, geo.world, num_rows,
        geo.n_max, tail,
        K=geo.num_topk, K_P2=triton.next_power_of_2(geo.num_topk), H=geo.hidden, DT=DTYPE_CODES[y.dtype],
        EXPAND=expand, W_P2=triton.next_power_of_2(geo.world), BLOCK_R=_rows_per_step(geo.device, expand),
        BLOCK_H=min(256, triton.next_power_of_2(geo.hidden)), BW=row_words(row),
    )  # fmt: skip


@launcher
def combine_reduce(geo: CombineGeometry, out, send_pos, biases, order=None) -> None:
    """Source side (one launch): wait, then ``out [T, hidden]`` = the fixed-order sum (+ up to two biases, in
    order); ``send_pos [T, W]`` int32 from the dispatch; ``order [T, W]`` int32, optional: per token the ranks
    whose rows are added, in that order (-1: none), after the biases."""
    bt = [b.dtype for b in biases] + [out.dtype] * (2 - len(biases))
    launch(
        _combine_reduce, (geo.programs(),), geo.device, out, send_pos, send_pos if order is None else order,
        biases[0] if biases else out, biases[1] if len(biases) > 1 else out, geo.status, geo.rows_local, geo.ctrl,
        geo.notices, geo.clock, out.shape[0], geo.timeout_ns, geo.world, geo.n_max,
        H=geo.hidden, DT=DTYPE_CODES[out.dtype], NB=len(biases), BDT=DTYPE_CODES[bt[0]], BDT2=DTYPE_CODES[bt[1]],
        ORDER=order is not None,
        BLOCK_T=4 if target(geo.device) == "cuda" else 8, BLOCK_H=min(1024, triton.next_power_of_2(geo.hidden)),
        HW_TIMER=target(geo.device) == "cuda",
    )  # fmt: skip
