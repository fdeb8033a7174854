"""``epkit.compat.deep_gemm``: DeepGEMM's signatures (``csrc/apis/*.hpp`` of deepseek-ai/DeepGEMM), its scale
layouts (float32 and packed UE8M0, TMA-aligned MN-major) and its settings, checked against epkit's GEMMs and
reference, with the call sequences vLLM (``vllm/utils/deep_gemm.py`` and its MoE experts) and SGLang
(``deep_gemm_wrapper``) use."""

from __future__ import annotations

import inspect
import os
import time

import pytest
import torch

import epkit.compat.deep_gemm as deep_gemm
from epkit import grouped_gemm as gemm
from epkit.compat._details.deep_gemm_runtime import SETTINGS, reset_settings
from epkit.quant import cast_to_mxfp4, per_block_cast_to_fp8, per_token_group_cast_to_fp8
from epkit.testing.markers import requires_cuda

G, N, K = 2, 128, 256


@pytest.fixture(autouse=True)
def _default_settings():
    yield
    reset_settings()


def _pack_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's packing of power-of-two float32 scales: their exponent bytes, 4 per int32 (padded with zeros)."""
    exps = ((sf.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return torch.nn.functional.pad(exps, (0, -sf.shape[-1] % 4)).contiguous().view(torch.int32)


def _inputs(m: int, seed: int, masked: bool = False, ue8m0: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((G, m, K) if masked else (m, K), generator=g)
    w = torch.randn(G, N, K, generator=g) / K**0.5
    return per_token_group_cast_to_fp8(x, ue8m0=ue8m0), per_block_cast_to_fp8(w), w


def _same(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what


def test_contiguous_fp8_float_and_packed_ue8m0_scales_agree_with_epkit():
    a, b, _ = _inputs(256, 1, ue8m0=True)
    layout = gemm.build_m_indices([100, 120])
    want = gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, torch.zeros(256, N, dtype=torch.bfloat16), layout)
    got = deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, torch.zeros(256, N, dtype=torch.bfloat16), layout)
    _same(got, want, "float32 scales")
    packed = (a[0], _pack_ue8m0(a[1]))  # [M, K/512] int32: 2 groups of 128 per int for K = 256 (padded)
    assert packed[1].shape == (256, 1)
    got = deep_gemm.m_grouped_fp8_gemm_nt_contiguous(packed, b, torch.zeros(256, N, dtype=torch.bfloat16), layout)
    _same(got, want, "packed UE8M0 activation scales")
    # packed by DeepGEMM's own helper, MN-major (strides (1, M) on [M, 1]: no dtype view of it works)
    tma_packed = (a[0], deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(a[1]))
    got = deep_gemm.m_grouped_fp8_gemm_nt_contiguous(tma_packed, b, torch.zeros(256, N, dtype=torch.bfloat16), layout)
    _same(got, want, "MN-major packed UE8M0 activation scales")
    mn_major = (a[0], deep_gemm.get_mn_major_tma_aligned_tensor(a[1]))  # as vLLM and SGLang pass them
    got = deep_gemm.m_grouped_fp8_gemm_nt_contiguous(mn_major, b, torch.zeros(256, N, dtype=torch.bfloat16), layout)
    _same(got, want, "MN-major scales")


def test_fp8_fp4_packed_scales_are_epkits_e8m0_bytes():
    a, _, w = _inputs(256, 2)
    packed, e8m0 = cast_to_mxfp4(w, ties="down", amax_min=1e-4)
    layout = gemm.build_m_indices([128, 60])
    want = gemm.m_grouped_fp8_fp4_gemm_nt_contiguous(a, (packed, e8m0), torch.zeros(256, N), layout)
    int_scales = e8m0.contiguous().view(torch.int32)  # [G, N, K/128]: DeepGEMM's packed UE8M0 weight scales
    for sfb in (int_scales, (e8m0.to(torch.int32) << 23).view(torch.float32)):
        got = deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous(
            a, (packed.view(torch.int8), sfb), torch.zeros(256, N), layout, recipe_a=(1, 128), recipe_b=(1, 32)
        )
        _same(got, want, str(sfb.dtype))


def test_psum_layout_at_another_alignment():
    deep_gemm.set_mk_alignment_for_contiguous_layout(256)
    assert (
        deep_gemm.get_mk_alignment_for_contiguous_layout() == 256 == deep_gemm.get_m_alignment_for_contiguous_layout()
    )
    assert deep_gemm.get_theoretical_mk_alignment_for_contiguous_layout(64) == 256
    a, b, _ = _inputs(768, 3)
    ends = torch.tensor([100, 600], dtype=torch.int32)
    for align in (256, 128):  # group 1 starts at the end of group 0 rounded up to the alignment
        deep_gemm.set_mk_alignment_for_contiguous_layout(align)
        rows = torch.full((768,), -1, dtype=torch.int32)
        rows[:100], rows[align:600] = 0, 1
        want = gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, torch.zeros(768, N), rows)
        got = deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, torch.zeros(768, N), ends, use_psum_layout=True)
        _same(got, want, f"psum at {align}")


