"""SymmBuffer on real CPU ranks: shm segments, one-sided puts, signals, barriers, exchanges, cleanup."""

import glob
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from epkit.collectives.symm_buffer import PeerFailedError, SymmBuffer
from epkit.testing.multiprocess import run_ranks
from epkit.testing.nvshmem_emulator import resolve_transport


def _shm_names():
    return set(glob.glob("/dev/shm/epkit-*"))


def _puts_and_signals(rank, world_size, transport):
    mode, transport = transport, resolve_transport(transport)
    buf = SymmBuffer(dist.group.WORLD, 4096, transport=transport, num_signals=4, timeout=20)
    direct = mode in ("shm", "nvemu", "nvemu-torch")  # every peer addressable
    assert buf.transport == transport and buf.is_within_domain() == direct
    provider = None if transport != "nvshmem" else "torch" if "torch" in mode else "epkit"
    assert buf.nvshmem_provider == provider, (buf.nvshmem_provider, buf.nvshmem_note)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    if direct:
        buf.peer(nxt)[rank * 8 : rank * 8 + 8].copy_(torch.full((8,), rank + 1, dtype=torch.uint8))
        buf.signal(nxt, 0, 1, op="add")
        assert buf.wait_until(0, ">=", 1) == 1
        assert buf.local[prev * 8 : prev * 8 + 8].tolist() == [prev + 1] * 8
        buf.barrier()
        buf.barrier()
    elif mode in ("nvemu-nop2p", "nvemu-torch-nop2p"):  # signals still reach every peer; only views are missing
        assert buf.peer(rank).data_ptr() == buf.local.data_ptr()
        with pytest.raises(RuntimeError, match="not directly addressable"):
            buf.peer(nxt)
        buf.signal(nxt, 1, 5, op="set")
        buf.barrier()  # the set lands before the add below
        buf.signal(nxt, 1, 2, op="add")
        assert buf.wait_until(1, "==", 7) == 7 and buf.read_signal(1) == 7
        buf.barrier()
    else:
        with pytest.raises(RuntimeError, match="directly addressable"):
            buf.peer(0)
        buf.barrier()
    # all_to_all: rank r sends r+1 bytes of value 10*r+dst to each dst.
    send = [torch.full((rank + 1,), 10 * rank + dst, dtype=torch.uint8) for dst in range(world_size)]
    for _ in range(3):  # repeated exchanges reuse the regions safely
        got = buf.all_to_all(send, [src + 1 for src in range(world_size)], region_bytes=64)
        assert [g.tolist() for g in got] == [[10 * src + rank] * (src + 1) for src in range(world_size)]
    buf.close()
    return True


