"""DeepEP's internode mode through ``epkit.compat.deep_ep`` (issue 40): on more than one NVLink domain,
``get_dispatch_layout`` counts tokens per RDMA rank, ``dispatch`` takes those counts and returns DeepEP's ten-tensor
handle, ``internode_dispatch`` / ``internode_combine`` are there, and the rows move on epkit's hierarchical path.

DeepEP's domain is 8 ranks; here it is set to 2 in each rank process (``deep_ep_internode.NVL_PEERS``) so that 4
ranks are 2 RDMA ranks of 2, on 2 emulated hosts of 2 ranks (the hierarchical path) and on one host (a flat one).
Every handle element is checked against what it means, counted here by plain loops from every rank's routing and
received rows (each row names its source rank and token). DeepEP's own ``tests/legacy/test_internode.py`` (16
ranks on 2 emulated hosts) runs outside the repository: see the issue's note.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import epkit.compat._details.deep_ep_internode as internode
import epkit.compat.deep_ep as deep_ep
from epkit.testing.hosts import requires_namespaces, run_hosts
from epkit.testing.multiprocess import run_ranks

HIDDEN, TOPK, PEERS, CHANNELS = 64, 2, 2, 4


def _all(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _inputs(rank: int, num_experts: int):
    t = (7, 5, 0, 9)[rank]  # unequal, and a rank with no tokens
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randint(-4, 5, (t, HIDDEN), generator=g).bfloat16()  # small integers: every sum is exact
    x[:, 0], x[:, 1] = rank, torch.arange(t)  # each row names its source and token
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(t)] or [torch.empty(0)])
    return x, ids.view(t, TOPK).long(), torch.rand(t, TOPK, generator=g)


def _upto(m: torch.Tensor, c: int) -> torch.Tensor:
    """The tokens of channels ``0..c`` of ``m``'s (``CHANNELS`` channels of ``ceil(T / CHANNELS)`` tokens)."""
    return m[: min((c + 1) * -(-m.shape[0] // CHANNELS), m.shape[0])]


def _check_handle(rank, world, handle, in_rank, recv_x):
    (h_in_rank, rdma_ch, gbl_ch, recv_rdma_ch, recv_rdma_sum, recv_gbl_ch, recv_gbl_sum, meta, send_rdma,
     send_nvl) = handle  # fmt: skip
    domains, me_d, me_l = world // PEERS, rank // PEERS, rank % PEERS
    every, every_recv = _all(in_rank), _all(recv_x[:, :2].int().tolist())
    hits = [[m[:, d * PEERS : (d + 1) * PEERS].any(1) for d in range(domains)] for m in every]  # [s][d]: [T_s]
    assert h_in_rank is in_rank and all(t.dtype == torch.int32 for t in handle[1:7] + handle[8:])
    for d in range(domains):
        assert rdma_ch[d].tolist() == [int(_upto(hits[rank][d], c).sum()) for c in range(CHANNELS)], d
    for r in range(world):
        assert gbl_ch[r].tolist() == [int(_upto(in_rank[:, r], c).sum()) for c in range(CHANNELS)], r
    rail = [d * PEERS + me_l for d in range(domains)]  # the sources of the RDMA receive, and their tokens for me_d
    for d, s in enumerate(rail):
        assert recv_rdma_ch[d].tolist() == [int(_upto(hits[s][me_d], c).sum()) for c in range(CHANNELS)], d
    assert recv_rdma_sum.tolist() == [sum(int(hits[s][me_d].sum()) for s in rail[: d + 1]) for d in range(domains)]
    rows = [(s, t) for s in range(world) for t in range(every[s].shape[0]) if every[s][t, rank]]
    assert every_recv[rank] == [list(r) for r in rows]  # by source rank, then token
    assert recv_gbl_sum.tolist() == [sum(1 for s2, _ in rows if s2 <= s) for s in range(world)]
    for s in range(world):
        before, per = sum(1 for s2, _ in rows if s2 < s), -(-every[s].shape[0] // CHANNELS)
        assert recv_gbl_ch[s].tolist() == [before + int(every[s][: c * per, rank].sum()) for c in range(CHANNELS)]
    assert meta.dtype == torch.uint8 and meta.shape == (len(rows), 8)
    local = range(me_d * PEERS, (me_d + 1) * PEERS)
    want = [[s // PEERS, sum(1 << p for p, r in enumerate(local) if every[s][t, r])] for s, t in rows]
    assert meta.view(torch.int32).tolist() == want
    for d in range(domains):
        order = torch.cumsum(hits[rank][d].long(), 0) - 1
        assert send_rdma[:, d].tolist() == torch.where(hits[rank][d], order, -1).tolist(), d
    rdma_rows = [(s, t) for s in rail for t in range(every[s].shape[0]) if hits[s][me_d][t]]
    assert send_nvl.shape == (len(rdma_rows), PEERS)
    for n, (s, t) in enumerate(rdma_rows):
        at = [every_recv[r].index([s, t]) if [s, t] in every_recv[r] else -1 for r in local]
        assert send_nvl[n].tolist() == at, (s, t)


def _expect_refused(call, what: str) -> None:
    try:
        call()
    except ValueError as exc:
        assert what in str(exc), exc
    else:
        raise AssertionError(f"not refused: {what}")


def _internode(rank: int, world: int) -> dict:
    internode.NVL_PEERS = PEERS  # this rank process's DeepEP domain: 2 ranks
    num_experts = 2 * world
    x, ids, weights = _inputs(rank, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 1 << 20, 1 << 20)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, num_experts)
    want = [int(in_rank[:, d * PEERS : (d + 1) * PEERS].any(1).sum()) for d in range(world // PEERS)]
    assert per_rdma is not None and per_rdma.dtype == torch.int32 and per_rdma.tolist() == want
    config = deep_ep.Config(2 * CHANNELS)
    layout = (per_rank, per_rdma, in_rank, per_expert)
    recv_x, recv_ids, recv_w, counts, handle, _ = buffer.dispatch(x, None, *layout, ids, weights, config=config)
    assert isinstance(handle, tuple) and len(handle) == 10
    _check_handle(rank, world, handle, in_rank, recv_x)
    transport = handle.buffer.transport
    # internode_dispatch is the same dispatch (DeepEP's dispatch calls it on more than 8 ranks)
    again = buffer.internode_dispatch(x, None, *layout, ids, weights, config=config)
    assert torch.equal(again[0], recv_x) and torch.equal(again[1], recv_ids) and again[3] == counts
    assert all(torch.equal(a, b) for a, b in zip(again[4], handle))
    assert torch.equal(buffer.dispatch(x, handle, config=config)[0], recv_x)  # cached
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w, config=config)
    assert torch.equal(combined, x * in_rank.sum(1, keepdim=True).to(x.dtype))  # exact: small integers
    assert torch.equal(combined_w, weights)  # each weight comes back from its expert's rank only
    combined_i = buffer.internode_combine(recv_x, handle, config=config)[0]
    assert torch.equal(combined_i, combined)
    # refused on every rank alike, then the buffer goes on: a wrong RDMA count on rank 0, no config (DeepEP asserts)
    bad = per_rdma + 1 if rank == 0 else per_rdma
    _expect_refused(lambda: buffer.dispatch(x, None, per_rank, bad, in_rank, per_expert, ids, weights), "rank 0")
    _expect_refused(lambda: buffer.internode_dispatch(x, None, *layout, ids, weights), "config must be given")
    _expect_refused(lambda: buffer.dispatch(x, None, per_rank, None, in_rank, per_expert, ids, weights),
                    "num_tokens_per_rdma_rank (internode)")  # fmt: skip
    assert torch.equal(buffer.dispatch(x, None, *layout, ids, weights, config=config)[0], recv_x)
    return {"transport": transport}


@requires_namespaces
def test_internode_on_two_hosts_moves_rows_on_the_hierarchical_path():
    got = run_hosts(_internode, 2, 2, timeout=180)
    assert [g["transport"] for g in got] == ["hierarchical(shm+torch)"] * 4


def test_internode_on_one_host():
    got = run_ranks(_internode, 4, timeout=180)
    assert [g["transport"] for g in got] == ["shm"] * 4


@pytest.mark.parametrize("world", [12, 20])
def test_internode_needs_whole_domains(world):
    assert internode.rdma_ranks(8) == 1 and internode.rdma_ranks(16) == 2
    with pytest.raises(ValueError, match="multiple of 8 ranks"):
        internode.rdma_ranks(world)
