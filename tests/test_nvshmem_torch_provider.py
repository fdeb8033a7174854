"""The nvshmem transport's torch provider: memory from torch's symmetric memory (NVSHMEM backend).

On CPU ranks torch's part is played by ``epkit.testing.torch_symm_emulator`` over the NVSHMEM emulator; the
first test pins that stand-in to the installed torch's own function signatures, so that the provider is
tested against the interface it will meet. What runs on a GPU is ``bench/gpu_check.py``'s job.
"""

import inspect
import os

import pytest
import torch.distributed as dist

from epkit.backends import BackendUnavailableError
from epkit.collectives.symm_buffer import SymmBuffer
from epkit.collectives.transports import nvshmem_torch
from epkit.collectives.transports.nvshmem_torch import plan_provider
from epkit.testing import nvshmem_emulator as emu
from epkit.testing import torch_symm_emulator as tse
from epkit.testing.multiprocess import run_ranks


def test_stand_in_has_the_installed_torchs_signatures():
    import torch.distributed._symmetric_memory as sm

    for name in nvshmem_torch.TORCH_SYMM_API:
        real, fake = inspect.signature(getattr(sm, name)), inspect.signature(getattr(tse, name))
        assert [(p.name, p.kind) for p in real.parameters.values()] == [
            (p.name, p.kind) for p in fake.parameters.values()
        ], (name, real, fake)
    # The attributes of the rendezvous handle the provider reads exist on torch's handle type.
    for attr in ("buffer_ptrs", "signal_pad_ptrs", "rank", "world_size", "buffer_size", "offset"):
        assert hasattr(sm._SymmetricMemory, attr), attr


def test_plan_provider_decisions():
    none, ok = [("none",)] * 2, [None, None]
    assert plan_provider("init", none, ok, "auto", True) == ("torch", "")
    assert plan_provider("init", none, ok, "epkit", True) == ("epkit", "EPKIT_NVSHMEM_PROVIDER=epkit")
    provider, note = plan_provider("init", none, [None, "no NVSHMEM"], "auto", True)
    assert provider == "epkit" and "rank 1: no NVSHMEM" in note
    provider, note = plan_provider("init", none, ok, "auto", False)
    assert provider == "epkit" and "not every rank of the default group" in note
    with pytest.raises(BackendUnavailableError, match="EPKIT_NVSHMEM_PROVIDER=torch, but .*rank 0: old torch"):
        plan_provider("init", none, ["old torch", None], "torch", True)
    # A job already running decides by itself who provides.
    job = [("job", (0, 1), d, "torch") for d in (0, 1)]
    assert plan_provider("reuse", job, ["x", "x"], "epkit", True) == ("torch", "")
    assert plan_provider("reuse", [("job", (0, 1), d) for d in (0, 1)], ok, "auto", True) == ("epkit", "")
    adopted = [("job", (0, 1), d, "adopted") for d in (0, 1)]
    assert plan_provider("reuse", adopted, ok, "torch", True) == ("epkit", "")
    assert plan_provider("adopt", [("external", i, 2) for i in range(2)], ok, "torch", True) == ("epkit", "")
    # torch started the job: joining it through torch is the only way.
    host = [("host",)] * 2
    assert plan_provider("attach", host, ok, "auto", True) == ("torch", "")
    with pytest.raises(BackendUnavailableError, match="only through torch's symmetric memory, but rank 1: gone"):
        plan_provider("attach", host, [None, "gone"], "auto", True)
    with pytest.raises(ValueError, match="EPKIT_NVSHMEM_PROVIDER=epkit"):
        plan_provider("attach", host, ok, "epkit", True)


def _torch_provider_run(rank, world_size):
    """Two buffers through the torch provider: zeroed memory, one backend switch, epkit's ops joined.

    As with torch's memory pool, each tensor sits 4 KiB into its symmetric allocation (``handle.offset``)."""
    tse.install(p2p=True, pool_offset=4096)
    a = SymmBuffer(dist.group.WORLD, 1 << 12, transport="nvshmem", num_signals=2, timeout=20)
    fresh = not a.local.any() and a.read_signal(0) == 0  # torch's allocation came filled with 0xA5
    a.barrier()
    b = SymmBuffer(dist.group.WORLD, 1 << 10, transport="nvshmem", timeout=20)
    b.signal((rank + 1) % world_size, 0, 40 + rank, op="set")
    got = b.wait_until(0, "==", 40 + (rank - 1) % world_size)
    b.barrier()
    out = (a.nvshmem_provider, b.nvshmem_provider, a.nvshmem_note, fresh, got == 40 + (rank - 1) % world_size)
    a_ptr = a.local.data_ptr()
    a.local.fill_(7)
    a.close()
    b.close()
    # torch never frees what it rendezvoused: a closed buffer's memory serves the next buffer of its size.
    c = SymmBuffer(dist.group.WORLD, 1 << 12, transport="nvshmem", num_signals=2, timeout=20)
    reused = (c.local.data_ptr() == a_ptr, not c.local.any())
    c.barrier()
    c.close()
    fake, nv = tse.calls(), emu.calls()
    return out, reused, fake.get("set_backend:NVSHMEM", 0), fake.get("empty", 0), nv.get("attach", 0), "init" in nv


