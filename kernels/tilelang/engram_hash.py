"""TileLang Engram n-gram hash: ``out[l, t, h] = (XOR_{k' <= k} ids[t, k'] * mult[l, k']) mod vocab[l, h] + off[l, h]``.

One factory serves both dialects. Head ``h`` belongs to order ``k = h // K + 1``.
The modulo is numpy's floor-mod of a wrapped int64 by a positive divisor
``d < 2**31``, computed without integer division (see :func:`floor_mod`):
two ``q = floor(x * (1/d))`` reduction steps in float64 followed by one exact
correction, so the result is bit-exact on every backend whatever the rounding
of the float steps. Run ``python -m epkit.kernels.tilelang.engram_hash`` to
check it against the reference and time it.
"""

import functools

import torch

from epkit.kernels.tilelang._build import build_cuda, language, run_rows_parallel

# The CPU build adds -march=native so that the per-head loop vectorises
# (int64 <-> float64 conversions need AVX-512DQ); the kernel is JIT-compiled on
# the machine that runs it.
_C_FLAGS = ["-O3", "-march=native", "-fwrapv"]
_PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True}


def _floor_mod(T, x, d, inv_d):
    """numpy's ``x % d`` for any int64 ``x`` (wrapped) and int64 ``2 <= d < 2**31``, without a division.

    ``q = trunc(x * (1/d))`` in float64 is off the true quotient by fewer than
    ``2**12 / d + 1``, so step 1 leaves ``|r| < 2**32`` (exact in float64); step 2
    leaves ``r`` in ``(-2d, 2d)``; three exact corrections give ``[0, d)``. Every
    intermediate is exact or corrected, so the result does not depend on rounding.
    """
    r1 = x - T.Cast("int64", T.Cast("float64", x) * inv_d) * d
    r2 = r1 - T.Cast("int64", T.Cast("float64", r1) * inv_d) * d
    r3 = r2 + T.if_then_else(r2 < 0, d, T.int64(0))
    r4 = r3 + T.if_then_else(r3 < 0, d, T.int64(0))
    return r4 - T.if_then_else(r4 >= d, d, T.int64(0))


