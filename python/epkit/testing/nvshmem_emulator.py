"""A CPU stand-in for ``epkit._C_cuda``: the nvshmem transport's host logic, run without a GPU.

``SymmBuffer(transport="nvshmem")`` and every protocol above it (``EPBuffer`` normal and
low-latency, deferred waits) talk to NVSHMEM only through the functions of ``epkit._C_cuda``.
This module implements the same functions, with the same arguments, checks and results, over
POSIX shared memory on CPU ranks of one host, so that the Python side of the transport (the
symmetric layout, word offsets, address translation, put-with-signal staging for peers outside
the NVLink domain, wait results, the sticky timeout word, deferred checks, collective free) runs
in CPU CI exactly as it would call the real extension. What it cannot show is the CUDA side:
the kernels, streams and the memory model of a GPU; those are rung 4 (``bench/gpu_check.py``).

Model
-----
- One *heap* per PE: a shared-memory segment of ``NVSHMEM_SYMMETRIC_SIZE`` bytes (default 1 GiB,
  sparse), every PE maps every heap. ``malloc`` is collective and deterministic, so an allocation
  has the same offset in every heap: a symmetric address is an address in the caller's heap, and
  on PE ``pe`` it is ``heap[pe] + (addr - heap[me])``.
- ``peer_ptr`` returns that translated address for the PEs of the caller's NVLink domain (every PE
  with ``p2p=True``, unless ``domain_size`` splits them) and 0 for any other (every other PE with
  ``p2p=False``, as across nodes), which sends the transport through ``put_signal``.
- The "stream" is the calling thread: every op has completed when it returns, so a wait blocks
  the host (GIL released) for at most its timeout, like a stream-ordered kernel followed by a sync.
- Errors the real extension raises (bad pe, unaligned signal word, ``init`` twice, use before
  ``init``) are raised the same way; collective steps that would hang in NVSHMEM (a missing peer
  in ``init`` or ``barrier_all``) raise RuntimeError after ``EPKIT_NVEMU_TIMEOUT`` seconds (60).

Use it in a rank process (``run_ranks``) before the first nvshmem buffer: after
``nvshmem_emulator.install(p2p=True)``, ``SymmBuffer(group, nbytes, transport="nvshmem")`` runs on CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import secrets
import sys
import time

from epkit.collectives.transports.shm import wait_word

__all__ = ["install", "uninstall", "installed", "resolve_transport", "calls", "EMULATED"]

#: Marks this module as the CPU stand-in (``transports/nvshmem_job.py`` checks it: CPU device, no streams).
EMULATED = True

_UID_BYTES = 128  # sizeof(nvshmemx_uniqueid_t) in the NVSHMEM 3.x headers
_CONTROL = 4096  # heap bytes before the first allocation: one barrier word per PE (up to 512 PEs)
_ALLOC_ALIGN = 512
_MASK64 = (1 << 64) - 1
_CMPS = {"==", "eq", "!=", "ne", ">=", "ge", ">", "gt", "<=", "le", "<", "lt"}
_CANON = {"eq": "==", "ne": "!=", "ge": ">=", "gt": ">", "le": "<=", "lt": "<"}

# "job": the process's NVSHMEM job exists (the host library's state, whoever started it); "initialized":
# this module may use it (epkit._C_cuda's own flag: set by init, or by attach to a job torch started).
_state: dict = {"job": False, "initialized": False, "finalized": False, "device": 0, "p2p": True, "domain_size": 0}
#: Calls per function of the extension's interface, and deferred waits (those given a sticky word).
_calls: dict[str, int] = {}


def _count(what: str) -> None:
    _calls[what] = _calls.get(what, 0) + 1


def calls() -> dict[str, int]:
    """How often each extension function ran in this process (``signal_wait_all/deferred``: with a sticky word;
    ``/timed_out``: waits that timed out; ``/skipped``: waits that returned at once on a set sticky word)."""
    return dict(_calls)


def _timeout() -> float:
    return float(os.environ.get("EPKIT_NVEMU_TIMEOUT", "60"))


def _heap_size() -> int:
    raw = os.environ.get("NVSHMEM_SYMMETRIC_SIZE", str(1 << 30)).strip()
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(raw[-1:].lower(), 1)
    return int(float(raw[:-1] if scale > 1 else raw) * scale)


def _require_init(what: str) -> None:
    if not _state["initialized"]:
        raise RuntimeError(f"{what}: call init() first")


def _enter(what: str) -> None:
    """An extension call begins: it needs a job this module may use; counted in :func:`calls`."""
    _require_init(what)
    _count(what)


def _require_job(what: str) -> None:
    if not _state["job"]:
        raise RuntimeError(f"{what}: no NVSHMEM job is running in this process")


def _require_pe(pe: int, what: str) -> None:
    n = _state["n_pes"]
    if not 0 <= pe < n:
        raise ValueError(f"{what}: pe {pe} outside [0, {n})")


def _parse_cmp(cmp: str) -> str:
    if cmp not in _CMPS:
        raise ValueError(f"unknown comparison '{cmp}': use one of == != >= > <= <")
    return _CANON.get(cmp, cmp)


def _parse_op(op: str) -> str:
    if op not in ("set", "add"):
        raise ValueError(f"unknown signal op '{op}': use 'set' or 'add'")
    return op


def _offset(addr: int, nbytes: int, what: str) -> int:
    """Byte offset of the symmetric address ``addr`` in this PE's heap (the range must lie in an allocation)."""
    off = addr - _state["heaps"][_state["me"]].addr
    if off < _CONTROL or off + nbytes > _state["top"]:
        raise ValueError(f"{what}: address {addr:#x} (+{nbytes} bytes) is not in the symmetric heap")
    return off


