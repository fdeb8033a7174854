"""Row-level helpers of the dispatch/combine protocol (EPBuffer, fused_moe): message layout constants,
the fused row reduction and row copies by address (``epkit._C``), and small shape helpers.

Rows in CPU memory go through ``epkit._C`` by address (no staging copies). Rows anywhere else
(CUDA views of nvshmem buffers), or all rows when a caller passes ``portable=True`` (an EPBuffer made with
``portable=True``: how the tests run the device formulations on CPU), take the same arithmetic in torch ops and
the Triton copy kernel: bitwise the same results.
"""

from __future__ import annotations

import collections
import ctypes
import math
from collections.abc import Sequence
from typing import TypeVar

import torch

from epkit.collectives.transports.base import rank_name

__all__ = [
    "Bias",
    "FIELD_ALIGN",
    "META_MSG",
    "ROW_DTYPES",
    "RowPool",
    "align_up",
    "by_address",
    "check_biases",
    "check_formats",
    "copy_rows_by_address",
    "decode_error",
    "device_table",
    "encode_error",
    "expanded_layout",
    "format_code",
    "leased_bytes",
    "rank_name",
    "sum_by_source",
    "sum_indexed_rows",
    "sum_rows_by_address",
    "sum_table_rows",
]

#: Bytes of error text a rejected call sends its peers (in the layout exchange, headers, publish areas).
META_MSG = 192
#: Byte alignment of the fields inside a message.
FIELD_ALIGN = 16
#: Row dtypes dispatch moves, in the order of the format codes its layout exchange carries.
ROW_DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn)
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
#: What combine takes as ``bias``: a ``[T, hidden]`` tensor, up to two of them, or None.
Bias = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor] | None


def check_formats(formats: list[int], global_ranks: Sequence[int], rows: str = "dispatch rows (x)") -> None:
    """Every rank sees every rank's row format (word 0 of the layout messages, or the handle agreement's), so every
    rank raises alike; ``rows`` names the rows in the message."""
    if len(set(formats)) != 1:
        names = [
            f"{rank_name(r, global_ranks)}: {ROW_DTYPES[(f - 1) // 2]}{' + FP8 scales' if (f - 1) % 2 else ''}"
            for r, f in enumerate(formats)
        ]
        raise ValueError(f"{rows} differ in format across ranks (" + "; ".join(names) + ")")


def row_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t [R, C]`` as ``[R, C * itemsize]`` uint8 rows (contiguous); an empty ``t`` of any strides too (torch keeps
    a broadcast stride of 0 on an empty tensor, which ``view`` to bytes refuses)."""
    rows, width = t.shape[0], t.shape[1] * t.element_size()
    if t.numel() == 0:
        return torch.empty((rows, width), dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8).view(rows, width)


def format_code(dtype: torch.dtype, has_scales: bool) -> int:
    """The row format code a dispatch's layout message carries (word 0): ``1 + 2 * dtype index + scales``."""
    return 1 + 2 * ROW_DTYPES.index(dtype) + int(has_scales)


_Size = TypeVar("_Size", int, torch.Tensor)


