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
from epkit.testing import how_it_ends
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


def _payload(src: int, dst: int, n: int) -> torch.Tensor:
    return ((torch.arange(n) * 7 + 13 * src + dst) % 256).to(torch.uint8)


def _torch_message_sizes(rank, world_size):
    from epkit.collectives.transports.torch import INLINE_BYTES

    buf = SymmBuffer(dist.group.WORLD, 0, transport="torch", timeout=20)
    sizes = [0, 1, INLINE_BYTES - 1, INLINE_BYTES, INLINE_BYTES + 1, 3 * INLINE_BYTES + 5]
    region = max(sizes) + world_size
    for n in sizes:  # exact sizes around the inline bound: rank src sends n + src bytes to each rank
        send = [_payload(rank, dst, n + rank) for dst in range(world_size)]
        got = buf.all_to_all(send, [n + src for src in range(world_size)], region_bytes=region)
        assert all(torch.equal(g, _payload(src, rank, n + src)) for src, g in enumerate(got)), n
    for k in range(len(sizes)):  # sizes only bounded: each source sends its own, the views have its size
        ex = buf.exchange(region, tag="bounded")
        for dst in range(world_size):
            n = sizes[(k + rank) % len(sizes)]
            ex.send_region(dst)[:n].copy_(_payload(rank, dst, n))
            ex.commit(dst, n)
        got = ex.receive([region] * world_size, at_most=True)
        want = [_payload(src, rank, sizes[(k + src) % len(sizes)]) for src in range(world_size)]
        assert all(torch.equal(g, v) for g, v in zip(got, want)), k
        ex.release()
    ex = buf.exchange(region, tag="too long")  # rank 1 sends 100 bytes where 10 are the bound
    for dst in range(world_size):
        ex.send_region(dst)[:100].copy_(_payload(rank, dst, 100))
        ex.commit(dst, 100 if rank == 1 and dst != 1 else 10)
    try:
        ex.receive([10] * world_size, at_most=True)
    except ValueError as exc:
        return str(exc)
    finally:
        buf.close()
    return None


def test_torch_messages_exact_and_bounded():
    # Payloads inline in their header's message and after it, of exactly the expected size or only bounded
    # (the view has what the source sent), and a source that sends more than the bound is named.
    res = run_ranks(_torch_message_sizes, 3, timeout=60)
    assert res[1] is None and res[0] == res[2].replace("rank 2:", "rank 0:"), res
    assert "rank 1's too long message is not this exchange's" in res[0] and "100 bytes" in res[0], res
    assert "at most 10 bytes" in res[0], res


