"""``python/epkit/_details/grouped_gemm_cpu.py``, the cpu backend of the grouped GEMMs, called directly: its
contiguous path (``cpu_contiguous``, which takes rows in any order, unlike the op), the fused C++ dequantizer
(``dequant_extension``, ``_Dequant``: the torch dequantizers' bits, SIMD and generic loops alike) and the fused AMX
kernel (``amx_kernel``: present wherever the CPU has AMX-BF16, the unfused path's results, bits independent of row
order). The ops themselves are ``test_grouped_gemm.py``'s.
"""

import pytest
import torch
from test_grouped_gemm import CONTIG, KINDS, MASKED, THRESH, _ref_contiguous, requires_amx

import epkit._details.grouped_gemm_cpu as gemm_cpu
import epkit.grouped_gemm as gemm
from epkit.grouped_gemm import build_m_indices, make_inputs
from epkit.testing import assert_bitwise_equal, assert_diff, calc_diff


def test_psum_layout_and_unsorted_indices():
    g, n, k = 3, 256, 512
    counts = [5, 0, 130]
    ends, pos = [], 0
    for c in counts:
        start = -(-pos // 128) * 128
        pos = start + c if c else pos
        ends.append(pos)
    ends_t = torch.tensor(ends, dtype=torch.int32)  # [5, 5, 258]
    m = 300
    a, b, af, bf = make_inputs("fp8", g, m, n, k, masked=False, seed=5)
    per_row = torch.full((m,), -1, dtype=torch.int32)
    per_row[:5] = 0
    per_row[128:258] = 2
    d1 = torch.full((m, n), 1.0, dtype=torch.bfloat16)
    d2 = torch.full((m, n), 2.0, dtype=torch.bfloat16)
    gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d1, ends_t, use_psum_layout=True, backend="cpu")
    gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d2, per_row, backend="cpu")
    assert_bitwise_equal(d1, d2, ctx="psum layout vs per-row m_indices")
    assert_diff(d1.float(), _ref_contiguous(af, bf, per_row), 1e-3, "psum")
    # the op takes DeepGEMM's layout only: shuffled rows are rejected, naming the argument ...
    perm = torch.randperm(m, generator=torch.Generator().manual_seed(0))
    d3 = torch.empty((m, n), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"m_indices\[\d+\] = \d+ but the 128-row block from row \d+ begins with"):
        gemm.m_grouped_fp8_gemm_nt_contiguous((a[0][perm], a[1][perm]), b, d3, per_row[perm], backend="cpu")
    # ... while the cpu backend's kernels themselves take rows in any order (the op validates before them)
    gemm_cpu.cpu_contiguous("fp8", a[0][perm], a[1][perm], b[0], b[1], d3, per_row[perm])
    assert_bitwise_equal(d3, d2[perm], ctx="shuffled rows")


# CPU backend internals: the fused C++ dequantizer must give the torch dequantizers' bits.


def _fused_dequant():
    """The C++ dequantizer is part of every build of epkit._C: its absence is a build failure, not a skip."""
    ext = gemm_cpu.dequant_extension()
    assert ext is not None, "epkit._C lacks dequant_blocks: rebuild the extension (pip install -e .)"
    return ext


def _bits_equal_or_both_nan(got: torch.Tensor, want: torch.Tensor, ctx: str) -> None:
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), ctx + ": NaN positions differ"
    assert_bitwise_equal(got[~nan], want[~nan], ctx=ctx)


def _run_deq(kind, out, q, s, row_block, rows=None):
    _fused_dequant()
    deq = gemm_cpu._Dequant()
    deq.add(kind, out, q, s, row_block, rows=rows)
    deq.run()
    generic = out.clone()  # the generic (non-SIMD) loops must give the same bits
    deq.run(simd=False)
    assert_bitwise_equal(generic, out, ctx=f"{kind}: SIMD vs generic loops")
    return out


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fused_fp8_dequant_bitwise_all_codes(out_dtype):
    from epkit.quant import dequant_per_block_fp8, dequant_per_token_group_fp8

    gen = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    # every code in every 128-column block, in a different order per row; 200 rows, K = 384
    q = codes[torch.stack([torch.randperm(256, generator=gen) for _ in range(600)]).view(200, 768)[:, :384]]
    exps = torch.randint(-140, 120, (200, 3), generator=gen).float()  # includes bf16 under/overflow
    s_tok = torch.rand(200, 3, generator=gen) * torch.pow(2.0, exps)
    got = _run_deq("fp8", torch.empty(200, 384, dtype=out_dtype), q, s_tok, 1)
    _bits_equal_or_both_nan(got, dequant_per_token_group_fp8(q, s_tok).to(out_dtype), "per-token scales")
    s_blk = torch.rand(2, 3, generator=gen) * 4.0
    got = _run_deq("fp8", torch.empty(200, 384, dtype=out_dtype), q, s_blk, 128)
    _bits_equal_or_both_nan(got, dequant_per_block_fp8(q, s_blk).to(out_dtype), "128x128 block scales")
    # batched weights [G, N, K] with N not a multiple of the block, and a gathered row subset
    qb = q[:150].reshape(3, 50, 384)
    sb = torch.rand(3, 1, 3, generator=gen)
    got = _run_deq("fp8", torch.empty(3, 50, 384, dtype=out_dtype), qb, sb, 128)
    _bits_equal_or_both_nan(got, dequant_per_block_fp8(qb, sb).to(out_dtype), "batched blocks")
    rows = torch.randperm(200, generator=gen)[:77]
    got = _run_deq("fp8", torch.empty(77, 384, dtype=out_dtype), q, s_tok, 1, rows=rows)
    _bits_equal_or_both_nan(got, dequant_per_token_group_fp8(q[rows], s_tok[rows]).to(out_dtype), "row index")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fused_mxfp4_dequant_bitwise_all_codes(out_dtype):
    from epkit.quant import dequant_mxfp4

    gen = torch.Generator().manual_seed(1)
    # all 256 bytes (every nibble pair) under every e8m0 exponent 0..255, plus random rows
    packed = torch.cat(
        [
            torch.arange(256, dtype=torch.uint8).repeat(256, 1),
            torch.randint(0, 256, (40, 256), generator=gen, dtype=torch.uint8),
        ]
    )
    scale = torch.cat(
        [
            torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16),
            torch.randint(0, 256, (40, 16), generator=gen, dtype=torch.uint8),
        ]
    )
    got = _run_deq("fp8_fp4", torch.empty(296, 512, dtype=out_dtype), packed, scale, 1)
    _bits_equal_or_both_nan(got, dequant_mxfp4(packed, scale).to(out_dtype), "mxfp4")


