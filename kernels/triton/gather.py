"""Triton row gather: ``out[i] = x[index[i]]``, zero rows where ``index[i] == -1``.

Rows are moved as integer words (the widest of 8/4/2/1 bytes that divides the
row), so the copy is bit-exact for every dtype (bf16, fp8, NaN payloads).
``python bench/kernel_check.py gather --backend triton`` checks it against the
reference and times it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epkit.kernels.triton.launch import launch, launcher


@triton.jit
def _gather_rows_kernel(x_ptr, index_ptr, out_ptr, M, W, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_w = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    row_ok = rows < M
    src = tl.load(index_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    col_ok = cols < W
    load_mask = (src >= 0)[:, None] & col_ok[None, :]
    vals = tl.load(x_ptr + src[:, None] * W + cols[None, :], mask=load_mask, other=0)
    store_mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * W + cols[None, :], vals, mask=store_mask)


def block_sizes(num_words: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_W) for a row of ``num_words`` words: 16 rows x up to 256 words."""
    block_w = min(256, triton.next_power_of_2(max(num_words, 1)))
    return max(1, 4096 // block_w), block_w


@launcher
def gather_rows_words(x_words: torch.Tensor, index: torch.Tensor, out_words: torch.Tensor) -> None:
    """Launch on word views: ``x_words [N, W]``, ``index [M]`` int32/int64, ``out_words [M, W]``."""
    m, w = out_words.shape
    if m == 0 or w == 0:
        return
    block_m, block_w = block_sizes(w)
    grid = (triton.cdiv(m, block_m), triton.cdiv(w, block_w))
    launch(_gather_rows_kernel, grid, x_words.device, x_words, index, out_words, m, w, BLOCK_M=block_m, BLOCK_W=block_w)
