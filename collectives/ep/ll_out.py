"""The tensors EPBuffer's low-latency calls write into: the caller's (``out=``), checked, or the buffer's pool.

A decode step's receive tensor is large (``[num_local_experts, W * N, hidden]``: 470 MB of bf16 at DeepSeek-V3's
sizes on 2 ranks), so a fresh one per call costs more than the exchange. The pool (a dict the buffer keeps, keyed by
shape, dtype and device) hands out tensors over memory it keeps, and reuses that memory only once nothing outside
the pool references it: no tensor, view or storage object over it (see :func:`take`). A result the caller still
holds is therefore never written again; one it dropped is written by the next call of that shape. Fresh memory is
zeroed, as the buffer's receive tensors always were; rows a call does not write hold zeros or an earlier call's
rows (unspecified, as in DeepEP).

On CUDA a block is reused only on the stream that got it (and a graph capture's only by that capture): stream
order puts the next write after every use queued on that stream. A result read by work on another stream must
stay referenced until that work is done; the pool does not see ``record_stream``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

import torch

__all__ = [
    "KEEP",
    "LLOut",
    "LLRows",
    "Pool",
    "take",
    "dispatch_outputs",
    "check_dispatch_out",
    "combine_output",
    "check_combine_out",
]

#: Storages kept per (shape, dtype, device): two results in flight at once (two-batch overlap), as DeepEP's
#: double buffer allows; a call that finds both held gets memory the pool does not keep.
KEEP = 2

#: A pool entry: ``[tensor, its storage object, (use count, Python references) when the pool took it]``.
_Entry = list[Any]
#: The pool: entries per key (:func:`_key`).
Pool = dict[tuple[object, ...], list[_Entry]]
#: Low-latency dispatch's receive tensors: ``x`` (bf16), or ``(x e4m3, scales float32)`` with FP8.
LLRows = torch.Tensor | tuple[torch.Tensor, ...]
#: What a caller may pass as a low-latency call's ``out=`` (checked: :func:`check_dispatch_out`).
LLOut = torch.Tensor | Sequence[torch.Tensor] | None


def _counts(entry: _Entry) -> tuple[int, int]:
    """``(use count, Python references)`` of the storage of a pool entry ``[tensor, storage object, counts]``."""
    storage = entry[1]
    return torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)


def _key(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[object, ...]:
    """A pool entry's key: besides shape, dtype and device, the CUDA stream and whether it is capturing a graph
    (memory is reused only in stream order, and a graph's memory only by that capture), and inference mode (an
    inference tensor cannot be written outside it)."""
    stream = capturing = None
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device).stream_id
        capturing = torch.cuda.is_current_stream_capturing()
    return shape, dtype, device, stream, capturing, torch.is_inference_mode_enabled()


def take(pool: Pool, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous ``shape`` tensor over pooled memory no one else references, or over fresh zeroed memory.

    The pool keeps a tensor and its storage object per memory block and hands out ``detach()``-ed aliases of the
    tensor (no ``_base`` leads back to it). A block is unused when its storage's use count and its storage object's
    references are what they were when the pool took it: every other tensor or view over the memory holds a use
    count (``torch._C._storage_Use_Count``, which torch's CUDA graph trees read the same way), and a storage has
    one Python object (what ``untyped_storage()`` returns), whose references count the rest. Launches nothing
    (no device op) but the zeroing of fresh memory."""
    shape = tuple(shape)
    entries = pool.setdefault(_key(shape, dtype, torch.device(device)), [])
    for entry in entries:
        if _counts(entry) == entry[2]:
            return cast(torch.Tensor, entry[0]).detach()
    fresh = torch.zeros(shape, dtype=dtype, device=device)
    if len(entries) >= KEEP:
        return fresh
    entry = [fresh, fresh.untyped_storage(), None]
    entry[2] = _counts(entry)  # the pool's own references
    entries.append(entry)
    return fresh.detach()


def _dispatch_shapes(
    num_local: int, slots: int, hidden: int, use_fp8: bool
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``[(shape, dtype)]`` of the received rows (and with ``use_fp8`` their float32 per-128 scales)."""
    x = ((num_local, slots, hidden), torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    return [x, ((num_local, slots, -(-hidden // 128)), torch.float32)] if use_fp8 else [x]


def _describe(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype} {tuple(v.shape)} on {v.device}"
    return "None" if v is None else f"a {type(v).__name__}"


def _check(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape or t.device != device:
        raise ValueError(f"{name} must be {dtype} {shape} on {device}, got {_describe(t)}")
    if not t.is_contiguous():  # the rows are written by address
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_dispatch_out(
    out: LLOut, num_local: int, slots: int, hidden: int, use_fp8: bool, device: torch.device
) -> None:
    """``ValueError`` unless ``out`` is None, or the receive tensor(s) ``low_latency_dispatch`` returns: bf16
    ``[num_local, slots, hidden]``, or with ``use_fp8`` a tuple ``(x e4m3, scales float32)``; contiguous, on
    ``device``."""
    if out is None:
        return
    shapes = _dispatch_shapes(num_local, slots, hidden, use_fp8)
    if use_fp8 and (not isinstance(out, (tuple, list)) or len(out) != 2):
        want = ", ".join(f"{dtype} {shape}" for shape, dtype in shapes)
        raise ValueError(f"out must be a tuple (x, scales) with use_fp8: {want} on {device}, got {_describe(out)}")
    parts, names = (list(out), ["out[0]", "out[1]"]) if use_fp8 else ([out], ["out"])
    for name, t, (shape, dtype) in zip(names, parts, shapes):
        _check(name, t, shape, dtype, device)


def dispatch_outputs(
    pool: Pool, out: LLOut, num_local: int, slots: int, hidden: int, use_fp8: bool, device: torch.device
) -> tuple[LLRows, torch.Tensor]:
    """``(recv_x, recv_count)`` of a low-latency dispatch: ``out`` (checked by :func:`check_dispatch_out`) or pooled
    receive tensors, and a pooled ``[num_local]`` int32 count."""
    shapes = _dispatch_shapes(num_local, slots, hidden, use_fp8)
    parts = (
        [take(pool, s, dtype, device) for s, dtype in shapes]
        if out is None
        else list(out)
        if use_fp8
        else [cast(torch.Tensor, out)]
    )
    recv_x = tuple(parts) if use_fp8 else parts[0]
    return recv_x, take(pool, (num_local,), torch.int32, device)


def check_combine_out(out: object, num_tokens: int, hidden: int, device: torch.device) -> None:
    """``ValueError`` unless ``out`` is None or a contiguous bf16 ``[num_tokens, hidden]`` tensor on ``device``."""
    if out is not None:
        _check("out", out, (num_tokens, hidden), torch.bfloat16, device)


def combine_output(
    pool: Pool, out: torch.Tensor | None, num_tokens: int, n_max: int, hidden: int, device: torch.device
) -> torch.Tensor:
    """A low-latency combine's result tensor: ``out`` (checked by :func:`check_combine_out`), or the first
    ``num_tokens`` rows of a pooled bf16 ``[n_max, hidden]`` (one pool entry whatever the step's token count)."""
    if out is not None:
        return out
    return take(pool, (n_max, hidden), torch.bfloat16, device)[:num_tokens]