def test_masked_bf16_and_the_dense_gemms():
    a, b, _ = _inputs(16, 4, masked=True)
    counts = torch.tensor([16, 7], dtype=torch.int32)
    want = gemm.m_grouped_fp8_gemm_nt_masked(a, b, torch.zeros(G, 16, N, dtype=torch.bfloat16), counts, 16)
    got = deep_gemm.fp8_m_grouped_gemm_nt_masked(a, b, torch.zeros(G, 16, N, dtype=torch.bfloat16), counts, 16)
    _same(got, want, "masked")
    xb, wb = a[0][0].float().bfloat16(), b[0][0].float().bfloat16()
    d = deep_gemm.bf16_gemm_nt(xb, wb, torch.empty(16, N))
    assert torch.allclose(d, xb.float() @ wb.float().T, atol=1e-3, rtol=1e-3)
    c = torch.randn(16, N)
    _same(deep_gemm.bf16_gemm_nt(xb, wb, torch.empty(16, N), c=c), d + c, "bf16 with c")
    _same(deep_gemm.bf16_gemm_nn(xb, wb.T.contiguous(), torch.empty(16, N)), d, "bf16 nn")
    one_a, one_b = (a[0][0], a[1][0]), (b[0][0], b[1][0])
    dense = deep_gemm.fp8_gemm_nt(one_a, one_b, torch.empty(16, N, dtype=torch.bfloat16))
    _same(dense[:16], want[0], "fp8 dense = one group of the masked GEMM")
    nn = deep_gemm.fp8_gemm_nn(one_a, (one_b[0].T, one_b[1].T), torch.empty(16, N, dtype=torch.bfloat16))
    _same(nn, dense, "fp8 nn")
    mm = torch.zeros(G, 16, N, dtype=torch.bfloat16)
    _same(deep_gemm.m_grouped_bf16_gemm_nt_masked(xb.expand(G, 16, K).contiguous(), wb.expand(G, N, K).contiguous(),
                                                  mm, counts, 16)[0], d.bfloat16(), "bf16 masked")  # fmt: skip


def test_layout_helpers():
    assert deep_gemm.get_tma_aligned_size(13, 4) == 16 and deep_gemm.get_tma_aligned_size(13, 1) == 16
    sf = torch.rand(3, 13, 6)
    t = deep_gemm.get_mn_major_tma_aligned_tensor(sf)
    assert t.stride() == (16 * 6, 1, 16) and torch.equal(t, sf)
    assert deep_gemm.get_mn_major_tma_aligned_tensor(t) is t
    pow2 = torch.exp2(torch.randint(-20, 5, (13, 6)).float())
    packed = deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(pow2)
    assert packed.dtype == torch.int32 and packed.shape == (13, 2) and packed.stride() == (1, 16)
    unpacked = (packed.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)[:, :6]
    _same(unpacked, pow2, "packed UE8M0 round trip")
    sfa = torch.rand(40, 2)
    moved = deep_gemm.transform_sf_into_required_layout(sfa, 40, 256, (1, 128, 128), is_sfa=True)
    assert moved.stride() == (1, 40) and torch.equal(moved, sfa)
    sfb = torch.rand(G, 1, 2)
    assert deep_gemm.transform_sf_into_required_layout(sfb, N, K, (1, 128, 128), num_groups=G, is_sfa=False) is sfb
    with pytest.raises(ValueError, match="sf must have shape"):
        deep_gemm.transform_sf_into_required_layout(sfb, N, K, (1, 128, 128), is_sfa=False)
    with pytest.raises(ValueError, match="needs is_sfa"):
        deep_gemm.transform_sf_into_required_layout(sfa, 40, 256, (1, 128, 128))


