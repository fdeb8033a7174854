"""The CPU path of ``epkit.engram.engram_hash`` (backend ``cpu``): a division-free floor-mod in C++.

``float_mod_table`` feeds it and the TileLang C kernel (``kernels/tilelang/engram.py``), which
uses the same split-residue scheme; ``checked_mod_table`` gives both their table with the value checks of the
head sizes and offsets done once per distinct set of hash parameters (they are a handful of fixed tensors per
model, and checking them and building the table cost several times the C++ hash of a few thousand tokens).
"""

from __future__ import annotations

import functools

import torch

from epkit._details.engram_params import check_hash_values

__all__ = ["checked_mod_table", "float_mod_table", "engram_hash_cpu"]

_CHUNK_BITS = 21
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


_TABLES: dict[tuple, torch.Tensor] = {}
#: Distinct hash parameter sets remembered by :func:`checked_mod_table` (then it starts over).
_MAX_TABLES = 64


def checked_mod_table(vocab_sizes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """:func:`check_hash_values` then :func:`float_mod_table` of CPU tensors, remembered by their values.

    The key is the tensors' shapes and bytes, so a changed tensor is checked again; only parameters that
    passed the checks are remembered. ``vocab_sizes [L, N-1, K]``, ``offsets [L, H]`` int32 on the CPU;
    returns the ``[L, 6, H]`` float64 table (shared between calls: read it, never write it).
    """
    key = (tuple(vocab_sizes.shape), vocab_sizes.numpy().tobytes(), offsets.numpy().tobytes())
    table = _TABLES.get(key)
    if table is None:
        check_hash_values(vocab_sizes, offsets)
        table = float_mod_table(vocab_sizes, offsets)
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        _TABLES[key] = table
    return table


@functools.cache
def _hash_extension():
    """``epkit._C`` when it has the C++ hash, else None."""
    try:
        from epkit import _C
    except ImportError:
        return None
    return _C if hasattr(_C, "engram_hash") else None


def engram_hash_cpu(ids, mult, table, out) -> bool:
    """The C++ hash (``epkit._C.engram_hash``: the division-free floor-mod of :func:`float_mod_table`'s
    ``table``, heads vectorised, token ranges over ``torch.get_num_threads()`` threads) into contiguous int32
    ``out``.

    Returns False, writing nothing, when ``epkit._C`` lacks it (the caller then runs the reference: no CPU path
    slower than the reference is offered).
    """
    ext = _hash_extension()
    if ext is None:
        return False
    ids, mult = ids.contiguous(), mult.contiguous()
    num_layers, heads = table.shape[0], table.shape[2]
    args = (out.data_ptr(), ids.data_ptr(), mult.data_ptr(), table.data_ptr(), ids.shape[0], ids.shape[1])
    ext.engram_hash(*args, heads, num_layers, _CHUNK_BITS, torch.get_num_threads())
    return True
