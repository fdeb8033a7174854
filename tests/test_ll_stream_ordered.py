"""The stream-ordered low-latency path: no host reads of routing data, deferred error reports.

CUDA rows take this path; ``EPBuffer(portable=True)`` runs the same code on CPU ranks (rows through the
Triton kernel in the interpreter, waits on the host), where ``HostSyncDetector`` checks that nothing
in the calls reads device data back. The rung-4 test checks the same on a GPU with
``torch.cuda.set_sync_debug_mode("error")``.
"""

import re
import time

import pytest
import torch
import torch.distributed as dist

from epkit._details.host_memory import mark_host_memory
from epkit.collectives.ep import rows as ep_rows
from epkit.collectives.ep_buffer import EPBuffer
from epkit.collectives.ep_reference import reference_low_latency_combine, reference_low_latency_dispatch
from epkit.collectives.symm_buffer import PeerFailedError, SymmBuffer
from epkit.kernels.triton.copy_rows import copy_rows_by_address, word_bytes_for
from epkit.testing import assert_bitwise_equal
from epkit.testing.host_sync import HostSyncDetector
from epkit.testing.markers import requires_cuda
from epkit.testing.multiprocess import run_ranks
from epkit.testing.nvshmem_emulator import resolve_transport

HIDDEN, EXPERTS, TOPK, N_MAX = 256, 16, 4, 16


def _inputs(rank, num_tokens, seed=0):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    rows = [torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(num_tokens)]
    idx = torch.stack(rows) if rows else torch.empty((0, TOPK), dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(torch.bfloat16)
    return x, idx, torch.rand(num_tokens, TOPK, generator=g)


def _expert_outputs(recv_x, counts, use_fp8, world_size):
    """A function of the received rows (the reference's too), NaN in the unused slots."""
    y = torch.full((EXPERTS // world_size, N_MAX * world_size, HIDDEN), float("nan"), dtype=torch.bfloat16)
    per_expert = []
    for e, c in enumerate(counts):
        rows = recv_x[0][e, :c].float() * recv_x[1][e, :c].repeat_interleave(128, 1) if use_fp8 else recv_x[e, :c]
        y[e, :c] = (rows.float() * 2 - 1).to(torch.bfloat16)
        per_expert.append(y[e, :c].clone())
    return y, per_expert


def _round(rank, world_size, portable, use_fp8, hook_mode, rounds=2, transport="shm", calls=None):
    """Dispatch + combine under the detector; the outputs against the reference outside it.

    ``calls``: a function returning counts of calls, whose increase over the dispatches and combines is returned
    with the events (not the construction's nor the close's: their timed barriers are host waits of their own)."""
    transport = resolve_transport(transport)
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport=transport, timeout=20, portable=portable)
    before = calls() if calls is not None else {}
    events = []
    for r in range(rounds):  # the second round goes through the acknowledgements and the deferred checks
        x, idx, wts = _inputs(rank, [N_MAX, 5, 0, 9][(rank + r) % 4], seed=r)
        with HostSyncDetector() as det:
            recv_x, recv_count, handle, hook = buf.low_latency_dispatch(
                x, idx, N_MAX, use_fp8=use_fp8, return_recv_hook=hook_mode
            )
            hook()
        events += det.events
        ref = reference_low_latency_dispatch(x, idx, N_MAX, EXPERTS, use_fp8=use_fp8)
        assert recv_count.tolist() == ref["counts"]
        for e, c in enumerate(ref["counts"]):
            assert_bitwise_equal(recv_x[0][e, :c] if use_fp8 else recv_x[e, :c], ref["recv_x"][e], f"{rank=} {e=}")
            if use_fp8:
                assert_bitwise_equal(recv_x[1][e, :c], ref["recv_scales"][e], f"{rank=} {e=} scales")
        y, y_ref = _expert_outputs(recv_x, ref["counts"], use_fp8, world_size)
        with HostSyncDetector() as det:
            out = buf.low_latency_combine(y, idx, wts, handle)
        events += det.events
        assert_bitwise_equal(out, reference_low_latency_combine(y_ref, idx, wts, ref), f"{rank=} combine")
    with HostSyncDetector() as det:
        buf.synchronize()  # nothing pending failed
    events += det.events
    counted = {k: v - before.get(k, 0) for k, v in calls().items() if v > before.get(k, 0)} if calls else None
    buf.close()
    return events if calls is None else (events, counted)


@pytest.mark.parametrize("use_fp8,hook_mode", [(True, False), (False, True)])
def test_stream_ordered_low_latency_reads_nothing_back_and_matches_reference(use_fp8, hook_mode):
    res = run_ranks(_round, 4, True, use_fp8, hook_mode, timeout=120)
    assert res == [[]] * 4, res


@pytest.mark.parametrize("transport", ["nvemu", "nvemu-nop2p", "nvemu-torch-nop2p"])
def test_stream_ordered_low_latency_over_emulated_nvshmem(transport):
    # The code the GPU runs, down to the nvshmem transport: waits are NvshmemState.wait_deferred writing
    # into host slots, peers outside the domain (nop2p) get their messages through put_signal.
    res = run_ranks(_round_emulated, 4, transport, timeout=120)
    assert [events for events, _ in res] == [[]] * 4, res
    for _, calls in res:
        # 2 rounds x (dispatch + combine), each one deferred wait for data and, from round 2, one for acks
        # per peer; the host-waiting form never runs.
        assert calls.get("signal_wait_all/deferred", 0) >= 4 and "signal_wait_all" not in calls, calls
        # without peer views every message to a peer is one put-with-signal (3 peers x 4 exchanges)
        assert calls.get("put_signal", 0) == (12 if transport.endswith("nop2p") else 0), calls


def _round_emulated(rank, world_size, transport):
    from epkit.testing import nvshmem_emulator

    return _round(rank, world_size, True, False, True, 2, transport, calls=nvshmem_emulator.calls)


def test_detector_sees_the_host_checked_path_read_routing():
    # The same calls in host-checked mode (CPU rows) read routing and headers on the host: the detector
    # must say so, or its silence above would mean nothing.
    res = run_ranks(_round, 2, False, False, False, 1, timeout=90)
    for events in res:
        assert any("_local_scalar_dense" in e for e in events), events
        assert any("tolist" in e for e in events), events


def _hooked_dispatch(rank, timeout):
    """A stream-ordered buffer over the emulator (portable) and one 6-token dispatch with a receive hook."""
    transport = resolve_transport("nvemu")
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport=transport, timeout=timeout, portable=True)
    x, idx, wts = _inputs(rank, 6)
    return buf, x, idx, wts, buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=False, return_recv_hook=True)


