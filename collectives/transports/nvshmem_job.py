"""The process-wide side of the ``nvshmem`` transport: the NVSHMEM job, its memory providers, test hooks.

One process per GPU; ``torch.cuda.current_device()`` is the rank's GPU. NVSHMEM is one job per
process, and the memory comes from one of two *providers* (``EPKIT_NVSHMEM_PROVIDER``):

- ``torch``: PyTorch symmetric memory with its NVSHMEM backend, where the installed torch has it
  (``torch.distributed._symmetric_memory``: ``is_nvshmem_available()``, the backend set explicitly
  with ``set_backend("NVSHMEM")``, ``empty`` + ``rendezvous`` for the allocation and its
  ``buffer_ptrs``). Torch starts the job over the default group (PE numbers are global ranks), so
  this provider needs a group of every rank; ``epkit._C_cuda.attach`` then joins that job so that
  epkit's own kernels (puts, signals, timed waits: torch's NVSHMEM ops have no timeouts) use it.
- ``epkit``: the extension's own binding. The first buffer starts the job (rank 0 of the group
  draws a unique id, the bytes travel with ``broadcast_object_list``, every rank joins).

``auto`` (the default) takes ``torch`` where every rank can and ``epkit`` otherwise, and the buffer
says why (``SymmBuffer.nvshmem_provider``, ``.nvshmem_note``). Later buffers over a group with the same
ranks reuse the job, and any other group is refused with a ValueError (NVSHMEM teams are out of
scope). A job that someone started directly through ``epkit._C_cuda.init`` is adopted when its PE
numbers are the group's ranks; one that torch started is joined through torch. NVSHMEM cannot be
initialised twice in one process: after :func:`finalize` no nvshmem buffer can be created in it.

:func:`allocate` is the collective entry point a new buffer calls; the per-buffer state and device
ops are :class:`~epkit.collectives.transports.nvshmem.NvshmemTransport`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epkit.backends import BackendUnavailableError

__all__ = [
    "HOST_GRACE_S",
    "INSTALL_HINT",
    "Allocation",
    "allocate",
    "auto_ready",
    "device_view",
    "emulated",
    "extension",
    "finalize",
    "gpu_identity",
    "local_job_state",
    "missing_reason",
    "plan_job",
    "use_extension",
]

INSTALL_HINT = (
    "build epkit's CUDA extension on a machine with the CUDA toolkit: "
    "`EPKIT_CUDA=1 pip install --no-build-isolation -e '.[cuda13]'` (or cuda12; needs nvcc on PATH and the "
    "nvidia-nvshmem wheel), and run on a CUDA build of torch with a visible GPU"
)
#: Seconds the host waits for a device wait beyond its own timeout before it calls the stream stuck.
HOST_GRACE_S = 10.0

# Process-wide NVSHMEM job: None, or {"ranks": global ranks, "device": CUDA index, "owner": "epkit" |
# "adopted" | "torch"}.
_job: dict | None = None
_finalized = False
# A stand-in for epkit._C_cuda with the same functions (epkit.testing.nvshmem_emulator), or None.
_extension = None


def use_extension(module) -> None:
    """Route this transport through ``module`` instead of ``epkit._C_cuda`` (None: back to the real one).

    Tests install ``epkit.testing.nvshmem_emulator`` this way to run the transport's host logic on CPU
    ranks; a module with ``EMULATED = True`` puts the buffers on the CPU and has no CUDA streams.
    """
    global _extension
    _extension = module


def emulated() -> bool:
    return bool(getattr(_extension, "EMULATED", False))


def extension():
    if _extension is not None:
        return _extension
    import epkit._C_cuda as cc

    return cc


def missing_reason() -> str | None:
    """Why this process cannot use the nvshmem transport, or None when it can.

    Returns
    -------
    str or None
        The missing pieces (no CUDA device, ``epkit._C_cuda`` not importable), ``"; "``-joined.
    """
    if emulated():
        return None
    problems = []
    if not torch.cuda.is_available():
        problems.append("torch sees no CUDA device (torch.cuda.is_available() is False)")
    try:
        extension()
    except ImportError as exc:
        problems.append(f"epkit._C_cuda (the NVSHMEM extension) is not importable: {exc}")
    return "; ".join(problems) or None


def auto_ready(group) -> bool:
    """Collective over ``group``: True when every rank can use the nvshmem transport (``auto`` picks it)."""
    ok = [None] * dist.get_world_size(group)
    dist.all_gather_object(ok, missing_reason() is None, group=group)
    return all(ok)


def local_job_state() -> tuple:
    """This process's NVSHMEM job, as a picklable tuple for :func:`plan_job`.

    ``("none",)``; ``("job", global_ranks, device, owner)`` (started, adopted or joined by SymmBuffer);
    ``("external", my_pe, n_pes)`` (started through ``epkit._C_cuda.init`` directly); ``("host",)`` (a job
    another library started, torch's symmetric memory, that the extension has not joined); ``("finalized",)``.
    """
    cc = extension()
    if _finalized or getattr(cc, "finalized", lambda: False)() or (_job is not None and not cc.initialized()):
        return ("finalized",)
    if _job is not None:
        return ("job", tuple(_job["ranks"]), _job["device"], _job["owner"])
    if cc.initialized():
        return ("external", cc.my_pe(), cc.n_pes())
    if getattr(cc, "job_status", lambda: 0)() >= 2:
        return ("host",)
    return ("none",)


def _describe(state: tuple) -> str:
    if state[0] == "job":
        return f"is in an NVSHMEM job over global ranks {list(state[1])} on cuda:{state[2]}"
    if state[0] == "external":
        return f"is PE {state[1]} of an NVSHMEM job of {state[2]} PEs started outside SymmBuffer"
    if state[0] == "host":
        return "runs an NVSHMEM job another library (torch's symmetric memory) started"
    return "has no NVSHMEM job"


def gpu_identity(device: int) -> str:
    """``host/GPU`` naming this process's GPU across the group (the UUID where torch reports it, so two
    processes that see one GPU under different CUDA_VISIBLE_DEVICES indices still match)."""
    if emulated():  # each emulated PE is its own "GPU"
        return f"{os.uname().nodename}/emulated-pid{os.getpid()}"
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"{os.uname().nodename}/{uuid if uuid is not None else f'cuda:{device}'}"


def plan_job(states: list[tuple], group_ranks, devices: list[int], gpus: list[str] | None = None) -> str:
    """Decide, identically on every rank, what a new nvshmem buffer does with the process-wide job.

    Parameters
    ----------
    states : list of tuple
        :func:`local_job_state` of each group rank, in group-rank order (all-gathered).
    group_ranks : sequence of int
        The group's global ranks (``dist.get_process_group_ranks``), in group-rank order.
    devices : list of int
        Each group rank's current CUDA device.
    gpus : list of str, optional
        Each group rank's :func:`gpu_identity`; two ranks on one GPU are refused (NVSHMEM needs one PE per GPU).

    Returns
    -------
    {"init", "reuse", "adopt", "attach"}
        Start a job over the group; reuse the job SymmBuffer already runs over exactly these ranks;
        adopt a job started directly whose PE numbers are the group ranks; attach to the job torch
        started on every rank (:func:`plan_provider` checks that torch can serve it).

    Raises
    ------
    RuntimeError
        Some rank's process already finalized NVSHMEM (it cannot be initialised again).
    ValueError
        The group's ranks are not those of the existing job, the ranks disagree, or a rank's
        current CUDA device is not the one its job was started on.
    """
    group_ranks = tuple(group_ranks)
    if len(states) != len(group_ranks) or len(devices) != len(group_ranks):
        raise ValueError(f"need one state and one device per group rank ({len(group_ranks)})")
    if gpus is not None:
        sharing: dict[str, list[int]] = {}
        for i, g in enumerate(gpus):
            sharing.setdefault(g, []).append(i)
        shared = {g: r for g, r in sharing.items() if len(r) > 1}
        if shared:
            detail = "; ".join(f"group ranks {r} all use {g}" for g, r in shared.items())
            raise ValueError(
                f"NVSHMEM needs one GPU per rank, but {detail}: call torch.cuda.set_device(local_rank) in "
                f"every process before creating the buffer"
            )
    finalized = [i for i, s in enumerate(states) if s[0] == "finalized"]
    if finalized:
        raise RuntimeError(
            f"NVSHMEM was already finalized in the processes of group ranks {finalized}; it cannot be "
            f"initialised twice in one process: create nvshmem SymmBuffers in fresh processes"
        )
    if all(s[0] == "none" for s in states):
        return "init"
    if all(s[0] == "job" and s[1] == group_ranks for s in states):
        moved = [i for i, s in enumerate(states) if s[2] != devices[i]]
        if moved:
            raise ValueError(
                f"group ranks {moved}: the current CUDA device ({[devices[i] for i in moved]}) is not the one "
                f"the NVSHMEM job was started on ({[states[i][2] for i in moved]}); call torch.cuda.set_device "
                f"back to it before creating the buffer"
            )
        return "reuse"
    if all(s[0] == "external" and s[1] == i and s[2] == len(group_ranks) for i, s in enumerate(states)):
        return "adopt"
    if all(s[0] == "host" for s in states):
        return "attach"
    detail = "; ".join(f"group rank {i} {_describe(s)}" for i, s in enumerate(states))
    raise ValueError(
        f"SymmBuffer(transport='nvshmem') runs one NVSHMEM job per process over one fixed set of ranks; this "
        f"group has global ranks {list(group_ranks)} but {detail}. Create every nvshmem SymmBuffer of a "
        f"process over groups with the same ranks (NVSHMEM teams are not supported)"
    )


def _bootstrap(cc, group, rank: int, world_size: int, device: int, ranks) -> None:
    global _job
    if world_size == 1:
        # One PE on one GPU needs no network transport, and bootstraps with itself over loopback (a
        # sandbox's other interfaces may not be usable); users may still choose otherwise.
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
    cc.set_device(device)
    uid = [cc.get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=dist.get_global_rank(group, 0), group=group)
    if not isinstance(uid[0], bytes) or len(uid[0]) != cc.unique_id_size():
        raise RuntimeError(f"rank {rank}: received a malformed NVSHMEM unique id ({type(uid[0]).__name__})")
    cc.init(uid[0], rank, world_size)
    _job = {"ranks": tuple(ranks), "device": device, "owner": "epkit"}


def finalize() -> None:
    """End this process's NVSHMEM job (collective over the job's ranks; close every nvshmem buffer first).

    NVSHMEM cannot be initialised again in this process afterwards: later nvshmem SymmBuffers raise.
    """
    global _finalized
    cc = extension()
    if cc.initialized():
        if not emulated():
            torch.cuda.synchronize()
        cc.finalize()
    _finalized = _finalized or _job is not None


def device_view(addr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A ``[nbytes]`` uint8 tensor on ``device`` aliasing memory at ``addr`` (not owned: it must outlive the view).

    Parameters
    ----------
    addr : int
        Address of the first byte (device memory for a CUDA ``device``).
    nbytes : int
        Length of the view in bytes.
    device : torch.device
        The device the tensor reports (a peer GPU's memory mapped into this GPU's address space
        is viewed as this GPU's, which is where kernels using the view run).
    """
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if not isinstance(addr, int) or addr <= 0:
        raise ValueError(f"addr must be a positive int address, got {addr!r}")
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is not None:
        storage = make(addr, device, nbytes)
        view = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
    else:  # older torch: the CUDA array interface, with the device stated explicitly
        iface = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}
        view = torch.as_tensor(type("_Mem", (), {"__cuda_array_interface__": iface})(), device=device)
    if view.data_ptr() != addr or view.device != device or view.numel() != nbytes:
        raise RuntimeError(
            f"could not view {nbytes} bytes at {addr:#x} on {device}: got a tensor at {view.data_ptr():#x} on "
            f"{view.device} with {view.numel()} bytes"
        )
    return view


