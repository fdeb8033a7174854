"""EPBuffer dispatch/combine on real CPU ranks, bit for bit against the textbook reference exchange."""

import pytest
import torch
import torch.distributed as dist

from epkit.collectives.ep_buffer import EPBuffer
from epkit.collectives.ep_reference import reference_combine, reference_dispatch, reference_layout
from epkit.testing import assert_bitwise_equal
from epkit.testing.multiprocess import RankError, run_ranks

HIDDEN, EXPERTS, TOPK = 256, 16, 4


def _routing(rank, world_size, case, seed):
    """Per-rank routing for a named case (uneven token counts, -1 entries, one hot expert...)."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    num_tokens = {"uneven": [0, 37, 5, 64][rank % 4], "hot": 23, "full": 48, "minus1": 31}[case]
    if case == "hot":
        idx = torch.full((num_tokens, TOPK), -1, dtype=torch.int64)
        idx[:, 0] = 5  # every token to one expert
    else:
        idx = (
            torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(num_tokens)])
            if num_tokens
            else torch.empty((0, TOPK), dtype=torch.int64)
        )
        if case == "minus1" and num_tokens:
            idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(torch.bfloat16)
    w = torch.rand(num_tokens, TOPK, generator=g)
    return x, idx, w


def _compare(rank, world_size, transport, case, expand, alignment, fp8, seed=0):
    buf = EPBuffer(
        dist.group.WORLD, HIDDEN, EXPERTS, num_max_tokens_per_rank=64, num_topk=TOPK, transport=transport, timeout=20
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
        want_s = ref["recv_scales"]
        if expand:
            rows = handle.expanded_rows
            want_s = torch.where((rows >= 0)[:, None], want_s[rows.clamp(min=0)], torch.zeros(()))
        assert_bitwise_equal(recv[1], want_s, ctx + " scales")
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
    buf.buffer.close()
    return True


CASES = [
    ("uneven", False, 1, False),
    ("minus1", True, 1, False),
    ("hot", True, 128, False),
    ("full", True, 4, True),
    ("uneven", False, 1, True),
]


@pytest.mark.parametrize("transport", ["shm", "torch"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_combine_matches_reference(transport, world_size):
    for case, expand, alignment, fp8 in CASES:
        assert (
            run_ranks(_compare, world_size, transport, case, expand, alignment, fp8, timeout=90) == [True] * world_size
        ), (case, expand, alignment, fp8)


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