def _silent_until_done(ranks: list[int], most: float) -> None:
    """Stay alive (the heap mapped) but silent to the buffer until ``ranks`` said they have their outcomes (keys of the
    job's store, which the buffer does not read), ``most`` seconds at most."""
    store, end = dist.distributed_c10d._get_default_store(), time.monotonic() + most
    while not store.check([f"done {r}" for r in ranks]) and time.monotonic() < end:
        time.sleep(0.05)


def _done(rank: int) -> None:
    dist.distributed_c10d._get_default_store().set(f"done {rank}", "1")


def _peer_never_acks(rank, world_size):
    """Rank 1 receives a dispatch but never releases it: the others' combine waits for its acknowledgement."""
    from epkit.testing import nvshmem_emulator

    buf, x, idx, wts, (recv_x, _, handle, hook) = _hooked_dispatch(rank, 2)
    if rank == 1:
        _silent_until_done([r for r in range(world_size) if r != 1], 5)  # alive but silent: no hook, no combine
        return None
    hook()
    y = torch.zeros(recv_x.shape, dtype=torch.bfloat16)
    buf.low_latency_combine(y, idx, wts, handle)  # queues its waits and returns; the outcome comes later
    err = _raised(buf.synchronize, TimeoutError)
    later = _raised(lambda: buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=False), RuntimeError)
    _done(rank)
    return err, later, nvshmem_emulator.calls()


def _raised(fn, exc_type) -> str | None:
    """The message of the ``exc_type`` that ``fn()`` raised, or None when it returned."""
    try:
        fn()
    except exc_type as exc:
        return str(exc)
    return None


