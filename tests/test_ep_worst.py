"""Worst-case dispatch outputs (``EPBuffer.dispatch(num_worst_tokens=N)``, ``collectives/ep/worst.py``) on CPU
ranks: on the host-driven paths (shm, torch) and on the device kernels (their source under the Triton
interpreter, over shm). Each worst-case result is checked against the plain dispatch of the same routing on the
same buffer (the plain path is checked against the reference exchange in ``test_ep_buffer.py``): the received
rows bit for bit, then the padding; its combine, with NaN in every padding row of ``y``, against the plain
combine; the device kernels' call reads nothing back to the host. Bad calls: the same ValueError on every rank.
"""

import os

import pytest
import torch
import torch.distributed as dist

from epkit.collectives.ep_buffer import EPBuffer
from epkit.testing.cuda_graph import captured
from epkit.testing.host_sync import HostSyncDetector
from epkit.testing.hosts import requires_namespaces, run_hosts
from epkit.testing.markers import requires_cuda
from epkit.testing.multiprocess import run_ranks

HIDDEN, EXPERTS, TOPK, N_MAX, ALIGN = 128, 8, 2, 16, 4
#: The paths: (transport, kernels).
PATHS = [("shm", "host"), ("torch", "host"), ("shm", "device")]


def _buffer(world_size, transport, kernels):
    return EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport=transport, kernels=kernels, timeout=20)


def _routing(rank, seed, num_tokens=None):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    t = int(torch.randint(1, N_MAX + 1, (1,), generator=g)) if num_tokens is None else num_tokens
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(t)])
    idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
    return torch.randn(t, HIDDEN, generator=g).bfloat16(), idx, torch.rand(t, TOPK, generator=g)