@pytest.mark.parametrize("transport", ["shm", "torch", "nvemu", "nvemu-nop2p", "nvemu-torch", "nvemu-torch-nop2p"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_puts_signals_exchanges(transport, world_size):
    before = _shm_names()
    assert run_ranks(_puts_and_signals, world_size, transport, timeout=60) == [True] * world_size
    assert _shm_names() <= before, "segments left in /dev/shm"


def _segment_mode(rank, world_size):
    from epkit import _C

    buf = SymmBuffer(dist.group.WORLD, 64, transport="shm")
    buf.barrier()  # every rank has returned from creation, so every rank has unlinked its own name
    gone = [not _C.shm_exists(s.name) for s in buf.impl.segments]
    buf.close()
    return gone


def test_segments_unlinked_after_attach():
    assert run_ranks(_segment_mode, 3, timeout=40) == [[True] * 3] * 3


def _mappings():
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/epkit-" in line for line in f)


def _views_outlive_close(rank, world_size):
    import gc

    buf = SymmBuffer(dist.group.WORLD, 1 << 16, transport="shm")
    mapped = _mappings()
    local, peer = buf.local[128:256], buf.peer((rank + 1) % world_size)[:64].view(torch.int32)
    local.fill_(rank + 7)
    buf.barrier()
    buf.close()
    # Views kept past close() are still mapped memory: reading and writing them does not fault.
    local.add_(1)
    peer.zero_()
    ok = local.tolist() == [rank + 8] * 128 and peer.tolist() == [0] * 16
    still = _mappings()
    del local, peer
    gc.collect()
    # With the last view gone, every segment of the buffer is unmapped.
    return ok, mapped == world_size, still == world_size, _mappings() == 0


def test_views_kept_past_close_stay_valid_then_unmap():
    assert run_ranks(_views_outlive_close, 2, timeout=40) == [(True, True, True, True)] * 2


def _killed_peer(rank, world_size):
    buf = SymmBuffer(dist.group.WORLD, 1 << 16, transport="shm", timeout=4)
    buf.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        buf.barrier()
    except TimeoutError as exc:
        return str(exc), time.monotonic() - t0
    return "no error", 0.0


def test_dead_peer_times_out_naming_it():
    before = _shm_names()
    res = run_ranks(_killed_peer, 3, timeout=40, may_die=(1,))
    assert res[1] is None
    for rank in (0, 2):
        msg, waited = res[rank]
        # Its own timeout, or the notice of the survivor whose timeout came first (PeerFailedError).
        assert re.search(r"rank 1 sent no (barrier signal within 4 s|signal within its timeout)", msg), msg
        assert waited < 15
    assert _shm_names() <= before, "a killed rank must leave nothing in /dev/shm"


def _silent_peer_reported(rank, world_size, transport):
    buf = SymmBuffer(dist.group.WORLD, 1 << 12, transport=resolve_transport(transport), timeout=30)
    buf.barrier()
    if rank == 2:  # alive but silent: never enters the second barrier
        time.sleep(4)
        return None
    return _outcome(lambda: buf.barrier(timeout=1.0 if rank == 0 else 30.0))


def _outcome(fn):
    """``(kind, peer, silent, message)`` of how ``fn()`` ended."""
    try:
        fn()
    except PeerFailedError as exc:
        return "PeerFailedError", exc.peer, exc.silent, str(exc)
    except TimeoutError as exc:
        return "TimeoutError", None, None, str(exc)
    return "no error", None, None, ""


@pytest.mark.parametrize("transport", ["shm", "nvemu"])
def test_a_rank_that_gives_up_tells_the_others(transport):
    # Rank 0 waits 1 s for the silent rank 2 and gives up; rank 1, waiting up to 30 s for rank 2, is told at
    # once through rank 2's words, and names rank 2 (not rank 0) as the silent one.
    res = run_ranks(_silent_peer_reported, 3, transport, timeout=40)
    assert res[0][0] == "TimeoutError" and "rank 2 sent no barrier signal within 1 s" in res[0][3], res
    kind, peer, silent, msg = res[1]
    assert (kind, peer, silent) == ("PeerFailedError", 2, True), res
    assert "rank 1: barrier abandoned: rank 0 reports that rank 2 sent no signal within its timeout" in msg, msg


def _killed_in_bootstrap(rank, world_size):
    from epkit import _C

    if rank == 1:  # dies right after creating its segment, before any peer could unlink its name
        original = _C.ShmSegment

        def create_then_die(name, size, create):
            seg = original(name, size, create)
            if create:
                os.kill(os.getpid(), signal.SIGKILL)
            return seg

        _C.ShmSegment = create_then_die
    try:
        SymmBuffer(dist.group.WORLD, 1 << 16, transport="shm", timeout=4)
    except Exception as exc:  # noqa: BLE001 - gloo reports the lost peer in its own words
        return type(exc).__name__
    return "no error"


def test_rank_killed_inside_the_bootstrap_leaves_no_segment():
    before = _shm_names()
    res = run_ranks(_killed_in_bootstrap, 3, timeout=60, may_die=(1,))
    assert res[1] is None and res[0] != "no error" and res[2] != "no error", res
    assert _shm_names() <= before, "the survivors must remove the dead rank's name"


def _notice_passed_on(rank, world_size, transport):
    buf = SymmBuffer(dist.group.WORLD, 4096, transport=resolve_transport(transport), timeout=20)
    ex = buf.exchange(64)
    for d in range(world_size):
        ex.send_region(d)[:1].fill_(rank)
        ex.commit(d, 1)
    ex.receive([1] * world_size)
    if rank == 2:  # fails after receiving, before releasing: rank 1 learns it from its acknowledgement wait
        time.sleep(0.5)
        ex.abandon("rank 2 failed")
        time.sleep(3)
        return None
    ex.release()
    ex = buf.exchange(64)

    def second_exchange():
        for d in [(rank + k) % world_size for k in range(world_size)]:
            if rank == 0:
                ex.commit(d, 0)  # nothing to send: rank 0 never waits on rank 2's acknowledgement
            else:
                ex.send_region(d)[:1].fill_(rank)
                ex.commit(d, 1)
        ex.receive([0] * world_size)

    return _outcome(second_exchange)


@pytest.mark.parametrize("transport", ["shm", "nvemu"])
def test_a_notice_is_passed_on_to_ranks_waiting_elsewhere(transport):
    # Rank 0 waits on rank 1's data, never on rank 2: it learns of rank 2's failure because rank 1, told by
    # rank 2, passes the notice on, instead of timing out after 20 s and blaming rank 1.
    res = run_ranks(_notice_passed_on, 3, transport, timeout=60)
    for rank in (0, 1):
        kind, peer, silent, msg = res[rank]
        assert (kind, peer, silent) == ("PeerFailedError", 2, False), res
        assert "rank 2 gave up on this buffer" in msg, msg