def test_silent_peer_surfaces_later_and_the_sticky_word_skips_the_queued_waits():
    res = run_ranks(_peer_never_acks, 4, timeout=90)
    assert res[1] is None
    for rank in (0, 2, 3):
        err, later, calls = res[rank]
        # Its own timeout, or (when another survivor's came first) that survivor's notice in rank 1's words.
        assert err is not None and re.search(
            rf"rank {rank}: (rank 1 sent no ll_combine consumed signal within 2 s|ll_combine consumed abandoned: "
            rf"rank \d reports that rank 1 sent no signal within its timeout)",
            err,
        ), err
        assert later is not None and "unusable" in later, later
        # The acknowledgement wait for rank 1 failed once; the waits queued after it in the same call returned
        # at once on the sticky word (the low-latency writes behind them all take the guard).
        assert calls.get("signal_wait_all/timed_out", 0) + calls.get("signal_wait_all/aborted", 0) == 1, calls
        assert calls.get("signal_wait_all/skipped", 0) >= 1, calls


def _silent_peers(rank, world_size):
    """Every rank but 0 dispatches, then goes silent: rank 0's combine queues an acknowledgement wait on each."""
    from epkit.testing import nvshmem_emulator

    buf, x, idx, wts, (recv_x, _, handle, hook) = _hooked_dispatch(rank, 3)
    if rank != 0:
        _silent_until_done([0], 9)  # past rank 0's 3 s wait, with room for a slow dispatch under load
        return None
    hook()
    buf.low_latency_combine(torch.zeros(recv_x.shape, dtype=torch.bfloat16), idx, wts, handle)
    err = _raised(buf.synchronize, TimeoutError)
    _done(0)
    return err, nvshmem_emulator.calls()


def test_a_dead_peer_costs_the_stream_one_timeout_not_one_per_queued_wait():
    # The low-latency writes all take the guard, so after the acknowledgement wait on rank 1 timed out, those on
    # ranks 2 and 3 (and the data wait) return at once instead of each waiting out the timeout.
    err, calls = run_ranks(_silent_peers, 4, timeout=60)[0]
    assert err is not None and "rank 1 sent no ll_combine consumed signal within 3 s" in err, err
    assert calls.get("signal_wait_all/timed_out") == 1 and calls.get("signal_wait_all/skipped", 0) >= 3, calls


def _peer_rejects_combine(rank, world_size):
    """Rank 0 rejects its own combine input (a local error): rank 1's deferred waits end on its notice."""
    from epkit.testing import nvshmem_emulator

    transport = resolve_transport("nvemu")
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport=transport, timeout=30, portable=True)
    x, idx, wts = _inputs(rank, 6)
    recv_x, _, handle, _ = buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=False)
    y = torch.zeros(recv_x.shape, dtype=torch.bfloat16)
    try:
        buf.low_latency_combine(y[:, :-1] if rank == 0 else y, idx, wts, handle)
        buf.synchronize()
        return "no error"
    except ValueError as exc:
        return "ValueError", str(exc)
    except PeerFailedError as exc:
        return "PeerFailedError", exc.peer, exc.silent, str(exc), nvshmem_emulator.calls()


def test_a_rank_rejecting_its_combine_input_ends_the_peers_deferred_waits():
    res = run_ranks(_peer_rejects_combine, 2, timeout=60)
    assert res[0][0] == "ValueError" and "y must be bfloat16" in res[0][1], res
    kind, peer, silent, msg, calls = res[1]
    assert (kind, peer, silent) == ("PeerFailedError", 0, False), res
    assert "rank 1: ll_combine" in msg and "rank 0 gave up on this buffer after a failure on its side" in msg, msg
    # ended by the notice (the abort mask), well inside the 30 s timeout: no wait timed out
    assert calls.get("signal_wait_all/aborted") == 1 and "signal_wait_all/timed_out" not in calls, calls


def _bad_ids_later(rank, world_size, what):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport="shm", timeout=10, portable=True)
    x, idx, wts = _inputs(rank, 6)
    if rank == 1 and what == "ids":
        idx[2, 1] = EXPERTS + 3
    if rank == 1 and what == "duplicates":  # 4 pairs per token for expert 3: 24 pairs, 16 slots
        idx = torch.full_like(idx, 3)
    recv_x, _, handle, _ = buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=False)  # returns on every rank
    first = _raised(buf.synchronize, ValueError)
    second = _raised(lambda: buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=False), RuntimeError)
    return first, second


