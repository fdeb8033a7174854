"""Triton Engram n-gram hash: ``out[l, t, h] = (XOR_{k' <= k} ids[t, k'] * mult[l, k']) mod vocab[l, h] + off[l, h]``.

Head ``h`` belongs to order ``k = h // K + 1``. The modulo is numpy's floor-mod
of a wrapped int64 by ``2 <= d < 2**31`` without integer division: two
``q = trunc(x * (1/d))`` steps in float64 and exact corrections (the same
scheme as the TileLang kernel; see ``epkit.kernels.tilelang.engram``), so
the result is bit-exact whatever the float rounding. One program handles
``BLOCK_T`` tokens of one layer. ``python bench/kernel_check.py engram --backend triton``
checks it against the reference and times it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from epkit.kernels.triton.launch import launch, launcher


@triton.jit
def _engram_hash_kernel(
    ids_ptr,
    mult_ptr,
    vocab_ptr,
    inv_ptr,
    off_ptr,
    out_ptr,
    num_tokens,
    NGRAM: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_t = tl.program_id(0)
    layer = tl.program_id(1)
    num_heads: tl.constexpr = (NGRAM - 1) * HEADS
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    tok64 = tok.to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    j_ok = j < HEADS
    store_mask = tok_ok[:, None] & j_ok[None, :]
    mix = tl.load(ids_ptr + tok64 * NGRAM, mask=tok_ok, other=0).to(tl.int64) * tl.load(mult_ptr + layer * NGRAM)
    out_row = out_ptr + (layer.to(tl.int64) * num_tokens + tok64) * num_heads
    for k in tl.static_range(1, NGRAM):
        ids_k = tl.load(ids_ptr + tok64 * NGRAM + k, mask=tok_ok, other=0).to(tl.int64)
        mix = mix ^ (ids_k * tl.load(mult_ptr + layer * NGRAM + k))
        h = (k - 1) * HEADS + j
        d = tl.load(vocab_ptr + layer * num_heads + h, mask=j_ok, other=2)
        inv_d = tl.load(inv_ptr + layer * num_heads + h, mask=j_ok, other=0.5)
        off = tl.load(off_ptr + layer * num_heads + h, mask=j_ok, other=0)
        # floor-mod without division (inlined: the interpreter twin cannot call nested jit functions)
        x = tl.broadcast_to(mix[:, None], (BLOCK_T, BLOCK_K))
        dd = tl.broadcast_to(d[None, :], (BLOCK_T, BLOCK_K))
        r = x - (x.to(tl.float64) * inv_d[None, :]).to(tl.int64) * dd
        r = r - (r.to(tl.float64) * inv_d[None, :]).to(tl.int64) * dd
        r = tl.where(r < 0, r + dd, r)
        r = tl.where(r < 0, r + dd, r)
        r = tl.where(r >= dd, r - dd, r)
        tl.store(out_row[:, None] + h[None, :], (r + off[None, :]).to(tl.int32), mask=store_mask)


BLOCK_T = 128


@launcher
def engram_hash_tokens(ids, mult, vocab, inv, off, out) -> None:
    """Launch on validated, contiguous tensors: ``ids [T, N] int32``, ``mult [L, N] int64``,
    ``vocab / off [L, H] int64``, ``inv [L, H] float64``, ``out [L, T, H] int32``."""
    num_layers, num_tokens, num_heads = out.shape
    ngram = ids.shape[1]
    if num_tokens == 0 or num_layers == 0 or num_heads == 0:
        return
    heads = num_heads // (ngram - 1)
    grid = (triton.cdiv(num_tokens, BLOCK_T), num_layers)
    launch(
        _engram_hash_kernel,
        grid,
        ids.device,
        ids,
        mult,
        vocab,
        inv,
        off,
        out,
        num_tokens,
        NGRAM=ngram,
        HEADS=heads,
        BLOCK_T=BLOCK_T,
        BLOCK_K=triton.next_power_of_2(heads),
    )
