"""Context parallelism: zigzag ("mirror") sharding of a packed prefill batch.

Each sequence of a varlen batch is cut into ``2 * cp_size`` equal blocks of
``ps = ceil(q_len / (2 * cp_size))`` tokens (the last ones padded). CP rank
``r`` takes block ``r`` and block ``2 * cp_size - 1 - r``, so every rank holds
one early and one late piece of every sequence and causal attention work is
balanced. :func:`prepare_cp_mirror` computes the index metadata of that layout
for one rank; :func:`to_mirror` moves a rank's rows into it and
:func:`from_mirror` restores the original order from the all-gathered buffer.

Backends of ``prepare_cp_mirror``: ``reference`` (per-token Python loops, the
specification), ``cpu`` (vectorised numpy on the host), ``tilelang`` (C target on CPU,
CUDA on GPU) and ``triton`` (CUDA, or the interpreter on CPU). Every backend is
bit-exact against the reference. The op is ``torch.ops.epkit.prepare_cp_mirror`` (``epkit.ops``): host
planning whose output sizes depend on the values (it compiles; it is not for CUDA graphs).

Example
-------
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

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from epkit._details.cp_mirror_host import (
    MirrorPlan,
    half_metadata,
    int32_tensor,
    mirror_indices_cpu,
    plan_batch,
    validate_cp_args,
    validate_cp_static,
)
from epkit.backends import ALL_BACKENDS_CPU, ALL_BACKENDS_CUDA, OpSpec, register_op, select
from epkit.gather import gather_rows
from epkit.ops import custom_op

__all__ = [
    "CPMirror",
    "prepare_cp_mirror",
    "prepare_cp_mirror_reference",
    "to_mirror",
    "from_mirror",
]


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


# Reference


def _reference_layout(cu_q: list, q_lens: list, block_sizes: list, cp_size: int, rank: int) -> list[int]:
    """Rank ``rank``'s mirror slots, one token at a time: sequence by sequence, block ``rank`` then
    block ``2 * cp_size - 1 - rank``; ``-1`` past a sequence's end."""
    slots = []
    for b in range(len(q_lens)):
        for blk in (rank, 2 * cp_size - 1 - rank):
            for j in range(block_sizes[b]):
                pos = block_sizes[b] * blk + j
                slots.append(cu_q[b] + pos if pos < q_lens[b] else -1)
    return slots


