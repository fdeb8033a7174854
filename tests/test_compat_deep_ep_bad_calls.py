"""One bad call on one rank through ``epkit.compat.deep_ep`` (the legacy ``Buffer`` and V2's ``ElasticBuffer``) is
the same ``ValueError`` on every rank, at once (inside the call's agreement, before any row moves), and the buffer
goes on: the next good calls return the same rows as before, bit for bit. Issue 39: the shim checked its combine,
cached-dispatch and low-latency-combine arguments on the calling rank only, so one rank raised while its peers
entered the exchange (30 s timeouts, retired buffers, or a later call paired with stale messages and returned wrong
rows); a bad low-latency ``y`` retired EPBuffer itself after rows had moved.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import epkit.compat.deep_ep as deep_ep
from epkit.testing.multiprocess import run_ranks

HIDDEN, TOPK, TOKENS, N_MAX = 128, 2, 6, 8
#: The rank that makes each bad call (the other passes good arguments).
BAD = 1


def _inputs(rank: int, num_experts: int):
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(TOKENS)])
    return x, ids, torch.rand(TOKENS, TOPK, generator=g)


def _same_error_at_once(rank: int, call) -> str:
    """Run ``call``, which must raise ValueError within the agreement (not after a timeout); its text."""
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        call()
    took = time.monotonic() - start
    assert took < 5.0, f"rank {rank}: raised after {took:.1f} s: not inside the agreement ({info.value})"
    return str(info.value)


def _normal(rank: int, world: int) -> dict[str, str]:
    num_experts = 4 * world
    x, ids, weights = _inputs(rank, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 1 << 20, 0)
    buffer.timeout = 10.0
    layout = buffer.get_dispatch_layout(ids, num_experts)

    def dispatch(**kw):
        return buffer.dispatch(x, None, layout[0], None, layout[3], layout[2], ids, weights, **kw)

    recv, _, recv_w, counts, handle, _ = dispatch()
    y = recv * 2
    combined, _, _ = buffer.combine(y, handle)
    cached = buffer.dispatch(x, handle)[0]
    first = dispatch()  # a second dispatch: its handle is current, the first one's stale
    bad = rank == BAD

    def other(value, good):
        return value if bad else good

    kinds = {
        "dispatch previous_event": lambda: dispatch(previous_event=other("event", None)),
        "dispatch config": lambda: dispatch(config=other(7, None)),
        "dispatch num_worst_tokens": lambda: dispatch(num_worst_tokens=other(-1, 0)),
        "dispatch num_worst_tokens too small": lambda: dispatch(num_worst_tokens=1),  # every rank: found in the routes
        "cached dispatch foreign handle": lambda: buffer.dispatch(x, other(object(), first[4])),
        "cached dispatch stale handle": lambda: buffer.dispatch(x, other(handle, first[4])),
        "cached dispatch with topk_idx": lambda: buffer.dispatch(x, first[4], topk_idx=other(ids, None)),
        "combine short rows": lambda: buffer.combine(other(first[0][:-1], first[0]), first[4]),
        "combine 3-tuple bias": lambda: buffer.combine(first[0], first[4], bias=other((x, x, x), None)),
        "combine foreign handle": lambda: buffer.combine(first[0], other(("not", "a handle"), first[4])),
        "combine stale handle": lambda: buffer.combine(first[0], other(handle, first[4])),
        "combine topk_weights shape": lambda: buffer.combine(
            first[0], first[4], topk_weights=other(first[2][:, :1], first[2])
        ),
        "combine topk_weights on one rank": lambda: buffer.combine(
            first[0], first[4], topk_weights=other(first[2], None)
        ),
        "combine x dtype": lambda: buffer.combine(other(first[0].float(), first[0]), first[4]),
    }
    texts = {name: _same_error_at_once(rank, call) for name, call in kinds.items()}
    # the Buffer goes on, and its calls pair as before: the same rows, bit for bit
    again = dispatch()
    assert torch.equal(again[0], recv) and torch.equal(again[2], recv_w) and again[3] == counts
    assert torch.equal(buffer.combine(again[0] * 2, again[4])[0], combined)
    assert torch.equal(buffer.dispatch(x, again[4])[0], cached)
    return texts


def _low_latency(rank: int, world: int) -> dict[str, str]:
    num_experts = 4 * world
    x, ids, weights = _inputs(rank, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, 1 << 22, low_latency_mode=True)
    buffer.timeout = 10.0

    def dispatch(**kw):
        return buffer.low_latency_dispatch(x, ids, N_MAX, num_experts, use_fp8=False, **kw)

    recv, count, handle, _, _ = dispatch()
    recv, count = recv.clone(), count.clone()
    combined = buffer.low_latency_combine(recv, ids, weights, handle)[0].clone()
    bad = rank == BAD

    def other(value, good):
        return value if bad else good

    kinds = {
        "low_latency_dispatch float32 x": lambda: buffer.low_latency_dispatch(
            other(x.float(), x), ids, N_MAX, num_experts, use_fp8=False
        ),
        "low_latency_dispatch flags": lambda: dispatch(async_finish=other(True, False), return_recv_hook=bad),
        "low_latency_combine x shape": lambda: buffer.low_latency_combine(
            other(recv[:, :-1], recv), ids, weights, handle
        ),
        "low_latency_combine x dtype": lambda: buffer.low_latency_combine(
            other(recv.float(), recv), ids, weights, handle
        ),
        "low_latency_combine foreign handle": lambda: buffer.low_latency_combine(
            recv, ids, weights, other(object(), handle)
        ),
        "low_latency_combine weights shape": lambda: buffer.low_latency_combine(
            recv, ids, other(weights[:, :1], weights), handle
        ),
        "low_latency_combine out shape": lambda: buffer.low_latency_combine(
            recv, ids, weights, handle, out=other(torch.empty(TOKENS + 1, HIDDEN, dtype=torch.bfloat16), None)
        ),
        "low_latency_combine flags": lambda: buffer.low_latency_combine(
            recv, ids, weights, handle, combine_wait_recv_cost_stats=other(torch.zeros(2, 2, dtype=torch.int64), None)
        ),
    }
    texts = {name: _same_error_at_once(rank, call) for name, call in kinds.items()}
    # int32 ids on one rank, int64 on the other: both DeepEP's kinds, one exchange
    again, again_count, again_handle, _, _ = buffer.low_latency_dispatch(
        x, other(ids.int(), ids), N_MAX, num_experts, use_fp8=False
    )
    assert torch.equal(again_count, count)
    for e, n in enumerate(count.tolist()):
        assert torch.equal(again[e, :n], recv[e, :n]), f"expert {e} after the rejected calls"
    assert torch.equal(buffer.low_latency_combine(again, ids, weights, again_handle)[0], combined)
    return texts


def _elastic(rank: int, world: int) -> dict[str, str]:
    num_experts = 4 * world
    x, ids, weights = _inputs(rank, num_experts)
    buffer = deep_ep.ElasticBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=N_MAX, hidden=HIDDEN, num_cpu_timeout_secs=10
    )

    def dispatch(**kw):
        return buffer.dispatch(x, ids, weights, num_experts=num_experts, **kw)

    recv, recv_idx, recv_w, handle, _ = dispatch()
    combined = buffer.combine(recv, handle, topk_weights=recv_w)[0]
    bad = rank == BAD

    def other(value, good):
        return value if bad else good

    kinds = {
        "elastic dispatch float32 x": lambda: buffer.dispatch(
            other(x.float(), x), ids, weights, num_experts=num_experts
        ),
        "elastic dispatch scales dtype": lambda: buffer.dispatch(
            (x.float().to(torch.float8_e4m3fn), torch.ones(TOKENS, 1, dtype=other(torch.float64, torch.float32))),
            ids,
            weights,
            num_experts=num_experts,
        ),
        "elastic dispatch ids out of range": lambda: buffer.dispatch(
            x, other(ids + num_experts, ids), weights, num_experts=num_experts
        ),
        "elastic dispatch too many tokens": lambda: dispatch(num_max_tokens_per_rank=other(1, N_MAX)),
        "elastic cached dispatch with topk_idx": lambda: buffer.dispatch(x, other(ids, None), handle=handle),
        "elastic cached dispatch foreign handle": lambda: buffer.dispatch(x, handle=other(object(), handle)),
        "elastic combine short x": lambda: buffer.combine(other(recv[:-1], recv), handle),
        "elastic combine foreign handle": lambda: buffer.combine(recv, other(("not", "a handle"), handle)),
        "elastic combine 3-tuple bias": lambda: buffer.combine(recv, handle, bias=other((x, x, x), None)),
        "elastic combine weights shape": lambda: buffer.combine(
            recv, handle, topk_weights=other(recv_w[:, :1], recv_w)
        ),
    }
    texts = {name: _same_error_at_once(rank, call) for name, call in kinds.items()}
    again = dispatch()
    assert torch.equal(again[0], recv) and torch.equal(
        buffer.combine(again[0], again[3], topk_weights=again[2])[0], combined
    )
    return texts


def _both(rank: int, world: int) -> dict[str, str]:
    return {**_normal(rank, world), **_low_latency(rank, world), **_elastic(rank, world)}


def test_one_bad_call_on_one_rank_is_the_same_value_error_on_every_rank_and_the_buffer_goes_on():
    # every wait has 10 s (the Buffers' timeout): a regression that waits instead of agreeing fails by the 5 s
    # bound above or a TimeoutError, within run_ranks' limit; it never hangs
    results = run_ranks(_both, 2, timeout=120)
    assert results[0].keys() == results[1].keys()
    for kind in results[0]:
        assert results[0][kind] == results[1][kind], f"{kind}: the ranks raised different errors"
        assert f"rank {BAD}" in results[0][kind], f"{kind}: the error does not name rank {BAD}: {results[0][kind]}"