def _torch_parts(rank, world_size):
    """Payloads in two parts (``commit``'s ``split``), the first received into memory of the receiver's (``into``),
    with and without ``meanwhile``; then a receiver that expects another split, and one that expects none."""
    from epkit.collectives.transports.torch import INLINE_BYTES

    buf = SymmBuffer(dist.group.WORLD, 0, transport="torch", timeout=20)
    sizes = [(10, 4), (INLINE_BYTES + 3, 5), (3 * INLINE_BYTES, 2 * INLINE_BYTES), (INLINE_BYTES, INLINE_BYTES)]
    region = max(n for n, _ in sizes) + world_size
    ran = []
    for i, (n, first) in enumerate(sizes):
        for meanwhile in (None, lambda i=i: ran.append(i)):
            ex = buf.exchange(region, tag="parts")
            for dst in range(world_size):
                ex.send_region(dst)[: n + rank].copy_(_payload(rank, dst, n + rank))
                ex.commit(dst, n + rank, split=first if dst != rank else 0)
            into = [None if src == rank else torch.full((first,), 255, dtype=torch.uint8) for src in range(world_size)]
            got = ex.receive([n + src for src in range(world_size)], into=into, meanwhile=meanwhile)
            for src in range(world_size):
                want = _payload(src, rank, n + src)
                head, rest = (want[:0], want) if src == rank else (into[src], got[src])
                assert torch.equal(torch.cat([head, rest]), want) and rest.numel() == want.numel() - head.numel()
            ex.release()
    assert ran == list(range(len(sizes))), ran  # each meanwhile ran once
    errors = []
    for theirs, mine in ((6, 5), (6, 0)):  # rank 1 splits after 6 bytes; the others expect 5, or no split
        buf = SymmBuffer(dist.group.WORLD, 0, transport="torch", timeout=20)
        ex = buf.exchange(64, tag="misplit", timeout=3)
        for dst in range(world_size):
            ex.send_region(dst)[:40].copy_(_payload(rank, dst, 40))
            ex.commit(dst, 40, split=theirs if rank == 1 and dst != 1 else 0)
        into = [torch.empty(mine, dtype=torch.uint8) if mine and src == 1 and rank != 1 else None for src in range(3)]
        try:
            ex.receive([40] * world_size, into=into)
            errors.append(None)
        except (ValueError, TimeoutError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        # every rank has its verdict before any closes the buffer: a peer's close resets the gloo pairs that rank 1
        # still waits on, which would end its wait as "died" (a CI run saw it) instead of its own timeout
        dist.barrier()
        buf.close()
    return errors


def test_torch_payload_parts():
    # A payload split in two messages lands, its first part in the receiver's memory, the rest in its view; a
    # receiver whose expected split differs (another place, or none) gets a ValueError naming the sender, which
    # sees its parts unreceived (a TimeoutError within the exchange's timeout), never a wrong byte.
    res = run_ranks(_torch_parts, 3, timeout=90)
    assert all(e.startswith("TimeoutError") and "receipt of this rank's" in e for e in res[1]), res
    for errors in (res[0], res[2]):
        assert "rank 1's misplit message is not this exchange's" in errors[0] and "split after 5 bytes" in errors[0]
        assert "rank 1's misplit message" in errors[1] and "in one part" in errors[1], errors


def _segment_names(rank, world_size):
    buf = SymmBuffer(dist.group.WORLD, 64, transport="shm")
    buf.barrier()
    named = _shm_names()  # nothing of this buffer has a name anywhere
    fds = [
        os.readlink(f"/proc/self/fd/{fd}")
        for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
    ]
    buf.close()
    return sorted(named), [f for f in fds if "epkit" in f], _mappings() == 0


def test_segments_have_no_name_and_no_descriptor():
    assert run_ranks(_segment_names, 3, timeout=40) == [([], [], True)] * 3


def _mappings():
    """This process's mappings of shm segments (anonymous memfds named epkit-shm-*)."""
    with open("/proc/self/maps") as f:
        return sum("/memfd:epkit-shm-" in line for line in f)


def _released_at_close(rank, world_size, transport):
    """Descriptors and mappings of this process before a buffer, while it lives, after close() with the garbage
    collector off (nothing may wait for it), and after a collection."""
    import gc

    def held():
        return len(os.listdir("/proc/self/fd")), _mappings()

    gc.disable()
    try:
        before = held()
        buf = SymmBuffer(dist.group.WORLD, 1 << 16, transport=transport, timeout=10)
        buf.barrier()
        during = held()
        buf.close()
        closed = held()
        del buf
        gc.collect()
        return before, during, closed, held()
    finally:
        gc.enable()


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_close_releases_descriptors_and_mappings_before_garbage_collection(transport):
    # The torch transport's own gloo group held 5 descriptors per 2-rank buffer until the collector ran.
    for before, during, closed, _ in run_ranks(_released_at_close, 2, transport, timeout=60):
        # (descriptors, shm mappings): the open buffer holds some (shm: its segments; torch: its group's sockets)
        assert during[0] > before[0] or during[1] > before[1], (before, during)
        assert closed[0] <= before[0] and closed[1] <= before[1], (before, during, closed)


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


def _killed_in_bootstrap(rank, world_size, point):
    """Rank ``victim`` SIGKILLs itself at ``point`` of the shm construction; the others report what they saw."""
    import time

    from epkit.collectives import bootstrap
    from epkit.collectives.transports import shm

    victim = 0 if point == "serving" else 1
    # Every rank past init_process_group first: gloo's full mesh can still be forming on a loaded machine when a
    # fast rank reaches its point, and a death then fails the slow rank's init instead of the buffer.
    dist.barrier()

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == victim:
        if point == "hello":
            bootstrap.Rendezvous.gather = lambda self, step, value: die()
        elif point == "memfd":
            shm.share_descriptors = lambda *a, **k: die()
        elif point == "shared":
            original = shm.share_descriptors
            shm.share_descriptors = lambda *a, **k: (original(*a, **k), die())
        elif point == "serving":
            shm._serve = lambda *a, **k: die()
    t0 = time.monotonic()
    try:
        buf = SymmBuffer(dist.group.WORLD, 1 << 16, transport="shm", timeout=2)
        buf.barrier()  # "shared": made on the survivors, who learn of the death at their first wait
    except TimeoutError as exc:
        return "TimeoutError", str(exc), time.monotonic() - t0, _mappings()
    return "no error", "", time.monotonic() - t0, _mappings()


@pytest.mark.parametrize("point", ["hello", "memfd", "shared", "serving"])
def test_rank_killed_at_each_step_of_construction_is_named_and_leaves_nothing(point):
    before = _shm_names()
    res = run_ranks(_killed_in_bootstrap, 3, point, timeout=60, may_die=(0 if point == "serving" else 1,))
    victim = 0 if point == "serving" else 1
    for rank in {0, 1, 2} - {victim}:
        kind, msg, seconds, mapped = res[rank]
        assert kind == "TimeoutError" and f"rank {victim}" in msg, (point, res)
        assert seconds < 2 + 2.5, (point, seconds)  # the buffer's 2 s timeout, not the group's
    assert _shm_names() <= before, "nothing of a buffer ever has a name in /dev/shm"


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


_PROBER = r"""
import array, os, socket, sys
names = [l.split()[-1][1:] for l in open("/proc/net/unix") if "@epkit-shm-" in l]
got = []
for name in names:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect(b"\0" + name.encode())
        fd = os.memfd_create("prober")
        s.sendmsg([b"1"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        print("connected", flush=True)
        fds = array.array("i")
        msg, anc, _, _ = s.recvmsg(4096, socket.CMSG_LEN(64 * fds.itemsize))
        got += [len(data) for _, _, data in anc]
    except OSError:
        pass
print("fds", sum(got), "names", len(names), "devshm", len([f for f in os.listdir("/dev/shm") if f.startswith("epkit")]))
"""


def _probed(rank, world_size):
    import subprocess
    import sys

    from epkit.collectives.transports import shm

    prober = []
    if rank == 0:  # a same-uid process that finds the socket and asks for a descriptor before the ranks do
        original = shm._listen

        def listen_then_probe():
            server, name = original()
            prober.append(subprocess.Popen([sys.executable, "-c", _PROBER], stdout=subprocess.PIPE, text=True))
            assert prober[0].stdout.readline().strip() == "connected"
            return server, name

        shm._listen = listen_then_probe
    buf = SymmBuffer(dist.group.WORLD, 4096, transport="shm", timeout=10)
    ok = run_barrier = buf.barrier() is None
    buf.close()
    if prober:
        out, _ = prober[0].communicate(timeout=30)
        return ok and run_barrier, out.strip()
    return ok, ""


def test_another_process_of_the_same_user_gets_no_segment():
    res = run_ranks(_probed, 3, timeout=60)
    assert res[0] == (True, "fds 0 names 1 devshm 0"), res
    assert res[1][0] and res[2][0]


_HOLDER = r"""
import socket, sys, time
names = [l.split()[-1][1:] for l in open("/proc/net/unix") if "@epkit-shm-" in l]
held = []
for name in names:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(b"\0" + name.encode())
        held.append(s)  # connected, and never sends a byte
    except OSError:
        pass
print("connected", len(held), flush=True)
time.sleep(60)
"""


def _held(rank, world_size, uid):
    import shutil
    import subprocess
    import sys
    import time

    from epkit.collectives.transports import shm

    holders = []
    original = shm._listen

    def listen_then_hold():  # a stranger connects to every epkit listener before the ranks do, and stays idle
        server, name = original()
        python = sys.executable if uid is None else shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        holders.append(
            subprocess.Popen([python, "-c", _HOLDER], stdout=subprocess.PIPE, text=True, user=uid, cwd="/")
        )  # another user may not reach this venv's interpreter: the system's (only the standard library is used)
        line = holders[-1].stdout.readline().split()
        assert line[:1] == ["connected"] and int(line[1]) >= 1, f"the stranger did not connect: {line}"
        return server, name

    shm._listen = listen_then_hold
    start = time.monotonic()
    try:
        buf = SymmBuffer(dist.group.WORLD, 4096, transport="shm", timeout=10)
        took = time.monotonic() - start
        ok = buf.barrier() is None
        buf.close()
    finally:
        for p in holders:
            p.kill()
            p.wait(timeout=10)
    return ok, took, len(holders)


@pytest.mark.parametrize("uid", [None, 65534], ids=["same-user", "other-user"])
def test_an_idle_stranger_on_the_listener_costs_the_ranks_nothing(uid):
    # A process that connects to rank 0's listener and sends nothing used to hold it until the ranks' deadline
    # (construction failed after the full 10 s with "Broken pipe"); it is now dropped by its credentials at once.
    if uid is not None and os.geteuid() != 0:
        pytest.skip("running a stranger as another user needs root")
    res = run_ranks(_held, 2, uid, timeout=60)
    assert all(ok for ok, _, _ in res), res
    assert res[0][2] >= 1, res  # rank 0 listened, and a stranger sat on its listener
    assert max(took for _, took, _ in res) < 5, res


def test_a_listener_that_times_out_says_a_stranger_was_turned_away():
    import subprocess
    import sys

    from epkit.collectives import bootstrap
    from epkit.collectives.transports import shm

    holders = []

    class Rendezvous:  # rank 0 of two; rank 1 never comes
        rank, global_ranks = 0, (0, 1)
        names = bootstrap.Rendezvous.names

        def gather(self, key, value):
            holders.append(subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True))
            assert holders[0].stdout.readline().startswith("connected")
            return [value]

    fd = os.memfd_create("epkit-test", os.MFD_CLOEXEC)
    try:
        with pytest.raises(TimeoutError) as err:
            shm.share_descriptors(Rendezvous(), [os.getpid(), 2**22 + 7], fd, timeout=2)
    finally:
        os.close(fd)
        holders[0].kill()
        holders[0].wait(timeout=10)
    msg = str(err.value)
    assert "rank 1 did not connect to rank 0" in msg, msg
    assert f"1 connection from processes that are not ranks of this buffer was turned away (pid {holders[0].pid}" in msg


