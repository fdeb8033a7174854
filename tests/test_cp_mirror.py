import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epkit.backends import select
from epkit.cp_mirror import (
    SPEC,
    CPMirror,
    from_mirror,
    mirrors_equal,
    prepare_cp_mirror,
    prepare_cp_mirror_reference,
    random_batch,
    to_mirror,
)
from epkit.testing import assert_bitwise_equal, tilelang_compile_cuda
from epkit.testing.markers import requires_cuda, requires_nvcc, requires_tilelang, requires_triton

KERNEL_BACKENDS = [
    "cpu",
    pytest.param("tilelang", marks=requires_tilelang),
    pytest.param("triton", marks=requires_triton),
]
ALL_BACKENDS = ["reference", *KERNEL_BACKENDS]
RATIOS = (1, 4, 128)


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _batch(q_lens, prefixes):
    return _cu(q_lens), _cu([q + p for q, p in zip(q_lens, prefixes, strict=True)])


def _all_ranks(cu_q, cu_k, cp_size, ratios=RATIOS, backend="cpu"):
    return [prepare_cp_mirror(cu_q, cu_k, cp_size, r, ratios, backend=backend) for r in range(cp_size)]


def _ranks_to_test(backend, cp_size):
    """Every rank, except under the (slow) Triton interpreter: first, middle and last."""
    return sorted({0, cp_size // 2, cp_size - 1}) if backend == "triton" else range(cp_size)


def _check_properties(mirrors: list[CPMirror], cu_q, cu_k, ctx: str) -> None:
    """Properties every backend's output must have, checked against formulas computed here."""
    cp_size = len(mirrors)
    q_lens = (cu_q[1:] - cu_q[:-1]).tolist()
    k_lens = (cu_k[1:] - cu_k[:-1]).tolist()
    total_q = int(cu_q[-1])
    lens = {m.cp_mirror_len for m in mirrors}
    assert len(lens) == 1, f"{ctx}: cp_mirror_len differs across ranks: {lens}"
    L = lens.pop()
    want_len = sum(2 * (-(-q // (2 * cp_size))) for q in q_lens)
    assert want_len == L, f"{ctx}: cp_mirror_len {L} != {want_len}"
    # The reverse index inverts the all-gathered (rank-major) mirror index.
    gathered = torch.cat([m.mirror_cp_index for m in mirrors])
    reverse = mirrors[0].mirror_cp_reverse_index
    assert reverse.dtype == torch.int32 and reverse.shape == (total_q,), ctx
    assert torch.equal(gathered[reverse.long()], torch.arange(total_q, dtype=torch.int32)), ctx
    valid_tokens = gathered[gathered >= 0]
    assert torch.equal(valid_tokens.sort().values, torch.arange(total_q, dtype=torch.int32)), f"{ctx}: not a partition"
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens, dtype=torch.long))
    for m in mirrors:
        assert torch.equal(m.mirror_cp_reverse_index, reverse), f"{ctx}: reverse index differs on rank {m.cp_rank}"
        idx = m.mirror_cp_index
        pad = idx < 0
        slot_seq = torch.repeat_interleave(
            torch.arange(len(q_lens)), (m.cu_seqlens_q[1:] - m.cu_seqlens_q[:-1]).long(), output_size=L
        )
        for c in m.compress_ratios:
            ks, ke = m.ks[c], m.ke[c]
            assert torch.equal(ks[pad], ke[pad]), f"{ctx}: padding slots with ks != ke (rank {m.cp_rank}, {c=})"
            firsts = [0]
            for k in k_lens:
                firsts.append(firsts[-1] + k // c)
            assert torch.equal(ks.long(), torch.tensor(firsts)[slot_seq]), f"{ctx}: ks (rank {m.cp_rank}, {c=})"
            tok = idx[~pad].long()
            b = seq_of_token[tok]
            i = tok - cu_q.long()[b]
            want = (cu_k.long()[b + 1] - cu_k.long()[b] - cu_q.long()[b + 1] + cu_q.long()[b] + i + 1) // c
            assert torch.equal((ke - ks)[~pad].long(), want), f"{ctx}: ke - ks (rank {m.cp_rank}, {c=})"
        # Half-block metadata: valid queries first, bottom-right causal alignment reproduces ke at ratio 1.
        for h in range(2 * len(q_lens)):
            lo, hi = int(m.cu_seqlens_q_half[h]), int(m.cu_seqlens_q_half[h + 1])
            nq = int(m.seqlens_q_half[h])
            assert bool((idx[lo : lo + nq] >= 0).all()) and bool((idx[lo + nq : hi] < 0).all()), f"{ctx}: half {h}"
            seen = (m.ke[1] - m.ks[1])[lo : lo + nq] if 1 in m.ks else None
            if seen is not None:
                want = int(m.seqlens_k_half[h]) - nq + torch.arange(1, nq + 1, dtype=torch.int32)
                assert torch.equal(seen, want), f"{ctx}: seqlens_k_half[{h}] on rank {m.cp_rank}"


# The docstring's worked example, computed by hand.


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_worked_example_cp2(backend):
    cu_q = torch.tensor([0, 5, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 8, 10], dtype=torch.int32)
    m0, m1 = (prepare_cp_mirror(cu_q, cu_k, 2, r, (1, 4), backend=backend) for r in (0, 1))
    assert (m0.cp_mirror_len, m1.cp_mirror_len, m0.total_q) == (6, 6, 7)
    expect = {
        "mirror_cp_index": ([0, 1, -1, -1, 5, -1], [2, 3, 4, -1, 6, -1]),
        "mirror_cp_reverse_index": ([0, 1, 6, 7, 8, 4, 10],) * 2,
        "cu_seqlens_q": ([0, 4, 6],) * 2,
        "cu_seqlens_q_half": ([0, 2, 4, 5, 6],) * 2,
        "seqlens_q_half": ([2, 0, 1, 0], [2, 1, 1, 0]),
        "seqlens_k_half": ([5, 8, 1, 2], [7, 8, 2, 2]),
    }
    for name, (want0, want1) in expect.items():
        for m, want in ((m0, want0), (m1, want1)):
            got = getattr(m, name)
            assert got.dtype == torch.int32 and got.tolist() == want, f"{backend=} rank {m.cp_rank} {name}"
    assert m0.ks[1].tolist() == m1.ks[1].tolist() == [0, 0, 0, 0, 8, 8]
    assert m0.ke[1].tolist() == [4, 5, 0, 0, 9, 8] and m1.ke[1].tolist() == [6, 7, 8, 0, 10, 8]
    assert m0.ks[4].tolist() == m1.ks[4].tolist() == [0, 0, 0, 0, 2, 2]
    assert m0.ke[4].tolist() == [1, 1, 0, 0, 2, 2] and m1.ke[4].tolist() == [1, 1, 2, 0, 2, 2]


# Bit-exact against the reference.

EDGE_LENGTHS = [0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 100, 0, 257, 8192, 1]
EDGE_PREFIXES = [0, 5, 0, 3, 100, 0, 1, 0, 127, 128, 4, 0, 999, 7, 0, 300, 0]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("cp_size", [1, 2, 4, 8])
def test_bit_exact_edge_lengths(backend, cp_size):
    cu_q, cu_k = _batch(EDGE_LENGTHS, EDGE_PREFIXES)
    for r in _ranks_to_test(backend, cp_size):
        got = prepare_cp_mirror(cu_q, cu_k, cp_size, r, RATIOS, backend=backend)
        diff = mirrors_equal(got, prepare_cp_mirror_reference(cu_q, cu_k, cp_size, r, RATIOS))
        assert diff is None, f"{backend=} {cp_size=} rank {r}: {diff}"
    if backend != "triton":
        _check_properties(_all_ranks(cu_q, cu_k, cp_size, backend=backend), cu_q, cu_k, f"{backend=} {cp_size=}")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("cp_size", [2, 8])
def test_bit_exact_random_batch_int64_inputs(backend, cp_size):
    cu_q, cu_k = random_batch(9, 3000, 2000, seed=cp_size)
    for r in _ranks_to_test(backend, cp_size):
        got = prepare_cp_mirror(cu_q.long(), cu_k.long(), cp_size, r, (128, 1), backend=backend)
        diff = mirrors_equal(got, prepare_cp_mirror_reference(cu_q, cu_k, cp_size, r, (128, 1)))
        assert diff is None, f"{backend=} {cp_size=} rank {r}: {diff}"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("lengths", [[], [0], [0, 0, 0]], ids=["no-seqs", "one-empty", "all-empty"])
def test_empty_batches(backend, lengths):
    cu_q, cu_k = _batch(lengths, [3] * len(lengths))
    m = prepare_cp_mirror(cu_q, cu_k, 4, 1, RATIOS, backend=backend)
    assert m.cp_mirror_len == 0 and m.total_q == 0
    assert m.mirror_cp_index.shape == (0,) and m.mirror_cp_reverse_index.shape == (0,)
    assert all(m.ks[c].shape == (0,) and m.ke[c].shape == (0,) for c in RATIOS)
    assert m.cu_seqlens_q.tolist() == [0] * (len(lengths) + 1)
    assert m.seqlens_q_half.tolist() == [0] * (2 * len(lengths))
    assert m.seqlens_k_half.tolist() == [3] * (2 * len(lengths))


# Property tests over random batches.

_batches = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 200)), min_size=0, max_size=6)
_ratios = st.lists(st.sampled_from([1, 2, 3, 4, 128]), min_size=1, max_size=3, unique=True)


@given(batch=_batches, cp_size=st.sampled_from([1, 2, 3, 4, 8]), ratios=_ratios)
@settings(max_examples=60)
def test_property_cpu_and_reference(batch, cp_size, ratios):
    cu_q, cu_k = _batch([q for q, _ in batch], [p for _, p in batch])
    ctx = f"{batch=} {cp_size=} {ratios=}"
    mirrors = _all_ranks(cu_q, cu_k, cp_size, tuple(ratios), "cpu")
    for r, m in enumerate(mirrors):
        ref = prepare_cp_mirror_reference(cu_q, cu_k, cp_size, r, ratios)
        assert mirrors_equal(m, ref) is None, f"{ctx} rank {r}: {mirrors_equal(m, ref)}"
    _check_properties(mirrors, cu_q, cu_k, ctx)


@requires_tilelang
@given(batch=_batches, cp_size=st.sampled_from([1, 2, 4, 8]), ratios=_ratios)
@settings(max_examples=25)
def test_property_tilelang(batch, cp_size, ratios):
    cu_q, cu_k = _batch([q for q, _ in batch], [p for _, p in batch])
    for r in range(cp_size):
        got = prepare_cp_mirror(cu_q, cu_k, cp_size, r, ratios, backend="tilelang")
        diff = mirrors_equal(got, prepare_cp_mirror(cu_q, cu_k, cp_size, r, ratios, backend="cpu"))
        assert diff is None, f"{batch=} {cp_size=} {ratios=} rank {r}: {diff}"


@requires_triton
@given(
    batch=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 20)), min_size=1, max_size=3),
    cp_size=st.sampled_from([1, 2, 4]),
    ratios=_ratios,
    data=st.data(),
)
@settings(max_examples=8)
def test_property_triton(batch, cp_size, ratios, data):
    cu_q, cu_k = _batch([q for q, _ in batch], [p for _, p in batch])
    r = data.draw(st.integers(0, cp_size - 1), label="cp_rank")
    got = prepare_cp_mirror(cu_q, cu_k, cp_size, r, ratios, backend="triton")
    diff = mirrors_equal(got, prepare_cp_mirror_reference(cu_q, cu_k, cp_size, r, ratios))
    assert diff is None, f"{batch=} {cp_size=} {ratios=} rank {r}: {diff}"


