"""A call whose arguments differ across ranks (one rank's ``x`` of another hidden size or dtype) is the same
``ValueError`` on every rank, raised at once inside the call's agreement and naming the argument and each rank's
value, through ``epkit.compat.deep_ep.Buffer`` (normal and low-latency dispatch, before and after its buffer
exists) and through ``EPBuffer``; the exchange goes on afterwards. Issue 37: the shim made its buffer from the
call's hidden size, so the ranks went separate ways (one into making a buffer, one into the exchange) and both
timed out after 30 s.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import epkit.compat.deep_ep as deep_ep
from epkit.collectives.ep_buffer import EPBuffer
from epkit.compat._details.deep_ep_agreement import describe_differences
from epkit.testing.multiprocess import run_ranks

HIDDEN, TOPK, TOKENS, MAX_TOKENS = 256, 2, 4, 8
#: What each rank's odd call differs in: rank 1's x has this hidden size, or float32 rows.
ODD_HIDDEN = 128
HIDDEN_DIFFERS = rf"x hidden size: rank 0 has {HIDDEN}, rank 1 has {ODD_HIDDEN}"
DTYPE_DIFFERS = r"x dtype: rank 0 has torch.bfloat16, rank 1 has torch.float32"


def _inputs(rank: int, num_experts: int):
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    ids = torch.randperm(num_experts, generator=g)[: TOPK * TOKENS].view(TOKENS, TOPK)
    return x, ids, torch.rand(TOKENS, TOPK, generator=g)


def _odd(rank: int, x: torch.Tensor, what: str) -> torch.Tensor:
    """Rank 1's x of another hidden size (``"hidden"``) or dtype (``"dtype"``); rank 0's as it is."""
    if rank != 1:
        return x
    return x[:, :ODD_HIDDEN].contiguous() if what == "hidden" else x.float()


def _raises_at_once(match: str, call) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        call()
    took = time.monotonic() - start
    assert took < 5.0, f"{match!r} raised after {took:.1f} s: not inside the agreement, but after a timeout"


def _shim_normal(rank: int, world: int, num_experts: int) -> None:
    x, ids, weights = _inputs(rank, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 1 << 20, 0)
    buffer.timeout = 10.0  # its agreement's and its EPBuffers' waits
    layout = buffer.get_dispatch_layout(ids, num_experts)

    def dispatch(rows):
        return buffer.dispatch(rows, None, layout[0], None, layout[3], layout[2], ids, weights)

    _raises_at_once(HIDDEN_DIFFERS, lambda: dispatch(_odd(rank, x, "hidden")))  # before any buffer exists
    recv, recv_ids, recv_w, counts, handle, _ = dispatch(x)  # the Buffer goes on
    _raises_at_once(HIDDEN_DIFFERS, lambda: dispatch(_odd(rank, x, "hidden")))  # rank 1 alone would need a buffer
    _raises_at_once(DTYPE_DIFFERS, lambda: dispatch(_odd(rank, x, "dtype")))
    again = dispatch(x)
    assert torch.equal(again[0], recv) and again[3] == counts, "the dispatch after the rejected ones"
    combined, _, _ = buffer.combine(again[0], again[4])
    assert combined.shape == x.shape


def _shim_low_latency(rank: int, world: int, num_experts: int) -> None:
    x, ids, weights = _inputs(rank, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, 1 << 22, low_latency_mode=True)
    buffer.timeout = 10.0

    def dispatch(rows):
        return buffer.low_latency_dispatch(rows, ids, MAX_TOKENS, num_experts, use_fp8=False)

    _raises_at_once(HIDDEN_DIFFERS, lambda: dispatch(_odd(rank, x, "hidden")))  # before any buffer exists
    recv_x, count, *_ = dispatch(x)
    recv_x, count = recv_x.clone(), count.clone()
    _raises_at_once(HIDDEN_DIFFERS, lambda: dispatch(_odd(rank, x, "hidden")))  # rank 1 alone would need a buffer
    _raises_at_once(DTYPE_DIFFERS, lambda: dispatch(_odd(rank, x, "dtype")))
    _raises_at_once(  # a larger capacity on one rank would also make a buffer there alone
        r"num_max_dispatch_tokens_per_rank: rank 0 has 8, rank 1 has 16",
        lambda: buffer.low_latency_dispatch(x, ids, MAX_TOKENS * (1 + rank), num_experts, use_fp8=False),
    )
    _raises_at_once(  # a check of one rank's own arguments: every rank learns of it in the agreement
        r"rejected on every rank before any row moved: rank 1: .*num_max_dispatch_tokens_per_rank must be a positive "
        r"int, got 0",
        lambda: buffer.low_latency_dispatch(x, ids, MAX_TOKENS * (rank == 0), num_experts, use_fp8=False),
    )
    again, again_count, handle, _, _ = dispatch(x)
    assert torch.equal(again_count, count), "the low-latency dispatch after the rejected ones"
    for e, n in enumerate(count.tolist()):
        assert torch.equal(again[e, :n], recv_x[e, :n]), f"expert {e}"
    combined, _, _ = buffer.low_latency_combine(again, ids, weights, handle)
    assert combined.shape == x.shape


def _native(rank: int, world: int, num_experts: int) -> None:
    x, ids, weights = _inputs(rank, num_experts)
    buf = EPBuffer(dist.group.WORLD, HIDDEN, num_experts, MAX_TOKENS, TOPK, timeout=10.0)
    _raises_at_once(
        rf"rank 1: x must be \[num_tokens, {HIDDEN}\], got \({TOKENS}, {ODD_HIDDEN}\)",
        lambda: buf.dispatch(_odd(rank, x, "hidden"), ids, weights),
    )
    _raises_at_once(
        r"rows \(x\) differ in format across ranks \(rank 0: torch.bfloat16; rank 1: torch.float32\)",
        lambda: buf.dispatch(_odd(rank, x, "dtype"), ids, weights),
    )
    recv, *_, handle = buf.dispatch(x, ids, weights)
    assert buf.combine(recv, handle).shape == x.shape
    for what, got in (("hidden", rf"torch.bfloat16 \({TOKENS}, {ODD_HIDDEN}\)"), ("dtype", r"torch.float32")):
        _raises_at_once(
            rf"rank 1: x must be bfloat16 \[num_tokens, {HIDDEN}\], got {got}",
            lambda what=what: buf.low_latency_dispatch(_odd(rank, x, what), ids, MAX_TOKENS, use_fp8=False),
        )
    _, count, _, _ = buf.low_latency_dispatch(x, ids, MAX_TOKENS, use_fp8=False)
    assert int(count.sum()) > 0 or world == 1
    buf.close()


def _divergent(rank: int, world: int) -> str:
    num_experts = 4 * world
    _shim_normal(rank, world, num_experts)
    _shim_low_latency(rank, world, num_experts)
    _native(rank, world, num_experts)
    return "ok"


def test_a_call_that_differs_across_ranks_is_a_value_error_on_every_rank_at_once():
    # every wait in it has 10 s (the Buffers' and EPBuffer's timeout): a regression that waits instead of agreeing
    # fails by _raises_at_once's 5 s bound or by a rank's TimeoutError, within run_ranks' limit, never hangs
    assert run_ranks(_divergent, 2, timeout=60) == ["ok", "ok"]


def test_describe_differences_names_each_argument_and_the_ranks_by_value():
    fields = [("x hidden size", False), ("x dtype", True)]
    rows = [[64, 0], [128, 0], [64, 2], [-1, -1]]  # rank 3's values unknown (its call was rejected before)
    assert describe_differences(fields, rows) == "x hidden size: ranks 0, 2 have 64, rank 1 has 128; x dtype: " + (
        "ranks 0, 1 have torch.bfloat16, rank 2 has torch.float32"
    )
    assert describe_differences(fields, [[64, 0], [64, 0]]) is None
