"""EPBuffer dispatch/combine on real CPU ranks, bit for bit against the textbook reference exchange."""

import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from epkit.collectives.ep_buffer import EPBuffer
from epkit.collectives.ep_reference import (
    reference_combine,
    reference_dispatch,
    reference_layout,
    reference_low_latency_combine,
    reference_low_latency_dispatch,
)
from epkit.testing import assert_bitwise_equal
from epkit.testing.markers import requires_cuda
from epkit.testing.multiprocess import RankError, run_ranks
from epkit.testing.nvshmem_emulator import resolve_transport

HIDDEN, EXPERTS, TOPK = 256, 16, 4


def _routing(rank, world_size, case, seed):
    """Per-rank routing for a named case (uneven token counts, -1 entries, one hot expert...)."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    fixed = {"uneven": [0, 37, 5, 64][rank % 4], "hot": 23, "full": 48, "minus1": 31}
    num_tokens = fixed[case] if case in fixed else int(torch.randint(0, 65, (1,), generator=g))
    if case == "hot":
        idx = torch.full((num_tokens, TOPK), -1, dtype=torch.int64)
        idx[:, 0] = 5  # every token to one expert
    else:
        idx = (
            torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(num_tokens)])
            if num_tokens
            else torch.empty((0, TOPK), dtype=torch.int64)
        )
        if case in ("minus1", "random") and num_tokens:
            idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(torch.bfloat16)
    w = torch.rand(num_tokens, TOPK, generator=g)
    return x, idx, w


def expected_scales(ref, handle, expand: bool) -> torch.Tensor:
    """The FP8 scales a dispatch should return: the reference's received ones, or with ``expand`` those of each
    expanded row (zeros in padding rows, where ``handle.expanded_rows`` is -1)."""
    want = ref["recv_scales"]
    if not expand:
        return want
    rows = handle.expanded_rows
    return torch.where((rows >= 0)[:, None], want[rows.clamp(min=0)], torch.zeros(()))


def _compare(rank, world_size, transport, case, expand, alignment, fp8, seed=0, portable=False):
    transport = resolve_transport(transport)
    buf = EPBuffer(
        dist.group.WORLD,
        HIDDEN,
        EXPERTS,
        num_max_tokens_per_rank=64,
        num_topk=TOPK,
        transport=transport,
        timeout=20,
        portable=portable,
    )
    x, idx, w = _routing(rank, world_size, case, seed)
    scales = None
    if fp8:
        from epkit.quant import per_token_group_cast_to_fp8

        x, scales = per_token_group_cast_to_fp8(x.float(), 128)
    layout = buf.get_dispatch_layout(idx)
    ref_layout = reference_layout(idx, EXPERTS, world_size)
    for a, b in zip(layout, ref_layout):
        assert torch.equal(a, b)
    inp = (x, scales) if fp8 else x
    recv, recv_idx, recv_w, counts, handle = buf.dispatch(inp, idx, w, expert_alignment=alignment, expand=expand)
    ref = reference_dispatch(x, idx, w, EXPERTS, expand=expand, expert_alignment=alignment, x_scales=scales)
    ctx = f"{rank=} {transport=} {case=} {expand=} {alignment=} {fp8=}"
    got_x = recv[0] if fp8 else recv
    assert_bitwise_equal(got_x, ref["expanded_x"] if expand else ref["recv_x"], ctx + " recv_x")
    if fp8:
        assert_bitwise_equal(recv[1], expected_scales(ref, handle, expand), ctx + " scales")
    assert_bitwise_equal(recv_idx, ref["recv_topk_idx"], ctx + " idx")
    assert_bitwise_equal(recv_w, ref["recv_topk_weights"], ctx + " weights")
    assert counts == ref["num_recv_tokens_per_expert"], ctx
    if expand:
        assert torch.equal(EPBuffer.m_indices(handle), ref["m_indices"]), ctx
    # combine: a deterministic "expert" output per row
    rows = ref["expanded_x"] if expand else ref["recv_x"]
    base = rows.float() if not fp8 else rows.float()
    y = (base * 0.5 + 1).to(torch.bfloat16)
    bias = torch.full((x.shape[0], HIDDEN), 0.25, dtype=torch.bfloat16)
    out = buf.combine(y, handle, bias=bias)
    want = reference_combine(y, ref, x.shape[0], bias=bias, expand=expand)
    assert_bitwise_equal(out, want, ctx + " combine")
    # cached dispatch reuses the layout and moves the same rows
    again = buf.dispatch(inp, handle=handle)
    assert_bitwise_equal(again[0][0] if fp8 else again[0], got_x, ctx + " cached")
    buf.close()
    buf.close()  # twice is harmless
    for late in (lambda: buf.dispatch(inp, idx, w), lambda: buf.low_latency_dispatch(x, idx, x.shape[0] or 1)):
        with pytest.raises(RuntimeError, match="closed"):
            late()
    # What the calls returned is the caller's, not a view of the released memory.
    assert_bitwise_equal(got_x, ref["expanded_x"] if expand else ref["recv_x"], ctx + " recv_x after close")
    assert_bitwise_equal(out, want, ctx + " combine after close")
    return True


CASES = [
    ("uneven", False, 1, False),
    ("minus1", True, 1, False),
    ("hot", True, 128, False),
    ("full", True, 4, True),
    ("uneven", False, 1, True),
    ("hot", True, 128, True),  # FP8 rows, and ranks that receive none (a reshape of 0 rows once failed)
]


@pytest.mark.parametrize(
    "transport,world_size",
    [("shm", 4), ("torch", 4), ("nvemu", 4), ("nvemu-nop2p", 4), ("nvemu-torch", 2)],
)
def test_dispatch_combine_matches_reference(transport, world_size):
    # Every case in one set of rank processes (a fresh buffer per case; its messages name the case). On 2 ranks
    # the flat transports are tests/test_ep_conformance.py's outcomes; here 4 ranks, one expert every rank hits,
    # closed buffers, and the transports' variants (no peer views, torch's symmetric memory).
    assert run_ranks(_compare_cases, world_size, transport, timeout=240) == [True] * world_size


def _compare_cases(rank, world_size, transport, portable=False):
    return all(_compare(rank, world_size, transport, *case, portable=portable) for case in CASES)


@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    world_size=st.sampled_from([2, 4]),
    expand=st.booleans(),
    alignment=st.sampled_from([1, 4, 128]),
    fp8=st.booleans(),
)
def test_random_routings(seed, world_size, expand, alignment, fp8):
    res = run_ranks(_compare, world_size, "shm", "random", expand, alignment, fp8, seed, timeout=90)
    assert res == [True] * world_size


def _bad_rank(rank, world_size):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, num_max_tokens_per_rank=8, num_topk=TOPK, timeout=10)
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    idx = torch.zeros(4, TOPK, dtype=torch.int64)
    if rank == 1:
        idx[2, 3] = EXPERTS  # invalid expert on one rank only
    try:
        buf.dispatch(x, idx)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_bad_input_fails_on_every_rank():
    res = run_ranks(_bad_rank, 4, timeout=40)
    for msg in res:
        assert "rank 1: topk_idx[2, 3] = 16 is outside [-1, 16)" in msg, msg


def _sub_group_bad_calls(rank, world_size):
    """An EPBuffer over global ranks 2 and 3 only; three calls that are bad on global rank 3 (group position 1)."""
    from epkit.collectives.bootstrap import SubGroup

    if rank < 2:
        return None
    buf = EPBuffer(SubGroup(dist.group.WORLD, [2, 3], "ep"), HIDDEN, EXPERTS, 8, TOPK, transport="shm", timeout=10)
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    idx = torch.arange(TOPK).repeat(4, 1)
    bad = idx.clone()
    if rank == 3:
        bad[2, 3] = EXPERTS
    calls = [
        lambda: buf.dispatch(x, bad),  # rejected by rank 3's own check, told in the agreement
        lambda: buf.dispatch(x.float() if rank == 3 else x, idx),  # valid on each rank; the formats differ
        lambda: buf.low_latency_dispatch(x, idx, 8 if rank == 2 else 4, use_fp8=False),  # the parameters differ
    ]
    msgs = []
    for call in calls:
        try:
            call()
            msgs.append("no error")
        except ValueError as exc:
            msgs.append(str(exc))
    counts = [8 * (rank == 2)] * TOPK + [0] * (EXPERTS // 2 - TOPK)  # both ranks' 4 tokens to experts 0-3
    assert buf.dispatch(x, idx)[3] == counts  # the buffer goes on
    buf.close()
    return msgs


def test_a_sub_groups_ep_errors_name_global_ranks():
    # An EPBuffer over global ranks 2 and 3 named them by their positions ("rank 1: topk_idx[2, 3] ...").
    res = run_ranks(_sub_group_bad_calls, 4, timeout=60)
    assert res[2] == res[3], res
    ids, formats, params = res[2]
    assert "rank 3: topk_idx[2, 3] = 16 is outside [-1, 16)" in ids, ids
    assert "rank 2: torch.bfloat16; rank 3: torch.float32" in formats, formats
    assert (
        "rank 2: num_max_dispatch_tokens_per_rank=8" in params
        and "rank 3: num_max_dispatch_tokens_per_rank=4" in params
    )
    assert "rank 0" not in " ".join(res[2]) and "rank 1" not in " ".join(res[2]), res[2]


def _too_many(rank, world_size):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, num_max_tokens_per_rank=8, num_topk=TOPK, timeout=10)
    n = 9 if rank == 0 else 3
    with pytest.raises(ValueError, match="rank 0: 9 tokens exceed num_max_tokens_per_rank = 8"):
        buf.dispatch(torch.zeros(n, HIDDEN, dtype=torch.bfloat16), torch.zeros(n, TOPK, dtype=torch.int64))
    with pytest.raises(ValueError, match="hidden|must be"):
        buf.dispatch(torch.zeros(2, HIDDEN + 1), torch.zeros(2, TOPK, dtype=torch.int64))
    return True


def test_capacity_and_shape_errors_everywhere():
    assert run_ranks(_too_many, 2, timeout=40) == [True, True]


def test_constructor_errors():
    with pytest.raises(RankError, match="not divisible by the EP group size 3"):
        run_ranks(_make, 3, timeout=30)


def _make(rank, world_size):
    EPBuffer(dist.group.WORLD, 8, 16, 4, 2)


def _low_latency(rank, world_size, transport, use_fp8, hook_mode, num_tokens_fn, portable=False):
    n_max = 16
    transport = resolve_transport(transport)
    buf = EPBuffer(
        dist.group.WORLD,
        HIDDEN,
        EXPERTS,
        num_max_tokens_per_rank=n_max,
        num_topk=TOPK,
        transport=transport,
        timeout=20,
        portable=portable,
    )
    g = torch.Generator().manual_seed(rank + 7)
    t = num_tokens_fn(rank)
    idx = (
        torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(t)])
        if t
        else torch.empty((0, TOPK), dtype=torch.int64)
    )
    if t:
        idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    x = torch.randn(t, HIDDEN, generator=g).to(torch.bfloat16)
    wts = torch.rand(t, TOPK, generator=g)
    recv_x, recv_count, handle, hook = buf.low_latency_dispatch(
        x, idx, n_max, use_fp8=use_fp8, return_recv_hook=hook_mode
    )
    shape = recv_x[0].shape if use_fp8 else recv_x.shape
    assert shape == (EXPERTS // world_size, n_max * world_size, HIDDEN)  # fixed, routing-independent
    hook()
    ref = reference_low_latency_dispatch(x, idx, n_max, EXPERTS, use_fp8=use_fp8)
    assert recv_count.tolist() == ref["counts"]
    for e, c in enumerate(ref["counts"]):
        got = recv_x[0][e, :c] if use_fp8 else recv_x[e, :c]
        assert_bitwise_equal(got, ref["recv_x"][e], f"{rank=} {e=} x")
        if use_fp8:
            assert_bitwise_equal(recv_x[1][e, :c], ref["recv_scales"][e], f"{rank=} {e=} scales")
    # the experts' outputs: a function of the received rows, padded rows filled with garbage
    y = torch.full((EXPERTS // world_size, n_max * world_size, HIDDEN), float("nan"), dtype=torch.bfloat16)
    y_ref = []
    for e, c in enumerate(ref["counts"]):
        rows = (
            (recv_x[0][e, :c].float() * recv_x[1][e, :c].repeat_interleave(128, dim=1))
            if use_fp8
            else recv_x[e, :c].float()
        )
        y[e, :c] = (rows * 2 - 1).to(torch.bfloat16)
        y_ref.append(y[e, :c].clone())
    out = buf.low_latency_combine(y, idx, wts, handle)
    want = reference_low_latency_combine(y_ref, idx, wts, ref)
    assert_bitwise_equal(out, want, f"{rank=} combine")
    return True


@pytest.mark.parametrize("use_fp8,hook_mode", [(True, False), (False, True)])
def test_low_latency_matches_reference(use_fp8, hook_mode):
    # 4 ranks of shm, one at the slot capacity; every path at 2 ranks (and nvshmem at 4): test_ep_conformance.py
    transport = "shm"
    assert run_ranks(_low_latency, 4, transport, use_fp8, hook_mode, _ll_tokens, timeout=90) == [True] * 4


def _ll_tokens(rank):
    return 16 if rank == 0 else [3, 0, 11][rank % 3]  # rank 0 at exactly the slot capacity


def _killed_mid_dispatch(rank, world_size, transport):
    import os
    import signal
    import time

    transport = resolve_transport(transport)
    buf = EPBuffer(
        dist.group.WORLD, HIDDEN, EXPERTS, num_max_tokens_per_rank=32, num_topk=TOPK, transport=transport, timeout=5
    )
    x, idx, w = _routing(rank, world_size, "full", 3)
    x, idx, w = x[:32], idx[:32], w[:32]
    buf.dispatch(x, idx, w)  # one good round
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # dies before the second dispatch's data
    t0 = time.monotonic()
    try:
        buf.dispatch(x, idx, w)
    except TimeoutError as exc:
        return str(exc), time.monotonic() - t0
    return "no error", 0.0


@pytest.mark.parametrize("transport", ["shm", "nvemu"])
def test_sigkilled_rank_times_out_naming_it_and_leaves_no_segment(transport):
    import glob

    before = set(glob.glob("/dev/shm/epkit-*"))
    res = run_ranks(_killed_mid_dispatch, 4, transport, timeout=60, may_die=(2,))
    assert res[2] is None
    for rank in (0, 1, 3):
        msg, waited = res[rank]
        # Its own timeout, or the notice of the survivor whose timeout came first (PeerFailedError).
        assert re.search(r"rank 2 sent no .*(within 5 s|within its timeout)", msg), msg
        assert waited < 20
    assert set(glob.glob("/dev/shm/epkit-*")) <= before


def _moe_layer(rank, world_size, seed):
    """Dispatch -> per-expert MLP -> combine against the same MoE layer computed in one process (float64)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(EXPERTS, 2 * 32, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, 32, generator=g, dtype=torch.float64) / 32**0.5
    xs, ids, ws = [], [], []
    for r in range(world_size):  # every rank knows every rank's tokens for the single-process check
        x, idx, wt = _routing(r, world_size, "minus1", seed)
        xs.append(x.float())
        ids.append(idx)
        ws.append(wt)

    def mlp(e, v):
        gate, up = (v @ w1[e].T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w2[e].T

    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, num_max_tokens_per_rank=64, num_topk=TOPK, timeout=20)
    local = EXPERTS // world_size
    recv_x, recv_idx, recv_w, _, handle = buf.dispatch(xs[rank], ids[rank], ws[rank], expand=True, expert_alignment=8)
    m_idx = EPBuffer.m_indices(handle)
    y = torch.zeros(recv_x.shape, dtype=torch.float32)
    for e in range(local):
        rows = (m_idx == e).nonzero().flatten()
        if rows.numel():
            y[rows] = mlp(rank * local + e, recv_x[rows].double()).float()
    out = buf.combine(y, handle)
    want = torch.zeros(xs[rank].shape, dtype=torch.float64)
    for t in range(xs[rank].shape[0]):
        for k in range(TOPK):
            e = int(ids[rank][t, k])
            if e >= 0:
                want[t] += ws[rank][t, k].double() * mlp(e, xs[rank][t : t + 1].double())[0]
    err = (out.double() - want).abs().max().item() if out.numel() else 0.0
    return err