# Mirror gathers.


@pytest.mark.parametrize("gather_backend", ["cpu", pytest.param("tilelang", marks=requires_tilelang)])
@pytest.mark.parametrize("cp_size", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8], ids=str)
def test_mirror_round_trip(gather_backend, cp_size, dtype):
    cu_q, cu_k = _batch([13, 0, 1, 2 * cp_size - 1, 64, 5], [0, 4, 9, 0, 17, 2])
    total_q = int(cu_q[-1])
    g = torch.Generator().manual_seed(cp_size)
    x = torch.randint(-100, 100, (total_q, 3, 5), generator=g).to(dtype)
    mirrors = _all_ranks(cu_q, cu_k, cp_size, (1,))
    parts = [to_mirror(x, m, backend=gather_backend) for m in mirrors]
    for m, part in zip(mirrors, parts, strict=True):
        assert part.shape == (m.cp_mirror_len, 3, 5) and part.dtype == dtype
        pad = m.mirror_cp_index < 0
        assert torch.equal(part[pad], torch.zeros_like(part[pad])), f"{cp_size=} rank {m.cp_rank}: padding rows"
        assert torch.equal(part[~pad], x[m.mirror_cp_index[~pad].long()]), f"{cp_size=} rank {m.cp_rank}"
    gathered = torch.cat(parts)  # what the CP all-gather produces, rank-major
    for m in mirrors:
        assert_bitwise_equal(from_mirror(gathered, m, backend=gather_backend), x, ctx=f"{cp_size=} {dtype=}")


