"""ENP-sharded Engram embedding table with a prefetchable row lookup.

An Engram layer's hashed n-gram table has hundreds of millions of rows, too many
to replicate on every rank. The table is split by rows over the ENP group:

    alignment    = lcm(256, enp_size)
    padded_rows  = ceil(num_rows / alignment) * alignment
    num_per_part = padded_rows // enp_size
    rank r owns global rows [r * num_per_part, (r + 1) * num_per_part)

and every rank allocates only its own part. A lookup is split in two so that it
can start before the model's layers run (hashes depend on token ids only):

``fetch(row_ids)``
    validates the ids, deduplicates them (``torch.unique`` with the inverse),
    counts the unique ids per owner and posts the request-count exchange
    (``all_to_all_single``, asynchronous); returns a hook at once.
``hook()``
    waits for the counts, exchanges the ids (``all_to_all_single``), serves the
    rows this rank owns to every requester (:func:`epkit.gather_rows` on the local
    shard), exchanges the rows back (``all_to_all_single``) and expands the unique
    rows to the requested order.

Serving is part of the collective flow: an owner gathers the rows others asked
for inside its own ``hook()``. Hence **every rank of the group must call
``fetch`` and then ``hook()``, in the same order** (a rank that needs no rows
passes an empty tensor); a rank that never calls its hook makes the others raise
``TimeoutError`` after ``timeout`` seconds. Rows travel as integer words, so a
lookup is bit-exact for every dtype.

Within one domain (every peer addressable: ``shm`` on one host, ``nvshmem`` in one
NVLink domain) the shards live in symmetric memory and a rank reads its rows straight
out of their owners' shards (:mod:`epkit.collectives._details.engram_table_direct`):
``fetch`` is one small exchange of error flags (every rank still calls it, in order),
the hook one copy per row and no exchange; the rows are bit for bit the same.

Bad input (ids outside ``[0, num_rows)``, a wrong dtype) is detected before any
row id is sent: the bad rank still takes part in the count exchange with an
error flag and raises ``ValueError`` in ``fetch``; its peers see the flag and
raise ``ValueError`` in ``hook()``. Nobody hangs and the group stays usable.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta

import torch

from epkit.collectives._details.engram_table_checks import fetch_error, rejection
from epkit.collectives._details.engram_table_direct import TRANSPORT_CHOICES, DirectHook, make_direct_shard
from epkit.collectives.bootstrap import Rendezvous
from epkit.collectives.ep.rows import META_MSG, RowPool, decode_error, encode_error
from epkit.collectives.transports.base import NOTICE_GRACE_S
from epkit.gather import gather_rows

__all__ = ["ShardedEngramTable", "engram_table_partition"]

INT32_MAX = 2**31 - 1
# Request header per peer: int64 [error flag, unique ids requested], then the error text (ep_rows.META_MSG bytes).
_HEADER_WORDS = 2 + META_MSG // 8
_ROW_ALIGN = 256


def engram_table_partition(num_rows: int, enp_size: int) -> tuple[int, int]:
    """Padded row count and rows per rank of an ENP-sharded table.

    Parameters
    ----------
    num_rows : int, >= 1
        Rows of the (unpadded) table.
    enp_size : int, >= 1
        Ranks the table is split over.

    Returns
    -------
    (padded_rows, num_per_part) : tuple of int
        ``padded_rows`` is ``num_rows`` rounded up to a multiple of ``lcm(256, enp_size)``;
        ``num_per_part = padded_rows // enp_size``.
    """
    for name, v in (("num_rows", num_rows), ("enp_size", enp_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} = {v!r}: expected an int >= 1")
    align = math.lcm(_ROW_ALIGN, enp_size)
    padded = -(-num_rows // align) * align
    return padded, padded // enp_size


def _words(t: torch.Tensor) -> torch.Tensor:
    """View a contiguous ``[n, dim]`` tensor as ``[n, W]`` int32 words (uint8 when rows are not 4-byte multiples)."""
    n = t.shape[0]
    row_bytes = t.shape[1] * t.element_size()
    flat = t.reshape(-1).view(torch.uint8)
    if row_bytes % 4 == 0 and t.data_ptr() % 4 == 0:
        return flat.view(torch.int32).view(n, row_bytes // 4)
    return flat.view(n, row_bytes)


class _FetchHook:
    """Completes one :meth:`ShardedEngramTable.fetch`; call it to get the rows (see the module docstring)."""

    def __init__(
        self,
        table,
        shape,
        counts_work=None,
        send_hdr=None,
        recv_hdr=None,
        send_counts=None,
        send_ids=None,
        inverse=None,
        out=None,
    ):
        self._table, self._shape = table, shape
        self._counts_work, self._send_hdr, self._recv_hdr = counts_work, send_hdr, recv_hdr
        self._send_counts, self._send_ids, self._inverse = send_counts, send_ids, inverse
        self._out = out
        self._result = None
        self._error = None

    def __call__(self) -> torch.Tensor:
        """Wait for the lookup and return the rows.

        Returns
        -------
        Tensor [*row_ids.shape, dim] of the table's dtype
            Row ``table[row_ids[i]]`` at position ``i``; bit-exact copies (``out`` when given to ``fetch``).

        Raises
        ------
        ValueError
            Some rank of the group passed invalid row ids to its ``fetch``.
        TimeoutError
            A peer did not take part within the table's ``timeout``.
        """
        if self._error is not None:
            raise self._error
        if self._result is None:
            try:
                self._result = self._complete()
            except (ValueError, TimeoutError) as exc:
                self._error = exc
                raise
            finally:  # drop the request state: a hook completes once
                self._counts_work = self._send_hdr = self._recv_hdr = self._send_ids = self._inverse = self._out = None
        return self._result

    def _complete(self) -> torch.Tensor:
        t = self._table
        if t.enp_size == 1:
            flat = self._send_ids  # the validated ids themselves
            return self._finish(gather_rows(t.weight, flat, self._flat_out(flat.numel()), check_index=False))
        t._wait(self._counts_work, "request counts")
        hdr = self._recv_hdr.view(t.enp_size, _HEADER_WORDS).cpu()
        t._raise_rejections(hdr)
        recv_counts = hdr[:, 1].tolist()
        send_counts = self._send_counts
        dev = t.weight.device
        # 1. ids: each owner receives the local row offsets it must serve.
        recv_ids = torch.empty(sum(recv_counts), dtype=torch.int32, device=dev)
        t._wait(
            t._a2a(recv_ids, self._send_ids, recv_counts, send_counts),
            "row ids",
        )
        # 2. serve: gather the requested rows of the local shard.
        served = gather_rows(t.weight, recv_ids, t._empty((recv_ids.numel(), t.dim)))
        # 3. rows back to the requesters, in the order they asked (sorted unique ids).
        uniq_rows = t._empty((self._send_ids.numel(), t.dim))
        t._wait(t._a2a(_words(uniq_rows), _words(served), send_counts, recv_counts), "rows")
        out = self._flat_out(self._inverse.numel())
        return self._finish(gather_rows(uniq_rows, self._inverse, out, check_index=False))

    def _flat_out(self, n: int) -> torch.Tensor:
        """Where the ``n`` result rows go: ``out`` (as rows) or a fresh row tensor."""
        if self._out is not None:
            return self._out.view(-1, self._table.dim)
        return self._table._empty((n, self._table.dim))

    def _finish(self, rows: torch.Tensor) -> torch.Tensor:
        return self._out if self._out is not None else rows.view(*self._shape, self._table.dim)


class ShardedEngramTable:
    """An Engram embedding table split by rows over an ENP process group.

    Parameters
    ----------
    num_rows : int, >= 1
        Rows of the full table (``sum`` of a layer's head table sizes).
    dim : int, >= 1
        Values per row (``engram_head_dim``).
    group : ProcessGroup, ParallelGroups or None
        The ENP group (gloo for CPU tables). A :class:`epkit.topology.ParallelGroups`
        contributes its ``enp`` group (the gloo twin for CPU tables). ``None``: the
        default group when torch.distributed is initialised, else one rank.
    dtype : torch.dtype
        Row dtype. Default ``torch.bfloat16``.
    device : str or torch.device
        Where the local shard lives. Default ``"cpu"``.
    timeout : float
        Seconds any wait on a peer may take before ``TimeoutError``. Default 30.
    transport : {"auto", "shm", "nvshmem", "torch"}
        How lookups reach the other ranks' shards. ``"auto"`` (default): straight out of their shards in
        symmetric memory where every peer is addressable (``shm``: CPU ranks on one host; ``nvshmem``: CUDA
        ranks of one NVLink domain), else ``all_to_all_single`` exchanges of ids and rows (``"torch"``).
        ``"shm"`` / ``"nvshmem"`` insist (an error where they cannot run).

    Attributes
    ----------
    num_rows, dim, dtype, enp_size, enp_rank
    transport : str
        The path lookups take: ``"shm"`` or ``"nvshmem"`` (one-sided reads), ``"torch"`` (all_to_all) or
        ``"local"`` (one rank).
    padded_rows : int
        ``num_rows`` rounded up to a multiple of ``lcm(256, enp_size)``.
    num_per_part : int
        ``padded_rows // enp_size``: rows every rank owns.
    row_start : int
        First global row of this rank's part: ``enp_rank * num_per_part``.
    weight : Tensor [num_per_part, dim]
        The local shard (rows past ``num_rows`` are padding and stay zero).

    Notes
    -----
    Constructing the table is collective when ``enp_size > 1``: the ranks check that
    they agree on ``num_rows``, ``dim`` and the row size. ``fetch`` / hook are
    collective too (see :meth:`fetch`).

    Examples
    --------
    >>> table = ShardedEngramTable(1000, 16, group=None, dtype=torch.float32)
    >>> table.load_rows(0, torch.arange(16000.0).view(1000, 16))
    >>> hook = table.fetch(torch.tensor([[3, 3], [999, 0]]))
    >>> hook().shape
    torch.Size([2, 2, 16])
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        group=None,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        timeout: float = 30.0,
        transport: str = "auto",
    ):
        for name, v in (("num_rows", num_rows), ("dim", dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} = {v!r}: expected an int >= 1")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype = {dtype!r}: expected a torch.dtype")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout = {timeout!r}: expected a positive number of seconds")
        if transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport = {transport!r}: expected one of {TRANSPORT_CHOICES}")
        self.device = torch.device(device)
        self.group = self._resolve_group(group)
        import torch.distributed as dist

        if self.group is None:
            self.enp_size, self.enp_rank, self.group_ranks = 1, 0, [0]
        else:
            self.enp_size, self.enp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            self.group_ranks = dist.get_process_group_ranks(self.group)
        self.num_rows, self.dim, self.dtype, self.timeout = num_rows, dim, dtype, float(timeout)
        self.padded_rows, self.num_per_part = engram_table_partition(num_rows, self.enp_size)
        if self.padded_rows - 1 > INT32_MAX:
            raise ValueError(
                f"num_rows = {num_rows} pads to {self.padded_rows} rows; row ids must fit int32 (<= {INT32_MAX})"
            )
        self.row_start = self.enp_rank * self.num_per_part
        self._direct = None
        self._waits = 0  # this table's collective waits so far (a failed one's number keys its notes)
        self._rv: Rendezvous | None = None
        if self.enp_size > 1:
            try:  # where a failed wait notes itself, so the ranks that noted nothing are named (no communication)
                self._rv = Rendezvous(self.group, self.timeout, "ShardedEngramTable")
            except Exception:  # noqa: BLE001 -- no job store: a failed wait names no rank
                self._rv = None
            self._check_agreement()
            self._direct = make_direct_shard(self.group, transport, self.num_per_part, dim, dtype, self.device, timeout)
        self.transport = (
            "local" if self.enp_size == 1 else "torch" if self._direct is None else self._direct.buf.transport
        )
        if self._direct is not None:
            self.weight = self._direct.weight
        else:
            self.weight = torch.zeros((self.num_per_part, dim), dtype=dtype, device=self.device)
        # The all_to_all path's served rows, received rows and result on the CPU (pages kept mapped between lookups).
        self._pool = RowPool() if self.transport == "torch" and self.device.type == "cpu" else None

    # Setup

    def _resolve_group(self, group):
        import torch.distributed as dist

        if group is not None and hasattr(group, "groups") and hasattr(group, "cpu_groups"):  # ParallelGroups
            group = group.cpu_groups["enp"] if self.device.type == "cpu" else group.groups["enp"]
        if group is None:
            if not (dist.is_available() and dist.is_initialized()):
                return None
            group = dist.group.WORLD
        elif not (dist.is_available() and dist.is_initialized()):
            raise ValueError("group was given but torch.distributed is not initialised")
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"group = {group!r}: expected a ProcessGroup, a ParallelGroups or None")
        if dist.get_rank(group) < 0:
            raise ValueError(f"this rank ({dist.get_rank()}) is not a member of the given group")
        return group

    def _check_agreement(self) -> None:
        import torch.distributed as dist

        mine = torch.tensor([self.num_rows, self.dim, self.dtype.itemsize], dtype=torch.int64, device=self.device)
        both = torch.cat([mine, -mine])
        self._wait(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group, async_op=True), "table shape check")
        hi, lo = both[:3].tolist(), (-both[3:]).tolist()
        if hi != lo:
            raise ValueError(
                f"ShardedEngramTable: the ranks of the ENP group disagree on (num_rows, dim, row itemsize): "
                f"this rank has {mine.tolist()}, the group spans min {lo} / max {hi}"
            )

    def _a2a(self, out, inp, out_splits, in_splits):
        import torch.distributed as dist

        return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)

    def _empty(self, shape: tuple[int, int]) -> torch.Tensor:
        """An uninitialised row tensor of the table's dtype and device; on the CPU from :attr:`_pool`."""
        if self._pool is not None:
            return self._pool.empty(shape, self.dtype)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _wait(self, work, what: str) -> None:
        """Wait for a collective of the all_to_all path; a failure (the timeout, or a peer's connection gone) is a
        TimeoutError naming the ranks that went silent (:meth:`_silent`)."""
        self._waits += 1
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            text = str(exc).strip().splitlines()[0][:160]
            timed_out = "timed out" in text.lower() or "timeout" in text.lower()
            silent = self._silent(self._waits)
            head = f"ShardedEngramTable: exchange of {what} with ENP ranks {self.group_ranks} "
            head += f"did not complete within {self.timeout:.1f} s" if timed_out else f"failed ({text})"
            if silent and self._rv is not None:
                who = self._rv.names(silent)
                raise TimeoutError(f"{head}: {who} sent nothing (it died, or stopped calling)") from exc
            raise TimeoutError(f"{head} (did every rank call fetch() and the hook?)") from exc

    def _silent(self, n: int) -> list[int]:
        """After this rank's wait ``n`` failed: note so in the job's store, give the other ranks up to
        ``NOTICE_GRACE_S`` to note theirs (a live rank's wait fails too, on this exchange or one next to it: the
        ranks may be an exchange apart), and return the positions that noted nothing this recent (dead, frozen,
        or not calling); [] without a store."""
        rv = self._rv
        if rv is None:
            return []
        try:
            rv.store.set(f"stuck/{rv.rank}", str(n))
            deadline = time.monotonic() + NOTICE_GRACE_S
            while True:
                silent = [r for r in range(rv.world_size) if not self._noted(r, n)]
                if not silent or time.monotonic() >= deadline:
                    return silent
                time.sleep(0.02)
        except Exception:  # noqa: BLE001 -- a store out of reach: name no rank
            return []

    def _noted(self, r: int, n: int) -> bool:
        """Whether position ``r`` noted a failed wait within two of this rank's wait ``n``."""
        assert self._rv is not None
        key = f"stuck/{r}"
        return bool(self._rv.store.check([key])) and int(self._rv.store.get(key)) >= n - 2

    # Weights

    def load_rows(self, start: int, tensor: torch.Tensor) -> None:
        """Write rows ``[start, start + len(tensor))`` of the global table; keep the part this rank owns.

        Every rank may be given the same full tensor, or any slice; rows outside this
        rank's part are ignored. Local only (no communication); on the one-sided path
        (:attr:`transport` ``shm`` / ``nvshmem``) it first waits, up to ``timeout``, until
        every peer has called the hooks of the lookups before it (they read this shard).

        Parameters
        ----------
        start : int
            First global row, ``0 <= start`` and ``start + tensor.shape[0] <= num_rows``.
        tensor : Tensor [n, dim], floating point, any device
            Converted to the table's dtype with ``Tensor.to`` (exact when the dtypes match).
        """
        if isinstance(start, bool) or not isinstance(start, int):
            raise ValueError(f"start = {start!r}: expected an int")
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.shape[1] != self.dim:
            raise ValueError(
                f"tensor must be [n, dim = {self.dim}], got {type(tensor).__name__} "
                f"of shape {tuple(getattr(tensor, 'shape', ()))}"
            )
        if not (tensor.dtype.is_floating_point or tensor.dtype == self.dtype):
            raise ValueError(f"tensor has dtype {tensor.dtype}; expected a floating dtype (table dtype {self.dtype})")
        n = tensor.shape[0]
        if start < 0 or start + n > self.num_rows:
            raise ValueError(
                f"load_rows: rows [{start}, {start + n}) are outside the table [0, num_rows = {self.num_rows})"
            )
        lo = max(start, self.row_start)
        hi = min(start + n, self.row_start + self.num_per_part)
        if lo < hi:
            if self._direct is not None:  # peers read this shard directly: not while a lookup may still read it
                self._direct.wait_readers(self.timeout, self.group_ranks)
            self.weight[lo - self.row_start : hi - self.row_start].copy_(tensor[lo - start : hi - start])

    # Lookup

    def fetch(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> _FetchHook:
        """Start looking up rows; returns a hook that completes the lookup.

        Collective over the ENP group: every rank calls ``fetch`` and later the hook,
        in the same order (pass an empty tensor to request nothing). On the all_to_all
        path (:attr:`transport` ``torch``) ``fetch`` posts the request-count exchange and
        returns; the hook exchanges ids, serves the rows this rank owns to its peers, and
        receives its own rows. On the one-sided path (``shm``, ``nvshmem``) ``fetch``
        exchanges error flags with every rank (it returns once all have called it) and
        the hook reads the rows from their owners' shards, waiting for no one.

        Parameters
        ----------
        row_ids : Tensor [*], int32 or int64, on the table's device
            Global rows in ``[0, num_rows)``; any shape, duplicates and any order allowed.
        out : Tensor [*row_ids.shape, dim], optional
            Preallocated contiguous result of the table's dtype and device (reusing it saves
            the allocation and first-touch of a fresh result on every lookup); the hook returns it.

        Returns
        -------
        hook : callable
            ``hook() -> Tensor [*row_ids.shape, dim]`` (table dtype), ``table[row_ids]``
            bit for bit. Calling it again returns the same tensor. Without ``out``, a CPU table of
            several ranks takes the result from memory it reuses once no tensor holds it (its storage
            cannot be resized).

        Raises
        ------
        ValueError
            Invalid ``row_ids`` (message names the rank and the value). Raised before any row id is sent,
            here on the bad rank and by the hooks of its peers, in the same words on every rank.
        TimeoutError
            (multi-rank) a peer did not take part within ``timeout``: on the all_to_all path on a bad
            call, on the one-sided path a peer that does not call ``fetch``.
        """
        error = fetch_error(row_ids, out, self.num_rows, self.dim, self.dtype, self.device)
        if self.enp_size == 1:
            if error is not None:
                raise ValueError(f"ShardedEngramTable.fetch: {error}")
            return _FetchHook(self, tuple(row_ids.shape), send_ids=row_ids.reshape(-1), out=out)
        if self._direct is not None:
            return self._fetch_direct(row_ids, out, error)
        import torch.distributed as dist

        hdr = torch.zeros((self.enp_size, _HEADER_WORDS), dtype=torch.int64, device=self.device)
        recv_hdr = torch.empty(self.enp_size * _HEADER_WORDS, dtype=torch.int64, device=self.device)
        if error is not None:
            hdr[:, 0] = 1  # error flag and text; no requests
            hdr[:, 2:] = encode_error(error).view(torch.int64).to(self.device)
            work = dist.all_to_all_single(recv_hdr, hdr.view(-1), group=self.group, async_op=True)
            self._wait(work, "request counts (error flag)")
            self._raise_rejections(recv_hdr.view(self.enp_size, _HEADER_WORDS).cpu())
        # int32 ids (every row id fits: padded_rows - 1 <= INT32_MAX) sort in about half the time of int64.
        uniq, inverse = torch.unique(row_ids.reshape(-1).to(torch.int32), sorted=True, return_inverse=True)
        owner = torch.div(uniq, self.num_per_part, rounding_mode="floor")
        hdr[:, 1] = torch.bincount(owner, minlength=self.enp_size)
        work = dist.all_to_all_single(recv_hdr, hdr.view(-1), group=self.group, async_op=True)
        send_ids = uniq - owner * self.num_per_part  # int32: the owners' local offsets, grouped by owner
        return _FetchHook(
            self,
            tuple(row_ids.shape),
            counts_work=work,
            send_hdr=hdr,
            recv_hdr=recv_hdr,
            send_counts=hdr[:, 1].tolist(),
            send_ids=send_ids,
            inverse=inverse,
            out=out,
        )

    def _fetch_direct(self, row_ids, out, error: str | None) -> DirectHook:
        """fetch on the one-sided path: the request exchange (error flags), then a hook that reads the rows."""
        rejected = rejection(self.group_ranks, self._direct.request(error, self.timeout, self.group_ranks))
        if error is not None:
            raise rejected
        if rejected is not None:
            return DirectHook(self._direct, row_ids.shape, error=rejected)
        src = self._direct.sources(row_ids.reshape(-1))
        return DirectHook(self._direct, row_ids.shape, src, out, dim=self.dim, dtype=self.dtype)

    def _raise_rejections(self, hdr: torch.Tensor) -> None:
        """The same ValueError on every rank if any rank's fetch was invalid (``hdr``: the received headers)."""
        errors = [
            (i, decode_error(hdr[i, 2:].contiguous().view(torch.uint8)))
            for i in range(self.enp_size)
            if int(hdr[i, 0]) != 0
        ]
        if errors:
            raise rejection(self.group_ranks, errors)

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        """``fetch(row_ids)()``: a blocking lookup (collective, like :meth:`fetch`).

        Parameters
        ----------
        row_ids : Tensor [*], int32 or int64

        Returns
        -------
        Tensor [*row_ids.shape, dim]
        """
        return self.fetch(row_ids)()

    def close(self) -> None:
        """Release the symmetric memory of the one-sided path (collective on nvshmem, like
        :meth:`SymmBuffer.close`); the table cannot be used afterwards. Nothing to do on the other paths."""
        if self._direct is not None:
            self._direct.buf.close()

    def __repr__(self) -> str:
        return (
            f"ShardedEngramTable(num_rows={self.num_rows}, dim={self.dim}, dtype={self.dtype}, "
            f"enp={self.enp_rank}/{self.enp_size}, rows [{self.row_start}, {self.row_start + self.num_per_part}), "
            f"transport={self.transport!r})"
        )