def test_dispatch_mlp_combine_equals_single_process_moe():
    errs = run_ranks(_moe_layer, 4, 5, timeout=90)
    assert max(errs) < 1e-5, errs  # float32 transport of float64 math


def _feed_eplb(rank, world_size):
    from epkit.eplb import ExpertLoadCounter
    from epkit.experts import ExpertPlacement

    placement = ExpertPlacement.default(12, world_size, min_num_extra_experts=4)  # 16 physical, 8 per rank
    buf = EPBuffer(dist.group.WORLD, HIDDEN, placement.num_physical, 64, TOPK, timeout=20)
    counter = ExpertLoadCounter(num_layers=1, num_logical=12, window=4)
    total = torch.zeros(12, dtype=torch.int64)
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + rank)
        logical = torch.stack([torch.randperm(12, generator=g)[:TOPK] for _ in range(20)])
        physical = logical  # the default layout maps logical e to physical slot e first
        buf.dispatch(torch.zeros(20, HIDDEN, dtype=torch.bfloat16), physical)
        local = buf.take_expert_load()
        gathered = [torch.zeros_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        per_logical = torch.zeros(12, dtype=torch.int64).index_add_(0, placement.phy2log.long(), torch.cat(gathered))
        counter.add(0, per_logical)
        counter.step()
        everyone = [torch.zeros_like(logical) for _ in range(world_size)]
        dist.all_gather(everyone, logical)
        total += torch.bincount(torch.cat(everyone).flatten(), minlength=12)
    assert torch.equal(counter.load()[0], total), (counter.load(), total)
    return True


def test_dispatch_counts_feed_the_eplb_counter():
    assert run_ranks(_feed_eplb, 2, timeout=60) == [True, True]


def _local_failure_agreed(rank, world_size, transport):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 16, TOPK, transport=resolve_transport(transport), timeout=3)
    x, idx, w = _routing(rank, world_size, "minus1", 4)
    x, idx, w = x[:16], idx[:16], w[:16]
    recv, _, _, _, handle = buf.dispatch(x, idx, w)
    y = recv if rank == 1 else recv[:, :-1]  # rank 0 passes a bad y: found before any row moves
    try:
        buf.combine(y, handle)
        first = "ok"
    except (ValueError, TimeoutError) as exc:
        first = f"{type(exc).__name__}: {exc}"
    # The agreement kept the ranks' exchanges in step: the next call pairs with the peers' next call.
    out = buf.combine(recv, handle)
    ref = reference_dispatch(x, idx, w, EXPERTS)
    assert_bitwise_equal(out, reference_combine(ref["recv_x"], ref, x.shape[0]), f"{rank=} after the rejected call")
    return first