def align_up(n: _Size, a: int = FIELD_ALIGN) -> _Size:
    """``n`` rounded up to a multiple of ``a`` (elementwise for a tensor)."""
    return -(-n // a) * a


def device_table(cache: dict[tuple[int, ...], torch.Tensor], values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, cached in ``cache`` by value: the regions of a buffer do
    not move, so the upload (non-blocking, from pinned memory) happens once and no call reads the host."""
    key = tuple(values)
    table = cache.get(key)
    if table is None:
        host = torch.tensor(values, dtype=torch.int64)
        table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        if len(cache) >= 64:
            cache.clear()
        cache[key] = table
    return table


def encode_error(text: str) -> torch.Tensor:
    """``text`` as the ``[META_MSG]`` uint8 field a rejected call sends its peers (UTF-8, cut to fit, NUL-padded)."""
    raw = text.encode()[: META_MSG - 1]
    out = torch.zeros(META_MSG, dtype=torch.uint8)
    if raw:
        out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def decode_error(field: torch.Tensor) -> str:
    """The text of an :func:`encode_error` field (any device; read on the host)."""
    return bytes(field[:META_MSG].tolist()).rstrip(b"\0").decode(errors="replace")


def sum_rows_by_address(
    out: torch.Tensor,
    addrs: torch.Tensor,
    src_dtype: torch.dtype,
    weights: torch.Tensor | None = None,
    biases: Sequence[torch.Tensor] = (),
    groups: list[int] | None = None,
) -> torch.Tensor:
    """``out[t] = cast(sum_k (w[t, k] *) row(addrs[t, k]) + sum biases)`` in float32, k ascending.

    ``addrs [T, K]`` int64 holds row addresses (0: no row) of ``src_dtype`` rows of
    ``out.shape[1]`` elements in CPU memory; ``epkit._C.reduce_rows`` reads them in place
    (multi-threaded). bf16 / float32 rows, output and biases (:func:`sum_indexed_rows` takes the
    other dtypes and devices). ``groups``: see :func:`sum_indexed_rows`.
    """
    t_num, h = out.shape
    if t_num == 0:
        return out
    if not _fused_ok(out, src_dtype, biases):
        raise ValueError(
            f"sum_rows_by_address: bf16/float32 contiguous CPU output and rows only (out {out.dtype}, "
            f"rows {src_dtype}, biases {[b.dtype for b in biases]}); use sum_indexed_rows"
        )
    from epkit import _C

    k = addrs.shape[1] if addrs.dim() == 2 else 0
    addrs = addrs.contiguous()
    w = weights.float().contiguous() if weights is not None else None
    bs = [b.contiguous() for b in biases]
    ends = _group_ends(groups, k)
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
        ends.data_ptr() if ends is not None else 0,
    )
    return out


def _group_ends(groups: list[int] | None, k: int) -> torch.Tensor | None:
    """``[K]`` uint8, 1 where a group ends, from the group sizes (None: no groups)."""
    if groups is None:
        return None
    if sum(groups) != k or any(g < 1 for g in groups):
        raise ValueError(f"groups {list(groups)} must be sizes >= 1 that add up to the {k} terms")
    ends = torch.zeros(k, dtype=torch.uint8)
    ends[torch.tensor(groups, dtype=torch.int64).cumsum(0) - 1] = 1
    return ends


def _fused_ok(out: torch.Tensor, src_dtype: torch.dtype, biases: Sequence[torch.Tensor]) -> bool:
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


def by_address(*tensors: torch.Tensor, portable: bool = False) -> bool:
    """Whether rows in these tensors move and sum through ``epkit._C`` by address: CPU memory, unless ``portable``
    asks for the formulations device rows take."""
    return not portable and all(t.device.type == "cpu" for t in tensors)


def sum_indexed_rows(
    out: torch.Tensor,
    sources: list[torch.Tensor],
    src_of: torch.Tensor,
    row_of: torch.Tensor,
    weights: torch.Tensor | None = None,
    biases: Sequence[torch.Tensor] = (),
    groups: list[int] | None = None,
    portable: bool = False,
) -> torch.Tensor:
    """``out[t] = cast(sum_k (w[t, k] *) sources[src_of[t, k]][row_of[t, k]] + sum biases)``, float32, k ascending.

    With ``groups`` (sizes of consecutive runs of k, adding up to K) the sum is two-level: each group's terms
    summed as above and cast to ``out.dtype`` (a partial of that dtype), then the partials of the groups with a
    row added in group order in float32, then the biases, cast: the hierarchy's two-level combine without the
    partials in memory.

    Parameters
    ----------
    out : Tensor [T, H] (bf16 / fp32 / fp16), written in place
    sources : list of Tensor [n_s, H], one dtype, rows contiguous
    src_of, row_of : Tensor [T, K] int64; ``src_of < 0`` means no row (the term is skipped)
    weights : Tensor [T, K] float32, optional
    biases : up to two Tensor [T, H], added after the sum in order
    groups : list of int, optional

    CPU rows of bf16/float32 are read in place by ``epkit._C.reduce_rows``; other dtypes, other devices
    (or ``portable``) use torch ops with the same rounding (each product rounded, then added), so the
    bits agree.
    """
    t_num, h = out.shape
    if t_num == 0:
        return out
    src_of, row_of = src_of.long(), row_of.long()
    dtype = sources[0].dtype if sources else out.dtype
    if by_address(out, *sources, portable=portable) and _fused_ok(out, dtype, biases):
        if sources:
            es = sources[0].element_size()
            bases = torch.tensor([src.data_ptr() for src in sources], dtype=torch.int64)
            strides = torch.tensor([src.stride(0) * es for src in sources], dtype=torch.int64)
            sel = src_of.clamp(min=0)
            addrs = torch.where(src_of >= 0, bases[sel] + row_of * strides[sel], 0)
        else:
            addrs = torch.zeros((t_num, 0), dtype=torch.int64)
        return sum_rows_by_address(out, addrs, dtype, weights, biases, groups)
    dev = out.device
    ends = _group_ends(groups, src_of.shape[1])
    acc = torch.zeros((t_num, h), dtype=torch.float32, device=dev)
    total = torch.zeros_like(acc) if ends is not None else None
    src_of_d, row_of_d = src_of.to(dev), row_of.to(dev)
    w_d = weights.float().to(dev) if weights is not None else None
    start = 0
    for k in range(src_of.shape[1]):  # k ascending: the order the fused reduction adds in
        for s, src in enumerate(sources):
            sel = (src_of_d[:, k] == s).nonzero().flatten()
            if sel.numel() == 0:
                continue
            rows = src.index_select(0, row_of_d[sel, k].to(src.device)).to(dev).float()
            if w_d is not None:
                rows = w_d[sel, k].unsqueeze(1) * rows
            acc.index_add_(0, sel, rows)  # one row per (t, k): a plain, ordered add
        if ends is not None and ends[k]:  # the group's partial, in out's dtype, joins the groups' sum
            assert total is not None  # made whenever ends is
            had = (src_of_d[:, start : k + 1] >= 0).any(1).nonzero().flatten()
            total.index_add_(0, had, acc[had].to(out.dtype).float())
            acc.zero_()
            start = k + 1
    if total is not None:
        acc = total
    for b in biases:
        acc += b.to(dev).float()
    return out.copy_(acc.to(out.dtype))


def copy_rows_by_address(
    dst_addrs: torch.Tensor,
    src_addrs: torch.Tensor,
    row_bytes: int,
    bases: list[int],
    guard: torch.Tensor | None = None,
    portable: bool = False,
) -> None:
    """Row i: copy ``row_bytes`` from address ``src_addrs[i]`` to ``dst_addrs[i]``; a 0 on either side skips it.
    (The one entry for both backends, named as they are: ``epkit._C.copy_rows_by_address`` and the Triton launcher
    ``epkit.kernels.triton.copy_rows.copy_rows_by_address``.)

    The lists have a fixed length (routing-independent), so callers build them with tensor ops and
    never read them on the host. ``bases``: every base address and offset the addresses were formed
    from (their common alignment picks the word width). CPU lists go to ``epkit._C`` (multi-threaded
    memcpy); device lists (or ``portable``) to the Triton kernel, which on CPU runs in the interpreter.
    ``guard`` (a ``[1]`` int64 word on the lists' device, see ``Exchange.guard``): copy nothing if it is
    nonzero when the copy runs (in stream order on a GPU; on CPU, where ops run in call order, when called).
    """
    if dst_addrs.numel() == 0 or row_bytes == 0:
        return
    if guard is not None and guard.device != dst_addrs.device:
        raise ValueError(f"the guard word is on {guard.device}, the address lists on {dst_addrs.device}")
    if by_address(dst_addrs, src_addrs, portable=portable):
        from epkit import _C

        d, s = dst_addrs.contiguous(), src_addrs.contiguous()
        g = 0 if guard is None else guard.data_ptr()  # read by the copy itself, as the kernel does
        _C.copy_rows_by_address(d.data_ptr(), s.data_ptr(), d.numel(), row_bytes, torch.get_num_threads(), g)
        return
    from epkit.kernels.triton import copy_rows as triton_copy  # its launcher has this function's name

    word = triton_copy.word_bytes_for(row_bytes, *bases)
    triton_copy.copy_rows_by_address(dst_addrs.reshape(-1), src_addrs.reshape(-1), row_bytes, word, guard)


def sum_table_rows(
    table: torch.Tensor, src_of: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``sum_k w[t, k] * table[src_of[t, k], row_of[t, k]]`` in float32, k ascending; ``src_of < 0`` skips the term.

    Fixed-shape tensor ops only (no host reads), the arithmetic of :func:`sum_indexed_rows`: each product
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


def check_biases(bias: Bias, num_tokens: int, hidden: int) -> list[torch.Tensor]:
    """``bias`` as a list of at most two ``[num_tokens, hidden]`` tensors (the fused reduction reads T*H of each)."""
    biases = [] if bias is None else list(bias) if isinstance(bias, (tuple, list)) else [bias]
    if len(biases) > 2:
        raise ValueError(f"at most two bias tensors, got {len(biases)}")
    for b in biases:
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (num_tokens, hidden):
            raise ValueError(f"bias must be [{num_tokens}, {hidden}], got {tuple(getattr(b, 'shape', ()))}")
    return biases


def expanded_layout(recv_idx: torch.Tensor, counts: torch.Tensor, alignment: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows per (received token, local expert), grouped by expert then received order, groups padded with -1.

    Parameters
    ----------
    recv_idx : Tensor [R, K] int
        Local expert id per received row and slot, -1 where the expert lives elsewhere.
    counts : Tensor [L] int64
        Valid entries of ``recv_idx`` per local expert.
    alignment : int
        Each expert's group is padded to a multiple of this.

    Returns
    -------
    rows : Tensor [X] int64
        The received row of each expanded row, -1 on padding.
    slot : Tensor [R, K] int64
        The expanded row of each (received row, k), -1 where not local.
    """
    r, k = recv_idx.shape
    num_local = counts.numel()
    flat = recv_idx.long().reshape(-1)
    sel = (flat >= 0).nonzero().flatten()  # (j, k) pairs in (j, k) order
    order = torch.sort(flat[sel], stable=True).indices
    pairs = sel[order]  # grouped by expert, within by received row
    sizes = counts.tolist()
    padded = [-(-c // alignment) * alignment for c in sizes]
    starts = torch.tensor([0] + padded[:-1], dtype=torch.int64).cumsum(0) if num_local else torch.zeros(0)
    rows = torch.full((sum(padded),), -1, dtype=torch.int64)
    slot = torch.full((r * k,), -1, dtype=torch.int64)
    pos_in_group = torch.arange(pairs.numel()) - torch.repeat_interleave(
        torch.tensor([0] + sizes[:-1], dtype=torch.int64).cumsum(0), torch.tensor(sizes)
    )
    dest = starts[flat[pairs]] + pos_in_group
    rows[dest] = pairs // k
    slot[pairs] = dest
    return rows, slot.view(r, k)


class RowPool:
    """Host memory for the row tensors that dispatch and combine return, recycled once no tensor uses it.

    The first write to a fresh multi-MiB tensor takes a page fault per 4 KiB page (on a virtual machine that
    costs several times the copy itself). :meth:`empty` hands out views of blocks this pool keeps: a block goes
    back to the pool when the last tensor or view of it is freed (the tensor owns a ctypes array whose lease
    returns the block), so the next call of a similar size writes into pages already mapped. Nothing a caller
    still holds is ever reused. Requests under ``MIN_BYTES`` are plain ``torch.empty``; at most ``max_free``
    blocks wait in the pool (their memory stays this process's until the pool is dropped).
    """

    MIN_BYTES = 1 << 20

    def __init__(self, max_free: int = 4):
        self.max_free = max_free
        self._free: list[torch.Tensor] = []  # uint8 blocks no tensor uses (touched by empty() only)
        # Blocks given back and not yet sorted into _free: a lease may be freed on another thread (gloo's, when
        # it drops the last tensor it sent from) or by the garbage collector in the middle of empty(); appending
        # to a deque is atomic, so empty() alone edits _free.
        self._returned: collections.deque[torch.Tensor] = collections.deque()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` (like ``torch.empty``)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0 or nbytes < self.MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        self._take_returned()
        fit = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= 2 * nbytes]
        if fit:
            block = self._free.pop(min(fit, key=lambda i: self._free[i].numel()))
        else:  # an eighth more than asked: the next call's routing may need a few more rows
            block = torch.empty(align_up(nbytes + nbytes // 8, 1 << 16), dtype=torch.uint8)
        if block.numel() < nbytes:
            raise AssertionError(f"RowPool: a block of {block.numel()} bytes for {nbytes}")
        return leased_bytes(block.data_ptr(), nbytes, _Lease(self, block)).view(dtype).view(shape)

    def give_back(self, block: torch.Tensor) -> None:
        """A block no tensor uses any more (called by its lease, from any thread): kept for the next :meth:`empty`."""
        self._returned.append(block)

    def _take_returned(self) -> None:
        """Sort the blocks given back into the free list: at most ``max_free``, the smallest dropped first."""
        while self._returned:
            block = self._returned.popleft()
            if len(self._free) >= self.max_free:
                smallest = min(range(len(self._free)), key=lambda i: self._free[i].numel())
                if self._free[smallest].numel() >= block.numel():
                    continue
                self._free.pop(smallest)
            self._free.append(block)


def leased_bytes(address: int, nbytes: int, lease: object) -> torch.Tensor:
    """``[nbytes]`` uint8 CPU tensor over the memory at ``address`` (``nbytes`` > 0) that holds ``lease`` until the
    last tensor or view over it is freed (it owns a ctypes array, which ``torch.frombuffer`` keeps alive): the
    lease's ``__del__`` says the memory is free again, and any reference it keeps keeps the memory valid."""
    arr = (ctypes.c_uint8 * nbytes).from_address(address)
    arr._epkit_lease = lease  # type: ignore[attr-defined]  # a ctypes array takes any attribute; its stub lists none
    return torch.frombuffer(arr, dtype=torch.uint8)


class _Lease:
    """Returns ``block`` to ``pool`` when the ctypes array over it (and so the last tensor using it) is freed."""

    def __init__(self, pool: RowPool, block: torch.Tensor):
        self.pool, self.block = pool, block

    def __del__(self) -> None:
        self.pool.give_back(self.block)


def sum_by_source(
    out: torch.Tensor,
    sources: list[torch.Tensor],
    send_tokens: list[torch.Tensor],
    biases: Sequence[torch.Tensor] = (),
    portable: bool = False,
) -> torch.Tensor:
    """Combine's source side: ``out[t] = cast(sum_r sources[r][i] + sum biases)`` in float32, ranks r ascending,
    where ``send_tokens[r][i] == t`` (a token that went nowhere gets the biases only, or zeros).

    ``out [T, H]``; ``sources[r] [len(send_tokens[r]), H]`` (rows contiguous, one dtype): what rank r sent
    back for the tokens this rank sent it; ``send_tokens[r]`` int64 token indices. The order of the sum is
    the one ``collectives.ep_reference`` documents. CPU rows are read in place by ``epkit._C.reduce_rows``
    (their addresses built in one pass per rank); other devices take :func:`sum_indexed_rows`'s torch ops.
    """
    t_num, w = out.shape[0], len(sources)
    dtype = sources[0].dtype if sources else out.dtype
    if by_address(out, *sources, portable=portable) and _fused_ok(out, dtype, biases):
        addrs = torch.zeros((t_num, w), dtype=torch.int64)
        for r, (src, t) in enumerate(zip(sources, send_tokens)):
            if t.numel():
                step = src.stride(0) * src.element_size()
                addrs[t, r] = torch.arange(src.data_ptr(), src.data_ptr() + step * t.numel(), step)
        return sum_rows_by_address(out, addrs, dtype, None, biases)
    src_of = torch.full((t_num, w), -1, dtype=torch.int64)
    row_of = torch.zeros((t_num, w), dtype=torch.int64)
    for r, t in enumerate(send_tokens):
        if t.numel():
            src_of[t, r] = r
            row_of[t, r] = torch.arange(t.numel(), dtype=torch.int64)
    return sum_indexed_rows(out, sources, src_of, row_of, None, biases, portable=portable)
