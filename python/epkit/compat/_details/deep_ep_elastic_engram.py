"""DeepEP V2's Engram storage (``ElasticBuffer.engram_write`` / ``engram_fetch``) for ``epkit.compat.deep_ep``,
over epkit's ENP-sharded Engram table (:class:`epkit.collectives.engram_table.ShardedEngramTable`).

V2's table: every rank writes its own ``[E, hidden]`` entries (bf16, or FP8 e4m3 with globally replicated scaling
factors ``sf [W * E, S]``, 4-byte packs); global entry ``i`` is entry ``i % E`` of rank ``i // E``. A
ShardedEngramTable splits ``padded_rows`` rows evenly over the group, ``padded_rows`` a multiple of
``lcm(256, W)``; so this table has ``P = align(E, lcm(256, W) / W)`` rows per rank, rank ``r``'s entries at global
rows ``[r * P, r * P + E)`` and zero padding after, and entry ``i`` is row ``(i // E) * P + i % E``. The table's
lookup reads its rows straight out of their owners' shards where every rank is addressable (shared memory on one
host, NVSHMEM in one NVLink domain), else by ``all_to_all`` exchanges; rows travel as words (bit-exact, FP8 too).

``engram_fetch(indices)`` returns a hook; the hook returns ``(data [T, entries_per_token * hidden], sf)`` (the
layout V2's fetch returns and its test compares: each token's entries side by side), ``sf [T, entries_per_token *
S]`` gathered on this rank from the ``sf`` of ``engram_write`` (row-major, or V2's TMA-aligned column-major
strides), None without FP8.

Where this differs from V2: V2's fetch is one-sided (RDMA reads; the owners take no part), epkit's is collective:
**every rank calls ``engram_fetch``, in the same order** (a rank that needs nothing passes ``[0, n]`` indices), and
on the ``all_to_all`` path the hooks too (the owners serve rows inside their hooks). ``engram_write`` is collective in
both (V2's has a barrier before and after). A bad call on one rank (wrong dtype or shape, indices outside ``[0,
W * E)``, more than the buffer holds) is the same ValueError on every rank, before anything moves. Every wait has
the buffer's timeout and names the silent ranks. ``num_qps``: accepted, no effect.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from epkit.collectives._details.engram_table_checks import fetch_error
from epkit.collectives.engram_table import ShardedEngramTable, engram_table_partition
from epkit.collectives.ep.rows import align_up
from epkit.compat._details.deep_ep_agreement import FieldValue
from epkit.compat._details.deep_ep_config import SIZE_ALIGN
from epkit.compat._details.deep_ep_layouts import tma_scales
from epkit.compat._details.deep_ep_session import Session

__all__ = ["ElasticEngram", "engram_storage_size_hint"]

#: The hook ``engram_fetch`` returns: ``() -> (data, sf or None)``.
FetchHook = Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
_ENTRY_ALIGN = 32
_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def engram_storage_size_hint(
    num_entries: int, hidden: int, num_max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[int, int]:
    """V2's ``get_engram_storage_size_hint``: ``(num_gpu_bytes, num_cpu_bytes)``, 2 MiB aligned: room for
    ``num_max_tokens_per_rank`` fetched entries, and for ``num_entries`` stored ones, each ``align(hidden *
    itemsize, 32)`` bytes."""
    entry = align_up(hidden * dtype.itemsize, _ENTRY_ALIGN)
    return align_up(entry * num_max_tokens_per_rank, SIZE_ALIGN), align_up(entry * num_entries, SIZE_ALIGN)


def _storage_error(storage: object, sf: object, num_ranks: int, num_cpu_bytes: int) -> str | None:
    """Why ``engram_write(storage, sf)`` is invalid on this rank (V2's checks; None: fine)."""
    if not isinstance(storage, torch.Tensor) or storage.dim() != 2 or storage.dtype not in _DTYPES:
        return f"storage must be a 2-D bf16 or float8_e4m3fn tensor, got {getattr(storage, 'dtype', storage)!r}"
    if not storage.is_contiguous() or storage.shape[0] == 0:
        return "storage must be contiguous, with one entry or more"
    if storage.numel() * storage.element_size() > num_cpu_bytes:
        return (
            f"storage has {storage.numel() * storage.element_size()} bytes; the buffer's num_cpu_bytes is "
            f"{num_cpu_bytes} (see get_engram_storage_size_hint)"
        )
    fp8 = storage.dtype == torch.float8_e4m3fn
    if (sf is not None) != fp8:
        return "sf must be given exactly when the storage is FP8 (float8_e4m3fn)"
    if isinstance(sf, torch.Tensor):
        want = num_ranks * storage.shape[0]
        if sf.dim() != 2 or sf.shape[0] != want or sf.element_size() != 4 or not sf.is_contiguous():
            return (
                f"sf must be contiguous [num_ranks * num_entries = {want}, num_sf_packs] of 4-byte packs, got "
                f"{sf.dtype} {tuple(sf.shape)}"
            )
    elif sf is not None:
        return f"sf must be a tensor or None, got {type(sf).__name__}"
    return None


class ElasticEngram:
    """The Engram storage of one ElasticBuffer (module docstring), on its session ``s``; ``num_bytes`` /
    ``num_cpu_bytes``: the buffer's (fetched entries must fit ``num_bytes - num_cpu_bytes``, stored ones
    ``num_cpu_bytes``, as V2's)."""

    def __init__(self, session: Session, num_bytes: int, num_cpu_bytes: int) -> None:
        self.s, self.num_gpu_bytes, self.num_cpu_bytes = session, num_bytes - num_cpu_bytes, num_cpu_bytes
        self.table: ShardedEngramTable | None = None
        self.num_entries = self.per_rank = 0  # E, and the table's rows per rank P
        self.sf: torch.Tensor | None = None

    def engram_write(self, storage: torch.Tensor, sf: torch.Tensor | None = None) -> None:
        """Store this rank's entries ``storage [E, hidden]`` (bf16, or float8_e4m3fn with ``sf [W * E, S]``, every
        rank's factors, 4-byte packs); collective: every rank passes the same ``E``, ``hidden`` and dtype, and the
        entries are readable by every rank once it returns."""
        error = _storage_error(storage, sf, self.s.group_size, self.num_cpu_bytes)
        ok = error is None
        fields: list[tuple[str, FieldValue]] = [
            ("num_entries", storage.shape[0] if ok else None), ("hidden", storage.shape[1] if ok else None),
            ("storage dtype", storage.dtype if ok else None),
            ("sf columns", (sf.shape[1] if sf is not None else 0) if ok else None),
        ]  # fmt: skip
        self.s.agree("engram_write", f"engram_write: {error}" if error else None, fields)
        num_entries, hidden = storage.shape
        table = self.table
        if table is None or (table.dim, table.dtype, self.num_entries) != (hidden, storage.dtype, num_entries):
            self.close()
            w = self.s.group_size
            padded, self.per_rank = engram_table_partition(w * num_entries, w)
            table = ShardedEngramTable(padded, hidden, self.s.group, storage.dtype, storage.device, self.s.timeout)
            self.table, self.num_entries = table, num_entries
        table.load_rows(self.s.rank * self.per_rank, storage)
        self.sf = sf
        self.s.agree("barrier", None, [])  # every rank's entries are in place

    def engram_fetch(
        self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False
    ) -> FetchHook:
        """Start fetching the entries ``indices [T, entries_per_token]`` (int32, global entries in ``[0, W * E)``)
        names; collective (module docstring). Returns ``hook() -> (data [T, entries_per_token * hidden] of the
        storage's dtype, sf [T, entries_per_token * S] or None)``; with ``use_tma_aligned_col_major_sf`` the
        factors have V2's TMA strides ``(1, align(T, 4))``."""
        error = self._fetch_error(indices, num_qps)
        self.s.agree("engram_fetch", f"engram_fetch: {error}" if error else None, [])
        assert self.table is not None
        flat = indices.reshape(-1).long()
        rows = (flat // self.num_entries) * self.per_rank + flat % self.num_entries
        lookup = self.table.fetch(rows.to(torch.int32))
        num_tokens, per_token = indices.shape  # explicit widths: a rank may fetch no token
        sf = None
        if self.sf is not None:
            packs = per_token * self.sf.shape[1]
            sf = tma_scales(self.sf[flat].view(num_tokens, packs), use_tma_aligned_col_major_sf)
        width = per_token * self.table.dim

        def hook() -> tuple[torch.Tensor, torch.Tensor | None]:
            return lookup().view(num_tokens, width), sf

        return hook

    def _fetch_error(self, indices: object, num_qps: object) -> str | None:
        """Why ``engram_fetch(indices, num_qps)`` is invalid on this rank (None: fine)."""
        table = self.table
        if table is None:
            return "call engram_write first"
        if isinstance(num_qps, bool) or not isinstance(num_qps, int) or num_qps < 0:
            return f"num_qps must be an int >= 0, got {num_qps!r}"
        if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or indices.dtype != torch.int32:
            return f"indices must be a 2-D int32 tensor, got {getattr(indices, 'dtype', indices)!r}"
        if not indices.is_contiguous():
            return "indices must be contiguous"
        nbytes = indices.numel() * table.dim * table.dtype.itemsize
        if nbytes > self.num_gpu_bytes:
            return (
                f"{indices.numel()} entries of {table.dim} {table.dtype} take {nbytes} bytes; the buffer holds "
                f"{self.num_gpu_bytes} (num_bytes - num_cpu_bytes; see get_engram_storage_size_hint)"
            )
        entries = self.s.group_size * self.num_entries
        error = fetch_error(indices, None, entries, table.dim, table.dtype, table.device)
        return error.replace("row_ids", "indices").replace("num_rows", "num_ranks * num_entries") if error else None

    def close(self) -> None:
        """Release the table (collective where its shards are symmetric memory: every rank comes here together)."""
        if self.table is not None:
            self.table.close()
        self.table, self.sf, self.num_entries = None, None, 0
