"""The device-side dispatch/combine kernels (``kernels/triton/ep_*.py``) on real CPU ranks: rungs 2 and 3.

Rung 2: every test below that runs ranks runs the kernels' own source, under the Triton interpreter, in 2 or 4
rank processes over the shm transport's segments: ``EPBuffer(kernels="device")``, set in each rank through
``EPKIT_EP_KERNELS=device`` so that the case lists of ``test_ep_buffer.py`` and ``test_fused_moe.py`` run
unchanged, bit for bit against the reference exchange (``collectives/ep_reference.py``). Waits are the kernels'
own (acquire loads of the peers' release signals, bounded by a clock word a host thread keeps current).

Rung 3: every kernel compiled for sm_90 (no GPU needed), with assertions on the generated code.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ep_buffer import CASES, _compare, _ll_tokens, _low_latency, _routing
from test_fused_moe import _fused_vs_composed

from epkit.collectives.ep_buffer import EPBuffer
from epkit.testing.host_sync import DeviceOpCounter, HostSyncDetector
from epkit.testing.multiprocess import run_ranks

HIDDEN, EXPERTS, TOPK = 256, 16, 4
#: Every kernel a dispatch/combine runs (the launch counter names them).
KERNELS = {
    "_layout",
    "_notify",
    "_dispatch_send",
    "_dispatch_recv",
    "_agree",
    "_combine_send",
    "_combine_reduce",
    "_ll_dispatch_send",
    "_ll_dispatch_recv",
    "_ll_combine_send",
    "_ll_combine_recv",
}


def _device(rank, world_size, fn, *args):
    """A rank body with every EPBuffer on the device kernels (their source run by the Triton interpreter)."""
    os.environ["EPKIT_EP_KERNELS"] = "device"
    return fn(rank, world_size, *args)


def _costs(rank, world_size, num_tokens):
    """Per call of each kind (after a warm-up call): Triton launches, other device ops, host reads of device data."""
    from epkit.kernels.triton.ep_common import LAUNCHES

    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 64, TOPK, transport="shm", timeout=20)
    assert buf.uses_device_kernels and buf.device.type == "cpu"  # so the interpreter runs the kernels
    x, idx, w = _routing(rank, world_size, "random", 11)
    x, idx, w = x[:num_tokens], idx[:num_tokens], w[:num_tokens]
    out = {}

    def measure(name, fn):
        fn()
        before = sum(LAUNCHES.values())
        with HostSyncDetector() as reads, DeviceOpCounter() as ops:
            res = fn()
        out[name] = (sum(LAUNCHES.values()) - before, len(ops.ops), len(reads.events))
        return res

    recv, _, _, _, handle = measure("dispatch", lambda: buf.dispatch(x, idx, w, expand=True, expert_alignment=4))
    y = recv.float().bfloat16()
    measure("combine", lambda: buf.combine(y, handle))
    n = 16
    xl, il = x[:n], idx[:n]

    def ll_dispatch():
        res = buf.low_latency_dispatch(xl, il, n, use_fp8=True)
        res[3]()
        return res

    res = measure("ll_dispatch", ll_dispatch)
    y = torch.zeros((EXPERTS // world_size, n * world_size, HIDDEN), dtype=torch.bfloat16)
    measure("ll_combine", lambda: buf.low_latency_combine(y, il, w[:n], res[2]))
    buf.close()
    return out


def _all(rank, world_size, cases, fused):
    """The case lists on the device kernels, then what each call costs."""
    for case in cases:
        assert _compare(rank, world_size, "shm", *case)
    assert _low_latency(rank, world_size, "shm", True, False, _ll_tokens)  # FP8, rank 0 at the slot capacity
    assert _low_latency(rank, world_size, "shm", False, True, _ll_tokens)  # bf16, receive hook
    if fused:
        assert _fused_vs_composed(rank, world_size, "fp8", [17, 0, 40, 64][:world_size])
    from epkit.kernels.triton.ep_common import LAUNCHES

    ran = set(LAUNCHES)
    return ran, _costs(rank, world_size, [9, 40, 0, 64][rank])


#: Per call: (Triton launches, other device ops, host reads of device data). The dispatch's other op is the copy
#: of topk_idx its handle keeps (a cached dispatch reuses it).
EXPECTED = {"dispatch": (4, 1, 1), "combine": (3, 0, 1), "ll_dispatch": (2, 0, 0), "ll_combine": (2, 0, 0)}


def _check_costs(results):
    for ran, costs in results:
        assert ran >= KERNELS, KERNELS - ran  # every kernel's source ran
        # A small constant number of launches per call, the same for any W and token count (0 tokens included);
        # the one host read of a dispatch is the summary sizing its outputs, of a combine the agreement's verdict.
        assert costs == EXPECTED, costs


def test_kernels_match_the_reference_on_2_ranks():
    """Every case of test_ep_buffer (uneven tokens with 0, -1 entries, one hot expert, expand on/off, alignment
    1/4/128, FP8 on/off, cached handles), the low-latency pair (FP8 at capacity; bf16 with the receive hook),
    fused_moe against the composed ops, all through the kernels' interpreted source on 2 ranks."""
    _check_costs(run_ranks(_device, 2, _all, CASES, True, timeout=240))


