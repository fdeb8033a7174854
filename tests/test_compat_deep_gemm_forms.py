"""``epkit.compat.deep_gemm``'s tn/tt dense GEMMs, K not a multiple of 128, ``recipe=(1, 1, 128)``, the K-grouped
GEMMs and their scale packing, cuBLASLt and the einsums, each against a float64 reference written here from
DeepGEMM's semantics (scales indexed element by element, sums in float64), not from the code under test."""

from __future__ import annotations

import pytest
import torch

import epkit.compat.deep_gemm as deep_gemm
from epkit.compat._details.deep_gemm_runtime import reset_settings
from epkit.utils import calc_diff


@pytest.fixture(autouse=True)
def _default_settings():
    yield
    reset_settings()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cast(x: torch.Tensor, gran_mn: int, gran_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 of ``x [MN, K]`` with one float32 power-of-two scale per ``gran_mn x gran_k`` block (a partial last block
    scaled by its own elements), scales ``[ceil(MN/gran_mn), ceil(K/gran_k)]``."""
    mn, k = x.shape
    rows, cols = -(-mn // gran_mn), -(-k // gran_k)
    pad = torch.zeros(rows * gran_mn, cols * gran_k)
    pad[:mn, :k] = x
    amax = pad.view(rows, gran_mn, cols, gran_k).abs().amax(dim=(1, 3)).clamp(min=1e-4)
    sf = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (pad.view(rows, gran_mn, cols, gran_k) / sf[:, None, :, None]).view_as(pad)[:mn, :k]
    return q.to(torch.float8_e4m3fn), sf.float()


def _deq64(q: torch.Tensor, sf: torch.Tensor, gran_mn: int, gran_k: int) -> torch.Tensor:
    """float64 ``q[i, j] * sf[i // gran_mn, j // gran_k]``."""
    i = torch.arange(q.shape[0])[:, None] // gran_mn
    j = torch.arange(q.shape[1])[None, :] // gran_k
    return q.double() * sf.double()[i, j]


def _t(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """An operand given transposed, as DeepGEMM's tn/tt/nn forms take it (contiguous, scales transposed too)."""
    return pair[0].T.contiguous(), pair[1].T.contiguous()


@pytest.mark.parametrize("layout", ["nt", "nn", "tn", "tt"])
@pytest.mark.parametrize("recipe", [None, (1, 1, 128)])
def test_fp8_dense_layouts_with_k_not_a_multiple_of_128(layout, recipe):
    m, n, k = 40, 136, 320  # K % 128 = 64: the last scale block covers 64 elements
    g = _gen(1)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    a = _cast(x, 1, 128)
    b = _cast(w, 1, 128) if recipe else _cast(w, 128, 128)
    want = _deq64(*a, 1, 128) @ (_deq64(*b, 1, 128) if recipe else _deq64(*b, 128, 128)).T
    c = torch.randn(m, n, generator=g)
    aa = _t(a) if layout[0] == "t" else a
    bb = _t(b) if layout[1] == "n" else b
    fn = getattr(deep_gemm, f"fp8_gemm_{layout}")
    d = torch.empty(m, n)
    fn(aa, bb, d, recipe=recipe)
    assert calc_diff(d, want) < 1e-9, f"{layout=} {recipe=}"
    d = c.clone()
    fn(aa, bb, d, c=d, recipe=recipe)  # accumulate into c (= d)
    assert calc_diff(d, want + c.double()) < 1e-9, f"{layout=} {recipe=} c"
    d16 = torch.empty(m, n, dtype=torch.bfloat16)
    getattr(deep_gemm, f"fp8_fp4_gemm_{layout}")(aa, bb, d16, recipe=recipe)
    assert calc_diff(d16, want) < 1e-5


def test_fp8_dense_errors_quote_the_callers_layout():
    a, b = _cast(torch.randn(8, 256), 1, 128), _cast(torch.randn(128, 384), 128, 128)
    with pytest.raises(
        ValueError, match=r"^fp8_gemm_tn: a \[K, M\] \(256, 8\) and b \[K, N\] \(384, 128\) disagree on K$"
    ):
        deep_gemm.fp8_gemm_tn(_t(a), _t(b), torch.empty(8, 128))
    with pytest.raises(ValueError, match=r"^fp8_gemm_nt: recipe=\(1, 1, 64\)"):
        deep_gemm.fp8_gemm_nt(a, b, torch.empty(8, 128), recipe=(1, 1, 64))


@pytest.mark.parametrize("layout", ["nt", "nn", "tn", "tt"])
def test_bf16_dense_layouts_and_trivial_sizes(layout):
    m, n, k = 24, 40, 200
    g = _gen(2)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    want = x.double() @ w.double().T
    aa = x.T.contiguous() if layout[0] == "t" else x.T.contiguous().T  # nt/nn: an MN-major a
    bb = w.T.contiguous() if layout[1] == "n" else w
    fn = getattr(deep_gemm, f"bf16_gemm_{layout}")
    c = torch.randn(m, n, generator=g)
    d = torch.empty(m, n)
    fn(aa, bb, d, c=c)
    assert calc_diff(d, want + c.double()) < 1e-9
    # K = 0: d = c (or zeros); M = 0: nothing to write
    empty_a = torch.zeros((0, m) if layout[0] == "t" else (m, 0), dtype=torch.bfloat16)
    empty_b = torch.zeros((0, n) if layout[1] == "n" else (n, 0), dtype=torch.bfloat16)
    d = torch.full((m, n), 7.0)
    assert torch.equal(fn(empty_a, empty_b, d, c=c), c)
    assert torch.equal(fn(empty_a, empty_b, d), torch.zeros(m, n))


def _k_grouped_ref(a_rows, b_rows, ranges, c):
    """float64 ``c[g] + sum over the group's K rows of a_row^T b_row`` (``a_rows [sum_K, M]`` float64)."""
    out = c.double().clone()
    for i, (start, k) in enumerate(ranges):
        for r in range(start, start + k):
            out[i] += torch.outer(a_rows[r], b_rows[r])
    return out


def _k_grouped_cast(x: torch.Tensor, ranges, gran: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group, FP8 of its rows of ``x [sum_K, MN]`` with 1 x ``gran`` scales along K (its own blocks): values
    ``[sum_K, MN]`` (zeros outside groups), scales ``[sum(ceil(k/gran)), MN]``, float64 dequantized rows."""
    q = torch.zeros(x.shape, dtype=torch.float8_e4m3fn)
    deq = torch.zeros(x.shape, dtype=torch.float64)
    sfs = []
    for start, k in ranges:
        if k:
            qg, sg = _cast(x[start : start + k].T, 1, gran)  # [MN, k], scales [MN, ceil(k/gran)]
            q[start : start + k] = qg.T
            deq[start : start + k] = _deq64(qg, sg, 1, gran).T
            sfs.append(sg.T)
    return q, torch.cat(sfs), deq


def test_k_grouped_fp8_nt_with_an_empty_group():
    m, n, ks = 24, 40, [256, 0, 128]
    ranges = [(0, 256), (256, 0), (256, 128)]
    g = _gen(3)
    x, y = torch.randn(384, m, generator=g), torch.randn(384, n, generator=g)
    qa, sfa, da = _k_grouped_cast(x, ranges, 128)
    qb, sfb, db = _k_grouped_cast(y, ranges, 128)
    c = torch.randn(3, m, n, generator=g)
    want = _k_grouped_ref(da, db, ranges, c)
    # DeepGEMM's nt layout: each group's [M, k] K-major block, flat, one after the other; scales [M, sum K blocks]
    flat_a = torch.cat([qa[s : s + k].T.reshape(-1) for s, k in ranges])
    flat_b = torch.cat([qb[s : s + k].T.reshape(-1) for s, k in ranges])
    d = c.clone()
    layout = torch.tensor(ks, dtype=torch.int32)
    deep_gemm.k_grouped_fp8_gemm_nt_contiguous((flat_a, sfa.T), (flat_b, sfb.T), d, ks, layout, d)
    assert calc_diff(d, want) < 1e-9
    assert torch.equal(d[1], c[1])  # the empty group keeps c


@pytest.mark.parametrize("gran", [128, 32])
def test_k_grouped_fp8_tn_psum_layout_partial_blocks_and_empty_group(gran):
    deep_gemm.set_mk_alignment_for_contiguous_layout(128)
    m, n = 16, 24
    real = [200, 0, 77]  # 200 % gran != 0 for 128; 77 a partial block either way
    ends, prev = [], 0
    for k in real:
        prev = -(-prev // 128) * 128 + k
        ends.append(prev)
    ranges = [(e - k, k) for e, k in zip(ends, real)]
    total = -(-ends[-1] // 128) * 128
    g = _gen(4)
    x, y = torch.randn(total, m, generator=g), torch.randn(total, n, generator=g)
    qa, sfa, da = _k_grouped_cast(x, ranges, gran)
    qb, sfb, db = _k_grouped_cast(y, ranges, gran)
    c = torch.randn(3, m, n, generator=g)
    want = _k_grouped_ref(da, db, ranges, c)
    for ks in (None, [], [-(-k // 128) * 128 for k in real]):
        d = c.clone()
        deep_gemm.k_grouped_fp8_gemm_tn_contiguous(
            (qa, sfa), (qb, sfb), d, ks, torch.tensor(ends, dtype=torch.int32), d, recipe=(1, 1, gran),
            use_psum_layout=True,
        )  # fmt: skip
        assert calc_diff(d, want) < 1e-9, f"{ks=}"


def test_k_grouped_bf16_tn_with_an_empty_group():
    m, n, ks = 16, 24, [128, 0, 256]
    ranges = [(0, 128), (128, 0), (128, 256)]
    g = _gen(5)
    a = torch.randn(384, m, generator=g).bfloat16()
    b = torch.randn(384, n, generator=g).bfloat16()
    c = torch.randn(3, m, n, generator=g)
    want = _k_grouped_ref(a.double(), b.double(), ranges, c)
    d = torch.empty(3, m, n)
    deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks, torch.tensor(ks, dtype=torch.int32), c)
    assert calc_diff(d, want) < 1e-9
    with pytest.raises(ValueError, match=r"^k_grouped_bf16_gemm_tn_contiguous: every K in ks_cpu must be a multiple"):
        deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, b, d, [100, 28, 256], torch.tensor(ks, dtype=torch.int32), c)


def test_k_grouped_packed_ue8m0_scales():
    mn, gran = 8, 128
    ks = [512, 128, 0, 640]
    rows = [-(-k // gran) for k in ks]
    sf = torch.exp2(torch.randint(-20, 20, (sum(rows), mn), generator=_gen(6)).float())
    got = deep_gemm.get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor(
        sf, torch.tensor(ks, dtype=torch.int32), ks, gran, gran
    )
    # reference: per group, int32 row p of column j = sum of exponent byte of scale row 4p+i at bit 8i
    want, src = [], 0
    for r in rows:
        for p in range(-(-r // 4)):
            word = [0] * mn
            for i in range(4):
                if 4 * p + i < r:
                    for j in range(mn):
                        e = int(torch.log2(sf[src + 4 * p + i, j]).item()) + 127
                        word[j] |= e << (8 * i)
            want.append([w - (1 << 32) if w >= 1 << 31 else w for w in word])
        src += r
    assert torch.equal(got, torch.tensor(want, dtype=torch.int32))


@pytest.mark.parametrize("layout", ["nt", "nn", "tn", "tt"])
def test_cublaslt_layouts(layout):
    m, n, k = 12, 20, 72
    g = _gen(7)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    aa = x.T.contiguous() if layout[0] == "t" else x
    bb = w.T.contiguous() if layout[1] == "n" else w
    c = torch.randn(m, n, generator=g)
    d = c.clone()
    getattr(deep_gemm, f"cublaslt_gemm_{layout}")(aa, bb, d, c=d)
    assert calc_diff(d, x.double() @ w.double().T + c.double()) < 1e-12
    fx, fw = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)  # unscaled FP8, as cuBLASLt takes it
    d = torch.empty(m, n)
    fa = fx.T.contiguous() if layout[0] == "t" else fx
    fb = fw.T.contiguous() if layout[1] == "n" else fw
    getattr(deep_gemm, f"cublaslt_gemm_{layout}")(fa, fb, d)
    assert calc_diff(d, fx.double() @ fw.double().T) < 1e-12


def test_einsum_forms():
    g = _gen(8)
    a, b = torch.randn(5, 16, 24, generator=g).bfloat16(), torch.randn(5, 8, 24, generator=g).bfloat16()
    c = torch.randn(16, 8, generator=g)
    d = c.clone()
    deep_gemm.einsum("bmk,bnk->mn", a, b, d, c=d)
    want = c.double() + sum(a[i].double() @ b[i].double().T for i in range(5))
    assert calc_diff(d, want) < 1e-12
    x = torch.randn(6, 4, 40, generator=g).bfloat16()  # bhr
    fy = torch.randn(4, 12, 48, generator=g).bfloat16()
    y = fy[:, :, :40]  # hdr, a strided view
    z = torch.empty(6, 4, 12, dtype=torch.bfloat16)
    deep_gemm.einsum("bhr,hdr->bhd", x, y, z)
    want = torch.stack([torch.stack([y[h].double() @ x[bb, h].double() for h in range(4)]) for bb in range(6)])
    assert calc_diff(z, want) < 1e-5
    x2 = torch.randn(6, 4, 12, generator=g).bfloat16()  # bhd
    z2 = torch.empty(6, 4, 40, dtype=torch.bfloat16)
    deep_gemm.einsum("bhd,hdr->bhr", x2, y, z2)
    want = torch.stack([torch.stack([x2[bb, h].double() @ y[h].double() for h in range(4)]) for bb in range(6)])
    assert calc_diff(z2, want) < 1e-5
    with pytest.raises(ValueError, match="^einsum: expression 'ij,jk->ik' is not supported"):
        deep_gemm.einsum("ij,jk->ik", a, b, d)


def test_fp8_einsum_forms():
    g = _gen(9)
    bsz, h, r, dd = 10, 3, 200, 136  # r % 128 != 0
    x, y = torch.randn(bsz, h, r, generator=g), torch.randn(h, dd, r, generator=g)
    xq = [_cast(x[:, i], 1, 128) for i in range(h)]
    yq = [_cast(y[i], 128, 128) for i in range(h)]
    x_fp8 = (torch.stack([q for q, _ in xq], 1), torch.stack([s for _, s in xq], 1))
    y_fp8 = (torch.stack([q for q, _ in yq]), torch.stack([s for _, s in yq]))
    want = torch.stack([_deq64(*xq[i], 1, 128) @ _deq64(*yq[i], 128, 128).T for i in range(h)], 1)
    z = torch.empty(bsz, h, dd)
    deep_gemm.fp8_einsum("bhr,hdr->bhd", x_fp8, y_fp8, z)
    assert calc_diff(z, want) < 1e-9
    # bhd,hdr->bhr: the same b [H, D, R] (scales [H, D/128, R/128]) contracted over D
    xd = torch.randn(bsz, h, dd, generator=g)
    xdq = [_cast(xd[:, i], 1, 128) for i in range(h)]
    xd_fp8 = (torch.stack([q for q, _ in xdq], 1), torch.stack([s for _, s in xdq], 1))
    z2 = torch.empty(bsz, h, r)
    deep_gemm.fp8_einsum("bhd,hdr->bhr", xd_fp8, y_fp8, z2)
    want2 = torch.stack([_deq64(*xdq[i], 1, 128) @ _deq64(*yq[i], 128, 128) for i in range(h)], 1)
    assert calc_diff(z2, want2) < 1e-9
    # bhd,bhr->hdr with 1x128 scales along b (the weight gradient), accumulated into c
    u, v = torch.randn(300, h, 16, generator=g), torch.randn(300, h, 24, generator=g)
    uq, vq = _cast(u.reshape(300, -1).T, 1, 128), _cast(v.reshape(300, -1).T, 1, 128)  # [H*D, B], [H*D, 3]
    u_fp8 = (uq[0].T.reshape(300, h, 16), uq[1].T.reshape(3, h, 16))
    v_fp8 = (vq[0].T.reshape(300, h, 24), vq[1].T.reshape(3, h, 24))
    du, dv = _deq64(*uq, 1, 128).view(h, 16, 300), _deq64(*vq, 1, 128).view(h, 24, 300)
    c = torch.randn(h, 16, 24, generator=g)
    z3 = c.clone()
    deep_gemm.fp8_einsum("bhd,bhr->hdr", u_fp8, v_fp8, z3, z3, recipe=(1, 1, 128))
    assert calc_diff(z3, c.double() + du @ dv.transpose(1, 2)) < 1e-9


def test_set_num_sms_zero_resets_and_version():
    default = deep_gemm.get_num_sms()
    deep_gemm.set_num_sms(1)
    assert deep_gemm.get_num_sms() == 1
    deep_gemm.set_num_sms(0)  # DeepGEMM: 0 means the device's again
    assert deep_gemm.get_num_sms() == default
    assert deep_gemm.__version__ == "2.6.1"
