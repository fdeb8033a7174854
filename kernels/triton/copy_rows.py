"""Triton row copy by address: row i moves ``row_bytes`` from ``src_addrs[i]`` to ``dst_addrs[i]``.

The address lists have a fixed length and a 0 on either side marks a row to skip, so a
caller can describe a routing-dependent set of row moves (into several peers' symmetric
buffers at once) without knowing on the host how many rows are live: the low-latency
dispatch/combine of :class:`~epkit.collectives.ep_buffer.EPBuffer` builds these lists with
fixed-shape tensor ops and never reads them back. Skipped rows cost one address load.

Rows move as integer words of ``word_bytes`` (8/4/2/1; every address and ``row_bytes`` must
be a multiple of it), so the copy is bit-exact for any dtype. An optional ``guard`` word (the
buffer's sticky word, set on the stream by a failed stream-ordered wait) turns the whole copy
into a no-op when it is nonzero as the kernel runs: writes queued behind a wait that timed out
do not land in a peer's region it may still be reading. On CPU tensors the same kernel
runs under the Triton interpreter (the addresses are host addresses then).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epkit.kernels.triton.launch import launch, launcher

__all__ = ["copy_rows_by_address", "word_bytes_for"]


@triton.jit
def _copy_rows_kernel(
    dst_addr_ptr,
    src_addr_ptr,
    guard_ptr,
    N,
    W,
    HAS_GUARD: tl.constexpr,
    WORD_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_w = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    in_range = rows < N
    if HAS_GUARD:  # one word, loaded per row so that the mask keeps the block's shape
        in_range = in_range & (tl.load(guard_ptr + rows * 0, volatile=True) == 0)
    d = tl.load(dst_addr_ptr + rows, mask=in_range, other=0)
    s = tl.load(src_addr_ptr + rows, mask=in_range, other=0)
    live = in_range & (d != 0) & (s != 0)
    mask = live[:, None] & (cols < W)[None, :]
    if WORD_BYTES == 8:
        word = tl.int64
    elif WORD_BYTES == 4:
        word = tl.int32
    elif WORD_BYTES == 2:
        word = tl.int16
    else:
        word = tl.int8
    sp = s.to(tl.pointer_type(word))
    dp = d.to(tl.pointer_type(word))
    vals = tl.load(sp[:, None] + cols[None, :], mask=mask)
    tl.store(dp[:, None] + cols[None, :], vals, mask=mask)


def word_bytes_for(row_bytes: int, *base_addrs: int) -> int:
    """The widest word (8/4/2/1 bytes) dividing ``row_bytes`` and every base address."""
    for word in (8, 4, 2, 1):
        if row_bytes % word == 0 and all(a % word == 0 for a in base_addrs):
            return word
    return 1


def _blocks(num_words: int) -> tuple[int, int]:
    block_w = min(256, triton.next_power_of_2(max(num_words, 1)))
    return max(1, 2048 // block_w), block_w


@launcher
def copy_rows_by_address(
    dst_addrs: torch.Tensor,
    src_addrs: torch.Tensor,
    row_bytes: int,
    word_bytes: int,
    guard: torch.Tensor | None = None,
) -> None:
    """Launch the copy.

    Parameters
    ----------
    dst_addrs, src_addrs : Tensor [N] int64 on the device that can reach the addresses (CUDA, or CPU
        for the interpreter); 0 marks a skipped row.
    row_bytes : int
        Bytes per row, a multiple of ``word_bytes``.
    word_bytes : int
        1, 2, 4 or 8: the width of each load/store; every row address must be aligned to it.
    guard : Tensor [1] int64 on the lists' device, optional
        Nothing is copied if it is nonzero when the kernel runs (read in stream order).
    """
    if word_bytes not in (1, 2, 4, 8) or row_bytes % word_bytes:
        raise ValueError(f"row_bytes ({row_bytes}) must be a multiple of word_bytes ({word_bytes}) in (1, 2, 4, 8)")
    if dst_addrs.dtype != torch.int64 or src_addrs.dtype != torch.int64 or dst_addrs.shape != src_addrs.shape:
        raise ValueError("dst_addrs and src_addrs must be int64 tensors of one shape")
    n, w = dst_addrs.numel(), row_bytes // word_bytes
    if n == 0 or w == 0:
        return
    if guard is not None and (guard.dtype != torch.int64 or guard.device != dst_addrs.device or guard.numel() < 1):
        raise ValueError(f"guard must be an int64 tensor on {dst_addrs.device}, got {guard.dtype} on {guard.device}")
    block_m, block_w = _blocks(w)
    grid = (triton.cdiv(n, block_m), triton.cdiv(w, block_w))
    # on the lists' device's current stream, where the caller's waits are ordered
    launch(
        _copy_rows_kernel,
        grid,
        dst_addrs.device,
        dst_addrs.contiguous(),
        src_addrs.contiguous(),
        dst_addrs if guard is None else guard,  # not read without a guard
        n,
        w,
        HAS_GUARD=guard is not None,
        WORD_BYTES=word_bytes,
        BLOCK_M=block_m,
        BLOCK_W=block_w,
    )