def test_mirror_gather_bad_input():
    cu_q, cu_k = _batch([5, 2], [3, 0])
    m = prepare_cp_mirror(cu_q, cu_k, 2, 0)
    with pytest.raises(ValueError, match=r"x must be a tensor of shape \[total_q = 7"):
        to_mirror(torch.zeros(6, 4), m)
    with pytest.raises(ValueError, match=r"gathered must have shape \[cp_size \* cp_mirror_len = 12"):
        from_mirror(torch.zeros(6, 4), m)
    with pytest.raises(ValueError, match="mirror must be a CPMirror"):
        to_mirror(torch.zeros(7, 4), m.mirror_cp_index)


# Bad input: ValueError naming the field and the sequence, before any kernel runs.


BAD_INPUTS = [
    (dict(cp_size=0), r"cp_size = 0 must be >= 1"),
    (dict(cp_size=2.0), r"cp_size must be a Python int"),
    (dict(cp_rank=2), r"cp_rank = 2 must be in \[0, 2\)"),
    (dict(cp_rank=-1), r"cp_rank = -1 must be in \[0, 2\)"),
    (dict(compress_ratios=(1, 0)), r"compress_ratios\[1\] = 0 must be >= 1"),
    (dict(compress_ratios=(4, -4)), r"compress_ratios\[1\] = -4"),
    (dict(compress_ratios=(4, 4)), r"compress_ratios\[1\] = 4 repeats compress_ratios\[0\]"),
    (dict(compress_ratios=()), r"compress_ratios must name at least one ratio"),
    (dict(cu_seqlens_q=[0, 5, 3, 9]), r"cu_seqlens_q decreases at sequence 1: cu_seqlens_q\[2\] = 3"),
    (dict(cu_seqlens_k=[0, 8, 12, 11]), r"cu_seqlens_k decreases at sequence 2"),
    (dict(cu_seqlens_k=[0, 8, 9, 19]), r"sequence 1 has k_len = 1 < q_len = 2"),
    (dict(cu_seqlens_k=[0, 8, 12]), r"cu_seqlens_k has 2 sequences; sequence 2 is missing from cu_seqlens_k"),
    (dict(cu_seqlens_q=[0, 5, 7, 9, 10]), r"sequence 3 is missing from cu_seqlens_k"),
    (dict(cu_seqlens_q=[1, 5, 7, 9]), r"cu_seqlens_q\[0\] must be 0, got 1"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 5.0, 7.0, 9.0])), r"cu_seqlens_q must have dtype int32 or int64"),
    (dict(cu_seqlens_k=torch.tensor([0, 8, 12, 20], dtype=torch.int16)), r"cu_seqlens_k must have dtype int32"),
    (dict(cu_seqlens_q=torch.zeros(2, 2, dtype=torch.int32)), r"cu_seqlens_q must be 1-D"),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("bad,match", BAD_INPUTS)