@dataclass
class Allocation:
    """One rank's symmetric allocation for a new buffer, as :func:`allocate` made it."""

    provider: str  # "torch" or "epkit"
    note: str  # why torch's symmetric memory was not used, or ""
    device: torch.device  # the rank's GPU (the CPU under the emulator)
    bases: list[int]  # each rank's base address as seen from this GPU; 0 where not directly addressable
    cc: object  # epkit._C_cuda (or its emulator)
    torch_memory: tuple | None  # torch provider: (allocation number, tensor, handle), for the pool


def _local_facts(alloc: int) -> tuple:
    """What this rank tells the others before a buffer is made (all-gathered by :func:`allocate`)."""
    from epkit.collectives.transports import nvshmem_torch as tp

    missing = missing_reason()
    device = (0 if emulated() else torch.cuda.current_device()) if missing is None else -1
    state = local_job_state() if missing is None else ("none",)
    gpu = gpu_identity(device) if missing is None else ""
    prefer = tp.provider_preference()
    torch_why = tp.torch_symm_reason() if missing is None and prefer != "epkit" else None
    if torch_why is None and state == ("host",) and prefer != "epkit":
        backend = tp.torch_backend_of(torch.device("cpu") if emulated() else torch.device("cuda", device))
        if backend != "NVSHMEM":  # not torch's job: torch's memory would not be on its heap
            torch_why = f"torch's symmetric-memory backend is {backend!r}, so another library started NVSHMEM"
    return missing, alloc, state, device, gpu, torch_why, tp.pooled_numbers(alloc), prefer


