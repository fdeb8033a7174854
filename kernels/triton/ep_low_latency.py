"""Low-latency dispatch/combine kernels for ranks whose memory is all addressable (one host, one NVLink domain).

Four kernels per dispatch + combine pair, no host synchronisation and nothing routing-dependent on the host:

- ``ll_dispatch_send``: routes every (token, expert) pair (slot = its rank among this rank's pairs for that
  expert, token order then k), quantizes each token once to e4m3 with float32 per-128 scales (epkit.quant's
  arithmetic) when asked, and writes each pair's row into its slot in the destination's message with 16-byte
  stores, the header (status, slots, format, count per local expert) last; then signals every rank.
- ``ll_dispatch_recv``: waits for every source, checks the headers, and unpacks the slots into the masked
  layout ``[num_local_experts, W * n_max, hidden]`` (expert e's rows by source, then slot).
- ``ll_combine_send``: the expert side writes each received row's output back into its source's message.
- ``ll_combine_recv``: waits, checks that every message comes from the same dispatch (the handle's identity in
  the message head), and reduces ``sum over k ascending of w[t, k] * row`` in float32 at the source.

Messages are double-buffered by the exchange number's parity, so back-to-back dispatches (or combines) never
overwrite a message that a slower rank may still read (every exchange is all-to-all: a rank starts exchange
``e + 1`` only after every rank finished sending ``e``, hence reading ``e - 1``). See ``ep_common.py`` for the
control words, waits and failure records; Triton rather than CUDA C++ for the reasons given there.

Message of one source in a destination's area (``ep_low_latency_layout`` documents it): int32 ``[status,
n_max, use_fp8, count per local expert]`` padded to 16 bytes, the error text, x slots, scale slots; a combine
message: int64 ``[buffer id, epoch]`` in ``COMBINE_HEAD`` bytes, then bf16 rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from epkit.kernels.triton.ep_common import (
    DEFAULT_CTAS,
    alive,
    begin_send,
    copy_rows,
    end_exchange,
    f32_from_bf16_bits,
    f32_to_bf16_bits,
    launch,
    programs,
    ptr,
    quantize_row,
    record_verdict,
    row_words,
    sent_epoch,
    shared_target,
    signal_peers,
    signal_share,
    vmax,
    vsum,
    wait_sources,
    wide,
)
from epkit.kernels.triton.ep_layout import (
    BAD_IDS,
    CODE_HANDLES,
    CODE_HEADERS,
    COMBINE_HEAD,
    KINDS,
    OK,
    OVERFLOW,
    REJECTED,
)
from epkit.kernels.triton.launch import launcher, target

__all__ = [
    "LLGeometry",
    "ll_combine_recv",
    "ll_combine_send",
    "ll_dispatch_recv",
    "ll_dispatch_send",
    "row_bytes",
]

_LLD = tl.constexpr(KINDS.index("ll_dispatch"))
_LLC = tl.constexpr(KINDS.index("ll_combine"))
_OK, _REJECTED, _BAD, _OVER = tl.constexpr(OK), tl.constexpr(REJECTED), tl.constexpr(BAD_IDS), tl.constexpr(OVERFLOW)
_HEADERS, _HANDLES = tl.constexpr(CODE_HEADERS), tl.constexpr(CODE_HANDLES)
_HEAD = tl.constexpr(COMBINE_HEAD)


# dispatch: send


@triton.jit
def _valid_ids(idx_ptr, at, live, E: tl.constexpr):
    """Expert ids at ``at`` where ``live`` (int32), with -2 for every id outside ``[0, E)`` and every dead lane."""
    ids = tl.load(idx_ptr + at, mask=live, other=-1).to(tl.int32)
    return tl.where(live & (ids >= 0) & (ids < E), ids, -2)


@triton.jit
def _route_block(idx_ptr, route_ptr, b, T, n_max, E: tl.constexpr, L: tl.constexpr, K: tl.constexpr,
                 BLOCK_T: tl.constexpr, NP2: tl.constexpr, CH: tl.constexpr):  # fmt: skip
    """Slots of the pairs of token block ``b`` (a pair's slot is its rank among the pairs of its expert, in token
    order then k): stored as route ``[3, T, K]`` int32 (destination rank, local expert, slot; -1 where no slot).
    The pairs before the block are counted for this block's experts only, ``CH`` ids at a time."""
    j = tl.arange(0, NP2)
    start = b * BLOCK_T * K
    pr = start + j
    valid = (j < BLOCK_T * K) & (pr < T * K)
    ids = tl.load(idx_ptr + pr, mask=valid, other=-1).to(tl.int32)
    key = tl.where(valid & (ids >= 0) & (ids < E), ids, E)  # E: no slot (never equal to a counted id)
    before = tl.full([NP2], 0, tl.int32)
    c = tl.arange(0, CH)
    for c0 in range(0, start, CH):
        earlier = _valid_ids(idx_ptr, c0 + c, c0 + c < start, E)
        before += vsum((key[:, None] == earlier[None, :]).to(tl.int32), 1)
    same = (key[:, None] == key[None, :]) & (j[None, :] < j[:, None])
    pos = before + vsum(same.to(tl.int32), 1)
    live = (key < E) & (pos < n_max)
    tl.store(route_ptr + pr, tl.where(live, key // L, -1), mask=valid)
    tl.store(route_ptr + T * K + pr, tl.where(live, key % L, -1), mask=valid)
    tl.store(route_ptr + 2 * T * K + pr, tl.where(live, pos, -1), mask=valid)


@triton.jit
def _send_block(x_ptr, route_ptr, stage_table, my_off, b, T, n_max, L: tl.constexpr, K: tl.constexpr,
                H: tl.constexpr, G_P2: tl.constexpr, FP8: tl.constexpr, HDR: tl.constexpr,
                BLOCK_T: tl.constexpr):  # fmt: skip
    """Rows of token block ``b``: each token read (and quantized) once, written into every slot it got.

    The row stores state their alignment on the pointer tensor itself, here (not in a helper: the hint goes on
    the op that makes the value): runs of 16 bytes, 16-byte aligned. A ``multiple_of`` on the scalar row start
    suffices for Triton 3.9; Triton 3.7 (torch 2.13's) then stores byte by byte (FP8) or 2 bytes at a time."""
    g = tl.arange(0, G_P2)
    col = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    m = (g < (H // 128))[:, None] | (col < H)  # whole 128-groups first: the mask is constant along a group
    sb: tl.constexpr = 4 * ((H + 127) // 128)
    scales_at = wide(n_max) * (L * H)  # the scale slots follow the x slots (int64: L * n_max * H passes 2**31)
    for i in tl.static_range(BLOCK_T):
        t = b * BLOCK_T + i
        if t < T:
            row = tl.load(tl.multiple_of(ptr(x_ptr, tl.int16) + wide(t) * H, 16) + col, mask=m, other=0)
            if FP8:
                q, scale = quantize_row(f32_from_bf16_bits(row))
            for k in tl.static_range(K):
                d = tl.load(route_ptr + t * K + k)
                if d >= 0:
                    at = t * K + k
                    slot = wide(tl.load(route_ptr + T * K + at)) * n_max + tl.load(route_ptr + 2 * T * K + at)
                    base = tl.load(stage_table + d) + my_off + HDR
                    if FP8:
                        dst = tl.multiple_of(ptr(base + slot * H, tl.int8) + col, [16, 16])
                        tl.store(tl.max_contiguous(dst, [1, 16]), q, mask=m)
                        s_at = base + scales_at + slot * sb
                        tl.store(ptr(s_at, tl.float32) + g, scale, mask=g * 128 < H)
                    else:
                        dst = tl.multiple_of(ptr(base + slot * (2 * H), tl.int16) + col, [16, 16])
                        tl.store(tl.max_contiguous(dst, [1, 8]), row, mask=m)


@triton.jit
def _headers(idx_ptr, stage_table, my_off, T, W, n_max, reject, text_ptr, E: tl.constexpr, L: tl.constexpr,
             K: tl.constexpr, FP8: tl.constexpr, L_P2: tl.constexpr, HDR: tl.constexpr, TEXT: tl.constexpr,
             TEXT_P2: tl.constexpr, CH: tl.constexpr):  # fmt: skip
    """Every destination's message header: status, slots, format, count per local expert (or the rejection).
    One program counts every pair, destination by destination (``[L_P2, CH]`` tiles: no ``[L, E]`` tile)."""
    c = tl.arange(0, CH)
    lj = tl.arange(0, L_P2)
    bad = tl.full([], 0, tl.int32)
    over = tl.full([], 0, tl.int32)
    if reject == 0:
        for c0 in range(0, T * K, CH):
            ids = tl.load(idx_ptr + c0 + c, mask=c0 + c < T * K, other=-1)
            bad = bad | vmax(((ids < -1) | (ids >= E)).to(tl.int32), 0)
    tj = tl.arange(0, TEXT_P2)
    text = tl.load(ptr(text_ptr, tl.int8) + tj, mask=tj < TEXT)
    for d in range(W):
        cnt = tl.full([L_P2], 0, tl.int32)
        if reject == 0:
            for c0 in range(0, T * K, CH):
                ids = _valid_ids(idx_ptr, c0 + c, c0 + c < T * K, E)
                cnt += vsum((ids[None, :] == d * L + lj[:, None]).to(tl.int32), 1)
        over = over | vmax((cnt > n_max).to(tl.int32), 0)
        h = ptr(tl.load(stage_table + d) + my_off, tl.int32)
        tl.store(h + 3 + lj, tl.minimum(cnt, n_max), mask=lj < L)
        tl.store(ptr(tl.load(stage_table + d) + my_off + HDR - TEXT, tl.int8) + tj, text, mask=tj < TEXT)
        tl.store(h + 1, n_max)
        tl.store(h + 2, tl.full([], FP8, tl.int32))
    # Status words last, once every destination's counts (and so the overflow anywhere) are known.
    status = tl.where(reject != 0, _REJECTED, tl.where(bad != 0, _BAD, tl.where(over != 0, _OVER, _OK)))
    for d in range(W):
        tl.store(ptr(tl.load(stage_table + d) + my_off, tl.int32), status)


@triton.jit(do_not_specialize=["T", "me", "W", "n_max", "reject"])
def _ll_dispatch_send(x_ptr, idx_ptr, route_ptr, text_ptr, stage_table, ctrl_table, ctrl_addr, T, me, W, n_max,
                      reject, area_bytes, msg_bytes, E: tl.constexpr, L: tl.constexpr, K: tl.constexpr,
                      H: tl.constexpr, FP8: tl.constexpr, HDR: tl.constexpr, TEXT: tl.constexpr,
                      BLOCK_T: tl.constexpr, NP2: tl.constexpr, L_P2: tl.constexpr, G_P2: tl.constexpr,
                      CH: tl.constexpr, CH_H: tl.constexpr):  # fmt: skip
    """Program 0 writes the headers (it counts every pair); programs 1.. route and send the token blocks (each
    counts, for its block's experts, the pairs before the block): a launch has at least 2 programs."""
    ctrl = ptr(ctrl_addr, tl.int64)
    if alive(ctrl, W):
        pid, P = tl.program_id(0), tl.num_programs(0)
        e = begin_send(ctrl, _LLD, W)
        my_off = (e % 2) * area_bytes + wide(me) * msg_bytes
        if pid == 0:
            _headers(idx_ptr, stage_table, my_off, T, W, n_max, reject, text_ptr, E, L, K, FP8, L_P2, HDR, TEXT,
                     triton.next_power_of_2(TEXT), CH_H)  # fmt: skip
        elif reject == 0:
            for b in range(pid - 1, (T + BLOCK_T - 1) // BLOCK_T, P - 1):
                _route_block(idx_ptr, route_ptr, b, T, n_max, E, L, K, BLOCK_T, NP2, CH)
                tl.debug_barrier()  # the route, stored by every thread, read back by each token's thread
                _send_block(x_ptr, route_ptr, stage_table, my_off, b, T, n_max, L, K, H, G_P2, FP8, HDR, BLOCK_T)
        signal_peers(ctrl_table, W, _LLD * W + wide(me), signal_share())


# dispatch: receive


@triton.jit
def _unpack(msgs, recv_x_addr, recv_s_addr, counts_ptr, recv_count_ptr, load_ptr, W, n_max, msg_bytes, L: tl.constexpr,
            XB: tl.constexpr, SB: tl.constexpr, HDR: tl.constexpr, W_P2: tl.constexpr, L_P2: tl.constexpr,
            BLOCK_R: tl.constexpr, BW_X: tl.constexpr, BW_S: tl.constexpr, VEC_S: tl.constexpr):  # fmt: skip
    """Slots -> the masked layout (expert e's rows by source, then slot); counts, totals and the load counter."""
    pid, P = tl.program_id(0), tl.num_programs(0)
    s = tl.arange(0, W_P2)
    lj = tl.arange(0, L_P2)
    hp = ptr(msgs + s.to(tl.int64) * msg_bytes, tl.int32)
    inside = (s < W)[:, None] & (lj < L)[None, :]
    cnt = tl.minimum(tl.maximum(tl.load(hp[:, None] + 3 + lj[None, :], mask=inside, other=0), 0), n_max)
    if pid == 0:
        tot = vsum(cnt, 0)
        tl.store(recv_count_ptr + lj, tot, mask=lj < L)
        tl.store(counts_ptr + s[:, None] * L + lj[None, :], cnt.to(tl.int64), mask=inside)
        tl.store(load_ptr + lj, tl.load(load_ptr + lj, mask=lj < L) + tot.to(tl.int64), mask=lj < L)
    rows = tl.arange(0, BLOCK_R)
    for item in range(pid, W * L, P):
        src, le = item // L, item % L
        col = tl.minimum(tl.maximum(tl.load(hp + 3 + le, mask=s < src, other=0), 0), n_max)
        c = tl.minimum(tl.maximum(tl.load(ptr(msgs + wide(src) * msg_bytes, tl.int32) + 3 + le), 0), n_max)
        first = wide(le) * W * n_max + vsum(col, 0)
        at = msgs + wide(src) * msg_bytes + HDR
        for r0 in range(0, c, BLOCK_R):
            copy_rows(recv_x_addr + first * XB, at + wide(le) * n_max * XB, r0 + rows, c, XB, XB, XB // 4, BW_X, 16)
            if SB > 0:
                s_at = at + wide(n_max) * (L * XB) + wide(le) * n_max * SB
                copy_rows(recv_s_addr + first * SB, s_at, r0 + rows, c, SB, SB, SB // 4, BW_S, VEC_S)


@triton.jit(do_not_specialize=["timeout_ns", "W", "n_max"])
def _ll_dispatch_recv(recv_x_addr, recv_s_addr, counts_ptr, recv_count_ptr, load_ptr, status_addr, stage_addr,
                      ctrl_addr, notice_addr, clock_addr, timeout_ns, W, n_max, area_bytes, msg_bytes,
                      L: tl.constexpr, XB: tl.constexpr, SB: tl.constexpr, FP8: tl.constexpr, HDR: tl.constexpr,
                      W_P2: tl.constexpr, L_P2: tl.constexpr, BLOCK_R: tl.constexpr, BW_X: tl.constexpr,
                      BW_S: tl.constexpr, VEC_S: tl.constexpr, HW_TIMER: tl.constexpr):  # fmt: skip
    ctrl = ptr(ctrl_addr, tl.int64)
    if alive(ctrl, W):
        e = sent_epoch(ctrl, _LLD, W)
        if wait_sources(ctrl, _LLD, W, shared_target(e), e, notice_addr, status_addr, clock_addr, timeout_ns, HW_TIMER):
            msgs = stage_addr + (e % 2) * area_bytes
            s = tl.arange(0, W_P2)
            hp = ptr(msgs + s.to(tl.int64) * msg_bytes, tl.int32)
            st = tl.load(hp, mask=s < W, other=_OK)
            nm = tl.load(hp + 1, mask=s < W, other=n_max)
            f8 = tl.load(hp + 2, mask=s < W, other=FP8)
            nbad = vsum(((st != _OK) | (nm != n_max) | (f8 != FP8)).to(tl.int32), 0)
            if nbad != 0:  # every source's header words, for the same words on every rank
                record_verdict(ctrl, W, status_addr, _HEADERS, _LLD, nbad, 0, 0, e, st.to(tl.int64), nm.to(tl.int64),
                               f8.to(tl.int64), f8, 3, W_P2)  # fmt: skip
            else:
                _unpack(msgs, recv_x_addr, recv_s_addr, counts_ptr, recv_count_ptr, load_ptr, W, n_max, msg_bytes, L,
                        XB, SB, HDR, W_P2, L_P2, BLOCK_R, BW_X, BW_S, VEC_S)  # fmt: skip
        if tl.program_id(0) == 0:
            end_exchange(ctrl, _LLD, W, e)


# combine


@triton.jit(do_not_specialize=["me", "W", "n_max", "ident0", "ident1"])
def _ll_combine_send(y_addr, counts_ptr, stage_table, ctrl_table, ctrl_addr, me, W, n_max, area_bytes, msg_bytes,
                     ident0, ident1, L: tl.constexpr, ROW: tl.constexpr, W_P2: tl.constexpr, BLOCK_R: tl.constexpr,
                     BW: tl.constexpr):  # fmt: skip
    ctrl = ptr(ctrl_addr, tl.int64)
    if alive(ctrl, W):
        pid, P = tl.program_id(0), tl.num_programs(0)
        e = begin_send(ctrl, _LLC, W)
        my_off = (e % 2) * area_bytes + wide(me) * msg_bytes
        if pid == 0:
            for d in range(W):
                head = ptr(tl.load(stage_table + d) + my_off, tl.int64)
                tl.store(head, wide(ident0))
                tl.store(head + 1, wide(ident1))
        s = tl.arange(0, W_P2)
        rows = tl.arange(0, BLOCK_R)
        for item in range(pid, W * L, P):
            src, le = item // L, item % L
            before = vsum(tl.load(counts_ptr + s * L + le, mask=s < src, other=0), 0)
            c = tl.load(counts_ptr + src * L + le).to(tl.int32)
            at = tl.load(stage_table + src) + my_off + _HEAD + wide(le) * n_max * ROW
            y_at = y_addr + (wide(le) * W * n_max + before) * ROW
            for r0 in range(0, c, BLOCK_R):
                copy_rows(at, y_at, r0 + rows, c, ROW, ROW, ROW // 4, BW, 16)
        signal_peers(ctrl_table, W, _LLC * W + wide(me), signal_share())


@triton.jit
def _reduce_tokens(out_ptr, w_ptr, route_ptr, msgs, t0, T, n_max, msg_bytes, K: tl.constexpr, K_P2: tl.constexpr,
                   H: tl.constexpr, BT: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """``out[t] = bf16(sum over k ascending of w[t, k] * row(t, k))`` in float32 (each product rounded, then
    added) for the tokens ``t0 + [0, BT)``."""
    t = wide(t0 + tl.arange(0, BT))
    kk = tl.arange(0, K_P2)
    inside = (t < T)[:, None] & (kk < K)[None, :]
    at = t[:, None] * K + kk[None, :]
    dst = tl.load(route_ptr + at, mask=inside, other=-1)
    loc = tl.load(route_ptr + T * K + at, mask=inside, other=0)
    pos = tl.load(route_ptr + 2 * T * K + at, mask=inside, other=0)
    wts = tl.load(ptr(w_ptr, tl.float32) + at, mask=inside, other=0.0)
    row_at = msgs + wide(dst) * msg_bytes + _HEAD + wide(loc * n_max + pos) * (2 * H)
    out_row = tl.multiple_of(ptr(out_ptr, tl.int16) + t * H, 16)
    for h0 in tl.static_range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = (t < T)[:, None] & (cols < H)[None, :]
        acc = tl.full([BT, BLOCK_H], 0.0, tl.float32)
        for k in tl.static_range(K):
            pick = kk[None, :] == k
            live = m & (vsum(tl.where(pick, dst, 0), 1) >= 0)[:, None]
            src = tl.multiple_of(ptr(vsum(tl.where(pick, row_at, 0), 1), tl.int16), 16)
            y = f32_from_bf16_bits(tl.load(src[:, None] + cols[None, :], mask=live, other=0))
            acc += tl.where(live, vsum(tl.where(pick, wts, 0.0), 1)[:, None] * y, 0.0)
        tl.store(out_row[:, None] + cols[None, :], f32_to_bf16_bits(acc), mask=m)


@triton.jit(do_not_specialize=["T", "timeout_ns", "W", "n_max", "ident0", "ident1"])
def _ll_combine_recv(out_ptr, w_ptr, route_ptr, status_addr, stage_addr, ctrl_addr, notice_addr, clock_addr, T,
                     timeout_ns, W, n_max, area_bytes, msg_bytes, ident0, ident1, K: tl.constexpr,
                     K_P2: tl.constexpr, H: tl.constexpr, W_P2: tl.constexpr, BT: tl.constexpr,
                     BLOCK_H: tl.constexpr, HW_TIMER: tl.constexpr):  # fmt: skip
    ctrl = ptr(ctrl_addr, tl.int64)
    if alive(ctrl, W):
        e = sent_epoch(ctrl, _LLC, W)
        if wait_sources(ctrl, _LLC, W, shared_target(e), e, notice_addr, status_addr, clock_addr, timeout_ns, HW_TIMER):
            msgs = stage_addr + (e % 2) * area_bytes
            s = tl.arange(0, W_P2)
            id0, id1 = wide(ident0), wide(ident1)
            i0 = tl.load(ptr(msgs + s.to(tl.int64) * msg_bytes, tl.int64), mask=s < W, other=id0)
            i1 = tl.load(ptr(msgs + s.to(tl.int64) * msg_bytes, tl.int64) + 1, mask=s < W, other=id1)
            nbad = vsum(((i0 != id0) | (i1 != id1)).to(tl.int32), 0)
            if nbad != 0:
                record_verdict(ctrl, W, status_addr, _HANDLES, _LLC, nbad, 0, 0, e, i0, i1, i1, i1, 2, W_P2)
            else:
                for t0 in range(tl.program_id(0) * BT, T, tl.num_programs(0) * BT):
                    _reduce_tokens(out_ptr, w_ptr, route_ptr, msgs, t0, T, n_max, msg_bytes, K, K_P2, H, BT, BLOCK_H)
        if tl.program_id(0) == 0:
            end_exchange(ctrl, _LLC, W, e)


# launchers


@dataclass(frozen=True)
class LLGeometry:
    """Everything fixed per buffer that the low-latency kernels take (addresses are this process's view).

    ``ctrl`` / ``notices``: this rank's control words and its NOTICE signal words; ``*_table``: every rank's
    control words and low-latency areas (``[W]`` int64 tensors on the device), ``*_local`` this rank's own area;
    ``*_area``: bytes per parity of an area; ``*_msg``: bytes per source message; ``status`` / ``clock``: the
    status block and the clock word (host memory); on a GPU the waits read ``%globaltimer`` instead of the clock.
    """

    rank: int
    world: int
    num_experts: int
    num_topk: int
    hidden: int
    header: int
    text: int
    ctrl: int
    notices: int
    ctrl_table: torch.Tensor
    dispatch_table: torch.Tensor
    combine_table: torch.Tensor
    dispatch_local: int
    combine_local: int
    dispatch_area: int
    dispatch_msg: int
    combine_area: int
    combine_msg: int
    status: int
    clock: int
    timeout_ns: int
    device: torch.device
    #: Programs of each multi-program launch on CUDA (the SMs the exchange takes; each rank may use its own: a
    #: receiver's target does not depend on it). :func:`~epkit.kernels.triton.ep_common.programs`.
    ctas: int = DEFAULT_CTAS

    @property
    def local(self) -> int:
        return self.num_experts // self.world

    def sizes(self) -> dict:
        """Block sizes and padded extents shared by the launches. On CUDA at most 2 tokens a step and count tiles
        of 2048 ids (larger ones spill under some Triton versions' register allocation); the interpreter, where a
        step costs the same whatever its size, takes 16 pairs and 4096."""
        k, h, cuda = self.num_topk, self.hidden, self.hw_timer()
        block_t = max(1, 16 // triton.next_power_of_2(k))
        block_t = min(2, block_t) if cuda else block_t
        np2 = triton.next_power_of_2(block_t * k)
        l_p2 = triton.next_power_of_2(self.local)
        ids = 2048 if cuda else 4096
        return {
            "BLOCK_T": block_t,
            "NP2": np2,
            "CH": max(16, ids // np2),  # ids per step of a block's count of the pairs before it: [NP2, CH]
            "CH_H": max(16, ids // l_p2),  # ids per step of the headers' count: [L_P2, CH_H]
            "L_P2": l_p2,
            "W_P2": triton.next_power_of_2(self.world),
            "G_P2": triton.next_power_of_2(-(-h // 128)),
            "K_P2": triton.next_power_of_2(k),
        }

    def hw_timer(self) -> bool:
        """Waits read ``%globaltimer`` (a GPU launch), else the clock word (the interpreter)."""
        return target(self.device) == "cuda"


def _grid(geo: LLGeometry) -> tuple[int]:
    return (programs(geo.device, geo.ctas),)


def row_bytes(hidden: int, fp8: bool) -> tuple[int, int]:
    """(x bytes, scale bytes) of one dispatched row."""
    return (hidden, 4 * -(-hidden // 128)) if fp8 else (2 * hidden, 0)


@launcher
def ll_dispatch_send(geo: LLGeometry, x, topk_idx, route, text, n_max: int, fp8: bool, reject: bool) -> None:
    """Route, quantize and send (one launch): ``x [T, hidden]`` bf16, ``topk_idx [T, K]`` int32/int64 (both on the
    device; with ``reject`` neither is read), ``route [3, T, K]`` int32 out, ``text`` uint8 (the error text)."""
    z = geo.sizes()
    launch(
        _ll_dispatch_send, _grid(geo), geo.device,
        x, topk_idx, route, text, geo.dispatch_table, geo.ctrl_table, geo.ctrl, x.shape[0], geo.rank, geo.world,
        n_max, int(reject), geo.dispatch_area, geo.dispatch_msg,
        E=geo.num_experts, L=geo.local, K=geo.num_topk, H=geo.hidden, FP8=int(fp8), HDR=geo.header, TEXT=geo.text,
        BLOCK_T=z["BLOCK_T"], NP2=z["NP2"], L_P2=z["L_P2"], G_P2=z["G_P2"], CH=z["CH"], CH_H=z["CH_H"],
    )  # fmt: skip


@launcher
def ll_dispatch_recv(geo: LLGeometry, recv_x, recv_s, counts, recv_count, load, n_max: int, fp8: bool) -> None:
    """Wait for every source and unpack into ``recv_x [L, W*n_max, hidden]`` (e4m3 or bf16) and ``recv_s`` (float32
    scales, or None); ``counts [W, L]`` int64 and ``recv_count [L]`` int32 out, ``load [L]`` int64 added to."""
    z = geo.sizes()
    xb, sb = row_bytes(geo.hidden, fp8)
    launch(
        _ll_dispatch_recv, _grid(geo), geo.device,
        recv_x.data_ptr(), (recv_s if recv_s is not None else recv_x).data_ptr(), counts, recv_count, load,
        geo.status, geo.dispatch_local, geo.ctrl, geo.notices, geo.clock, geo.timeout_ns, geo.world, n_max,
        geo.dispatch_area, geo.dispatch_msg,
        L=geo.local, XB=xb, SB=sb, FP8=int(fp8), HDR=geo.header, W_P2=z["W_P2"], L_P2=z["L_P2"],
        BLOCK_R=8 if geo.hw_timer() else 4, BW_X=row_words(xb), BW_S=row_words(sb), VEC_S=16 if sb % 16 == 0 else 4,
        HW_TIMER=geo.hw_timer(),
    )  # fmt: skip


@launcher
def ll_combine_send(geo: LLGeometry, y, counts, n_max: int, ident: tuple[int, int]) -> None:
    """The expert side: ``y [L, W*n_max, hidden]`` bf16 rows back into their sources' messages, headed by the
    handle's ``ident`` (buffer id, dispatch epoch); ``counts [W, L]`` int64 from the dispatch."""
    z = geo.sizes()
    row = 2 * geo.hidden
    launch(
        _ll_combine_send, _grid(geo), geo.device,
        y.data_ptr(), counts, geo.combine_table, geo.ctrl_table, geo.ctrl, geo.rank, geo.world, n_max,
        geo.combine_area, geo.combine_msg, ident[0], ident[1],
        L=geo.local, ROW=row, W_P2=z["W_P2"], BLOCK_R=8 if geo.hw_timer() else 4, BW=row_words(row),
    )  # fmt: skip


@launcher
def ll_combine_recv(geo: LLGeometry, out, weights, route, n_max: int, ident: tuple[int, int]) -> None:
    """The source side: wait, check every message's head against ``ident``, and reduce into ``out [T, hidden]``
    bf16 with ``weights [T, K]`` float32 and the dispatch's ``route [3, T, K]``."""
    z = geo.sizes()
    launch(
        _ll_combine_recv, _grid(geo), geo.device,
        out, weights, route, geo.status, geo.combine_local, geo.ctrl, geo.notices, geo.clock, out.shape[0],
        geo.timeout_ns, geo.world, n_max, geo.combine_area, geo.combine_msg, ident[0], ident[1],
        K=geo.num_topk, K_P2=z["K_P2"], H=geo.hidden, W_P2=z["W_P2"], BT=2 if geo.hw_timer() else 8,
        BLOCK_H=min(1024, triton.next_power_of_2(geo.hidden)),
        HW_TIMER=geo.hw_timer(),
    )  # fmt: skip
