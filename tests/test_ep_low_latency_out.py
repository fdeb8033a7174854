"""The low-latency calls' receive tensors: caller-provided (``out=``) or reused from the buffer's pool, never while
the caller still holds them (``collectives/ep/ll_out.py``), on 2 CPU ranks, bit for bit against
the textbook exchange."""

import pytest
import torch
import torch.distributed as dist

from epkit.collectives.ep_buffer import EPBuffer
from epkit.collectives.ep_reference import reference_low_latency_combine, reference_low_latency_dispatch
from epkit.testing import assert_bitwise_equal
from epkit.testing.multiprocess import run_ranks

HIDDEN, EXPERTS, TOPK, N_MAX = 256, 16, 4, 8


def _inputs(rank, seed, num_tokens=6):
    g = torch.Generator().manual_seed(10 * seed + rank)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(num_tokens)])
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(torch.bfloat16)
    return x, idx, torch.rand(num_tokens, TOPK, generator=g)


def _parts(recv_x):
    return list(recv_x) if isinstance(recv_x, tuple) else [recv_x]


def _same_bits(kept, now):
    bits = [(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) for a, b in zip(kept, now)]
    return all(torch.equal(a, b) for a, b in bits)


def _check(recv_x, recv_count, x, idx, use_fp8, what):
    """The received rows against the reference (collective: every rank runs it)."""
    ref = reference_low_latency_dispatch(x, idx, N_MAX, EXPERTS, use_fp8=use_fp8)
    assert recv_count.tolist() == ref["counts"], what
    for e, c in enumerate(ref["counts"]):
        assert_bitwise_equal(_parts(recv_x)[0][e, :c], ref["recv_x"][e], f"{what} expert {e}")
        if use_fp8:
            assert_bitwise_equal(recv_x[1][e, :c], ref["recv_scales"][e], f"{what} expert {e} scales")
    return ref


def _dispatch_pool(rank, world_size, use_fp8, portable):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport="shm", timeout=20, portable=portable)

    def call(seed):
        x, idx, _ = _inputs(rank, seed)
        recv_x, recv_count, _, _ = buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=use_fp8)
        _check(recv_x, recv_count, x, idx, use_fp8, f"{rank=} call {seed}")
        return recv_x, recv_count

    first, first_count = call(0)
    ptrs = [t.data_ptr() for t in _parts(first)]
    del first, first_count  # dropped: the next call may write into the same memory
    second, second_count = call(1)
    reused = [t.data_ptr() for t in _parts(second)] == ptrs
    kept = [t.clone() for t in _parts(second)] + [second_count.clone()]
    third, third_count = call(2)  # the caller still holds the second result: never overwritten
    fresh = all(a.data_ptr() != b.data_ptr() for a, b in zip(_parts(third), _parts(second)))
    fresh = fresh and third_count.data_ptr() != second_count.data_ptr()
    unchanged = _same_bits(kept, _parts(second))
    unchanged = unchanged and torch.equal(kept[-1], second_count)
    third_x = _parts(third)[0].data_ptr()
    view = _parts(second)[0][1:3]  # a view alone keeps its tensor's memory too
    del second, second_count, third, third_count
    fourth = _parts(call(3)[0])[0].data_ptr()
    by_view = fourth == third_x and torch.equal(view, kept[0][1:3])  # the free one, not the viewed one
    buf.close()
    return reused, fresh, unchanged, by_view


@pytest.mark.parametrize("portable", [False, True], ids=["host-checked", "stream-ordered"])
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_dispatch_reuses_a_dropped_receive_tensor_and_never_a_held_one(use_fp8, portable):
    res = run_ranks(_dispatch_pool, 2, use_fp8, portable, timeout=120)
    assert res == [(True, True, True, True)] * 2, res


