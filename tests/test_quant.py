import math

import numpy as np
import pytest
import torch

from epkit.quant import (
    FP8_E4M3_MAX,
    cast_to_mxfp4,
    cast_to_nvfp4,
    ceil_to_ue8m0,
    dequant_mxfp4,
    dequant_nvfp4,
    dequant_per_block_fp8,
    dequant_per_token_group_fp8,
    e2m1_to_float,
    per_block_cast_to_fp8,
    per_token_group_cast_to_fp8,
)
from epkit.testing import calc_diff

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_ceil_to_ue8m0():
    x = torch.tensor([1.0, 0.75, 3.0, 2.0**-20 * 1.1, 448.0])
    assert torch.equal(ceil_to_ue8m0(x), torch.tensor([1.0, 1.0, 4.0, 2.0**-19, 512.0]))


@pytest.mark.parametrize("m,k", [(7, 256), (3, 200), (0, 128), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_group_fp8(m, k, dtype):
    g = torch.Generator().manual_seed(m * 31 + k)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10).to(dtype)
    if m:
        x[0, : min(k, 128)] = 0  # an all-zero group
    q, s = per_token_group_cast_to_fp8(x)
    groups = -(-k // 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k), f"{m=} {k=}"
    assert s.dtype == torch.float32 and s.shape == (m, groups), f"{m=} {k=}"
    assert torch.isfinite(s).all() and (s > 0).all()
    for i in range(m):  # scale = max(amax, 1e-4) / 448, group by group
        for j in range(groups):
            amax = max(float(x[i, j * 128 : (j + 1) * 128].float().abs().max()), 1e-4)
            assert s[i, j].item() == pytest.approx(amax / 448.0, rel=1e-6), f"{i=} {j=}"
    if m:
        assert float(q.float().abs().max()) <= FP8_E4M3_MAX
        assert calc_diff(dequant_per_token_group_fp8(q, s), x.float()) < 1e-3


def test_per_token_group_fp8_ue8m0_and_3d():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 384, generator=g) * 3
    q, s = per_token_group_cast_to_fp8(x, ue8m0=True)
    assert s.shape == (2, 5, 3)
    log2 = torch.log2(s)
    assert torch.equal(log2, log2.round()), "UE8M0 scales must be powers of two"
    amax = x.view(2, 5, 3, 128).abs().amax(-1)
    assert (s >= amax / 448).all() and (s < 2 * amax / 448).all()
    assert calc_diff(dequant_per_token_group_fp8(q, s), x) < 1e-3
    q2, s2 = per_token_group_cast_to_fp8(x, group_size=64)
    assert s2.shape == (2, 5, 6)
    assert calc_diff(dequant_per_token_group_fp8(q2, s2, group_size=64), x) < 1e-3


@pytest.mark.parametrize("shape", [(256, 384), (3, 130, 200), (0, 128)])
def test_per_block_fp8(shape):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=g) * 0.05
    if w.numel():
        w[..., :128, :128] = 0
    q, s = per_block_cast_to_fp8(w)
    *lead, n, k = shape
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == (*lead, -(-n // 128), -(-k // 128)) and s.dtype == torch.float32
    assert torch.isfinite(s).all() and (s > 0).all()
    if w.numel():
        nb, kb = s.shape[-2:]
        for bi in range(nb):
            for bj in range(kb):
                blk = w[..., bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
                amax = blk.abs().flatten(-2).amax(-1).clamp(min=1e-4)
                torch.testing.assert_close(s[..., bi, bj], amax / 448.0, rtol=1e-6, atol=0)
        assert calc_diff(dequant_per_block_fp8(q, s), w) < 1e-3


def test_mxfp4_exact_grid_packing_and_ties():
    # Values that are exactly e2m1 * 2**e round-trip bit-exactly.
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (4, 64), generator=g)
    codes[:, 0] = 7  # amax 6 in every block -> scale 2**e exactly
    codes[:, 32] = 15
    exps = torch.tensor([[0, -3], [5, 1], [-10, 2], [0, 0]], dtype=torch.float32)
    vals = torch.tensor(E2M1 + [-v for v in E2M1])[codes] * torch.pow(2.0, exps).repeat_interleave(32, 1)
    packed, scale = cast_to_mxfp4(vals)
    assert packed.shape == (4, 32) and packed.dtype == torch.uint8
    assert scale.shape == (4, 2) and scale.dtype == torch.uint8
    assert torch.equal(scale, (exps + 127).to(torch.uint8))
    assert torch.equal(dequant_mxfp4(packed, scale), vals)
    # even element in the low nibble (-0.0 codes become +0)
    lo = codes[:, 0::2].clone()
    hi = codes[:, 1::2].clone()
    lo[lo == 8] = 0
    hi[hi == 8] = 0
    assert torch.equal(packed, (lo | (hi << 4)).to(torch.uint8))
    # ties to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    row = torch.zeros(32)
    row[0] = 6.0
    row[1:8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    p, s = cast_to_mxfp4(row)
    got = dequant_mxfp4(p, s)[1:8]
    assert torch.equal(got, torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]))


def test_mxfp4_random_and_zero_blocks():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 64, 256, generator=g) * 0.02
    w[0, 0, :32] = 0
    packed, scale = cast_to_mxfp4(w.bfloat16())
    deq = dequant_mxfp4(packed, scale)
    assert torch.isfinite(deq).all() and torch.equal(deq[0, 0, :32], torch.zeros(32))
    assert calc_diff(deq, w.bfloat16().float()) < 1e-2
    blk = w.bfloat16().float().view(3, 64, 8, 32).abs().amax(-1)
    s = torch.pow(2.0, scale.float() - 127)
    nz = blk > 0
    assert (blk[nz] / s[nz] <= 6).all() and (blk[nz] / s[nz] > 3).all(), "smallest power of two with amax/s <= 6"


