"""collectives/ep/rows.py: the fused row reduction (``epkit._C.reduce_rows``, its AVX2 kernel for bf16 rows
included) gives the bits of the torch formulation it stands for (``portable=True``: each product rounded, then added in
float32, k ascending, the biases in order, one rounding to the output dtype). NaN payloads are the one thing compared
by class only: a NaN is a NaN on both sides, and a bfloat16 NaN out of the fused kernels is 0x7FC0."""

import itertools

import pytest
import torch

from epkit.collectives.ep.rows import sum_indexed_rows


def _rows(n: int, h: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Rows with the values that tell roundings apart: wide exponents, signed zeros, inf and NaN."""
    x = torch.randn(n, h, generator=g) * torch.exp2(torch.randint(-20, 20, (n, h), generator=g).float())
    flat = x.view(-1)
    pick = torch.randint(0, flat.numel(), (6 * n,), generator=g)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.0e38])
    flat[pick] = specials[torch.arange(pick.numel()) % specials.numel()]
    return x.to(dtype)


def _fused_cases():
    """Every (source, output, bias) dtype combination, each at both hidden sizes (200: a tail of no whole vector),
    weighted or not and on 1 or 2 threads (2: the tokens split over the caller and a pool helper) in turn, so
    that every pair of values of any two parameters meets: 24 cases, not the 96 of the full product."""
    dtypes = itertools.product(
        [torch.bfloat16, torch.float32], [torch.bfloat16, torch.float32], [None, torch.bfloat16, torch.float32]
    )
    return [
        (*d, bool((i + j) % 2), hidden, 1 + (i // 3 + j) % 2)
        for i, d in enumerate(dtypes)
        for j, hidden in enumerate((2048, 200))
    ]


@pytest.mark.parametrize("src_dtype,out_dtype,bias_dtype,weighted,hidden,threads", _fused_cases())
def test_fused_reduction_gives_the_torch_formulation_bits(src_dtype, out_dtype, bias_dtype, weighted, hidden, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_fused_against_portable(src_dtype, out_dtype, bias_dtype, weighted, hidden)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_result_of_8_mib_or_more_gets_the_same_bits(out_dtype, threads):
    # Results this large are written with streaming stores (csrc/ep_rows.cpp, STREAM_BYTES): the same values.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_fused_against_portable(torch.bfloat16, out_dtype, torch.bfloat16, True, 2048, t_num=2048)
    finally:
        torch.set_num_threads(before)


def _check_fused_against_portable(src_dtype, out_dtype, bias_dtype, weighted, hidden, t_num=67):
    g = torch.Generator().manual_seed(hidden + 7 * weighted)
    k = 5
    sources = [_rows(n, hidden, src_dtype, g) for n in (40, 9, 70)]
    src_of = torch.randint(-1, len(sources), (t_num, k), generator=g)
    src_of[3] = -1  # a token no row reaches: 0 plus the biases
    row_of = torch.stack([torch.randint(0, sources[max(s, 0)].shape[0], (1,), generator=g) for s in src_of.view(-1)])
    row_of = row_of.view(t_num, k)
    weights = torch.randn(t_num, k, generator=g) if weighted else None
    biases = [] if bias_dtype is None else [_rows(t_num, hidden, bias_dtype, g) for _ in range(2)]
    fused = sum_indexed_rows(torch.empty(t_num, hidden, dtype=out_dtype), sources, src_of, row_of, weights, biases)
    out = torch.empty(t_num, hidden, dtype=out_dtype)
    want = sum_indexed_rows(out, sources, src_of, row_of, weights, biases, portable=True)
    nan = want.isnan()
    assert nan.any() and torch.equal(fused.isnan(), nan)
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(fused.view(bits)[~nan], want.view(bits)[~nan])
    if out_dtype == torch.bfloat16:  # the canonical NaN of torch's scalar rounding (its vectorised one gives 0xFFFF)
        assert (fused.view(torch.int16)[nan] == 0x7FC0).all()


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [2048, 200])
@pytest.mark.parametrize("weighted", [False, True])
def test_groups_give_the_bits_of_partials_written_out_and_summed(src_dtype, out_dtype, hidden, weighted):
    # groups=[2, 1, 2]: each group's sum cast to out's dtype, then the groups with a row summed in order, then the
    # biases - what the hierarchy computed with each host's partial in memory (two calls through the torch
    # formulation here, the oracle); the fused kernels (AVX2 for bf16 rows, the generic ones) and portable agree.
    g = torch.Generator().manual_seed(hidden + 3 * weighted)
    t_num, groups = 67, [2, 1, 2]
    sources = [_rows(n, hidden, src_dtype, g) for n in (40, 9, 70)]
    src_of = torch.randint(-1, len(sources), (t_num, 5), generator=g)
    src_of[3] = -1  # no row at all
    src_of[5, :2] = -1  # the first group without a row
    row_of = torch.stack([torch.randint(0, sources[max(s, 0)].shape[0], (1,), generator=g) for s in src_of.view(-1)])
    row_of = row_of.view(t_num, 5)
    weights = torch.randn(t_num, 5, generator=g) if weighted else None
    biases = [_rows(t_num, hidden, torch.bfloat16, g)]

    def run(portable):
        out = torch.empty(t_num, hidden, dtype=out_dtype)
        return sum_indexed_rows(out, sources, src_of, row_of, weights, biases, groups, portable)

    partials, cols = [], [slice(0, 2), slice(2, 3), slice(3, 5)]
    for c in cols:
        w = weights[:, c] if weighted else None
        out = torch.empty(t_num, hidden, dtype=out_dtype)
        partials.append(sum_indexed_rows(out, sources, src_of[:, c], row_of[:, c], w, portable=True))
    had = torch.stack([(src_of[:, c] >= 0).any(1) for c in cols], 1)
    p_src = torch.where(had, torch.arange(3), -1)
    p_row = torch.arange(t_num).unsqueeze(1).expand(t_num, 3)
    out = torch.empty(t_num, hidden, dtype=out_dtype)
    want = sum_indexed_rows(out, partials, p_src, p_row, None, biases, portable=True)
    nan = want.isnan()
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    for got in (run(False), run(True)):
        assert nan.any() and torch.equal(got.isnan(), nan)
        assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])
    with pytest.raises(ValueError, match="add up to the 5 terms"):
        sum_indexed_rows(torch.empty(t_num, hidden, dtype=out_dtype), sources, src_of, row_of, groups=[2, 2])


def test_dispatch_layout_pass_matches_the_reference_and_refuses_ids_out_of_range():
    # epkit._C.dispatch_layout (EPBuffer.get_dispatch_layout's one pass) against ep_reference.reference_layout on
    # routing with -1 entries, a token naming two experts of one rank and an empty batch; an id outside [-1, E)
    # is an IndexError, not a skipped entry (the Python caller checks first; the pass must not count garbage).
    from epkit import _C
    from epkit.collectives.ep_reference import reference_layout

    def layout(idx, experts, world):
        t = idx.shape[0]
        in_rank = torch.empty((t, world), dtype=torch.bool)
        per_rank, per_expert = torch.empty(world, dtype=torch.int32), torch.empty(experts, dtype=torch.int32)
        ptrs = (in_rank.data_ptr(), per_rank.data_ptr(), per_expert.data_ptr())
        _C.dispatch_layout(idx.data_ptr(), t, idx.shape[1], experts // world, world, experts, *ptrs)
        return per_rank, per_expert, in_rank

    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(32, generator=g)[:4] for _ in range(50)])
    idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    idx[0] = torch.tensor([0, 1, -1, 9])  # two experts of rank 0: the token counts once there
    for case in (idx, idx[:0]):
        for got, want in zip(layout(case.contiguous(), 32, 4), reference_layout(case, 32, 4)):
            assert torch.equal(got, want)
    for bad in (32, -2):
        wrong = idx.clone()
        wrong[7, 2] = bad
        with pytest.raises(IndexError, match="outside"):
            layout(wrong, 32, 4)