def test_torch_provider_allocates_through_torch_and_joins_its_job():
    for out, reused, set_backend, empties, attaches, epkit_init in run_ranks(_torch_provider_run, 2, timeout=60):
        assert out == ("torch", "torch", "", True, True)
        assert reused == (True, True)
        assert (set_backend, empties, attaches, epkit_init) == (1, 2, 1, False)


def _fallback(rank, world_size, case):
    if case == "unavailable":
        tse.install(available=False)
    elif case == "backend-taken":  # another backend allocated already: torch refuses to switch
        tse.install()
        tse._state["allocated"] = True
    elif case == "backend-taken-on-1":  # rank 0 switches, rank 1 cannot: rank 0 switches back
        tse.install()
        tse._state["allocated"] = rank == 1
    elif case == "other-library":  # NVSHMEM started by something other than torch (its backend stays CUDA)
        tse.install()
        emu._start_job(b"0" * 128, rank, world_size)  # one fixed unique id for both ranks
    elif case == "subgroup":
        tse.install()
    group = dist.new_group([0]) if case == "subgroup" else dist.group.WORLD
    if case == "subgroup" and rank != 0:
        return None
    try:
        buf = SymmBuffer(group, 256, transport="nvshmem", timeout=20)
    except BackendUnavailableError as exc:
        return "BackendUnavailableError", str(exc), tse._state["backend"]
    provider, note = buf.nvshmem_provider, buf.nvshmem_note
    buf.close()
    return provider, note, tse._state["backend"]


@pytest.mark.parametrize(
    "case, env, want",
    [
        ("unavailable", "auto", ("epkit", "rank 1: torch reports NVSHMEM unavailable", "CUDA")),
        ("unavailable", "torch", ("BackendUnavailableError", "EPKIT_NVSHMEM_PROVIDER=torch, but", "CUDA")),
        ("backend-taken", "auto", ("epkit", "rank 0: set_backend('NVSHMEM') failed", "CUDA")),
        ("subgroup", "auto", ("epkit", "not every rank of the default group", "CUDA")),
        ("backend-taken-on-1", "auto", ("epkit", "rank 1: set_backend('NVSHMEM') failed", "CUDA")),
        ("other-library", "auto", ("BackendUnavailableError", "backend is 'CUDA', so another library started", "CUDA")),
    ],
)
def test_torch_provider_falls_back_or_refuses_with_the_reason(case, env, want, monkeypatch):
    monkeypatch.setenv("EPKIT_NVSHMEM_PROVIDER", env)
    res = run_ranks(_fallback, 2, case, timeout=60)
    for r in range(1 if case == "subgroup" else 2):
        kind, text, backend = res[r]
        assert kind == want[0] and want[1] in text and backend == want[2], res[r]


def _torch_started_first(rank, world_size, prefer):
    tse.install()
    tse.set_backend("NVSHMEM")
    user = tse.empty(64, device="cpu")  # the application used torch's NVSHMEM memory before epkit
    os.environ["EPKIT_NVSHMEM_PROVIDER"] = prefer
    try:
        buf = SymmBuffer(dist.group.WORLD, 256, transport="nvshmem", timeout=20)
    except ValueError as exc:
        return "ValueError", str(exc)
    buf.barrier()
    provider = buf.nvshmem_provider
    buf.close()
    del user
    return provider, emu.calls().get("attach", 0)


def test_a_job_torch_started_is_joined_not_restarted():
    assert run_ranks(_torch_started_first, 2, "auto", timeout=60) == [("torch", 1)] * 2
    for kind, msg in run_ranks(_torch_started_first, 2, "epkit", timeout=60):
        assert kind == "ValueError" and "can join that job only through torch" in msg


def _preferences(rank, world_size, prefs):
    tse.install()
    os.environ["EPKIT_NVSHMEM_PROVIDER"] = prefs[rank]
    try:
        SymmBuffer(dist.group.WORLD, 256, transport="nvshmem", timeout=20)
    except ValueError as exc:
        return str(exc)
    return "created"


@pytest.mark.parametrize(
    "prefs, message",
    [(("epkit", "auto"), "differs across ranks"), (("auto", "nvshmem4py"), "ranks [1] set ['nvshmem4py']")],
)
def test_provider_preferences_are_checked_on_every_rank(prefs, message):
    # Each rank reads its own environment; a rank deciding alone would leave the others in a collective.
    for msg in run_ranks(_preferences, 2, prefs, timeout=60):
        assert message in msg, msg
