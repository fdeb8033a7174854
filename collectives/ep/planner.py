"""How an EPBuffer chooses its paths, once, at construction: the transport (and the hosts or NVLink domains the
group spans), the buffers it needs, and then one normal-mode path and one low-latency path:

============================  =========================  ==========================
buffer                        normal mode                low latency
============================  =========================  ==========================
device kernels (in reach)     :class:`DeviceNormalPath`  :class:`DeviceLowLatencyPath`
hierarchical (several hosts)  :class:`HierNormalPath`    :class:`HostLowLatencyPath`
flat (shm, torch, nvshmem)    :class:`FlatNormalPath`    :class:`HostLowLatencyPath`
============================  =========================  ==========================
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, NamedTuple

from epkit.collectives.ep.config import EPConfig
from epkit.collectives.ep.context import EPContext
from epkit.collectives.ep.device_state import attach, kernel_area
from epkit.collectives.ep.hier_rows import HIERARCHICAL, PARTS
from epkit.collectives.ep.ll_device import DeviceLowLatencyPath
from epkit.collectives.ep.ll_host import HostLowLatencyPath
from epkit.collectives.ep.normal_device import DeviceNormalPath
from epkit.collectives.ep.normal_flat import FlatNormalPath
from epkit.collectives.ep.normal_hier import Hierarchy, HierNormalPath, flat_region
from epkit.collectives.ep.result_slots import ResultSlots, result_slot_count
from epkit.collectives.symm_buffer import SymmBuffer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Paths", "TRANSPORTS", "nvshmem_domains", "open_paths", "plan_transport"]

#: The transports an EPBuffer can be asked for.
TRANSPORTS = ("auto", "shm", "torch", "nvshmem", HIERARCHICAL)

NormalPath = FlatNormalPath | HierNormalPath | DeviceNormalPath
LowLatencyPath = HostLowLatencyPath | DeviceLowLatencyPath


class Paths(NamedTuple):
    """What :func:`open_paths` made: the context and the paths it chose."""

    ctx: EPContext
    normal: NormalPath
    low_latency: LowLatencyPath


def nvshmem_domains(group: ProcessGroup | None, timeout: float) -> list[list[int]]:
    """The group's NVLink domains (collective over ``group``): the ranks each rank reaches directly through
    NVSHMEM (``nvshmem_ptr`` of a small probe allocation, freed again), gathered; ascending lists, by first rank.
    When those sets are not a partition (a rank that reaches a peer which does not reach it back, or reaches a
    rank the peer does not), the whole group is one list: no hierarchy is built on a topology it cannot
    describe, and the sums keep the one-level order."""
    from epkit.collectives.bootstrap import Rendezvous
    from epkit.collectives.symm_buffer import SymmBuffer

    probe = SymmBuffer(group, 0, transport="nvshmem", num_signals=0, timeout=timeout)
    try:
        peer_data: list[int] = probe.impl.peer_data  # type: ignore[attr-defined]  # nvshmem's (the base lacks it)
        reach = [r for r, addr in enumerate(peer_data) if addr]
    finally:
        probe.close()
    sets = [tuple(s) for s in Rendezvous(group, timeout, "EPBuffer domain probe").gather("reach", reach)]
    if any(r not in s or any(sets[q] != s for q in s) for r, s in enumerate(sets)):
        return [list(range(len(sets)))]
    return [list(s) for s in sorted(set(sets))]


def plan_transport(group: ProcessGroup | None, transport: str, timeout: float) -> tuple[str, list[list[int]], str]:
    """``(transport, hosts, rows)`` for an EPBuffer on ``group`` asking for ``transport``; collective over the group.
    ``rows``: ``"cpu"`` or ``"cuda"``, the kind of ranks (the key of :data:`PARTS` a hierarchy is made of).

    CUDA ranks (an NCCL-only group, or a gloo group of CPU stand-ins for them when the NVSHMEM emulator is
    installed and ``nvshmem`` or ``hierarchical`` is asked for) find their NVLink domains
    (:func:`nvshmem_domains`): ``auto`` and ``hierarchical`` take :data:`HIERARCHICAL` over domains of one size
    with more than one rank each, else ``nvshmem``; ``nvshmem`` stays flat (two-level sums when there are several
    domains). CPU ranks of a gloo group meet once (a rendezvous: every rank gets the same answer) to find their
    hosts (:func:`~epkit.collectives.transports.host_groups`, confirmed by a shared segment). ``auto`` then takes
    ``shm`` on one host, :data:`HIERARCHICAL` on several hosts of equal size, ``torch`` on hosts of unequal
    sizes (the hierarchy pairs rank l of every host: flat ``torch`` instead). An explicit ``hierarchical``
    on one host is ``shm``, on unequal hosts ``torch``; an explicit ``shm`` is one host, unprobed.
    """
    from epkit.collectives.bootstrap import Rendezvous, group_info, host_identity
    from epkit.collectives.transports import host_groups, nvshmem_job

    _, w, _, backend = group_info(group)
    nccl_only = "nccl" in backend and "gloo" not in backend
    if nccl_only or (nvshmem_job.emulated() and transport in ("nvshmem", HIERARCHICAL)):
        if transport not in ("auto", "nvshmem", HIERARCHICAL):
            return transport, [list(range(w))], "cuda"
        domains = nvshmem_domains(group, timeout)
        sizes = {len(d) for d in domains}
        if transport != "nvshmem" and len(domains) > 1 and len(sizes) == 1 and sizes.pop() > 1:
            return HIERARCHICAL, domains, "cuda"
        return "nvshmem", domains, "cuda"
    if transport == "shm":  # shared memory is one host by definition (SymmBuffer refuses it otherwise): no probe
        return transport, [list(range(w))], "cpu"
    rv = Rendezvous(group, timeout, "EPBuffer host probe")
    hellos = rv.gather("hello", {"host": host_identity(), "pid": os.getpid()})
    hosts = host_groups(hellos, rv)
    if transport not in ("auto", HIERARCHICAL):
        return transport, hosts, "cpu"
    if len(hosts) == 1:
        return "shm", hosts, "cpu"
    return (HIERARCHICAL if len({len(g) for g in hosts}) == 1 else "torch"), hosts, "cpu"


def open_paths(group: ProcessGroup | None, cfg: EPConfig, transport: str, kernels: str) -> Paths:
    """Plan the transport (collective over ``group``), make the buffers and choose the paths. ``cfg`` without
    hosts (they are found here). Every buffer made is closed again if a later step fails."""
    if transport not in TRANSPORTS:
        raise ValueError(
            f"EPBuffer transport must be 'auto', 'shm', 'torch', 'nvshmem' or 'hierarchical', got {transport!r}"
        )
    transport, hosts, rows = plan_transport(group, transport, cfg.timeout)
    cfg = dataclasses.replace(cfg, hosts=tuple(tuple(g) for g in hosts))
    sizes, w = cfg.sizes, cfg.world_size
    n, n_ll = cfg.num_max_tokens_per_rank, cfg.num_max_dispatch_tokens_per_rank
    ll_sized = sizes.low_latency >= sizes.normal
    knob = "num_max_dispatch_tokens_per_rank" if ll_sized else "num_max_tokens_per_rank"
    hint = (
        f"EPBuffer's {w} regions of {sizes.region_bytes} bytes are sized by its "
        f"{'low-latency' if ll_sized else 'normal'} mode (num_max_tokens_per_rank={n}, "
        f"num_max_dispatch_tokens_per_rank={n_ll}, hidden={cfg.hidden}, num_experts={cfg.num_experts}): lower {knob}"
    )
    region, hy = sizes.region_bytes, None
    if transport == HIERARCHICAL:  # the flat buffer carries the agreements and the low-latency mode only
        region = flat_region(sizes, cfg.hidden, cfg.num_topk, cfg.num_local_experts, n_ll)
        parts = PARTS[rows]
        hy = Hierarchy(group, hosts, cfg.hidden, cfg.num_topk, n, cfg.timeout, parts, hint)
        transport = parts[0]
    try:
        mode, layout = kernel_area(cfg, kernels, transport, group)
        num_bytes = region * w + layout.get("total", 0)
        slots, count = None, result_slot_count()
        if transport == "shm" and not layout and count:  # normal-mode results written by the senders
            cap, h = w * n, cfg.hidden
            slots = ResultSlots(num_bytes, count, cap, 4 * h, 4 * -(-h // 128))
            num_bytes += slots.nbytes
            hint += (
                f"; {count} result slots add {slots.nbytes} bytes (every row a rank can receive, "
                f"world_size * num_max_tokens_per_rank, each; EPKIT_RESULT_SLOTS=0 turns them off)"
            )
        buffer = SymmBuffer(group, num_bytes, transport=transport, timeout=cfg.timeout, memory_hint=hint)
        if slots is not None:
            slots.buffer = buffer
    except BaseException:
        if hy is not None:
            hy.close()
        raise
    name = f"{HIERARCHICAL}({hy.intra.transport}+{hy.rail.transport})" if hy is not None else buffer.transport
    ctx = EPContext(cfg, buffer, region, name, slots, hy.buffers() if hy is not None else ())
    try:
        dev = attach(ctx, mode, layout)
    except BaseException:
        for b in ctx.all_buffers():
            b.close()
        raise
    if dev is not None:
        return Paths(ctx, DeviceNormalPath(ctx, dev), DeviceLowLatencyPath(ctx, dev))
    normal = HierNormalPath(ctx, hy) if hy is not None else FlatNormalPath(ctx)
    return Paths(ctx, normal, HostLowLatencyPath(ctx))
