"""MegaMoE-style fused MoE layer: dispatch -> grouped GEMM -> SwiGLU -> grouped GEMM -> combine in one call.

On a buffer that took the device kernels (``EPBuffer(kernels=...)``, see ``ep/device_state.py``) each row
crosses to its destination rank once and the receive kernel lays it out as the grouped GEMM's contiguous
input; the combine reads the expert outputs where they are (the weighted sums leave the expert rank once), with
one host read (the rows received, which size the GEMM) and no host barrier. Otherwise:

Allowed only when every EP peer is directly addressable (``EPBuffer.is_within_domain()``: the
``shm`` transport on one host, or ``nvshmem`` within one NVLink domain, where the rows live on the
GPU and move through peer views; that path runs in CI on the nvshmem emulator with the row moves and
sums in their torch formulations, a buffer made with ``portable=True``). There is no dispatch staging: each rank
publishes its tokens once in its own symmetric buffer, and every expert rank
gathers the rows it needs straight from the senders' buffers into the grouped
GEMM's input; the expert side then writes its weighted partial sums straight
into the sources' buffers, and each source reduces them in place.

The result is bitwise equal to the composed ops
``dispatch(expand=True) -> expert_mlp -> combine`` (same row order, same
expert MLP, same fixed summation order).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from epkit.collectives.ep.rows import (
    META_MSG,
    align_up,
    by_address,
    check_biases,
    copy_rows_by_address,
    decode_error,
    encode_error,
    expanded_layout,
    sum_indexed_rows,
)
from epkit.collectives.ep_buffer import EPBuffer
from epkit.ops import custom_op, refuse_capture

__all__ = ["buffer_name", "fused_moe"]


def _publish_layout(t_num: int, xb: int, k: int) -> tuple[int, int, int, int]:
    """Byte offsets (x, topk ids, weights, end) in a rank's publish area after the header."""
    o_x = align_up(16 + META_MSG)
    o_i = align_up(o_x + t_num * xb)
    o_w = align_up(o_i + 4 * k * t_num)
    return o_x, o_i, o_w, align_up(o_w + 4 * k * t_num)


def fused_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w13,
    w2,
    buffer: EPBuffer,
    *,
    bias=None,
    swiglu_limit: float | None = None,
    expert_alignment: int = 128,
    backend: str = "auto",
) -> torch.Tensor:
    """One fused MoE layer over the EP group of ``buffer``.

    Parameters
    ----------
    x : Tensor [T, hidden] bfloat16
    topk_idx : Tensor [T, num_topk] int32/int64 in [-1, num_experts)
    topk_weights : Tensor [T, num_topk] float32
    w13, w2 : this rank's local experts' weights, as :func:`epkit.moe.expert_mlp` takes them
        (``[L, 2I, hidden]`` and ``[L, hidden, I]``; FP8, MXFP4 or bf16)
    buffer : EPBuffer whose every peer is directly addressable (shm; nvshmem within one NVLink domain)
    bias : Tensor [T, hidden] or tuple of two, optional (e.g. the shared expert's output)
    swiglu_limit : float, optional
    expert_alignment : int
        Rows per expert group are padded to this (the grouped GEMM's M alignment).
    backend : str
        Passed to the grouped GEMMs.

    Returns
    -------
    Tensor [T, hidden] bfloat16, bitwise equal to dispatch(expand=True) -> expert_mlp -> combine.
    """

    if not isinstance(buffer, EPBuffer):
        raise ValueError(f"buffer must be an EPBuffer, got {type(buffer).__name__}")
    if not buffer.is_within_domain():
        raise ValueError(
            f"fused_moe needs every EP peer directly addressable (shm on one host, or nvshmem within one NVLink "
            f"domain); this buffer ({buffer.transport!r}) is not: compose dispatch -> expert_mlp -> combine instead"
        )
    refuse_capture("fused_moe", buffer.device)
    error, biases = _check_call(x, topk_idx, topk_weights, buffer, bias, expert_alignment, w13, w2)
    if buffer.uses_device_kernels:  # dispatch and combine on the device kernels, the expert MLP between them
        from epkit.moe import expert_mlp

        def experts(rows, m_indices):
            if rows.shape[0] == 0:
                return torch.zeros((0, buffer.hidden), dtype=torch.bfloat16, device=buffer.device)
            mlp = expert_mlp(
                rows, "contiguous", w13, w2, m_indices=m_indices, swiglu_limit=swiglu_limit, backend=backend
            )
            return mlp.contiguous()

        return buffer.run_fused(x, topk_idx, topk_weights, expert_alignment, error, biases, experts)
    peers = _publish(x, topk_idx, topk_weights, buffer, error)
    with buffer.retire_on_failure("fused_moe"):  # a failure past the agreement leaves peers at a barrier
        return _fused_rows(x, topk_idx, peers, w13, w2, buffer, biases, swiglu_limit, expert_alignment, backend)


