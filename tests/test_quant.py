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
