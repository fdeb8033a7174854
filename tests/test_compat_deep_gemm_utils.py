"""``epkit.compat.deep_gemm.utils``: DeepGEMM's ``deep_gemm.utils`` (``math``: the casts to FP8 / FP4 and UE8M0
packing; ``layout``) at DeepGEMM's import paths, with DeepGEMM's signatures, and its casts' bits checked against
references written here: hand-computed codes on small inputs, float32 arithmetic in numpy (DeepGEMM's formula on a
GPU: ``amax * (1 / 448)``, values times the reciprocal of their scale), and epkit's own quantizers where the
arithmetic is the same (power-of-two scales)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import epkit.compat.deep_gemm as deep_gemm
import epkit.compat.deep_gemm.utils as utils
from epkit import quant
from epkit.compat.deep_gemm.utils import layout
from epkit.compat.deep_gemm.utils import math as dgmath

E4M3 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    assert torch.equal(_bits(got), _bits(want)), what


def _np_scales(amax: np.ndarray, top: float) -> np.ndarray:
    """DeepGEMM's scale in float32 arithmetic: max(amax, 1e-4) times the float32 reciprocal of ``top``."""
    return np.maximum(amax.astype(np.float32), np.float32(1e-4)) * np.float32(1.0 / top)


def _np_fp8(x: np.ndarray, sf: np.ndarray) -> torch.Tensor:
    """e4m3 of ``x * (1 / sf)`` computed in numpy float32."""
    return torch.from_numpy((x.astype(np.float32) * (np.float32(1.0) / sf)).astype(np.float32)).to(E4M3)


def _exponent_bytes(sf: torch.Tensor) -> torch.Tensor:
    return (sf.view(torch.int32) >> 23).to(torch.uint8)


# DeepGEMM's tests import these from deep_gemm.utils (tests/generators.py, test_attention.py, test_layout.py) and
# deep_gemm.utils.math (test_einsum.py)
IMPORTED_BY_DEEP_GEMM_TESTS = {
    "utils": [
        "align",
        "ceil_div",
        "per_token_cast_to_fp8",
        "per_channel_cast_to_fp8",
        "per_block_cast_to_fp8",
        "per_token_cast_to_fp4",
        "transpose_packed_fp4",
        "get_mk_alignment_for_contiguous_layout",
        "set_mk_alignment_for_contiguous_layout",
        "per_custom_dims_cast_to_fp8",
        "cast_back_from_fp4",
        "get_tma_aligned_size",
        "get_mn_major_tma_aligned_tensor",
        "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    ],
    "utils.math": ["ceil_div", "per_block_cast_to_fp8", "per_channel_cast_to_fp8", "per_token_cast_to_fp8"],
}

# deep_gemm/utils/math.py's signatures
SIGNATURES = {
    "ceil_div": "x y",
    "align": "x y",
    "ceil_to_ue8m0": "x",
    "pack_ue8m0_to_int": "x",
    "unpack_ue8m0_from_int": "packed_sf",
    "per_token_cast_to_fp8": "x use_ue8m0 gran_k=128 use_packed_ue8m0=False",
    "per_channel_cast_to_fp8": "x use_ue8m0 gran_k=128",
    "per_block_cast_to_fp8": "x use_ue8m0 gran_k=128",
    "per_custom_dims_cast_to_fp8": "x dims use_ue8m0",
    "per_token_cast_to_fp4": "x use_ue8m0 gran_k=128 use_packed_ue8m0=False",
    "transpose_packed_fp4": "a",
    "cast_back_from_fp4": "packed sf gran_k=128 use_packed_ue8m0=False",
}


def test_import_paths_names_and_signatures():
    for name in IMPORTED_BY_DEEP_GEMM_TESTS["utils"]:
        assert getattr(utils, name) is getattr(deep_gemm, name), name  # DeepGEMM binds them at the top level too
    for name in IMPORTED_BY_DEEP_GEMM_TESTS["utils.math"]:
        assert getattr(dgmath, name) is getattr(utils, name), name
    assert deep_gemm.utils is utils and utils.math is dgmath and utils.layout is layout
    assert layout.get_mk_alignment_for_contiguous_layout is deep_gemm.get_mk_alignment_for_contiguous_layout
    for name, want in SIGNATURES.items():
        params = inspect.signature(getattr(dgmath, name)).parameters.values()
        got = " ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}" for p in params)
        assert got == want, name
    k_grouped = "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor"
    assert getattr(layout, k_grouped) is getattr(utils, k_grouped) is getattr(deep_gemm, k_grouped)
    from epkit.compat.deep_gemm.utils import dist

    assert utils.init_dist is dist.init_dist is deep_gemm.init_dist  # DeepGEMM binds them in utils and at the top
    assert utils.uneven_all_gather is dist.uneven_all_gather is deep_gemm.uneven_all_gather


