"""Grouped (per-expert) GEMMs with DeepGEMM-compatible semantics: ``d = a @ b[g].T`` per group.

Layouts
-------
contiguous (prefill): ``a [M, K]`` holds every group's rows back to back;
    ``m_indices [M]`` int32 gives each row's group, ``-1`` for padding rows,
    whose outputs are written as exact zeros. With ``use_psum_layout=True``
    ``m_indices [G]`` holds cumulative row ends instead: group ``g`` owns rows
    ``[align(end[g-1]), end[g])`` (``end[-1] = 0``, ``align`` rounds up to
    :func:`get_mk_alignment_for_contiguous_layout`); every other row is padding.
masked (decode): ``a [G, M_max, K]``; only the first ``masked_m[g]`` rows of
    group ``g`` are computed, the rest of ``d`` is left untouched.

Formats
-------
``fp8``      a e4m3 + float32 ``sfa [M, K/128]`` (1x128 groups); b e4m3 [G, N, K] +
             float32 ``sfb [G, ceil(N/128), K/128]`` (128x128 blocks).
``fp8_fp4``  a as above; b MXFP4 ``uint8 [G, N, K/2]`` + e8m0 ``uint8 sfb [G, N, K/32]``.
``bf16``     a bf16 [M, K]; b bf16 [G, N, K]; no scales.
``d`` is bfloat16 or float32.

Backends: ``cpu`` - with a bf16 ``d`` on a CPU with AMX-BF16, the fused C++ kernel
``epkit._C.grouped_gemm_amx``: per expert it dequantizes the rows into a cache-resident bf16
block and the weights panel by panel straight into AMX's tile layout, and multiplies on AMX
tiles with float32 accumulation (no full-size dequantized copy is ever written). Otherwise
every call dequantizes the live groups' weights and rows in one threaded pass (fused C++
``epkit._C.dequant_blocks`` when built, else the ``epkit.quant`` dequantizers) and runs one
torch matmul per group, or one batched matmul when the groups are equal and evenly spaced,
written straight into d (bf16 operands when the CPU has fast bf16 and d is bf16, else
float32). Both paths multiply the same operands: the dequantizers' float32 values rounded to
bf16 (or kept in float32 for a float32 d without AMX); only the summation order differs.
``triton`` (kernels/triton/grouped_gemm.py; the interpreter on CPU
tensors), ``reference`` (float32 matmul of dequantized inputs, group by group).
"""

from __future__ import annotations

import functools
import threading

import torch

from epkit.backends import OpSpec, register_op, select
from epkit.quant import dequant_mxfp4, dequant_per_block_fp8, dequant_per_token_group_fp8

__all__ = [
    "get_mk_alignment_for_contiguous_layout",
    "build_m_indices",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "m_grouped_fp8_fp4_gemm_nt_masked",
    "m_grouped_bf16_gemm_nt_contiguous",
    "m_grouped_bf16_gemm_nt_masked",
    "grouped_gemm_reference",
]

_ALIGN = 128
_SF_K = 128  # activation / weight scale granularity along K (fp8)
_FP4_BLOCK = 32


def get_mk_alignment_for_contiguous_layout() -> int:
    """Row alignment of each group in the contiguous layout (128, as DeepGEMM)."""
    return _ALIGN


