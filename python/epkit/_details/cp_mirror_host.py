"""The host side of ``epkit.cp_mirror.prepare_cp_mirror``: argument checks, per-sequence sums, the ``cpu`` backend.

:func:`validate_cp_static` checks what the arguments are without reading their values (the public function
runs it) and :func:`validate_cp_args` the rest (the op runs it, for every backend, the reference included);
:func:`plan_batch` turns validated ``cu_seqlens`` into per-sequence prefix sums (what every
backend's kernel reads); :func:`mirror_indices_cpu` expands them into the per-slot and
per-token indices with ``np.repeat`` (the ``cpu`` backend); :func:`half_metadata` gives the
varlen-attention lengths of the mirror layout, the same on every backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "validate_cp_static",
    "validate_cp_args",
    "MirrorPlan",
    "plan_batch",
    "int32_tensor",
    "half_metadata",
    "mirror_indices_cpu",
]

_INT32_MAX = 2**31 - 1


def _check_int(name: str, value, lo: int, hi: int | None = None, what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a Python int{what}, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value >= hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise ValueError(f"{name} = {value} must be {rng}{what}")
    return value


def validate_cp_static(cu_q, cu_k, cp_size, cp_rank, compress_ratios) -> tuple[int, ...]:
    """The checks of ``prepare_cp_mirror``'s arguments that read no tensor value: sizes, ranks and ratios,
    and the cu_seqlens' types, dtypes, shapes and devices (ValueError naming the field); returns the ratios."""
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
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must have dtype int32 or int64, got {t.dtype}")
        if t.dim() != 1 or t.numel() < 1:
            raise ValueError(f"{name} must be 1-D of shape [B + 1] (B >= 0), got shape {tuple(t.shape)}")
    if cu_q.device != cu_k.device:
        raise ValueError(f"cu_seqlens_q is on {cu_q.device} but cu_seqlens_k is on {cu_k.device}")
    if cu_q.numel() != cu_k.numel():
        bq, bk = cu_q.numel() - 1, cu_k.numel() - 1
        missing, where = (min(bq, bk), "cu_seqlens_k" if bk < bq else "cu_seqlens_q")
        raise ValueError(
            f"batch sizes differ: cu_seqlens_q has {bq} sequences, cu_seqlens_k has {bk} sequences; "
            f"sequence {missing} is missing from {where}"
        )
    return ratios


def validate_cp_args(cu_q, cu_k, cp_size, cp_rank, compress_ratios) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """Check every argument of ``prepare_cp_mirror`` (ValueError naming the field and the sequence): those of
    :func:`validate_cp_static`, then the cu_seqlens' values, read on the host; returns int64 host (numpy) copies
    of both cu_seqlens and the ratios as a tuple of ints."""
    ratios = validate_cp_static(cu_q, cu_k, cp_size, cp_rank, compress_ratios)
    host = []
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
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


@dataclass(frozen=True)
class MirrorPlan:
    """Per-sequence prefix sums (int64 numpy, host) and the sizes they imply; no per-token work."""

    q_start: np.ndarray  # [B]     first query token of the sequence
    q_len: np.ndarray  # [B]
    prefix: np.ndarray  # [B]     k_len - q_len: cached keys before the first query
    block: np.ndarray  # [B]     ps = ceil(q_len / (2 * cp_size))
    mirror_off: np.ndarray  # [B]     first slot of the sequence in the mirror layout
    key_start: np.ndarray  # [B, R]  first compressed key of the sequence per ratio
    mirror_len: int
    total_q: int


def plan_batch(hq: np.ndarray, hk: np.ndarray, cp_size: int, ratios: tuple[int, ...]) -> MirrorPlan:
    """The plan of validated host ``cu_seqlens_q`` / ``cu_seqlens_k`` (int64 [B + 1]) for ``cp_size`` ranks."""
    q_len = np.diff(hq)
    k_len = np.diff(hk)
    ps = (q_len + 2 * cp_size - 1) // (2 * cp_size)
    mirror_end = np.cumsum(2 * ps)
    kc = k_len[:, None] // np.asarray(ratios, dtype=np.int64)[None, :]
    return MirrorPlan(
        q_start=hq[:-1],
        q_len=q_len,
        prefix=k_len - q_len,
        block=ps,
        mirror_off=mirror_end - 2 * ps,
        key_start=np.cumsum(kc, 0) - kc,
        mirror_len=int(mirror_end[-1]) if mirror_end.size else 0,
        total_q=int(hq[-1]),
    )