def test_integer_rounding():
    assert [dgmath.ceil_div(x, 4) for x in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert [dgmath.align(x, 128) for x in (1, 128, 129, 300)] == [128, 128, 256, 384]


def test_ceil_to_ue8m0_has_deep_gemms_floor_and_top():
    x = torch.tensor(
        [0.0, 1e-45, 2.0**-127, 3.0, 4.0, -5.0, 1.5 * 2.0**126, 2.0**127, 1.5 * 2.0**127, float("inf"), float("nan")]
    )
    want = torch.tensor(
        [2.0**-126, 2.0**-126, 2.0**-126, 4.0, 4.0, 8.0, 2.0**127, 2.0**127, 2.0**127, 2.0**127, 2.0**127]
    )
    _same(dgmath.ceil_to_ue8m0(x), want)


def test_ue8m0_packing_is_four_exponent_bytes_little_endian():
    sf = torch.tensor([[1.0, 2.0, 0.5, 2.0**-126, 2.0**100, 0.25, 1.0, 8.0]])
    packed = dgmath.pack_ue8m0_to_int(sf)
    want = [127 | 128 << 8 | 126 << 16 | 1 << 24, 227 | 125 << 8 | 127 << 16 | 130 << 24]
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert [int(v) & 0xFFFFFFFF for v in packed[0]] == want
    _same(dgmath.unpack_ue8m0_from_int(packed), sf)
    _same(dgmath.unpack_ue8m0_from_int(torch.zeros(1, 1, dtype=torch.int32)), torch.zeros(1, 4))  # byte 0: 0.0
    for bad, match in ((torch.tensor([[1.0, 2.0, 3.0, 4.0]]), "powers of two"), (torch.ones(1, 3), "multiple of 4")):
        with pytest.raises(ValueError, match=match):
            dgmath.pack_ue8m0_to_int(bad)


def test_per_token_cast_to_fp8_by_hand():
    x = torch.zeros(1, 128)
    x[0, :4] = torch.tensor([3.0, -1.5, 0.01, 0.0])
    q, sf = dgmath.per_token_cast_to_fp8(x, use_ue8m0=True)
    # amax 3: 3 / 448 = 0.0067 rounds up to 2**-7, so q = x * 128 and 0.01 * 128 = 1.28 rounds to 1.25 in e4m3
    _same(sf, torch.tensor([[2.0**-7]]))
    assert q.dtype == E4M3 and q[0, :4].float().tolist() == [384.0, -192.0, 1.25, 0.0]
    q, sf = dgmath.per_token_cast_to_fp8(torch.full((1, 128), 448.0), use_ue8m0=False)
    assert sf.item() == np.float32(448.0) * np.float32(1 / 448) and q.float().max().item() == 448.0
    # v / scale lies next to 1.0625, the midpoint between e4m3's 1.0 and 1.125: v times the scale's reciprocal
    # (DeepGEMM) rounds to 1.125, v divided by the scale (one float32 ulp lower) ties down to 1.0
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1] = 4.027173042297363, 0.009551052935421467  # amax, v (both float32)
    q, sf = dgmath.per_token_cast_to_fp8(x, use_ue8m0=False)
    assert sf.item() == np.float32(4.027173042297363) * np.float32(1 / 448)
    assert q[0, 1].float().item() == 1.125 and (x[0, 1] / sf[0, 0]).to(E4M3).float().item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gran_k", [128, 32])
