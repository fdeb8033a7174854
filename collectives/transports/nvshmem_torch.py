"""The ``torch`` memory provider of the ``nvshmem`` transport: PyTorch's NVSHMEM symmetric memory.

Where the installed torch has it (``torch.distributed._symmetric_memory``: ``is_nvshmem_available()``,
the backend set explicitly with ``set_backend("NVSHMEM")``, ``empty`` + ``rendezvous`` for the allocation
and its ``buffer_ptrs``), a buffer's memory comes from torch and epkit's kernels join torch's job
(``epkit._C_cuda.attach``). Everything here is feature-detected by name, never by version, and decided
identically on every rank from all-gathered facts. See :mod:`epkit.collectives.transports.nvshmem_job`
for the job itself and the choice between providers.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from epkit.backends import BackendUnavailableError
from epkit.collectives.transports import nvshmem_job

__all__ = [
    "PROVIDERS",
    "TORCH_SYMM_API",
    "agreed_preference",
    "claim_torch_backend",
    "plan_provider",
    "pool_keep",
    "pooled_numbers",
    "provider_preference",
    "symm_mem",
    "torch_alloc",
    "torch_backend_of",
    "torch_symm_reason",
    "use_torch_symm",
]

PROVIDERS = ("auto", "torch", "epkit")
#: torch.distributed._symmetric_memory's functions the torch provider calls (feature-detected by name).
TORCH_SYMM_API = ("is_nvshmem_available", "set_backend", "get_backend", "empty", "rendezvous")

# A stand-in for torch.distributed._symmetric_memory (epkit.testing.torch_symm_emulator), or None.
_torch_symm = None
# Closed buffers' allocations, by size, for reuse. torch's NVSHMEM allocator keeps every rendezvoused
# allocation for the life of the process, so memory handed back to it would never return. Entries are
# (allocation number, tensor, handle); allocations are collective, so every rank numbers them alike
# (addresses would not do: each PE may see its heap elsewhere).
_torch_pool: dict[int, list[tuple[int, torch.Tensor, object]]] = {}
_torch_allocations = 0


def use_torch_symm(module) -> None:
    """Route the torch provider through ``module`` instead of ``torch.distributed._symmetric_memory``
    (None: back to torch's). Tests install ``epkit.testing.torch_symm_emulator`` this way."""
    global _torch_symm
    _torch_symm = module


def symm_mem():
    if _torch_symm is not None:
        return _torch_symm
    import torch.distributed._symmetric_memory as sm

    return sm


def torch_symm_reason() -> str | None:
    """Why this rank cannot take its buffers from torch's NVSHMEM symmetric memory, or None when it can.

    Feature detection, not version checks: the module must import and have every function the provider
    calls, and ``is_nvshmem_available()`` must be true (torch built with NVSHMEM, ``libnvshmem_host.so.3``
    loadable). Whether the backend can still be switched to NVSHMEM is only known by trying (see
    :class:`NvshmemState`).
    """
    if _torch_symm is None and nvshmem_job.emulated():
        return "the NVSHMEM emulator is installed without torch's stand-in (epkit.testing.torch_symm_emulator)"
    try:
        if not callable(getattr(nvshmem_job.extension(), "attach", None)):
            return "epkit._C_cuda predates attach() (rebuild it to join torch's NVSHMEM job)"
    except ImportError as exc:
        return f"epkit._C_cuda is not importable ({exc})"
    try:
        sm = symm_mem()
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory is not importable ({exc})"
    missing = [name for name in TORCH_SYMM_API if not callable(getattr(sm, name, None))]
    if missing:
        return f"this torch's symmetric memory lacks {missing}"
    try:
        available = bool(sm.is_nvshmem_available())
    except Exception as exc:  # noqa: BLE001 -- any failure of the probe means "not usable", with its reason
        return f"torch's is_nvshmem_available() failed ({type(exc).__name__}: {exc})"
    if not available:
        return "torch reports NVSHMEM unavailable (built without it, or libnvshmem_host.so.3 is not loadable)"
    return None


def provider_preference() -> str:
    """``EPKIT_NVSHMEM_PROVIDER`` as this process sets it, normalised (``auto`` when unset); checked by the
    buffer after every rank's value is gathered, so that a bad or differing value fails on every rank."""
    return os.environ.get("EPKIT_NVSHMEM_PROVIDER", "auto").strip().lower() or "auto"


def agreed_preference(prefs: list[str]) -> str:
    """The one provider preference of the group, or ValueError (identical on every rank)."""
    bad = {r: p for r, p in enumerate(prefs) if p not in PROVIDERS}
    if bad:
        raise ValueError(
            f"EPKIT_NVSHMEM_PROVIDER must be one of {PROVIDERS}; ranks {list(bad)} set {list(bad.values())}"
        )
    if len(set(prefs)) != 1:
        raise ValueError(f"EPKIT_NVSHMEM_PROVIDER differs across ranks ({prefs}); set the same value on every rank")
    return prefs[0]


def plan_provider(
    plan: str, states: list[tuple], torch_reasons: list[str | None], prefer: str, whole_world: bool
) -> tuple[str, str]:
    """Which provider a new buffer's memory comes from, decided identically on every rank.

    Parameters
    ----------
    plan : str
        :func:`plan_job`'s answer.
    states : list of tuple
        :func:`local_job_state` of each group rank.
    torch_reasons : list of (str or None)
        :func:`torch_symm_reason` of each group rank.
    prefer : {"auto", "torch", "epkit"}
        :func:`provider_preference`.
    whole_world : bool
        The group holds every rank of the default group, in order (torch's NVSHMEM job spans the
        default group and numbers PEs by global rank).

    Returns
    -------
    (provider, note) : tuple of str
        ``"torch"`` or ``"epkit"``, and why torch's was not taken ("" when it was, or when the job
        already decided).

    Raises
    ------
    BackendUnavailableError
        ``prefer="torch"`` where some rank cannot use it; or NVSHMEM already runs (``attach``) and some
        rank cannot join it through torch.
    ValueError
        NVSHMEM already runs (``attach``) but ``prefer="epkit"``: epkit's own binding cannot start a second job.
    """
    if plan == "reuse":
        return ("torch" if len(states[0]) > 3 and states[0][3] == "torch" else "epkit"), ""
    if plan == "adopt":
        return "epkit", ""
    blockers = [f"rank {r}: {why}" for r, why in enumerate(torch_reasons) if why]
    if not whole_world:
        blockers.append("the group is not every rank of the default group, over which torch starts NVSHMEM")
    if len(states) == 1:  # measured on torch 2.11 (H200): rendezvous fails "Expected global_ranks.size() > 1"
        blockers.append("a one-rank group (torch's symmetric-memory rendezvous needs two or more ranks)")
    note = "torch's NVSHMEM symmetric memory is not used (" + "; ".join(blockers) + ")" if blockers else ""
    if plan == "attach":
        if prefer == "epkit":
            raise ValueError(
                "NVSHMEM already runs in these processes (torch's symmetric memory started it); epkit can join that "
                "job only through torch, but EPKIT_NVSHMEM_PROVIDER=epkit"
            )
        if blockers:
            raise BackendUnavailableError(
                "NVSHMEM already runs in these processes, started outside epkit; epkit can join that job only "
                "through torch's symmetric memory, but " + "; ".join(blockers)
            )
        return "torch", ""
    if prefer == "epkit":
        return "epkit", "EPKIT_NVSHMEM_PROVIDER=epkit"
    if blockers and prefer == "torch":
        raise BackendUnavailableError(f"EPKIT_NVSHMEM_PROVIDER=torch, but {note}")
    return ("epkit", note) if blockers else ("torch", "")


def _torch_backend(sm, device: torch.device) -> tuple[str | None, str | None]:
    """Set torch's symmetric-memory backend to NVSHMEM for ``device``: ``(previous backend, error or None)``."""
    try:
        previous = sm.get_backend(device)
        if previous != "NVSHMEM":
            sm.set_backend("NVSHMEM")
    except Exception as exc:  # noqa: BLE001 -- torch refuses once another backend allocated; say so, all ranks
        return None, f"set_backend('NVSHMEM') failed ({type(exc).__name__}: {exc})"
    return previous, None


def _tensor_bases(handle, data_ptr: int, rank: int) -> list[int]:
    """Each rank's address of the rendezvoused tensor (0 where not directly addressable).

    ``buffer_ptrs`` are the peers' addresses of the tensor itself, or, where torch carves tensors out of a
    larger symmetric allocation (its memory pool), of that allocation, the tensor sitting ``handle.offset``
    bytes in. Which one holds is read off this rank's own entry.
    """
    raw = [int(p or 0) for p in handle.buffer_ptrs]
    offset = int(getattr(handle, "offset", 0) or 0)
    if offset and 0 <= rank < len(raw) and raw[rank] != data_ptr and raw[rank] + offset == data_ptr:
        return [p + offset if p else 0 for p in raw]
    return raw


def torch_backend_of(device: torch.device) -> str:
    """torch's symmetric-memory backend for ``device`` (a reason string in its place if the query fails)."""
    try:
        return symm_mem().get_backend(device)
    except Exception as exc:  # noqa: BLE001 -- a reason like any other, gathered by the caller
        return f"unknown ({type(exc).__name__}: {exc})"


def pooled_numbers(alloc: int) -> list[int]:
    """Numbers of this process's pooled allocations of ``alloc`` bytes (all-gathered to pick a common one)."""
    return [number for number, _, _ in _torch_pool.get(alloc, [])]


def pool_keep(memory: tuple) -> None:
    """Keep a cleanly closed buffer's ``(number, tensor, handle)`` for the next buffer of its size."""
    _torch_pool.setdefault(memory[1].numel(), []).append(memory)


def claim_torch_backend(group, world_size: int, device: torch.device, prefer: str) -> tuple[str, str]:
    """Set torch's backend to NVSHMEM on every rank (collective); where some rank cannot, undo it and fall
    back to epkit's binding (``auto``: returns ``("epkit", why)``) or raise (``torch``)."""
    sm = symm_mem()
    previous, error = _torch_backend(sm, device)
    errors = [None] * world_size
    dist.all_gather_object(errors, error, group=group)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if not failed:
        return "torch", ""
    if error is None and previous not in (None, "NVSHMEM"):
        # Nothing was allocated with NVSHMEM here: give the user's backend back (best effort).
        with contextlib.suppress(Exception):
            sm.set_backend(previous)
    note = "torch's NVSHMEM symmetric memory is not used (" + "; ".join(failed) + ")"
    if prefer == "torch":
        raise BackendUnavailableError(f"EPKIT_NVSHMEM_PROVIDER=torch, but {note}")
    return "epkit", note


def _take(alloc: int, reuse: int | None, device: torch.device, group):
    """Pooled allocation number ``reuse``, or a new rendezvoused one: ``(number, tensor, handle)``."""
    global _torch_allocations
    if reuse is not None:
        pool = _torch_pool[alloc]
        return pool.pop(next(i for i, entry in enumerate(pool) if entry[0] == reuse))
    sm = symm_mem()
    _torch_allocations += 1
    tensor = sm.empty(alloc, dtype=torch.uint8, device=device)  # torch starts NVSHMEM at the first
    return _torch_allocations, tensor, sm.rendezvous(tensor, group)


def torch_alloc(group, rank: int, world_size: int, device: torch.device, alloc: int, reuse: int | None, cc):
    """Allocate through torch's symmetric memory (or take pooled allocation number ``reuse``, pooled on every
    rank), join its job, zero the memory. Collective over ``group``; a failure on any rank raises on every rank.

    Returns ``(bases, memory)``: each rank's base address as seen from this GPU (0 where not directly
    addressable), and the ``(number, tensor, handle)`` to give :func:`pool_keep` at a clean close.
    """
    error, bases, memory = None, [], None
    try:
        memory = _take(alloc, reuse, device, group)
        _, tensor, handle = memory
        bases = _tensor_bases(handle, tensor.data_ptr(), rank)
        if tensor.data_ptr() == 0:  # torch does not check nvshmem_malloc's result
            error = f"the allocation of {alloc} bytes gave a null pointer (the symmetric heap is exhausted)"
        elif len(bases) != world_size or bases[rank] != tensor.data_ptr():
            error = (
                f"rendezvous gave buffer_ptrs {[hex(int(p or 0)) for p in handle.buffer_ptrs]} (offset "
                f"{getattr(handle, 'offset', None)}) for a tensor at {tensor.data_ptr():#x} in a group of "
                f"{world_size}"
            )
        else:
            cc.attach()  # epkit's kernels join torch's job (their device state is the extension's own)
    except Exception as exc:  # noqa: BLE001 -- reported on every rank below
        error = f"{type(exc).__name__}: {exc}"
    errors = [None] * world_size
    dist.all_gather_object(errors, error, group=group)
    failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    if failed:
        raise RuntimeError(
            f"torch's NVSHMEM symmetric memory could not provide {alloc} bytes per rank ({failed}); set "
            f"NVSHMEM_SYMMETRIC_SIZE larger, or EPKIT_NVSHMEM_PROVIDER=epkit to use epkit's own binding"
        )
    memory[1].zero_()  # torch's allocation is not zeroed, and the signal words must start at 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=group)  # no rank signals or writes into a peer's buffer before the peer zeroed it
    return bases, memory