def engram_hash_func(num_layers: int, ngram: int, heads: int, dialect: str = "cpu", block_tokens: int = 64):
    """The prim_func over ``ids [T, N] int32``, ``mult [L, N] int64``, ``vocab [L, H] int64``,
    ``inv [L, H] float64`` (``1/vocab``), ``off [L, H] int64`` -> ``out [L, T, H] int32``
    with ``H = (N - 1) * heads``. ``T`` is a runtime size; the kernel covers tokens
    ``[begin, end)`` (the CPU splits that range across threads; ``end <= T``).

    CPU: per block of tokens, each head's modulo runs over the block's tokens (a loop
    the C compiler vectorises), results are staged in a local tile and written out in
    rows. CUDA: one token per thread.
    """
    T, kernel_kw = language(dialect)
    num_tokens = T.dynamic("num_tokens")
    num_heads = (ngram - 1) * heads
    block = block_tokens if dialect == "cpu" else kernel_kw["threads"]

    @T.prim_func
    def engram_hash_kernel(
        ids: T.Tensor((num_tokens, ngram), "int32"),
        mult: T.Tensor((num_layers, ngram), "int64"),
        vocab: T.Tensor((num_layers, num_heads), "int64"),
        inv: T.Tensor((num_layers, num_heads), "float64"),
        off: T.Tensor((num_layers, num_heads), "int64"),
        out: T.Tensor((num_layers, num_tokens, num_heads), "int32"),
        begin: T.int32,
        end: T.int32,
    ):
        with T.Kernel(T.ceildiv(end - begin, block), **kernel_kw) as bx:
            if dialect == "cpu":
                mix = T.alloc_local((block,), "int64")
                r = T.alloc_local((block,), "int64")
                dv = T.alloc_local((1,), "int64")
                ov = T.alloc_local((1,), "int64")
                iv = T.alloc_local((1,), "float64")
                tile = T.alloc_local((block * num_heads,), "int32")
                t0 = begin + bx * block
                for l in T.serial(num_layers):
                    for i in T.serial(block):
                        mix[i] = T.Cast("int64", ids[T.min(t0 + i, end - 1), 0]) * mult[l, 0]
                    for k in T.serial(ngram - 1):
                        for i in T.serial(block):
                            mix[i] = mix[i] ^ (T.Cast("int64", ids[T.min(t0 + i, end - 1), k + 1]) * mult[l, k + 1])
                        for j in T.serial(heads):
                            h = k * heads + j
                            # Divisor in locals and one simple pass per step: each loop vectorises.
                            dv[0] = vocab[l, h]
                            iv[0] = inv[l, h]
                            ov[0] = off[l, h]
                            for i in T.serial(block):
                                r[i] = mix[i] - T.Cast("int64", T.Cast("float64", mix[i]) * iv[0]) * dv[0]
                            for i in T.serial(block):
                                r[i] = r[i] - T.Cast("int64", T.Cast("float64", r[i]) * iv[0]) * dv[0]
                            for i in T.serial(block):
                                r[i] = r[i] + T.if_then_else(r[i] < 0, dv[0], T.int64(0))
                            for i in T.serial(block):
                                r[i] = r[i] + T.if_then_else(r[i] < 0, dv[0], T.int64(0))
                            for i in T.serial(block):
                                r[i] = r[i] - T.if_then_else(r[i] >= dv[0], dv[0], T.int64(0))
                                tile[i * num_heads + h] = T.Cast("int32", r[i] + ov[0])
                    for i in T.serial(block):
                        if t0 + i < end:
                            for h in T.serial(num_heads):
                                out[l, t0 + i, h] = tile[i * num_heads + h]
            else:
                for i in T.Parallel(block):
                    t = begin + bx * block + i
                    mix = T.alloc_local((1,), "int64")
                    if t < end:
                        for l in T.serial(num_layers):
                            mix[0] = T.Cast("int64", ids[t, 0]) * mult[l, 0]
                            for k in T.serial(ngram - 1):
                                mix[0] = mix[0] ^ (T.Cast("int64", ids[t, k + 1]) * mult[l, k + 1])
                                for j in T.serial(heads):
                                    h = k * heads + j
                                    r = _floor_mod(T, mix[0], vocab[l, h], inv[l, h])
                                    out[l, t, h] = T.Cast("int32", r + off[l, h])

    return engram_hash_kernel


@functools.cache
def _kernel(num_layers: int, ngram: int, heads: int, device_type: str):
    import tilelang

    if device_type == "cpu":
        func = engram_hash_func(num_layers, ngram, heads, "cpu")
        # The kernel's own `t < end` guard keeps every access in bounds (end <= T, checked by the
        # launcher), so TileLang's per-access bounds checks, which block vectorisation, are off.
        return tilelang.compile(func, target="c", compile_flags=_C_FLAGS, pass_configs=_PASS_CONFIGS)
    return build_cuda(engram_hash_func(num_layers, ngram, heads, "cuda"))


def engram_hash_tokens(
    ids: torch.Tensor,
    mult: torch.Tensor,
    vocab: torch.Tensor,
    inv: torch.Tensor,
    off: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Launch on validated, contiguous tensors: ``ids [T, N] int32``, ``mult [L, N] int64``,
    ``vocab / off [L, H] int64``, ``inv [L, H] float64``, ``out [L, T, H] int32``."""
    num_layers, num_tokens, num_heads = out.shape
    ngram = ids.shape[1]
    if num_tokens == 0 or num_layers == 0 or num_heads == 0:
        return
    kernel = _kernel(num_layers, ngram, num_heads // (ngram - 1), ids.device.type)
    if ids.device.type != "cpu":
        kernel(ids, mult, vocab, inv, off, out, 0, num_tokens)
        return

    run_rows_parallel(
        kernel, num_tokens, lambda k, s, e: k(ids, mult, vocab, inv, off, out, s, e), min_rows_per_thread=4096
    )


if __name__ == "__main__":
    from epkit.engram import _bench_main

    _bench_main("tilelang")