def _expanded_bound(n, local):
    """The expanded rows a worst case holds, written out here (DeepEP V2's bound), not taken from epkit."""
    rows = n * min(TOPK, local) + (ALIGN - 1) * local
    return -(-rows // ALIGN) * ALIGN


def _check_padded(got, want, rows, fill):
    """``got`` is ``want`` in its first rows (bit for bit) and ``fill`` in every row from ``want``'s on."""
    assert got.shape[0] == rows and got.shape[1:] == want.shape[1:]
    r = want.shape[0]
    assert torch.equal(got[:r], want)
    assert bool((got[r:] == fill).all())


def _equivalence(rank, world_size, transport, kernels):
    buf = _buffer(world_size, transport, kernels)
    assert buf.uses_device_kernels == (kernels == "device")
    assert (buf.paths[0] == "HierNormalPath") == (transport == "auto")  # the hierarchy where hosts are emulated
    n, local = world_size * N_MAX, EXPERTS // world_size
    x, idx, w = _routing(rank, 1)
    for expand in (False, True):
        plain = buf.dispatch(x, idx, w, expert_alignment=ALIGN, expand=expand)
        worst = buf.dispatch(x, idx, w, expert_alignment=ALIGN, expand=expand, num_worst_tokens=n)
        x_rows = _expanded_bound(n, local) if expand else n
        _check_padded(worst.recv_x, plain.recv_x, x_rows, 0)
        _check_padded(worst.recv_topk_idx, plain.recv_topk_idx, n, -1)
        _check_padded(worst.recv_topk_weights, plain.recv_topk_weights, n, 0)
        counts = worst.num_recv_tokens_per_expert
        assert isinstance(counts, torch.Tensor) and counts.dtype == torch.int32
        assert counts.tolist() == plain.num_recv_tokens_per_expert
        if expand:
            _check_padded(EPBuffer.m_indices(worst.handle), EPBuffer.m_indices(plain.handle), x_rows, -1)
        # combine: NaN in every padding row, which must not reach any output
        y_plain = (plain.recv_x.float() * 2 - 1).bfloat16()
        y_worst = torch.full((x_rows, HIDDEN), float("nan"), dtype=torch.bfloat16)
        y_worst[: y_plain.shape[0]] = y_plain
        bias = torch.randn(x.shape[0], HIDDEN).bfloat16()
        want = buf.combine(y_plain, plain.handle, bias=bias)
        got = buf.combine(y_worst, worst.handle, bias=bias)
        assert torch.equal(got, want) and not got.isnan().any()
        # a cached dispatch along the worst-case handle: padded alike
        x2 = (x.float() + 1).bfloat16()
        cached_plain = buf.dispatch(x2, handle=plain.handle)
        cached = buf.dispatch(x2, handle=worst.handle)
        _check_padded(cached.recv_x, cached_plain.recv_x, x_rows, 0)
        _check_padded(cached.recv_topk_idx, plain.recv_topk_idx, n, -1)
    # a worst case smaller than the job's: enough for this routing, fewer rows than world_size * N_MAX
    plain = buf.dispatch(x, idx, w)
    small = buf.dispatch(x, idx, w, num_worst_tokens=N_MAX + 8)
    _check_padded(small.recv_x, plain.recv_x, N_MAX + 8, 0)
    buf.close()
    return True


@pytest.mark.parametrize("transport,kernels", PATHS)
def test_worst_case_outputs_equal_the_plain_dispatch_padded(transport, kernels):
    assert run_ranks(_equivalence, 2, transport, kernels, timeout=240) == [True, True]


def _fp8(rank, world_size, transport, kernels):
    from epkit.quant import per_token_group_cast_to_fp8

    buf = _buffer(world_size, transport, kernels)
    x, idx, w = _routing(rank, 7)
    xq = per_token_group_cast_to_fp8(x.float(), 128)
    n = world_size * N_MAX
    for expand in (False, True):
        plain = buf.dispatch(xq, idx, w, expert_alignment=ALIGN, expand=expand)
        worst = buf.dispatch(xq, idx, w, expert_alignment=ALIGN, expand=expand, num_worst_tokens=n)
        rows = _expanded_bound(n, EXPERTS // world_size) if expand else n
        _check_padded(worst.recv_x[0].view(torch.uint8), plain.recv_x[0].view(torch.uint8), rows, 0)
        _check_padded(worst.recv_x[1], plain.recv_x[1], rows, 0)  # the scales
    buf.close()
    return True


@pytest.mark.parametrize("transport,kernels", PATHS)
def test_fp8_rows_and_their_scales_are_padded_alike(transport, kernels):
    assert run_ranks(_fp8, 2, transport, kernels, timeout=240) == [True, True]


@requires_namespaces
def test_worst_case_outputs_on_the_hierarchy_across_two_hosts():
    assert run_hosts(_equivalence, 2, 2, "auto", "host", timeout=240) == [True] * 4


def _reads(rank, world_size):
    os.environ.pop("EPKIT_EP_KERNELS", None)
    buf = _buffer(world_size, "shm", "device")
    x, idx, w = _routing(rank, 2)
    out = {}
    for name, kw in (("plain", {}), ("worst", {"num_worst_tokens": 32})):
        for _warm in (True, False):  # the first call compiles and fills every cache; the second is measured
            with HostSyncDetector() as reads:
                recv, _, _, _, handle = buf.dispatch(x, idx, w, expand=True, expert_alignment=ALIGN, **kw)
            with HostSyncDetector() as reads_combine:
                buf.combine(recv, handle)
            with HostSyncDetector() as reads_cached:
                buf.dispatch(x, handle=handle)
        out[name] = (reads.events, reads_combine.events, reads_cached.events)
    buf.close()
    return out


def test_worst_case_dispatch_combine_and_cached_dispatch_on_the_device_kernels_read_nothing_back():
    for got in run_ranks(_reads, 2, timeout=240):
        assert all(got["plain"]), f"the detector sees each plain call's one read (control): {got['plain']}"
        assert got["worst"] == ([], [], []), got["worst"]


def _bad_call(rank, world_size, transport, kernels, case):
    buf = _buffer(world_size, transport, kernels)
    x, idx, w = _routing(rank, 3, num_tokens=N_MAX)
    n = {
        "overflow": 4,  # 16 tokens per rank, of which far more than 4 reach some rank
        "differ": [32, 24][rank],
        "plain_vs_worst": [32, 0][rank],
        "bad_value": [32, -1][rank],
    }[case]
    try:
        buf.dispatch(x, idx, w, num_worst_tokens=n)
    except ValueError as exc:
        error = str(exc)
    else:
        error = None
    # afterwards: the host paths go on; the device kernels retired the buffer (their verdict was a failure)
    try:
        buf.dispatch(x, idx, w)
        after = "usable"
    except RuntimeError:
        after = "retired"
    buf.close()
    return error, after


def _bad_combine(rank, world_size, case):
    buf = _buffer(world_size, "shm", "device")
    x, idx, w = _routing(rank, 4)
    first = buf.dispatch(x, idx, w, num_worst_tokens=32)
    second = buf.dispatch(x, idx, w, num_worst_tokens=32)
    handle = {"stale": [first, second][rank].handle, "not_a_handle": [second.handle, []][rank]}[case]
    try:
        buf.combine(second.recv_x, handle)
    except ValueError as exc:
        error = str(exc)
    else:
        error = None
    try:
        buf.combine(second.recv_x, second.handle)
        after = "usable"
    except RuntimeError:
        after = "retired"
    buf.close()
    return error, after


@pytest.mark.parametrize("case", ["stale", "not_a_handle"])
def test_a_bad_combine_after_a_worst_case_dispatch_is_judged_on_the_device_alike_on_every_rank(case):
    # "stale": both ranks judge on the device (every handle a worst-case one); "not_a_handle": rank 1 judges on the
    # host (its call is bad) and retires its buffer as rank 0's kernel retires rank 0's
    got = run_ranks(_bad_combine, 2, case, timeout=240)
    errors = [g[0] for g in got]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0].startswith("combine rejected on every rank before any row moved"), errors[0]
    want = "handles do not come from one dispatch" if case == "stale" else "rank 1: handle must be the DispatchHandle"
    assert want in errors[0], errors[0]
    assert [g[1] for g in got] == ["retired", "retired"]


_EXPECTED = {
    "overflow": "num_worst_tokens=4 leaves room for 4 rows",
    "differ": "the ranks' num_worst_tokens differ (rank 0: 32; rank 1: 24)",
    "plain_vs_worst": "the ranks' num_worst_tokens differ (rank 0: 32; rank 1: 0)",
    "bad_value": "rank 1: num_worst_tokens must be an int >= 0, got -1",
}


@pytest.mark.parametrize("case", sorted(_EXPECTED))
@pytest.mark.parametrize("transport,kernels", [("shm", "host"), ("shm", "device")])
def test_bad_worst_case_calls_raise_the_same_error_on_every_rank(transport, kernels, case):
    got = run_ranks(_bad_call, 2, transport, kernels, case, timeout=240)
    errors = [g[0] for g in got]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0].startswith("dispatch rejected on every rank before any data moved"), errors[0]
    assert _EXPECTED[case] in errors[0], errors[0]
    assert {g[1] for g in got} == {"retired" if kernels == "device" else "usable"}