def _agree(group, world_size: int, alloc: int) -> list[tuple]:
    """All-gather every rank's :func:`_local_facts`; every rank sees the same list, so every rank raises the
    same error for a missing piece or a size mismatch (no rank is left waiting)."""
    infos = [None] * world_size
    dist.all_gather_object(infos, _local_facts(alloc), group=group)
    reasons = {r: info[0] for r, info in enumerate(infos) if info[0]}
    if reasons:
        detail = "; ".join(f"rank {r}: {why}" for r, why in reasons.items())
        raise BackendUnavailableError(f"SymmBuffer transport 'nvshmem' cannot run here ({detail}); {INSTALL_HINT}")
    sizes = [info[1] for info in infos]
    if len(set(sizes)) != 1:
        raise ValueError(
            f"SymmBuffer sizes differ across ranks (symmetric bytes per rank: {sizes}); every rank "
            f"must pass the same num_bytes and num_signals"
        )
    return infos


def _epkit_alloc(cc, rank: int, world_size: int, alloc: int) -> list[int]:
    """``nvshmem_malloc`` through epkit's binding (collective; zero-filled): each rank's base from here."""
    try:
        base = cc.malloc(alloc)
    except RuntimeError as exc:
        raise RuntimeError(
            f"rank {rank}: {exc}; the NVSHMEM symmetric heap may be too small for {alloc} bytes per "
            f"rank: set NVSHMEM_SYMMETRIC_SIZE (bytes, read when NVSHMEM starts) larger"
        ) from exc
    return [base if r == rank else cc.peer_ptr(base, r) for r in range(world_size)]


