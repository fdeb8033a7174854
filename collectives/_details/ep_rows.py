"""Row-level helpers of the dispatch/combine protocol (EPBuffer, fused_moe): message layout constants,
the fused row reduction and row copies by address (``epkit._C``), and small shape helpers.

Rows in CPU memory go through ``epkit._C`` by address (no staging copies). Rows anywhere else
(CUDA views of nvshmem buffers), or all rows when ``PORTABLE[0]`` is set (tests use it to run the
device path on CPU), take the same arithmetic in torch ops: bitwise the same results.
"""

from __future__ import annotations

import torch

_META_MSG = 192  # bytes of error text carried by the layout exchange
_ALIGN = 16


def _al(n: int, a: int = _ALIGN) -> int:
    return -(-n // a) * a


_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
#: Force the torch formulations (the path CUDA tensors take) on CPU tensors too.
PORTABLE = [False]
_ROW_DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn)


def reduce_rows(
    out: torch.Tensor,
    addrs: torch.Tensor,
    src_dtype: torch.dtype,
    weights: torch.Tensor | None = None,
    biases: list[torch.Tensor] = (),
) -> torch.Tensor:
    """``out[t] = cast(sum_k (w[t, k] *) row(addrs[t, k]) + sum biases)`` in float32, k ascending.

    ``addrs [T, K]`` int64 holds row addresses (0: no row) of ``src_dtype`` rows of
    ``out.shape[1]`` elements in CPU memory; ``epkit._C.reduce_rows`` reads them in place
    (multi-threaded). bf16 / float32 rows, output and biases (:func:`reduce_indexed` takes the
    other dtypes and devices).
    """
    t_num, h = out.shape
    if t_num == 0:
        return out
    if not _fused_ok(out, src_dtype, biases):
        raise ValueError(
            f"reduce_rows: bf16/float32 contiguous CPU output and rows only (out {out.dtype}, rows {src_dtype}, "
            f"biases {[b.dtype for b in biases]}); use reduce_indexed"
        )
    from epkit import _C

    k = addrs.shape[1] if addrs.dim() == 2 else 0
    addrs = addrs.contiguous()
    w = weights.float().contiguous() if weights is not None else None
    bs = [b.contiguous() for b in biases]
    _C.reduce_rows(
        out.data_ptr(),
        _DTYPE_CODE[out.dtype],
        addrs.data_ptr(),
        t_num,
        k,
        h,
        _DTYPE_CODE[src_dtype],
        w.data_ptr() if w is not None else 0,
        [b.data_ptr() for b in bs],
        _DTYPE_CODE[bs[0].dtype] if bs else 0,
        torch.get_num_threads(),
    )
    return out


def _fused_ok(out: torch.Tensor, src_dtype: torch.dtype, biases) -> bool:
    """Whether epkit._C.reduce_rows takes these dtypes (one bias dtype) and layout."""
    bias_dtypes = {b.dtype for b in biases}
    return (
        out.device.type == "cpu"
        and out.is_contiguous()
        and out.dtype in _DTYPE_CODE
        and src_dtype in _DTYPE_CODE
        and len(bias_dtypes) <= 1
        and bias_dtypes <= set(_DTYPE_CODE)
        and all(b.device.type == "cpu" for b in biases)
    )


def _by_address(*tensors: torch.Tensor) -> bool:
    return not PORTABLE[0] and all(t.device.type == "cpu" for t in tensors)


def reduce_indexed(
    out: torch.Tensor,
    sources: list[torch.Tensor],
    src_of: torch.Tensor,
    row_of: torch.Tensor,
    weights: torch.Tensor | None = None,
    biases: list[torch.Tensor] = (),
) -> torch.Tensor:
    """``out[t] = cast(sum_k (w[t, k] *) sources[src_of[t, k]][row_of[t, k]] + sum biases)``, float32, k ascending.

    Parameters
    ----------
    out : Tensor [T, H] (bf16 / fp32 / fp16), written in place
    sources : list of Tensor [n_s, H], one dtype, rows contiguous
    src_of, row_of : Tensor [T, K] int64; ``src_of < 0`` means no row (the term is skipped)
    weights : Tensor [T, K] float32, optional
    biases : up to two Tensor [T, H], added after the sum in order

    CPU rows of bf16/float32 are read in place by ``epkit._C.reduce_rows``; other dtypes, other devices
    (or ``PORTABLE``) use torch ops with the same rounding (each product rounded, then added), so the
    bits agree.
    """
    t_num, h = out.shape
    if t_num == 0:
        return out
    src_of, row_of = src_of.long(), row_of.long()
    dtype = sources[0].dtype if sources else out.dtype
    if _by_address(out, *sources) and _fused_ok(out, dtype, biases):
        if sources:
            es = sources[0].element_size()
            bases = torch.tensor([src.data_ptr() for src in sources], dtype=torch.int64)
            strides = torch.tensor([src.stride(0) * es for src in sources], dtype=torch.int64)
            sel = src_of.clamp(min=0)
            addrs = torch.where(src_of >= 0, bases[sel] + row_of * strides[sel], 0)
        else:
            addrs = torch.zeros((t_num, 0), dtype=torch.int64)
        return reduce_rows(out, addrs, dtype, weights, biases)
    dev = out.device
    acc = torch.zeros((t_num, h), dtype=torch.float32, device=dev)
    src_of_d, row_of_d = src_of.to(dev), row_of.to(dev)
    w_d = weights.float().to(dev) if weights is not None else None
    for k in range(src_of.shape[1]):  # k ascending: the order the fused reduction adds in
        for s, src in enumerate(sources):
            sel = (src_of_d[:, k] == s).nonzero().flatten()
            if sel.numel() == 0:
                continue
            rows = src.index_select(0, row_of_d[sel, k].to(src.device)).to(dev).float()
            if w_d is not None:
                rows = w_d[sel, k].unsqueeze(1) * rows
            acc.index_add_(0, sel, rows)  # one row per (t, k): a plain, ordered add
    for b in biases:
        acc += b.to(dev).float()
    return out.copy_(acc.to(out.dtype))