def test_per_token_cast_to_fp8_matches_float32_arithmetic(dtype, gran_k):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(24, 300, generator=g) * torch.logspace(-4, 3, 300)).to(dtype)  # K = 300: a padded last group
    groups = -(-300 // gran_k)
    xn = torch.nn.functional.pad(x.float(), (0, groups * gran_k - 300)).numpy().reshape(24, groups, gran_k)
    sf = _np_scales(np.abs(xn).max(axis=2), 448.0)
    q, got_sf = dgmath.per_token_cast_to_fp8(x, use_ue8m0=False, gran_k=gran_k)
    _same(got_sf, torch.from_numpy(sf))
    _same(q, _np_fp8(xn, sf[:, :, None]).reshape(24, -1)[:, :300])
    # power-of-two scales: epkit's quantizer (x / scale, exact then) gives the same bits
    q, got_sf = dgmath.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=gran_k)
    want_q, want_sf = quant.per_token_group_cast_to_fp8(x, gran_k, ue8m0=True)
    _same(q, want_q, "codes")
    _same(got_sf, want_sf, "scales")
    if groups % 4 == 0:
        _, packed = dgmath.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=gran_k, use_packed_ue8m0=True)
        _same(packed, _exponent_bytes(want_sf).view(torch.int32), "packed scales")


def test_per_block_and_per_channel_casts_match_float32_arithmetic():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 300, generator=g) * torch.logspace(-2, 2, 300)
    xp = torch.nn.functional.pad(x, (0, 84, 0, 56)).numpy().reshape(2, 128, 3, 128)
    sf = _np_scales(np.abs(xp).max(axis=(1, 3), keepdims=True), 448.0)
    q, got_sf = dgmath.per_block_cast_to_fp8(x, use_ue8m0=False)
    _same(got_sf, torch.from_numpy(sf.reshape(2, 3)))
    _same(q, _np_fp8(xp, sf).reshape(256, 384)[:200, :300])
    q, got_sf = dgmath.per_block_cast_to_fp8(x, use_ue8m0=True)
    want_q, want_sf = quant.per_block_cast_to_fp8(x, ue8m0=True)
    _same(q, want_q)
    _same(got_sf, want_sf)
    xc = x[:128, :40].contiguous().repeat(2, 1) * torch.linspace(0.5, 2.0, 256)[:, None]
    xn = xc.numpy().reshape(2, 128, 40)
    sf = _np_scales(np.abs(xn).max(axis=1), 448.0)
    q, got_sf = dgmath.per_channel_cast_to_fp8(xc, use_ue8m0=False)
    _same(got_sf, torch.from_numpy(sf))
    _same(q, _np_fp8(xn, sf[:, None, :]).reshape(256, 40))
    with pytest.raises(ValueError, match="multiple of gran_k"):
        dgmath.per_channel_cast_to_fp8(xc[:100], use_ue8m0=False)


def test_per_custom_dims_cast_to_fp8():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, 6, generator=g)
    q, sf = dgmath.per_custom_dims_cast_to_fp8(x, (0, 2), use_ue8m0=False)
    want = _np_scales(np.abs(x.numpy()).max(axis=1, keepdims=True), 448.0)  # [4, 1, 6]: one scale per (i, k)
    _same(sf, torch.from_numpy(want.reshape(4, 6)))
    _same(q, _np_fp8(x.numpy(), want))


def _fp4_bytes(codes: list[int]) -> list[int]:
    return [lo | hi << 4 for lo, hi in zip(codes[0::2], codes[1::2])]


