"""The one mutable state an EPBuffer's paths share: its symmetric buffers, the call counters that make handles
comparable across ranks, the load counters, the pools results come from, and retirement (a failure past an
agreement leaves the ranks' exchanges out of step: the buffer is retired on every rank)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from epkit._details.host_memory import mark_host_memory
from epkit.collectives.ep.config import EPConfig
from epkit.collectives.ep.ll_out import Pool
from epkit.collectives.ep.result_slots import ResultSlots
from epkit.collectives.ep.rows import RowPool, device_table
from epkit.collectives.symm_buffer import SymmBuffer

__all__ = ["EPContext"]


@dataclass(eq=False)
class EPContext:
    """``buffer``: the flat symmetric buffer over the whole group (``region_bytes`` per source, then the device
    kernels' area if any, then the result slots if any); ``sub_buffers``: a hierarchy's ``intra`` and ``rail``
    buffers (retired and closed with it); ``device``: where rows live; ``transport``: the name users see."""

    cfg: EPConfig
    buffer: SymmBuffer
    region_bytes: int
    transport: str
    result_slots: ResultSlots | None = None
    sub_buffers: tuple[SymmBuffer, ...] = ()
    #: Normal / low-latency dispatch calls so far (a handle's epoch), counted on every rank at every call.
    dispatches: int = 0
    ll_dispatches: int = 0
    #: Tokens received per local expert since the last ``take_expert_load`` (host-counted calls).
    recv_tokens_per_expert_total: torch.Tensor = field(init=False)
    #: The same, counted on the device by stream-ordered calls on CUDA rows (None until one counts).
    device_load: torch.Tensor | None = None
    row_pool: RowPool = field(default_factory=RowPool)
    addr_tables: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    #: The pool of the tensors low-latency calls return (``ll_out``).
    ll_outputs: Pool = field(default_factory=dict)

    #: Where rows live (the buffer's memory when made: a closed buffer's ``local`` is an empty CPU tensor).
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        counts = torch.zeros(self.cfg.num_local_experts, dtype=torch.int64)
        self.recv_tokens_per_expert_total = mark_host_memory(counts)
        self.device = self.buffer.local.device
        parts = self.all_buffers()
        for b in parts:  # one retired retires the others, naming the same culprit to their peers (weak: no cycle)
            b.siblings = tuple(weakref.proxy(p) for p in parts if p is not b)

    def all_buffers(self) -> tuple[SymmBuffer, ...]:
        return (self.buffer, *self.sub_buffers)

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A result tensor for rows on the buffer's device; on the CPU from the buffer's :class:`RowPool`."""
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self.row_pool.empty(shape, dtype)

    def addresses(self, values: list[int]) -> torch.Tensor:
        """``values`` (addresses of regions, a handle's identity) as a cached int64 table on the rows' device."""
        return device_table(self.addr_tables, values, self.device)

    def count_load(self, per_expert: torch.Tensor) -> None:
        """Add to the EPLB load counter without a host read (a device accumulator on CUDA rows)."""
        if per_expert.device == self.recv_tokens_per_expert_total.device:
            self.recv_tokens_per_expert_total += per_expert
            return
        self.device_load_counter().add_(per_expert)

    def device_load_counter(self) -> torch.Tensor:
        """Tokens received per local expert, counted on the rows' device (``take_expert_load`` adds it in)."""
        if self.device_load is None:
            self.device_load = torch.zeros(self.cfg.num_local_experts, dtype=torch.int64, device=self.device)
        return self.device_load

    def take_expert_load(self) -> torch.Tensor:
        out = self.recv_tokens_per_expert_total.clone()
        self.recv_tokens_per_expert_total.zero_()
        if self.device_load is not None:
            out += self.device_load.cpu()
            self.device_load.zero_()
        return out

    def drop_caches(self) -> None:
        self.ll_outputs.clear()
        self.addr_tables.clear()
        self.row_pool = RowPool()

    @contextlib.contextmanager
    def retire_on_failure(self, what: str) -> Iterator[None]:
        """Context for code that moves rows after every rank agreed on the call: any exception inside leaves the
        ranks' exchange counters out of step, so it retires every buffer of this EPBuffer and tells the peers
        before it propagates (their waits on this rank end at once with PeerFailedError). A sub-buffer's timeout
        says which global ranks its positions are."""
        try:
            yield
        except BaseException as exc:
            reason = f"{what} failed on {self.cfg.rank_name(self.cfg.rank)}: {type(exc).__name__}: {exc}"
            blame = getattr(exc, "culprit", None)  # a peer that went silent or gave up, by its global rank
            for buf in self.all_buffers():
                if blame is not None:
                    buf.mark_broken(reason, blame=blame)
                else:
                    buf.mark_broken(reason, culprit=buf.rank)
            raise

    def reject_locally(self, what: str, exc: Exception) -> NoReturn:
        """A call with no agreement step failed validation on this rank only: retire the buffer here, so the next
        call cannot pair with the peers' stale messages, and tell the peers, whose waits on this rank end at once
        (PeerFailedError) instead of timing out."""
        me = self.cfg.rank
        self.buffer.mark_broken(f"{what} rejected on {self.cfg.rank_name(me)}: {exc}", culprit=me)
        raise exc
