"""DeepEP V2's ``ElasticBuffer`` calls past dispatch and combine, through ``epkit.compat.deep_ep`` on CPU ranks:
pipeline send/receive around the ring, the all-gather session (plain, batched, in place) and Engram (bf16, FP8 with
replicated factors, V2's TMA strides), against references built here from every rank's inputs (all-gathered); a bad
call on one rank is the same ValueError on every rank where the call is collective, and a rank that goes silent is
named. DeepEP's own ``tests/elastic/test_pp.py``, ``test_agrs.py``, ``test_engram.py`` are the acceptance (run by
hand with the peer runner); this file keeps the semantics in CI.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import epkit.compat.deep_ep as deep_ep
from epkit.testing.multiprocess import run_ranks


def _all(obj: object) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _pp(buffer: deep_ep.ElasticBuffer, rank: int, world: int) -> None:
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    buffer.pp_set_config(1024, 2)
    to_next = [torch.randn(4, 8).bfloat16() + rank, torch.arange(6, dtype=torch.int32) * (rank + 1)]
    to_prev = torch.randn(3, 5) - rank
    sent = _all((to_next, to_prev))
    for t in to_next:  # two in flight to the next rank (the limit), one to the previous
        buffer.pp_send(t, nxt)
        t.zero_()  # a sent tensor is the caller's again at once
    buffer.pp_send(to_prev, prev)
    for want in sent[prev][0]:
        got = torch.empty_like(want)
        buffer.pp_recv(got, prev)
        assert torch.equal(got, want)
    got = torch.empty(3, 5)
    buffer.pp_recv(got, nxt)
    assert torch.equal(got, sent[nxt][1])
    # this rank's own errors: not a neighbour, too large, a receive of another size (the queue stays in step)
    with pytest.raises(ValueError, match=r"pp_send: dst_rank_idx=.* is not a ring neighbour"):
        buffer.pp_send(to_prev, rank)
    with pytest.raises(ValueError, match=r"pp_send: t has 4096 bytes; pp_set_config allows 1024"):
        buffer.pp_send(torch.zeros(1024), nxt)
    buffer.pp_send(torch.full((4,), float(rank)), nxt)
    buffer.pp_send(torch.full((2,), float(rank)), nxt)
    with pytest.raises(ValueError, match=rf"pp_recv: rank {prev} sent a tensor of 16 bytes; the receiving .* 8"):
        buffer.pp_recv(torch.empty(2), prev)
    got = torch.empty(2)
    buffer.pp_recv(got, prev)
    assert got.tolist() == [float(prev)] * 2
    # a bad configuration on one rank: the same ValueError on every rank
    with pytest.raises(ValueError, match=r"pp_set_config rejected on every rank .* rank 1: pp_set_config: num_max_"):
        buffer.pp_set_config(1024, 0 if rank == 1 else 2)
    with pytest.raises(ValueError, match=r"need 4194304 bytes; the buffer has num_bytes=2097152"):
        buffer.pp_set_config(1 << 20, 1)


def _agrs(buffer: deep_ep.ElasticBuffer, rank: int, world: int) -> None:
    shapes = [(3, 4), (5,)]
    need = deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(dist.group.WORLD, shapes + [(2, 2)], torch.bfloat16)
    buffer.agrs_set_config(need, 2)
    xs = [torch.randn(s).bfloat16() + rank for s in shapes]
    single = torch.arange(4, dtype=torch.bfloat16).view(2, 2) * (rank + 1)
    every = _all((xs, single))
    with buffer.agrs_new_session():
        inplace = buffer.agrs_get_inplace_tensor(tuple(torch.Size(s) for s in shapes), torch.bfloat16)
        for dst, src in zip(inplace, xs, strict=True):
            dst.copy_(src)
        *gathered, handle = buffer.all_gather(inplace)
        one, handle_one = buffer.all_gather(single)
        handle()
        handle_one()
        for i, g in enumerate(gathered):
            assert torch.equal(g, torch.stack([every[r][0][i] for r in range(world)]))
        assert torch.equal(one, torch.stack([every[r][1] for r in range(world)]))
        with pytest.raises(ValueError, match=r"all_gather rejected .*: the session has had its 2 all_gather calls"):
            buffer.all_gather(single)
    with pytest.raises(RuntimeError, match="called after it ended"):
        handle()
    with buffer.agrs_new_session():  # a bad call on one rank (not contiguous): the same error, the session goes on
        bad = torch.zeros(4, 4).bfloat16()[:, :2] if rank == 1 else torch.zeros(4, 2).bfloat16()
        with pytest.raises(ValueError, match=r"rejected on every rank before any row moved: rank 1: all_gather: tens"):
            buffer.all_gather(bad)
        again, h = buffer.all_gather(single)
        h()
        assert torch.equal(again, torch.stack([every[r][1] for r in range(world)]))
    with pytest.raises(ValueError, match=r"agrs_set_config rejected .* rank 2: agrs_set_config: num_max_session_b"):
        buffer.agrs_set_config(need * (1 << 20) if rank == 2 else need, 2)


def _rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The reference fetch: each token's entries of ``table`` side by side, ``[T, entries_per_token * width]``."""
    return table[idx.view(-1).long()].view(idx.shape[0], idx.shape[1] * table.shape[1])


