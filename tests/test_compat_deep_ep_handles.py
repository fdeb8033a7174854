"""DeepEP's handles through ``epkit.compat.deep_ep``: the tuples DeepEP's tests index, each element checked against
what it means on the received rows (gathered from every rank, counted here by plain loops), and the dispatch
without top-k that routes by ``is_token_in_rank`` (DeepEP's legacy tests run it first). Issue 40: handles were
opaque (``'LowLatencyHandle' object is not subscriptable``) and a dispatch without top-k was refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import epkit.compat.deep_ep as deep_ep
from epkit.testing.multiprocess import run_ranks

HIDDEN, TOPK, N_MAX = 64, 2, 16


def _tokens(rank: int) -> int:
    return (5, 9, 0)[rank % 3]  # unequal, and a rank with no tokens


def _inputs(rank: int, world: int, num_experts: int):
    t = _tokens(rank)
    g = torch.Generator().manual_seed(3 + rank)
    x = torch.randn(t, HIDDEN, generator=g).bfloat16()
    x[:, 0] = rank  # each row names its source and token
    x[:, 1] = torch.arange(t)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(t)] or [torch.empty(0)])
    ids = ids.view(t, TOPK).long()
    return x, ids, torch.rand(t, TOPK, generator=g)


def _all(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _normal(rank: int, world: int, num_experts: int, with_topk: bool) -> None:
    x, ids, weights = _inputs(rank, world, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 1 << 20, 0)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, num_experts)
    config = deep_ep.Config(8)  # 4 channels
    kw = {"topk_idx": ids, "topk_weights": weights} if with_topk else {}
    recv_x, recv_ids, recv_w, counts, handle, _ = buffer.dispatch(
        x, None, per_rank, None, in_rank, per_expert, config=config, **kw
    )
    assert isinstance(handle, tuple) and len(handle) == 6
    rank_prefix, channel_prefix, recv_channel, recv_src, handle_in_rank, send_head = handle
    every_in_rank, every_x = _all(in_rank), _all(x)
    local = num_experts // world
    # rank_prefix_matrix[i][j]: rows rank j receives from ranks 0..i
    want = [[sum(int(every_in_rank[s][:, j].sum()) for s in range(i + 1)) for j in range(world)] for i in range(world)]
    assert rank_prefix.tolist() == want and rank_prefix.dtype == torch.int32
    # recv_src_idx: each received row's token on its source; the rows are that token's, by source then token
    sources = [s for s in range(world) for _ in range(int(every_in_rank[s][:, rank].sum()))]
    assert recv_src.dtype == torch.int32 and recv_src.numel() == recv_x.shape[0] == len(sources)
    for row, (s, t) in enumerate(zip(sources, recv_src.tolist())):
        assert every_in_rank[s][t, rank] and torch.equal(recv_x[row], every_x[s][t]), f"row {row}"
    assert handle_in_rank is in_rank
    # channels: 4 of ceil(T / 4) tokens; channel_prefix_matrix[r][c]: my tokens to r from channels 0..c
    t_num, per = x.shape[0], -(-x.shape[0] // 4)
    for r in range(world):
        running = 0
        for c in range(4):
            running += sum(1 for t in range(c * per, min((c + 1) * per, t_num)) if in_rank[t, r])
            assert channel_prefix[r, c] == running, (r, c)
    # recv_channel_prefix_matrix[s][c]: the row where source s's channel c starts (its rows before, and the rows
    # of the sources before it)
    for s in range(world):
        ts = every_in_rank[s].shape[0]
        per_s = -(-ts // 4)
        before = sum(int(every_in_rank[s2][:, rank].sum()) for s2 in range(s))
        for c in range(4):
            assert recv_channel[s, c] == before + int(every_in_rank[s][: min(c * per_s, ts), rank].sum()), (s, c)
    # send_head[t][r]: the row of rank r's recv_x that token t became (-1: not sent)
    every_recv, every_head = _all(recv_x), _all(send_head)
    for r in range(world):
        for t in range(t_num):
            h = int(every_head[rank][t, r])
            assert (h >= 0) == bool(in_rank[t, r])
            if h >= 0:
                assert torch.equal(every_recv[r][h], x[t]), (t, r)
    # the per-expert counts are the senders' num_tokens_per_expert, summed (with top-k or without)
    every_per_expert = _all(per_expert)
    assert counts == [int(sum(p[rank * local + e] for p in every_per_expert)) for e in range(local)]
    if not with_topk:
        assert recv_ids is None and recv_w is None
    # combine sums each token's rows over the ranks it went to (the rows unweighted), then a cached dispatch
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w if with_topk else None)
    assert torch.equal(combined.float(), (x.float() * in_rank.sum(1, keepdim=True)).bfloat16().float())
    if with_topk:
        assert torch.equal(combined_w, weights)  # each weight comes back from its expert's rank only
    again = buffer.dispatch(x, handle)[0]
    assert torch.equal(again, recv_x)


def _low_latency(rank: int, world: int, num_experts: int) -> None:
    x, ids, weights = _inputs(rank, world, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, 1 << 22, low_latency_mode=True)
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, ids, N_MAX, num_experts, use_fp8=False)
    assert isinstance(handle, tuple) and len(handle) == 5
    src_info, layout_range, n_max, hidden, experts = handle
    assert (n_max, hidden, experts) == (N_MAX, HIDDEN, num_experts)
    assert src_info.dtype == torch.int32 and layout_range.dtype == torch.int64
    every_ids, every_x = _all(ids), _all(x)
    local = num_experts // world
    for e in range(local):
        expert = rank * local + e
        begin = 0
        for s in range(world):
            tokens = [t for t in range(every_ids[s].shape[0]) if expert in every_ids[s][t].tolist()]
            packed = int(layout_range[e, s])
            assert (packed >> 32, packed & 0xFFFFFFFF) == (begin, len(tokens)), (e, s)
            assert src_info[e, begin : begin + len(tokens)].tolist() == tokens, (e, s)
            for i, t in enumerate(tokens):
                assert torch.equal(recv_x[e, begin + i], every_x[s][t]), (e, s, t)
            begin += len(tokens)
        assert recv_count[e] == begin
    combined, _, _ = buffer.low_latency_combine(recv_x, ids, weights, handle)
    assert combined.shape == x.shape


def _run(rank: int, world: int) -> str:
    num_experts = 2 * world
    for with_topk in (False, True):
        _normal(rank, world, num_experts, with_topk)
    _low_latency(rank, world, num_experts)
    return "ok"


@pytest.mark.parametrize("world", [3])
def test_deep_ep_handles_mean_what_deep_ep_says_on_the_received_rows(world):
    assert run_ranks(_run, world, timeout=120) == ["ok"] * world