def _killed_making_the_torch_group(rank, world_size, point):
    """Rank 1 SIGKILLs itself as the torch transport makes its own gloo group (``before``: on its way there, after
    the hello; ``inside``: in the group's own rendezvous); the others report what they saw and how long it took."""

    import torch.distributed as dist_module

    from epkit.collectives import bootstrap

    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 1:
        if point == "before":
            original_gather = bootstrap.Rendezvous.gather

            def gather(self, step, value, **k):
                return die() if step.startswith("torch") else original_gather(self, step, value, **k)

            bootstrap.Rendezvous.gather = gather
        else:
            dist_module.ProcessGroupGloo = die
    dist.barrier()  # the ranks start together: what is timed is the construction alone
    return how_it_ends(lambda: SymmBuffer(dist.group.WORLD, 1 << 12, transport="torch", timeout=2))


@pytest.mark.parametrize("point", ["before", "inside"])
def test_the_torch_transports_own_group_is_bounded_by_the_buffers_timeout(point):
    # The gloo group's rendezvous waited on the job store with the store's own timeout (10 s here, the job's
    # init timeout), not the buffer's 2 s, and named no rank.
    res = run_ranks(_killed_making_the_torch_group, 3, point, timeout=60, may_die=(1,))
    for rank in (0, 2):
        msg, seconds = res[rank]
        assert "rank 1 did not come" in msg or "rank 1 died or stopped while it was made" in msg, (point, res)
        assert seconds < 2 + 1.5, (point, res)