def test_nvfp4():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(32, 128, generator=g)
    w[1, :16] = 0
    packed, scale, gs = cast_to_nvfp4(w)
    assert packed.shape == (32, 64) and packed.dtype == torch.uint8
    assert scale.shape == (32, 8) and scale.dtype == torch.float8_e4m3fn
    assert gs.dtype == torch.float32 and gs.dim() == 0
    assert gs.item() == pytest.approx(w.abs().max().item() / (448 * 6), rel=1e-6)
    deq = dequant_nvfp4(packed, scale, gs)
    assert torch.isfinite(deq).all() and torch.equal(deq[1, :16], torch.zeros(16))
    assert calc_diff(deq, w) < 1e-2
    # hand-made: one block [6, 3, 0.5, ...] with amax 6 == global amax
    row = torch.zeros(1, 16)
    row[0, :3] = torch.tensor([6.0, -3.0, 0.5])
    p, s, g2 = cast_to_nvfp4(row)
    assert float(s[0, 0].float()) == 448.0 and g2.item() == pytest.approx(6 / 2688)
    assert int(p[0, 0]) == 7 | ((8 | 5) << 4) and int(p[0, 1]) == 1
    torch.testing.assert_close(dequant_nvfp4(p, s, g2), row, rtol=1e-6, atol=0)