def build_m_indices(
    num_tokens_per_group: torch.Tensor | list[int], alignment: int | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Per-row group ids for the contiguous layout, each group padded to ``alignment`` rows.

    Parameters
    ----------
    num_tokens_per_group : Tensor [G] or list of G ints (>= 0)
    alignment : int, optional
        Defaults to :func:`get_mk_alignment_for_contiguous_layout`.
    device : torch device of the result.

    Returns
    -------
    Tensor [sum(align_up(count_g))], int32: ``g`` for group g's rows, ``-1`` for padding rows.

    Examples
    --------
    >>> build_m_indices([1, 0, 2], alignment=2).tolist()
    [0, -1, 2, 2]
    """
    counts = torch.as_tensor(num_tokens_per_group, dtype=torch.int64).cpu()
    alignment = _ALIGN if alignment is None else alignment
    if counts.dim() != 1 or (counts.numel() and int(counts.min()) < 0):
        raise ValueError(f"num_tokens_per_group must be a 1-D list of counts >= 0, got {counts.tolist()}")
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment must be a positive int, got {alignment!r}")
    padded = (counts + alignment - 1) // alignment * alignment
    g = counts.numel()
    ids = torch.arange(g, dtype=torch.int32).repeat_interleave(padded)
    pos = torch.arange(int(padded.sum())) - torch.repeat_interleave(torch.cumsum(padded, 0) - padded, padded)
    ids[pos >= torch.repeat_interleave(counts, padded)] = -1
    return ids.to(device)


# Validation


def _shape(t) -> tuple:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _want(name: str, t, dtypes: tuple, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype} of shape {_shape(t)}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {_shape(t)}")


def _unpack(x, name: str, scaled: bool):
    if scaled:
        if not (isinstance(x, (tuple, list)) and len(x) == 2):
            raise ValueError(f"{name} must be a (tensor, scales) pair, got {type(x).__name__}")
        return x[0], x[1]
    if isinstance(x, (tuple, list)):
        raise ValueError(f"{name} must be a single bf16 tensor for the bf16 GEMM, got a {type(x).__name__}")
    return x, None


def _validate(kind: str, a, b, d, masked: bool):
    """Check dtypes/shapes of (a, sfa), (b, sfb), d; returns (a, sfa, b, sfb, G, M, N, K)."""
    scaled = kind != "bf16"
    a, sfa = _unpack(a, "a", scaled)
    b, sfb = _unpack(b, "b", scaled)
    a_dt = (torch.bfloat16,) if kind == "bf16" else (torch.float8_e4m3fn,)
    if not isinstance(a, torch.Tensor) or a.dim() != (3 if masked else 2):
        raise ValueError(f"a must be a {'[G, M_max, K]' if masked else '[M, K]'} tensor, got shape {_shape(a)}")
    if not isinstance(b, torch.Tensor) or b.dim() != 3:
        raise ValueError(f"b must be a [G, N, K{'/2' if kind == 'fp8_fp4' else ''}] tensor, got shape {_shape(b)}")
    k = a.shape[-1]
    g, n = b.shape[0], b.shape[1]
    if masked and a.shape[0] != g:
        raise ValueError(f"a has {a.shape[0]} groups but b has {g} (a {_shape(a)}, b {_shape(b)})")
    _want("a", a, a_dt, tuple(a.shape))
    if scaled and k % _SF_K:
        raise ValueError(f"K = {k} (a {_shape(a)}) must be a multiple of the scale block {_SF_K}")
    rows = tuple(a.shape[:-1])
    if kind == "fp8":
        _want("b", b, (torch.float8_e4m3fn,), (g, n, k))
        _want("sfb", sfb, (torch.float32,), (g, -(-n // 128), k // _SF_K))
    elif kind == "fp8_fp4":
        _want("b", b, (torch.uint8,), (g, n, k // 2))
        _want("sfb", sfb, (torch.uint8,), (g, n, k // _FP4_BLOCK))
    else:
        _want("b", b, (torch.bfloat16,), (g, n, k))
    if scaled:
        _want("sfa", sfa, (torch.float32,), (*rows, k // _SF_K))
    _want("d", d, (torch.bfloat16, torch.float32), (*rows, n))
    if not d.is_contiguous():
        raise ValueError(f"d must be contiguous, got strides {d.stride()}")
    devs = {t.device for t in (a, sfa, b, sfb, d) if t is not None}
    if len(devs) > 1:
        raise ValueError(f"a, b, scales and d must share one device, got {sorted(str(x) for x in devs)}")
    return a, sfa, b, sfb, g, (a.shape[0] if not masked else a.shape[1]), n, k


def _psum_to_m_indices(ends: torch.Tensor, m: int) -> torch.Tensor:
    ends64 = ends.long().cpu()
    g = ends64.numel()
    ids = torch.full((m,), -1, dtype=torch.int32)
    prev = 0
    for grp, end in enumerate(ends64.tolist()):  # loop over groups, not rows
        start = -(-prev // _ALIGN) * _ALIGN
        if end < prev or end > m or (prev < end < start):
            raise ValueError(
                f"m_indices (psum layout) must be non-decreasing cumulative ends <= M = {m}, with each group "
                f"starting at the previous end rounded up to {_ALIGN}; group {grp} of {g} has end {end} "
                f"after previous end {prev} (aligned start {start})"
            )
        if end > start:
            ids[start:end] = grp
        prev = end
    return ids.to(ends.device)


def _check_m_indices(m_indices, g: int, m: int, device, use_psum_layout: bool) -> torch.Tensor:
    want = (g,) if use_psum_layout else (m,)
    if not isinstance(m_indices, torch.Tensor) or m_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"m_indices must be an int32 tensor of shape {want}, got {getattr(m_indices, 'dtype', None)}")
    if tuple(m_indices.shape) != want:
        raise ValueError(
            f"m_indices must have shape {want} ({'[G] cumulative ends' if use_psum_layout else '[M]'}), "
            f"got {tuple(m_indices.shape)}"
        )
    if m_indices.device != device:
        raise ValueError(f"m_indices is on {m_indices.device} but a is on {device}")
    if use_psum_layout:
        return _psum_to_m_indices(m_indices, m)
    if m_indices.numel():
        lo, hi = int(m_indices.min()), int(m_indices.max())
        if lo < -1 or hi >= g:
            bad = lo if lo < -1 else hi
            pos = int((m_indices == bad).nonzero()[0])
            raise ValueError(f"m_indices[{pos}] = {bad} is outside [-1, {g}) (b has G = {g} groups)")
    return m_indices


def _check_masked_m(masked_m, g: int, m_max: int, device, expected_m) -> torch.Tensor:
    if not isinstance(masked_m, torch.Tensor) or masked_m.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"masked_m must be an int32 tensor of shape ({g},), got {getattr(masked_m, 'dtype', None)}")
    if tuple(masked_m.shape) != (g,):
        raise ValueError(f"masked_m must have shape ({g},) (one count per group), got {tuple(masked_m.shape)}")
    if masked_m.device != device:
        raise ValueError(f"masked_m is on {masked_m.device} but a is on {device}")
    if not isinstance(expected_m, int) or expected_m < 0:
        raise ValueError(f"expected_m must be an int >= 0 (a hint for the kernel config), got {expected_m!r}")
    if g:
        lo, hi = int(masked_m.min()), int(masked_m.max())
        if lo < 0 or hi > m_max:
            bad = lo if lo < 0 else hi
            pos = int((masked_m == bad).nonzero()[0])
            raise ValueError(f"masked_m[{pos}] = {bad} is outside [0, M_max = {m_max}] (a has shape [G, M_max, K])")
    return masked_m


# Reference


def _deq_a(kind: str, a: torch.Tensor, sfa: torch.Tensor | None) -> torch.Tensor:
    return a.float() if kind == "bf16" else dequant_per_token_group_fp8(a, sfa, _SF_K)


def _deq_b(kind: str, b: torch.Tensor, sfb: torch.Tensor | None) -> torch.Tensor:
    if kind == "fp8":
        return dequant_per_block_fp8(b, sfb, (128, _SF_K))
    if kind == "fp8_fp4":
        return dequant_mxfp4(b, sfb)
    return b.float()


def grouped_gemm_reference(kind, a, sfa, b, sfb, d, m_indices=None, masked_m=None) -> torch.Tensor:
    """Readable specification: float32 matmul of dequantized inputs, group by group.

    ``kind`` is ``"fp8"``, ``"fp8_fp4"`` or ``"bf16"``; pass per-row ``m_indices [M]``
    (contiguous; padding rows become zeros) or ``masked_m [G]`` (masked; other rows untouched).
    """
    for grp in range(b.shape[0]):
        w = _deq_b(kind, b[grp], None if sfb is None else sfb[grp])  # [N, K] float32
        if masked_m is not None:
            rows = int(masked_m[grp])
            x = _deq_a(kind, a[grp, :rows], None if sfa is None else sfa[grp, :rows])
            d[grp, :rows] = (x @ w.T).to(d.dtype)
        else:
            sel = m_indices == grp
            x = _deq_a(kind, a[sel], None if sfa is None else sfa[sel])
            d[sel] = (x @ w.T).to(d.dtype)
    if masked_m is None:
        d[m_indices < 0] = 0
    return d


# CPU backend: weights and activations dequantized on every call (fused C++ when epkit._C has it,
# the quant module's torch dequantizers otherwise - the same bits), one matmul per group written
# straight into d. No per-row Python work; padding rows and empty groups are skipped.


@functools.cache
def _fast_bf16_matmul() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def _ext():
    """``epkit._C`` when it has the fused dequantizer, else None (torch fallback, same bits)."""
    try:
        from epkit import _C
    except ImportError:
        return None
    return _C if hasattr(_C, "dequant_blocks") else None


@functools.cache
def _amx():
    """``epkit._C`` when it has the AMX grouped GEMM and this CPU/OS allow AMX tiles, else None."""
    ext = _ext()
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
        and _amx() is not None
    )


_AMX_ENABLED = [True]  # tests switch it off to compare against the unfused path


def _amx_run(kind: str, a, sfa, b, sfb, d, tasks: list) -> None:
    """Run the fused AMX kernel on ``tasks``: (group, row addresses in a, sfa, d, row count, row list or 0).

    Keeps the row list tensors alive (they are in the caller's frame) while the kernel runs.
    """
    a_code, b_code = _KIND_CODES[kind]
    b = _inner_contig(b)
    sfb = None if sfb is None else _inner_contig(sfb)
    _amx().grouped_gemm_amx(
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
        ext = _ext()
        if ext is None or any(j[1].device.type != "cpu" or j[1].stride(-1) != 1 for j in self.jobs):
            for kind, out, q, s, row_block, rows in self.jobs:
                if rows is not None:
                    q, s = q[rows], s[rows]
                if kind == "fp8_fp4":
                    out.copy_(dequant_mxfp4(q, s))
                elif row_block == 1:
                    out.copy_(dequant_per_token_group_fp8(q, s, _SF_K))
                else:
                    out.copy_(dequant_per_block_fp8(q, s, (row_block, _SF_K)))
            return
        specs = []
        for kind, out, q, s, row_block, rows in self.jobs:
            o3, q3, s3 = _as3(out), _as3(q), _as3(s)
            batches, nrows, k = o3.shape
            fp4 = kind == "fp8_fp4"
            specs.append(
                (int(fp4), _OUT_CODE[out.dtype], o3.data_ptr(), o3.stride(0), o3.stride(1))
                + (q3.data_ptr(), q3.stride(0), q3.stride(1), s3.data_ptr(), s3.stride(0), s3.stride(1))
                + (batches, nrows, k, 1 if fp4 else row_block, _FP4_BLOCK if fp4 else _SF_K)
                + (0 if rows is None else rows.data_ptr(),)
            )
        ext.dequant_blocks(specs, torch.get_num_threads(), simd)


def _compute_dtype(d: torch.Tensor) -> torch.dtype:
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
    row_block = 128 if kind == "fp8" else 1
    if len(live) == b.shape[0]:
        deq.add(kind, out, b, sfb, row_block)  # every expert in one job
    else:
        for i, grp in enumerate(live):
            deq.add(kind, out[i], b[grp], sfb[grp], row_block)
    return out


def _mm_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x @ w^T`` for 2-D (one group) or 3-D (a batch of groups) operands; out is a view of d."""
    mm = torch.matmul if x.dim() == 2 else torch.bmm
    if out.dtype == x.dtype and out.is_contiguous():
        mm(x, w.transpose(-1, -2), out=out)
    else:
        out.copy_(mm(x, w.transpose(-1, -2)))


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


def _cpu_contiguous(kind, a, sfa, b, sfb, d, m_indices) -> None:
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
    cd = _compute_dtype(d)
    n, k = b.shape[1], a.shape[1]
    if kind == "bf16":
        w = _weights(None, kind, b, None, live, cd, None)
        x_all = None if (all(is_slice) and a.dtype == cd) else a[order].to(cd)
    else:
        wbuf, x_all = _scratch([len(live) * n * k, offs[-1] * k], cd)
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
        _mm_into(x3, w, out)
    else:
        for i in range(len(live)):
            x = x_all[offs[i] : offs[i + 1]] if x_all is not None else a[firsts[i] : lasts[i] + 1]
            if is_slice[i]:
                _mm_into(x, w[i], d[firsts[i] : lasts[i] + 1])
            else:
                d.index_copy_(0, order[offs[i] : offs[i + 1]], torch.matmul(x, w[i].T).to(d.dtype))


def _cpu_masked(kind, a, sfa, b, sfb, d, masked_m) -> None:
    cd = _compute_dtype(d)
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
    if kind == "bf16":
        w = _weights(None, kind, b, None, live, cd, None)
        x_all = None
    else:
        wbuf, x_all = _scratch([len(live) * n * k, offs[-1] * k], cd)
        deq = _Dequant()
        w = _weights(deq, kind, b, sfb, live, cd, wbuf)
        x_all = x_all.view(offs[-1], k)
        for i, grp in enumerate(live):
            deq.add("fp8", x_all[offs[i] : offs[i + 1]], a[grp, : counts[grp]], sfa[grp, : counts[grp]], 1)
        deq.run()
    c, g0, ng = counts[live[0]], live[0], len(live)
    if ng >= 2 and live == list(range(g0, g0 + ng)) and all(counts[grp] == c for grp in live):
        x3 = x_all.view(ng, c, k) if x_all is not None else a[g0 : g0 + ng, :c].to(cd)
        _mm_into(x3, w, d[g0 : g0 + ng, :c])  # one batched matmul
        return
    for i, grp in enumerate(live):
        x = x_all[offs[i] : offs[i + 1]] if x_all is not None else a[grp, : counts[grp]].to(cd)
        _mm_into(x, w[i], d[grp, : counts[grp]])


# Public ops


def _contiguous(op, kind, a, b, d, m_indices, use_psum_layout, backend):
    a, sfa, b, sfb, g, m, n, k = _validate(kind, a, b, d, masked=False)
    rows_ids = _check_m_indices(m_indices, g, m, a.device, use_psum_layout)
    impl = select(op, a.device, backend)
    if m == 0 or n == 0:
        return d
    if impl == "reference":
        grouped_gemm_reference(kind, a, sfa, b, sfb, d, m_indices=rows_ids)
    elif impl == "cpu":
        _cpu_contiguous(kind, a, sfa, b, sfb, d, rows_ids)
    else:
        from epkit.kernels.triton.grouped_gemm import grouped_gemm_contiguous

        grouped_gemm_contiguous(kind, a, sfa, b, sfb, d, rows_ids)
    return d


def _masked(op, kind, a, b, d, masked_m, expected_m, backend):
    a, sfa, b, sfb, g, m_max, n, k = _validate(kind, a, b, d, masked=True)
    masked_m = _check_masked_m(masked_m, g, m_max, a.device, expected_m)
    impl = select(op, a.device, backend)
    if g == 0 or m_max == 0 or n == 0:
        return d
    if impl == "reference":
        grouped_gemm_reference(kind, a, sfa, b, sfb, d, masked_m=masked_m)
    elif impl == "cpu":
        _cpu_masked(kind, a, sfa, b, sfb, d, masked_m)
    else:
        from epkit.kernels.triton.grouped_gemm import grouped_gemm_masked

        grouped_gemm_masked(kind, a, sfa, b, sfb, d, masked_m, expected_m)
    return d


_CONTIG_DOC = """Contiguous-layout grouped GEMM ``d[i] = a[i] @ b[m_indices[i]].T`` ({what}).

    Parameters
    ----------
    a : {a}
    b : {b}
    d : Tensor [M, N], bfloat16 or float32, contiguous
        Written in place; rows with ``m_indices == -1`` become exact zeros.
    m_indices : Tensor [M] int32
        Group per row in ``[-1, G)``; or, with ``use_psum_layout=True``, Tensor [G] int32 of
        cumulative row ends (group g owns rows ``[align(end[g-1], 128), end[g])``).
    use_psum_layout : bool
    backend : ``"auto"``, ``"cpu"``, ``"triton"`` or ``"reference"``.

    Returns
    -------
    d
    """

_MASKED_DOC = """Masked-layout grouped GEMM ``d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T`` ({what}).

    Parameters
    ----------
    a : {a_masked}
    b : {b}
    d : Tensor [G, M_max, N], bfloat16 or float32, contiguous
        Rows ``>= masked_m[g]`` of group g are left untouched.
    masked_m : Tensor [G] int32, values in ``[0, M_max]``
    expected_m : int
        Expected rows per group (a hint for kernel configuration).
    backend : ``"auto"``, ``"cpu"``, ``"triton"`` or ``"reference"``.

    Returns
    -------
    d
    """

_FMT = {
    "fp8": dict(
        what="FP8 x FP8",
        a="(Tensor [M, K] float8_e4m3fn, Tensor [M, K/128] float32) - K a multiple of 128",
        a_masked="(Tensor [G, M_max, K] float8_e4m3fn, Tensor [G, M_max, K/128] float32)",
        b="(Tensor [G, N, K] float8_e4m3fn, Tensor [G, ceil(N/128), K/128] float32) - 128x128 block scales",
    ),
    "fp8_fp4": dict(
        what="FP8 activations x MXFP4 weights",
        a="(Tensor [M, K] float8_e4m3fn, Tensor [M, K/128] float32) - K a multiple of 128",
        a_masked="(Tensor [G, M_max, K] float8_e4m3fn, Tensor [G, M_max, K/128] float32)",
        b="(Tensor [G, N, K/2] uint8 e2m1 pairs (even element low nibble), Tensor [G, N, K/32] uint8 e8m0)",
    ),
    "bf16": dict(
        what="BF16 x BF16",
        a="Tensor [M, K] bfloat16",
        a_masked="Tensor [G, M_max, K] bfloat16",
        b="Tensor [G, N, K] bfloat16",
    ),
}


def m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, use_psum_layout=False, *, backend="auto"):
    return _contiguous("m_grouped_fp8_gemm_nt_contiguous", "fp8", a, b, d, m_indices, use_psum_layout, backend)


def m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m, *, backend="auto"):
    return _masked("m_grouped_fp8_gemm_nt_masked", "fp8", a, b, d, masked_m, expected_m, backend)