def _engram(buffer: deep_ep.ElasticBuffer, rank: int, world: int) -> None:
    entries, hidden = 5, 32  # rows per rank not a multiple of the table's padding
    storage = torch.randn(entries, hidden).bfloat16() * (rank + 1)
    idx = torch.randint(
        0, world * entries, ((3, 6, 0)[rank % 3], 4), dtype=torch.int32, generator=torch.Generator().manual_seed(rank)
    )
    table = torch.cat(_all(storage))
    buffer.engram_write(storage)
    data, sf = buffer.engram_fetch(idx)()
    assert sf is None and torch.equal(data, _rows(table, idx))
    # FP8 with every rank's factors replicated; V2's TMA strides on request
    fp8 = storage.float().to(torch.float8_e4m3fn)
    factors = torch.cat(_all(torch.rand(entries, 2) + rank))
    buffer.engram_write(fp8, sf=factors)
    table8 = torch.cat(_all(fp8.view(torch.uint8)))
    for tma in (False, True):
        data, got_sf = buffer.engram_fetch(idx, use_tma_aligned_col_major_sf=tma)()
        assert data.dtype == torch.float8_e4m3fn
        assert torch.equal(data.view(torch.uint8), _rows(table8, idx))
        assert torch.equal(got_sf, _rows(factors, idx))
        if idx.shape[0]:  # a rank with no token (rank 2) has no strides to speak of
            assert got_sf.stride() == ((1, -(-idx.shape[0] // 4) * 4) if tma else (8, 1))
    with pytest.raises(ValueError, match=r"rejected on every rank before any row moved: rank 1: engram_fetch: indices"):
        buffer.engram_fetch(idx + world * entries * (rank == 1))
    with pytest.raises(ValueError, match=r"engram_write rejected .* \(hidden: ranks 0, 2 have 32, rank 1 has 16\)"):
        buffer.engram_write(fp8[:, : 16 if rank == 1 else hidden].contiguous(), sf=factors)
    data, _ = buffer.engram_fetch(idx)()  # the table goes on
    assert torch.equal(data.view(torch.uint8), _rows(table8, idx))


def _run(rank: int, world: int) -> str:
    buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_bytes=2 << 20, num_cpu_bytes=1 << 20, explicitly_destroy=True)
    _pp(buffer, rank, world)
    _agrs(buffer, rank, world)
    _engram(buffer, rank, world)
    buffer.barrier()
    buffer.destroy()
    return "ok"


@pytest.mark.parametrize("world", [3])
def test_elastic_pp_agrs_engram_match_v2_semantics(world):
    assert run_ranks(_run, world, timeout=120) == ["ok"] * world


def _silent(rank: int, world: int) -> str:
    buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_bytes=2 << 20, num_cpu_timeout_secs=1)
    buffer.pp_set_config(64, 1)
    if rank == 1:
        time.sleep(2.5)  # never sends
        return "silent"
    with pytest.raises(TimeoutError, match=r"rank 0: pp_recv: rank 1 did not send a tensor within 1 s"):
        buffer.pp_recv(torch.empty(4), 1)
    return "named"


def test_pp_recv_names_the_silent_rank():
    assert run_ranks(_silent, 2, timeout=60) == ["named", "silent"]