def _gpu_worst(rank, world_size):
    """Rung 4: on one GPU (nvshmem, the device kernels), a worst-case dispatch and its combine make no host read
    and give the plain dispatch's rows, padded, and its combine's bits (the expanded pair on a budget of 24 SMs)."""
    torch.cuda.set_device(0)
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport="nvshmem", timeout=20)
    assert buf.uses_device_kernels and buf.device.type == "cuda"
    x, idx, w = (t.cuda() for t in _routing(rank, 5))
    for expand in (False, True):
        plain = buf.dispatch(x, idx, w, expert_alignment=ALIGN, expand=expand)
        y_plain = (plain.recv_x.float() * 2 - 1).bfloat16()
        want = buf.combine(y_plain, plain.handle)
        x_rows = _expanded_bound(N_MAX, EXPERTS) if expand else N_MAX
        y_worst = torch.full((x_rows, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
        y_worst[: y_plain.shape[0]] = y_plain
        sms = 24 if expand else None
        for _warm in (True, False):  # the first call compiles; the second is measured
            with HostSyncDetector() as reads:
                worst = buf.dispatch(
                    x, idx, w, expert_alignment=ALIGN, expand=expand, num_worst_tokens=N_MAX, num_sms=sms
                )
                got = buf.combine(y_worst, worst.handle, num_sms=sms)
        assert reads.events == [], reads.events
        _check_padded(worst.recv_x.cpu(), plain.recv_x.cpu(), x_rows, 0)
        _check_padded(worst.recv_topk_idx.cpu(), plain.recv_topk_idx.cpu(), N_MAX, -1)
        assert torch.equal(got.cpu(), want.cpu())
    buf.close()
    return True


@requires_cuda
def test_gpu_worst_case_dispatch_and_combine_read_nothing_back():
    assert run_ranks(_gpu_worst, 1, timeout=240) == [True]


def _gpu_capture(rank, world_size):
    """Rung 4: a worst-case dispatch and its combine captured in a CUDA graph (after one eager warm-up call) and
    replayed on new rows give, each time, the eager plain dispatch's rows (padded) and its combine's bits."""
    torch.cuda.set_device(0)
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport="nvshmem", timeout=20)
    x, idx, w = (t.cuda() for t in _routing(rank, 6, num_tokens=N_MAX))
    static_x = x.clone()

    def step():
        got = buf.dispatch(static_x, idx, w, expert_alignment=ALIGN, expand=True, num_worst_tokens=N_MAX)
        return got, buf.combine(got.recv_x, got.handle)

    graph, (got, out) = captured(step)  # the eager step compiles, allocates the host words
    for trial in range(3):
        static_x.copy_((x.float() * (trial + 2)).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        plain = buf.dispatch(static_x, idx, w, expert_alignment=ALIGN, expand=True)
        want = buf.combine(plain.recv_x, plain.handle)
        _check_padded(got.recv_x.cpu(), plain.recv_x.cpu(), _expanded_bound(N_MAX, EXPERTS), 0)
        assert torch.equal(out.cpu(), want.cpu()), trial
    buf.close()
    return True


@requires_cuda
def test_gpu_worst_case_dispatch_and_combine_replay_from_a_cuda_graph():
    assert run_ranks(_gpu_capture, 1, timeout=240) == [True]
