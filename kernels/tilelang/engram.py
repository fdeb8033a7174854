"""TileLang Engram n-gram hash: ``out[l, t, h] = (XOR_{k' <= k} ids[t, k'] * mult[l, k']) mod vocab[l, h] + off[l, h]``.

One factory, :func:`engram_hash_func`, serves both dialects; head ``h`` belongs to
order ``k = h // K + 1``. The modulo is numpy's floor-mod of a wrapped int64 by a
positive divisor ``d < 2**31``, computed without integer division and bit-exact
whatever the rounding of the float steps:

* CPU (C target): the split-residue scheme of :func:`epkit._details.engram_cpu.float_mod_table`
  (``y = a2 * (2**42 mod d) + a1 * (2**21 mod d) + a0`` exact in float64, one
  rounded quotient, one sign correction). Per block of tokens the ids are read
  once for every layer, the 21-bit chunks of each order's mix are computed over the
  block (a loop the compiler vectorises), and each token's heads are one vector
  loop; the 64-byte output rows go out with non-temporal stores where the compiler
  targets AVX-512 (the row buffer is copied with ``memcpy`` otherwise).
* CUDA: one token per thread, ``x mod d`` by two ``q = trunc(x * (1/d))`` steps in
  float64 followed by exact corrections.

``python bench/kernel_check.py engram --backend tilelang`` checks it against the
reference and times it.
"""

import functools
import hashlib
import os
import platform

import torch

from epkit.kernels.tilelang.build import build_cuda, language, run_rows_parallel

# -march=native: the kernel is JIT-compiled on the machine that runs it (int64 <-> float64
# conversions vectorise with AVX-512DQ); on x86 the head loop is one 8-lane float64 vector.
_C_FLAGS = ["-O3", "-march=native", "-fwrapv"]
if platform.machine().lower() in ("x86_64", "amd64"):
    _C_FLAGS.append("-mprefer-vector-width=512")
_PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True}

# Row store helpers the CPU kernel reaches through T.call_extern (TileLang emits a matching
# `extern "C" void* name(int32_t*, int32_t*)` declaration, so the definitions use that signature).
_ROW_STORE_HEADER = r"""#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
/* Copy one 64-byte row (16 int32) to dst, bypassing the cache when dst is 64-byte aligned. */
extern "C" inline void* epkit_store_row64(int32_t* dst, int32_t* src) {
#if defined(__AVX512F__)
  if ((((uintptr_t)dst) & 63) == 0) {
    _mm512_stream_si512((__m512i*)dst, _mm512_loadu_si512((const void*)src));
    return 0;
  }
#endif
  memcpy(dst, src, 64);
  return 0;
}
/* Order the non-temporal stores before the kernel returns. */
extern "C" inline void* epkit_store_fence() {
#if defined(__AVX512F__)
  _mm_sfence();
#endif
  return 0;
}
"""

#: Lanes of one non-temporal row store (int32).
ROW = 16


@functools.cache
def _row_store_header() -> str:
    """Path of the row-store header, written once into TileLang's per-user cache directory.

    The name carries a hash of the content, so the compile flags (part of TileLang's kernel
    cache key) stay the same from one process to the next.
    """
    from tilelang import env

    digest = hashlib.sha256(_ROW_STORE_HEADER.encode()).hexdigest()[:16]
    folder = os.path.join(env.TILELANG_CACHE_DIR, "epkit")
    path = os.path.join(folder, f"engram_row_store-{digest}.h")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(_ROW_STORE_HEADER)
        os.replace(tmp, path)
    return path