def test_per_token_cast_to_fp4_by_hand():
    row = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.6, 0.26, -6.0]  # amax 6: scale 6 * (1/6) = 1.0
    x = torch.tensor([row + [0.0] * 20])
    packed, sf = dgmath.per_token_cast_to_fp4(x, use_ue8m0=False, gran_k=32)
    # midpoints round to the smaller magnitude; -0.25 gives +0 (no negative zero); -2.6 is -3.0: 8 | 5
    codes = [0, 1, 2, 3, 4, 5, 6, 7, 0, 13, 1, 15] + [0] * 20
    assert packed.dtype == torch.int8 and packed.shape == (1, 16) and sf.tolist() == [[1.0]]
    assert packed.view(torch.uint8)[0].tolist() == _fp4_bytes(codes)
    back = dgmath.cast_back_from_fp4(packed, sf, gran_k=32)
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -3.0, 0.5, -6.0] + [0.0] * 20
    assert back.dtype == torch.float32 and back[0].tolist() == want


def test_per_token_cast_to_fp4_is_epkits_mxfp4_with_deep_gemms_ties():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 256, generator=g) * torch.logspace(-3, 2, 256)
    packed, sf = dgmath.per_token_cast_to_fp4(x, use_ue8m0=True, gran_k=32)
    want_packed, want_e8m0 = quant.cast_to_mxfp4(x, ties="down", amax_min=1e-4)
    _same(packed.view(torch.uint8), want_packed)
    _same(_exponent_bytes(sf), want_e8m0)
    _, int_sf = dgmath.per_token_cast_to_fp4(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
    _same(int_sf, want_e8m0.view(torch.int32))
    # two groups (K = 64) are padded to four with 1.0 (byte 127) before packing
    _, two = dgmath.per_token_cast_to_fp4(x[:, :64], use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
    assert two.shape == (16, 1) and two.view(torch.uint8)[:, 2:].eq(127).all()
    _same(two.view(torch.uint8)[:, :2], want_e8m0[:, :2])
    with pytest.raises(ValueError, match="use_packed_ue8m0 needs use_ue8m0"):
        dgmath.per_token_cast_to_fp4(x, use_ue8m0=False, use_packed_ue8m0=True)


def test_fp4_transpose_and_cast_back_of_every_byte():
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

    def value(code: int) -> float:
        return -table[code & 7] if code & 8 and code & 7 else table[code & 7]  # code 8 is +0.0

    every = torch.arange(256, dtype=torch.uint8).view(torch.int8).view(2, 128)
    sf = torch.tensor([[2.0, 0.5], [0.25, 4.0]])  # gran_k 128: the two scales of each row's 256 values
    back = dgmath.cast_back_from_fp4(every, sf, gran_k=128)
    want = [[0.0] * 256 for _ in range(2)]
    for r in (0, 1):
        for i in range(128):  # byte 128 r + i holds elements 2 i (low nibble) and 2 i + 1 (high nibble) of row r
            for half in (0, 1):
                code = ((128 * r + i) >> (4 * half)) & 15
                want[r][2 * i + half] = value(code) * float(sf[r, (2 * i + half) // 128])
    _same(back, torch.tensor(want))
    assert not torch.signbit(back[0, 16])  # byte 8, low nibble: code 8 reads as +0.0
    _same(dgmath.cast_back_from_fp4(every, _exponent_bytes(sf.repeat(1, 2)).view(torch.int32), 128, True), back)
    a = torch.tensor([[0x21, 0x43], [0x65, 0x87]], dtype=torch.uint8).view(torch.int8)  # codes [[1 2 3 4] [5 6 7 8]]
    t = dgmath.transpose_packed_fp4(a)  # codes [[1 5] [2 6] [3 7] [4 8]]
    assert t.dtype == torch.int8 and t.view(torch.uint8).tolist() == [[0x51], [0x62], [0x73], [0x84]]
    with pytest.raises(ValueError, match="even row count"):
        dgmath.transpose_packed_fp4(a[:1])