def test_bad_input(monkeypatch, backend, bad, match):
    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran before the input was validated")

    for mod in ("epkit.kernels.triton.cp_mirror", "epkit.kernels.tilelang.cp_mirror"):
        with contextlib.suppress(ImportError):  # framework not installed: nothing to guard
            monkeypatch.setattr(f"{mod}.prepare_cp_mirror_launch", no_kernel)
    monkeypatch.setattr("epkit.cp_mirror.mirror_indices_cpu", no_kernel)
    args = dict(cu_seqlens_q=[0, 5, 7, 9], cu_seqlens_k=[0, 8, 12, 20], cp_size=2, cp_rank=1, compress_ratios=(1, 4))
    args.update(bad)
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if isinstance(args[name], list):
            args[name] = torch.tensor(args[name], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        prepare_cp_mirror(**args, backend=backend)


def test_int32_overflow_rejected():
    cu_q = torch.tensor([0, 2**31], dtype=torch.int64)
    with pytest.raises(ValueError, match="too large for int32"):
        prepare_cp_mirror(cu_q, cu_q, 4, 0)


# Registration, selection and selfcheck.


def test_backend_selection_and_selfcheck():
    assert select("prepare_cp_mirror", "cpu") == "cpu"
    assert SPEC.cuda[0] == "triton"
    SPEC.selfcheck("cpu")
    SPEC.selfcheck("reference")


@requires_tilelang
def test_selfcheck_tilelang():
    SPEC.selfcheck("tilelang")


# Rung 3: compiled for sm_90 without a GPU.


@requires_tilelang
@requires_nvcc
def test_tilelang_lowers_and_nvcc_compiles_for_sm90():
    from epkit.kernels.tilelang.cp_mirror import prepare_cp_mirror_func

    k = tilelang_compile_cuda(prepare_cp_mirror_func("cuda"), "sm_90")
    assert "__global__" in k.source and "prepare_cp_mirror_kernel" in k.source
    assert "threadIdx.x" in k.source, "slots must be spread over the block's threads"
    assert k.cubin and len(k.cubin) > 1000
    if k.sass is not None:
        assert "STG" in k.sass


# Rung 4: executed on a GPU.


@requires_cuda
@pytest.mark.parametrize("backend", ["triton", pytest.param("tilelang", marks=requires_tilelang), "reference"])
@pytest.mark.parametrize("cp_size", [1, 2, 8])
def test_gpu_bit_exact(backend, cp_size):
    cu_q, cu_k = _batch(EDGE_LENGTHS, EDGE_PREFIXES)
    for r in range(cp_size):
        got = prepare_cp_mirror(cu_q.cuda(), cu_k.cuda(), cp_size, r, RATIOS, backend=backend)
        assert got.mirror_cp_index.is_cuda
        diff = mirrors_equal(got, prepare_cp_mirror_reference(cu_q, cu_k, cp_size, r, RATIOS))
        assert diff is None, f"{backend=} {cp_size=} rank {r}: {diff}"