# Bootstrap and teardown


def unique_id_size() -> int:
    return _UID_BYTES


def set_device(device: int) -> None:
    _state["device"] = int(device)


def get_unique_id() -> bytes:
    return secrets.token_bytes(_UID_BYTES)


def init(unique_id: bytes, rank: int, world_size: int) -> None:
    """Join the job: create this PE's heap, map every peer's, barrier, unlink the names (collective)."""
    if len(unique_id) != _UID_BYTES:
        raise ValueError(f"unique id has {len(unique_id)} bytes, expected {_UID_BYTES}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    if _state["initialized"]:
        raise RuntimeError("init: NVSHMEM is already initialised in this process")
    if _state["finalized"]:
        raise RuntimeError("init: NVSHMEM was finalized in this process and cannot be initialised again")
    _start_job(unique_id, rank, world_size)
    _state["initialized"] = True
    _count("init")


def _start_job(unique_id: bytes, rank: int, world_size: int) -> None:
    """The host library's part of init (torch's symmetric memory starts a job this way, without epkit's module)."""
    from epkit import _C

    if _state["job"]:
        raise RuntimeError("init: an NVSHMEM job is already running in this process")
    if world_size * 8 > _CONTROL:
        raise ValueError(f"the emulator supports at most {_CONTROL // 8} PEs")
    size = _heap_size()
    names = [f"/epkit-nvemu-{unique_id[:16].hex()}-{r}" for r in range(world_size)]
    mine = _C.ShmSegment(names[rank], size, True)
    atexit.register(_unlink_quietly, mine)  # a peer that never arrives must not leave our name behind
    heaps = []
    deadline = time.monotonic() + _timeout()
    try:
        for r, name in enumerate(names):
            heaps.append(mine if r == rank else _map_heap(name, size, r, deadline))
        _state.update(me=rank, n_pes=world_size, heaps=heaps, top=_CONTROL, free=[], barrier=0, allocs={})
        _state["job"] = True
        _barrier()  # every PE has mapped every heap: the names can go
    except BaseException:
        _state["job"] = False
        for name in names:  # a PE that died before unlinking its own name leaves it to us
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name.lstrip('/')}")
        raise
    finally:
        mine.unlink()


