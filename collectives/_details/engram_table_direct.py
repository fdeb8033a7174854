"""ShardedEngramTable within one domain: each rank reads the rows it needs straight out of their owners' shards.

Where every rank of the ENP group can address every other rank's memory (the ``shm`` transport: CPU ranks on
one host; ``nvshmem`` with a peer view of every rank: GPUs of one NVLink domain), the shards live in one
:class:`~epkit.collectives.symm_buffer.SymmBuffer` and a lookup moves no row id and no row through an exchange.
One rank's buffer data::

    [ request headers: world_size x HEADER_BYTES | padding to 4096 | shard: num_per_part x dim rows ]

``fetch`` (collective) is one exchange of the request headers through the buffer: an error flag and, for a bad
call, its text (8 bytes for a good one). Every rank so learns whether any call was bad before any row is read,
and that every rank has reached this fetch, so that each shard holds what its rank wrote before (on nvshmem the
header's signal is ordered after the rank's earlier writes on its stream). The hook is one copy of each
requested row from its owner's shard into the result, by address (``epkit._C.gather_rows_by_address`` for CPU
memory; :func:`~epkit.collectives.ep.rows.copy_rows_by_address`, the Triton copy kernel, on the GPU; the same
source addresses either way), duplicates and all, in the requested order; then it adds 1 to its "lookups read"
word at every owner (user signal ``reader rank`` of the owner).

The only writer of a shard is its own rank (``load_rows``, or the ``weight`` attribute): ``load_rows`` first
waits until every peer has read for every lookup this rank took part in, so no reader ever sees a row being
rewritten; the rows a lookup returns are their owners' as of that lookup's ``fetch``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epkit.collectives.ep.rows import (
    META_MSG,
    RowPool,
    align_up,
    by_address,
    copy_rows_by_address,
    decode_error,
    encode_error,
)

__all__ = [
    "HEADER_BYTES",
    "TRANSPORT_CHOICES",
    "DirectHook",
    "DirectShard",
    "make_direct_shard",
    "shard_offset",
]

#: One rank's request header: int64 [error flag, 0], then the error text (``ep.rows.META_MSG`` bytes).
HEADER_BYTES = 16 + META_MSG
_SHARD_ALIGN = 4096
#: What ``ShardedEngramTable(transport=)`` takes.
TRANSPORT_CHOICES = ("auto", "shm", "nvshmem", "torch")


def make_direct_shard(group, transport: str, num_per_part: int, dim: int, dtype, device, timeout: float):
    """The table's shard in symmetric memory when every peer is addressable, else None (the all_to_all path).

    Collective over ``group``. ``transport``: ``"auto"`` (``shm`` for a CPU table whose ranks share one host,
    ``nvshmem`` for a CUDA table where it runs; None otherwise), ``"shm"`` / ``"nvshmem"`` (that one, or an
    error), ``"torch"`` (None); one of :data:`TRANSPORT_CHOICES`, checked by the caller. Every rank takes the
    same path: the ranks agree on reachability.
    """
    from epkit.backends import BackendUnavailableError
    from epkit.collectives.symm_buffer import SymmBuffer
    from epkit.collectives.transports import all_on_one_host

    name = "shm" if device.type == "cpu" else "nvshmem"
    if transport == "torch":
        return None
    if transport not in ("auto", name):
        raise ValueError(f"transport = {transport!r} cannot hold a table on {device}; it takes {name!r} or 'torch'")
    w = dist.get_world_size(group)
    if transport == "auto" and name == "shm" and not all_on_one_host(group, timeout):
        return None
    nbytes = shard_offset(w) + num_per_part * dim * dtype.itemsize
    hint = "the table's rows per rank (num_rows / enp_size) set it"
    try:
        buf = SymmBuffer(group, nbytes, transport=name, num_signals=w, timeout=timeout, memory_hint=hint)
    except BackendUnavailableError:
        if transport != "auto":
            raise
        return None
    reachable = torch.tensor([int(buf.is_within_domain())], dtype=torch.int64, device=device)
    dist.all_reduce(reachable, op=dist.ReduceOp.MIN, group=group)
    if not int(reachable.item()):
        buf.close()
        if transport != "auto":
            raise ValueError(f"transport = {transport!r}: some rank of the ENP group cannot address every peer")
        return None
    return DirectShard(buf, num_per_part, dim, dtype)


def shard_offset(world_size: int) -> int:
    """Byte offset of the shard in a rank's buffer data (past the request headers)."""
    return align_up(world_size * HEADER_BYTES, _SHARD_ALIGN)


