"""DeepEP V2's ``ElasticBuffer`` through ``epkit.compat.deep_ep`` on CPU ranks, against references written here
from every rank's inputs (all-gathered): the received rows, ids, weights and handle fields, the expanded layout
(DeepGEMM's psum ``grouped_layout``), the cached and worst-case (``do_cpu_sync=False``) dispatches, and the
combine bit for bit in V2's order (the biases first, then each rank's row, ranks by the last top-k slot naming one
of their experts). DeepEP's own ``tests/elastic/test_ep.py`` is the acceptance (run by hand, see the issue notes);
this file keeps the semantics in CI.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import epkit.compat.deep_ep as deep_ep
from epkit.testing.multiprocess import run_ranks

HIDDEN, TOPK, N_MAX = 128, 3, 8


def _all(t: torch.Tensor) -> list[torch.Tensor]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t)
    return out


def _inputs(rank: int, num_experts: int):
    t = (5, 8, 0)[rank % 3]  # unequal counts and a rank with no tokens
    g = torch.Generator().manual_seed(20 + rank)
    x = torch.randn(t, HIDDEN, generator=g).bfloat16()
    rows = [torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(t)]
    ids = torch.stack(rows) if rows else torch.empty(0, TOPK, dtype=torch.int64)
    if t:
        ids[0, 1] = -1  # a top-k slot naming no expert
    w = torch.rand(t, TOPK, generator=g)
    w[ids < 0] = 0
    return x, ids, w


def _term(src: int, token: int, receiver: int) -> torch.Tensor:
    """What rank ``receiver`` sends back for token ``token`` of rank ``src`` (bf16 row; known at the source too)."""
    base = torch.arange(HIDDEN, dtype=torch.float32) * 1e-3
    return (base * (1 + src) + token * 0.37 + receiver * 1.7).bfloat16()


def _run(rank: int, world: int) -> str:
    num_experts = 2 * world
    local = num_experts // world
    x, ids, weights = _inputs(rank, num_experts)
    buffer = deep_ep.ElasticBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=N_MAX, hidden=HIDDEN, explicitly_destroy=True
    )
    assert buffer.get_logical_domain_size() == (1, world)
    every_x, every_ids, every_w = _all(x), _all(ids), _all(weights)
    # the reference receive: tokens of every source naming one of my experts, by source then token
    mine = [(s, t) for s in range(world) for t in range(every_ids[s].shape[0])
            if ((every_ids[s][t] >= rank * local) & (every_ids[s][t] < (rank + 1) * local)).any()]  # fmt: skip
    ref_x = torch.stack([every_x[s][t] for s, t in mine]) if mine else torch.empty(0, HIDDEN, dtype=torch.bfloat16)
    ref_ids = [every_ids[s][t] for s, t in mine]
    for alignment in (1, 4):
        recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(
            x, ids, weights, num_experts=num_experts, expert_alignment=alignment
        )
        assert torch.equal(recv_x, ref_x)
        assert handle.recv_src_metadata[:, 0].tolist() == [s * N_MAX + t for s, t in mine]
        for j, want in enumerate(ref_ids):
            loc = torch.where((want >= rank * local) & (want < (rank + 1) * local), want - rank * local, -1)
            assert recv_idx[j].tolist() == loc.tolist()
            assert torch.equal(recv_w[j][loc >= 0], every_w[mine[j][0]][mine[j][1]][loc >= 0])
        counts = [sum(int((r == rank * local + e).sum()) for r in ref_ids) for e in range(local)]
        aligned = [-(-c // alignment) * alignment for c in counts]
        assert handle.num_recv_tokens_per_expert_list == aligned
        assert handle.psum_num_recv_tokens_per_expert.tolist() == torch.tensor(aligned).cumsum(0).tolist()
        per_src = [sum(1 for s, _ in mine if s == r) for r in range(world)]
        assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == torch.tensor(per_src).cumsum(0).tolist()
        for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert", "recv_src_metadata",
                     "num_unaligned_recv_tokens_per_expert", "dst_buffer_slot_idx"):  # fmt: skip
            assert getattr(handle, name).is_contiguous(), name  # engines' kernels read them by pointer
        # expanded: one row per (token, local expert), experts' blocks aligned; psum = start + unaligned count
        ex_x, ex_idx, ex_w, ex_handle, _ = buffer.dispatch(
            x, ids, weights, num_experts=num_experts, expert_alignment=alignment, do_expand=True
        )
        assert ex_idx is None
        starts = [sum(aligned[:e]) for e in range(local)]
        assert ex_handle.psum_num_recv_tokens_per_expert.tolist() == [starts[e] + counts[e] for e in range(local)]
        slots = ex_handle.recv_src_metadata[:, 2:]
        for j, want in enumerate(ref_ids):
            for k in range(TOPK):
                e = int(want[k]) - rank * local
                if 0 <= e < local:
                    assert starts[e] <= slots[j, k] < starts[e] + counts[e]
                    assert (
                        torch.equal(ex_x[slots[j, k]], ref_x[j])
                        and ex_w[slots[j, k]] == every_w[mine[j][0]][mine[j][1]][k]
                    )
                else:
                    assert slots[j, k] == -1
        # cached: the same rows, the same handle
        cached = buffer.dispatch(x * 2, handle=handle)
        assert cached[3] is handle and torch.equal(cached[0], (ref_x.float() * 2).bfloat16())
    # FP8 rows with float32 scales: the same rows and scales (the scales' TMA strides as asked)
    scales = torch.rand(x.shape[0], HIDDEN // 128) + 0.5
    fp8 = x.float().to(torch.float8_e4m3fn)
    (f_x, f_s), *_ = buffer.dispatch(
        (fp8, scales), ids, weights, num_experts=num_experts, use_tma_aligned_col_major_sf=True
    )
    every_s, every_f = _all(scales), _all(fp8.view(torch.uint8))
    if mine:
        assert torch.equal(f_x.view(torch.uint8), torch.stack([every_f[s][t] for s, t in mine]))
        assert torch.equal(f_s, torch.stack([every_s[s][t] for s, t in mine])) and f_s.stride(0) == 1
    # a cached dispatch with new weights: they travel too
    new_w = weights * 3
    _, _, cached_w, _, _ = buffer.dispatch(x, handle=handle, topk_weights=new_w)
    every_new = _all(new_w)
    for j, (src, t) in enumerate(mine):
        assert torch.equal(cached_w[j], every_new[src][t]), f"cached weights of row {j}"
    # worst-case shapes without a host sync: the valid rows first
    wc_x, wc_idx, _, wc_handle, _ = buffer.dispatch(x, ids, weights, num_experts=num_experts, do_cpu_sync=False)
    assert wc_x.shape[0] == N_MAX * world and torch.equal(wc_x[: len(mine)], ref_x)
    assert (wc_idx[len(mine) :] == -1).all() and wc_handle.num_recv_tokens_per_expert_list == []
    # combine, in V2's order: bias0 + bias1, then each rank's row by the last top-k slot naming its experts
    y = torch.stack([_term(s, t, rank) for s, t in mine]) if mine else torch.empty(0, HIDDEN, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(40 + rank)
    bias = (
        torch.randn(x.shape[0], HIDDEN, generator=g).bfloat16(),
        torch.randn(x.shape[0], HIDDEN, generator=g).bfloat16(),
    )
    combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w, bias=bias)
    for t in range(x.shape[0]):
        acc = bias[0][t].float() + bias[1][t].float()
        owners = [int(e) // local if e >= 0 else -1 for e in ids[t]]
        last = {r: k for k, r in enumerate(owners) if r >= 0}
        for r in sorted(last, key=last.get):
            acc = acc + _term(rank, t, r).float()
        assert torch.equal(combined[t], acc.bfloat16()), f"token {t}"
    assert torch.equal(combined_w, weights)  # each weight back from its expert's rank
    # a bad call on one rank (or one that differs across ranks): the same ValueError everywhere, the buffer goes on
    with pytest.raises(ValueError, match=r"the ranks' arguments differ \(num_experts: ranks 0, 2 have 6, rank 1 has 7"):
        buffer.dispatch(x, ids, weights, num_experts=num_experts + (rank == 1))
    with pytest.raises(ValueError, match=r"rejected on every rank before any row moved: rank 1: dispatch: "):
        buffer.dispatch(x, ids + num_experts * (rank == 1), weights, num_experts=num_experts)  # ids out of range
    again = buffer.dispatch(x, ids, weights, num_experts=num_experts)
    assert torch.equal(again[0], ref_x)
    buffer.destroy()
    _v2_shaped_misuse_of_the_native_buffer(x, ids, weights, num_experts)
    return "ok"


def _v2_shaped_misuse_of_the_native_buffer(x, ids, weights, num_experts) -> None:
    """V2-style code on the native EPBuffer unpacks five values too (the fourth the counts, the fifth the handle):
    the first use of what it took for the handle and the event raises, saying what they are."""
    from epkit.collectives.ep_buffer import EPBuffer

    buf = EPBuffer(dist.group.WORLD, HIDDEN, num_experts, N_MAX, TOPK)
    result = buf.dispatch(x, ids, weights)
    assert result.handle is result[4] and result.num_recv_tokens_per_expert is result[3]  # named fields
    recv_x, _, _, handle, event = result  # V2's order: "handle" is the count list, "event" the handle
    with pytest.raises(AttributeError, match=r"this is the handle, not an event.*ElasticBuffer"):
        event.current_stream_wait()
    with pytest.raises(ValueError, match=r"got list \(dispatch's fourth value, the per-expert counts"):
        buf.combine(recv_x, handle)
    assert buf.combine(recv_x, result.handle).shape == x.shape  # the buffer goes on
    buf.close()


@pytest.mark.parametrize("world", [3])
def test_elastic_buffer_matches_v2_semantics_bit_for_bit(world):
    assert run_ranks(_run, world, timeout=120) == ["ok"] * world