@pytest.mark.parametrize(
    "what,message",
    [
        ("ids", "rank 1: topk_idx holds expert ids outside"),
        ("duplicates", "rank 1: an expert gets more .* pairs than its 16 slots"),
    ],
)
def test_device_found_errors_reach_every_rank_later_and_retire_the_buffer(what, message):
    import re

    for first, second in run_ranks(_bad_ids_later, 2, what, timeout=90):
        assert first is not None and re.search(message, first), first
        assert second is not None and "unusable" in second and "rejected on every rank" in second, second


def _host_rejection(rank, world_size):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport="shm", timeout=10, portable=True)
    x, idx, _ = _inputs(rank, 4)
    if rank == 0:
        x = x.float()  # rejected on this rank before anything moves
    try:
        buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=False)
        buf.synchronize()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_rank_rejecting_its_input_is_reported_on_every_rank():
    res = run_ranks(_host_rejection, 2, timeout=60)
    for msg in res:
        assert "rank 0: x must be bfloat16" in msg, res


def test_host_sync_detector_flags_reads_and_passes_fixed_shape_ops():
    t = torch.arange(10)
    with HostSyncDetector() as det:
        y = torch.where(t > 3, t * 2, 0).cumsum(0)
        torch.sort(y, stable=True)
        torch.zeros(5, dtype=torch.int64).scatter_add_(0, t % 5, t)
    assert det.events == []
    host = torch.zeros(2, dtype=torch.int64)
    mark_host_memory(host)
    with HostSyncDetector() as det:
        host.numpy()
        int(t[0])
        t.nonzero()
        t[t > 3]
        t.tolist()
        torch.bincount(t)
    kinds = " | ".join(det.events)
    for needle in ("_local_scalar_dense", "nonzero", "boolean mask", "Tensor.tolist", "bincount"):
        assert needle in kinds, kinds
    assert len(det.events) == 5, det.events
    with pytest.raises(AssertionError, match="host read of device data"), HostSyncDetector(strict=True):
        bool(t.any())


def test_copy_rows_kernel_skips_zero_addresses_and_copies_bits():
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (40, 96), dtype=torch.uint8, generator=g)
    dst = torch.full((50, 96), 7, dtype=torch.uint8)
    want = dst.clone()
    rows = torch.randperm(50, generator=g)[:40]
    keep = torch.rand(40, generator=g) < 0.7
    d = torch.where(keep, dst.data_ptr() + rows * 96, 0)
    s = src.data_ptr() + torch.arange(40) * 96
    s[3] = 0  # a zero on the source side skips too
    keep[3] = False
    want[rows[keep]] = src[keep]
    word = word_bytes_for(96, dst.data_ptr(), src.data_ptr())
    before = dst.clone()
    copy_rows_by_address(d, s, 96, word, guard=torch.ones(1, dtype=torch.int64))  # a set guard: nothing moves
    assert torch.equal(dst, before)
    copy_rows_by_address(d, s, 96, word, guard=torch.zeros(1, dtype=torch.int64))
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="multiple of word_bytes"):
        copy_rows_by_address(d, s, 94, 8)


def test_cpu_row_copy_honours_its_guard():
    src = torch.arange(64, dtype=torch.uint8).view(4, 16)
    dst = torch.zeros(4, 16, dtype=torch.uint8)
    d, s = dst.data_ptr() + torch.arange(4) * 16, src.data_ptr() + torch.arange(4) * 16
    ep_rows.copy_rows_by_address(d, s, 16, [dst.data_ptr(), src.data_ptr()], guard=torch.ones(1, dtype=torch.int64))
    assert not dst.any()
    ep_rows.copy_rows_by_address(d, s, 16, [dst.data_ptr(), src.data_ptr()], guard=torch.zeros(1, dtype=torch.int64))
    assert torch.equal(dst, src)


