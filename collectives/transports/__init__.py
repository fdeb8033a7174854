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

import torch.distributed as dist

from epkit.collectives.transports.base import Transport

__all__ = ["TRANSPORTS", "Transport", "all_on_one_host", "choose", "create", "hello"]

#: Every transport: name -> (module, class) under epkit.collectives.transports (imported on first use).
TRANSPORTS = {
    "shm": ("shm", "ShmTransport"),
    "torch": ("torch", "TorchTransport"),
    "nvshmem": ("nvshmem", "NvshmemTransport"),
}


def all_on_one_host(group) -> bool:
    """Collective over ``group``: every rank reports this host's name."""
    host = os.uname().nodename
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, host, group=group)
    return len(set(hosts)) == 1


def hello(nccl: bool) -> dict:
    """What this rank tells the others first when a buffer is made (through the rendezvous): where it runs,
    its pid, the memory it can still give, and, for an NCCL group, why it cannot run nvshmem (None: it can)."""
    from epkit.collectives.bootstrap import host_identity, memory_available

    info = {"host": host_identity(), "pid": os.getpid(), "mem": memory_available(), "nvshmem": "not an NCCL group"}
    if nccl:
        from epkit.collectives.transports import nvshmem_job

        info["nvshmem"] = nvshmem_job.missing_reason()
    return info


def choose(hellos: list[dict], backend: str) -> str:
    """The ``auto`` transport from every rank's :func:`hello`: ``nvshmem`` for an NCCL group whose every rank
    can run it (else ``torch``), ``shm`` for a gloo group on one host, ``torch`` otherwise."""
    if "nccl" in str(backend):
        return "nvshmem" if all(h["nvshmem"] is None for h in hellos) else "torch"
    if backend == "gloo" and len({h["host"] for h in hellos}) == 1:
        return "shm"
    return "torch"


def create(name: str, rv, hellos: list[dict], num_bytes: int, num_signals: int) -> Transport:
    """Make transport ``name``'s part of a new buffer on this rank (collective over the rendezvous ``rv``)."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be 'auto' or one of {tuple(TRANSPORTS)}, got {name!r}")
    module, cls = TRANSPORTS[name]
    impl = getattr(importlib.import_module(f"epkit.collectives.transports.{module}"), cls)
    return impl(rv, hellos, num_bytes, num_signals)