def test_e2m1_table():
    assert e2m1_to_float(torch.arange(16, dtype=torch.uint8)).tolist() == E2M1 + [-v for v in E2M1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises(bad):
    x = torch.ones(2, 128)
    x[1, 5] = bad
    for fn in (per_token_group_cast_to_fp8, per_block_cast_to_fp8, cast_to_mxfp4, cast_to_nvfp4):
        with pytest.raises(ValueError, match="NaN/Inf"):
            fn(x)


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of 32"):
        cast_to_mxfp4(torch.ones(2, 48))
    with pytest.raises(ValueError, match="multiple of 16"):
        cast_to_nvfp4(torch.ones(2, 24))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        per_token_group_cast_to_fp8(torch.ones(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale must have shape"):
        dequant_per_token_group_fp8(torch.zeros(2, 256).to(torch.float8_e4m3fn), torch.ones(2, 1))
    with pytest.raises(ValueError, match="group_size"):
        per_token_group_cast_to_fp8(torch.ones(2, 128), group_size=0)


# Quantizer conventions, each checked against values computed here from first principles (Python floats and
# numpy float32 arithmetic), never by the functions under test.


def _pow2_ceil(v: float) -> float:
    """The smallest power of two >= v > 0, from the exact binary exponent of v (math.frexp: v = m * 2**e)."""
    m, e = math.frexp(v)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


def test_ceil_to_ue8m0_is_an_exact_ceiling():
    ks = range(-126, 128)
    powers = torch.tensor([math.ldexp(1.0, k) for k in ks], dtype=torch.float32)
    assert torch.equal(ceil_to_ue8m0(powers), powers), "a power of two is its own ceiling"
    # one ulp above a power of two: float32 log2 rounds these to the integer, a ceiling must not
    above = torch.tensor([math.ldexp(1.0 + 2.0**-23, k) for k in range(-126, 127)], dtype=torch.float32)
    want = torch.tensor([math.ldexp(1.0, k + 1) for k in range(-126, 127)], dtype=torch.float32)
    assert torch.equal(ceil_to_ue8m0(above), want)
    assert ceil_to_ue8m0(torch.tensor([2.0**-30 * (1 + 2.0**-23)])).item() == 2.0**-29  # the reported case
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(4000, generator=gen) * torch.pow(2.0, torch.randint(-120, 120, (4000,), generator=gen).float())
    x = x[x >= 2.0**-126]
    got = ceil_to_ue8m0(-x)  # the sign is dropped
    for xv, gv in zip(x.tolist(), got.tolist()):
        assert gv == _pow2_ceil(xv), (xv, gv)
        assert gv >= xv and gv / 2 < xv


def test_ceil_to_ue8m0_zero_subnormal_and_out_of_range_inputs():
    tiny = 2.0**-126  # the smallest normal float32: the floor for zero and subnormal inputs (UE8M0 byte 1)
    sub = torch.tensor([0.0, -0.0, 2.0**-149, 2.0**-127, 1e-40, tiny - 2.0**-149], dtype=torch.float32)
    assert ceil_to_ue8m0(sub).tolist() == [tiny] * 6
    big = torch.tensor([2.0**127, 2.0**127 * (1 + 2.0**-23), torch.finfo(torch.float32).max, math.inf, -math.inf])
    assert ceil_to_ue8m0(big).tolist() == [2.0**127, math.inf, math.inf, math.inf, math.inf]
    assert math.isnan(ceil_to_ue8m0(torch.tensor([math.nan])).item())
    half = torch.tensor([0.75, 3.0, 1e-3], dtype=torch.bfloat16)  # read as float32
    assert ceil_to_ue8m0(half).tolist() == [_pow2_ceil(v) for v in half.float().tolist()]


def test_fp8_scales_are_amax_times_the_float32_reciprocal():
    inv = np.float32(1.0) / np.float32(448.0)  # float32(1/448), rounded once
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=gen) * torch.pow(2.0, torch.randint(-20, 20, (64, 1), generator=gen).float())
    x[0, :128] = 0.1  # amax 0.1 and 3.0: a float32 division by 448 gives other bits (one ulp apart)
    x[1, :128] = -3.0
    _, s = per_token_group_cast_to_fp8(x)
    amax = x.view(64, 2, 128).abs().amax(-1).clamp(min=1e-4).numpy().astype(np.float32)
    assert np.array_equal(s.numpy(), (amax * inv).astype(np.float32))
    for row in (0, 1):
        a = np.float32(amax[row, 0])
        assert s[row, 0].item() != float(a / np.float32(448.0)), "the documented one-ulp difference"
        assert abs(np.float32(s[row, 0].item()) - a / np.float32(448.0)) == np.spacing(a / np.float32(448.0))
    w = x.reshape(128, 128)
    _, sb = per_block_cast_to_fp8(w)
    bmax = np.float32(max(float(w.abs().max()), 1e-4))
    assert sb.item() == float(np.float32(bmax * inv))
    _, su = per_token_group_cast_to_fp8(x, ue8m0=True)  # rounded up, never below amax * (1/448)
    assert su.flatten().tolist() == [_pow2_ceil(float(v)) for v in (amax * inv).astype(np.float32).flatten()]


def _mxfp4_row(values, amax=6.0):
    """One 32-element MXFP4 block: ``values`` after a first element ``amax`` (scale 1 when amax is 6)."""
    row = torch.zeros(32)
    row[0] = amax
    row[1 : 1 + len(values)] = torch.tensor(values)
    return row


def test_mxfp4_ties_even_by_default_down_as_deepgemm():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -3.5]
    row = _mxfp4_row(ties)
    for mode, want in (
        ("even", [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0]),
        ("down", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -0.5, -3.0]),
    ):
        p, s = cast_to_mxfp4(row, ties=mode)
        assert int(s[0]) == 127, "amax 6: scale 2**0"
        assert dequant_mxfp4(p, s)[1:10].tolist() == want, mode
    with pytest.raises(ValueError, match="ties must be one of"):
        cast_to_mxfp4(row, ties="up")
    with pytest.raises(ValueError, match="amax_min must be a positive"):
        cast_to_mxfp4(row, amax_min=0.0)


