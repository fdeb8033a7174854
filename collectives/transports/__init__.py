"""Transports of :class:`~epkit.collectives.symm_buffer.SymmBuffer`, one file each behind one interface.

=========  ==================================================================  =====================
name       what moves the bytes                                                file
=========  ==================================================================  =====================
``shm``    CPU ranks on one host: POSIX shared memory, one-sided copies,       ``shm.py``
           64-bit signal words (``csrc/shm_transport.cpp``)
``torch``  torch.distributed collectives, any layout of hosts                  ``torch.py``
``nvshmem`` CUDA ranks: one NVSHMEM symmetric allocation per buffer, device    ``nvshmem.py`` (job:
           signals and timed waits (``csrc/cuda/nvshmem_transport.cu``)        ``nvshmem_job.py``)
=========  ==================================================================  =====================

:class:`~epkit.collectives.transports.base.Transport` is the interface; the protocol built on it
(exchanges, barriers, failure notices) is written once, in ``symm_buffer.py``, ``exchange.py`` and
``peer_failure.py``, and asks a transport for capabilities (``direct``, ``stream_ordered``), never for
its name. A new transport is one file here plus one entry in :data:`TRANSPORTS`.
"""

from __future__ import annotations

import importlib
import os

from epkit.collectives.transports.base import Transport

__all__ = ["TRANSPORTS", "Transport", "all_on_one_host", "choose", "create", "hello", "host_groups"]

#: Every transport: name -> (module, class) under epkit.collectives.transports (imported on first use).
TRANSPORTS = {
    "shm": ("shm", "ShmTransport"),
    "torch": ("torch", "TorchTransport"),
    "nvshmem": ("nvshmem", "NvshmemTransport"),
}


def host_groups(hellos: list[dict], rv=None) -> list[list[int]]:
    """The ranks by host, from every rank's :func:`hello`: lists of ranks, ascending, ordered by first rank.

    A host is what :func:`~epkit.collectives.bootstrap.host_identity` names (kernel, network and pid
    namespaces, ``/dev/shm``; not the host name). With the rendezvous ``rv`` (collective), each group of
    several ranks is confirmed by a segment its first rank creates and the others attach
    (:func:`~epkit.collectives.transports.shm.confirm_hosts`); a rank that cannot attach is a host of its own.
    The hierarchical EPBuffer (``collectives/ep/normal_hier.py``) takes its hosts from here.
    """
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hellos):
        by_host.setdefault(h["host"], []).append(r)
    groups = sorted(by_host.values())
    if rv is not None:
        from epkit.collectives.transports.shm import confirm_hosts

        groups = confirm_hosts(rv, hellos, groups)
    return groups


def all_on_one_host(group, timeout: float = 30.0) -> bool:
    """Collective over ``group``: every rank shares one host, per :func:`host_groups` (confirmed by a segment).
    Bounded by ``timeout`` seconds; a rank that does not come is named in the ``TimeoutError``."""
    from epkit.collectives.bootstrap import Rendezvous, host_identity

    rv = Rendezvous(group, timeout, "host probe")
    hellos = rv.gather("hello", {"host": host_identity(), "pid": os.getpid()})
    return len(host_groups(hellos)) == 1 and len(host_groups(hellos, rv)) == 1


def hello(nccl: bool) -> dict:
    """What this rank tells the others first when a buffer is made (through the rendezvous): where it runs
    (``host``: :func:`~epkit.collectives.bootstrap.host_identity`; ``hostname``, for messages only),
    its pid, the memory it can still give, and, for an NCCL group, why it cannot run nvshmem (None: it can)."""
    from epkit.collectives.bootstrap import host_identity, memory_available

    info = {"host": host_identity(), "hostname": os.uname().nodename, "pid": os.getpid(), "mem": memory_available()}
    info["nvshmem"] = "not an NCCL group"
    if nccl:
        from epkit.collectives.transports import nvshmem_job

        info["nvshmem"] = nvshmem_job.missing_reason()
    return info


def choose(hellos: list[dict], backend: str, rv=None) -> str:
    """The ``auto`` transport from every rank's :func:`hello`: ``nvshmem`` for an NCCL group whose every rank
    can run it (else ``torch``), ``shm`` for a gloo group on one host (:func:`host_groups`; with the
    rendezvous ``rv``, collective, confirmed by attaching a segment), ``torch`` otherwise.

    This is one buffer's transport, the same for every peer: ranks on several hosts get ``torch``. The hierarchy
    (``shm`` inside each of :func:`host_groups`, ``torch`` between them) is made of several buffers, so it is
    chosen a level up, by :class:`~epkit.collectives.ep_buffer.EPBuffer` (``transport="auto"`` or
    ``"hierarchical"``; ``collectives/ep/normal_hier.py``), from the same host groups.
    """
    if "nccl" in str(backend):
        return "nvshmem" if all(h["nvshmem"] is None for h in hellos) else "torch"
    if backend == "gloo" and len(host_groups(hellos)) == 1:  # one candidate host: confirm it where rv is given
        return "shm" if rv is None or len(host_groups(hellos, rv)) == 1 else "torch"
    return "torch"


def create(name: str, rv, hellos: list[dict], num_bytes: int, num_signals: int) -> Transport:
    """Make transport ``name``'s part of a new buffer on this rank (collective over the rendezvous ``rv``)."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be 'auto' or one of {tuple(TRANSPORTS)}, got {name!r}")
    module, cls = TRANSPORTS[name]
    impl = getattr(importlib.import_module(f"epkit.collectives.transports.{module}"), cls)
    return impl(rv, hellos, num_bytes, num_signals)