def _dispatch_out(rank, world_size, use_fp8):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport="shm", timeout=20)
    L, slots = EXPERTS // world_size, N_MAX * world_size
    x, idx, _ = _inputs(rank, 0)
    dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
    mine = torch.full((L, slots, HIDDEN), 3.0, dtype=torch.bfloat16).to(dtype)
    out = (mine, torch.full((L, slots, HIDDEN // 128), 7.0)) if use_fp8 else mine
    recv_x, recv_count, _, _ = buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=use_fp8, out=out)
    given = all(a is b for a, b in zip(_parts(recv_x), _parts(out)))
    _check(recv_x, recv_count, x, idx, use_fp8, f"{rank=} out=")
    # rank 0 alone passes a receive tensor of the wrong shape: every rank raises the same ValueError
    bad = mine[:, :-1]
    wrong = (bad, out[1]) if use_fp8 else bad
    with pytest.raises(ValueError) as err:
        buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=use_fp8, out=wrong if rank == 0 else out)
    # and the buffer goes on
    x2, idx2, _ = _inputs(rank, 1)
    again = buf.low_latency_dispatch(x2, idx2, N_MAX, use_fp8=use_fp8, out=out)
    _check(again[0], again[1], x2, idx2, use_fp8, f"{rank=} after the rejected call")
    buf.close()
    return given, str(err.value)


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_dispatch_writes_into_out_and_a_wrong_out_fails_on_every_rank(use_fp8):
    res = run_ranks(_dispatch_out, 2, use_fp8, timeout=90)
    assert [given for given, _ in res] == [True, True], res
    assert res[0][1] == res[1][1], res  # the same error on every rank
    name = "out[0]" if use_fp8 else "out"
    dtype = "torch.float8_e4m3fn" if use_fp8 else "torch.bfloat16"
    want = f"low-latency dispatch rejected on every rank: rank 0: {name} must be {dtype} (8, 16, 256)"
    assert res[0][1].startswith(want), res[0][1]
    assert "(8, 15, 256)" in res[0][1], res[0][1]


def _dispatch_out_checks(rank, world_size):
    """Each kind of bad ``out`` names what is wrong (rank 1 passes the good one: the error still reaches it)."""
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport="shm", timeout=20)
    L, slots = EXPERTS // world_size, N_MAX * world_size
    x, idx, _ = _inputs(rank, 0)
    good_x = torch.zeros((L, slots, HIDDEN), dtype=torch.float8_e4m3fn)
    good_s = torch.zeros((L, slots, HIDDEN // 128))
    cases = [
        (good_x, "out must be a tuple (x, scales)"),
        ((good_x, good_s.double()), "out[1] must be torch.float32 (8, 16, 2)"),
        ((good_x, good_s.transpose(1, 2).contiguous().transpose(1, 2)), "out[1] must be contiguous"),
        ((good_x.view(torch.uint8), good_s), "out[0] must be torch.float8_e4m3fn (8, 16, 256)"),
    ]
    seen = []
    for bad, _ in cases:
        with pytest.raises(ValueError) as err:
            buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=True, out=bad if rank == 0 else (good_x, good_s))
        seen.append(str(err.value))
    with pytest.raises(ValueError) as err:  # bf16: one tensor
        buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=False, out=(good_x, good_s) if rank == 0 else None)
    seen.append(str(err.value))
    buf.close()
    return seen, [match for _, match in cases] + ["out must be torch.bfloat16 (8, 16, 256)"]


def test_each_bad_dispatch_out_is_named():
    res = run_ranks(_dispatch_out_checks, 2, timeout=90)
    assert res[0][0] == res[1][0], res
    for got, want in zip(*res[0]):
        assert f"rank 0: {want}" in got, (got, want)


