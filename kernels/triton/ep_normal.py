"""Normal-mode dispatch kernels for ranks whose memory is all addressable (one host, one NVLink domain).

Four launches per dispatch, one host read (the received counts, to size the outputs):

- ``layout``: each of ``P`` programs counts its chunk of tokens (contiguous, ``ceil(T / P)`` each): tokens per
  destination rank (a token counts once per rank) and (token, expert) pairs per expert; bad expert ids.
- ``notify`` (one program): prefix sums over the chunks, then every rank's totals go to every rank (release
  signals, timed acquire waits), from which each rank computes where its rows land in every destination
  (after the rows of the lower ranks) and what it receives; the summary goes to host memory. A worst-case
  dispatch (``worst``: outputs sized for ``num_worst_tokens``, no host read) judges the exchange here instead:
  every rank sees every message, so every rank finds the same rejection, mismatch or overflow, and records it
  as a failure (``CODE_NOTIFY``; the host raises it at the rank's next call) before any row moves.
- ``dispatch_send``: each program walks its chunk in token order with running counters, writing each token's
  row once per destination rank straight into its final row of the receive layout (source rank, then source
  token order), with its local expert ids, weights and, per slot, its row in the expanded layout (grouped by
  local expert, each group padded to ``expert_alignment``); 16-byte stores; then signals.
- ``dispatch_recv``: waits, and copies the received rows into the outputs: the normal layout, or the expanded
  one with ``m_indices`` (padding rows zero, -1).

The agreement every rank needs before rows move is the notify exchange itself: a rank whose call is invalid
(checked on the host, or bad expert ids found here) says so in its notify message, every rank's host reads
every status, and no rank launches ``dispatch_send``. See ``ep_common.py`` for waits, signals and failures.
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
    copy_rows_at,
    end_exchange,
    launch,
    next_epoch,
    programs,
    ptr,
    publish_ready,
    record_verdict,
    row_words,
    signal_peers,
    signal_share,
    vcumsum,
    vmax,
    vsum,
    wait_sources,
    wide,
)
from epkit.kernels.triton.ep_layout import BAD_IDS, CODE_NOTIFY, KINDS, OK
from epkit.kernels.triton.launch import launcher, target

__all__ = [
    "NormalGeometry",
    "dispatch_send",
    "layout",
    "layout_tail",
    "layout_words",
    "notify",
    "row_fields",
    "summary_words",
]

_NOTIFY = tl.constexpr(KINDS.index("notify"))
_DATA = tl.constexpr(KINDS.index("dispatch"))
_OK, _BAD, _JUDGED = tl.constexpr(OK), tl.constexpr(BAD_IDS), tl.constexpr(CODE_NOTIFY)


def summary_words(world: int, local: int) -> int:
    """Words of the notify summary in host memory: ``[R, X, code[W], fmt[W], recv_n[W], count[L], exchange, ready]``
    (``exchange``: the notify exchange's number on the device, whose parity picks the area the messages are in: a
    graph's replays make exchanges the host never counted; ``ready``: the call number, written last)."""
    return 2 + 3 * world + local + 2


# the layout words (int64, one tensor per dispatch; ``layout_words`` sizes it): send_start [W_P2],
# exp_base [E_P2], chunk token bases [P_P2, W_P2], chunk pair bases [P_P2, E_P2], then recv_start [W_P2],
# recv_n [W_P2], exp_start [L_P2], count [L_P2], rows received, expanded rows (for the kernels that run without
# the host knowing them: a worst-case dispatch's receive and its combine)


def layout_words(w_p2: int, e_p2: int, l_p2: int, p_p2: int) -> int:
    """Words of a dispatch's layout tensor (see the comment above)."""
    return w_p2 + e_p2 + p_p2 * (w_p2 + e_p2) + 2 * w_p2 + 2 * l_p2 + 2


@triton.jit
def _tok_base(W_P2: tl.constexpr, E_P2: tl.constexpr):
    return W_P2 + E_P2


@triton.jit
def _pair_base(W_P2: tl.constexpr, E_P2: tl.constexpr, P_P2: tl.constexpr):
    return W_P2 + E_P2 + P_P2 * W_P2


@triton.jit
def layout_tail(W_P2: tl.constexpr, E_P2: tl.constexpr, P_P2: tl.constexpr):
    return W_P2 + E_P2 + P_P2 * (W_P2 + E_P2)


# layout


@triton.jit
def _token_block(idx_ptr, t0, t_end, E: tl.constexpr, L: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                 K_P2: tl.constexpr, W_P2: tl.constexpr):  # fmt: skip
    """Expert ids ``[BT, K_P2]`` of tokens ``t0 + i < t_end`` (-1 elsewhere), valid mask, the token mask and
    ``in_rank [BT, W_P2]`` (the token has an expert on that rank)."""
    t = t0 + tl.arange(0, BT)
    kk = tl.arange(0, K_P2)
    inside = (t < t_end)[:, None] & (kk < K)[None, :]
    ids = tl.load(idx_ptr + wide(t)[:, None] * K + kk[None, :], mask=inside, other=-1).to(tl.int32)
    valid = inside & (ids >= 0) & (ids < E)
    bad = inside & ((ids < -1) | (ids >= E))
    rank_of = tl.where(valid, ids // L, W_P2)
    dst = tl.arange(0, W_P2)
    in_rank = vmax((rank_of[:, :, None] == dst[None, None, :]).to(tl.int32), 1)
    return ids, valid, bad, in_rank


@triton.jit(do_not_specialize=["T"])
def _layout(idx_ptr, counts_ptr, T, E: tl.constexpr, L: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
            K_P2: tl.constexpr, W_P2: tl.constexpr, E_P2: tl.constexpr):  # fmt: skip
    """Program p: ``counts[p] = [tokens per rank (W_P2), pairs per expert (E_P2), bad]`` of its chunk."""
    p, P = tl.program_id(0), tl.num_programs(0)
    chunk = (T + P - 1) // P
    t_end = tl.minimum(T, (p + 1) * chunk)
    n = tl.full([W_P2], 0, tl.int32)
    c = tl.full([E_P2], 0, tl.int32)
    bad = tl.full([], 0, tl.int32)
    ex = tl.arange(0, E_P2)
    for t0 in range(p * chunk, t_end, BT):
        ids, valid, bads, in_rank = _token_block(idx_ptr, t0, t_end, E, L, K, BT, K_P2, W_P2)
        n += vsum(in_rank, 0)
        key = tl.where(valid, ids, E_P2)
        c += vsum(vsum((key[:, :, None] == ex[None, None, :]).to(tl.int32), 0), 0)
        bad = bad | vmax(vmax(bads.to(tl.int32), 0), 0)
    row = counts_ptr + p * (W_P2 + E_P2 + 1)
    tl.store(row + tl.arange(0, W_P2), n)
    tl.store(row + W_P2 + ex, c)
    tl.store(row + W_P2 + E_P2, bad)


# notify


@triton.jit
def _chunk_bases(counts_ptr, layout_ptr, P, W_P2: tl.constexpr, E_P2: tl.constexpr, P_P2: tl.constexpr,
                 EB: tl.constexpr):  # fmt: skip
    """Per chunk: tokens per rank and pairs per expert in the chunks before it (into the layout, after the first
    ``W_P2 + E_P2`` words); returns the totals and the bad flag."""
    pp = tl.arange(0, P_P2)
    stride = W_P2 + E_P2 + 1
    wj = tl.arange(0, W_P2)
    live = (pp < P)[:, None]
    n = tl.load(counts_ptr + pp[:, None] * stride + wj[None, :], mask=live, other=0)
    tl.store(layout_ptr + _tok_base(W_P2, E_P2) + pp[:, None] * W_P2 + wj[None, :], vcumsum(n, 0) - n, mask=live)
    bad = vmax(tl.load(counts_ptr + pp * stride + W_P2 + E_P2, mask=pp < P, other=0), 0)
    base = _pair_base(W_P2, E_P2, P_P2)
    for e0 in tl.static_range(0, E_P2, EB):
        ej = e0 + tl.arange(0, EB)
        c = tl.load(counts_ptr + pp[:, None] * stride + W_P2 + ej[None, :], mask=live, other=0)
        tl.store(layout_ptr + base + pp[:, None] * E_P2 + ej[None, :], vcumsum(c, 0) - c, mask=live)
        tl.store(layout_ptr + W_P2 + ej, vsum(c, 0))  # scratch: this rank's pairs per expert
    return vsum(n, 0), bad


@triton.jit
def _publish(slot_at, code, fmt, n, c_ptr, text_ptr, W, E: tl.constexpr, W_P2: tl.constexpr, E_P2: tl.constexpr,
             TEXT: tl.constexpr, TEXT_P2: tl.constexpr):  # fmt: skip
    """This rank's notify message ``[code, fmt, tokens per rank, pairs per expert, text]`` at ``slot_at``."""
    w = ptr(slot_at, tl.int64)
    wj, ej, tj = tl.arange(0, W_P2), tl.arange(0, E_P2), tl.arange(0, TEXT_P2)
    tl.store(w + 2 + wj, n, mask=wj < W)
    tl.store(w + 2 + W + ej, tl.load(c_ptr + ej), mask=ej < E)
    tl.store(ptr(slot_at + 8 * (2 + W + E), tl.int8) + tj, tl.load(ptr(text_ptr, tl.int8) + tj, mask=tj < TEXT),
             mask=tj < TEXT)  # fmt: skip
    tl.store(w + 1, fmt)
    tl.store(w, code)


@triton.jit
def _align_up(n, align):
    """``n`` (int64 pair counts, each below 2**31) rounded up to a multiple of ``align``, divided in int32: a 64-bit
    division is a called subroutine on the GPU, whose register saves spill under some Triton versions."""
    n32 = n.to(tl.int32)
    return ((n32 + align - 1) // align * align).to(tl.int64)


@triton.jit
def _global_layout(msgs, msg_bytes, layout_ptr, host_ptr, me, W, e, align, E: tl.constexpr, L: tl.constexpr,
                   W_P2: tl.constexpr, E_P2: tl.constexpr, L_P2: tl.constexpr):  # fmt: skip
    """From every rank's message: where this rank's rows go in every destination (``send_start [W_P2]``, then
    ``exp_base``: the expanded row of this rank's first pair per global expert ``d * L + l``) and what it
    receives (the host summary; returns ``recv_start [W_P2]``, ``recv_n [W_P2]``, ``exp_start`` and ``count``
    ``[L_P2]``, then, per rank ``[W_P2]``, its status, format word, rows received and expanded rows)."""
    s, lj = tl.arange(0, W_P2), tl.arange(0, L_P2)
    at = ptr(msgs + wide(s) * msg_bytes, tl.int64)
    live = s < W
    code = tl.load(at, mask=live, other=_OK)
    fmt = tl.load(at + 1, mask=live, other=0)
    nmat = tl.load(at[:, None] + 2 + s[None, :], mask=live[:, None] & live[None, :], other=0)  # [src, dst]
    tl.store(layout_ptr + s, vsum(tl.where((s < me)[:, None], nmat, 0), 0))  # send_start
    inside = live[None, :, None] & (lj < L)[None, None, :]
    g = s[None, :, None] * L + lj[None, None, :]  # [1, dst, l]: global expert
    cmat = tl.load(at[:, None, None] + 2 + W + g, mask=live[:, None, None] & inside, other=0)  # [src, dst, l]
    total = vsum(cmat, 0)  # [dst, l] pairs over every source
    aligned = _align_up(total, align)
    exp_base = vcumsum(aligned, 1) - aligned + vsum(tl.where((s < me)[:, None, None], cmat, 0), 0)
    tl.store(layout_ptr + W_P2 + s[:, None] * L + lj[None, :], exp_base, mask=live[:, None] & (lj < L)[None, :])
    recv_n = vsum(tl.where(s[None, :] == me, nmat, 0), 1)
    cnt = vsum(tl.where((s == me)[:, None], total, 0), 0)
    al = _align_up(cnt, align)
    h = ptr(host_ptr, tl.int64)
    tl.store(h, vsum(recv_n, 0))
    tl.store(h + 1, vsum(al, 0))
    tl.store(h + 2 + s, code, mask=live)
    tl.store(h + 2 + W + s, fmt, mask=live)
    tl.store(h + 2 + 2 * W + s, recv_n, mask=live)
    tl.store(h + 2 + 3 * W + lj, cnt, mask=lj < L)
    tl.store(h + 2 + 3 * W + L, e)
    rs, es = vcumsum(recv_n, 0) - recv_n, vcumsum(al, 0) - al
    return rs, recv_n, es, cnt, code, fmt, vsum(nmat, 0), vsum(aligned, 1)


@triton.jit
def _judge_worst(ctrl, status_addr, W, e, codes, fmts, rows, expanded, fmt, worst, worst_x, W_P2: tl.constexpr):
    """A worst-case dispatch's verdict, from every rank's status and format word and every rank's rows received
    and expanded (the same on every rank): a failure, recorded with every rank's words, unless every call is
    valid, every rank has this rank's format word (format and ``num_worst_tokens``) and no rank receives more
    than ``worst`` rows or ``worst_x`` expanded rows. True when the dispatch may go on."""
    s = tl.arange(0, W_P2)
    live = s < W
    bad = live & ((codes != _OK) | (fmts != fmt) | (rows > worst) | (expanded > worst_x))
    nbad = vsum(bad.to(tl.int32), 0)
    if nbad != 0:
        record_verdict(ctrl, W, status_addr, _JUDGED, _NOTIFY, nbad, worst, worst_x, e, codes, fmts, rows, expanded,
                       4, W_P2)  # fmt: skip
    return nbad == 0


@triton.jit(do_not_specialize=["timeout_ns", "me", "W", "P", "code", "fmt", "align", "ready", "worst", "worst_x"])
def _notify(counts_ptr, layout_ptr, text_ptr, notify_table, ctrl_table, ctrl_addr, notice_addr, status_addr,
            clock_addr, host_addr, ready_addr, ready, timeout_ns, me, W, P, code, fmt, align, worst, worst_x,
            area_bytes, msg_bytes,
            E: tl.constexpr, L: tl.constexpr, W_P2: tl.constexpr, E_P2: tl.constexpr, L_P2: tl.constexpr,
            P_P2: tl.constexpr, EB: tl.constexpr, TEXT: tl.constexpr, TEXT_P2: tl.constexpr,
            HW_TIMER: tl.constexpr):  # fmt: skip
    ctrl = ptr(ctrl_addr, tl.int64)
    if alive(ctrl, W):
        e = next_epoch(ctrl, _NOTIFY, W)
        off = (e % 2) * area_bytes
        n, bad = _chunk_bases(counts_ptr, layout_ptr, P, W_P2, E_P2, P_P2, EB)
        tl.debug_barrier()  # the totals, stored by every thread, are read back to publish them
        code = tl.where((code == _OK) & (bad != 0), _BAD, code)
        for d in range(W):
            slot = tl.load(notify_table + d) + off + wide(me) * msg_bytes
            _publish(slot, code, fmt, n, layout_ptr + W_P2, text_ptr, W, E, W_P2, E_P2, TEXT, TEXT_P2)
        signal_peers(ctrl_table, W, _NOTIFY * W + wide(me), 1)
        if wait_sources(ctrl, _NOTIFY, W, e, e, notice_addr, status_addr, clock_addr, timeout_ns, HW_TIMER):
            msgs = tl.load(notify_table + me) + off
            tl.debug_barrier()  # every thread has read the totals before the layout overwrites their words
            rs, rn, es, cnt, codes, fmts, rows, expanded = _global_layout(
                msgs, msg_bytes, layout_ptr, host_addr, me, W, e, align, E, L, W_P2, E_P2, L_P2
            )
            tail = layout_ptr + layout_tail(W_P2, E_P2, P_P2)
            tl.store(tail + tl.arange(0, W_P2), rs)
            tl.store(tail + W_P2 + tl.arange(0, W_P2), rn)
            tl.store(tail + 2 * W_P2 + tl.arange(0, L_P2), es)
            tl.store(tail + 2 * W_P2 + L_P2 + tl.arange(0, L_P2), cnt)
            tl.store(tail + 2 * W_P2 + 2 * L_P2, vsum(rn, 0))
            tl.store(tail + 2 * W_P2 + 2 * L_P2 + 1, vsum(_align_up(cnt, align), 0))
            if worst > 0:
                _judge_worst(ctrl, status_addr, W, e, codes, fmts, rows, expanded, fmt, worst, worst_x, W_P2)
        end_exchange(ctrl, _NOTIFY, W, e)
    publish_ready(ready_addr, ready)


# dispatch: send


@triton.jit
def row_fields(cap, XB: tl.constexpr, SB: tl.constexpr, K: tl.constexpr):
    """Byte offsets of the field blocks of the receive rows (``cap`` rows each): scales, local expert ids, weights,
    expanded rows (the x rows are first)."""
    o_s = (wide(cap) * XB + 15) // 16 * 16
    o_i = o_s + (wide(cap) * SB + 15) // 16 * 16
    o_w = o_i + (wide(cap) * 4 * K + 15) // 16 * 16
    return o_s, o_i, o_w, o_w + (wide(cap) * 4 * K + 15) // 16 * 16


@triton.jit
def _send_rows(x_ptr, s_ptr, w_ptr, rows_table, layout_ptr, t, ids, valid, in_rank, pos, epos, T, W, cap,
               E: tl.constexpr, L: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr, W_P2: tl.constexpr,
               XB: tl.constexpr, SB: tl.constexpr, HAS_W: tl.constexpr, BT: tl.constexpr, BW_X: tl.constexpr,
               BW_S: tl.constexpr):  # fmt: skip
    """A block of tokens' rows (each read once per destination, in L2) into their rows at every destination
    rank they go to, with the metadata: local expert ids, weights, the expanded row of each slot (-1 where the
    expert lives elsewhere). ``pos [BT, W_P2]``: each token's row among this rank's rows to each destination."""
    wj, kk = tl.arange(0, W_P2), tl.arange(0, K_P2)
    o_s, o_i, o_w, o_p = row_fields(cap, XB, SB, K)
    row = wide(pos) + tl.load(layout_ptr + wj)[None, :]  # [BT, W_P2]: the row in the destination's layout
    base = tl.load(rows_table + wj, mask=wj < W, other=0)[None, :] + row * 0
    live = tl.reshape(in_rank > 0, [BT * W_P2])
    rflat = tl.reshape(row, [BT * W_P2])
    bflat = tl.reshape(base, [BT * W_P2])
    tflat = tl.reshape(wide(t)[:, None] + wj[None, :] * 0, [BT * W_P2])
    x_at = ptr(x_ptr, tl.int8).to(tl.int64)
    copy_rows_at(bflat + rflat * XB, x_at + tflat * XB, live, XB // 4, BW_X, 16)
    if SB > 0:
        s_at = ptr(s_ptr, tl.int8).to(tl.int64)
        copy_rows_at(bflat + o_s + rflat * SB, s_at + tflat * SB, live, SB // 4, BW_S, 4)
    inside = (t < T)[:, None] & (kk < K)[None, :]
    if HAS_W:
        wv = tl.load(w_ptr + wide(t)[:, None] * K + kk[None, :], mask=inside, other=0.0)
    else:
        wv = tl.full([BT, K_P2], 0.0, tl.float32)
    here = (tl.where(valid, ids // L, -1)[:, None, :] == wj[None, :, None]) & inside[:, None, :]  # [BT, W, K]
    loc = tl.reshape(tl.where(here, ids[:, None, :] - wj[None, :, None] * L, -1), [BT * W_P2, K_P2])
    exp = tl.reshape(tl.where(here, epos[:, None, :], -1), [BT * W_P2, K_P2])
    wts = tl.reshape(wv[:, None, :] + (wj[None, :, None] * 0).to(tl.float32), [BT * W_P2, K_P2])
    meta = live[:, None] & (kk < K)[None, :]
    at = bflat[:, None] + rflat[:, None] * (4 * K) + kk[None, :] * 4
    tl.store(ptr(at + o_i, tl.int32), loc, mask=meta)
    tl.store(ptr(at + o_w, tl.float32), wts, mask=meta)
    tl.store(ptr(at + o_p, tl.int32), exp, mask=meta)


@triton.jit(do_not_specialize=["T", "me", "W", "cap"])
def _dispatch_send(x_ptr, s_ptr, idx_ptr, w_ptr, layout_ptr, send_pos_ptr, rows_table, ctrl_table, ctrl_addr, T,
                   me, W, cap, E: tl.constexpr, L: tl.constexpr, K: tl.constexpr, XB: tl.constexpr,
                   SB: tl.constexpr, HAS_W: tl.constexpr, BT: tl.constexpr, K_P2: tl.constexpr, W_P2: tl.constexpr,
                   E_P2: tl.constexpr, P_P2: tl.constexpr, BW_X: tl.constexpr, BW_S: tl.constexpr):  # fmt: skip
    ctrl = ptr(ctrl_addr, tl.int64)
    if alive(ctrl, W):
        p, P = tl.program_id(0), tl.num_programs(0)
        begin_send(ctrl, _DATA, W)
        chunk = (T + P - 1) // P
        t_end = tl.minimum(T, (p + 1) * chunk)
        wj, ex = tl.arange(0, W_P2), tl.arange(0, E_P2)
        run_t = tl.load(layout_ptr + _tok_base(W_P2, E_P2) + p * W_P2 + wj).to(tl.int32)
        # expanded rows per expert before this chunk's next pair (int32: a [pairs, experts] tile is held below)
        run_e = (
            tl.load(layout_ptr + W_P2 + ex) + tl.load(layout_ptr + _pair_base(W_P2, E_P2, P_P2) + p * E_P2 + ex)
        ).to(tl.int32)
        jj = tl.arange(0, BT * K_P2)
        for t0 in range(p * chunk, t_end, BT):
            ids, valid, _, in_rank = _token_block(idx_ptr, t0, t_end, E, L, K, BT, K_P2, W_P2)
            t = t0 + tl.arange(0, BT)
            pos = run_t[None, :] + vcumsum(in_rank, 0) - in_rank
            tl.store(send_pos_ptr + wide(t)[:, None] * W + wj[None, :], tl.where(in_rank > 0, pos, -1),
                     mask=(t < t_end)[:, None] & (wj < W)[None, :])  # fmt: skip
            key = tl.reshape(tl.where(valid, ids, E_P2), [BT * K_P2])
            same = (key[None, :] == key[:, None]) & (jj[None, :] < jj[:, None])
            onehot = key[:, None] == ex[None, :]
            epos = vsum(tl.where(onehot, run_e[None, :], 0), 1) + vsum(same.to(tl.int32), 1)
            _send_rows(x_ptr, s_ptr, w_ptr, rows_table, layout_ptr, t, ids, valid, in_rank, pos,
                       tl.reshape(epos, [BT, K_P2]), t_end, W, cap, E, L, K, K_P2, W_P2, XB, SB, HAS_W, BT, BW_X,
                       BW_S)  # fmt: skip
            run_t += vsum(in_rank, 0)
            run_e += vsum(onehot.to(tl.int32), 0)
        signal_peers(ctrl_table, W, _DATA * W + wide(me), signal_share())


# launchers


@dataclass(frozen=True)
class NormalGeometry:
    """Everything fixed per buffer that the normal-mode kernels take (addresses are this process's view):
    ``cap`` receive rows per rank (``W * num_max_tokens_per_rank``); ``*_table`` every rank's control words,
    notify and rows areas (``[W]`` int64 on the device), ``*_local`` this rank's; the rest as ``LLGeometry``."""

    rank: int
    world: int
    num_experts: int
    num_topk: int
    cap: int
    text: int
    ctrl: int
    notices: int
    ctrl_table: torch.Tensor
    notify_table: torch.Tensor
    rows_table: torch.Tensor
    rows_local: int
    notify_area: int
    notify_msg: int
    status: int
    clock: int
    timeout_ns: int
    device: torch.device
    #: Programs of each multi-program launch on CUDA (the SMs the exchange takes; per rank and per call, e.g. a
    #: dispatch's ``num_sms``). :func:`~epkit.kernels.triton.ep_common.programs`.
    ctas: int = DEFAULT_CTAS
    #: ``ctas`` was chosen for the call: the interpreter runs that many programs too (else 2).
    exact_ctas: bool = False

    def programs(self) -> int:
        """Programs of each multi-program launch (and chunks of the layout)."""
        return programs(self.device, self.ctas, self.exact_ctas)

    def sizes(self) -> dict:
        """Block sizes and padded extents shared by the launches. ``BT`` tokens per step: on a GPU the per-step tiles
        (``[BT * W_P2]`` rows copied, ``[BT * K_P2]`` pairs against each other and against every expert) stay in
        registers."""
        p2 = triton.next_power_of_2
        k_p2, w_p2 = p2(self.num_topk), p2(self.world)
        return {
            "K_P2": k_p2,
            "W_P2": w_p2,
            "E_P2": p2(self.num_experts),
            "L_P2": p2(self.num_experts // self.world),
            "P_P2": p2(self.programs()),
            "BT": max(1, 16 // max(w_p2, k_p2)) if self.hw_timer() else 8,
        }

    def hw_timer(self) -> bool:
        """Waits read ``%globaltimer`` (a GPU launch), else the clock word (the interpreter)."""
        return target(self.device) == "cuda"

    def layout_words(self) -> int:
        z = self.sizes()
        return layout_words(z["W_P2"], z["E_P2"], z["L_P2"], z["P_P2"])

    def tail(self) -> int:
        """Word of ``recv_start`` in the layout words (``layout_tail`` in the kernels)."""
        z = self.sizes()
        return z["W_P2"] + z["E_P2"] + z["P_P2"] * (z["W_P2"] + z["E_P2"])


@launcher
def layout(geo: NormalGeometry, topk_idx, counts) -> None:
    """Per-chunk counts of ``topk_idx [T, K]`` into ``counts [P, W_P2 + E_P2 + 1]`` int32 (one launch)."""
    z = geo.sizes()
    launch(
        _layout, (geo.programs(),), geo.device, topk_idx, counts, topk_idx.shape[0],
        E=geo.num_experts, L=geo.num_experts // geo.world, K=geo.num_topk, BT=z["BT"], K_P2=z["K_P2"],
        W_P2=z["W_P2"], E_P2=z["E_P2"],
    )  # fmt: skip


@launcher
def notify(
    geo: NormalGeometry, counts, lay, text, host, code: int, fmt: int, align: int, ready: int,
    worst: tuple[int, int] = (0, 0),
) -> None:  # fmt: skip
    """The notify exchange (one program): ``lay`` the dispatch's layout words (int64, out), ``host`` the summary
    (host memory, ``summary_words``; its last word gets ``ready``, the caller's call number, after every other
    word), ``code`` this rank's status (OK or REJECTED with ``text``), ``fmt`` its format word (row format, and
    ``num_worst_tokens`` above it: ``collectives/ep/worst.py``). ``worst``: a worst-case dispatch's ``(rows,
    expanded rows)``, judged here (``(0, 0)``: the host reads the summary and judges)."""
    z = geo.sizes()
    launch(
        _notify, (1,), geo.device, counts, lay, text, geo.notify_table, geo.ctrl_table, geo.ctrl, geo.notices,
        geo.status, geo.clock, host.data_ptr(), host[-1:].data_ptr(), ready, geo.timeout_ns, geo.rank, geo.world,
        geo.programs(), code, fmt, align, worst[0], worst[1], geo.notify_area, geo.notify_msg,
        E=geo.num_experts, L=geo.num_experts // geo.world, W_P2=z["W_P2"], E_P2=z["E_P2"], L_P2=z["L_P2"],
        P_P2=z["P_P2"], EB=min(64, z["E_P2"]), TEXT=geo.text, TEXT_P2=triton.next_power_of_2(geo.text),
        HW_TIMER=geo.hw_timer(), num_warps=8 if geo.hw_timer() else 4,  # 8: its [W, W, L] tiles spill on 4 warps
    )  # fmt: skip


@launcher
def dispatch_send(geo: NormalGeometry, x, scales, topk_idx, weights, lay, send_pos) -> None:
    """Every token's row once per destination rank (one launch): ``x [T, hidden]`` (any dtype, moved as bytes),
    ``scales [T, G]`` float32 or None, ``weights [T, K]`` float32 or None; ``send_pos [T, W]`` int32 out (each
    token's row among this rank's rows to each destination, -1 where it does not go)."""
    z = geo.sizes()
    xb = x.shape[1] * x.element_size()
    sb = 4 * scales.shape[1] if scales is not None else 0
    rows = z["BT"] * z["W_P2"] if geo.hw_timer() else 1  # a GPU step's tile stays in registers; the interpreter's
    launch(
        _dispatch_send, (geo.programs(),), geo.device, x, scales if scales is not None else x, topk_idx,
        weights if weights is not None else send_pos, lay, send_pos, geo.rows_table, geo.ctrl_table, geo.ctrl,
        x.shape[0], geo.rank, geo.world, geo.cap,
        E=geo.num_experts, L=geo.num_experts // geo.world, K=geo.num_topk, XB=xb, SB=sb, HAS_W=weights is not None,
        BT=z["BT"], K_P2=z["K_P2"], W_P2=z["W_P2"], E_P2=z["E_P2"], P_P2=z["P_P2"],
        BW_X=row_words(xb, rows), BW_S=row_words(sb, rows),
    )  # fmt: skip
