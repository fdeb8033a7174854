"""Triton logical -> physical expert ids: one lane per (token, k) slot of ``topk_idx``.

For ``e = topk_idx[t, k]``: ``-1`` stays ``-1``; else the first replica of ``e``
(in ``log2phy`` order) whose physical expert lives on ``ep_rank``
(``phy // num_local == ep_rank``); else replica ``(t + token_offset) % logcnt[e]``.
The replica scan is a runtime loop over ``log2phy``'s columns, so placements
with any replica count share one compiled kernel.
``python bench/kernel_check.py experts --backend triton`` checks it against the
reference and times it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epkit.kernels.triton.launch import launch, launcher


@triton.jit
def _logical_to_physical_kernel(
    topk_ptr,
    log2phy_ptr,
    logcnt_ptr,
    out_ptr,
    N,
    K,
    R,
    num_local,
    ep_rank,
    token_offset,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < N
    e = tl.load(topk_ptr + offs, mask=in_range, other=-1).to(tl.int64)
    valid = e >= 0
    ec = tl.where(valid, e, 0)
    cnt = tl.load(logcnt_ptr + ec, mask=in_range, other=1).to(tl.int64)
    row = log2phy_ptr + ec * R
    # Remote choice: spread by token index.
    tok = offs // K + token_offset
    rep = tok % cnt
    remote = tl.load(row + rep, mask=in_range, other=-1)
    # Local choice: the first replica on this rank, scanning the replica columns in order.
    local = tl.full([BLOCK], -1, dtype=tl.int32)
    for r in range(0, R):
        phy = tl.load(row + r, mask=in_range, other=-1)
        hit = (local < 0) & (phy >= 0) & (cnt > r) & ((phy // num_local) == ep_rank)
        local = tl.where(hit, phy, local)
    res = tl.where(local >= 0, local, remote)
    res = tl.where(valid, res, -1)
    tl.store(out_ptr + offs, res, mask=in_range)


BLOCK = 1024


@launcher
def logical_to_physical_flat(
    topk: torch.Tensor,
    log2phy: torch.Tensor,
    logcnt: torch.Tensor,
    out: torch.Tensor,
    num_tokens: int,
    top_k: int,
    num_local: int,
    ep_rank: int,
    token_offset: int,
) -> None:
    """Launch on contiguous tensors: ``topk [T*K]`` int32/int64, ``log2phy [E, R]`` int32, ``logcnt [E]`` int32,
    ``out [T*K]`` int32 (written)."""
    n = num_tokens * top_k
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK),)
    launch(
        _logical_to_physical_kernel,
        grid,
        topk.device,
        topk,
        log2phy,
        logcnt,
        out,
        n,
        top_k,
        log2phy.shape[1],
        num_local,
        ep_rank,
        token_offset,
        BLOCK=BLOCK,
    )