def test_mxfp4_scale_is_the_smallest_power_of_two_without_clipping():
    inv6 = np.float32(1.0) / np.float32(6.0)
    # amax just above 6 * 2**-30, where a float32 log2 of amax / 6 still reads -30: the scale must be 2**-29
    amax = np.float32(6 * 2.0**-30)
    while np.float32(amax * inv6) <= np.float32(2.0**-30):
        amax = np.nextafter(amax, np.float32(1.0), dtype=np.float32)
    assert np.log2(np.float32(amax * inv6)) == np.float32(-30.0), "the case a log2-based ceiling gets wrong"
    row = _mxfp4_row([float(amax) * 0.5], amax=float(amax))
    p, s = cast_to_mxfp4(row)
    assert int(s[0]) == 127 - 29
    deq = dequant_mxfp4(p, s)
    assert float(deq[0]) == 3 * 2.0**-29 and float(deq[1]) == 1.5 * 2.0**-29, "amax reads 3 scales, amax/2 1.5"
    assert float(deq.abs().max()) <= 6 * 2.0**-29
    # the amax floor: a block with amax 1e-5 keeps its own scale by default, DeepGEMM's 1e-4 floor raises it
    tiny = _mxfp4_row([], amax=1e-5)
    for floor, a in ((2.0**-126, 1e-5), (1e-4, 1e-4)):
        want = 127 + int(math.log2(_pow2_ceil(float(np.float32(np.float32(a) * inv6)))))
        assert int(cast_to_mxfp4(tiny, amax_min=floor)[1][0]) == want, floor


def _deepgemm_mxfp4(x: np.ndarray):
    """DeepGEMM's per_token_cast_to_fp4 (use_ue8m0, gran_k=32) from its definition: amax floored at 1e-4,
    scale the UE8M0 ceiling of amax * float32(1/6), values x / scale, codes counting the midpoints strictly
    below |v| (ties to the smaller magnitude), the sign kept on non-zero codes."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.maximum(np.abs(blocks).max(-1), np.float32(1e-4)).astype(np.float32)
    sf = np.vectorize(lambda a: _pow2_ceil(float(a)))((amax * (np.float32(1) / np.float32(6))).astype(np.float32))
    v = np.minimum(np.abs(blocks / sf[..., None].astype(np.float32)), np.float32(6))
    code = (v[..., None] > mids).sum(-1).astype(np.uint8)
    code |= ((blocks < 0) & (code != 0)).astype(np.uint8) << 3
    code = code.reshape(x.shape)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed, (np.log2(sf).astype(np.int64) + 127).astype(np.uint8)


def test_mxfp4_deepgemm_convention_bit_for_bit():
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(16, 256, generator=gen) * torch.pow(2.0, torch.randint(-12, 6, (16, 1), generator=gen).float())
    w[0, :32] = torch.tensor([6.0, 0.75, 1.75, 3.5, -1.75] + [0.0] * 27)  # exact ties
    w[1, 32:64] = 3e-6  # below DeepGEMM's amax floor
    w[2, :32] = 0.0
    p, s = cast_to_mxfp4(w, ties="down", amax_min=1e-4)
    want_p, want_s = _deepgemm_mxfp4(w.numpy())
    assert np.array_equal(s.numpy(), want_s) and np.array_equal(p.numpy(), want_p)
    p_even, s_even = cast_to_mxfp4(w)
    assert not torch.equal(p_even, p) and not torch.equal(s_even, s), "the defaults differ from DeepGEMM's"