@pytest.mark.parametrize("transport", ["shm", "nvemu"])
def test_one_bad_combine_is_rejected_everywhere_and_the_buffer_goes_on(transport):
    res = run_ranks(_local_failure_agreed, 2, transport, timeout=60)
    assert res[0] == res[1], res  # the same error on every rank, not a timeout or a peer notice
    assert res[0].startswith("ValueError: combine rejected on every rank before any row moved: rank 0: y must be"), res


def _ll_reject_then_recover(rank, world_size, transport):
    transport = resolve_transport(transport)
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 8, TOPK, transport=transport, timeout=10)
    x = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1, -1, -1]] * 2, dtype=torch.int64)
    if rank == 1:  # duplicate expert ids in every token: 16 pairs for expert 3's 8 slots
        bad = torch.tensor([[3, 3, -1, -1]] * 8, dtype=torch.int64)
        x_bad = torch.zeros(8, HIDDEN, dtype=torch.bfloat16)
    else:
        bad, x_bad = idx, x
    with pytest.raises(ValueError, match="rank 1: expert 3 gets 16 .* more than its 8 slots"):
        buf.low_latency_dispatch(x_bad, bad, 8, use_fp8=False)
    recv, count, handle, _ = buf.low_latency_dispatch(x, idx, 8, use_fp8=False)  # the buffer still works
    out = buf.low_latency_combine(recv, idx, torch.ones(2, TOPK), handle)
    return count.tolist(), tuple(out.shape)