def _map_heap(name: str, size: int, pe: int, deadline: float):
    """Map PE ``pe``'s heap once it exists at full size (its creator sizes it just after creating the name)."""
    from epkit import _C

    last = "it does not exist"
    while True:
        if _C.shm_exists(name):
            try:
                return _C.ShmSegment(name, size, False)
            except RuntimeError as exc:
                if "holds" not in str(exc):  # anything but "not sized yet" is an error
                    raise
                last = str(exc)  # not sized yet, or sized differently (NVSHMEM_SYMMETRIC_SIZE differs)
        if time.monotonic() > deadline:
            raise RuntimeError(f"init: PE {pe}'s heap was not ready within {_timeout():g} s ({last})")
        time.sleep(1e-3)


def _unlink_quietly(seg) -> None:
    with contextlib.suppress(Exception):
        seg.unlink()


def finalize() -> None:
    if _state["initialized"]:
        if _state.get("attached"):  # gives back attach()'s reference: the job stays with whoever started it
            _barrier()  # still collective, as nvshmem_finalize is
            _state.update(initialized=False, finalized=True, attached=False)
            return
        barrier_all()
        _state.update(job=False, initialized=False, finalized=True, heaps=[])


def job_status() -> int:
    """2 while an NVSHMEM job runs in this process (whoever started it), else 0 (``nvshmemx_init_status``)."""
    return 2 if _state["job"] else 0


def attach() -> None:
    """Let this module use the job another library (torch's symmetric memory) started in this process."""
    if _state["initialized"]:
        return
    if _state["finalized"]:
        raise RuntimeError("attach: NVSHMEM was finalized in this process")
    if not _state["job"]:
        raise RuntimeError("attach: no NVSHMEM job is running in this process to attach to")
    _count("attach")
    _state.update(initialized=True, attached=True)


def initialized() -> bool:
    return _state["initialized"]


def finalized() -> bool:
    return _state["finalized"]


def my_pe() -> int:
    _require_init("my_pe")
    return _state["me"]


def n_pes() -> int:
    _require_init("n_pes")
    return _state["n_pes"]


def barrier_all() -> None:
    """Every PE reaches this point: each posts its epoch into every heap's control words and waits for all."""
    _require_init("barrier_all")
    _barrier()