def test_kernels_match_the_reference_on_4_ranks():
    """Uneven tokens (0 included) on 4 ranks, the low-latency pair, and the same launch counts as on 2 ranks."""
    cases = [c for c in CASES if c[0] == "uneven"]
    _check_costs(run_ranks(_device, 4, _all, cases, False, timeout=240))


def _routings(rank, world_size, draws):
    return [_compare(rank, world_size, "shm", "random", expand, alignment, fp8, seed)
            for seed, expand, alignment, fp8 in draws]  # fmt: skip


_DRAW = st.tuples(st.integers(0, 10**6), st.booleans(), st.sampled_from([1, 4, 128]), st.booleans())


@settings(max_examples=1, deadline=None)
@given(draws=st.lists(_DRAW, min_size=3, max_size=3), world_size=st.sampled_from([2, 4]))
def test_random_routings_on_the_kernels(draws, world_size):
    """Hypothesis routings (seed, expand, alignment, FP8), three per rank start (starting ranks is the cost)."""
    res = run_ranks(_device, world_size, _routings, draws, timeout=180)
    assert res == [[True] * len(draws)] * world_size, (draws, res)


def _rejections(rank, world_size):
    """Bad calls on one rank: the same ValueError on every rank before any row moves, and the buffer goes on."""
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 16, TOPK, transport="shm", timeout=10)
    x, idx, w = _routing(rank, world_size, "full", 2)
    x, idx, w = x[:16], idx[:16], w[:16]
    seen = []
    bad = idx.clone()
    if rank == 1:
        bad[3, 1] = EXPERTS + 2  # found on the device (no host read of topk_idx)
    with pytest.raises(ValueError, match="rank 1: topk_idx holds expert ids outside") as exc:
        buf.dispatch(x, bad, w)
    seen.append(str(exc.value))
    many = torch.cat([x, x]) if rank == 0 else x  # found on the host of rank 0 alone
    with pytest.raises(ValueError, match="rank 0: 32 tokens exceed num_max_tokens_per_rank = 16") as exc:
        buf.dispatch(many, torch.cat([idx, idx]) if rank == 0 else idx, None)
    seen.append(str(exc.value))
    shifted_x = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view_as(x)  # 2 bytes past a 16-byte boundary
    shifted_x.copy_(x)
    with pytest.raises(ValueError, match="rank 1: x must start on a 16-byte boundary") as exc:
        buf.dispatch(shifted_x if rank == 1 else x, idx, w)
    seen.append(str(exc.value))
    recv, _, _, _, handle = buf.dispatch(x, idx, w)
    moved = torch.empty(recv.numel() + 8, dtype=recv.dtype)[8:].view_as(recv)  # 16 bytes past: aligned
    moved.copy_(recv)
    assert torch.equal(buf.combine(moved, handle), buf.combine(recv, handle))
    shifted = torch.empty(recv.numel() + 1, dtype=recv.dtype)[1:].view_as(recv)
    shifted.copy_(recv)
    with pytest.raises(ValueError, match="rank 1: y must start on a 16-byte boundary") as exc:
        buf.combine(shifted if rank == 1 else recv, handle)
    seen.append(str(exc.value))
    recv, _, _, _, handle = buf.dispatch(x, idx, w)
    stale = handle
    recv, _, _, _, handle = buf.dispatch(x, idx, w)
    with pytest.raises(ValueError, match="combine rejected on every rank before any row moved: rank 0: y must be"):
        buf.combine(recv if rank == 1 else recv[:, :-1], handle)
    with pytest.raises(ValueError, match="the handles do not come from one dispatch") as exc:
        buf.combine(recv, stale if rank == 0 else handle)
    seen.append(str(exc.value))
    out = buf.combine(recv, handle)  # still usable, and right
    from epkit.collectives.ep_reference import reference_combine, reference_dispatch

    ref = reference_dispatch(x, idx, w, EXPERTS)
    assert torch.equal(out, reference_combine(ref["recv_x"], ref, x.shape[0]))
    # a rejected low-latency dispatch retires its buffer (it is not agreed before the rows move): a fresh one
    ll = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 16, TOPK, transport="shm", timeout=10)
    with pytest.raises(ValueError, match="rank 0: x must start on a 16-byte boundary") as exc:
        ll.low_latency_dispatch(shifted_x if rank == 0 else x, idx, 16, use_fp8=False)
    seen.append(str(exc.value))
    return seen