def _copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for 2-D byte tensors with contiguous rows of equal size.

    One multi-threaded memcpy per row in ``epkit._C`` (torch's index_copy_ moves uint8 rows element
    by element); indices are checked against both shapes first.
    """
    n = dst_rows.numel()
    if n == 0:
        return
    if not _by_address(dst, src):  # device memory (or PORTABLE): the same copy in torch ops
        dst.index_copy_(0, dst_rows.long().to(dst.device), src.index_select(0, src_rows.long().to(src.device)))
        return
    if dst.dtype != torch.uint8 or src.dtype != torch.uint8:
        raise ValueError("_copy_rows: byte (uint8) tensors only")
    if src_rows.numel() != n or dst.shape[1] != src.shape[1] or dst.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError("_copy_rows: row lists and row sizes must match, rows contiguous")
    dst_rows, src_rows = dst_rows.long(), src_rows.long()
    if int(dst_rows.min()) < 0 or int(dst_rows.max()) >= dst.shape[0]:
        raise IndexError(f"_copy_rows: destination rows outside [0, {dst.shape[0]})")
    if int(src_rows.min()) < 0 or int(src_rows.max()) >= src.shape[0]:
        raise IndexError(f"_copy_rows: source rows outside [0, {src.shape[0]})")
    from epkit import _C

    dst_addrs = (dst.data_ptr() + dst_rows * dst.stride(0)).contiguous()
    src_addrs = (src.data_ptr() + src_rows * src.stride(0)).contiguous()
    _C.copy_rows_by_address(dst_addrs.data_ptr(), src_addrs.data_ptr(), n, dst.shape[1], torch.get_num_threads())


def move_rows(
    dst_addrs: torch.Tensor,
    src_addrs: torch.Tensor,
    row_bytes: int,
    bases: list[int],
    guard: torch.Tensor | None = None,
) -> None:
    """Row i: copy ``row_bytes`` from address ``src_addrs[i]`` to ``dst_addrs[i]``; a 0 on either side skips it.

    The lists have a fixed length (routing-independent), so callers build them with tensor ops and
    never read them on the host. ``bases``: every base address and offset the addresses were formed
    from (their common alignment picks the word width). CPU lists go to ``epkit._C`` (multi-threaded
    memcpy); device lists (or ``PORTABLE``) to the Triton kernel, which on CPU runs in the interpreter.
    ``guard`` (a ``[1]`` int64 word on the lists' device, see ``Exchange.guard``): copy nothing if it is
    nonzero when the copy runs (in stream order on a GPU; on CPU, where ops run in call order, when called).
    """
    if dst_addrs.numel() == 0 or row_bytes == 0:
        return
    if guard is not None and guard.device != dst_addrs.device:
        raise ValueError(f"the guard word is on {guard.device}, the address lists on {dst_addrs.device}")
    if _by_address(dst_addrs, src_addrs):
        from epkit import _C

        d, s = dst_addrs.contiguous(), src_addrs.contiguous()
        g = 0 if guard is None else guard.data_ptr()  # read by the copy itself, as the kernel does
        _C.copy_rows_by_address(d.data_ptr(), s.data_ptr(), d.numel(), row_bytes, torch.get_num_threads(), g)
        return
    from epkit.kernels.triton.copy_rows import copy_rows_by_address, word_bytes_for

    word = word_bytes_for(row_bytes, *bases)
    copy_rows_by_address(dst_addrs.reshape(-1), src_addrs.reshape(-1), row_bytes, word, guard)


def reduce_gathered(
    table: torch.Tensor, src_of: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``sum_k w[t, k] * table[src_of[t, k], row_of[t, k]]`` in float32, k ascending; ``src_of < 0`` skips the term.

    Fixed-shape tensor ops only (no host reads), the arithmetic of :func:`reduce_indexed`: each product
    rounded to float32, then added to an accumulator that starts at +0, so the bits agree with it.

    table : Tensor [S, R, H] (any float dtype); src_of, row_of : Tensor [T, K] int64; weights [T, K] float32.
    Returns Tensor [T, H] float32.
    """
    t_num, k_num = src_of.shape
    acc = torch.zeros((t_num, table.shape[2]), dtype=torch.float32, device=table.device)
    live = src_of >= 0
    s, r = src_of.clamp(min=0), row_of.clamp(min=0)
    for k in range(k_num):
        term = weights[:, k, None].float() * table[s[:, k], r[:, k]].float()
        acc += torch.where(live[:, k, None], term, 0.0)
    return acc


def _check_biases(bias, num_tokens: int, hidden: int) -> list[torch.Tensor]:
    """``bias`` as a list of at most two ``[num_tokens, hidden]`` tensors (the fused reduction reads T*H of each)."""
    biases = [] if bias is None else list(bias) if isinstance(bias, (tuple, list)) else [bias]
    if len(biases) > 2:
        raise ValueError(f"at most two bias tensors, got {len(biases)}")
    for b in biases:
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (num_tokens, hidden):
            raise ValueError(f"bias must be [{num_tokens}, {hidden}], got {tuple(getattr(b, 'shape', ()))}")
    return biases