@pytest.mark.parametrize("transport", ["shm", "torch", "nvemu"])
def test_low_latency_rejection_leaves_buffer_usable(transport):
    res = run_ranks(_ll_reject_then_recover, 2, transport, timeout=60)
    assert res[0][0][:2] == [2 * 2, 2 * 2] and res[0][1] == (2, HIDDEN), res


def _ll_bytes_on_torch(rank, world_size):
    """Bytes this rank sends its peer for one low-latency dispatch and one combine on the torch transport."""
    from epkit.collectives.ep.ll_layout import COMBINE_HEADER
    from epkit.collectives.ep.rows import META_MSG

    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 32, TOPK, transport="torch", timeout=20)
    x, idx, w = _routing(rank, world_size, "minus1", 4)
    idx = idx[:20]
    x, w = x[:20], w[:20]
    sent = buf.buffer.impl.bytes_sent
    peer = 1 - rank
    before = sent[peer]
    recv, count, handle, _ = buf.low_latency_dispatch(x, idx, 32, use_fp8=True)
    dispatched = sent[peer] - before
    y = recv[0].float().mul(recv[1].repeat_interleave(128, dim=2)).to(torch.bfloat16)
    before = sent[peer]
    buf.low_latency_combine(y, idx, w, handle)
    combined = sent[peer] - before
    # What the message must hold: a 24-byte transport header, then the low-latency header (int32 status, n_max,
    # use_fp8 and one count per local expert, 16-byte aligned, and the error text), the FP8 rows, 16-byte
    # aligned, and their float32 scales (one per 128 values); a combine: its header (the handle's identity,
    # padded) and the bf16 rows. Rows: the (token, expert) pairs whose expert lives on the peer.
    # Rows: the (token, expert) pairs whose expert lives on the peer, and back, the peer's pairs whose expert
    # lives here.
    local = EXPERTS // world_size
    pairs = int(((idx >= 0) & (idx // local == peer)).sum())
    peer_idx = _routing(peer, world_size, "minus1", 4)[1][:20]
    back = int(((peer_idx >= 0) & (peer_idx // local == rank)).sum())
    head = -(-4 * (3 + local) // 16) * 16 + META_MSG
    want_dispatch = 24 + head + -(-pairs * HIDDEN // 16) * 16 + pairs * 4 * (HIDDEN // 128)
    want_combine = 24 + COMBINE_HEADER + back * 2 * HIDDEN
    return pairs, dispatched, want_dispatch, combined, want_combine, buf.region_bytes


def test_low_latency_messages_on_torch_carry_only_their_rows():
    # The torch transport sends what a low-latency message holds, not its fixed-slot region (every local
    # expert's capacity): bytes counted by the transport, predicted from the routing.
    for pairs, dispatched, want_dispatch, combined, want_combine, region in run_ranks(
        _ll_bytes_on_torch, 2, timeout=60
    ):
        assert pairs > 0
        assert dispatched == want_dispatch, (dispatched, want_dispatch)
        assert combined == want_combine, (combined, want_combine)
        assert dispatched < region // 4


def _mixed_formats(rank, world_size):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 8, TOPK, timeout=10)
    dtype = torch.float32 if rank == 1 else torch.bfloat16
    idx = torch.tensor([[0, 5, -1, -1]] * 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="differ in format across ranks .*rank 1: torch.float32"):
        buf.dispatch(torch.zeros(3, HIDDEN, dtype=dtype), idx)
    recv, *_ = buf.dispatch(torch.zeros(3, HIDDEN, dtype=torch.bfloat16), idx)  # still usable
    return tuple(recv.shape)


def test_row_format_mismatch_is_caught_everywhere():
    assert run_ranks(_mixed_formats, 2, timeout=40) == [(6, HIDDEN), (0, HIDDEN)]  # experts 0 and 5 live on rank 0


def test_device_path_arithmetic_matches_reference_on_cpu():
    # The same protocol with torch row copies and the torch reduction instead of epkit._C by address (a buffer
    # made with portable=True): bitwise the same results, normal and low-latency modes.
    assert run_ranks(_compare_cases, 2, "shm", True, timeout=180) == [True, True]
    assert run_ranks(_low_latency, 4, "shm", True, False, _ll_tokens, True, timeout=90) == [True] * 4


def _pooled(rank, world_size, fn, *args):
    """Run a rank body with every CPU result row tensor from the buffer's RowPool (whatever its size)."""
    from epkit.collectives.ep import rows as ep_rows

    ep_rows.RowPool.MIN_BYTES = 0
    return fn(rank, world_size, *args)


def test_pooled_results_match_reference_and_are_never_reused_while_held():
    # _compare holds the first dispatch's rows and the combine's output across a cached dispatch and the
    # buffer's close, and checks them bit for bit afterwards: a block still in use is never handed out again.
    assert run_ranks(_pooled, 4, _compare_cases, "shm", timeout=180) == [True] * 4


def _result_slots(rank, world_size):
    """shm dispatch results live in the receiver's result slots (ep_result_slots) while one is free; a held result
    (or any view of it) keeps its slot, later results take the other or go through the region, and a result stays
    readable past the buffer's close."""
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 64, TOPK, transport="shm", timeout=20)
    local = buf.buffer.local
    lo, hi = local.data_ptr(), local.data_ptr() + local.numel()

    def call(seed):
        x, idx, w = _routing(rank, world_size, "full", seed)
        recv = buf.dispatch(x, idx, w)[0]
        return recv, reference_dispatch(x, idx, w, EXPERTS)["recv_x"], lo <= recv.data_ptr() < hi

    held = [call(seed) for seed in range(4)]  # two slots: the 3rd and 4th results cannot take one
    where = [in_slot for _, _, in_slot in held]
    part = held[0][0][3:9]  # a view of the first: its slot stays taken after the tensor itself is dropped
    part_want = held[0][1][3:9]
    del held[1]  # the second's slot is free again
    del held[0]
    fifth = call(4)
    where.append(fifth[2])
    same = [torch.equal(r, want) for r, want, _ in held] + [torch.equal(fifth[0], fifth[1])]
    same.append(torch.equal(part, part_want))
    buf.close()
    same.append(torch.equal(fifth[0], fifth[1]))  # still readable: the memory stays mapped while held
    return where, same


def test_shm_results_are_written_into_free_result_slots_and_never_reused_while_held():
    for where, same in run_ranks(_result_slots, 2, timeout=60):
        assert where == [True, True, False, False, True], where
        assert all(same), same


def _no_slots(rank, world_size):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 64, TOPK, transport="shm", timeout=20)
    x, idx, w = _routing(rank, world_size, "full", 1)
    recv = buf.dispatch(x, idx, w)[0]
    same = torch.equal(recv, reference_dispatch(x, idx, w, EXPERTS)["recv_x"])
    buf.close()
    return buf.result_slots is None, same


def test_result_slots_can_be_turned_off(monkeypatch):
    # EPKIT_RESULT_SLOTS=0: no slot memory, the rows take the regions and the receiver's copy; the same rows.
    monkeypatch.setenv("EPKIT_RESULT_SLOTS", "0")
    assert run_ranks(_no_slots, 2, timeout=60) == [(True, True)] * 2
    monkeypatch.setenv("EPKIT_RESULT_SLOTS", "two")
    with pytest.raises(RankError, match="EPKIT_RESULT_SLOTS must be an integer >= 0, got 'two'"):
        run_ranks(_no_slots, 2, timeout=60)


def test_row_pool_reuses_a_block_only_once_every_view_of_it_is_gone():
    from epkit.collectives.ep.rows import RowPool

    pool = RowPool(max_free=2)
    a = pool.empty((1024, 1024), torch.float32)
    a.fill_(1.0)
    view = a[10:20]
    addr = a.data_ptr()
    del a
    b = pool.empty((1024, 1024), torch.float32)  # the view keeps the first block in use
    assert b.data_ptr() != addr and torch.equal(view, torch.ones(10, 1024))
    del view
    c = pool.empty((1024, 1536), torch.bfloat16)  # 3 MiB of the 4.5 MiB block: more than half of it, reused
    assert c.data_ptr() == addr and c.shape == (1024, 1536) and c.dtype == torch.bfloat16 and c.is_contiguous()
    assert pool.empty((8, 8), torch.float32).numel() == 64  # small requests are plain torch.empty


def test_row_pool_takes_back_blocks_freed_on_other_threads():
    # gloo may drop the last tensor of a block on its own thread: the block still comes back to the pool
    import threading

    from epkit.collectives.ep.rows import RowPool

    pool = RowPool(max_free=2)
    holder = [pool.empty((1024, 1024), torch.float32)]
    addr = holder[0].data_ptr()
    t = threading.Thread(target=holder.clear)  # the last reference goes on the other thread
    t.start()
    t.join(timeout=10)
    assert not t.is_alive() and not holder
    assert pool.empty((1024, 1024), torch.float32).data_ptr() == addr


def _gpu_loopback(rank, world_size):
    """EPBuffer(nvshmem) on one GPU: the CUDA path against the CPU reference, bit for bit."""
    torch.cuda.set_device(0)
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 64, TOPK, transport="nvshmem", timeout=20)
    assert buf.device.type == "cuda"
    for case, expand, alignment, fp8 in CASES:
        x, idx, w = _routing(rank, world_size, case, 0)
        scales = None
        if fp8:
            from epkit.quant import per_token_group_cast_to_fp8

            x, scales = per_token_group_cast_to_fp8(x.float(), 128)
        inp = (x.cuda(), scales.cuda()) if fp8 else x.cuda()
        recv, recv_idx, _, counts, handle = buf.dispatch(
            inp, idx.cuda(), w.cuda(), expert_alignment=alignment, expand=expand
        )
        ref = reference_dispatch(x, idx, w, EXPERTS, expand=expand, expert_alignment=alignment, x_scales=scales)
        ctx = f"{case=} {expand=} {fp8=}"
        got_x = recv[0] if fp8 else recv
        assert got_x.is_cuda and recv_idx.is_cuda, ctx
        assert_bitwise_equal(got_x.cpu(), ref["expanded_x"] if expand else ref["recv_x"], ctx + " recv_x")
        assert counts == ref["num_recv_tokens_per_expert"], ctx
        rows = ref["expanded_x"] if expand else ref["recv_x"]
        y = (rows.float() * 0.5 + 1).to(torch.bfloat16)
        bias = torch.full((x.shape[0], HIDDEN), 0.25, dtype=torch.bfloat16)
        out = buf.combine(y.cuda(), handle, bias=bias.cuda())
        assert_bitwise_equal(out.cpu(), reference_combine(y, ref, x.shape[0], bias=bias, expand=expand), ctx)
    buf.buffer.close()
    return True


@requires_cuda
def test_gpu_dispatch_combine_over_nvshmem_matches_reference():
    assert run_ranks(_gpu_loopback, 1, timeout=240) == [True]