def _silent_peer(rank, world_size):
    """Low-latency overflow found on the device retires the buffer everywhere; then a rank that never comes: its
    peer's kernel wait ends at its deadline, naming it, and retires that buffer too."""
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 8, TOPK, transport="shm", timeout=10)
    x = torch.zeros(8, HIDDEN, dtype=torch.bfloat16)
    idx = torch.tensor([[3, 3, -1, -1]] * 8 if rank == 1 else [[0, 1, -1, -1]] * 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="rank 1: an expert gets more .* than its 8 slots"):
        buf.low_latency_dispatch(x, idx, 8, use_fp8=False)
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        buf.low_latency_dispatch(x, idx, 8, use_fp8=False)
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 8, TOPK, transport="shm", timeout=1.5)
    idx = torch.tensor([[0, 5, -1, -1]] * 8, dtype=torch.int64)
    buf.dispatch(x, idx)
    if rank == 1:
        time.sleep(4)  # alive, but silent
        return "slept"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 0: rank 1 sent no dispatch layout signal within 1.5 s") as exc:
        buf.dispatch(x, idx)
    waited = time.monotonic() - t0
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        buf.dispatch(x, idx)
    return str(exc.value), waited


def _faults(rank, world_size):
    return _rejections(rank, world_size), _silent_peer(rank, world_size)


def test_bad_calls_silent_peers_and_device_found_failures():
    """A bad call on one rank is the same error everywhere and the buffer goes on; a low-latency overflow found
    on the device retires the buffer everywhere; a silent peer is named when the kernel's wait times out."""
    (seen0, timed), (seen1, slept) = run_ranks(_device, 2, _faults, timeout=150)
    assert seen0 == seen1, (seen0, seen1)
    assert slept == "slept" and 1.5 <= timed[1] < 6, timed


def test_the_cta_count_is_a_checked_parameter():
    """Every multi-program launch takes its geometry's CTA count on CUDA (at least 2: the low-latency send keeps
    program 0 for the headers); the interpreter runs 2 programs whatever the count."""
    from epkit.kernels.triton.ep_common import programs
    from epkit.kernels.triton.launch import as_cuda

    with as_cuda():
        assert programs(torch.device("cpu"), 24) == 24
    assert programs(torch.device("cpu"), 24) == 2
    for bad in (1, 0, 2.0, True):
        with pytest.raises(ValueError, match="CTA count must be an int >= 2"):
            programs(torch.device("cpu"), bad)


# rung 3: tests/test_as_launched.py


# rung 4, prepared: the GPU section's pure-Python parts


def test_gpu_section_counts_the_moved_bytes_and_judges_each_target(monkeypatch):
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    from gpu_sections.common import Ctx
    from gpu_sections.nvshmem_kernels import TARGETS, kernel_targets, normal_moved_bytes, verdicts

    # 4096 tokens, hidden 7168 FP8 (7168 + 4 * 56 bytes a row), top-8: rows twice, 12 bytes per slot; bf16 back.
    assert normal_moved_bytes(4096, 7168, 8) == {
        "dispatch": 2 * 4096 * 7392 + 4096 * 8 * 12,
        "combine": 2 * 4096 * 14336,
        "total": 60948480 + 117440512,
    }
    assert normal_moved_bytes(2, 256, 1, fp8=False)["dispatch"] == 2 * 2 * 512 + 2 * 12
    res = {
        "ep_kernels": {
            "normal": {"fraction_of_copy_roof": 0.7, "dispatch_host_us_per_call": 90, "combine_host_us_per_call": 120},
            "low_latency": {"graph_pair_us": 25.0},
        },
        "fused_moe": {"speedup_vs_composed": 1.1},
    }
    got = verdicts(res)
    assert set(got) == set(TARGETS)
    assert got["normal_fraction_of_copy_roof"] == {"value": 0.7, "met": True}
    assert got["normal_host_us_per_call"] == {"value": 120, "met": False}  # the slower call decides
    assert got["low_latency_graph_pair_us"] == {"value": 25.0, "met": True}
    assert got["fused_moe_speedup_vs_composed"] == {"value": 1.1, "met": False}
    assert got["symm_exchange_fraction_of_copy_roof"] is None  # not measured: no verdict
    # With the budget spent, each measurement says it did not run (and touches no GPU).
    ctx = Ctx(torch.device("cpu"), True, time.perf_counter())
    ctx.begin("nvshmem", 0.0)
    out: dict = {}
    kernel_targets(ctx, out)
    assert out["ep_kernels"]["targets"] == TARGETS
    assert all(out["ep_kernels"][k]["status"].startswith("not run") for k in ("normal", "low_latency")), out