class DirectShard:
    """This rank's shard in ``buf`` and the lookup protocol over every rank's (see the module docstring).

    Attributes
    ----------
    buf : SymmBuffer
    weight : Tensor [num_per_part, dim]
        The local shard, a view of ``buf.local``.
    lookups : int
        Lookups (fetches) this rank took part in; every peer's "lookups read" word reaches it before a rewrite.
    pool : RowPool or None
        Memory of the results of fetches without ``out`` (CPU tables): a fresh multi-MiB result would take a page
        fault per 4 KiB page on its first write, longer than the reads themselves.
    """

    def __init__(self, buf, num_per_part: int, dim: int, dtype: torch.dtype):
        self.buf = buf
        self.num_per_part, self.row_bytes = num_per_part, dim * dtype.itemsize
        off, n = shard_offset(buf.world_size), num_per_part * self.row_bytes
        self.weight = buf.local[off : off + n].view(dtype).view(num_per_part, dim)
        self.weight.zero_()  # padding rows stay zero (nvshmem memory is not cleared)
        self._peers = [buf.peer(r) for r in range(buf.world_size)]  # views keep peers' memory mapped
        self.bases = [v.data_ptr() + off for v in self._peers]
        # source address of global row g: g * row_bytes + adjust[g // num_per_part]
        adjust = [b - r * num_per_part * self.row_bytes for r, b in enumerate(self.bases)]
        self._adjust = torch.tensor(adjust, dtype=torch.int64, device=buf.local.device)
        self.lookups = 0
        self.pool = RowPool() if buf.local.device.type == "cpu" else None

    def request(self, error: str | None, timeout: float, group_ranks: list[int]) -> list[tuple[int, str]]:
        """fetch's collective step: exchange the error flags (and texts); returns the bad calls' (rank, text).

        A lookup with a bad call reads nothing: this rank counts it read at every owner at once.
        """
        buf, w = self.buf, self.buf.world_size
        header = torch.zeros(HEADER_BYTES // 8, dtype=torch.int64)
        if error is not None:
            header[0] = 1
            header[2:] = encode_error(error).view(torch.int64)
        payload = (header if error is not None else header[:1]).view(torch.uint8).to(buf.local.device)
        try:
            ex = buf.exchange(HEADER_BYTES, "engram table request", timeout)
            for k in range(w):
                dst = (buf.rank + k) % w
                ex.write(dst, payload)
                ex.commit(dst, HEADER_BYTES)
            views = ex.receive([HEADER_BYTES] * w)
            flags = torch.stack([v[:8] for v in views]).view(torch.int64).view(-1).cpu()
            bad = [(r, decode_error(views[r][16:].cpu())) for r in range(w) if int(flags[r])]
            ex.release()
        except TimeoutError as exc:
            raise TimeoutError(
                f"ShardedEngramTable: the request exchange with ENP ranks {group_ranks} did not complete within "
                f"{timeout:.1f} s (did every rank call fetch()?): {exc}"
            ) from exc
        self.lookups += 1
        if bad:
            self.read_done()
        return bad

    def sources(self, flat_ids: torch.Tensor) -> torch.Tensor:
        """Int64 ``[n]`` addresses of the rows ``flat_ids`` (validated global ids) in their owners' shards."""
        ids = flat_ids.to(torch.int64)
        owner = torch.div(ids, self.num_per_part, rounding_mode="floor")
        return ids * self.row_bytes + self._adjust[owner]

    def read(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """Copy row i of ``out`` ([n, dim], contiguous) from address ``src[i]``; then count this lookup read."""
        n = out.shape[0]
        if n and by_address(out, src):  # CPU memory: epkit._C's gather by address (multi-threaded memcpy)
            from epkit import _C

            _C.gather_rows_by_address(out.data_ptr(), src.data_ptr(), n, self.row_bytes, torch.get_num_threads())
        elif n:  # device memory: the copy kernel over address lists
            dst = torch.arange(n, dtype=torch.int64, device=out.device) * self.row_bytes + out.data_ptr()
            copy_rows_by_address(dst, src, self.row_bytes, [*self.bases, out.data_ptr(), self.row_bytes])
        self.read_done()

    def read_done(self) -> None:
        """Tell every owner that this rank has read for one more lookup (adds 1 to its word ``self.rank`` there)."""
        buf = self.buf
        for r in range(buf.world_size):
            if r != buf.rank:
                buf.signal(r, buf.rank, 1, op="add")

    def wait_readers(self, timeout: float, group_ranks: list[int]) -> None:
        """Wait until every peer has read for all :attr:`lookups` (before this rank rewrites its shard)."""
        buf = self.buf
        for r in range(buf.world_size):
            if r == buf.rank:
                continue
            try:
                buf.wait_until(r, ">=", self.lookups, timeout)
            except TimeoutError as exc:
                raise TimeoutError(
                    f"ShardedEngramTable.load_rows: ENP rank {group_ranks[r]} has not finished reading this rank's "
                    f"rows for all {self.lookups} lookups within {timeout:.1f} s (did it call every hook?)"
                ) from exc


class DirectHook:
    """Completes one fetch on the direct path: the rows are read when it is called (see the module docstring)."""

    def __init__(self, shard: DirectShard, shape, src=None, out=None, error=None, dim: int = 0, dtype=None):
        self._shard, self._shape, self._src, self._out, self._error = shard, tuple(shape), src, out, error
        self._dim, self._dtype = dim, dtype
        self._result = None

    def __call__(self) -> torch.Tensor:
        """The rows, ``[*row_ids.shape, dim]`` (``out`` when given to fetch); see ``ShardedEngramTable.fetch``."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            out = self._out
            if out is None:
                shape, pool = (*self._shape, self._dim), self._shard.pool
                if pool is not None:
                    out = pool.empty(shape, self._dtype)
                else:
                    out = torch.empty(shape, dtype=self._dtype, device=self._src.device)
            try:
                self._shard.read(self._src, out.view(-1, self._dim))
            finally:
                self._src = self._out = None  # a hook completes once
            self._result = out
        return self._result
