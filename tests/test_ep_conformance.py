"""The EP paths' conformance test: every outcome of the planner (``collectives/ep/planner.py``: the transport, the
hosts or NVLink domains, and the normal-mode and low-latency paths an EPBuffer chooses once at construction) runs
the same calls through the public API, bit for bit against ``collectives/ep_reference.py``:

- normal mode: bf16 and FP8 rows, plain and expanded (alignment 4 and 128), ``-1`` entries, a rank with no tokens
  and one at ``num_max_tokens_per_rank``; a cached dispatch of other rows along the same routing; combine with a
  bias, in the reference's order for the buffer's hosts (two levels across hosts or domains);
- low latency: FP8 rows, and bf16 rows through the receive hook, one rank at the slot capacity, one with none.

Each outcome also checks what was chosen (``buf.paths``, the transport, the hosts, whether normal-mode results go
through result slots), so a planner change that moves a configuration to another path fails here by name.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from test_ep_buffer import expected_scales

from epkit.collectives.ep_buffer import EPBuffer
from epkit.collectives.ep_reference import (
    reference_combine,
    reference_dispatch,
    reference_low_latency_combine,
    reference_low_latency_dispatch,
)
from epkit.quant import per_token_group_cast_to_fp8
from epkit.testing import assert_bitwise_equal
from epkit.testing.hosts import namespaces_unavailable, run_hosts
from epkit.testing.multiprocess import run_ranks
from epkit.testing.nvshmem_emulator import resolve_transport

HIDDEN, EXPERTS, TOPK, CAP, LL_CAP = 256, 16, 4, 32, 8
TOKENS = [5, 32, 0, 17]  # normal mode, by rank % 4: rank 1 at num_max_tokens_per_rank, rank 2 with none
LL_TOKENS = [8, 3, 0, 6]  # low latency: rank 0 at the slot capacity
#: Normal-mode calls: (expand, FP8 rows, expert alignment).
NORMAL_CALLS = [(False, False, 1), (True, False, 4), (True, True, 128), (False, True, 1)]

FLAT, HIER, DEVICE = "FlatNormalPath", "HierNormalPath", "DeviceNormalPath"
HOST_LL, DEVICE_LL = "HostLowLatencyPath", "DeviceLowLatencyPath"
ONE, TWO = [[0, 1]], [[0, 1], [2, 3]]


class Chosen(NamedTuple):
    """What a buffer chose: its paths, transport, hosts (or NVLink domains), and whether it has result slots."""

    paths: tuple[str, str]
    transport: str
    hosts: list[list[int]]
    result_slots: bool


def _routing(rank: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    perms = [torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(n)]
    idx = torch.stack(perms) if n else torch.empty((0, TOPK), dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
    return torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16), idx, torch.rand(n, TOPK, generator=g)


def _normal(buf: EPBuffer, expand: bool, fp8: bool, alignment: int, seed: int) -> None:
    r = buf.rank
    x, idx, w = _routing(r, TOKENS[r % 4], seed)
    scales = None
    if fp8:
        x, scales = per_token_group_cast_to_fp8(x.float(), 128)
    ctx = f"rank {r} {buf.transport} {buf.paths} {expand=} {fp8=} {alignment=}"
    recv, recv_idx, recv_w, counts, handle = buf.dispatch((x, scales) if fp8 else x, idx, w, alignment, expand)
    ref = reference_dispatch(x, idx, w, EXPERTS, expand=expand, expert_alignment=alignment, x_scales=scales)
    key = "expanded_x" if expand else "recv_x"
    assert_bitwise_equal(recv[0] if fp8 else recv, ref[key], ctx + " rows")
    if fp8:
        assert_bitwise_equal(recv[1], expected_scales(ref, handle, expand), ctx + " scales")
    assert_bitwise_equal(recv_idx, ref["recv_topk_idx"], ctx + " topk_idx")
    assert_bitwise_equal(recv_w, ref["recv_topk_weights"], ctx + " topk_weights")
    assert counts == ref["num_recv_tokens_per_expert"], ctx
    if expand:
        assert_bitwise_equal(EPBuffer.m_indices(handle), ref["m_indices"], ctx + " m_indices")
    # cached: other rows along the same routing
    x2 = x if fp8 else (x.float() * -2).to(x.dtype)
    again = buf.dispatch((x2, scales) if fp8 else x2, handle=handle)
    ref2 = reference_dispatch(x2, idx, w, EXPERTS, expand=expand, expert_alignment=alignment, x_scales=scales)
    assert_bitwise_equal(again[0][0] if fp8 else again[0], ref2[key], ctx + " cached")
    # combine: each rank's own function of the rows, so the order of the sum shows
    y = (ref[key].float() * (0.5 + 0.125 * r) + 1).to(torch.bfloat16)
    bias = torch.randn(x.shape[0], HIDDEN, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
    want = reference_combine(y, ref, x.shape[0], bias=bias, expand=expand, hosts=buf.hosts)
    assert_bitwise_equal(buf.combine(y, handle, bias=bias), want, ctx + " combine")


def _low_latency(buf: EPBuffer, use_fp8: bool, seed: int) -> None:
    r, w = buf.rank, buf.world_size
    x, idx, wts = _routing(r, LL_TOKENS[r % 4], seed)
    ctx = f"rank {r} {buf.transport} {buf.paths} low latency {use_fp8=}"
    recv_x, recv_count, handle, hook = buf.low_latency_dispatch(
        x, idx, LL_CAP, use_fp8=use_fp8, return_recv_hook=not use_fp8
    )
    hook()
    ref = reference_low_latency_dispatch(x, idx, LL_CAP, EXPERTS, use_fp8=use_fp8)
    assert recv_count.tolist() == ref["counts"], ctx
    y = torch.full((EXPERTS // w, LL_CAP * w, HIDDEN), float("nan"), dtype=torch.bfloat16)  # padding: garbage
    y_ref = []
    for e, c in enumerate(ref["counts"]):
        got = recv_x[0][e, :c] if use_fp8 else recv_x[e, :c]
        assert_bitwise_equal(got, ref["recv_x"][e], f"{ctx} expert {e}")
        if use_fp8:
            assert_bitwise_equal(recv_x[1][e, :c], ref["recv_scales"][e], f"{ctx} expert {e} scales")
        y[e, :c] = (got.float() * 2 - 1).to(torch.bfloat16)
        y_ref.append(y[e, :c].clone())
    out = buf.low_latency_combine(y, idx, wts, handle)
    assert_bitwise_equal(out, reference_low_latency_combine(y_ref, idx, wts, ref), ctx + " combine")


def _conform(rank: int, world_size: int, emulator: str | None, transport: str, env: dict[str, str]) -> Chosen:
    os.environ.update(env)
    if emulator is not None:
        resolve_transport(emulator)
    with EPBuffer(
        dist.group.WORLD, HIDDEN, EXPERTS, CAP, TOPK, transport=transport, num_max_dispatch_tokens_per_rank=LL_CAP
    ) as buf:
        chosen = Chosen(buf.paths, buf.transport, buf.hosts, buf.result_slots is not None)
        for seed, call in enumerate(NORMAL_CALLS):
            _normal(buf, *call, seed)
        _low_latency(buf, True, 11)
        _low_latency(buf, False, 12)
    return chosen


class Outcome(NamedTuple):
    hosts: int  # emulated hosts (network namespaces); 1: plain rank processes
    world_size: int
    emulator: str | None  # CUDA ranks stood in for by the NVSHMEM emulator (tests/test_nvshmem_emulator.py pins it)
    transport: str  # asked for
    env: dict[str, str]
    chosen: Chosen


DEV = {"EPKIT_EP_KERNELS": "device"}
#: Every row of the planner's table, and the variants inside a row that take other code (result slots, the
#: transports a flat path runs over, one or two NVLink domains).
OUTCOMES = {
    "flat-shm-result-slots": Outcome(1, 2, None, "shm", {}, Chosen((FLAT, HOST_LL), "shm", ONE, True)),
    "flat-shm": Outcome(1, 2, None, "shm", {"EPKIT_RESULT_SLOTS": "0"}, Chosen((FLAT, HOST_LL), "shm", ONE, False)),
    "flat-torch": Outcome(1, 2, None, "torch", {}, Chosen((FLAT, HOST_LL), "torch", ONE, False)),
    "flat-nvshmem": Outcome(1, 2, "nvemu", "nvshmem", {}, Chosen((FLAT, HOST_LL), "nvshmem", ONE, False)),
    "flat-nvshmem-two-domains": Outcome(
        1, 4, "nvemu-dom2", "nvshmem", {}, Chosen((FLAT, HOST_LL), "nvshmem", TWO, False)
    ),
    "device-shm": Outcome(1, 2, None, "shm", DEV, Chosen((DEVICE, DEVICE_LL), "shm", ONE, False)),
    "device-nvshmem": Outcome(1, 2, "nvemu", "nvshmem", DEV, Chosen((DEVICE, DEVICE_LL), "nvshmem", ONE, False)),
    "hierarchical-hosts": Outcome(
        2, 4, None, "auto", {}, Chosen((HIER, HOST_LL), "hierarchical(shm+torch)", TWO, False)
    ),
    "hierarchical-nvshmem-domains": Outcome(
        1, 4, "nvemu-dom2", "hierarchical", {}, Chosen((HIER, HOST_LL), "hierarchical(nvshmem+nvshmem)", TWO, False)
    ),
}


@pytest.mark.parametrize("name", OUTCOMES)
def test_every_planner_outcome_matches_the_reference(name):
    o = OUTCOMES[name]
    args = (o.emulator, o.transport, o.env)
    if o.hosts > 1:
        why = namespaces_unavailable()
        if why is not None:
            pytest.skip(f"emulated hosts unavailable: {why}")
        got = run_hosts(_conform, o.hosts, o.world_size // o.hosts, *args, timeout=300)
    else:
        got = run_ranks(_conform, o.world_size, *args, timeout=300)
    assert got == [o.chosen] * o.world_size


def test_the_outcomes_cover_the_planners_table():
    """Every (normal, low-latency) pair of the planner's docstring table has an outcome above."""
    from epkit.collectives.ep import planner

    table = {tuple(re.findall(r":class:`(\w+)`", line)) for line in (planner.__doc__ or "").splitlines()}
    table.discard(())
    assert table == {o.chosen.paths for o in OUTCOMES.values()}, table