def _cpu_func(num_layers: int, ngram: int, heads: int, block: int):
    """The C-target prim_func (see :func:`engram_hash_func`).

    One function although it runs past 80 lines: TileLang traces the kernel from this Python body,
    and the buffers it allocates (ids, chunks, the row buffer) are shared by every step, so the
    steps cannot be separate Python functions without passing each buffer through a macro.
    """
    T, _ = language("cpu")
    num_tokens = T.dynamic("num_tokens")
    num_ids = T.dynamic("num_ids")
    orders = ngram - 1
    num_heads = orders * heads
    row_stores = num_heads % ROW == 0
    mask21 = (1 << 21) - 1

    @T.prim_func
    def engram_hash_kernel(
        ids: T.Tensor((num_ids,), "int32"),
        mult: T.Tensor((num_layers, ngram), "int64"),
        table: T.Tensor((num_layers, 6, num_heads), "float64"),
        out: T.Tensor((num_layers, num_tokens, num_heads), "int32"),
        begin: T.int32,
        end: T.int32,
    ):
        with T.Kernel(T.ceildiv(end - begin, block)) as bx:
            raw = T.alloc_local((block * ngram,), "int32")
            x = T.alloc_local((ngram * block,), "int64")
            mix = T.alloc_local((block,), "int64")
            a0 = T.alloc_local((orders * block,), "float64")
            a1 = T.alloc_local((orders * block,), "float64")
            a2 = T.alloc_local((orders * block,), "float64")
            q = T.alloc_local((heads,), "float64")
            r = T.alloc_local((heads,), "float64")
            res = T.alloc_local((num_heads,), "float64")
            row = T.alloc_local((num_heads,), "int32")
            t0 = begin + bx * block
            # The block's ids, read once for all layers: a contiguous copy (clamped in the last block).
            if t0 + block <= end:
                for m in T.serial(block * ngram):
                    raw[m] = ids[t0 * ngram + m]
            else:
                for m in T.serial(block * ngram):
                    raw[m] = ids[T.min(t0 * ngram + m, end * ngram - 1)]
            for k in T.serial(ngram):
                for i in T.serial(block):
                    x[k * block + i] = T.Cast("int64", raw[i * ngram + k])
            for l in T.serial(num_layers):
                # Mix of each order, split into 21-bit chunks: a2 signed (bits 42..63), a1, a0 unsigned.
                for i in T.serial(block):
                    mix[i] = x[i] * mult[l, 0]
                for k in T.serial(orders):
                    for i in T.serial(block):
                        mix[i] = mix[i] ^ (x[(k + 1) * block + i] * mult[l, k + 1])
                        a2[k * block + i] = T.Cast("float64", mix[i] >> 42)
                        a1[k * block + i] = T.Cast("float64", (mix[i] >> 21) & mask21)
                        a0[k * block + i] = T.Cast("float64", mix[i] & mask21)
                for i in T.serial(block):
                    if t0 + i < end:
                        for k in T.serial(orders):
                            for j in T.serial(heads):
                                h = k * heads + j
                                # table rows: 0 = 2**21 mod d, 1 = 2**42 mod d (both in (-d/2, d/2]),
                                # 2 = 1/d, 3 = d, 4 = offset, 5 = 1.5 * 2**52 (round-to-integer constant).
                                c = k * block + i
                                y = a2[c] * table[l, 1, h] + (a1[c] * table[l, 0, h] + a0[c])
                                q[j] = y * table[l, 2, h] + table[l, 5, h]
                                r[j] = y - (q[j] - table[l, 5, h]) * table[l, 3, h]
                                res[h] = r[j] + table[l, 4, h] + T.if_then_else(r[j] < 0, table[l, 3, h], T.float64(0))
                        if row_stores:
                            for h in T.serial(num_heads):
                                row[h] = T.Cast("int32", res[h])
                            for c in T.serial(num_heads // ROW):
                                T.evaluate(
                                    T.call_extern(
                                        "handle",
                                        "epkit_store_row64",
                                        T.address_of(out[l, t0 + i, c * ROW]),
                                        T.address_of(row[c * ROW]),
                                    )
                                )
                        else:
                            for h in T.serial(num_heads):
                                out[l, t0 + i, h] = T.Cast("int32", res[h])
            if row_stores:  # noqa: SIM102 (a Python-level switch around a kernel condition)
                if bx == T.ceildiv(end - begin, block) - 1:
                    T.evaluate(T.call_extern("handle", "epkit_store_fence"))

    return engram_hash_kernel


def _cuda_func(num_layers: int, ngram: int, heads: int):
    T, kernel_kw = language("cuda")
    num_tokens = T.dynamic("num_tokens")
    num_heads = (ngram - 1) * heads
    block = kernel_kw["threads"]

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
            for i in T.Parallel(block):
                t = begin + bx * block + i
                mix = T.alloc_local((1,), "int64")
                r = T.alloc_local((1,), "int64")
                if t < end:
                    for l in T.serial(num_layers):
                        mix[0] = T.Cast("int64", ids[t, 0]) * mult[l, 0]
                        for k in T.serial(ngram - 1):
                            mix[0] = mix[0] ^ (T.Cast("int64", ids[t, k + 1]) * mult[l, k + 1])
                            for j in T.serial(heads):
                                h = k * heads + j
                                d = vocab[l, h]
                                inv_d = inv[l, h]
                                # numpy's floor-mod of the wrapped int64 mix by 2 <= d < 2**31, no division:
                                # q = trunc(x * (1/d)) in float64 is off the true quotient by fewer than
                                # 2**12 / d + 1, so step 1 leaves |r| < 2**32 (exact in float64), step 2
                                # leaves r in (-2d, 2d) and three exact corrections give [0, d). Every
                                # intermediate is exact or corrected: the result does not depend on rounding.
                                # One statement per step (a single nested expression repeats each step's
                                # input and makes TileLang's lowering take about a minute).
                                r[0] = mix[0] - T.Cast("int64", T.Cast("float64", mix[0]) * inv_d) * d
                                r[0] = r[0] - T.Cast("int64", T.Cast("float64", r[0]) * inv_d) * d
                                r[0] = r[0] + T.if_then_else(r[0] < 0, d, T.int64(0))
                                r[0] = r[0] + T.if_then_else(r[0] < 0, d, T.int64(0))
                                r[0] = r[0] - T.if_then_else(r[0] >= d, d, T.int64(0))
                                out[l, t, h] = T.Cast("int32", r[0] + off[l, h])

    return engram_hash_kernel


def engram_hash_func(num_layers: int, ngram: int, heads: int, dialect: str = "cpu", block_tokens: int = 64):
    """The prim_func of the hash for ``dialect``; it covers tokens ``[begin, end)`` (``end <= T``).

    * ``"cpu"``: ``(ids [T*N] int32 (row-major [T, N] flattened), mult [L, N] int64,
      table [L, 6, H] float64 (:func:`epkit._details.engram_cpu.float_mod_table`), out [L, T, H] int32,
      begin, end)``; ``block_tokens`` tokens per grid step (the C target runs the grid as a
      loop; :func:`engram_hash_tokens_cpu` splits ``[0, T)`` across threads).
    * ``"cuda"``: ``(ids [T, N] int32, mult [L, N] int64, vocab [L, H] int64, inv [L, H]
      float64 (``1/vocab``), off [L, H] int64, out [L, T, H] int32, begin, end)``; one token
      per thread.

    ``H = (N - 1) * heads`` and ``T`` is a runtime size.
    """
    if dialect == "cpu":
        return _cpu_func(num_layers, ngram, heads, block_tokens)
    if dialect == "cuda":
        return _cuda_func(num_layers, ngram, heads)
    raise ValueError(f"unknown TileLang dialect {dialect!r}; expected 'cpu' or 'cuda'")


@functools.cache
def _kernel(num_layers: int, ngram: int, heads: int, device_type: str):
    import tilelang

    if device_type == "cpu":
        func = engram_hash_func(num_layers, ngram, heads, "cpu")
        # The kernel's own `t < end` guard keeps every access in bounds (end <= T, checked by the
        # launcher), so TileLang's per-access bounds checks, which block vectorisation, are off.
        flags = [*_C_FLAGS, "-include", _row_store_header()]
        return tilelang.compile(func, target="c", compile_flags=flags, pass_configs=_PASS_CONFIGS)
    return build_cuda(engram_hash_func(num_layers, ngram, heads, "cuda"))


def engram_hash_tokens_cpu(ids: torch.Tensor, mult: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> None:
    """Launch on validated, contiguous CPU tensors: ``ids [T, N] int32``, ``mult [L, N] int64``,
    ``table [L, 6, H] float64`` (:func:`epkit._details.engram_cpu.float_mod_table`), ``out [L, T, H] int32``.

    Token ranges are split across ``torch.get_num_threads()`` threads (the call releases the GIL).
    """
    num_layers, num_tokens, num_heads = out.shape
    ngram = ids.shape[1]
    if num_tokens == 0 or num_layers == 0 or num_heads == 0:
        return
    kernel = _kernel(num_layers, ngram, num_heads // (ngram - 1), "cpu")
    flat = ids.view(-1)
    run_rows_parallel(kernel, num_tokens, lambda k, s, e: k(flat, mult, table, out, s, e), min_rows_per_thread=4096)


def engram_hash_tokens(ids, mult, vocab, inv, off, out) -> None:
    """Launch the CUDA kernel on validated, contiguous GPU tensors: ``ids [T, N] int32``,
    ``mult [L, N] int64``, ``vocab / off [L, H] int64``, ``inv [L, H] float64``, ``out [L, T, H] int32``."""
    num_layers, num_tokens, num_heads = out.shape
    ngram = ids.shape[1]
    if num_tokens == 0 or num_layers == 0 or num_heads == 0:
        return
    if ids.device.type == "cpu":
        raise ValueError("engram_hash_tokens launches the CUDA kernel; use engram_hash_tokens_cpu for CPU tensors")
    kernel = _kernel(num_layers, ngram, num_heads // (ngram - 1), ids.device.type)
    kernel(ids, mult, vocab, inv, off, out, 0, num_tokens)