def _combine_out(rank, world_size):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, N_MAX, TOPK, transport="shm", timeout=20)

    def combine(seed, **kwargs):
        x, idx, wts = _inputs(rank, seed)
        recv_x, recv_count, handle, _ = buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=False)
        ref = _check(recv_x, recv_count, x, idx, False, f"{rank=} dispatch {seed}")
        y = (recv_x.float() * 2 - 1).to(torch.bfloat16)
        out = buf.low_latency_combine(y, idx, wts, handle, **kwargs)
        per_expert = [y[e, :c] for e, c in enumerate(ref["counts"])]
        assert_bitwise_equal(out, reference_low_latency_combine(per_expert, idx, wts, ref), f"{rank=} combine {seed}")
        return out

    first = combine(0)
    ptr = first.data_ptr()
    del first
    second = combine(1)
    reused = second.data_ptr() == ptr
    kept = second.clone()
    third = combine(2)
    fresh = third.data_ptr() != second.data_ptr() and torch.equal(second, kept)
    mine = torch.full((6, HIDDEN), 5.0, dtype=torch.bfloat16)
    given = combine(3, out=mine) is mine
    x, idx, wts = _inputs(rank, 4)
    recv_x, _, handle, _ = buf.low_latency_dispatch(x, idx, N_MAX, use_fp8=False)
    # rank 0 alone passes a wrong out: found before any row moves; rank 0 sends its rejection instead of rows, so
    # every rank raises the same ValueError in this call and the buffer goes on
    try:
        buf.low_latency_combine(recv_x, idx, wts, handle, out=mine[:5] if rank == 0 else mine)
        error = "none"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    again = combine(4)  # usable after the rejection
    buf.close()
    return reused, fresh, given, error, again.shape


def test_combine_reuses_a_dropped_output_writes_into_out_and_names_a_wrong_one():
    res = run_ranks(_combine_out, 2, timeout=90)
    assert [r[:3] for r in res] == [(True, True, True)] * 2, res
    assert res[0][3] == res[1][3], res  # the same error on both ranks
    assert res[0][3].startswith(
        "ValueError: low-latency combine rejected on every rank before any row was summed: rank 0: out must be "
        "torch.bfloat16 (6, 256)"
    ), res[0][3]
    assert res[0][3].endswith("got torch.bfloat16 (5, 256) on cpu"), res[0][3]
    assert [r[4] for r in res] == [(6, HIDDEN)] * 2, res


