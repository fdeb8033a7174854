"""SymmBuffer's nvshmem transport: refusal on CPU ranks, its pure helpers, and (on a GPU) one-PE loopback runs.

The GPU tests run in a fresh process each (run_ranks with one rank): NVSHMEM is one job per process and
cannot be initialised again there once finalized.
"""

import ctypes
import importlib.util
import time

import pytest
import torch
import torch.distributed as dist

from epkit.backends import BackendUnavailableError
from epkit.collectives.symm_buffer import TRANSPORTS, SymmBuffer
from epkit.collectives.transports import nvshmem_job
from epkit.collectives.transports.base import layout
from epkit.collectives.transports.nvshmem_job import device_view, missing_reason, plan_job
from epkit.testing.markers import requires_cuda
from epkit.testing.multiprocess import run_ranks

# CPU ranks: a clear refusal, and auto unchanged


def _try_nvshmem(rank, world_size):
    try:
        SymmBuffer(dist.group.WORLD, 4096, transport="nvshmem", num_signals=2)
    except BackendUnavailableError as exc:
        return str(exc)
    return "created"


@pytest.mark.parametrize("world_size", [1, 2])
def test_nvshmem_on_cpu_ranks_is_unavailable_with_reason(world_size, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the spawned ranks see no GPU, even on a GPU machine
    msgs = run_ranks(_try_nvshmem, world_size, timeout=60)
    for rank, msg in enumerate(msgs):
        assert msg.startswith("SymmBuffer transport 'nvshmem' cannot run here"), (rank, msg)
        # Every rank reports every rank's reason (they were all-gathered), and how to get the transport.
        for r in range(world_size):
            assert f"rank {r}: torch sees no CUDA device" in msg, (rank, msg)
        assert "EPKIT_CUDA=1" in msg and "cuda13" in msg and "nvcc" in msg, msg
    assert len(set(msgs)) == 1, msgs


def _auto_transport(rank, world_size):
    buf = SymmBuffer(dist.group.WORLD, 256, transport="auto")
    got = (buf.transport, buf.is_within_domain())
    buf.close()
    return got


def test_auto_still_picks_shm_on_gloo_one_host():
    assert "nvshmem" in TRANSPORTS
    assert run_ranks(_auto_transport, 2, timeout=60) == [("shm", True)] * 2


def _ep_buffer_on_nvshmem(rank, world_size):
    from epkit.collectives.ep_buffer import EPBuffer

    try:
        EPBuffer(dist.group.WORLD, 128, 4, 16, 2, transport="nvshmem")
    except BackendUnavailableError as exc:
        return str(exc)
    return "created"


def test_ep_buffer_on_nvshmem_without_a_gpu_says_what_is_missing(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    (msg,) = run_ranks(_ep_buffer_on_nvshmem, 1, timeout=60)
    assert msg.startswith("SymmBuffer transport 'nvshmem' cannot run here") and "torch sees no CUDA device" in msg, msg


def test_missing_reason_matches_this_machine():
    reason = missing_reason()
    cuda = torch.cuda.is_available()
    built = importlib.util.find_spec("epkit._C_cuda") is not None
    assert (reason is None) == (cuda and built), reason
    if not cuda:
        assert "torch sees no CUDA device" in reason
    if not built:
        assert "epkit._C_cuda" in reason


# Pure helpers


def test_layout_words_and_aligned_data():
    # 4 reserved words per rank (READY, ACK, BARRIER, NOTICE) + user words; data starts on a 4096-byte boundary.
    assert layout(2, 4, 1000) == (12, 4096, 5096)
    assert layout(1, 0, 0) == (4, 4096, 4097)  # an empty buffer still allocates one byte
    assert layout(200, 64, 1 << 20) == (864, 8192, 8192 + (1 << 20))  # 864 words = 6912 bytes -> 2 pages
    assert layout(127, 4, 7) == (512, 4096, 4103)  # exactly one page of words
    for bad in ((0, 4, 10), (2, -1, 10), (2, 4, -1), (2, 4, 1.5)):
        with pytest.raises(ValueError, match="must be an int"):
            layout(*bad)


def test_layout_matches_symm_buffer_word_offsets():
    # SymmBuffer puts word (kind, src) at (kind * w + src) * 8 and user word i at (4w + i) * 8.
    w, s = 4, 5
    num_words, data_offset, _ = layout(w, s, 64)
    last_user_word_end = (4 * w + (s - 1)) * 8 + 8
    assert num_words * 8 == last_user_word_end == 168
    assert data_offset >= last_user_word_end and data_offset % 4096 == 0


def test_plan_job_init_reuse_adopt():
    ranks = [0, 1, 2]
    assert plan_job([("none",)] * 3, ranks, [0, 1, 2]) == "init"
    job = [("job", (0, 1, 2), d) for d in (0, 1, 2)]
    assert plan_job(job, ranks, [0, 1, 2]) == "reuse"
    assert plan_job(job, range(3), [0, 1, 2]) == "reuse"  # any sequence of the same ranks
    ext = [("external", pe, 3) for pe in range(3)]
    assert plan_job(ext, ranks, [0, 1, 2]) == "adopt"


def test_plan_job_refuses_two_ranks_on_one_gpu():
    ranks = [0, 1, 2]
    gpus = ["hostA/GPU-aa", "hostA/GPU-bb", "hostB/GPU-aa"]  # same UUID text on another host is another GPU
    assert plan_job([("none",)] * 3, ranks, [0, 1, 0], gpus) == "init"
    with pytest.raises(ValueError, match=r"group ranks \[0, 2\] all use hostA/GPU-aa.*set_device"):
        plan_job([("none",)] * 3, ranks, [0, 1, 0], ["hostA/GPU-aa", "hostA/GPU-bb", "hostA/GPU-aa"])


def test_plan_job_other_membership_is_a_value_error():
    job = [("job", (0, 1, 2, 3), d) for d in (0, 1)]
    with pytest.raises(ValueError, match=r"global ranks \[0, 1\] but group rank 0 is in an NVSHMEM job over global"):
        plan_job(job, [0, 1], [0, 1])
    # Some ranks in a job, others not: every rank sees the same states, so every rank raises.
    mixed = [("job", (0, 1), 0), ("none",)]
    with pytest.raises(ValueError, match="group rank 1 has no NVSHMEM job.*teams are not supported"):
        plan_job(mixed, [0, 1], [0, 0])
    # An external job whose PE numbers are not the group ranks is not adopted.
    with pytest.raises(ValueError, match="PE 1 of an NVSHMEM job of 2 PEs started outside SymmBuffer"):
        plan_job([("external", 1, 2), ("external", 0, 2)], [0, 1], [0, 1])
    with pytest.raises(ValueError, match="one state and one device per group rank"):
        plan_job([("none",)], [0, 1], [0, 1])


def test_plan_job_finalized_or_moved_device():
    with pytest.raises(RuntimeError, match=r"finalized in the processes of group ranks \[1\]"):
        plan_job([("none",), ("finalized",)], [0, 1], [0, 1])
    job = [("job", (0, 1), 0), ("job", (0, 1), 1)]
    with pytest.raises(ValueError, match=r"group ranks \[1\]: the current CUDA device \(\[3\]\)"):
        plan_job(job, [0, 1], [0, 3])


def test_local_job_state_reflects_the_extension():
    if importlib.util.find_spec("epkit._C_cuda") is None:
        with pytest.raises(ImportError):
            nvshmem_job.local_job_state()
        return
    import epkit._C_cuda as cc

    state = nvshmem_job.local_job_state()
    if cc.finalized():  # another test of this process (test_csrc_cuda on a GPU) ran NVSHMEM and ended it
        assert state == ("finalized",)
    elif cc.initialized():
        assert state[0] in ("external", "job"), state
    else:
        assert state == ("none",)


def test_device_view_aliases_memory():
    raw = (ctypes.c_uint8 * 64)()
    addr = ctypes.addressof(raw)
    view = device_view(addr, 64, torch.device("cpu"))
    assert view.dtype == torch.uint8 and view.shape == (64,) and view.data_ptr() == addr
    view[3:6] = torch.tensor([7, 8, 9], dtype=torch.uint8)
    assert list(raw[2:7]) == [0, 7, 8, 9, 0]
    raw[10] = 200
    assert int(view[10]) == 200
    assert device_view(0, 0, torch.device("cpu")).numel() == 0
    with pytest.raises(ValueError, match="addr must be a positive int"):
        device_view(0, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="nbytes must be a non-negative int"):
        device_view(addr, -1, torch.device("cpu"))


# GPU: one PE, one process per test


def _gpu_loopback(rank, world_size):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    nbytes = 1 << 20
    buf = SymmBuffer(dist.group.WORLD, nbytes, transport="nvshmem", num_signals=4, timeout=10)
    assert buf.transport == "nvshmem"
    loc = buf.local
    assert loc.device == dev and loc.dtype == torch.uint8 and loc.shape == (nbytes,)
    assert buf.is_within_domain()
    assert buf.peer(0).data_ptr() == loc.data_ptr()
    buf.peer(0)[100:108].copy_(torch.arange(1, 9, dtype=torch.uint8, device=dev))
    assert loc[100:108].tolist() == list(range(1, 9))

    # Signals: set, add, the full 64-bit range, and validation before any launch.
    buf.signal(0, 1, 7, op="set")
    assert buf.wait_until(1, "==", 7, timeout=5) == 7
    buf.signal(0, 1, 5, op="add")
    assert buf.wait_until(1, ">=", 12, timeout=5) == 12
    assert buf.read_signal(1) == 12
    buf.signal(0, 3, 2**64 - 1)
    assert buf.wait_until(3, "==", 2**64 - 1, timeout=5) == 2**64 - 1
    with pytest.raises(ValueError, match="signal value"):
        buf.signal(0, 1, -1)
    with pytest.raises(ValueError, match="op must be"):
        buf.signal(0, 1, 1, op="xor")
    with pytest.raises(ValueError, match="unknown comparison"):
        buf.wait_until(1, "~", 1, timeout=1)
    with pytest.raises(ValueError, match="signal index"):
        buf.signal(0, 4, 1)

    # A wait that cannot be satisfied times out after about its timeout, naming the word.
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="signal word 2 did not satisfy > 0 within 0.2 s"):
        buf.wait_until(2, ">", 0, timeout=0.2)
    waited = time.monotonic() - t0
    assert 0.15 <= waited < 15, waited
    buf.barrier()  # a user-level timeout leaves the buffer usable
    buf.barrier()

    # Exchanges to self: bit-exact, consecutive epochs, odd and zero sizes.
    gen = torch.Generator(device=dev).manual_seed(7)
    region = nbytes // 2
    for n in (region, 12345, 0):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=gen)
        ex = buf.exchange(region, tag="loop")
        dst = ex.send_region(0)
        assert dst.data_ptr() == loc.data_ptr()  # rank 0's region of its own buffer: no staging
        dst[:n].copy_(data)
        ex.commit(0, n)
        got = ex.receive([n])
        assert (n == 0 or got[0].data_ptr() == loc.data_ptr()) and torch.equal(got[0], data), n
        ex.release()
    out = buf.all_to_all([torch.full((33,), 9, dtype=torch.uint8, device=dev)], [33], region_bytes=64)
    assert out[0].device == dev and out[0].tolist() == [9] * 33

    # A second buffer reuses the job; closing frees the symmetric memory.
    other = SymmBuffer(dist.group.WORLD, 4096, transport="nvshmem")
    other.barrier()
    other.close()
    buf.close()
    assert buf.local.numel() == 0
    with pytest.raises(RuntimeError, match="closed"):
        buf.signal(0, 0, 1)
    nvshmem_job.finalize()
    with pytest.raises(RuntimeError, match="cannot be initialised twice"):
        SymmBuffer(dist.group.WORLD, 4096, transport="nvshmem")
    return True


