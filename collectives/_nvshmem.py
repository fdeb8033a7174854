"""The ``nvshmem`` transport of :class:`~epkit.collectives.symm_buffer.SymmBuffer` (CUDA ranks).

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

Each buffer is one collective symmetric allocation laid out as the shm segments are::

    [ 64-bit signal words | padding to 4096 | data (num_bytes) ]
      READY[w] ACK[w] BARRIER[w] NOTICE[w] user[num_signals]

Signals (``signal_op``) and timed waits (``signal_wait_all``, one deadline over a strided run of
words) are kernels of ``epkit._C_cuda`` launched on the current CUDA stream, so they order with the
caller's kernels. The host reads a wait's 2-word result after the stream reaches it, with its own
deadline as a second line of defence against a stuck stream.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

from epkit.backends import BackendUnavailableError

__all__ = [
    "INSTALL_HINT",
    "NvshmemState",
    "auto_ready",
    "device_view",
    "finalize",
    "gpu_identity",
    "layout",
    "local_job_state",
    "missing_reason",
    "plan_job",
    "plan_provider",
    "torch_symm_reason",
    "use_extension",
    "use_torch_symm",
]

INSTALL_HINT = (
    "build epkit's CUDA extension on a machine with the CUDA toolkit: "
    "`EPKIT_CUDA=1 pip install --no-build-isolation -e '.[cuda13]'` (or cuda12; needs nvcc on PATH and the "
    "nvidia-nvshmem wheel), and run on a CUDA build of torch with a visible GPU"
)
ALIGN = 4096
#: Reserved words per source rank: READY, ACK, BARRIER, NOTICE (indices as in symm_buffer).
NUM_RESERVED_KINDS = 4
#: Seconds the host waits for a device wait beyond its own timeout before it calls the stream stuck.
HOST_GRACE_S = 10.0
MASK64 = (1 << 64) - 1
_SIGNAL_OPS = ("set", "add")

PROVIDERS = ("auto", "torch", "epkit")
# torch.distributed._symmetric_memory's functions the torch provider calls (feature-detected by name).
_TORCH_SYMM_API = ("is_nvshmem_available", "set_backend", "get_backend", "empty", "rendezvous")

# Process-wide NVSHMEM job: None, or {"ranks": global ranks, "device": CUDA index, "owner": "epkit" |
# "adopted" | "torch"}.
_job: dict | None = None
_finalized = False
# A stand-in for epkit._C_cuda with the same functions (epkit.testing.nvshmem_emulator), or None.
_extension = None
# A stand-in for torch.distributed._symmetric_memory (epkit.testing.torch_symm_emulator), or None.
_torch_symm = None
# torch provider: closed buffers' allocations, by size, for reuse. torch's NVSHMEM allocator keeps every
# rendezvoused allocation for the life of the process, so memory handed back to it would never return.
# Entries are (allocation number, tensor, handle); allocations are collective, so every rank numbers
# them alike (addresses would not do: each PE may see its heap elsewhere).
_torch_pool: dict[int, list[tuple[int, torch.Tensor, object]]] = {}
_torch_allocations = 0


def use_extension(module) -> None:
    """Route this transport through ``module`` instead of ``epkit._C_cuda`` (None: back to the real one).

    Tests install ``epkit.testing.nvshmem_emulator`` this way to run the transport's host logic on CPU
    ranks; a module with ``EMULATED = True`` puts the buffers on the CPU and has no CUDA streams.
    """
    global _extension
    _extension = module


def use_torch_symm(module) -> None:
    """Route the torch provider through ``module`` instead of ``torch.distributed._symmetric_memory``
    (None: back to torch's). Tests install ``epkit.testing.torch_symm_emulator`` this way."""
    global _torch_symm
    _torch_symm = module


def _symm_mem():
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
    if _torch_symm is None and _emulated():
        return "the NVSHMEM emulator is installed without torch's stand-in (epkit.testing.torch_symm_emulator)"
    try:
        if not callable(getattr(_load(), "attach", None)):
            return "epkit._C_cuda predates attach() (rebuild it to join torch's NVSHMEM job)"
    except ImportError as exc:
        return f"epkit._C_cuda is not importable ({exc})"
    try:
        sm = _symm_mem()
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory is not importable ({exc})"
    missing = [name for name in _TORCH_SYMM_API if not callable(getattr(sm, name, None))]
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


def _agreed_preference(prefs: list[str]) -> str:
    """The one provider preference of the group, or ValueError (identical on every rank)."""
    bad = {r: p for r, p in enumerate(prefs) if p not in PROVIDERS}
    if bad:
        raise ValueError(
            f"EPKIT_NVSHMEM_PROVIDER must be one of {PROVIDERS}; ranks {list(bad)} set {list(bad.values())}"
        )
    if len(set(prefs)) != 1:
        raise ValueError(f"EPKIT_NVSHMEM_PROVIDER differs across ranks ({prefs}); set the same value on every rank")
    return prefs[0]


def _emulated() -> bool:
    return bool(getattr(_extension, "EMULATED", False))


def _load():
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
    if _emulated():
        return None
    problems = []
    if not torch.cuda.is_available():
        problems.append("torch sees no CUDA device (torch.cuda.is_available() is False)")
    try:
        _load()
    except ImportError as exc:
        problems.append(f"epkit._C_cuda (the NVSHMEM extension) is not importable: {exc}")
    return "; ".join(problems) or None


def auto_ready(group) -> bool:
    """Collective over ``group``: True when every rank can use the nvshmem transport (``auto`` picks it)."""
    ok = [None] * dist.get_world_size(group)
    dist.all_gather_object(ok, missing_reason() is None, group=group)
    return all(ok)


def layout(world_size: int, num_signals: int, num_bytes: int) -> tuple[int, int, int]:
    """Word and byte layout of one rank's symmetric allocation.

    Parameters
    ----------
    world_size, num_signals, num_bytes : int
        Ranks in the group, user signal words, data bytes per rank.

    Returns
    -------
    (num_words, data_offset, alloc_bytes) : tuple of int
        64-bit signal words (``4 * world_size + num_signals``); byte offset of the data (a multiple
        of 4096 past the words); bytes to allocate (``data_offset + max(num_bytes, 1)``).
    """
    for name, v, lo in (("world_size", world_size, 1), ("num_signals", num_signals, 0), ("num_bytes", num_bytes, 0)):
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    num_words = NUM_RESERVED_KINDS * world_size + num_signals
    data_offset = -(-num_words * 8 // ALIGN) * ALIGN
    return num_words, data_offset, data_offset + max(num_bytes, 1)


def local_job_state() -> tuple:
    """This process's NVSHMEM job, as a picklable tuple for :func:`plan_job`.

    ``("none",)``; ``("job", global_ranks, device, owner)`` (started, adopted or joined by SymmBuffer);
    ``("external", my_pe, n_pes)`` (started through ``epkit._C_cuda.init`` directly); ``("host",)`` (a job
    another library started, torch's symmetric memory, that the extension has not joined); ``("finalized",)``.
    """
    cc = _load()
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
    if _emulated():  # each emulated PE is its own "GPU"
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
    cc = _load()
    if cc.initialized():
        if not _emulated():
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


class NvshmemState:
    """One rank's part of an nvshmem SymmBuffer: the symmetric allocation, its views and the device ops.

    Creation is collective over ``group`` (one all-gather, the bootstrap when needed, one symmetric
    allocation: ``nvshmem_malloc`` through epkit's binding, or torch's ``empty`` + ``rendezvous``).
    Offsets (``off``) are byte offsets into the signal words, as ``SymmBuffer._word``.

    Attributes
    ----------
    provider : {"torch", "epkit"}
        Where the memory and the job come from (see the module docstring).
    note : str
        Why torch's symmetric memory was not used, or "".
    """

    def __init__(self, group, rank: int, world_size: int, num_bytes: int, num_signals: int):
        global _job
        num_words, data_offset, alloc = layout(world_size, num_signals, num_bytes)
        missing = missing_reason()
        emulated = _emulated()
        device = (0 if emulated else torch.cuda.current_device()) if missing is None else -1
        state = local_job_state() if missing is None else ("none",)
        gpu = gpu_identity(device) if missing is None else ""
        prefer = provider_preference()
        torch_why = torch_symm_reason() if missing is None and prefer != "epkit" else None
        if torch_why is None and state == ("host",) and prefer != "epkit":
            try:
                backend = _symm_mem().get_backend(torch.device("cpu") if emulated else torch.device("cuda", device))
            except Exception as exc:  # noqa: BLE001 -- a reason like any other, gathered below
                backend = f"unknown ({type(exc).__name__}: {exc})"
            if backend != "NVSHMEM":  # not torch's job: torch's memory would not be on its heap
                torch_why = f"torch's symmetric-memory backend is {backend!r}, so another library started NVSHMEM"
        pooled = [number for number, _, _ in _torch_pool.get(alloc, [])]
        info = (missing, alloc, state, device, gpu, torch_why, pooled, prefer)
        infos = [None] * world_size
        # Every rank sees the same list, so every rank raises the same error (no rank is left waiting).
        dist.all_gather_object(infos, info, group=group)
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
        ranks = dist.get_process_group_ranks(group)
        states = [info[2] for info in infos]
        plan = plan_job(states, ranks, [info[3] for info in infos], [info[4] for info in infos])
        whole_world = list(ranks) == list(range(dist.get_world_size()))
        prefer = _agreed_preference([info[7] for info in infos])
        self.provider, self.note = plan_provider(plan, states, [info[5] for info in infos], prefer, whole_world)
        self.rank, self.world_size, self.num_bytes = rank, world_size, num_bytes
        # The emulator's PEs are CPU processes: CPU views, and its ops complete before they return.
        self.device = torch.device("cpu") if emulated else torch.device("cuda", device)
        self.num_words, self.data_offset = num_words, data_offset
        if self.provider == "torch" and plan == "init":
            self.provider, self.note = self._claim_torch_backend(group, prefer)
        cc = _load()
        self.cc = cc
        self._torch_memory = None  # torch provider: (allocation number, the symmetric tensor, its handle)
        if self.provider == "torch":
            cc.set_device(device)
            common = set.intersection(*(set(info[6]) for info in infos))
            bases = self._torch_alloc(group, alloc, min(common) if common else None)
            if _job is None:
                _job = {"ranks": tuple(ranks), "device": device, "owner": "torch"}
        else:
            if plan == "init":
                _bootstrap(cc, group, rank, world_size, device, ranks)
            elif plan == "adopt":
                _job = {"ranks": tuple(ranks), "device": device, "owner": "adopted"}
            cc.set_device(device)  # kernels of epkit._C_cuda launch on this thread's current device
            try:
                base = cc.malloc(alloc)  # collective; zero-filled
            except RuntimeError as exc:
                raise RuntimeError(
                    f"rank {rank}: {exc}; the NVSHMEM symmetric heap may be too small for {alloc} bytes per "
                    f"rank: set NVSHMEM_SYMMETRIC_SIZE (bytes, read when NVSHMEM starts) larger"
                ) from exc
            bases = [base if r == rank else cc.peer_ptr(base, r) for r in range(world_size)]
        self.base = bases[rank]
        #: Address of each rank's data as seen from this GPU; 0 where the peer is not directly addressable.
        self.peer_data = [b + data_offset if b else 0 for b in bases]
        self.views = [device_view(p, num_bytes, self.device) if p else None for p in self.peer_data]
        self.local = self.views[rank]
        self.words = device_view(self.base, num_words * 8, self.device).view(torch.int64)
        self._result = torch.zeros(2, dtype=torch.int64, device=self.device)
        # Set by a deferred wait that timed out: the deferred waits queued after it then return at once.
        self._sticky = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._event = None if emulated else torch.cuda.Event()
        self._urgent = None  # the side stream of urgent posts (created on first use)

    def _claim_torch_backend(self, group, prefer: str) -> tuple[str, str]:
        """Set torch's backend to NVSHMEM on every rank (collective); where some rank cannot, undo it and fall
        back to epkit's binding (``auto``) or raise (``torch``)."""
        sm = _symm_mem()
        previous, error = _torch_backend(sm, self.device)
        errors = [None] * self.world_size
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

    def _torch_alloc(self, group, alloc: int, reuse: int | None) -> list[int]:
        """Allocate through torch's symmetric memory (or take pooled allocation number ``reuse``, pooled on every
        rank), join its job, zero the memory; returns each rank's base address as seen from this GPU (0 where
        not directly addressable). Collective over ``group``; a failure on any rank raises on every rank."""
        global _torch_allocations
        sm = _symm_mem()
        error, bases = None, []
        try:
            if reuse is not None:
                pool = _torch_pool[alloc]
                number, tensor, handle = pool.pop(next(i for i, entry in enumerate(pool) if entry[0] == reuse))
            else:
                _torch_allocations += 1
                number = _torch_allocations
                tensor = sm.empty(alloc, dtype=torch.uint8, device=self.device)  # torch starts NVSHMEM at the first
                handle = sm.rendezvous(tensor, group)
            self._torch_memory = (number, tensor, handle)
            bases = _tensor_bases(handle, tensor.data_ptr(), self.rank)
            if tensor.data_ptr() == 0:  # torch does not check nvshmem_malloc's result
                error = f"the allocation of {alloc} bytes gave a null pointer (the symmetric heap is exhausted)"
            elif len(bases) != self.world_size or bases[self.rank] != tensor.data_ptr():
                error = (
                    f"rendezvous gave buffer_ptrs {[hex(int(p or 0)) for p in handle.buffer_ptrs]} (offset "
                    f"{getattr(handle, 'offset', None)}) for a tensor at {tensor.data_ptr():#x} in a group of "
                    f"{self.world_size}"
                )
            else:
                self.cc.attach()  # epkit's kernels join torch's job (their device state is the extension's own)
        except Exception as exc:  # noqa: BLE001 -- reported on every rank below
            error = f"{type(exc).__name__}: {exc}"
        errors = [None] * self.world_size
        dist.all_gather_object(errors, error, group=group)
        failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        if failed:
            self._torch_memory = None
            raise RuntimeError(
                f"torch's NVSHMEM symmetric memory could not provide {alloc} bytes per rank ({failed}); set "
                f"NVSHMEM_SYMMETRIC_SIZE larger, or EPKIT_NVSHMEM_PROVIDER=epkit to use epkit's own binding"
            )
        tensor.zero_()  # torch's allocation is not zeroed, and the signal words must start at 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=group)  # no rank signals or writes into a peer's buffer before the peer zeroed it
        return bases

    @property
    def within_domain(self) -> bool:
        return all(self.peer_data)

    def addressable(self, rank: int) -> bool:
        return self.peer_data[rank] != 0

    def _stream(self) -> int:
        if self.device.type != "cuda":
            return 0  # emulated: the calling thread is the stream
        return torch.cuda.current_stream(self.device).cuda_stream

    def post(self, off: int, value: int, op: str, pe: int, urgent: bool = False, guarded: bool = False) -> None:
        """Set/add ``value`` to the word at ``off`` on rank ``pe``, on the current stream after its earlier work.

        ``urgent``: on a stream of its own instead, so that it is not queued behind a stuck stream (the
        gave-up notices). ``guarded``: not if a stream-ordered wait of this buffer failed before it (the
        sticky word), so that no signal follows writes that were skipped.
        """
        if op not in _SIGNAL_OPS:
            raise ValueError(f"op must be 'set' or 'add', got {op!r}")
        if not isinstance(value, int) or not 0 <= value <= MASK64:
            raise ValueError(f"signal value must be an int in [0, 2**64), got {value!r}")
        stream = self._stream()
        if urgent and self.device.type == "cuda":
            if self._urgent is None:
                self._urgent = torch.cuda.Stream(self.device, priority=-1)
            stream = self._urgent.cuda_stream
        self.cc.signal_op(self.base + off, value, op, pe, stream, self._sticky.data_ptr() if guarded else 0)

    def put_signal(
        self,
        dst_off: int,
        src: torch.Tensor | None,
        nbytes: int,
        sig_off: int,
        value: int,
        pe: int,
        guarded: bool = False,
    ):
        """Copy ``nbytes`` of ``src`` to data offset ``dst_off`` on ``pe``, then set its word at ``sig_off``
        (``guarded``: neither after a failed stream-ordered wait of this buffer, see :meth:`post`)."""
        if nbytes == 0:
            self.post(sig_off, value, "set", pe, guarded=guarded)
            return
        if (
            src is None
            or src.device != self.device
            or not src.is_contiguous()
            or src.numel() * src.element_size() < nbytes
        ):
            raise ValueError(f"put_signal needs a contiguous tensor of >= {nbytes} bytes on {self.device}")
        self.cc.put_signal(
            self.base + self.data_offset + dst_off,
            src.data_ptr(),
            nbytes,
            self.base + sig_off,
            value,
            "set",
            pe,
            self._stream(),
            self._sticky.data_ptr() if guarded else 0,
        )

    def wait(
        self, off: int, count: int, cmp: str, value: int, timeout: float, abort_words: int = 0
    ) -> tuple[int, int | None]:
        """Timed device wait until the ``count`` local words from ``off`` all satisfy ``cmp value``.

        Returns ``(value seen, None)`` when they did, ``(value seen, index)`` for the first word (0-based
        from ``off``) that did not within ``timeout``, or whose abort word (``abort_words`` words further;
        0: none) turned nonzero first (the value is then the abort word's). Raises TimeoutError only when
        the stream itself did not reach the end of the wait within ``timeout + HOST_GRACE_S`` (stuck
        behind other work).
        """
        self._launch_wait(off, count, cmp, value, timeout, self._result.data_ptr(), 0, abort_words, True)
        if self._event is not None:
            self._event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + timeout + HOST_GRACE_S
        spins = 0
        while self._event is not None and not self._event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {self.rank}: the CUDA stream did not finish a {timeout:g} s signal wait within "
                    f"{timeout + HOST_GRACE_S:g} s (stuck behind earlier work, or a kernel hung)"
                )
            spins += 1
            if spins > 2000:
                time.sleep(50e-6)
        seen, failed = (v & MASK64 for v in self._result.tolist())
        return seen, (None if failed == 0 else failed - 1)

    def wait_deferred(
        self,
        off: int,
        count: int,
        cmp: str,
        value: int,
        timeout: float,
        checks,
        judge,
        what: str,
        abort_words: int = 0,
        skip_on_sticky: bool = True,
    ):
        """:meth:`wait` without the host: the wait kernel writes its 2-word result into pinned host memory and
        ``checks`` (a DeferredChecks) judges it once the stream has passed it. Returns at once.

        After a failed deferred wait on this buffer the later ones return at once (the sticky word),
        except those with ``skip_on_sticky=False``: waits that guard writes into a peer's memory.
        """
        slot = checks.host_slot(2)  # pinned: with unified addressing the kernel stores into it directly
        sticky = self._sticky.data_ptr()
        self._launch_wait(off, count, cmp, value, timeout, slot.data_ptr(), sticky, abort_words, skip_on_sticky)
        checks.record(slot, judge, timeout, what)

    def _launch_wait(self, off, count, cmp, value, timeout, result: int, sticky: int, abort_words, skip) -> None:
        """Check the arguments, then queue ``signal_wait_all`` over ``count`` words from ``off`` (stride 1)."""
        if not isinstance(value, int) or not 0 <= value <= MASK64:
            raise ValueError(f"signal value must be an int in [0, 2**64), got {value!r}")
        if not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        self.cc.signal_wait_all(
            self.base + off, 1, count, cmp, value, float(timeout), result, self._stream(), sticky, abort_words, skip
        )

    def read(self, off: int) -> int:
        """Current value of this rank's word at ``off`` (read after the stream's earlier work)."""
        return int(self.words[off // 8].item()) & MASK64

    def peer(self, rank: int) -> torch.Tensor:
        view = self.views[rank]
        if view is None:
            raise RuntimeError(
                f"rank {rank} is not directly addressable from rank {self.rank} (nvshmem_ptr gave no address: "
                f"no NVLink/P2P path between the GPUs); use exchange()/all_to_all, which put through NVSHMEM"
            )
        return view

    def free(self, collective: bool) -> bool:
        """Free the allocation (collective: every rank must call it); returns False when it was left allocated."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.views, self.local, self.words = [], None, None
        if self._torch_memory is not None:
            # torch never frees a rendezvoused allocation, so a cleanly closed buffer's goes to this process's
            # pool for the next buffer of the size; after a failure a peer may still write into it: dropped.
            memory, self._torch_memory = self._torch_memory, None
            if not collective:
                return False
            # Every PE's puts and signals into this memory (the last acknowledgements too) have landed before
            # it can be reused: quiet and barrier over the job (torch's job is every rank, as this group).
            self.cc.barrier_all()
            _torch_pool.setdefault(memory[1].numel(), []).append(memory)
            return True
        if not collective or not self.cc.initialized():
            return False
        self.cc.free(self.base)
        return True