def _gpu_no_sync(rank, world_size):
    torch.cuda.set_device(0)
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport="nvshmem", timeout=20)
    x, idx, wts = _inputs(rank, 11)
    xc, idxc, wc = x.cuda(), idx.cuda(), wts.cuda()
    buf.low_latency_dispatch(xc, idxc, N_MAX, use_fp8=True)  # warm-up: allocations, address tables
    buf.synchronize()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        recv_x, recv_count, handle, hook = buf.low_latency_dispatch(xc, idxc, N_MAX, use_fp8=True)
        hook()
        ref = reference_low_latency_dispatch(x, idx, N_MAX, EXPERTS, use_fp8=True)
        y = torch.zeros((EXPERTS, N_MAX, HIDDEN), dtype=torch.bfloat16, device="cuda")
        scales = recv_x[1].unsqueeze(-1).expand(-1, -1, -1, 128).reshape(EXPERTS, N_MAX, HIDDEN)
        y.copy_(recv_x[0].float() * scales)
        out = buf.low_latency_combine(y, idxc, wc, handle)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    buf.synchronize()
    assert recv_count.tolist() == ref["counts"]
    for e, c in enumerate(ref["counts"]):
        assert_bitwise_equal(recv_x[0][e, :c].cpu(), ref["recv_x"][e], f"{e=}")
    y_ref = [y[e, :c].cpu() for e, c in enumerate(ref["counts"])]
    assert_bitwise_equal(out.cpu(), reference_low_latency_combine(y_ref, idx, wts, ref), "combine")
    buf.buffer.close()
    return True


@requires_cuda
def test_gpu_low_latency_makes_no_synchronizing_call():
    assert run_ranks(_gpu_no_sync, 1, timeout=240) == [True]


def _slow_reader_and_a_failed_peer(rank, world_size, blame_reader, guarded):
    """Rank 0 gives up after epoch 1 (failing itself, or calling the slow rank 2 silent); rank 1 starts
    epoch 2 while rank 2 is still reading epoch 1. ``guarded``: a guarded exchange writing through the guard,
    else direct stores into the send regions."""
    from epkit.testing import nvshmem_emulator

    buf = SymmBuffer(dist.group.WORLD, 4096, transport=resolve_transport("nvemu"), timeout=3)

    def put(ex, d, value):
        if guarded:
            ex.write(d, torch.full((8,), value, dtype=torch.uint8))
        else:
            ex.send_region(d)[:8].fill_(value)

    ex = buf.exchange(64, deferred=True, guarded=guarded)
    for d in range(world_size):
        put(ex, d, rank + 1)
        ex.commit(d, 8)
    views = ex.receive([8] * world_size)
    buf.synchronize()
    dist.barrier()
    if rank == 2:  # a slow consumer: reads epoch 1 after rank 1's wait on rank 0 timed out (3 s)
        time.sleep(4.5)
        got = [v.tolist() for v in views]
        ex.release()
        return got
    if rank == 0:  # gives up before acknowledging epoch 1
        if blame_reader:  # as after its own wait on rank 2 timed out: a notice in rank 2's NOTICE word at rank 1
            buf.mark_broken("no signal from rank 2", culprit=2, silent=True)
        else:
            buf.mark_broken("rank 0 fails locally", culprit=0)
        ex.release()  # posts nothing: a rank that gave up signals nothing more
        return None
    ex.release()
    time.sleep(0.3)
    ex = buf.exchange(64, deferred=True, guarded=guarded)
    for d in range(world_size):
        # The acknowledgement wait on rank 0 fails on its notice (sticky set). Unguarded, the one on rank 2
        # must still wait for rank 2 to finish reading, or the store below lands in the region it is reading;
        # guarded, it may end at once (skipped, or on the notice calling rank 2 silent): the write is skipped.
        put(ex, d, 99)
    return nvshmem_emulator.calls()


