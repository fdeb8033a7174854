"""Row gather with padding: ``out[i] = x[index[i]]``, a zero row where ``index[i] == -1``.

The index gather that several layers share: CP mirror layouts (``to_mirror``),
dispatch staging (tokens into send order), Engram row lookup. Bit-exact on
every backend for every dtype: rows move as integer words, or in their own dtype where ``torch.index_select``
copies them as they are (on the ``cpu`` backend as bytes by ``epkit._C.gather_rows``: on torch's OpenMP workers
(epkit's own thread pool in a forked child, where GNU OpenMP would hang), source rows prefetched, streaming stores
for large outputs; ``torch.index_select`` for one-thread results that fit the caches, and where the extension is
missing). ``torch.ops.epkit.gather_rows``
/ ``gather_rows_out`` (``epkit.ops``) are the op; the index check runs inside it (not during CUDA stream
capture, where an index outside ``[-1, N)`` gives a zero row).
"""

from __future__ import annotations

import functools
import math

import torch

from epkit.backends import ALL_BACKENDS_CPU, ALL_BACKENDS_CUDA, OpSpec, register_op, select
from epkit.ops import custom_op, host_checks

__all__ = ["gather_rows", "gather_rows_reference"]

# Reference


def gather_rows_reference(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Readable specification: one row at a time (slow; for tests)."""
    out = torch.zeros((index.numel(), *x.shape[1:]), dtype=x.dtype, device=x.device)
    for i, src in enumerate(index.tolist()):
        if src >= 0:
            out[i] = x[src]
    return out


# Implementation


def _validate(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise on bad types, dtypes, shapes or devices (static facts: nothing is read from the tensors)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(
            f"x must be a tensor with at least 1 dimension (rows first), got {type(x).__name__} "
            f"of shape {getattr(x, 'shape', None)}"
        )
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index must be a 1-D int32 or int64 tensor, got {index.dtype} of shape {tuple(index.shape)}")
    if index.device != x.device:
        raise ValueError(f"index is on {index.device} but x is on {x.device}")
    if out is not None:
        want = (index.numel(), *x.shape[1:])
        if tuple(out.shape) != want or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(
                f"out must be {x.dtype} of shape {want} on {x.device}, got {out.dtype} "
                f"{tuple(out.shape)} on {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")


def _check_index_values(x: torch.Tensor, index: torch.Tensor, error: type[Exception] = ValueError) -> int | None:
    """Raise ``error`` when an index is outside ``[-1, N)`` (reads ``index`` on the host); returns ``index.min()``,
    or None for an empty index."""
    if index.numel() == 0:
        return None
    lo, hi = (int(v) for v in torch.aminmax(index))
    if lo < -1 or hi >= x.shape[0]:
        bad = lo if lo < -1 else hi
        pos = int((index == bad).nonzero()[0])
        raise error(f"index[{pos}] = {bad} is outside [-1, {x.shape[0]}) (x has {x.shape[0]} rows)")
    return lo


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Dtypes whose rows torch.index_select moves in their own type (a plain element copy, bit for bit): on the CPU
# that is faster than the integer words of _as_words.
_SELECT_DTYPES = frozenset(
    (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8)
)


def _as_words(t: torch.Tensor, rows: int) -> torch.Tensor:
    """View a contiguous tensor as [rows, W] of the widest integer word that fits."""
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    flat = t.reshape(-1).view(torch.uint8)
    for size, dtype in _WORDS.items():
        if row_bytes % size == 0 and t.data_ptr() % size == 0:
            return flat.view(dtype).view(rows, row_bytes // size)
    raise AssertionError("unreachable: 1-byte words always fit")


def gather_rows(
    x: torch.Tensor,
    index: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    check_index: bool = True,
) -> torch.Tensor:
    """Gather rows of ``x`` by ``index``; ``-1`` gives a zero row.

    Parameters
    ----------
    x : Tensor [N, *]
        Any dtype; rows are copied bit for bit.
    index : Tensor [M], int32 or int64
        Source row per output row, in ``[-1, N)``; ``-1`` means padding.
    out : Tensor [M, *], optional
        Preallocated contiguous output of ``x``'s dtype and device.
    backend : str
        ``"auto"`` (default), ``"cpu"``, ``"tilelang"``, ``"triton"`` or ``"reference"``.
    check_index : bool
        Validate index values (one device->host sync on GPU). Default True. During CUDA stream capture
        (where nothing can be read on the host) an index outside ``[-1, N)`` gives a zero row instead.

    Returns
    -------
    Tensor [M, *] with ``out[i] = x[index[i]]`` and zeros where ``index[i] == -1``.

    Examples
    --------
    >>> x = torch.arange(6.).view(3, 2)
    >>> gather_rows(x, torch.tensor([2, -1, 0], dtype=torch.int32))
    tensor([[4., 5.],
            [0., 0.],
            [0., 1.]])
    """
    _validate(x, index, out)
    if _plain_eager_cpu(x, index, out):  # what the op would run, without its ~0.2 ms of Python dispatch
        if out is None:
            out = torch.empty((index.numel(), *x.shape[1:]), dtype=x.dtype)
        else:
            torch.autograd.graph.increment_version(out)  # as the op does for an argument it mutates
        _gather_into(x, index, out, backend, check_index)
        return out
    if out is None:
        return _gather_rows_op(x, index, backend, check_index)
    _gather_rows_out_op(x, index, out, backend, check_index)
    return out


def _plain_eager_cpu(*tensors: torch.Tensor | None) -> bool:
    """Whether a call may run the op's implementation directly rather than through ``torch.ops.epkit``: plain
    CPU tensors that need no grad, and nothing that sees or records ops (torch.compile, a dispatch or torch
    function mode, a functorch transform), so that nothing can tell the two apart. Through torch.library's
    custom op an eager call costs ~0.2 ms of Python, which is the whole cost of a small gather."""
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or t.device.type != "cpu" or t.requires_grad):
            return False
    return not (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
    )


def _gather_into(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor, backend: str, check_index: bool) -> None:
    """The implementation of both ops: ``out[i] = x[index[i]]`` (zeros at -1) on the selected backend."""
    lo = None
    if check_index and host_checks(x.device):
        lo = _check_index_values(x, index)
    elif check_index:  # capturing: no host read; ids outside [-1, N) become padding on the device
        index = torch.where((index >= -1) & (index < x.shape[0]), index, torch.full_like(index, -1))
    impl = select("gather_rows", x.device, backend)
    if impl == "reference":
        out.copy_(gather_rows_reference(x, index))
        return
    m, n = index.numel(), x.shape[0]
    if m == 0 or out.numel() == 0:
        return
    xc = x.contiguous()
    if impl == "cpu" and _gather_extension() is not None and not _index_select_faster(out):
        _gather_c(xc, index.contiguous(), out)
        return
    if impl == "cpu" and lo is None:  # unchecked: a bad index raises IndexError as in the C++ gather; padding below
        lo = _check_index_values(xc, index, IndexError)
    if impl == "cpu" and xc.dtype in _SELECT_DTYPES:  # rows of a dtype index_select copies as they are
        width = math.prod(xc.shape[1:])
        x_words, out_words = xc.view(n, width), out.view(m, width)
    else:
        x_words, out_words = _as_words(xc, n), _as_words(out, m)
    if x_words.dtype != out_words.dtype:  # alignment differs: fall back to the common word
        size = min(x_words.element_size(), out_words.element_size())
        x_words = xc.reshape(-1).view(torch.uint8).view(_WORDS[size]).view(n, -1)
        out_words = out.reshape(-1).view(torch.uint8).view(_WORDS[size]).view(m, -1)
    if impl == "cpu":
        if n == 0:  # every index is -1
            out.zero_()
            return
        if lo is not None and lo >= 0:  # no padding: one pass, no extra index passes
            torch.index_select(x_words, 0, index, out=out_words)
            return
        torch.index_select(x_words, 0, index.clamp(min=0), out=out_words)
        pad = index < 0
        if bool(pad.any()):
            out_words[pad] = 0
        return
    index = index.contiguous()
    if impl == "triton":
        from epkit.kernels.triton.gather import gather_rows_words
    else:
        from epkit.kernels.tilelang.gather import gather_rows_words
    gather_rows_words(x_words, index, out_words)


#: On one thread, output bytes below which ``torch.index_select`` is at least as fast as the C++ gather: a
#: result that fits the caches, where prefetching has nothing to win (measured on 2 cores, quiet: level at 4 MiB,
#: the C++ gather 1.2x ahead at 8 MiB; ``bench/README.md``). On more threads the C++ gather runs at every size
#: (its helpers take chunks of 256 KiB of output).
INDEX_SELECT_BYTES = 8 << 20


def _index_select_faster(out: torch.Tensor) -> bool:
    return torch.get_num_threads() == 1 and out.numel() * out.element_size() < INDEX_SELECT_BYTES


@functools.cache
def _gather_extension():
    """``epkit._C`` when it has the row gather, else None (the cpu backend then uses ``torch.index_select``)."""
    try:
        from epkit import _C
    except ImportError:
        return None
    return _C if hasattr(_C, "gather_rows") else None


def _gather_c(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """The C++ gather (contiguous ``x``, ``index`` and ``out``); an index outside ``[-1, N)`` raises, as
    ``torch.index_select`` does (its row is zeroed)."""
    row_bytes = out.numel() // index.numel() * out.element_size()
    args = (out.data_ptr(), x.data_ptr(), index.data_ptr(), index.element_size(), index.numel(), x.shape[0])
    bad = _gather_extension().gather_rows(*args, row_bytes, torch.get_num_threads())
    if bad >= 0:
        raise IndexError(f"index[{bad}] = {int(index[bad])} is outside [-1, {x.shape[0]}) (x has {x.shape[0]} rows)")


def _fake_gather(x, index, backend, check_index):
    return x.new_empty((index.shape[0], *x.shape[1:]))


@custom_op("gather_rows", _fake_gather)
def _gather_rows_op(x: torch.Tensor, index: torch.Tensor, backend: str, check_index: bool) -> torch.Tensor:
    """``torch.ops.epkit.gather_rows``: :func:`gather_rows` into a new tensor."""
    out = torch.empty((index.numel(), *x.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_into(x, index, out, backend, check_index)
    return out


def _fake_gather_out(x, index, out, backend, check_index):
    return None


@custom_op("gather_rows_out", _fake_gather_out, mutates_args=("out",))
def _gather_rows_out_op(
    x: torch.Tensor, index: torch.Tensor, out: torch.Tensor, backend: str, check_index: bool
) -> None:
    """``torch.ops.epkit.gather_rows_out``: :func:`gather_rows` into ``out`` (written in place)."""
    _gather_into(x, index, out, backend, check_index)


def _selfcheck(backend: str, device: str = "cpu") -> None:
    """``gather_rows[backend]`` on ``device`` against the reference, bit for bit, for 4-, 2- and 1-byte dtypes."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        x = torch.randint(-100, 100, (37, 5, 3), generator=g).to(dtype)
        idx = torch.randint(-1, 37, (53,), generator=g, dtype=torch.int32)
        got = gather_rows(x.to(device), idx.to(device), backend=backend).cpu()
        want = gather_rows_reference(x, idx)
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            raise AssertionError(f"gather_rows[{backend}] differs from the reference for {dtype}")


SPEC = register_op(
    OpSpec(
        "gather_rows", ALL_BACKENDS_CPU, ALL_BACKENDS_CUDA, "out[i] = x[index[i]], zero rows at index -1", _selfcheck
    )
)