def m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, m_indices, use_psum_layout=False, *, backend="auto"):
    return _contiguous("m_grouped_fp8_fp4_gemm_nt_contiguous", "fp8_fp4", a, b, d, m_indices, use_psum_layout, backend)


def m_grouped_fp8_fp4_gemm_nt_masked(a, b, d, masked_m, expected_m, *, backend="auto"):
    return _masked("m_grouped_fp8_fp4_gemm_nt_masked", "fp8_fp4", a, b, d, masked_m, expected_m, backend)


def m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices, use_psum_layout=False, *, backend="auto"):
    return _contiguous("m_grouped_bf16_gemm_nt_contiguous", "bf16", a, b, d, m_indices, use_psum_layout, backend)


def m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, *, backend="auto"):
    return _masked("m_grouped_bf16_gemm_nt_masked", "bf16", a, b, d, masked_m, expected_m, backend)


for _fn, _kind, _doc in (
    (m_grouped_fp8_gemm_nt_contiguous, "fp8", _CONTIG_DOC),
    (m_grouped_fp8_gemm_nt_masked, "fp8", _MASKED_DOC),
    (m_grouped_fp8_fp4_gemm_nt_contiguous, "fp8_fp4", _CONTIG_DOC),
    (m_grouped_fp8_fp4_gemm_nt_masked, "fp8_fp4", _MASKED_DOC),
    (m_grouped_bf16_gemm_nt_contiguous, "bf16", _CONTIG_DOC),
    (m_grouped_bf16_gemm_nt_masked, "bf16", _MASKED_DOC),
):
    _fn.__doc__ = _doc.format(**_FMT[_kind])