def _slow_reader_keeps_its_bytes(rank, world_size, transport):
    """Rank 1 reads epoch 1 after rank 0's acknowledgement wait for it (2 s) has timed out."""
    from epkit.testing import nvshmem_emulator

    buf = SymmBuffer(dist.group.WORLD, 4096, transport=resolve_transport(transport), timeout=2)
    ex = buf.exchange(64, deferred=True)
    for d in range(world_size):
        ex.write(d, torch.full((8,), rank + 1, dtype=torch.uint8))
        ex.commit(d, 8)
    views = ex.receive([8] * world_size)
    buf.synchronize()
    dist.barrier()
    if rank == 1:  # alive, but slower than rank 0's timeout
        time.sleep(5)
        got = [v.tolist() for v in views]
        ex.release()
        return got
    ex.release()
    ex = buf.exchange(64, deferred=True)
    for d in range(world_size):
        ex.write(d, torch.full((8,), 99, dtype=torch.uint8))  # to rank 1: behind the wait that times out
        ex.commit(d, 8)
    calls = nvshmem_emulator.calls()
    return _raised(buf.synchronize, TimeoutError), calls.get("signal_op/guarded", 0), calls.get("put_signal/guarded", 0)


@pytest.mark.parametrize("transport", ["nvemu", "nvemu-nop2p"])
def test_writes_behind_a_timed_out_acknowledgement_wait_do_not_land(transport):
    # Rank 0's wait for rank 1's acknowledgement of epoch 1 times out on the stream; the epoch-2 write and
    # its signal (a store and a post with P2P, a put-with-signal without) queued behind it must not happen,
    # so the slow rank 1 still reads what rank 0 sent in epoch 1.
    res = run_ranks(_slow_reader_keeps_its_bytes, 2, transport, timeout=60)
    assert res[1] == [[1] * 8, [2] * 8], res
    err, guarded_posts, guarded_puts = res[0]
    assert err is not None and "rank 1 sent no" in err, res
    assert (guarded_posts, guarded_puts) == ((1, 0) if transport == "nvemu" else (0, 1)), res


def _slow_reader_then_a_rejection(rank, world_size):
    """Rank 0 rejects its second dispatch while rank 1, slower than rank 0's 2 s timeout, has not read the first."""
    buf, x, idx, _, (_, recv_count, _, hook) = _hooked_dispatch(rank, 2)
    if rank == 0:
        hook()
        try:
            buf.low_latency_dispatch(x.float(), idx, N_MAX, use_fp8=False)  # rejected: a header to every rank
        except (TimeoutError, ValueError) as exc:
            return type(exc).__name__, str(exc)
        return "no error", ""
    time.sleep(5)
    hook()
    err = _raised(buf.synchronize, ValueError)
    local = EXPERTS // world_size
    want = [0] * local
    for src in range(world_size):  # what each source routed to this rank's experts (slots are never short here)
        ids = _inputs(src, 6)[1]
        for e in range(local):
            want[e] += int((ids == rank * local + e).sum())
    return recv_count.tolist() == want, err


def test_a_rejection_behind_a_timed_out_wait_does_not_reach_the_slow_reader():
    # The rejection header is a write into the slow rank's region like any other: behind the acknowledgement
    # wait that timed out it must not land, so rank 1 reads rank 0's first message intact.
    res = run_ranks(_slow_reader_then_a_rejection, 2, timeout=60)
    assert res[1] == (True, None), res
    assert res[0][0] == "TimeoutError" and "rank 1 sent no" in res[0][1], res


@pytest.mark.parametrize("guarded", [False, True])
@pytest.mark.parametrize("blame_reader", [False, True])
def test_notices_never_let_writes_into_an_unacknowledged_region(blame_reader, guarded):
    # After rank 1's acknowledgement wait on rank 0 failed (sticky set), either its wait on rank 2 still runs
    # (unguarded: not skipped, not ended by a notice calling rank 2 silent; only rank 2's acknowledgement ends
    # it), or (guarded) the wait ends at once and the write behind it is skipped. Rank 2 keeps its bytes.
    res = run_ranks(_slow_reader_and_a_failed_peer, 3, blame_reader, guarded, timeout=60)
    assert res[2] == [[1] * 8, [2] * 8, [3] * 8], res
    calls = res[1]
    ended_early = calls.get("signal_wait_all/skipped", 0) + calls.get("signal_wait_all/aborted", 0)
    if guarded:  # the notice ended the first acknowledgement wait; the two behind it (self, rank 2) were skipped
        assert calls.get("signal_wait_all/aborted") == 1 and ended_early == 3, calls
        assert "signal_wait_all/timed_out" not in calls, calls