def _deep_ep_shim(rank, world_size, use_fp8):
    """DeepEP's low_latency_dispatch over EPBuffer's pooled receive tensors (no copy of the rows): a held result is
    never written again, a dropped one's memory is; low_latency_combine writes into the caller's ``out``."""
    import epkit.compat.deep_ep as deep_ep

    buffer = deep_ep.Buffer(dist.group.WORLD, 0, 1 << 24, low_latency_mode=True, explicitly_destroy=True)
    local, slots = EXPERTS // world_size, N_MAX * world_size

    def call(seed):
        x, idx, wts = _inputs(rank, seed)
        recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, N_MAX, EXPERTS, use_fp8=use_fp8)
        ref = reference_low_latency_dispatch(x, idx, N_MAX, EXPERTS, use_fp8=use_fp8)
        rows, scales = recv_x if use_fp8 else (recv_x, None)
        assert count.tolist() == ref["counts"] and rows.shape == (local, slots, HIDDEN)
        if use_fp8:  # DeepEP's layout: column-major scales
            assert scales.shape == (local, slots, HIDDEN // 128) and scales.stride()[1:] == (1, slots)
        for e, c in enumerate(ref["counts"]):
            assert_bitwise_equal(rows[e, :c], ref["recv_x"][e], f"{rank=} call {seed} expert {e}")
            if use_fp8:
                assert_bitwise_equal(scales[e, :c], ref["recv_scales"][e], f"{rank=} call {seed} expert {e} scales")
        return recv_x, count, (idx, wts, handle, ref)

    first = call(0)
    ptr = _parts(first[0])[0].data_ptr()
    del first
    second = call(1)
    reused = _parts(second[0])[0].data_ptr() == ptr
    kept = [t.clone() for t in _parts(second[0])] + [second[1].clone()]
    third = call(2)
    fresh = _parts(third[0])[0].data_ptr() != _parts(second[0])[0].data_ptr()
    unchanged = _same_bits(kept, _parts(second[0]))
    unchanged = unchanged and torch.equal(kept[-1], second[1])
    # the combine of the held (second) dispatch into the caller's out: EPBuffer writes into it, no copy
    idx, wts, handle, ref = second[2]
    rows = _parts(second[0])[0].float()
    y = (rows * (second[0][1].repeat_interleave(128, -1) if use_fp8 else 1)).to(torch.bfloat16)
    mine = torch.empty((idx.shape[0], HIDDEN), dtype=torch.bfloat16)
    combined, _, _ = buffer.low_latency_combine(y, idx, wts, handle, out=mine)
    want = reference_low_latency_combine([y[e, :c] for e, c in enumerate(ref["counts"])], idx, wts, ref)
    assert_bitwise_equal(mine, want, f"{rank=} combine into out")
    with pytest.raises(ValueError, match=r"out must be torch.bfloat16 \(6, 256\) on cpu"):  # EPBuffer's check
        buffer.low_latency_combine(y, idx, wts, handle, out=mine.float())
    buffer.destroy()
    return reused, fresh, unchanged, combined is mine


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_deep_ep_low_latency_results_are_epbuffers_pooled_tensors(use_fp8):
    assert run_ranks(_deep_ep_shim, 2, use_fp8, timeout=90) == [(True, True, True, True)] * 2


@pytest.mark.parametrize(
    "holder",
    [
        lambda t: t,
        lambda t: t[1:],
        lambda t: t.view(torch.uint8),
        lambda t: t.data,
        lambda t: t.detach(),
        lambda t: t.untyped_storage(),
        lambda t: t.numpy(),
        lambda t: torch.utils.dlpack.to_dlpack(t),
    ],
    ids=["tensor", "view", "dtype-view", "data", "detach", "storage", "numpy", "dlpack"],
)
def test_pool_reuses_memory_only_once_nothing_outside_it_references_it(holder):
    from epkit.collectives.ep.ll_out import KEEP, take

    pool = {}
    first = take(pool, (4, 8), torch.float32, "cpu")
    addr = first.data_ptr()
    first.fill_(1.0)
    kept = holder(first)
    del first
    other = take(pool, (4, 8), torch.float32, "cpu")  # the first block is still referenced: never handed out
    assert other.data_ptr() != addr and not other.any()  # fresh memory is zeroed
    del kept
    again = take(pool, (4, 8), torch.float32, "cpu")
    assert again.data_ptr() == addr and bool((again == 1.0).all())  # nothing references it any more
    held = [take(pool, (4, 8), torch.float32, "cpu") for _ in range(KEEP + 1)]  # more held than the pool keeps
    assert len({t.data_ptr() for t in held + [again, other]}) == KEEP + 3
    (entries,) = pool.values()  # one key: one shape, dtype, device (and stream, mode) here
    assert len(entries) == KEEP


def test_pool_memory_made_in_inference_mode_stays_there():
    """A block made under ``torch.inference_mode`` is an inference tensor, which cannot be written outside it: the
    pool keys its blocks by the mode, so a call outside gets writable memory of its own."""
    from epkit.collectives.ep.ll_out import take

    pool: dict = {}
    with torch.inference_mode():
        inner = take(pool, (4, 8), torch.float32, "cpu")
        addr = inner.data_ptr()
        del inner
    outer = take(pool, (4, 8), torch.float32, "cpu")
    assert not outer.is_inference() and outer.data_ptr() != addr
    outer.copy_(torch.ones(4, 8))  # raised "Inplace update to inference tensor outside InferenceMode" before
    with torch.inference_mode():
        assert take(pool, (4, 8), torch.float32, "cpu").data_ptr() == addr
