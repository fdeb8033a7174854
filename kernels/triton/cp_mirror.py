"""Triton ``prepare_cp_mirror``: the zigzag CP index math, one program per sequence.

Inputs are per-sequence prefix sums computed on the host (first query token,
query length, cached prefix, first mirror slot, first compressed key per
ratio); every per-token index is computed here. All sizes are runtime
arguments, so one compiled kernel serves every batch.
``python bench/kernel_check.py cp_mirror --backend triton`` checks it against the
reference and times it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from epkit.kernels.triton.launch import launch, launcher

BLOCK = 256


@triton.jit
def _prepare_cp_mirror_kernel(
    q_start_ptr,
    q_len_ptr,
    prefix_ptr,
    mirror_off_ptr,
    key_start_ptr,
    ratios_ptr,
    index_ptr,
    reverse_ptr,
    ks_ptr,
    ke_ptr,
    cp_size,
    cp_rank,
    mirror_len,
    num_ratios,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    first = tl.load(q_start_ptr + b)
    sq = tl.load(q_len_ptr + b)
    pre = tl.load(prefix_ptr + b)
    off = tl.load(mirror_off_ptr + b)
    # Every operand is non-negative, so Triton's truncating division equals floor division.
    ps = (sq + 2 * cp_size - 1) // (2 * cp_size)
    lanes = tl.arange(0, BLOCK)
    # Mirror slots: half 0 holds block cp_rank, half 1 block 2*cp_size-1-cp_rank; slot j of a half holds
    # position ps*blk + j of the sequence, or padding past its end.
    for half in range(2):
        blk = cp_rank + half * (2 * cp_size - 1 - 2 * cp_rank)
        for j0 in range(0, ps, BLOCK):
            j = j0 + lanes
            live = j < ps
            pos = ps * blk + j
            valid = live & (pos < sq)
            slot = off + half * ps + j
            tl.store(index_ptr + slot, tl.where(valid, first + pos, -1), mask=live)
            for r in range(num_ratios):
                k0 = tl.load(key_start_ptr + b * num_ratios + r)
                ratio = tl.load(ratios_ptr + r)
                seen = (pre + pos + 1) // ratio
                tl.store(ks_ptr + r * mirror_len + slot, k0 + 0 * slot, mask=live)
                tl.store(ke_ptr + r * mirror_len + slot, k0 + tl.where(valid, seen, 0), mask=live)
    # Reverse index: block blk lands at owner * cp_mirror_len + mirror_off + second * ps in the rank-major
    # gathered buffer (owner = blk, second = 0 for blk < cp_size; else 2*cp_size-1-blk and 1).
    for blk in range(2 * cp_size):
        second = blk // cp_size
        owner = blk + second * (2 * cp_size - 1 - 2 * blk)
        base = owner * mirror_len + off + second * ps
        for j0 in range(0, ps, BLOCK):
            j = j0 + lanes
            live = (j < ps) & (ps * blk + j < sq)
            tl.store(reverse_ptr + first + ps * blk + j, base + j, mask=live)


@launcher
def prepare_cp_mirror_launch(
    q_start, q_len, prefix, mirror_off, key_start, ratios, cp_size, cp_rank, index, reverse, ks, ke
) -> None:
    """Fill ``index [L]``, ``reverse [TQ]``, ``ks`` / ``ke [R, L]`` (int32) from the per-sequence inputs."""
    num_seqs = q_len.numel()
    if num_seqs == 0 or index.numel() == 0:
        return
    launch(
        _prepare_cp_mirror_kernel,
        (num_seqs,),
        index.device,
        q_start,
        q_len,
        prefix,
        mirror_off,
        key_start,
        ratios,
        index,
        reverse,
        ks,
        ke,
        cp_size,
        cp_rank,
        index.numel(),
        ratios.numel(),
        BLOCK=BLOCK,
    )
