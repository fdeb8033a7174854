"""DeepEP's shrink mode through ``epkit.compat.deep_ep``: ``Buffer(..., enable_shrink=True)`` and the low-latency mask
buffer (``low_latency_update_mask_buffer`` / ``query`` / ``clean``).

A rank that stops calling (alive: it waits in the job's final barrier) is masked by the others after the Buffer's
timeout, at the same call on every survivor; from then on their dispatch receives nothing from it and their combine
sums no term of its experts. The results are compared with references built here from every rank's inputs (each
rank can draw any rank's), with the masked ranks' routing and experts left out. Without ``enable_shrink`` a silent
rank stays a TimeoutError naming it. The meeting itself (``RankMask``): a rank slow inside a call that the others
mask by hand at the next still gets that call's result; one that comes to a call the others left behind raises.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import epkit.compat.deep_ep as deep_ep
from epkit.compat._details.deep_ep_shrink import RankMask
from epkit.testing.multiprocess import run_ranks

HIDDEN, TOPK, TOKENS, N_MAX = 128, 2, 6, 8
WORLD, SILENT, BY_HAND = 4, 3, 2
EXPERTS = 2 * WORLD
#: The Buffer's timeout: a live survivor later than this to a meeting is masked too (shrink mode's rule), so it must
#: exceed what a loaded 2-core CI machine can delay one of four rank processes by (1.5 s did not, once).
TIMEOUT = 3.0


def _inputs(rank: int, step: int):
    """Rank ``rank``'s ``(x [TOKENS, HIDDEN] bf16, topk_idx [TOKENS, TOPK] int64, some -1, weights)`` at ``step``."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(TOKENS)])
    ids[1, 0] = -1
    return x, ids, torch.rand(TOKENS, TOPK, generator=g)


def _expected_rows(rank: int, step: int, masked: set[int]) -> list[torch.Tensor]:
    """Per local expert of ``rank``: the rows it must receive (sources ascending, then tokens), none of ``masked``."""
    local = EXPERTS // WORLD
    rows: list[list[torch.Tensor]] = [[] for _ in range(local)]
    for src in range(WORLD):
        if src in masked:
            continue
        x, ids, _ = _inputs(src, step)
        for e in range(local):
            hit = (ids == rank * local + e).any(1)
            rows[e].append(x[hit])
    return [torch.cat(r) for r in rows]


def _expected_combine(rank: int, step: int, masked: set[int]) -> torch.Tensor:
    """The combine of expert outputs ``2 * x`` with ``rank``'s weights, float32 k ascending, masked ranks' experts
    (and -1) adding nothing."""
    x, ids, w = _inputs(rank, step)
    acc = torch.zeros(TOKENS, HIDDEN)
    for k in range(TOPK):
        live = (ids[:, k] >= 0) & ~torch.isin(ids[:, k] // (EXPERTS // WORLD), torch.tensor(sorted(masked) or [-1]))
        acc += torch.where(live[:, None], w[:, k : k + 1] * (2 * x.float()), 0.0)
    return acc.bfloat16()


def _round(buffer, rank: int, step: int, masked: set[int]) -> float:
    """One dispatch + combine checked against the references; its seconds."""
    x, ids, w = _inputs(rank, step)
    start = time.monotonic()
    recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, ids, N_MAX, EXPERTS, use_fp8=False)
    want = _expected_rows(rank, step, masked)
    assert count.tolist() == [r.shape[0] for r in want], (rank, step, count, masked)
    for e, rows in enumerate(want):
        assert torch.equal(recv_x[e, : rows.shape[0]], rows), (rank, step, e)
    y = (recv_x.float() * 2).bfloat16()
    combined, _, _ = buffer.low_latency_combine(y, ids, w, handle)
    assert torch.equal(combined, _expected_combine(rank, step, masked)), (rank, step, masked)
    return time.monotonic() - start


def _query(buffer) -> set[int]:
    status = torch.full((WORLD,), 7, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(status)
    return set(status.nonzero().view(-1).tolist())


def _shrink(rank: int, world: int) -> dict[str, float]:
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, 1 << 20, low_latency_mode=True, enable_shrink=True)
    buffer.timeout = TIMEOUT
    assert buffer.enable_shrink and _query(buffer) == set()
    took: dict[str, float] = {"all": _round(buffer, rank, 0, set())}
    if rank != SILENT:
        took["silent masked"] = _round(buffer, rank, 1, {SILENT})  # waits out the timeout once
        assert _query(buffer) == {SILENT}
        took["after"] = _round(buffer, rank, 2, {SILENT})  # no wait for it any more
        # a call that differs on one rank: the same ValueError on the survivors, naming only them
        with pytest.raises(ValueError, match=r"rejected on every rank.*hidden: rank 0 has 0, ranks 1, 2 have 128\)"):
            buffer.clean_low_latency_buffer(N_MAX, HIDDEN if rank else 0, EXPERTS)
        buffer.low_latency_clean_mask_buffer()  # every survivor: the next call waits for it again
        assert _query(buffer) == set()
        buffer.clean_low_latency_buffer(N_MAX, HIDDEN, EXPERTS)  # masks it again, after the timeout
        assert _query(buffer) == {SILENT}
    if rank not in (SILENT, BY_HAND):
        buffer.low_latency_update_mask_buffer(BY_HAND, True)  # the last survivors leave a live rank out by hand
        assert _query(buffer) == {SILENT, BY_HAND}
        took["by hand"] = _round(buffer, rank, 3, {SILENT, BY_HAND})
        buffer.low_latency_update_mask_buffer(BY_HAND, False)
        assert _query(buffer) == {SILENT}
    dist.barrier()  # the silent rank is alive throughout: it waits here
    return took