# Self-checks and registration


def make_inputs(kind: str, g: int, m: int, n: int, k: int, masked: bool, seed: int = 0):
    """Random quantized inputs ``(a, b, a_ref_f32, b_ref_f32)`` for tests and benchmarks.

    ``a``/``b`` are what the op takes (pairs for scaled kinds); the float32 tensors are the
    unquantized originals (``[M, K]`` or ``[G, M, K]``, and ``[G, N, K]``).
    """
    from epkit.quant import cast_to_mxfp4, per_block_cast_to_fp8, per_token_group_cast_to_fp8

    gen = torch.Generator().manual_seed(seed)
    af = torch.randn((g, m, k) if masked else (m, k), generator=gen)
    bf = torch.randn(g, n, k, generator=gen) / k**0.5
    if kind == "bf16":
        af, bf = af.bfloat16(), bf.bfloat16()
        return af, bf, af.float(), bf.float()
    a = per_token_group_cast_to_fp8(af)
    b = per_block_cast_to_fp8(bf) if kind == "fp8" else cast_to_mxfp4(bf)
    return a, b, af, bf


def _selfcheck_for(op: str, kind: str, masked: bool):
    def check(backend: str) -> None:
        fn = globals()[op]
        a, b, _, _ = make_inputs(kind, 3, 40, 96, 256, masked, seed=11)
        if masked:
            mm = torch.tensor([0, 40, 17], dtype=torch.int32)
            got = fn(a, b, torch.zeros(3, 40, 96, dtype=torch.bfloat16), mm, 40, backend=backend)
            want = fn(a, b, torch.zeros(3, 40, 96, dtype=torch.bfloat16), mm, 40, backend="reference")
        else:
            idx = torch.tensor([-1] * 3 + [2] * 20 + [0] * 10 + [-1] * 7, dtype=torch.int32)
            got = fn(a, b, torch.ones(40, 96, dtype=torch.bfloat16), idx, backend=backend)
            want = fn(a, b, torch.ones(40, 96, dtype=torch.bfloat16), idx, backend="reference")
        from epkit.testing import calc_diff

        if calc_diff(got, want) > 1e-4 or not torch.isfinite(got.float()).all():
            raise AssertionError(f"{op}[{backend}] differs from the reference: calc_diff {calc_diff(got, want):.2e}")

    return check


#: (op name, weight kind, masked layout) of every grouped GEMM.
GROUPED_OPS = (
    ("m_grouped_fp8_gemm_nt_contiguous", "fp8", False),
    ("m_grouped_fp8_gemm_nt_masked", "fp8", True),
    ("m_grouped_fp8_fp4_gemm_nt_contiguous", "fp8_fp4", False),
    ("m_grouped_fp8_fp4_gemm_nt_masked", "fp8_fp4", True),
    ("m_grouped_bf16_gemm_nt_contiguous", "bf16", False),
    ("m_grouped_bf16_gemm_nt_masked", "bf16", True),
)

for _op, _kind, _masked_layout in GROUPED_OPS:
    register_op(
        OpSpec(
            name=_op,
            cpu=("cpu", "reference", "triton"),
            cuda=("triton", "reference"),
            doc=f"grouped GEMM ({_kind}, {'masked' if _masked_layout else 'contiguous'} layout)",
            selfcheck=_selfcheck_for(_op, _kind, _masked_layout),
        )
    )
