"""A CPU stand-in for ``torch.distributed._symmetric_memory`` with its NVSHMEM backend.

The nvshmem transport takes its memory from torch's symmetric memory where torch has NVSHMEM (the
``torch`` provider of ``transports/nvshmem_torch.py``). A CPU build of torch refuses every symmetric
allocation, so this module plays torch's part on CPU ranks, over the NVSHMEM emulator's heaps
(``epkit.testing.nvshmem_emulator``), with the behaviour of torch's NVSHMEM allocator that the
transport depends on:

- the backend is global and chosen with ``set_backend``; it cannot change after the first allocation;
- the first ``empty`` starts the NVSHMEM job over the *default* group (every rank takes part, PE
  numbers are global ranks), without epkit's module: epkit must ``attach`` before its ops work;
- ``empty`` does not zero the memory (here it is filled with 0xA5, so a transport that forgets to
  zero its signal words fails loudly);
- ``rendezvous(tensor, group)`` gives a handle whose ``buffer_ptrs`` are the group's peers' addresses
  of the allocation (``nvshmem_ptr``), 0 for peers outside the NVLink domain;
- with ``install(pool_offset=N)``, as torch's memory pool does, the tensor sits ``N`` bytes into its
  symmetric allocation: ``buffer_ptrs`` are then the allocation's addresses and ``handle.offset`` is ``N``.

Function names and signatures follow the installed torch's (``tests/test_nvshmem_torch_provider.py``
compares them). Use it in a rank process before the first nvshmem buffer::

    from epkit.testing import torch_symm_emulator
    torch_symm_emulator.install(p2p=True)          # also installs the NVSHMEM emulator
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from epkit.testing import nvshmem_emulator as _emu

__all__ = ["install", "uninstall", "calls", "EMULATED"]

EMULATED = True
_BACKENDS = ("NVSHMEM", "CUDA", "NCCL")
_GARBAGE = 0xA5

_state: dict = {"available": True, "backend": "CUDA", "allocated": False, "allocs": {}, "pool_offset": 0}
_calls: dict[str, int] = {}


def _count(what: str) -> None:
    _calls[what] = _calls.get(what, 0) + 1


def calls() -> dict[str, int]:
    """How often each function ran in this process (``set_backend:NVSHMEM`` counts the backend asked for)."""
    return dict(_calls)


def is_nvshmem_available() -> bool:
    _count("is_nvshmem_available")
    return _state["available"]


def set_backend(name) -> None:
    _count(f"set_backend:{name}")
    if name not in _BACKENDS:
        raise ValueError(f"unknown symmetric memory backend {name!r}")
    if _state["allocated"] and name != _state["backend"]:
        raise RuntimeError(
            f"the symmetric memory backend cannot be changed to {name} after a {_state['backend']} allocation"
        )
    _state["backend"] = name


def get_backend(device) -> str | None:
    return _state["backend"]


def empty(*size, dtype=None, device=None) -> torch.Tensor:
    """Uninitialised symmetric tensor from the NVSHMEM heap (collective over every rank of the default group)."""
    _count("empty")
    if _state["backend"] != "NVSHMEM":
        raise RuntimeError(f"the emulator models torch's NVSHMEM backend only; the backend is {_state['backend']}")
    if len(size) == 1 and isinstance(size[0], Sequence):
        size = tuple(size[0])
    dtype = dtype or torch.get_default_dtype()
    if not _emu._state["job"]:  # torch starts NVSHMEM over the default group at its first allocation
        uid = [_emu.get_unique_id() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(uid, src=0)
        _emu._start_job(uid[0], dist.get_rank(), dist.get_world_size())
    numel = 1
    for n in size:
        numel *= int(n)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    offset = _state["pool_offset"]
    base = _emu._malloc(offset + nbytes, zero=False)
    ctypes.memset(base, _GARBAGE, offset + nbytes)
    ptr = base + offset
    _state["allocated"] = True
    _state["allocs"][ptr] = (base, nbytes)
    raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8)[:nbytes].view(dtype).view(size)


class _SymmetricMemory:
    """The rendezvous handle: the attributes of torch's ``_SymmetricMemory`` the transport reads."""

    def __init__(self, ptr: int, base: int, nbytes: int, group, device: torch.device):
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.buffer_size = nbytes
        self.device = device
        self.offset = ptr - base
        ranks = dist.get_process_group_ranks(group)
        self.buffer_ptrs = [_emu._peer_ptr(base, pe) for pe in ranks]
        pad = _emu._malloc(2048, zero=True)  # torch's handle allocates its signal pad (collective)
        self.signal_pad_ptrs = [_emu._peer_ptr(pad, pe) for pe in ranks]


def rendezvous(tensor: torch.Tensor, group) -> _SymmetricMemory:
    _count("rendezvous")
    ptr = tensor.data_ptr()
    if ptr not in _state["allocs"]:
        raise RuntimeError("rendezvous: the tensor was not allocated with symmetric memory empty()")
    base, nbytes = _state["allocs"][ptr]
    return _SymmetricMemory(ptr, base, nbytes, group, tensor.device)


def install(p2p: bool = True, available: bool = True, backend: str = "CUDA", pool_offset: int = 0) -> None:
    """Make the nvshmem transport's torch provider use this stand-in (and the NVSHMEM emulator) here.

    Parameters
    ----------
    p2p : bool
        Peers directly addressable (see ``nvshmem_emulator.install``).
    available : bool
        What ``is_nvshmem_available()`` answers.
    backend : str
        The backend before epkit sets one (torch's default for CUDA is "CUDA").
    pool_offset : int
        Bytes between a symmetric allocation's start and the tensor ``empty`` returns (torch's memory pool
        carves tensors out of larger allocations; ``handle.offset`` says where).
    """
    from epkit.collectives.transports import nvshmem_torch

    _emu.install(p2p=p2p)
    _state["available"] = bool(available)
    _state["pool_offset"] = int(pool_offset)
    if not _state["allocated"]:  # installing again later (a second buffer) keeps the backend torch froze
        _state["backend"] = backend
    nvshmem_torch.use_torch_symm(sys.modules[__name__])


def uninstall() -> None:
    from epkit.collectives.transports import nvshmem_torch

    nvshmem_torch.use_torch_symm(None)
    _emu.uninstall()