def _num_sms(rank, world_size):
    """Each rank its own SM budget per call (odd counts, honoured by the interpreter too): the same bits as the
    buffer's default, for a plain, an expanded worst-case and a cached dispatch and their combines."""
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 64, TOPK, transport="shm", kernels="device", timeout=20)
    x, idx, w = _routing(rank, world_size, "random", 12)
    out = []
    for sms in (None, [3, 5][rank], [7, 2][rank]):
        plain = buf.dispatch(x, idx, w, expert_alignment=4, num_sms=sms)
        worst = buf.dispatch(x, idx, w, expert_alignment=4, expand=True, num_worst_tokens=128, num_sms=sms)
        cached = buf.dispatch((x.float() + 1).bfloat16(), handle=plain.handle)
        y = (plain.recv_x.float() * 0.5).bfloat16()
        combined = buf.combine(y, plain.handle, num_sms=sms)
        combined_worst = buf.combine(worst.recv_x, worst.handle, num_sms=[2, 4][rank] if sms else None)
        out.append([plain.recv_x, worst.recv_x, EPBuffer.m_indices(worst.handle), cached.recv_x, combined,
                    combined_worst])  # fmt: skip
    default, *others = out
    same = [[torch.equal(a, b) for a, b in zip(default, other)] for other in others]
    try:
        buf.dispatch(x, idx, w, num_sms=[8, 1][rank])
    except ValueError as exc:
        error = str(exc)
    buf.close()
    return same, error


def test_each_rank_may_choose_its_own_num_sms_per_call():
    for same, error in run_ranks(_num_sms, 2, timeout=240):
        assert same == [[True] * 6] * 2, same
        assert error.startswith("dispatch rejected on every rank before any data moved: rank 1: num_sms must be")


def _bad_num_sms(rank, world_size, transport, kernels):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 64, TOPK, transport=transport, kernels=kernels, timeout=20)
    x, idx, w = _routing(rank, world_size, "random", 13)
    first = buf.dispatch(x, idx, w)
    calls = (
        lambda: buf.dispatch(x, idx, w, num_sms=[4, 0][rank]),
        lambda: buf.combine(first.recv_x, first.handle, num_sms=[True, 2][rank]),
        # last: a rejected worst-case dispatch retires a buffer on the device kernels
        lambda: buf.dispatch(x, idx, w, num_worst_tokens=128, num_sms=[None, 1][rank]),
    )
    errors, same = [], None
    for i, call in enumerate(calls):
        if i == 2:  # usable after the plain rejections: a rejected call moves no row
            same = torch.equal(buf.combine(first.recv_x, first.handle), buf.combine(first.recv_x, first.handle))
        try:
            call()
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    buf.close()
    return errors, same


@pytest.mark.parametrize("transport,kernels", [("shm", "host"), ("torch", "host"), ("shm", "device")])
def test_a_bad_num_sms_is_the_same_error_on_every_rank_on_every_path(transport, kernels):
    # no effect on the host paths, but refused there as on the device kernels: a CPU test catches what a GPU would
    got = run_ranks(_bad_num_sms, 2, transport, kernels, timeout=240)
    (errors0, same0), (errors1, same1) = got
    assert errors0 == errors1 and same0 and same1, got
    why = "num_sms must be None or an int >= 2 (the programs of each device-kernel launch), got"
    dispatch, combine = (
        "dispatch rejected on every rank before any data moved",
        "combine rejected on every rank before any row moved",
    )
    assert errors0 == [f"{dispatch}: rank 1: {why} 0", f"{combine}: rank 0: {why} True", f"{dispatch}: rank 1: {why} 1"]
