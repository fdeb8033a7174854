"""The CPU path of ``epkit.engram.engram_hash`` (backend ``cpu``): a division-free floor-mod in vectorised torch.

``float_mod_table`` also feeds the TileLang C kernel (``kernels/tilelang/engram.py``), which
uses the same split-residue scheme.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["float_mod_table", "engram_hash_cpu"]

_CHUNK_BITS = 21
_CHUNK_MASK = (1 << _CHUNK_BITS) - 1
#: Adding then subtracting 1.5 * 2**52 rounds a float64 of magnitude < 2**51 to the nearest integer.
_ROUND_MAGIC = 1.5 * 2.0**52


def float_mod_table(vocab_sizes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-head constants of the division-free floor-mod used by the CPU kernels.

    For a wrapped int64 ``x`` split into 21-bit chunks ``x = a2 * 2**42 + a1 * 2**21 + a0``
    (``a2 = x >> 42`` signed, ``a1, a0`` in ``[0, 2**21)``) and a head size ``2 <= d < 2**31``::

        y = a2 * c42 + (a1 * c21 + a0)        c21 = 2**21 mod d, c42 = 2**42 mod d, both in (-d/2, d/2]
        q = round(y * (1/d))                  (add then subtract 1.5 * 2**52)
        r = y - q * d;  r += d if r < 0       ->  r = x mod d (numpy's floor-mod)

    Every product and sum is an integer below ``2**53`` in magnitude (``|a2 * c42|``,
    ``|a1 * c21| <= 2**51``), so ``y`` (``== x mod d``) and ``r`` are exact in float64, fused
    multiply-adds or not. ``|y / d| < 2**22``, so the float quotient is within ``2**-30``
    of ``y / d`` and rounds to ``floor(y / d)`` or one above: ``r`` is in ``(-d, d)``
    before the correction.

    Parameters
    ----------
    vocab_sizes : Tensor [L, N-1, K], int32
    offsets : Tensor [L, (N-1)*K], int32

    Returns
    -------
    Tensor [L, 6, H], float64, ``H = (N-1)*K``
        Rows ``c21, c42, 1/d, d, offset, 1.5 * 2**52`` of every head.
    """
    num_layers = vocab_sizes.shape[0]
    d = vocab_sizes.reshape(num_layers, -1).to(torch.int64)
    c21 = (1 << _CHUNK_BITS) % d
    c42 = (1 << (2 * _CHUNK_BITS)) % d
    c21 = torch.where(c21 > d // 2, c21 - d, c21)
    c42 = torch.where(c42 > d // 2, c42 - d, c42)
    df = d.to(torch.float64)
    rows = [c21.to(torch.float64), c42.to(torch.float64), 1.0 / df, df, offsets.to(torch.float64)]
    rows.append(torch.full_like(df, _ROUND_MAGIC))
    return torch.stack(rows, dim=1).contiguous()


@functools.cache
def _cpu_pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="epkit-engram")


def engram_hash_cpu(ids, mult, vocab, off, out, chunk: int = 1 << 11) -> None:
    """Vectorised torch, the division-free floor-mod of :func:`float_mod_table` (int64 wraps).

    Work arrays are ``[N-1, K, chunk]`` (tokens innermost): long inner loops, yet below torch's
    intra-op grain size, so each op runs inline; token ranges go to ``torch.get_num_threads()``
    threads instead (torch ops release the GIL).
    """
    num_layers, orders, heads = vocab.shape
    table = float_mod_table(vocab, off).view(num_layers, 6, orders, heads, 1)
    magic = torch.tensor(_ROUND_MAGIC, dtype=torch.float64)

    def run(begin: int, end: int) -> None:
        for s in range(begin, end, chunk):
            e = min(s + chunk, end)
            x = ids[s:e].to(torch.int64).T
            for layer in range(num_layers):
                c21, c42, inv, d, o, _ = table[layer].unbind(0)  # each [N-1, K, 1]
                mix = x[0] * mult[layer, 0]
                mixes = []
                for k in range(1, orders + 1):
                    mix = mix ^ (x[k] * mult[layer, k])
                    mixes.append(mix)
                m = torch.stack(mixes)[:, None, :]  # [N-1, 1, n]: every order's mix
                a2 = (m >> (2 * _CHUNK_BITS)).to(torch.float64)
                a1 = ((m >> _CHUNK_BITS) & _CHUNK_MASK).to(torch.float64)
                a0 = (m & _CHUNK_MASK).to(torch.float64)
                y = torch.addcmul(a0, c21, a1).addcmul_(c42, a2)  # [N-1, K, n], exact: == mix (mod d)
                q = torch.addcmul(magic, y, inv).sub_(magic)  # round(y / d)
                r = y.addcmul_(q, d, value=-1)  # exact, in (-d, d)
                r += torch.where(r < 0, d + o, o)
                out[layer, s:e] = r.view(orders * heads, e - s).T  # exact integers -> int32

    num_tokens = ids.shape[0]
    workers = max(1, min(torch.get_num_threads(), num_tokens // (4 * chunk)))
    if workers == 1:
        run(0, num_tokens)
        return
    step = -(-num_tokens // workers)
    step = -(-step // chunk) * chunk
    futures = [_cpu_pool(workers).submit(run, s, min(s + step, num_tokens)) for s in range(0, num_tokens, step)]
    for f in futures:
        f.result()