def _barrier() -> None:
    _require_job("barrier_all")
    _count("barrier_all")
    _state["barrier"] += 1
    epoch, me = _state["barrier"], _state["me"]
    for heap in _state["heaps"]:
        heap.store(me * 8, epoch)
    deadline = time.monotonic() + _timeout()
    for pe in range(_state["n_pes"]):
        try:
            _state["heaps"][me].wait_until(pe * 8, ">=", epoch, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise RuntimeError(f"barrier_all: PE {pe} did not arrive within {_timeout():g} s") from None


# Symmetric memory


def malloc(nbytes: int) -> int:
    """Collective allocation at the same offset in every heap, zero-filled, then a barrier."""
    _require_init("malloc")
    return _malloc(nbytes, zero=True)


def _malloc(nbytes: int, zero: bool) -> int:
    """The collective allocation (``zero=False``: left as the heap holds it, as ``nvshmem_malloc`` itself does)."""
    _require_job("malloc")
    _count("malloc")
    size = -(-max(nbytes, 1) // _ALLOC_ALIGN) * _ALLOC_ALIGN
    off = next((o for o, n in _state["free"] if n >= size), None)
    if off is not None:  # first fit in a freed range (every PE frees in the same order, so offsets agree)
        n = dict(_state["free"])[off]
        _state["free"].remove((off, n))
        if n > size:
            _state["free"].append((off + size, n - size))
    else:
        if _state["top"] + size > _state["heaps"][0].size:
            raise RuntimeError(
                f"nvshmem_malloc({nbytes}) failed: the {_state['heaps'][0].size}-byte emulated heap is full"
            )
        off, _state["top"] = _state["top"], _state["top"] + size
    _state["allocs"][off] = size
    base = _state["heaps"][_state["me"]].addr
    if zero:
        ctypes.memset(base + off, 0, size)
    _barrier()  # as epkit's malloc: no PE writes into a peer's allocation before the peer zeroed it
    return base + off


def free(ptr: int) -> None:
    _enter("free")
    off = ptr - _state["heaps"][_state["me"]].addr
    if off not in _state["allocs"]:
        raise ValueError(f"free: {ptr:#x} is not a live symmetric allocation")
    barrier_all()  # nvshmem_free is collective (a failed barrier leaves the allocation in place on every PE)
    _state["free"].append((off, _state["allocs"].pop(off)))


def peer_ptr(ptr: int, pe: int) -> int:
    """``ptr`` (symmetric) as an address of PE ``pe``'s memory, or 0 when ``pe`` is not directly addressable."""
    _require_init("peer_ptr")
    return _peer_ptr(ptr, pe)


def _peer_ptr(ptr: int, pe: int) -> int:
    _require_job("peer_ptr")
    _count("peer_ptr")
    _require_pe(pe, "peer_ptr")
    me, size = _state["me"], _state["domain_size"]
    if pe != me and (not _state["p2p"] or (size and pe // size != me // size)):
        return 0
    return _state["heaps"][pe].addr + (ptr - _state["heaps"][me].addr)


# One-sided ops (the stream is the calling thread: complete on return)


def _signal(sig: int, value: int, op: str, pe: int) -> None:
    if sig == 0 or sig % 8:
        raise ValueError("signal_op needs an 8-byte aligned symmetric signal address")
    off = _offset(sig, 8, "signal")
    heap = _state["heaps"][pe]
    if op == "set":
        heap.store(off, value & _MASK64)
    else:
        heap.fetch_add(off, value & _MASK64)


def _guarded(guard: int, what: str) -> bool:
    """The optional guard word (the buffer's sticky word) is set: the op must not happen (counted)."""
    if guard and ctypes.c_uint64.from_address(guard).value != 0:
        _count(f"{what}/guarded")
        return True
    return False


def signal_op(sig: int, value: int, op: str, pe: int, stream: int, guard: int = 0) -> None:
    """Set/add ``value`` to the 64-bit word at symmetric ``sig`` on ``pe`` (release: earlier writes first);
    nothing when the local word ``guard`` (0: none) is nonzero."""
    _enter("signal_op")
    op = _parse_op(op)
    _require_pe(pe, "signal_op")
    if sig == 0 or sig % 8:
        raise ValueError("signal_op needs an 8-byte aligned symmetric signal address")
    if _guarded(guard, "signal_op"):
        return
    _signal(sig, value, op, pe)


def put_signal(
    dst: int, src: int, nbytes: int, sig: int, value: int, op: str, pe: int, stream: int, guard: int = 0
) -> None:
    """Copy ``nbytes`` from local ``src`` to symmetric ``dst`` on ``pe``, then set/add its word ``sig``;
    neither when the local word ``guard`` (0: none) is nonzero."""
    _enter("put_signal")
    op = _parse_op(op)
    _require_pe(pe, "put_signal")
    if _guarded(guard, "put_signal"):
        return
    off = _offset(dst, nbytes, "put_signal")
    if nbytes:
        ctypes.memmove(_state["heaps"][pe].addr + off, src, nbytes)
    _signal(sig, value, op, pe)  # a release store: the bytes are visible before the signal


def signal_wait(sig: int, cmp: str, value: int, timeout: float, result: int, stream: int) -> None:
    """Wait until the local word at ``sig`` satisfies ``cmp value``; ``result`` gets ``[last value, timed out]``."""
    _enter("signal_wait")
    _wait_all("signal_wait", sig, 1, 1, cmp, value, timeout, result)


def signal_wait_all(
    sig: int,
    stride: int,
    count: int,
    cmp: str,
    value: int,
    timeout: float,
    result: int,
    stream: int,
    sticky: int = 0,
    abort_words: int = 0,
    skip_on_sticky: bool = True,
) -> None:
    """Wait until each local word ``sig[i * stride]`` (``i < count``) satisfies ``cmp value`` under one deadline.

    Writes ``[last value seen, 0 | 1 + index of the first word that failed]`` to the two uint64 at
    ``result``. A word fails by timing out, or at once when its abort word (``abort_words`` words
    further, 0: none) turns nonzero while it waits; ``result[0]`` is then the abort word. A set
    ``sticky`` word makes the wait return at once with ``result[1] = 2**64 - 1`` (unless
    ``skip_on_sticky`` is False); a failure sets it. All as the device kernel does.
    """
    _require_init("signal_wait_all")
    _count("signal_wait_all/deferred" if sticky else "signal_wait_all")
    _wait_all("signal_wait_all", sig, stride, count, cmp, value, timeout, result, sticky, abort_words, skip_on_sticky)


def _wait_all(what, sig, stride, count, cmp, value, timeout, result, sticky=0, abort_words=0, skip_on_sticky=True):
    """The body of both waits (``signal_wait`` is the one-word form: a timeout gives ``result[1] = 1``)."""
    cmp = _parse_cmp(cmp)
    if result == 0:
        raise ValueError(f"{what} needs a 2-word device result buffer")
    if sig == 0 or sig % 8:
        raise ValueError(f"{what} needs an 8-byte aligned local signal address")
    if count < 0 or stride == 0:
        raise ValueError(f"{what}: count must be >= 0 and stride >= 1 (in words), got {count} and {stride}")
    out = (ctypes.c_uint64 * 2).from_address(result)
    flag = ctypes.c_uint64.from_address(sticky) if sticky else None
    if skip_on_sticky and flag is not None and flag.value != 0:
        _count(f"{what}/skipped")
        out[0], out[1] = 0, _MASK64
        return
    heap = _state["heaps"][_state["me"]]
    deadline = time.monotonic() + _seconds(timeout)
    seen = 0
    for i in range(count):
        off = _offset(sig + 8 * i * stride, 8, what)
        abort_off = _offset(sig + 8 * (i * stride + abort_words), 8, what) if abort_words else None
        status, seen = wait_word(heap, off, cmp, value, deadline, abort_off)
        if status:  # seen: the abort word (1) or the word's last value (2)
            out[0], out[1] = seen, i + 1
            if flag is not None:
                flag.value = 1
            _count(f"{what}/aborted" if status == 1 else f"{what}/timed_out")
            return
    out[0], out[1] = seen, 0


def _seconds(timeout: float) -> float:
    """A timeout as the device code takes it: clamped to [0, 1e6] s, NaN as 0."""
    t = float(timeout)
    return min(max(t, 0.0), 1e6) if t == t else 0.0


# Installation


def install(p2p: bool = True, domain_size: int = 0) -> None:
    """Make the nvshmem transport use this emulator in this process (call before any nvshmem buffer).

    Parameters
    ----------
    p2p : bool
        True: every PE directly addressable (one NVLink domain: ``peer()`` views, one-sided stores);
        False: only this PE (``peer_ptr`` gives 0), so puts go through staging and ``put_signal``.
    domain_size : int
        With ``p2p``: PEs reach only their NVLink domain's (``pe // domain_size``) directly; 0: one domain.
    """
    from epkit.collectives.transports import nvshmem_job

    _state["p2p"], _state["domain_size"] = bool(p2p), max(int(domain_size), 0)
    nvshmem_job.use_extension(sys.modules[__name__])


def uninstall() -> None:
    """Back to the real ``epkit._C_cuda``."""
    from epkit.collectives.transports import nvshmem_job

    nvshmem_job.use_extension(None)


def installed() -> bool:
    from epkit.collectives.transports import nvshmem_job

    return nvshmem_job.emulated()


def resolve_transport(transport: str) -> str:
    """Test parameter -> SymmBuffer transport: ``"nvemu"`` / ``"nvemu-nop2p"`` install the emulator
    (with / without peer views) and give ``"nvshmem"``, as ``"nvemu-domN"`` does with NVLink domains of N
    PEs; ``"nvemu-torch"`` / ``"nvemu-torch-nop2p"`` also install torch's symmetric-memory stand-in, so that
    the memory comes through the torch provider; any other name is returned unchanged."""
    size = transport[9:] if transport.startswith("nvemu-dom") else ""  # "nvemu-dom2": domains of 2 PEs
    if transport in ("nvemu", "nvemu-nop2p") or size.isdigit():
        install(p2p=transport != "nvemu-nop2p", domain_size=int(size or 0))
        return "nvshmem"
    if transport in ("nvemu-torch", "nvemu-torch-nop2p"):
        from epkit.testing import torch_symm_emulator

        torch_symm_emulator.install(p2p=transport == "nvemu-torch")
        return "nvshmem"
    return transport