def allocate(group, rank: int, world_size: int, alloc: int) -> Allocation:
    """Collective over ``group``: agree on the job and the provider, start or join the job, allocate.

    One all-gather of every rank's facts (:func:`_local_facts`), :func:`plan_job` and
    ``nvshmem_torch.plan_provider`` decided identically on every rank, then the bootstrap where needed and
    one symmetric allocation of ``alloc`` bytes per rank.
    """
    global _job
    from epkit.collectives.transports import nvshmem_torch as tp

    infos = _agree(group, world_size, alloc)
    ranks = dist.get_process_group_ranks(group)
    states = [info[2] for info in infos]
    plan = plan_job(states, ranks, [info[3] for info in infos], [info[4] for info in infos])
    whole_world = list(ranks) == list(range(dist.get_world_size()))
    prefer = tp.agreed_preference([info[7] for info in infos])
    provider, note = tp.plan_provider(plan, states, [info[5] for info in infos], prefer, whole_world)
    index = infos[rank][3]
    # The emulator's PEs are CPU processes: CPU views, and its ops complete before they return.
    device = torch.device("cpu") if emulated() else torch.device("cuda", index)
    if provider == "torch" and plan == "init":
        provider, note = tp.claim_torch_backend(group, world_size, device, prefer)
    cc = extension()
    cc.set_device(index)  # kernels of epkit._C_cuda launch on this thread's current device
    if provider == "torch":
        common = set.intersection(*(set(info[6]) for info in infos))
        bases, memory = tp.torch_alloc(group, rank, world_size, device, alloc, min(common) if common else None, cc)
        if _job is None:
            _job = {"ranks": tuple(ranks), "device": index, "owner": "torch"}
        return Allocation(provider, note, device, bases, cc, memory)
    if plan == "init":
        _bootstrap(cc, group, rank, world_size, index, ranks)
    elif plan == "adopt":
        _job = {"ranks": tuple(ranks), "device": index, "owner": "adopted"}
    return Allocation(provider, note, device, _epkit_alloc(cc, rank, world_size, alloc), cc, None)