def int32_tensor(a: np.ndarray, device) -> torch.Tensor:
    """``a`` as a contiguous int32 tensor on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)


def half_metadata(plan: MirrorPlan, cp_size: int, cp_rank: int, device):
    """cu_seqlens_q [B + 1], cu_seqlens_q_half [2B + 1], seqlens_q_half [2B], seqlens_k_half [2B] (int32)."""
    ps, q_len = plan.block[:, None], plan.q_len[:, None]
    start = ps * np.array([cp_rank, 2 * cp_size - 1 - cp_rank])[None, :]
    q_half = np.clip(q_len - start, 0, ps)
    k_half = plan.prefix[:, None] + np.minimum(start + ps, q_len)
    cu_local = np.concatenate(([0], np.cumsum(2 * plan.block)))
    cu_half = np.concatenate(([0], np.cumsum(np.repeat(plan.block, 2))))
    return tuple(int32_tensor(a, device) for a in (cu_local, cu_half, q_half.ravel(), k_half.ravel()))


def _slot_indices(plan: MirrorPlan, cp_size: int, cp_rank: int, ratios: tuple[int, ...]):
    """``index [L]`` and per ratio ``ks`` / ``ke [L]`` (int32 numpy), half-block by half-block."""
    num_seqs, R = plan.q_len.size, len(ratios)
    ps = plan.block[:, None]
    # Slot s of half h holds token s + col0[h] while s < col1[h]; a valid slot sees s + col2[h]
    # uncompressed keys of its sequence; col 3+r is the sequence's first key at ratio r.
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
    slot = np.arange(plan.mirror_len, dtype=np.int32)
    ok = slot < expanded[:, 1]
    index = np.where(ok, slot + expanded[:, 0], np.int32(-1))
    seen = slot + expanded[:, 2]
    ks, ke = {}, {}
    for r, c in enumerate(ratios):
        first = np.ascontiguousarray(expanded[:, 3 + r])
        ks[c] = first
        ke[c] = np.where(ok, first + (seen if c == 1 else seen // np.int32(c)), first)
    return index, ks, ke


def _reverse_index(plan: MirrorPlan, cp_size: int) -> np.ndarray:
    """``reverse [total_q]`` (int32 numpy), block by block: token t of block blk lands at t + rev_off[b, blk]."""
    ps = plan.block[:, None]
    blocks = np.arange(2 * cp_size)
    owner = np.where(blocks < cp_size, blocks, 2 * cp_size - 1 - blocks)
    blk_start = ps * blocks[None, :]
    blk_len = np.clip(plan.q_len[:, None] - blk_start, 0, ps)
    dest = owner[None, :] * plan.mirror_len + plan.mirror_off[:, None] + (blocks >= cp_size)[None, :] * ps
    rev_off = (dest - plan.q_start[:, None] - blk_start).astype(np.int32)
    reverse = np.repeat(rev_off.ravel(), blk_len.ravel())
    reverse += np.arange(plan.total_q, dtype=np.int32)
    return reverse


def mirror_indices_cpu(plan: MirrorPlan, cp_size: int, cp_rank: int, ratios: tuple[int, ...]):
    """The ``cpu`` backend: ``(index [L], reverse [total_q], ks, ke)``, int32 CPU tensors, ``ks`` / ``ke`` per ratio.

    Vectorised on the host: per-half-block and per-block offsets expanded with ``np.repeat``.
    """
    index, ks, ke = _slot_indices(plan, cp_size, cp_rank, ratios)
    reverse = _reverse_index(plan, cp_size)
    ks = {c: torch.from_numpy(v) for c, v in ks.items()}
    ke = {c: torch.from_numpy(v) for c, v in ke.items()}
    return torch.from_numpy(index), torch.from_numpy(reverse), ks, ke