def test_a_rank_that_stops_calling_is_masked_and_the_survivors_results_leave_its_experts_out():
    results = run_ranks(_shrink, WORLD, timeout=120)
    for rank, took in enumerate(results):
        if rank != SILENT:
            assert took["silent masked"] >= TIMEOUT * 0.9, (rank, took)  # masked by the timeout, not before
            assert took["after"] < TIMEOUT, (rank, took)
        if rank not in (SILENT, BY_HAND):
            assert took["by hand"] < TIMEOUT, (rank, took)


def _without_shrink(rank: int, world: int) -> str:
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, 1 << 20, low_latency_mode=True)
    buffer.timeout = 3.0  # the survivors note their wait after a second: only the silent rank is named
    with pytest.raises(RuntimeError, match="enable_shrink"):
        buffer.low_latency_query_mask_buffer(torch.zeros(world, dtype=torch.int32))
    _round(buffer, rank, 0, set())
    text = ""
    if rank != SILENT:
        with pytest.raises(TimeoutError) as info:
            buffer.low_latency_dispatch(*_inputs(rank, 1)[:2], N_MAX, EXPERTS, use_fp8=False)
        text = str(info.value)
    _hold(rank)  # not dist.barrier: the survivors' timed-out all-gather is still pending in the group
    return text


def _hold(rank: int) -> None:
    """The silent rank stays alive until the others are done (through the job's store: no collective)."""
    store = dist.distributed_c10d._get_default_store()
    if rank != SILENT:
        store.set(f"shrink-test-done/{rank}", "1")
    else:
        store.wait([f"shrink-test-done/{r}" for r in range(WORLD) if r != SILENT], timedelta(seconds=60))


def test_without_enable_shrink_a_silent_rank_is_a_timeout_naming_it():
    texts = run_ranks(_without_shrink, WORLD, timeout=60)
    for rank, text in enumerate(texts):
        assert rank == SILENT or (f"rank {SILENT}" in text and "did not come" in text), text


LATE = 2


def _comes_late(rank: int, world: int) -> float:
    mask = RankMask(dist.group.WORLD, rank, world, list(range(world)))
    assert mask.exchange(bytes([rank]), "call", 30.0) == {r: bytes([r]) for r in range(world)}
    store = dist.distributed_c10d._get_default_store()
    took = 0.0
    if rank == LATE:  # comes to call 2 only once the others are past call 3
        store.wait([f"shrink-late/{r}" for r in range(world) if r != LATE], timedelta(seconds=60))
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=f"rank {LATE}: call: the other ranks masked this rank"):
            mask.exchange(b"late", "call", 30.0)
        took = time.monotonic() - start
    else:
        assert mask.exchange(b"2", "call", 1.0) == {r: b"2" for r in range(world) if r != LATE}  # masked after 1 s
        assert mask.masked == {LATE}
        for _ in range(2):  # calls 3 and 4 wait for nobody
            assert mask.exchange(b"3", "call", 30.0).keys() == {r for r in range(world) if r != LATE}
        store.set(f"shrink-late/{rank}", "1")
    dist.barrier()
    return took


def test_a_rank_that_comes_after_the_others_went_on_finds_itself_masked_at_once():
    """The store's entries of a call are overwritten two calls later: a masked rank that comes late to that call
    reads the later entries (raises at once), never waits for entries that are gone, never decides alone."""
    took = run_ranks(_comes_late, 3, timeout=60)
    assert took[LATE] < 5.0, took


def _slow_reader(rank: int, world: int) -> tuple[dict[int, bytes], ...]:
    mask = RankMask(dist.group.WORLD, rank, world, list(range(world)))
    mask.exchange(b"1", "call", 30.0)
    if rank == LATE:  # posts call 2's row, then stops 1.5 s before reading the others'
        read = mask._read

        def slow(*args):
            time.sleep(1.5)
            mask._read = read
            return read(*args)

        mask._read = slow  # type: ignore[method-assign]
        got = (mask.exchange(b"2", "call", 30.0),)
    else:
        got = (mask.exchange(b"2", "call", 30.0),)
        mask.update(LATE, True)  # calls 3 and 4 leave it out: call 4 overwrites call 2's entries once it read them
        got += tuple(mask.exchange(b"x", "call", 30.0) for _ in range(2))
    dist.barrier()
    return got


def test_a_rank_masked_by_hand_at_the_next_call_still_gets_this_calls_result():
    """A rank still reading call 2 when the others, who mask it by hand at call 3, are at call 4: its result."""
    got = run_ranks(_slow_reader, 3, timeout=60)
    every = {r: b"2" for r in range(3)}
    assert got[LATE] == (every,)
    assert got[0] == got[1] == (every, {0: b"x", 1: b"x"}, {0: b"x", 1: b"x"})
