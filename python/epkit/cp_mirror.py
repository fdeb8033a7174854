"""Context parallelism: zigzag ("mirror") sharding of a packed prefill batch.

Each sequence of a varlen batch is cut into ``2 * cp_size`` equal blocks of
``ps = ceil(q_len / (2 * cp_size))`` tokens (the last ones padded). CP rank
``r`` takes block ``r`` and block ``2 * cp_size - 1 - r``, so every rank holds
one early and one late piece of every sequence and causal attention work is
balanced. :func:`prepare_cp_mirror` computes the index metadata of that layout
for one rank; :func:`to_mirror` moves a rank's rows into it and
:func:`from_mirror` restores the original order from the all-gathered buffer.

Backends of ``prepare_cp_mirror``: ``reference`` (per-token Python loops, the
specification), ``cpu`` (vectorised torch), ``tilelang`` (C target on CPU,
CUDA on GPU) and ``triton`` (CUDA, or the interpreter on CPU). Every backend is
bit-exact against the reference.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from epkit.backends import OpSpec, register_op, select
from epkit.gather import gather_rows

__all__ = [
    "CPMirror",
    "prepare_cp_mirror",
    "prepare_cp_mirror_reference",
    "to_mirror",
    "from_mirror",
]

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class CPMirror:
    """Index metadata of one CP rank's mirror layout (see :func:`prepare_cp_mirror`).

    All tensors are int32 on the device of ``cu_seqlens_q``. ``B`` is the number
    of sequences, ``L = cp_mirror_len`` and ``total_q = cu_seqlens_q[-1]``.

    Attributes
    ----------
    cp_size, cp_rank : int
        The CP group size and this rank.
    compress_ratios : tuple of int
        The ratios ``ks`` / ``ke`` are given for.
    cp_mirror_len : int
        Slots in this rank's mirror layout, ``sum_b 2 * ps_b``; equal on every rank.
    total_q : int
        Query tokens in the packed batch.
    mirror_cp_index : Tensor [L]
        Packed-batch token held by each slot, ``-1`` for padding.
    mirror_cp_reverse_index : Tensor [total_q]
        Position of each original token in the all-gathered ``[cp_size * L]`` buffer (rank-major).
    ks, ke : dict[int, Tensor [L]]
        Per ratio ``c``: half-open key range of each slot in that ratio's packed key buffer.
        Padding slots have ``ks == ke`` (both equal to the sequence's first key).
    cu_seqlens_q : Tensor [B + 1]
        Slot offsets of each sequence in the mirror layout (padding included): ``cumsum(2 * ps)``.
    cu_seqlens_q_half : Tensor [2B + 1]
        Slot offsets of the half-blocks (sequence ``b``'s first half is ``2b``, its second ``2b + 1``).
    seqlens_q_half : Tensor [2B]
        Valid queries in each half-block; they come first, padding fills the rest of the ``ps`` slots.
    seqlens_k_half : Tensor [2B]
        Uncompressed keys (counted from the sequence's first key) that the half-block's last slot may see:
        ``k_len - q_len + min(ps * (blk + 1), q_len)``. With bottom-right causal alignment, valid query
        ``j`` of a half-block sees ``seqlens_k_half - seqlens_q_half + j + 1`` keys, exactly as ``ke``.
    """

    cp_size: int
    cp_rank: int
    compress_ratios: tuple[int, ...]
    cp_mirror_len: int
    total_q: int
    mirror_cp_index: torch.Tensor
    mirror_cp_reverse_index: torch.Tensor
    ks: dict[int, torch.Tensor]
    ke: dict[int, torch.Tensor]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_q_half: torch.Tensor
    seqlens_q_half: torch.Tensor
    seqlens_k_half: torch.Tensor


# Validation


def _check_int(name: str, value, lo: int, hi: int | None = None, what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a Python int{what}, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value >= hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise ValueError(f"{name} = {value} must be {rng}{what}")
    return value


def _validate(cu_q, cu_k, cp_size, cp_rank, compress_ratios) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """Check every argument; returns int64 host (numpy) copies of both cu_seqlens and the ratios."""
    _check_int("cp_size", cp_size, 1)
    _check_int("cp_rank", cp_rank, 0, cp_size, f" (cp_size = {cp_size})")
    if isinstance(compress_ratios, (int, torch.Tensor)) or not isinstance(compress_ratios, Sequence):
        raise ValueError(f"compress_ratios must be a sequence of positive ints, got {compress_ratios!r}")
    if len(compress_ratios) == 0:
        raise ValueError("compress_ratios must name at least one ratio, got an empty sequence")
    ratios = tuple(_check_int(f"compress_ratios[{i}]", c, 1) for i, c in enumerate(compress_ratios))
    for i, c in enumerate(ratios):
        if c in ratios[:i]:
            raise ValueError(f"compress_ratios[{i}] = {c} repeats compress_ratios[{ratios.index(c)}]")
    host = []
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must have dtype int32 or int64, got {t.dtype}")
        if t.dim() != 1 or t.numel() < 1:
            raise ValueError(f"{name} must be 1-D of shape [B + 1] (B >= 0), got shape {tuple(t.shape)}")
        h = t.detach().cpu().numpy().astype(np.int64)
        if h[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {int(h[0])}")
        d = np.diff(h)
        if d.size and d.min() < 0:
            b = int(np.argmax(d < 0))
            raise ValueError(
                f"{name} decreases at sequence {b}: {name}[{b + 1}] = {int(h[b + 1])} < {name}[{b}] = {int(h[b])}"
            )
        host.append(h)
    hq, hk = host
    if cu_q.device != cu_k.device:
        raise ValueError(f"cu_seqlens_q is on {cu_q.device} but cu_seqlens_k is on {cu_k.device}")
    if hq.size != hk.size:
        bq, bk = hq.size - 1, hk.size - 1
        missing, where = (min(bq, bk), "cu_seqlens_k" if bk < bq else "cu_seqlens_q")
        raise ValueError(
            f"batch sizes differ: cu_seqlens_q has {bq} sequences, cu_seqlens_k has {bk} sequences; "
            f"sequence {missing} is missing from {where}"
        )
    short = np.diff(hk) < np.diff(hq)
    if short.any():
        b = int(np.argmax(short))
        raise ValueError(
            f"sequence {b} has k_len = {int(hk[b + 1] - hk[b])} < q_len = {int(hq[b + 1] - hq[b])} "
            "(cu_seqlens_k vs cu_seqlens_q); the keys must include the sequence's own queries"
        )
    mirror_len = int(2 * ((np.diff(hq) + 2 * cp_size - 1) // (2 * cp_size)).sum())
    if hk[-1] > _INT32_MAX or cp_size * mirror_len > _INT32_MAX or len(ratios) * mirror_len > _INT32_MAX:
        raise ValueError(
            f"batch too large for int32 indices: total_k = {int(hk[-1])}, cp_size * cp_mirror_len = "
            f"{cp_size * mirror_len}, len(compress_ratios) * cp_mirror_len = {len(ratios) * mirror_len}"
        )
    return hq, hk, ratios


# Reference


def prepare_cp_mirror_reference(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    compress_ratios: Sequence[int] = (1,),
) -> CPMirror:
    """Readable specification of :func:`prepare_cp_mirror`: one token at a time (slow; for tests)."""
    hq, hk, ratios = _validate(cu_seqlens_q, cu_seqlens_k, cp_size, cp_rank, compress_ratios)
    cu_q, cu_k = hq.tolist(), hk.tolist()
    num_seqs = len(cu_q) - 1
    q_lens = [cu_q[b + 1] - cu_q[b] for b in range(num_seqs)]
    k_lens = [cu_k[b + 1] - cu_k[b] for b in range(num_seqs)]
    block_sizes = [(sq + 2 * cp_size - 1) // (2 * cp_size) for sq in q_lens]

    # Every rank's mirror layout: sequence by sequence, block `rank` then block `2*cp_size-1-rank`.
    def layout(rank: int) -> list[int]:
        slots = []
        for b in range(num_seqs):
            for blk in (rank, 2 * cp_size - 1 - rank):
                for j in range(block_sizes[b]):
                    pos = block_sizes[b] * blk + j
                    slots.append(cu_q[b] + pos if pos < q_lens[b] else -1)
        return slots

    layouts = [layout(rank) for rank in range(cp_size)]
    mirror_len = len(layouts[0])
    index = layouts[cp_rank]

    # Reverse index: where each original token sits once all ranks' layouts are concatenated rank-major.
    reverse = [-1] * cu_q[-1]
    for rank, slots in enumerate(layouts):
        for s, token in enumerate(slots):
            if token >= 0:
                reverse[token] = rank * mirror_len + s

    # Key ranges: sequence b owns k_len // c compressed keys after the earlier sequences' ones; the query at
    # position i (after the cached prefix of k_len - q_len keys) sees (k_len - q_len + i + 1) // c of them.
    ks, ke = {}, {}
    for c in ratios:
        first_key, start = [], 0
        for b in range(num_seqs):
            first_key.append(start)
            start += k_lens[b] // c
        lo, hi, s = [], [], 0
        for b in range(num_seqs):
            for _ in range(2 * block_sizes[b]):
                token = index[s]
                lo.append(first_key[b])
                if token < 0:
                    hi.append(first_key[b])
                else:
                    i = token - cu_q[b]
                    hi.append(first_key[b] + (k_lens[b] - q_lens[b] + i + 1) // c)
                s += 1
        ks[c], ke[c] = lo, hi

    # Varlen-attention metadata of the mirror layout.
    cu_local, cu_half, q_half, k_half = [0], [0], [], []
    for b in range(num_seqs):
        ps = block_sizes[b]
        cu_local.append(cu_local[-1] + 2 * ps)
        for blk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            cu_half.append(cu_half[-1] + ps)
            q_half.append(max(0, min(ps, q_lens[b] - ps * blk)))
            k_half.append(k_lens[b] - q_lens[b] + min(ps * (blk + 1), q_lens[b]))

    dev = cu_seqlens_q.device

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=dev)

    return CPMirror(
        cp_size=cp_size,
        cp_rank=cp_rank,
        compress_ratios=ratios,
        cp_mirror_len=mirror_len,
        total_q=cu_q[-1],
        mirror_cp_index=i32(index),
        mirror_cp_reverse_index=i32(reverse),
        ks={c: i32(v) for c, v in ks.items()},
        ke={c: i32(v) for c, v in ke.items()},
        cu_seqlens_q=i32(cu_local),
        cu_seqlens_q_half=i32(cu_half),
        seqlens_q_half=i32(q_half),
        seqlens_k_half=i32(k_half),
    )


# Implementation


@dataclass(frozen=True)
class _Plan:
    """Per-sequence prefix sums (int64 numpy, host) and the sizes they imply; no per-token work."""

    q_start: np.ndarray  # [B]     first query token of the sequence
    q_len: np.ndarray  # [B]
    prefix: np.ndarray  # [B]     k_len - q_len: cached keys before the first query
    block: np.ndarray  # [B]     ps = ceil(q_len / (2 * cp_size))
    mirror_off: np.ndarray  # [B]     first slot of the sequence in the mirror layout
    key_start: np.ndarray  # [B, R]  first compressed key of the sequence per ratio
    mirror_len: int
    total_q: int


def _plan(hq: np.ndarray, hk: np.ndarray, cp_size: int, ratios: tuple[int, ...]) -> _Plan:
    q_len = np.diff(hq)
    k_len = np.diff(hk)
    ps = (q_len + 2 * cp_size - 1) // (2 * cp_size)
    mirror_end = np.cumsum(2 * ps)
    kc = k_len[:, None] // np.asarray(ratios, dtype=np.int64)[None, :]
    return _Plan(
        q_start=hq[:-1],
        q_len=q_len,
        prefix=k_len - q_len,
        block=ps,
        mirror_off=mirror_end - 2 * ps,
        key_start=np.cumsum(kc, 0) - kc,
        mirror_len=int(mirror_end[-1]) if mirror_end.size else 0,
        total_q=int(hq[-1]),
    )


def _i32(a: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)


def _half_metadata(plan: _Plan, cp_size: int, cp_rank: int, device):
    """cu_seqlens_q, cu_seqlens_q_half, seqlens_q_half, seqlens_k_half (per-sequence vectors)."""
    ps, q_len = plan.block[:, None], plan.q_len[:, None]
    start = ps * np.array([cp_rank, 2 * cp_size - 1 - cp_rank])[None, :]
    q_half = np.clip(q_len - start, 0, ps)
    k_half = plan.prefix[:, None] + np.minimum(start + ps, q_len)
    cu_local = np.concatenate(([0], np.cumsum(2 * plan.block)))
    cu_half = np.concatenate(([0], np.cumsum(np.repeat(plan.block, 2))))
    return tuple(_i32(a, device) for a in (cu_local, cu_half, q_half.ravel(), k_half.ravel()))


def _cpu_kernel(plan: _Plan, cp_size: int, cp_rank: int, ratios: tuple[int, ...]):
    """Vectorised on the host: per-half-block and per-block offsets expanded with ``np.repeat``."""
    L, T, R = plan.mirror_len, plan.total_q, len(ratios)
    num_seqs = plan.q_len.size
    ps = plan.block[:, None]

    # Mirror slots, half-block by half-block: slot s of half h holds token s + col0[h] while s < col1[h];
    # a valid slot sees s + col2[h] uncompressed keys of its sequence; col 3+r is the sequence's first key.
    half = np.arange(2)
    blk = cp_rank + half * (2 * cp_size - 1 - 2 * cp_rank)
    half_first = plan.mirror_off[:, None] + half[None, :] * ps
    in_seq = ps * blk[None, :]
    per_half = np.empty((num_seqs, 2, 3 + R), dtype=np.int32)
    per_half[..., 0] = plan.q_start[:, None] + in_seq - half_first
    per_half[..., 1] = half_first + np.clip(plan.q_len[:, None] - in_seq, 0, ps)
    per_half[..., 2] = plan.prefix[:, None] + in_seq + 1 - half_first
    per_half[..., 3:] = plan.key_start[:, None, :]
    expanded = np.repeat(per_half.reshape(2 * num_seqs, 3 + R), np.repeat(plan.block, 2), axis=0)
    slot = np.arange(L, dtype=np.int32)
    ok = slot < expanded[:, 1]
    index = np.where(ok, slot + expanded[:, 0], np.int32(-1))
    seen = slot + expanded[:, 2]
    ks, ke = {}, {}
    for r, c in enumerate(ratios):
        first = np.ascontiguousarray(expanded[:, 3 + r])
        ks[c] = torch.from_numpy(first)
        ke[c] = torch.from_numpy(np.where(ok, first + (seen if c == 1 else seen // np.int32(c)), first))

    # Reverse index, block by block: token t of block blk lands at t + rev_off[b, blk] in the gathered buffer.
    blocks = np.arange(2 * cp_size)
    owner = np.where(blocks < cp_size, blocks, 2 * cp_size - 1 - blocks)
    blk_start = ps * blocks[None, :]
    blk_len = np.clip(plan.q_len[:, None] - blk_start, 0, ps)
    dest = owner[None, :] * L + plan.mirror_off[:, None] + (blocks >= cp_size)[None, :] * ps
    rev_off = (dest - plan.q_start[:, None] - blk_start).astype(np.int32)
    reverse = np.repeat(rev_off.ravel(), blk_len.ravel())
    reverse += np.arange(T, dtype=np.int32)
    return torch.from_numpy(index), torch.from_numpy(reverse), ks, ke


def prepare_cp_mirror(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    compress_ratios: Sequence[int] = (1,),
    backend: str = "auto",
) -> CPMirror:
    """Index metadata of CP rank ``cp_rank``'s zigzag ("mirror") share of a packed prefill batch.

    Sequence ``b`` (``sq = q_len_b`` queries) is cut into ``2 * cp_size`` blocks of
    ``ps = ceil(sq / (2 * cp_size))`` slots; this rank holds block ``cp_rank`` then block
    ``2 * cp_size - 1 - cp_rank`` of every sequence, in sequence order. Slot ``j`` of block
    ``blk`` holds token ``cu_seqlens_q[b] + ps * blk + j`` if ``ps * blk + j < sq``, else padding (-1).

    Parameters
    ----------
    cu_seqlens_q : Tensor [B + 1], int32 or int64
        Query offsets of the packed batch (starts at 0, non-decreasing).
    cu_seqlens_k : Tensor [B + 1], int32 or int64
        Key offsets; ``k_len_b >= q_len_b``, the difference being cached prefix keys that precede
        the sequence's queries. Same device as ``cu_seqlens_q``.
    cp_size : int
        CP group size, ``>= 1``.
    cp_rank : int
        This rank, in ``[0, cp_size)``.
    compress_ratios : sequence of int
        Distinct key compression ratios ``c >= 1``; ratio ``c`` packs ``k_len_b // c`` keys per sequence.
    backend : str
        ``"auto"`` (default), ``"cpu"``, ``"tilelang"``, ``"triton"`` or ``"reference"``.

    Returns
    -------
    CPMirror
        int32 tensors on the input device: ``mirror_cp_index [L]``, ``mirror_cp_reverse_index [total_q]``,
        ``ks[c]`` / ``ke[c]`` ``[L]`` per ratio (the query at position ``i`` of its sequence sees keys
        ``[ks, ke)`` with ``ke - ks = (k_len - q_len + i + 1) // c``; padding has ``ks == ke``), the local
        ``cu_seqlens_q [B + 1]`` of the mirror layout and per-half-block lengths (see :class:`CPMirror`).
        ``L = cp_mirror_len = sum_b 2 * ps_b`` is the same on every rank.

    Raises
    ------
    ValueError
        ``cp_size < 1``, ``cp_rank`` outside ``[0, cp_size)``, a ratio ``<= 0`` or repeated, non-integer
        dtypes, shapes other than ``[B + 1]``, mismatched batch sizes, ``cu_seqlens[0] != 0``, decreasing
        ``cu_seqlens``, or ``k_len < q_len``; the message names the field and the sequence index.
        Raised before any kernel runs.

    Examples
    --------
    Two sequences: 5 queries after 3 cached keys, and 2 queries with no cache; ``cp_size = 2`` cuts each
    into 4 blocks (``ps = 2`` and ``ps = 1``): tokens ``[0 1 | 2 3 | 4 - | - -]`` and ``[5 | 6 | - | -]``.
    Rank 0 takes blocks 0 and 3, rank 1 blocks 1 and 2:

    >>> cu_q = torch.tensor([0, 5, 7], dtype=torch.int32)
    >>> cu_k = torch.tensor([0, 8, 10], dtype=torch.int32)
    >>> m0 = prepare_cp_mirror(cu_q, cu_k, 2, 0, (1, 4))
    >>> m1 = prepare_cp_mirror(cu_q, cu_k, 2, 1, (1, 4))
    >>> m0.cp_mirror_len, m0.mirror_cp_index.tolist(), m1.mirror_cp_index.tolist()
    (6, [0, 1, -1, -1, 5, -1], [2, 3, 4, -1, 6, -1])
    >>> m0.mirror_cp_reverse_index.tolist()  # gathered = [0 1 - - 5 - | 2 3 4 - 6 -]
    [0, 1, 6, 7, 8, 4, 10]
    >>> m0.ks[1].tolist(), m0.ke[1].tolist(), m1.ke[1].tolist()
    ([0, 0, 0, 0, 8, 8], [4, 5, 0, 0, 9, 8], [6, 7, 8, 0, 10, 8])
    >>> m0.ks[4].tolist(), m0.ke[4].tolist(), m1.ke[4].tolist()
    ([0, 0, 0, 0, 2, 2], [1, 1, 0, 0, 2, 2], [1, 1, 2, 0, 2, 2])
    >>> m0.cu_seqlens_q.tolist(), m0.cu_seqlens_q_half.tolist()
    ([0, 4, 6], [0, 2, 4, 5, 6])
    >>> m0.seqlens_q_half.tolist(), m0.seqlens_k_half.tolist()
    ([2, 0, 1, 0], [5, 8, 1, 2])
    >>> m1.seqlens_q_half.tolist(), m1.seqlens_k_half.tolist()
    ([2, 1, 1, 0], [7, 8, 2, 2])

    Sequence 0 owns keys ``[0, 8)`` at ratio 1 and ``[0, 2)`` at ratio 4; sequence 1 owns ``[8, 10)`` and
    none (it starts at 2). Token 4 (position 4 after 3 cached keys) sees ``3 + 4 + 1 = 8`` keys, i.e.
    ``8 // 4 = 2`` compressed ones.
    """
    hq, hk, ratios = _validate(cu_seqlens_q, cu_seqlens_k, cp_size, cp_rank, compress_ratios)
    dev = cu_seqlens_q.device
    impl = select("prepare_cp_mirror", dev, backend)
    if impl == "reference":
        return prepare_cp_mirror_reference(cu_seqlens_q, cu_seqlens_k, cp_size, cp_rank, ratios)
    plan = _plan(hq, hk, cp_size, ratios)
    if impl == "cpu":
        index, reverse, ks, ke = _cpu_kernel(plan, cp_size, cp_rank, ratios)
    else:
        L, T, R = plan.mirror_len, plan.total_q, len(ratios)
        index = torch.empty(L, dtype=torch.int32, device=dev)
        reverse = torch.empty(T, dtype=torch.int32, device=dev)
        ks_all = torch.empty((R, L), dtype=torch.int32, device=dev)
        ke_all = torch.empty((R, L), dtype=torch.int32, device=dev)
        if plan.mirror_len:  # zero slots means zero tokens: nothing to launch
            if impl == "triton":
                from epkit.kernels.triton.cp_mirror import prepare_cp_mirror_launch
            else:
                from epkit.kernels.tilelang.cp_mirror import prepare_cp_mirror_launch
            per_seq = _i32(np.stack((plan.q_start, plan.q_len, plan.prefix, plan.mirror_off)), dev)
            prepare_cp_mirror_launch(
                *per_seq,
                _i32(plan.key_start, dev),
                _i32(np.asarray(ratios), dev),
                cp_size,
                cp_rank,
                index,
                reverse,
                ks_all,
                ke_all,
            )
        ks = {c: ks_all[r] for r, c in enumerate(ratios)}
        ke = {c: ke_all[r] for r, c in enumerate(ratios)}
    cu_local, cu_half, q_half, k_half = _half_metadata(plan, cp_size, cp_rank, dev)
    return CPMirror(
        cp_size=cp_size,
        cp_rank=cp_rank,
        compress_ratios=ratios,
        cp_mirror_len=plan.mirror_len,
        total_q=plan.total_q,
        mirror_cp_index=index,
        mirror_cp_reverse_index=reverse,
        ks=ks,
        ke=ke,
        cu_seqlens_q=cu_local,
        cu_seqlens_q_half=cu_half,
        seqlens_q_half=q_half,
        seqlens_k_half=k_half,
    )


# Mirror gathers


def to_mirror(x: torch.Tensor, mirror: CPMirror, *, backend: str = "auto") -> torch.Tensor:
    """Rows of the packed batch in this rank's mirror order, zero rows at padding slots.

    Parameters
    ----------
    x : Tensor [total_q, *]
        Any dtype; one row per query token of the packed batch (same device as ``mirror``).
    mirror : CPMirror
        From :func:`prepare_cp_mirror` for this rank.
    backend : str
        Passed to :func:`epkit.gather_rows`.

    Returns
    -------
    Tensor [cp_mirror_len, *] of ``x``'s dtype: ``out[s] = x[mirror_cp_index[s]]``, zeros where it is -1.
    """
    if not isinstance(mirror, CPMirror):
        raise ValueError(f"mirror must be a CPMirror from prepare_cp_mirror, got {type(mirror).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != mirror.total_q:
        raise ValueError(
            f"x must be a tensor of shape [total_q = {mirror.total_q}, *], got shape {tuple(getattr(x, 'shape', ()))}"
        )
    return gather_rows(x, mirror.mirror_cp_index, backend=backend, check_index=False)


def from_mirror(gathered: torch.Tensor, mirror: CPMirror, *, backend: str = "auto") -> torch.Tensor:
    """Restore the original token order from every rank's mirror rows, all-gathered rank-major.

    Parameters
    ----------
    gathered : Tensor [cp_size * cp_mirror_len, *]
        Concatenation of ``to_mirror`` outputs (or per-slot results) of ranks ``0 .. cp_size-1``.
    mirror : CPMirror
        From :func:`prepare_cp_mirror` (any rank: the reverse index is the same on every rank).
    backend : str
        Passed to :func:`epkit.gather_rows`.

    Returns
    -------
    Tensor [total_q, *] of ``gathered``'s dtype: ``out[t] = gathered[mirror_cp_reverse_index[t]]``.
    """
    if not isinstance(mirror, CPMirror):
        raise ValueError(f"mirror must be a CPMirror from prepare_cp_mirror, got {type(mirror).__name__}")
    want = mirror.cp_size * mirror.cp_mirror_len
    if not isinstance(gathered, torch.Tensor) or gathered.dim() < 1 or gathered.shape[0] != want:
        raise ValueError(
            f"gathered must have shape [cp_size * cp_mirror_len = {want}, *], "
            f"got shape {tuple(getattr(gathered, 'shape', ()))}"
        )
    return gather_rows(gathered, mirror.mirror_cp_reverse_index, backend=backend, check_index=False)


# Registration


def mirrors_equal(a: CPMirror, b: CPMirror) -> str | None:
    """None when two CPMirrors are identical (sizes and every tensor bit for bit), else the first difference."""
    for name in ("cp_size", "cp_rank", "compress_ratios", "cp_mirror_len", "total_q"):
        if getattr(a, name) != getattr(b, name):
            return f"{name}: {getattr(a, name)!r} != {getattr(b, name)!r}"
    pairs = [(n, getattr(a, n), getattr(b, n)) for n in _TENSOR_FIELDS]
    pairs += [(f"{n}[{c}]", getattr(a, n)[c], getattr(b, n)[c]) for n in ("ks", "ke") for c in a.compress_ratios]
    for name, x, y in pairs:
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.cpu(), y.cpu()):
            return (
                f"{name}: {x.dtype} {tuple(x.shape)} {x.tolist()[:16]} != {y.dtype} {tuple(y.shape)} {y.tolist()[:16]}"
            )
    return None


_TENSOR_FIELDS = (
    "mirror_cp_index",
    "mirror_cp_reverse_index",
    "cu_seqlens_q",
    "cu_seqlens_q_half",
    "seqlens_q_half",
    "seqlens_k_half",
)


def _selfcheck(backend: str) -> None:
    cu_q = torch.tensor([0, 5, 5, 6, 40, 43], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 12, 13, 60, 63], dtype=torch.int32)
    for cp_size in (1, 2, 4):
        for cp_rank in range(cp_size):
            got = prepare_cp_mirror(cu_q, cu_k, cp_size, cp_rank, (1, 4, 128), backend=backend)
            want = prepare_cp_mirror_reference(cu_q, cu_k, cp_size, cp_rank, (1, 4, 128))
            diff = mirrors_equal(got, want)
            if diff is not None:
                raise AssertionError(f"prepare_cp_mirror[{backend}] {cp_size=} {cp_rank=} differs: {diff}")


SPEC = register_op(
    OpSpec(
        name="prepare_cp_mirror",
        cpu=("cpu", "tilelang", "reference", "triton"),
        cuda=("triton", "tilelang", "reference"),
        doc="zigzag CP mirror layout: index, reverse index, per-ratio key ranges",
        selfcheck=_selfcheck,
    )
)


def random_batch(num_seqs: int, total_q: int, max_prefix: int = 0, seed: int = 0):
    """A packed batch of ``num_seqs`` sequences summing to ``total_q`` queries (cu_seqlens_q, cu_seqlens_k, int32)."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, total_q + 1, (max(num_seqs - 1, 0),), generator=g)).values
    cu_q = torch.cat((torch.tensor([0]), cuts, torch.tensor([total_q]))) if num_seqs else torch.tensor([0])
    q_len = cu_q[1:] - cu_q[:-1]
    prefix = torch.randint(0, max_prefix + 1, (num_seqs,), generator=g)
    cu_k = torch.cat((torch.tensor([0]), torch.cumsum(q_len + prefix, 0)))
    return cu_q.to(torch.int32), cu_k.to(torch.int32)


def _bench_main(backend: str) -> None:
    """Check one backend against the reference, then time it on 64 sequences / 131072 tokens, cp 8."""
    device = "cuda" if torch.cuda.is_available() and backend not in ("cpu", "reference") else "cpu"
    cu_q, cu_k = random_batch(9, 700, 100, seed=1)
    for cp_rank in range(4):
        got = prepare_cp_mirror(cu_q.to(device), cu_k.to(device), 4, cp_rank, (1, 4, 128), backend=backend)
        diff = mirrors_equal(got, prepare_cp_mirror_reference(cu_q, cu_k, 4, cp_rank, (1, 4, 128)))
        if diff is not None:
            raise AssertionError(f"prepare_cp_mirror[{backend}] differs from the reference: {diff}")
    print(f"prepare_cp_mirror[{backend}] matches the reference")
    if device == "cpu" and backend == "triton":
        return  # the interpreter is for verification, not for timing
    cu_q, cu_k = (t.to(device) for t in random_batch(64, 131072, 4096, seed=0))
    reps = 20
    prepare_cp_mirror(cu_q, cu_k, 8, 3, (1, 4, 128), backend=backend)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        prepare_cp_mirror(cu_q, cu_k, 8, 3, (1, 4, 128), backend=backend)
    if device == "cuda":
        torch.cuda.synchronize()
    print(
        f"prepare_cp_mirror[{backend}]: {(time.perf_counter() - t0) / reps * 1e3:.3f} ms (64 seqs, 131072 tokens, cp 8)"
    )