# The fused AMX kernel (cpu backend, bf16 output, CPUs with AMX-BF16)


def test_amx_used_wherever_the_cpu_has_it():
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    want = {"amx_tile", "amx_bf16", "avx512_fp16", "avx512_bf16", "avx512bw", "avx512dq"} <= set(flags)
    have = gemm_cpu.amx_kernel() is not None
    assert have == want, f"AMX kernel available: {have}, cpu flags: {want}"


def _cpu_backend(kind, a, b, d, m_indices):
    """The cpu backend's contiguous path itself, which takes rows in any order (the op takes DeepGEMM's
    128-row-aligned layout only)."""
    (aq, sfa), (bq, sfb) = (a, b) if kind != "bf16" else ((a, None), (b, None))
    gemm_cpu.cpu_contiguous(kind, aq, sfa, bq, sfb, d, m_indices)
    return d


@requires_amx
@pytest.mark.parametrize("kind", KINDS)
def test_amx_matches_unfused_path(kind, monkeypatch):
    """Same operands, different summation order: the two cpu paths agree to float32 rounding, on
    tails (rows not a multiple of 32, N not a multiple of 32), empty groups and scattered rows."""
    gen = torch.Generator().manual_seed(11)
    for g, n, k in [(3, 200, 256), (5, 384, 1024), (1, 16, 128)]:
        counts = torch.randint(0, 70, (g,), generator=gen)
        counts[0] = 33
        if g > 1:
            counts[1] = 0
        m_indices = build_m_indices(counts)
        perm = torch.randperm(m_indices.numel(), generator=gen)
        for ids in (m_indices, m_indices[perm].contiguous()):  # grouped rows, then scattered rows
            m = ids.numel()
            a, b, af, bf = make_inputs(kind, g, m, n, k, masked=False, seed=g + n)
            outs = []
            for amx in (True, False):
                monkeypatch.setattr(gemm_cpu, "_AMX_ENABLED", [amx])
                outs.append(_cpu_backend(kind, a, b, torch.full((m, n), 9.0, dtype=torch.bfloat16), ids))
            ctx = f"{kind=} {g=} {n=} {k=} counts={counts.tolist()}"
            assert calc_diff(outs[0].float(), outs[1].float()) < 1e-5, ctx
            assert_bitwise_equal(outs[0][ids < 0], torch.zeros_like(outs[0][ids < 0]), ctx=ctx + " padding")
            assert_diff(outs[0].float(), _ref_contiguous(af, bf, ids), THRESH[kind], ctx)
        # masked, with the same tails
        m_max = 45
        am, bm, _, _ = make_inputs(kind, g, m_max, n, k, masked=True, seed=g * n)
        masked_m = torch.randint(0, m_max + 1, (g,), generator=gen, dtype=torch.int32)
        masked_m[0] = m_max
        outs = []
        for amx in (True, False):
            monkeypatch.setattr(gemm_cpu, "_AMX_ENABLED", [amx])
            dm = torch.full((g, m_max, n), -3.0, dtype=torch.bfloat16)
            outs.append(MASKED[kind](am, bm, dm, masked_m, m_max, backend="cpu"))
        live = torch.arange(m_max)[None, :] < masked_m[:, None].long()
        assert torch.equal(outs[0][~live], torch.full_like(outs[0][~live], -3.0)), "rows past masked_m untouched"
        assert calc_diff(outs[0][live].float(), outs[1][live].float()) < 1e-5, f"{kind=} masked {g=} {n=}"


@requires_amx
def test_amx_row_order_does_not_change_bits():
    """A row's result does not depend on where it sits: shuffled rows give the shuffled bits."""
    counts = [40, 0, 90]
    m_indices = build_m_indices(counts)
    m = m_indices.numel()
    a, b, _, _ = make_inputs("fp8", 3, m, 256, 512, masked=False, seed=2)
    d = CONTIG["fp8"](a, b, torch.empty(m, 256, dtype=torch.bfloat16), m_indices, backend="cpu")
    perm = torch.randperm(m, generator=torch.Generator().manual_seed(1))
    d_perm = _cpu_backend(
        "fp8", (a[0][perm], a[1][perm]), b, torch.empty(m, 256, dtype=torch.bfloat16), m_indices[perm]
    )
    assert_bitwise_equal(d_perm, d[perm], ctx="shuffled rows")
