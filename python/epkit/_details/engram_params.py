"""The Engram hash ABI's parameters in numpy, and the small checks and tables built on them.

:func:`hash_params_np` computes, once per :class:`epkit.engram.EngramConfig`, the multipliers,
the distinct prime head sizes and the row offsets (the ABI is in :mod:`epkit.engram`'s module
docstring); ``epkit.engram.hash_params`` returns tensor copies, ``epkit.engram_layer`` sizes its
tables from them. :func:`check_ids` is the id-range check both modules raise with;
:func:`kernel_tables` the per-head tables the GPU kernels read; :func:`validate_hash_args` and
:func:`check_hash_values` the static and the value checks of ``engram_hash``'s arguments.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from epkit.engram import EngramConfig

__all__ = [
    "INT32_MAX",
    "INT64_MAX",
    "is_prime",
    "hash_params_np",
    "check_ids",
    "kernel_tables",
    "validate_hash_args",
    "check_hash_values",
]

INT64_MAX = int(np.iinfo(np.int64).max)
INT32_MAX = int(np.iinfo(np.int32).max)
_LAYER_SEED_STRIDE = 10007


@functools.lru_cache(maxsize=4096)
def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for n < 3.3e24); cached, every call validates the head sizes."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _next_unused_prime(start: int, taken: set[int]) -> int:
    cand = start + 1
    while not (is_prime(cand) and cand not in taken):
        cand += 1
    return cand


@functools.cache
def hash_params_np(config: EngramConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(multipliers int64 [L, N], vocab_sizes int32 [L, N-1, K], offsets int32 [L, (N-1)*K])``, cached per config.

    The cached arrays are shared: callers copy before handing them out. Raises ValueError when a
    layer's total rows overflow int32 row ids.
    """
    n, k = config.max_ngram_size, config.n_head_per_ngram
    half_bound = max(1, (INT64_MAX // config.vocab_size) // 2)
    mult = np.empty((config.num_layers, n), dtype=np.int64)
    for li, layer_id in enumerate(config.layer_ids):
        rng = np.random.default_rng(config.seed + _LAYER_SEED_STRIDE * layer_id)
        mult[li] = rng.integers(0, half_bound, n, dtype=np.int64) * 2 + 1
    taken: set[int] = set()
    vocab = np.empty((config.num_layers, n - 1, k), dtype=np.int64)
    for li in range(config.num_layers):
        for order in range(2, n + 1):
            start = config.ngram_vocab_sizes[order - 2] - 1
            for j in range(k):
                start = _next_unused_prime(start, taken)
                taken.add(start)
                vocab[li, order - 2, j] = start
    flat = vocab.reshape(config.num_layers, -1)
    totals = flat.sum(axis=1)
    if int(totals.max()) > INT32_MAX + 1:
        li = int(totals.argmax())
        raise ValueError(
            f"Engram layer {config.layer_ids[li]} has {int(totals[li])} table rows, which overflows int32 row ids "
            f"(at most {INT32_MAX + 1}); lower ngram_vocab_sizes {config.ngram_vocab_sizes} or n_head_per_ngram"
        )
    offsets = np.cumsum(flat, axis=1) - flat
    return mult, vocab.astype(np.int32), offsets.astype(np.int32)


def check_ids(name: str, t: torch.Tensor, upper: int, what: str) -> None:
    """Raise ValueError naming the first entry of ``t`` outside ``[0, upper)`` (``what`` says what the range is)."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        pos = int((t.reshape(-1) == bad).nonzero()[0])
        raise ValueError(f"{name}[{pos}] = {bad} is outside [0, {upper}) ({what})")


def kernel_tables(vocab_sizes: torch.Tensor, offsets: torch.Tensor):
    """The per-head tables the GPU kernels read, from validated ``vocab_sizes [L, N-1, K]`` and ``offsets
    [L, H]`` int32: ``(vocab int64 [L, H], 1/vocab float64 [L, H], offsets int64 [L, H])``, contiguous."""
    vocab64 = vocab_sizes.reshape(vocab_sizes.shape[0], -1).to(torch.int64).contiguous()
    return vocab64, 1.0 / vocab64.to(torch.float64), offsets.to(torch.int64).contiguous()


def validate_hash_args(ids, mult, vocab, off, out) -> None:
    """The static checks of ``engram_hash``'s arguments (types, dtypes, shapes, devices; no value is read)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.int32 or ids.shape[1] < 2:
        raise ValueError(
            f"ngram_token_ids must be an int32 tensor [T, N] with N >= 2, got "
            f"{getattr(ids, 'dtype', type(ids).__name__)} of shape {tuple(getattr(ids, 'shape', ()))}"
        )
    n = ids.shape[1]
    if not isinstance(mult, torch.Tensor) or mult.dtype != torch.int64 or mult.dim() != 2:
        raise ValueError(
            f"multipliers must be int64 [L, N], got {getattr(mult, 'dtype', None)} {tuple(getattr(mult, 'shape', ()))}"
        )
    if mult.shape[1] != n:  # the parameters fix N (max_ngram_size); the ids are what the caller built
        raise ValueError(
            f"ngram_token_ids has N = {n} columns, but the hash parameters are for N = {mult.shape[1]} "
            f"(multipliers {tuple(mult.shape)}, max_ngram_size of the EngramConfig): ngram_token_ids must be "
            f"[T, {mult.shape[1]}], got {tuple(ids.shape)}"
        )
    num_layers = mult.shape[0]
    if (
        not isinstance(vocab, torch.Tensor)
        or vocab.dtype != torch.int32
        or vocab.dim() != 3
        or tuple(vocab.shape[:2]) != (num_layers, n - 1)
        or vocab.shape[2] < 1
    ):
        raise ValueError(
            f"vocab_sizes must be int32 [{num_layers}, {n - 1}, K>=1], got "
            f"{getattr(vocab, 'dtype', None)} {tuple(getattr(vocab, 'shape', ()))}"
        )
    num_heads = (n - 1) * vocab.shape[2]
    if not isinstance(off, torch.Tensor) or off.dtype != torch.int32 or tuple(off.shape) != (num_layers, num_heads):
        raise ValueError(
            f"offsets must be int32 [{num_layers}, {num_heads}], got "
            f"{getattr(off, 'dtype', None)} {tuple(getattr(off, 'shape', ()))}"
        )
    for name, t in (("multipliers", mult), ("vocab_sizes", vocab), ("offsets", off)):
        if t.device != ids.device:
            raise ValueError(f"{name} is on {t.device} but ngram_token_ids is on {ids.device}")
    if out is not None:
        want = (num_layers, ids.shape[0], num_heads)
        if tuple(out.shape) != want or out.dtype != torch.int32 or out.device != ids.device or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous int32 tensor {want} on {ids.device}, got {out.dtype} "
                f"{tuple(out.shape)} on {out.device}"
            )


def check_hash_values(vocab: torch.Tensor, off: torch.Tensor) -> None:
    """Head sizes distinct primes, offsets non-negative and within int32 row ids (reads both on the host)."""
    num_layers, num_heads = off.shape
    sizes = vocab.reshape(-1).tolist()
    seen: dict[int, int] = {}
    for i, d in enumerate(sizes):
        if not is_prime(d):
            raise ValueError(f"vocab_sizes.flatten()[{i}] = {d} is not a prime (head table sizes must be primes)")
        if d in seen:
            raise ValueError(
                f"vocab_sizes.flatten()[{i}] = {d} repeats vocab_sizes.flatten()[{seen[d]}] "
                "(head sizes must be distinct)"
            )
        seen[d] = i
    last = off.to(torch.int64) + vocab.reshape(num_layers, num_heads).to(torch.int64)
    if num_layers and num_heads:
        if int(off.min()) < 0:
            i = int((off.reshape(-1) < 0).nonzero()[0])
            raise ValueError(f"offsets.flatten()[{i}] = {int(off.reshape(-1)[i])} is negative")
        if int(last.max()) > INT32_MAX + 1:
            i = int(last.reshape(-1).argmax())
            raise ValueError(
                f"offsets.flatten()[{i}] + vocab size = {int(last.reshape(-1)[i])} rows overflows int32 row ids "
                f"(at most {INT32_MAX + 1})"
            )