@requires_cuda
def test_gpu_one_pe_signals_waits_barrier_exchanges():
    assert run_ranks(_gpu_loopback, 1, timeout=180) == [True]


def _gpu_staged_put(rank, world_size):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    buf = SymmBuffer(dist.group.WORLD, 1 << 16, transport="nvshmem", timeout=10)
    # Simulate a peer outside the NVLink domain (nvshmem_ptr gave 0): the put-with-signal path.
    buf.impl.peer_data[0] = 0
    buf.impl.views[0] = None
    assert not buf.is_within_domain()
    with pytest.raises(RuntimeError, match="not directly addressable"):
        buf.peer(0)
    gen = torch.Generator(device=dev).manual_seed(3)
    for n in (4096, 777, 0):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=gen)
        ex = buf.exchange(1 << 15, tag="staged")
        stage = ex.send_region(0)
        assert stage.data_ptr() != buf.local.data_ptr() and stage.device == dev
        stage[:n].copy_(data)
        ex.commit(0, n)
        got = ex.receive([n])
        assert torch.equal(got[0], data), n
        ex.release()
    buf.barrier()
    buf.close()
    nvshmem_job.finalize()
    return True


@requires_cuda
def test_gpu_one_pe_put_with_signal_when_peer_not_addressable():
    assert run_ranks(_gpu_staged_put, 1, timeout=180) == [True]