def _check_call(x, topk_idx, topk_weights, buffer: EPBuffer, bias, expert_alignment, w13, w2):
    """This rank's validation: ``(error text or None, biases)``; no exception escapes, since every rank must
    learn of a bad call through the publish header. It covers what the expert MLP would refuse only after the
    rows moved (the weights, an alignment the contiguous GEMM cannot take), so that such a call fails on every
    rank before the first row moves, and the buffer goes on."""
    from epkit.grouped_gemm import get_mk_alignment_for_contiguous_layout
    from epkit.moe import check_expert_weights

    h, region = buffer.hidden, buffer.region_bytes
    try:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
            raise ValueError(f"x must be bfloat16 [num_tokens, {h}], got {getattr(x, 'dtype', type(x))}")
        buffer.validate_dispatch(x, None, topk_idx, topk_weights, buffer.num_max_tokens_per_rank)
        if topk_weights is None:
            raise ValueError("topk_weights is required")
        if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
        gemm_align = get_mk_alignment_for_contiguous_layout()
        if expert_alignment % gemm_align:
            raise ValueError(
                f"expert_alignment must be a multiple of {gemm_align} (each expert's rows start a block of the "
                f"contiguous grouped GEMM: get_mk_alignment_for_contiguous_layout()), got {expert_alignment}"
            )
        check_expert_weights(x, w13, w2, buffer.num_local_experts)
        biases = check_biases(bias, x.shape[0], h)
        if len({b.dtype for b in biases}) > 1 or any(b.dtype not in (torch.bfloat16, torch.float32) for b in biases):
            raise ValueError(f"bias must be bfloat16 or float32 (one dtype), got {[b.dtype for b in biases]}")
        if _publish_layout(x.shape[0], 2 * h, buffer.num_topk)[3] > region:
            raise ValueError(f"{x.shape[0]} tokens do not fit the buffer's {region}-byte publish area")
    except Exception as exc:  # noqa: BLE001 -- reported to every rank
        return (str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"), []
    return None, biases


def _publish(x, topk_idx, topk_weights, buffer: EPBuffer, error: str | None) -> list[torch.Tensor]:
    """Write this rank's tokens (or its error) into its own publish area, meet every rank, and return every
    rank's publish area as a view; raises the same ValueError on every rank if any rank's call was bad."""
    sb, region, K = buffer.buffer, buffer.region_bytes, buffer.num_topk
    w, me, xb = buffer.world_size, buffer.rank, 2 * buffer.hidden
    pub = sb.local[me * region : (me + 1) * region]
    head = pub[:16].view(torch.int64)
    if error is not None:
        head[0], head[1] = -1, 0
        pub[16 : 16 + META_MSG].copy_(encode_error(error).to(pub.device))
    else:
        t_num = x.shape[0]
        o_x, o_i, o_w, _ = _publish_layout(t_num, xb, K)
        head[0], head[1] = 0, t_num
        pub[o_x : o_x + t_num * xb].view(t_num, xb).copy_(x.contiguous().view(torch.uint8).view(t_num, xb))
        pub[o_i : o_i + 4 * K * t_num].view(torch.int32).view(t_num, K).copy_(topk_idx)
        pub[o_w : o_w + 4 * K * t_num].view(torch.float32).view(t_num, K).copy_(topk_weights.float())
    sb.barrier()  # every rank has published
    peers = [sb.peer(r)[r * region : (r + 1) * region] for r in range(w)]
    errors = [
        f"rank {r}: {decode_error(p[16 : 16 + META_MSG])}"
        for r, p in enumerate(peers)
        if int(p[:8].view(torch.int64)[0]) == -1
    ]
    if errors:
        sb.barrier()  # nobody rewrites a publish area while another rank still reads the error text
        raise ValueError("fused_moe rejected on every rank before any row moved: " + "; ".join(errors))
    return peers


def _fused_rows(x, topk_idx, peers, w13, w2, buffer: EPBuffer, biases, swiglu_limit, expert_alignment, backend):
    """The row-moving part of :func:`fused_moe`, after every rank published and agreed. Routing metadata is
    read to the CPU (as normal-mode dispatch does); rows stay on the buffer's device."""
    from epkit.moe import expert_mlp

    sb, dev = buffer.buffer, buffer.device
    w, me, L, K, h = buffer.world_size, buffer.rank, buffer.num_local_experts, buffer.num_topk, buffer.hidden
    region, xb = buffer.region_bytes, 2 * buffer.hidden
    # Expert side: which (source, token) rows come here, in dispatch's received order.
    recv_src, recv_tok, recv_idx, recv_w, bases = [], [], [], [], []
    for r, p in enumerate(peers):
        t_r = int(p[8:16].view(torch.int64)[0])
        o_x, o_i, o_w, _ = _publish_layout(t_r, xb, K)
        bases.append(p.data_ptr() + o_x)
        ids = p[o_i : o_i + 4 * K * t_r].view(torch.int32).view(t_r, K).long().cpu()
        on_me = (ids >= 0) & (ids // L == me)
        toks = on_me.any(dim=1).nonzero().flatten()
        recv_src.append(torch.full((toks.numel(),), r, dtype=torch.int64))
        recv_tok.append(toks)
        recv_idx.append(torch.where(on_me[toks], ids[toks] - me * L, -1))
        recv_w.append(p[o_w : o_w + 4 * K * t_r].view(torch.float32).view(t_r, K).cpu()[toks])
    recv_src, recv_tok = torch.cat(recv_src), torch.cat(recv_tok)
    recv_idx = torch.cat(recv_idx).to(torch.int32)
    recv_w = torch.cat(recv_w).clone()
    counts = torch.bincount(recv_idx[recv_idx >= 0].long(), minlength=L)
    buffer.recv_tokens_per_expert_total.add_(counts)
    rows, slot = expanded_layout(recv_idx, counts, expert_alignment)
    # Gather the GEMM's input straight from the senders' buffers (zero rows for padding).
    row_addr = torch.tensor(bases, dtype=torch.int64)[recv_src] + recv_tok * xb
    addrs = torch.where(rows >= 0, row_addr[rows.clamp(min=0)], 0) if rows.numel() else rows
    n_rows = rows.numel()
    portable = buffer.cfg.portable
    if by_address(x, portable=portable):
        from epkit import _C

        expanded = torch.empty((n_rows, h), dtype=torch.bfloat16)
        _C.gather_rows_by_address(
            expanded.data_ptr(), addrs.contiguous().data_ptr(), n_rows, xb, torch.get_num_threads()
        )
    else:  # device rows (or portable): the copy kernel, padding rows left zero
        expanded = torch.zeros((n_rows, h), dtype=torch.bfloat16, device=dev)
        dst = expanded.data_ptr() + torch.arange(n_rows, dtype=torch.int64) * xb
        copy_rows_by_address(dst.to(dev), addrs.to(dev), xb, [expanded.data_ptr(), xb, *bases], portable=portable)
    m_indices = torch.full((n_rows,), -1, dtype=torch.int32)
    ok = slot >= 0
    m_indices[slot[ok]] = recv_idx[ok]
    if n_rows:
        y = expert_mlp(
            expanded, "contiguous", w13, w2, m_indices=m_indices.to(dev), swiglu_limit=swiglu_limit, backend=backend
        ).contiguous()
    else:
        y = torch.zeros((0, h), dtype=torch.bfloat16, device=dev)
    sb.barrier()  # every rank is done reading the publish areas: regions may now be overwritten

    # Expert side of combine: weighted partials written straight into each source's buffer.
    for r in range(w):
        sel = (recv_src == r).nonzero().flatten()
        n = sel.numel()
        if n:
            dst = sb.peer(r)[me * region : me * region + n * xb].view(torch.bfloat16).view(n, h)
            s = slot[sel]
            sum_indexed_rows(dst, [y], torch.where(s >= 0, 0, -1), s.clamp(min=0), recv_w[sel], portable=portable)
    sb.barrier()  # every partial has landed

    # Source side: sum over ranks ascending, reading the partials in place.
    t_num = x.shape[0]
    ids = topk_idx.long().cpu()
    src_of = torch.full((t_num, w), -1, dtype=torch.int64)
    row_of = torch.zeros((t_num, w), dtype=torch.int64)
    sources = []
    for r in range(w):
        toks = ((ids >= 0) & (ids // L == r)).any(dim=1).nonzero().flatten()
        src_of[toks, r] = r
        row_of[toks, r] = torch.arange(toks.numel())
        sources.append(sb.local[r * region : r * region + toks.numel() * xb].view(torch.bfloat16).view(-1, h))
    out = torch.empty((t_num, h), dtype=torch.bfloat16, device=dev)
    sum_indexed_rows(out, sources, src_of, row_of, None, biases, portable=portable)
    sb.barrier()  # regions are free again for the next exchange
    return out


# torch.ops.epkit.fused_moe: fused_moe with its buffer named

_BUFFERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_SERIAL = itertools.count()


def buffer_name(buffer) -> str:
    """A name for ``buffer`` (an :class:`~epkit.collectives.ep_buffer.EPBuffer`) that ``torch.ops.epkit.fused_moe``
    takes in its place (held weakly: the op raises once the buffer is gone). Call it outside compiled code."""
    for name, held in list(_BUFFERS.items()):
        if held is buffer:
            return name
    name = f"epbuffer-{next(_SERIAL)}"  # never reused: a graph holding a dead buffer's name cannot reach a new one
    _BUFFERS[name] = buffer
    return name


def _fake_fused_moe(x, *args):
    return torch.empty_like(x)


@custom_op("fused_moe", _fake_fused_moe)
def _fused_moe_op(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scales: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scales: torch.Tensor | None,
    buffer: str,
    bias: list[torch.Tensor],
    swiglu_limit: float | None,
    expert_alignment: int,
    backend: str,
) -> torch.Tensor:
    """``torch.ops.epkit.fused_moe``: :func:`epkit.fused_moe` on the buffer named ``buffer``
    (:func:`buffer_name`), weights given as tensors and their scales (None for bf16), ``bias`` as a list of up to
    two tensors (empty: none). It waits for the peers on the host: it compiles, and is not for CUDA graphs."""
    buf = _BUFFERS.get(buffer)
    if buf is None:
        raise ValueError(
            f"fused_moe: no buffer is named {buffer!r} (name it with epkit.collectives.fused_moe.buffer_name(buffer))"
        )
    w13 = w13 if w13_scales is None else (w13, w13_scales)
    w2 = w2 if w2_scales is None else (w2, w2_scales)
    biases = None if not bias else (bias[0] if len(bias) == 1 else tuple(bias))
    return fused_moe(
        x, topk_idx, topk_weights, w13, w2, buf, bias=biases, swiglu_limit=swiglu_limit,
        expert_alignment=expert_alignment, backend=backend,
    )  # fmt: skip
