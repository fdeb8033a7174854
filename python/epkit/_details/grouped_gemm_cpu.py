"""CPU backend of the grouped GEMMs in :mod:`epkit.grouped_gemm` (see its module docstring).

With a bf16 ``d`` on a CPU with AMX-BF16, every layout runs the fused C++ kernel
``epkit._C.grouped_gemm_amx`` (a task per expert: row address, scale address, output address,
row count, optional row list). Otherwise the live groups' weights and rows are dequantized in one
threaded pass (``epkit._C.dequant_blocks`` when built, else ``epkit.quant``'s dequantizers: the
same bits) and multiplied by torch matmuls written straight into ``d``. No per-row Python work;
padding rows and empty groups are skipped. Inputs arrive validated.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from epkit.quant import (
    FP8_BLOCK,
    MXFP4_BLOCK,
    dequant_mxfp4,
    dequant_per_block_fp8,
    dequant_per_token_group_fp8,
)
from epkit.utils import ROW_ALIGN

__all__ = ["cpu_contiguous", "cpu_masked", "dequant_extension", "amx_kernel", "amx_disabled", "compute_dtype"]


@functools.cache
def _fast_bf16_matmul() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def dequant_extension():
    """``epkit._C`` when it has the fused dequantizer ``dequant_blocks``, else None (torch fallback, same bits)."""
    try:
        from epkit import _C
    except ImportError:
        return None
    return _C if hasattr(_C, "dequant_blocks") else None


@functools.cache
def amx_kernel():
    """``epkit._C`` when it has the AMX grouped GEMM and this CPU/OS allow AMX tiles, else None.

    Whether a call uses it also depends on :func:`amx_disabled` and the call's output dtype and K.
    """
    ext = dequant_extension()
    if ext is None or not hasattr(ext, "grouped_gemm_amx"):
        return None
    try:
        return ext if ext.amx_available() else None
    except RuntimeError:
        return None


_KIND_CODES = {"fp8": (0, 0), "fp8_fp4": (0, 1), "bf16": (2, 2)}  # (activation, weight) codes of the C++ kernel


def _amx_ok(kind: str, a, b, d) -> bool:
    """Whether the fused AMX kernel takes this call (bf16 output on an AMX CPU, K a multiple of 32)."""
    return (
        _AMX_ENABLED[0]
        and d.dtype == torch.bfloat16
        and d.device.type == "cpu"
        and a.shape[-1] > 0
        and a.shape[-1] % 32 == 0
        and amx_kernel() is not None
    )


_AMX_ENABLED = [True]  # amx_disabled() (and tests, by monkeypatching) switch it off: the unfused path runs


@contextlib.contextmanager
def amx_disabled():
    """Within the block, the cpu backend does not use the AMX kernel (the unfused path runs, as on CPUs
    without AMX); the previous setting comes back on exit. Not thread-safe: one switch per process."""
    before = _AMX_ENABLED[0]
    _AMX_ENABLED[0] = False
    try:
        yield
    finally:
        _AMX_ENABLED[0] = before


def _amx_run(kind: str, a, sfa, b, sfb, d, tasks: list) -> None:
    """Run the fused AMX kernel on ``tasks``: (group, row addresses in a, sfa, d, row count, row list or 0).

    Keeps the row list tensors alive (they are in the caller's frame) while the kernel runs.
    """
    a_code, b_code = _KIND_CODES[kind]
    b = _inner_contig(b)
    sfb = None if sfb is None else _inner_contig(sfb)
    amx_kernel().grouped_gemm_amx(
        a_code,
        b_code,
        _OUT_CODE[d.dtype],
        a.stride(-2) * a.element_size(),
        0 if sfa is None else sfa.stride(-2),
        b.data_ptr(),
        0 if sfb is None else sfb.data_ptr(),
        b.stride(0) * b.element_size(),
        b.stride(1) * b.element_size(),
        0 if sfb is None else sfb.stride(0),
        0 if sfb is None else sfb.stride(1),
        b.shape[1],
        a.shape[-1],
        d.stride(-2),
        tasks,
        torch.get_num_threads(),
    )


def _row_addr(t: torch.Tensor, *index) -> int:
    """Address of ``t[index]`` (a row start) without creating a view."""
    off = t.storage_offset() + sum(i * st for i, st in zip(index, t.stride()))
    return t.untyped_storage().data_ptr() + off * t.element_size()


_OUT_CODE = {torch.float32: 0, torch.bfloat16: 1}
_SCRATCH_CAP = 1 << 28  # bytes of per-thread scratch kept between calls (larger requests are one-off)
_SCRATCH_ALIGN = 64
_tls = threading.local()


def _scratch(sizes: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Flat per-thread scratch tensors of ``sizes`` elements (64-byte aligned).

    Only memory is reused across calls (it avoids page-faulting fresh buffers on every call);
    every element handed out is overwritten by a dequantization before anything reads it.
    """
    item = torch.empty((), dtype=dtype).element_size()
    offs, total = [], 0
    for numel in sizes:
        offs.append(total)
        total += -(-numel * item // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.numel() < total:
        buf = torch.empty(max(total, 1), dtype=torch.uint8)
        if total <= _SCRATCH_CAP:
            _tls.buf = buf
    return [buf[o : o + numel * item].view(dtype) for o, numel in zip(offs, sizes)]


def _buffers(kind: str, groups: int, rows: int, n: int, k: int, cd: torch.dtype) -> list[torch.Tensor]:
    """Scratch of the unfused path in dtype cd: dequantized weights ``[groups * n * k]`` and rows ``[rows * k]``
    (empty for bf16 operands, used as they are) and the matmul results ``[rows * n]`` (see :func:`_mm_into`)."""
    deq = 0 if kind == "bf16" else 1
    return _scratch([deq * groups * n * k, deq * rows * k, rows * n], cd)


def _inner_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _as3(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)


class _Dequant:
    """Dequantization jobs of one GEMM call, run together in one threaded C++ pass.

    Each job writes ``out [.., R, K]`` (bf16 / f32) from ``q`` with block scales ``s``:
    fp8: ``q [.., Rq, K]`` e4m3, ``s [.., ceil(Rq/row_block), K/128]`` float32;
    fp8_fp4: ``q [.., Rq, K/2]`` uint8 e2m1 pairs, ``s [.., Rq, K/32]`` uint8 e8m0 (row_block 1).
    ``rows`` (int64 [R], optional, 2-D jobs with row_block 1) picks source rows. The result is
    bitwise equal to ``epkit.quant``'s float32 dequantizers followed by ``.to(out.dtype)``,
    which is also the fallback when ``epkit._C`` lacks the fused kernel.
    """

    def __init__(self) -> None:
        self.jobs: list = []

    def add(self, kind: str, out: torch.Tensor, q: torch.Tensor, s: torch.Tensor, row_block: int, rows=None) -> None:
        self.jobs.append((kind, out, _inner_contig(q), _inner_contig(s), row_block, rows))

    def run(self, simd: bool = True) -> None:
        ext = dequant_extension()
        if ext is None or any(j[1].device.type != "cpu" or j[1].stride(-1) != 1 for j in self.jobs):
            for kind, out, q, s, row_block, rows in self.jobs:
                if rows is not None:
                    q, s = q[rows], s[rows]
                if kind == "fp8_fp4":
                    out.copy_(dequant_mxfp4(q, s))
                elif row_block == 1:
                    out.copy_(dequant_per_token_group_fp8(q, s, FP8_BLOCK))
                else:
                    out.copy_(dequant_per_block_fp8(q, s, (row_block, FP8_BLOCK)))
            return
        specs = []
        for kind, out, q, s, row_block, rows in self.jobs:
            o3, q3, s3 = _as3(out), _as3(q), _as3(s)
            batches, nrows, k = o3.shape
            fp4 = kind == "fp8_fp4"
            specs.append(
                (int(fp4), _OUT_CODE[out.dtype], o3.data_ptr(), o3.stride(0), o3.stride(1))
                + (q3.data_ptr(), q3.stride(0), q3.stride(1), s3.data_ptr(), s3.stride(0), s3.stride(1))
                + (batches, nrows, k, 1 if fp4 else row_block, MXFP4_BLOCK if fp4 else FP8_BLOCK)
                + (0 if rows is None else rows.data_ptr(),)
            )
        ext.dequant_blocks(specs, torch.get_num_threads(), simd)


def compute_dtype(d: torch.Tensor) -> torch.dtype:
    """Operand dtype of the unfused path's matmuls for output ``d``: bfloat16 for a bf16 ``d`` on a CPU with
    fast bf16 matmuls, else float32."""
    return torch.bfloat16 if (d.dtype == torch.bfloat16 and _fast_bf16_matmul()) else torch.float32


def _weights(deq: _Dequant | None, kind: str, b, sfb, live: list[int], cd: torch.dtype, buf) -> torch.Tensor:
    """``[len(live), N, K]`` weights of the live groups in dtype cd.

    Scaled kinds are dequantized into ``buf`` (queued on ``deq``); bf16 weights are used as they are.
    """
    if kind == "bf16":
        if len(live) == b.shape[0] and b.dtype == cd:
            return b
        return b[torch.tensor(live, dtype=torch.long, device=b.device)].to(cd)
    out = buf.view(len(live), b.shape[1], -1)
    row_block = FP8_BLOCK if kind == "fp8" else 1
    if len(live) == b.shape[0]:
        deq.add(kind, out, b, sfb, row_block)  # every expert in one job
    else:
        for i, grp in enumerate(live):
            deq.add(kind, out[i], b[grp], sfb[grp], row_block)
    return out


def _mm_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, res: torch.Tensor) -> None:
    """``out = x @ w^T`` for 2-D (one group) or 3-D (a batch of groups) operands; out is a view of d.

    The rows are taken in whole :data:`~epkit.utils.ROW_ALIGN` blocks, so a row's bits do not depend on its
    group's size: the leading multiple of ROW_ALIGN rows straight from ``x``, the rest zero-padded to one more
    block. Where ``out`` cannot take the matmul's result (another dtype, or not contiguous), the product goes
    to ``res`` (flat scratch of at least ``out.numel()`` elements of x's dtype, reused across calls: a fresh
    result would be page-faulted in on every call) and is cast into ``out`` from there."""
    rows = x.shape[-2]
    head = rows - rows % ROW_ALIGN
    if head:
        _mm_block(x[..., :head, :], w, out[..., :head, :], res)
    if head < rows:
        tail = x.new_zeros((*x.shape[:-2], ROW_ALIGN, x.shape[-1]))
        tail[..., : rows - head, :] = x[..., head:, :]
        prod = torch.matmul(tail, w.transpose(-1, -2))
        out[..., head:, :].copy_(prod[..., : rows - head, :])


def _mm_block(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, res: torch.Tensor) -> None:
    mm = torch.matmul if x.dim() == 2 else torch.bmm
    if out.dtype == x.dtype and out.is_contiguous():
        mm(x, w.transpose(-1, -2), out=out)
    else:
        r = res[: out.numel()].view(out.shape)
        mm(x, w.transpose(-1, -2), out=r)
        out.copy_(r)


def _group_rows(m_indices: torch.Tensor, g: int):
    """Rows of each group for the contiguous layout.

    Returns ``(counts, order)``: ``counts`` a list of G row counts, ``order`` int64 [rows in
    groups] listing the rows of group 0, then group 1, ..., each in ascending order.
    """
    ids = m_indices.long()
    counts = torch.bincount(ids + 1, minlength=g + 1).tolist()
    order = torch.argsort(ids, stable=True)
    return counts[1:], order[counts[0] :]


def _even_stride(starts: list[int], cnt: list[int]) -> int | None:
    """Row stride when equal-sized groups start at evenly spaced rows (one batched matmul), else None."""
    if len(cnt) < 2 or min(cnt) != max(cnt):
        return None
    stride = starts[1] - starts[0]
    if stride < cnt[0] or any(y - x != stride for x, y in zip(starts, starts[1:])):
        return None
    return stride


def cpu_contiguous(kind, a, sfa, b, sfb, d, m_indices) -> None:
    """Contiguous layout on validated CPU inputs: ``d[i] = a[i] @ b[m_indices[i]].T``, zeros where ``m_indices``
    is -1 (see :mod:`epkit.grouped_gemm`; ``sfa``/``sfb`` None for bf16)."""
    counts, order = _group_rows(m_indices, b.shape[0])
    live = [grp for grp, c in enumerate(counts) if c]
    if live:
        offs = [0]
        for grp in live:
            offs.append(offs[-1] + counts[grp])
        firsts = order[offs[:-1]].tolist()
        lasts = order[[o - 1 for o in offs[1:]]].tolist()
        is_slice = [y - x + 1 == counts[grp] for grp, x, y in zip(live, firsts, lasts)]
        if _amx_ok(kind, a, b, d):
            a_in = _inner_contig(a)
            sfa_in = None if sfa is None else _inner_contig(sfa)
            tasks = []
            for i, (grp, r) in enumerate(zip(live, firsts)):
                if is_slice[i]:  # rows r .. r + count - 1
                    base, index = r, 0
                else:  # scattered rows: the kernel reads and writes them through the (ascending) row list
                    base, index = 0, order[offs[i] : offs[i + 1]].data_ptr()
                sfa_row = 0 if sfa_in is None else _row_addr(sfa_in, base)
                tasks.append((grp, _row_addr(a_in, base), sfa_row, _row_addr(d, base), counts[grp], index))
            _amx_run(kind, a_in, sfa_in, b, sfb, d, tasks)
        else:
            _cpu_contiguous_unfused(kind, a, sfa, b, sfb, d, counts, order, live, offs, firsts, lasts, is_slice)
    pad = m_indices < 0
    if bool(pad.any()):
        d.masked_fill_(pad.unsqueeze(1), 0)  # fast fill (boolean-index assignment would gather)


def _cpu_contiguous_unfused(kind, a, sfa, b, sfb, d, counts, order, live, offs, firsts, lasts, is_slice) -> None:
    """Dequantize every live group in one pass, then torch matmuls (the path without AMX)."""
    cd = compute_dtype(d)
    n, k = b.shape[1], a.shape[1]
    wbuf, x_all, res = _buffers(kind, len(live), offs[-1], n, k, cd)
    if kind == "bf16":
        w = _weights(None, kind, b, None, live, cd, None)
        x_all = None if (all(is_slice) and a.dtype == cd) else a[order].to(cd)
    else:
        deq = _Dequant()
        w = _weights(deq, kind, b, sfb, live, cd, wbuf)
        x_all = x_all.view(offs[-1], k)
        deq.add("fp8", x_all, a, sfa, 1, rows=order)  # live rows, gathered group by group
        deq.run()
    stride = _even_stride(firsts, [counts[grp] for grp in live]) if all(is_slice) else None
    if stride is not None:  # equal, evenly spaced groups: one batched matmul
        c, ng = counts[live[0]], len(live)
        if x_all is not None:
            x3 = x_all.view(ng, c, k)
        else:
            sa = a.stride()
            x3 = a.as_strided((ng, c, k), (stride * sa[0], sa[0], sa[1]), a.storage_offset() + firsts[0] * sa[0])
        out = d.as_strided((ng, c, n), (stride * n, n, 1), d.storage_offset() + firsts[0] * n)
        _mm_into(x3, w, out, res)
    else:
        for i in range(len(live)):
            x = x_all[offs[i] : offs[i + 1]] if x_all is not None else a[firsts[i] : lasts[i] + 1]
            if is_slice[i]:
                _mm_into(x, w[i], d[firsts[i] : lasts[i] + 1], res)
            else:
                r = res[: x.shape[0] * n].view(x.shape[0], n)
                _mm_into(x, w[i], r, res[x.shape[0] * n :])
                d.index_copy_(0, order[offs[i] : offs[i + 1]], r.to(d.dtype))


def cpu_masked(kind, a, sfa, b, sfb, d, masked_m) -> None:
    """Masked layout on validated CPU inputs: ``d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T``, other rows
    untouched."""
    cd = compute_dtype(d)
    n, k = b.shape[1], a.shape[2]
    counts = masked_m.tolist()
    live = [grp for grp, c in enumerate(counts) if c]
    if not live:
        return
    if _amx_ok(kind, a, b, d):
        a_in = _inner_contig(a)
        sfa_in = None if sfa is None else _inner_contig(sfa)
        tasks = [
            (grp, _row_addr(a_in, grp, 0), 0 if sfa_in is None else _row_addr(sfa_in, grp, 0), _row_addr(d, grp, 0))
            + (counts[grp], 0)
            for grp in live
        ]
        _amx_run(kind, a_in, sfa_in, b, sfb, d, tasks)
        return
    offs = [0]
    for grp in live:
        offs.append(offs[-1] + counts[grp])
    wbuf, x_all, res = _buffers(kind, len(live), offs[-1], n, k, cd)
    if kind == "bf16":
        w = _weights(None, kind, b, None, live, cd, None)
        x_all = None
    else:
        deq = _Dequant()
        w = _weights(deq, kind, b, sfb, live, cd, wbuf)
        x_all = x_all.view(offs[-1], k)
        for i, grp in enumerate(live):
            deq.add("fp8", x_all[offs[i] : offs[i + 1]], a[grp, : counts[grp]], sfa[grp, : counts[grp]], 1)
        deq.run()
    c, g0, ng = counts[live[0]], live[0], len(live)
    if ng >= 2 and live == list(range(g0, g0 + ng)) and all(counts[grp] == c for grp in live):
        x3 = x_all.view(ng, c, k) if x_all is not None else a[g0 : g0 + ng, :c].to(cd)
        _mm_into(x3, w, d[g0 : g0 + ng, :c], res)  # one batched matmul
        return
    for i, grp in enumerate(live):
        x = x_all[offs[i] : offs[i + 1]] if x_all is not None else a[grp, : counts[grp]].to(cd)
        _mm_into(x, w[i], d[grp, : counts[grp]], res)
