"""``EPBuffer.mask_ranks``: the low-latency calls leave masked ranks out (DeepEP's shrink mode, which
``epkit.compat.deep_ep`` builds on). A rank that takes part in a dispatch and then stops is masked by the others
before the combine: their combine sums no term of its experts and waits for nothing from it; the next dispatch
neither sends to it nor receives from it. Results are checked against references built from every rank's inputs.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from epkit.collectives.ep_buffer import EPBuffer
from epkit.testing.multiprocess import run_ranks

HIDDEN, EXPERTS, TOPK, N_MAX, TOKENS = 128, 6, 2, 4, 3
GONE = 2


def _inputs(rank: int, step: int):
    g = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(TOKENS)])
    return x, ids, torch.rand(TOKENS, TOPK, generator=g)


def _check_rows(rank: int, world: int, step: int, recv_x, count, masked: set[int]) -> None:
    local = EXPERTS // world
    for e in range(local):
        want = [x[(ids == rank * local + e).any(1)] for x, ids, _ in map(lambda s: _inputs(s, step), range(world))]
        rows = torch.cat([w for src, w in enumerate(want) if src not in masked])
        assert int(count[e]) == rows.shape[0] and torch.equal(recv_x[e, : rows.shape[0]], rows), (rank, step, e)


def _combined(rank: int, world: int, step: int, masked: set[int]) -> torch.Tensor:
    x, ids, w = _inputs(rank, step)
    acc = torch.zeros(TOKENS, HIDDEN)
    for k in range(TOPK):
        live = ~torch.isin(ids[:, k] // (EXPERTS // world), torch.tensor(sorted(masked) or [-1]))
        acc += torch.where(live[:, None], w[:, k : k + 1] * (2 * x.float()), 0.0)
    return acc.bfloat16()


def _ranks_leave(rank: int, world: int) -> bool:
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, num_max_dispatch_tokens_per_rank=N_MAX, timeout=5)
    store = dist.distributed_c10d._get_default_store()
    x, ids, w = _inputs(rank, 0)
    recv_x, count, handle, _ = buf.low_latency_dispatch(x, ids, N_MAX, use_fp8=False)
    _check_rows(rank, world, 0, recv_x, count, set())
    if rank == GONE:  # took part in the dispatch, never combines: alive until the others are done
        store.wait([f"mask-test/{r}" for r in range(world) if r != GONE], timedelta(seconds=60))
        return True
    buf.mask_ranks([GONE])
    assert buf.masked_ranks == {GONE}
    out = buf.low_latency_combine((recv_x.float() * 2).bfloat16(), ids, w, handle)
    assert torch.equal(out, _combined(rank, world, 0, {GONE})), rank
    for step in (1, 2):  # later calls: nothing to it, nothing from it
        x, ids, w = _inputs(rank, step)
        recv_x, count, handle, _ = buf.low_latency_dispatch(x, ids, N_MAX, use_fp8=False)
        _check_rows(rank, world, step, recv_x, count, {GONE})
        out = buf.low_latency_combine((recv_x.float() * 2).bfloat16(), ids, w, handle)
        assert torch.equal(out, _combined(rank, world, step, {GONE})), (rank, step)
    store.set(f"mask-test/{rank}", "1")
    return True


def test_masked_rank_is_left_out_of_combine_and_later_dispatches():
    assert run_ranks(_ranks_leave, 3, timeout=60) == [True] * 3