def _reference_key_ranges(index: list, cu_q: list, q_lens: list, k_lens: list, block_sizes: list, c: int):
    """``(ks, ke)`` lists of ratio ``c`` for the slots ``index``.

    Sequence b owns ``k_len // c`` compressed keys after the earlier sequences' ones; the query at
    position i (after the cached prefix of ``k_len - q_len`` keys) sees ``(k_len - q_len + i + 1) // c``.
    """
    first_key, start = [], 0
    for k_len in k_lens:
        first_key.append(start)
        start += k_len // c
    lo, hi, s = [], [], 0
    for b in range(len(q_lens)):
        for _ in range(2 * block_sizes[b]):
            token = index[s]
            lo.append(first_key[b])
            if token < 0:
                hi.append(first_key[b])
            else:
                i = token - cu_q[b]
                hi.append(first_key[b] + (k_lens[b] - q_lens[b] + i + 1) // c)
            s += 1
    return lo, hi


def _reference_half_metadata(q_lens: list, k_lens: list, block_sizes: list, cp_size: int, cp_rank: int):
    """Varlen-attention metadata of the mirror layout: ``cu_seqlens_q``, ``cu_seqlens_q_half``,
    ``seqlens_q_half``, ``seqlens_k_half`` as lists."""
    cu_local, cu_half, q_half, k_half = [0], [0], [], []
    for b, ps in enumerate(block_sizes):
        cu_local.append(cu_local[-1] + 2 * ps)
        for blk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            cu_half.append(cu_half[-1] + ps)
            q_half.append(max(0, min(ps, q_lens[b] - ps * blk)))
            k_half.append(k_lens[b] - q_lens[b] + min(ps * (blk + 1), q_lens[b]))
    return cu_local, cu_half, q_half, k_half


def prepare_cp_mirror_reference(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    compress_ratios: Sequence[int] = (1,),
) -> CPMirror:
    """Readable specification of :func:`prepare_cp_mirror`: one token at a time (slow; for tests)."""
    hq, hk, ratios = validate_cp_args(cu_seqlens_q, cu_seqlens_k, cp_size, cp_rank, compress_ratios)
    cu_q, cu_k = hq.tolist(), hk.tolist()
    num_seqs = len(cu_q) - 1
    q_lens = [cu_q[b + 1] - cu_q[b] for b in range(num_seqs)]
    k_lens = [cu_k[b + 1] - cu_k[b] for b in range(num_seqs)]
    block_sizes = [(sq + 2 * cp_size - 1) // (2 * cp_size) for sq in q_lens]

    layouts = [_reference_layout(cu_q, q_lens, block_sizes, cp_size, rank) for rank in range(cp_size)]
    mirror_len = len(layouts[0])
    index = layouts[cp_rank]
    # Reverse index: where each original token sits once all ranks' layouts are concatenated rank-major.
    reverse = [-1] * cu_q[-1]
    for rank, slots in enumerate(layouts):
        for s, token in enumerate(slots):
            if token >= 0:
                reverse[token] = rank * mirror_len + s
    ranges = {c: _reference_key_ranges(index, cu_q, q_lens, k_lens, block_sizes, c) for c in ratios}
    cu_local, cu_half, q_half, k_half = _reference_half_metadata(q_lens, k_lens, block_sizes, cp_size, cp_rank)

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
        ks={c: i32(lo) for c, (lo, _) in ranges.items()},
        ke={c: i32(hi) for c, (_, hi) in ranges.items()},
        cu_seqlens_q=i32(cu_local),
        cu_seqlens_q_half=i32(cu_half),
        seqlens_q_half=i32(q_half),
        seqlens_k_half=i32(k_half),
    )


# Implementation


def _mirror_indices_kernel(impl: str, plan: MirrorPlan, cp_size: int, cp_rank: int, ratios: tuple[int, ...], dev):
    """``(index, reverse, ks [R, L], ke [R, L])`` from the ``triton`` or ``tilelang`` kernel, int32 on ``dev``."""
    L, T, R = plan.mirror_len, plan.total_q, len(ratios)
    index = torch.empty(L, dtype=torch.int32, device=dev)
    reverse = torch.empty(T, dtype=torch.int32, device=dev)
    ks_all = torch.empty((R, L), dtype=torch.int32, device=dev)
    ke_all = torch.empty((R, L), dtype=torch.int32, device=dev)
    if L:  # zero slots means zero tokens: nothing to launch
        if impl == "triton":
            from epkit.kernels.triton.cp_mirror import prepare_cp_mirror_launch
        else:
            from epkit.kernels.tilelang.cp_mirror import prepare_cp_mirror_launch
        per_seq = int32_tensor(np.stack((plan.q_start, plan.q_len, plan.prefix, plan.mirror_off)), dev)
        key_start, ratio_t = int32_tensor(plan.key_start, dev), int32_tensor(np.asarray(ratios), dev)
        prepare_cp_mirror_launch(*per_seq, key_start, ratio_t, cp_size, cp_rank, index, reverse, ks_all, ke_all)
    return index, reverse, ks_all, ke_all


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

    See the module docstring for a worked example.
    """
    ratios = validate_cp_static(cu_seqlens_q, cu_seqlens_k, cp_size, cp_rank, compress_ratios)
    index, reverse, ks_all, ke_all, cu_local, cu_half, q_half, k_half = _prepare_op(
        cu_seqlens_q, cu_seqlens_k, cp_size, cp_rank, list(ratios), backend
    )
    return CPMirror(
        cp_size=cp_size,
        cp_rank=cp_rank,
        compress_ratios=ratios,
        cp_mirror_len=index.shape[0],
        total_q=reverse.shape[0],
        mirror_cp_index=index,
        mirror_cp_reverse_index=reverse,
        ks={c: ks_all[r] for r, c in enumerate(ratios)},
        ke={c: ke_all[r] for r, c in enumerate(ratios)},
        cu_seqlens_q=cu_local,
        cu_seqlens_q_half=cu_half,
        seqlens_q_half=q_half,
        seqlens_k_half=k_half,
    )


def _fake_prepare(cu_seqlens_q, cu_seqlens_k, cp_size, cp_rank, ratios, backend):
    ctx = torch.library.get_ctx()
    slots, tokens, b = ctx.new_dynamic_size(), ctx.new_dynamic_size(), cu_seqlens_q.shape[0] - 1
    shapes = (
        (slots,),
        (tokens,),
        (len(ratios), slots),
        (len(ratios), slots),
        (b + 1,),
        (2 * b + 1,),
        (2 * b,),
        (2 * b,),
    )
    return tuple(cu_seqlens_q.new_empty(shape, dtype=torch.int32) for shape in shapes)


@custom_op("prepare_cp_mirror", _fake_prepare)
def _prepare_op(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, cp_size: int, cp_rank: int, ratios: list[int], backend: str
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """``torch.ops.epkit.prepare_cp_mirror``: the CPMirror tensors (``ks`` and ``ke`` as ``[R, L]``, one row per
    ratio), after the checks that read the cu_seqlens on the host (all of this op is host planning: it
    synchronizes, and its output sizes depend on the values, so it is not for CUDA graphs)."""
    hq, hk, ratios = validate_cp_args(cu_seqlens_q, cu_seqlens_k, cp_size, cp_rank, ratios)
    dev = cu_seqlens_q.device
    impl = select("prepare_cp_mirror", dev, backend)
    if impl == "reference":
        m = prepare_cp_mirror_reference(cu_seqlens_q, cu_seqlens_k, cp_size, cp_rank, ratios)
        ks_all, ke_all = (torch.stack([getattr(m, n)[c] for c in ratios]) for n in ("ks", "ke"))
        rest = (m.cu_seqlens_q, m.cu_seqlens_q_half, m.seqlens_q_half, m.seqlens_k_half)
        return m.mirror_cp_index, m.mirror_cp_reverse_index, ks_all, ke_all, *rest
    plan = plan_batch(hq, hk, cp_size, ratios)
    if impl == "cpu":
        index, reverse, ks, ke = mirror_indices_cpu(plan, cp_size, cp_rank, ratios)
        ks_all = torch.stack([ks[c] for c in ratios])
        ke_all = torch.stack([ke[c] for c in ratios])
    else:
        index, reverse, ks_all, ke_all = _mirror_indices_kernel(impl, plan, cp_size, cp_rank, ratios, dev)
    return index, reverse, ks_all, ke_all, *half_metadata(plan, cp_size, cp_rank, dev)


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


#: The tensor fields of CPMirror other than the per-ratio dicts ``ks`` / ``ke``.
_TENSOR_FIELDS = tuple(f.name for f in fields(CPMirror) if f.type == "torch.Tensor")


def _selfcheck(backend: str, device: str = "cpu") -> None:
    """``prepare_cp_mirror[backend]`` on a small batch on ``device`` (cp 1, 2, 4, every rank) against the reference."""
    cu_q = torch.tensor([0, 5, 5, 6, 40, 43], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 12, 13, 60, 63], dtype=torch.int32)
    for cp_size in (1, 2, 4):
        for cp_rank in range(cp_size):
            got = prepare_cp_mirror(cu_q.to(device), cu_k.to(device), cp_size, cp_rank, (1, 4, 128), backend=backend)
            want = prepare_cp_mirror_reference(cu_q, cu_k, cp_size, cp_rank, (1, 4, 128))
            diff = mirrors_equal(got, want)
            if diff is not None:
                raise AssertionError(f"prepare_cp_mirror[{backend}] {cp_size=} {cp_rank=} differs: {diff}")


_DOC = "zigzag CP mirror layout: index, reverse index, per-ratio key ranges"
SPEC = register_op(OpSpec("prepare_cp_mirror", ALL_BACKENDS_CPU, ALL_BACKENDS_CUDA, _DOC, _selfcheck))


def random_batch(num_seqs: int, total_q: int, max_prefix: int = 0, seed: int = 0):
    """A packed batch of ``num_seqs`` sequences summing to ``total_q`` queries (cu_seqlens_q, cu_seqlens_k, int32)."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, total_q + 1, (max(num_seqs - 1, 0),), generator=g)).values
    cu_q = torch.cat((torch.tensor([0]), cuts, torch.tensor([total_q]))) if num_seqs else torch.tensor([0])
    q_len = cu_q[1:] - cu_q[:-1]
    prefix = torch.randint(0, max_prefix + 1, (num_seqs,), generator=g)
    cu_k = torch.cat((torch.tensor([0]), torch.cumsum(q_len + prefix, 0)))
    return cu_q.to(torch.int32), cu_k.to(torch.int32)