def _sub_group_member_dies(rank, world_size, transport):
    """Global ranks 2 and 3 make a buffer over a sub-group of their own; rank 3 dies before it comes."""

    from epkit.collectives.bootstrap import SubGroup

    dist.barrier()  # every rank's gloo mesh is up: a rank 3 that died sooner could fail another rank's connect
    if rank < 2:
        return None
    sub = SubGroup(dist.group.WORLD, [2, 3], "pair")
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return how_it_ends(lambda: SymmBuffer(sub, 4096, transport=transport, timeout=2))


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_a_sub_groups_errors_name_global_ranks(transport):
    # Construction over a sub-group named its members by their positions in it: global rank 2 said "rank 0: rank 1
    # did not come" when global rank 3 died.
    res = run_ranks(_sub_group_member_dies, 4, transport, timeout=60, may_die=(3,))
    msg, seconds = res[2]
    assert msg.startswith("rank 2: rank 3 did not come to make this SymmBuffer"), msg
    assert seconds < 2 + 1.5, res


def _sub_group_member_goes_silent(rank, world_size, transport):
    """A buffer over global ranks 2 and 3; after one barrier rank 3 stops taking part."""
    from epkit.collectives.bootstrap import SubGroup

    if rank < 2:
        return None
    buf = SymmBuffer(SubGroup(dist.group.WORLD, [2, 3], "pair"), 4096, transport=transport, timeout=10)
    buf.barrier()
    if rank == 3:  # silent, and alive well past rank 2's 1 s wait (its exit would tell rank 2 it left)
        time.sleep(5)
        return None
    return how_it_ends(lambda: buf.barrier(timeout=1.0))


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_a_sub_groups_waits_name_global_ranks(transport):
    # After construction too: the wait's error named positions in the sub-group ("rank 0: rank 1 sent no ...").
    msg, _ = run_ranks(_sub_group_member_goes_silent, 4, transport, timeout=60)[2]
    kind = "signal" if transport == "shm" else "message"
    assert msg.startswith(f"rank 2: rank 3 sent no barrier {kind} within 1 s"), msg