def test_refusals_name_deep_gemms_parameter():
    a, b, _ = _inputs(256, 5)
    layout = gemm.build_m_indices([10, 10])
    d = torch.zeros(256, N, dtype=torch.bfloat16)
    for kwargs, match in (
        (dict(recipe=(1, 1, 128)), r"recipe=\(1, 1, 128\).*1x128 activation scales"),
        (dict(recipe_a=(1, 128)), "both recipe_a and recipe_b"),
        (dict(compiled_dims="nz"), "compiled_dims"),
        (dict(ensure_zero_padding=1), "ensure_zero_padding must be a bool"),
        (dict(expected_m_for_psum_layout=-1), "expected_m_for_psum_layout"),
    ):
        with pytest.raises(ValueError, match=match):
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout, **kwargs)
    with pytest.raises(ValueError, match="a must be float8_e4m3fn"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a[0].view(torch.int8), a[1]), b, d, layout)
    with pytest.raises(ValueError, match="per-row packed UE8M0 weight scales"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, (b[0], b[1].view(torch.int32)), d, layout)
    fp4 = (torch.zeros(G, N, K // 2, dtype=torch.int8), torch.zeros(G, N, K // 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="nn form is for FP8 b"):
        deep_gemm.m_grouped_fp8_fp4_gemm_nn_contiguous(a, fp4, d, layout)
    for bad in (64, 0, 200):
        with pytest.raises(ValueError, match="new_value must be a positive multiple of 128"):
            deep_gemm.set_mk_alignment_for_contiguous_layout(bad)
    with pytest.raises(ValueError, match="new_num_sms"):
        deep_gemm.set_num_sms(-1)
    one = torch.zeros(8, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"bf16_gemm_nt: alpha=2\.0 is not supported"):
        deep_gemm.bf16_gemm_nt(one, one, torch.empty(8, 8), alpha=2.0)
    with pytest.raises(TypeError):
        deep_gemm.m_grouped_fp8_gemm_nt_masked(a, b, d, layout, 1, use_psum_layout=True)  # not DeepGEMM's either


def test_errors_name_the_alias_called():
    a, b, _ = _inputs(256, 12)
    layout = gemm.build_m_indices([10, 10])
    ma, mb, _ = _inputs(8, 13, masked=True)
    counts = torch.tensor([8, 8], dtype=torch.int32)
    one_a, one_b = (a[0][:8], a[1][:8]), (b[0][0], b[1][0])
    xb, wb = torch.zeros(G, 8, K, dtype=torch.bfloat16), torch.zeros(G, N, K, dtype=torch.bfloat16)
    calls = {  # a bad recipe: refused by epkit.compat.deep_gemm's own check
        "m_grouped_fp8_gemm_nt_contiguous": lambda **kw: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
            a, b, torch.zeros(256, N), layout, **kw),
        "m_grouped_fp8_gemm_nn_contiguous": lambda **kw: deep_gemm.m_grouped_fp8_gemm_nn_contiguous(
            a, (b[0].transpose(1, 2), b[1].transpose(1, 2)), torch.zeros(256, N), layout, **kw),
        "m_grouped_fp8_gemm_nt_masked": lambda **kw: deep_gemm.m_grouped_fp8_gemm_nt_masked(
            ma, mb, torch.zeros(G, 8, N), counts, 8, **kw),
        "fp8_m_grouped_gemm_nt_masked": lambda **kw: deep_gemm.fp8_m_grouped_gemm_nt_masked(
            ma, mb, torch.zeros(G, 8, N), counts, 8, **kw),
        "fp8_gemm_nt": lambda **kw: deep_gemm.fp8_gemm_nt(one_a, one_b, torch.zeros(8, N), **kw),
        "fp8_gemm_nn": lambda **kw: deep_gemm.fp8_gemm_nn(one_a, (one_b[0].T, one_b[1].T), torch.zeros(8, N), **kw),
    }  # fmt: skip
    for name, call in calls.items():
        call()  # the call itself is good
        with pytest.raises(ValueError, match=rf"^{name}: recipe=\(1, 1, 64\)"):
            call(recipe=(1, 1, 64))
    # refused by epkit's GEMM (d's shape), in the caller's terms too
    with pytest.raises(ValueError, match=r"^bf16_m_grouped_gemm_nt_masked: d must have shape \(2, 8, 128\)"):
        deep_gemm.bf16_m_grouped_gemm_nt_masked(xb, wb, torch.zeros(G, 8, 64), counts, 8)
    with pytest.raises(ValueError, match=r"^m_grouped_fp8_gemm_nt_contiguous: d must have shape \(256, 128\)"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, torch.zeros(256, 64), layout)
    # DeepGEMM's name of the layout argument, not epkit's (m_indices)
    with pytest.raises(ValueError, match=r"^m_grouped_fp8_gemm_nt_contiguous: grouped_layout must have shape \(256,\)"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, torch.zeros(256, N), layout[:100])
    bad = layout.clone()
    bad[3] = 5
    with pytest.raises(ValueError, match=r"^m_grouped_bf16_gemm_nn_contiguous: grouped_layout\[3\] = 5 is outside"):
        deep_gemm.m_grouped_bf16_gemm_nn_contiguous(
            torch.zeros(256, K, dtype=torch.bfloat16), wb.transpose(1, 2), torch.zeros(256, N), bad
        )


def test_dense_errors_quote_the_callers_shapes():
    a, b = per_token_group_cast_to_fp8(torch.randn(4, K)), per_block_cast_to_fp8(torch.randn(N, K))
    for b_bad, d, match in (
        ((b[0][:, :128], b[1]), torch.empty(4, N), r"a \[M, K\] \(4, 256\) and b \[N, K\] \(128, 128\) disagree on K$"),
        ((b[0], b[1][:, :1]), torch.empty(4, N), r"b's scales must be \(1, 2\) for these operands, got \(1, 1\)$"),
        (
            b,
            torch.empty(4, 64),
            r"d must be \[M, N\] = \(4, 128\) for a \[M, K\] \(4, 256\) and b \[N, K\] "
            r"\(128, 256\), got \(4, 64\)$",
        ),
    ):
        with pytest.raises(ValueError, match="^fp8_fp4_gemm_nt: " + match):
            deep_gemm.fp8_fp4_gemm_nt(a, b_bad, d)
    x = torch.zeros(4, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^bf16_gemm_nt: a \[M, K\] \(4, 256\) and b \[N, K\] \(128, 384\) disagree"):
        deep_gemm.bf16_gemm_nt(x, torch.zeros(N, 384, dtype=torch.bfloat16), torch.empty(4, N))
    with pytest.raises(ValueError, match=r"^bf16_gemm_nt: b must be a 2-D \[N, K\] tensor, got \(1, 128, 256\)$"):
        deep_gemm.bf16_gemm_nt(x, torch.zeros(1, N, K, dtype=torch.bfloat16), torch.empty(4, N))


def test_nn_errors_quote_b_as_passed():
    # b [.., K, N] (scales [.., K/128, N/128]) is checked as passed, before epkit transposes it to [.., N, K]
    a, b = per_token_group_cast_to_fp8(torch.randn(4, K)), per_block_cast_to_fp8(torch.randn(N, K))
    kn = (b[0].T, b[1].T)  # [256, 128], scales [2, 1]
    with pytest.raises(
        ValueError, match=r"^fp8_gemm_nn: b's scales must be \(2, 1\) for these operands, got \(1, 1\)$"
    ):
        deep_gemm.fp8_gemm_nn(a, (kn[0], kn[1][:1]), torch.empty(4, N))
    x = torch.zeros(4, K, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"^bf16_gemm_nn: a \[M, K\] \(4, 256\) and b \[K, N\] \(384, 128\) disagree on K$"
    ):
        deep_gemm.bf16_gemm_nn(x, torch.zeros(384, N, dtype=torch.bfloat16), torch.empty(4, N))
    ga, gb, _ = _inputs(256, 14)
    gkn = (gb[0].transpose(1, 2)[:, :128], gb[1].transpose(1, 2))  # K cut to 128: [G, 128, N]
    layout = gemm.build_m_indices([10, 10])
    msg = r"^m_grouped_fp8_gemm_nn_contiguous: b must have shape \(2, 256, 128\), got \(2, 128, 128\)$"
    with pytest.raises(ValueError, match=msg):
        deep_gemm.m_grouped_fp8_gemm_nn_contiguous(ga, gkn, torch.zeros(256, N), layout)
    msg = r"^m_grouped_bf16_gemm_nn_contiguous: b must be a \[G, K, N\] tensor, got shape \(256, 128\)$"
    with pytest.raises(ValueError, match=msg):
        deep_gemm.m_grouped_bf16_gemm_nn_contiguous(
            torch.zeros(256, K, dtype=torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16), torch.zeros(256, N),
            layout,
        )  # fmt: skip


def test_vllm_and_sglang_call_sequences():
    # vLLM: vllm/utils/deep_gemm.py wraps every call with disable_ue8m0_cast=not is_deep_gemm_e8m0_used()
    (a1q, a1q_scale), (w1, w1_scale), _ = _inputs(256, 6, ue8m0=True)
    expert_ids = gemm.build_m_indices([90, 100])
    mm1_out = torch.empty(256, N, dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
        (a1q, deep_gemm.get_mn_major_tma_aligned_tensor(a1q_scale)), (w1, w1_scale), mm1_out, expert_ids,
        disable_ue8m0_cast=False,
    )  # fmt: skip
    want = gemm.grouped_gemm_reference("fp8", a1q, a1q_scale, w1, w1_scale, torch.empty_like(mm1_out), expert_ids)
    assert (mm1_out.float() - want.float()).abs().max() < 0.1
    assert deep_gemm.get_mk_alignment_for_contiguous_layout() == 128
    (a, a_s), b, _ = _inputs(8, 7, masked=True)
    expert_num_tokens = torch.tensor([8, 3], dtype=torch.int32)
    out = torch.zeros(G, 8, N, dtype=torch.bfloat16)
    deep_gemm.fp8_m_grouped_gemm_nt_masked((a, a_s), b, out, expert_num_tokens, 8, disable_ue8m0_cast=True)
    # SGLang: deep_gemm_wrapper (masked, contiguous, dense) and configure_deep_gemm_num_sms
    lhs, rhs = (a, a_s), b
    again = torch.zeros_like(out)
    original_num_sms = deep_gemm.get_num_sms()
    deep_gemm.set_num_sms(1)
    try:
        assert deep_gemm.get_num_sms() == 1
        deep_gemm.fp8_m_grouped_gemm_nt_masked(lhs, rhs, again, expert_num_tokens, 8)
    finally:
        deep_gemm.set_num_sms(original_num_sms)
    assert deep_gemm.get_num_sms() == original_num_sms
    _same(again, out, "the same GEMM with another SM count")
    dense = torch.empty(8, N, dtype=torch.bfloat16)
    deep_gemm.fp8_gemm_nt((a[0], a_s[0]), (b[0][0], b[1][0]), dense)
    _same(dense, out[0], "dense")


def test_runtime_settings_are_recorded_and_change_no_result():
    a, b, _ = _inputs(16, 11, masked=True)
    counts = torch.tensor([16, 5], dtype=torch.int32)
    before = deep_gemm.m_grouped_fp8_gemm_nt_masked(a, b, torch.zeros(G, 16, N), counts, 16)
    assert (deep_gemm.get_tc_util(), deep_gemm.get_pdl()) == (100, False)  # DeepGEMM's defaults
    assert (SETTINGS.ignore_compile_dims, SETTINGS.block_size_multiple_of) == (False, (1, 1))
    deep_gemm.set_tc_util(40)
    deep_gemm.set_pdl(True)
    deep_gemm.set_ignore_compile_dims(True)
    deep_gemm.set_block_size_multiple_of(64)
    assert (deep_gemm.get_tc_util(), deep_gemm.get_pdl()) == (40, True)
    assert (SETTINGS.ignore_compile_dims, SETTINGS.block_size_multiple_of) == (True, (64, 64))
    deep_gemm.set_block_size_multiple_of((32, 16))
    assert SETTINGS.block_size_multiple_of == (32, 16)
    after = deep_gemm.m_grouped_fp8_gemm_nt_masked(a, b, torch.zeros(G, 16, N), counts, 16)
    _same(after, before, "the same GEMM under other runtime settings")
    deep_gemm.set_tc_util(0)  # DeepGEMM: 0 unsets it, and unset reads as 100
    deep_gemm.set_pdl(False)
    assert (deep_gemm.get_tc_util(), deep_gemm.get_pdl()) == (100, False)
    for setter, bad, match in (
        (deep_gemm.set_tc_util, 101, r"new_tc_util must be an int in \[0, 100\]"),
        (deep_gemm.set_tc_util, True, "new_tc_util"),
        (deep_gemm.set_pdl, 1, "new_enable_pdl must be a bool"),
        (deep_gemm.set_ignore_compile_dims, "yes", "new_value must be a bool"),
        (deep_gemm.set_block_size_multiple_of, 0, "positive int or a"),
        (deep_gemm.set_block_size_multiple_of, (8, 8, 8), "positive int or a"),
    ):
        with pytest.raises(ValueError, match=match):
            setter(bad)
    assert SETTINGS.block_size_multiple_of == (32, 16) and SETTINGS.ignore_compile_dims


def test_testing_helpers():
    t = deep_gemm.testing
    x = torch.tensor([1.0, 0.0])
    assert t.calc_diff(x, torch.tensor([0.0, 1.0])) == 1.0 and t.calc_diff(x, x) == 0.0
    assert t.calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    # 3 float32 + 4 bf16 + 5 int8, through a tuple and a list, None skipped
    assert t.count_bytes(torch.zeros(3), (torch.zeros(2, 2, dtype=torch.bfloat16), None), [torch.zeros(5).char()]) == 25
    t.assert_bitwise_equal(torch.tensor([1.0, -0.0]), torch.tensor([1.0, -0.0]))
    with pytest.raises(AssertionError, match=r"bitwise mismatch \(zeros\): 1 of 8 bytes differ; the first is byte 7"):
        t.assert_bitwise_equal(torch.tensor([1.0, 0.0]), torch.tensor([1.0, -0.0]), "zeros")  # the sign byte
    with pytest.raises(AssertionError, match="bitwise mismatch"):
        t.assert_bitwise_equal(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    if not torch.cuda.is_available():
        assert t.get_arch_major() == 9  # SM90: the architecture epkit.compat.deep_gemm follows


def test_timing_stand_ins_time_whole_calls_on_the_host(monkeypatch):
    t = deep_gemm.testing
    calls, barriers = [], []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    sec = t.bench(fn, num_warmups=2, num_tests=3)
    assert len(calls) == 5 and 0.002 <= sec < 1.0
    calls.clear()
    both = t.bench_kineto(fn, ("gemm", "reduce"), num_tests=4, barrier=lambda: barriers.append(1))
    assert len(calls) == 5 and len(barriers) == 4  # one warm-up call, then each timed call after the barrier
    assert isinstance(both, tuple) and len(both) == 2 and both[0] == both[1] and 0.002 <= both[0] < 1.0
    assert isinstance(t.bench_kineto(fn, "gemm", num_tests=1), float)
    calls.clear()
    monkeypatch.setenv("DG_USE_NVIDIA_TOOLS", "1")  # DeepGEMM: under NVIDIA's tools it returns 1 and runs nothing
    assert t.bench_kineto(fn, ("a", "b")) == (1.0, 1.0) and t.bench_kineto(fn, "a") == 1.0 and calls == []


def test_test_filter_and_ignore_env(monkeypatch, capsys):
    t = deep_gemm.testing
    ran = []
    t.test_filter(lambda: False)(lambda: ran.append("no"))()
    t.test_filter(lambda: True)(lambda: ran.append("yes"))()
    assert ran == ["yes"] and "Filtered by" in capsys.readouterr().out
    monkeypatch.setenv("EPKIT_TEST_ENV", "1")
    seen = []

    @t.ignore_env("EPKIT_TEST_ENV", lambda: True)
    def body():
        seen.append(os.environ.get("EPKIT_TEST_ENV"))
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        body()
    assert seen == [None] and os.environ["EPKIT_TEST_ENV"] == "1"  # unset inside, back afterwards
    t.ignore_env("EPKIT_TEST_ENV", lambda: False)(lambda: seen.append(os.environ.get("EPKIT_TEST_ENV")))()
    assert seen == [None, "1"]


# DeepGEMM's Python signatures (pybind11 definitions in csrc/apis/gemm.hpp and layout.hpp)
_FP8 = "recipe=None recipe_a=None recipe_b=None compiled_dims='nk' disable_ue8m0_cast=False"
SIGNATURES = {
    "m_grouped_fp8_fp4_gemm_nt_contiguous": f"a b d grouped_layout {_FP8} use_psum_layout=False "
    "ensure_zero_padding=True expected_m_for_psum_layout=None",
    "m_grouped_fp8_fp4_gemm_nn_contiguous": f"a b d grouped_layout {_FP8} use_psum_layout=False "
    "ensure_zero_padding=True",
    "m_grouped_fp8_fp4_gemm_nt_masked": f"a b d masked_m expected_m {_FP8}",
    "fp8_fp4_gemm_nt": f"a b d c=None {_FP8} alpha=None",
    "fp8_fp4_gemm_nn": f"a b d c=None {_FP8} alpha=None",
    "bf16_gemm_nt": "a b d c=None compiled_dims='nk' alpha=None",
    "bf16_gemm_nn": "a b d c=None compiled_dims='nk' alpha=None",
    "fp8_fp4_gemm_tn": f"a b d c=None {_FP8.replace('nk', 'mn')} alpha=None",
    "fp8_fp4_gemm_tt": f"a b d c=None {_FP8.replace('nk', 'mn')} alpha=None",
    "bf16_gemm_tn": "a b d c=None compiled_dims='mn' alpha=None",
    "bf16_gemm_tt": "a b d c=None compiled_dims='mn' alpha=None",
    "k_grouped_fp8_gemm_nt_contiguous": "a b d ks_cpu grouped_layout c=None recipe=(1, 1, 128) compiled_dims='mn' "
    "use_psum_layout=False",
    "k_grouped_fp8_gemm_tn_contiguous": "a b d ks_cpu grouped_layout c=None recipe=(1, 1, 128) compiled_dims='mn' "
    "use_psum_layout=False",
    "k_grouped_bf16_gemm_tn_contiguous": "a b d ks_cpu grouped_layout c=None compiled_dims='mn' use_psum_layout=False",
    "cublaslt_gemm_nt": "a b d c=None",
    "cublaslt_gemm_nn": "a b d c=None",
    "cublaslt_gemm_tn": "a b d c=None",
    "cublaslt_gemm_tt": "a b d c=None",
    "einsum": "expr a b d c=None use_cublaslt=False",
    "fp8_einsum": "expr a b d c=None recipe=(1, 128, 128)",
    "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor": "sf grouped_layout ks_cpu gran_k k_alignment "
    "use_psum_layout=False",
    "m_grouped_bf16_gemm_nt_contiguous": "a b d grouped_layout compiled_dims='nk' use_psum_layout=False "
    "ensure_zero_padding=True expected_m_for_psum_layout=None",
    "m_grouped_bf16_gemm_nn_contiguous": "a b d grouped_layout compiled_dims='nk' use_psum_layout=False "
    "ensure_zero_padding=True",
    "m_grouped_bf16_gemm_nt_masked": "a b d masked_m expected_m compiled_dims='nk'",
    "transform_sf_into_required_layout": "sf mn k recipe num_groups=None is_sfa=None disable_ue8m0_cast=False "
    "psum_layout=None",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor": "sf psum_layout=None",
    "get_theoretical_mk_alignment_for_contiguous_layout": "expected_m=None",
    # csrc/apis/runtime.hpp (pybind11 lambdas: positional, named here as there)
    "set_tc_util": "new_tc_util",
    "get_tc_util": "",
    "set_pdl": "new_enable_pdl",
    "get_pdl": "",
    "set_ignore_compile_dims": "new_value",
    "set_block_size_multiple_of": "new_value",
    # deep_gemm/testing/*.py
    "testing.bench": "fn num_warmups=5 num_tests=10 high_precision=False",
    "testing.bench_kineto": "fn kernel_names num_tests=30 suppress_kineto_output=False trace_path=None flush_l2=True "
    "with_multiple_kernels=False barrier=None",
    "testing.calc_diff": "x y",
    "testing.count_bytes": "tensors",
    "testing.assert_bitwise_equal": "x y label=''",
    "testing.get_arch_major": "",
    "testing.test_filter": "condition",
    "testing.ignore_env": "name condition",
}
ALIASES = {
    "fp8_gemm_nt": "fp8_fp4_gemm_nt",
    "fp8_gemm_nn": "fp8_fp4_gemm_nn",
    "fp8_gemm_tn": "fp8_fp4_gemm_tn",
    "fp8_gemm_tt": "fp8_fp4_gemm_tt",
    "m_grouped_fp8_gemm_nt_contiguous": "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nn_contiguous": "m_grouped_fp8_fp4_gemm_nn_contiguous",
    "m_grouped_fp8_gemm_nt_masked": "m_grouped_fp8_fp4_gemm_nt_masked",
    "fp8_m_grouped_gemm_nt_masked": "m_grouped_fp8_fp4_gemm_nt_masked",
    "bf16_m_grouped_gemm_nt_masked": "m_grouped_bf16_gemm_nt_masked",
    "get_m_alignment_for_contiguous_layout": "get_mk_alignment_for_contiguous_layout",
    "get_k_alignment_for_contiguous_layout": "get_mk_alignment_for_contiguous_layout",
}


def _sig(fn) -> str:
    return " ".join(
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in inspect.signature(fn).parameters.values()
    )


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signatures_are_deep_gemms(name):
    fn = deep_gemm
    for part in name.split("."):
        fn = getattr(fn, part)
    assert _sig(fn) == SIGNATURES[name]


def test_aliases_are_deep_gemms():
    for alias, target in ALIASES.items():
        fn, same = getattr(deep_gemm, alias), getattr(deep_gemm, target)
        if alias.startswith("get_"):
            assert fn is same, alias
        else:  # the same call under DeepGEMM's other name, which its errors give (test_errors_name_the_alias_called)
            assert fn.__name__ == alias and _sig(fn) == _sig(same) and f":func:`{target}`" in fn.__doc__, alias
    assert set(deep_gemm.__all__) >= {n for n in SIGNATURES if "." not in n} | set(ALIASES)


# What ``import deep_gemm`` binds in DeepGEMM 2.6.1 (deep_gemm/__init__.py: its imports from _C, the aliases, the
# mega-MoE entry points, the submodules and the names of ``from .utils import *``), written out here by hand
_NAMES = """
set_num_sms get_num_sms set_tc_util get_tc_util set_ignore_compile_dims set_block_size_multiple_of set_pdl get_pdl
cublaslt_gemm_nt cublaslt_gemm_nn cublaslt_gemm_tn cublaslt_gemm_tt
fp8_fp4_gemm_nt fp8_fp4_gemm_nn fp8_fp4_gemm_tn fp8_fp4_gemm_tt m_grouped_fp8_fp4_gemm_nt_contiguous
m_grouped_fp8_fp4_gemm_nn_contiguous m_grouped_fp8_fp4_gemm_nt_masked
fp8_gemm_nt fp8_gemm_nn fp8_gemm_tn fp8_gemm_tt fp8_gemm_nt_skip_head_mid m_grouped_fp8_gemm_nt_contiguous
m_grouped_fp8_gemm_nn_contiguous m_grouped_fp8_gemm_nt_masked k_grouped_fp8_gemm_nt_contiguous
k_grouped_fp8_gemm_tn_contiguous
bf16_gemm_nt bf16_gemm_nn bf16_gemm_tn bf16_gemm_tt m_grouped_bf16_gemm_nt_contiguous m_grouped_bf16_gemm_nn_contiguous
m_grouped_bf16_gemm_nt_masked k_grouped_bf16_gemm_tn_contiguous
einsum fp8_einsum
fp8_fp4_mqa_logits get_paged_mqa_logits_metadata fp8_fp4_paged_mqa_logits fp8_mqa_logits fp8_paged_mqa_logits
tf32_hc_prenorm_gemm transform_sf_into_required_layout
fp8_m_grouped_gemm_nt_masked bf16_m_grouped_gemm_nt_masked
mega SymmBuffer get_symm_buffer_for_mega_moe transform_weights_for_mega_moe fp8_fp4_mega_moe bf16_mega_moe
testing utils legacy
get_tma_aligned_size get_mn_major_tma_aligned_tensor get_mn_major_tma_aligned_packed_ue8m0_tensor
get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor set_mk_alignment_for_contiguous_layout
get_mk_alignment_for_contiguous_layout get_theoretical_mk_alignment_for_contiguous_layout
get_m_alignment_for_contiguous_layout get_k_alignment_for_contiguous_layout
ceil_div align ceil_to_ue8m0 pack_ue8m0_to_int per_token_cast_to_fp8 per_channel_cast_to_fp8 per_block_cast_to_fp8
per_custom_dims_cast_to_fp8 per_token_cast_to_fp4 transpose_packed_fp4 unpack_ue8m0_from_int cast_back_from_fp4
init_dist uneven_all_gather
"""
DEEP_GEMM_NAMES = _NAMES.split()
# The split: kernels and helpers epkit means to provide (all of them are, since the Mega MoE interface: the
# not-yet table is empty), and those outside its scope
OUT_OF_SCOPE = {
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "fp8_fp4_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
    "get_paged_mqa_logits_metadata",
    "tf32_hc_prenorm_gemm",
    "fp8_gemm_nt_skip_head_mid",
}


def _missing(name: str) -> str:
    with pytest.raises(AttributeError) as exc:
        getattr(deep_gemm, name)
    assert exc.value.name == name
    return str(exc.value)


def test_every_deep_gemm_name_is_provided_or_says_why_not():
    from epkit.compat._details import deep_gemm_coverage as cov

    assert len(DEEP_GEMM_NAMES) == len(set(DEEP_GEMM_NAMES)) == 80
    assert set(deep_gemm.__all__) <= set(DEEP_GEMM_NAMES), "a provided name DeepGEMM does not have"
    assert not set(cov.NOT_YET_PROVIDED) & set(cov.OUT_OF_SCOPE)
    assert cov.NOT_YET_PROVIDED == {} and set(cov.OUT_OF_SCOPE) >= OUT_OF_SCOPE
    for name in DEEP_GEMM_NAMES:
        provided = name in deep_gemm.__all__
        assert provided == hasattr(deep_gemm, name), name
        assert provided + (name in cov.NOT_YET_PROVIDED) + (name in cov.OUT_OF_SCOPE) == 1, name
    assert set(cov.NOT_YET_PROVIDED) | set(cov.OUT_OF_SCOPE) <= set(DEEP_GEMM_NAMES)


def test_a_name_not_provided_says_what_to_install():
    for name in sorted(OUT_OF_SCOPE):
        msg = _missing(name)
        assert msg.startswith(f"module 'epkit.compat.deep_gemm' has no attribute '{name}': "), msg
        assert f"epkit does not provide {name}" in msg and "outside epkit's scope" in msg, msg
        assert "DeepGEMM itself" in msg and "sm_90 or sm_100 GPU" in msg, msg
        assert "not yet" not in msg, msg
    assert "attention-indexer kernel" in _missing("fp8_paged_mqa_logits")
    msg = _missing("fp8_gemm_ntt")  # a typo: DeepGEMM has no such name either
    assert msg == (
        "module 'epkit.compat.deep_gemm' has no attribute 'fp8_gemm_ntt': it is not part of DeepGEMM's interface as "
        "epkit knows it (`epkit info` lists what is provided)"
    )
    assert _missing("__wrapped__") == "module 'epkit.compat.deep_gemm' has no attribute '__wrapped__'"
    assert deep_gemm.__version__ == "2.6.1"
    assert getattr(deep_gemm, "fp8_mqa_logits", None) is None  # engines probe with getattr(..., None) / hasattr
    with pytest.raises(ImportError, match="epkit does not provide fp8_paged_mqa_logits.*DeepGEMM itself"):
        exec("from epkit.compat.deep_gemm import fp8_paged_mqa_logits")

    # the "not yet provided" message, for a name the table lists (none today: a stand-in)
    from epkit.compat._details import deep_gemm_coverage as cov

    cov.NOT_YET_PROVIDED["future_gemm"] = "a GEMM to come"
    try:
        msg = str(cov.missing_name_error("epkit.compat.deep_gemm", "future_gemm"))
    finally:
        del cov.NOT_YET_PROVIDED["future_gemm"]
    assert "future_gemm, DeepGEMM's a GEMM to come, is not yet provided by epkit" in msg and "sm_90" in msg, msg


@requires_cuda
def test_gpu_deep_gemm_calls_give_epkits_bits_and_a_cuda_graph_holds_them():
    # rung 4: the DeepGEMM-style calls engines make (packed UE8M0 activation scales in the MN-major layout, a psum
    # layout at another alignment, the masked decode GEMM) on CUDA tensors give the bits of epkit's own GEMM on the
    # same tensors, and capture and replay in a CUDA graph (every scale conversion is a device op)
    def cuda(pair):
        return tuple(t.cuda() for t in pair)

    a, b = (cuda(p) for p in _inputs(768, 9, ue8m0=True)[:2])
    rows = torch.full((768,), -1, dtype=torch.int32)
    rows[:100], rows[256:600] = 0, 1
    ends, rows = torch.tensor([100, 600], dtype=torch.int32).cuda(), rows.cuda()
    want = gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, torch.zeros(768, N, dtype=torch.bfloat16).cuda(), rows)
    ma, mb = (cuda(p) for p in _inputs(16, 10, masked=True)[:2])
    counts = torch.tensor([16, 7], dtype=torch.int32).cuda()
    want_m = gemm.m_grouped_fp8_gemm_nt_masked(ma, mb, torch.zeros(G, 16, N, dtype=torch.bfloat16).cuda(), counts, 16)
    packed = (a[0], deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(a[1]))
    d, dm = torch.zeros_like(want), torch.zeros_like(want_m)

    def calls():
        deep_gemm.set_mk_alignment_for_contiguous_layout(256)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(packed, b, d, ends, use_psum_layout=True)
        deep_gemm.set_mk_alignment_for_contiguous_layout(128)
        deep_gemm.m_grouped_fp8_gemm_nt_masked(ma, mb, dm, counts, 16)

    calls()  # eager (and the kernels' compilation, outside the capture)
    torch.cuda.synchronize()
    _same(d, want, "psum at 256, packed UE8M0 scales")
    _same(dm, want_m, "masked")
    d.zero_()
    dm.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    torch.cuda.synchronize()
    _same(d, want, "replayed contiguous")
    _same(dm, want_m, "replayed masked")
