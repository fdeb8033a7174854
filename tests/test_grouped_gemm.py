import pytest
import torch

import epkit._details.grouped_gemm_cpu as gemm_cpu
import epkit.grouped_gemm as gemm
from epkit.grouped_gemm import build_m_indices, get_mk_alignment_for_contiguous_layout, make_inputs
from epkit.testing import assert_bitwise_equal, assert_diff, calc_diff
from epkit.testing.markers import requires_triton

KINDS = ["fp8", "fp8_fp4", "bf16"]
THRESH = {"fp8": 1e-3, "fp8_fp4": 1e-2, "bf16": 1e-5}
CONTIG = {k: getattr(gemm, f"m_grouped_{k}_gemm_nt_contiguous") for k in KINDS}
MASKED = {k: getattr(gemm, f"m_grouped_{k}_gemm_nt_masked") for k in KINDS}
SHAPES_CPU = [(256, 512), (512, 256), (384, 1024)]


def _ref_contiguous(af, bf, m_indices):
    """float32 matmul of the UNQUANTIZED inputs, row by expert id; zeros for padding rows."""
    ids = m_indices.long()
    out = torch.einsum("mk,mnk->mn", af.float(), bf.float()[ids.clamp(min=0)])
    out[ids < 0] = 0
    return out


def _counts(g, seed, hi=150):
    gen = torch.Generator().manual_seed(seed)
    c = torch.randint(0, hi, (g,), generator=gen)
    c[seed % g] = 0  # always one empty group
    return c


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "g,n,k,backend",
    [(g, n, k, "cpu") for g in (1, 4, 8) for n, k in SHAPES_CPU] + [(4, 256, 512, "reference")],
)
def test_contiguous_cpu(kind, g, n, k, backend):
    counts = _counts(g, g * 7 + n + k)
    m_indices = build_m_indices(counts)
    m = m_indices.numel()
    a, b, af, bf = make_inputs(kind, g, m, n, k, masked=False, seed=g + n + k)
    d = torch.full((m, n), 7.0, dtype=torch.bfloat16)
    CONTIG[kind](a, b, d, m_indices, backend=backend)
    ctx = f"{kind=} {g=} {n=} {k=} {backend=} counts={counts.tolist()}"
    pad = m_indices < 0
    assert_bitwise_equal(d[pad], torch.zeros(int(pad.sum()), n, dtype=torch.bfloat16), ctx=ctx + " padding rows")
    if m:
        assert_diff(d.float(), _ref_contiguous(af, bf, m_indices), THRESH[kind], ctx)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("g,m_max", [(1, 1), (4, 64), (8, 96)])
def test_masked_cpu(kind, g, m_max):
    n, k = 256, 512
    a, b, af, bf = make_inputs(kind, g, m_max, n, k, masked=True, seed=g * 3 + m_max)
    gen = torch.Generator().manual_seed(g)
    masked_m = torch.randint(0, m_max + 1, (g,), generator=gen, dtype=torch.int32)
    masked_m[0] = m_max
    if g > 1:
        masked_m[1] = 0
    d = torch.full((g, m_max, n), -3.0, dtype=torch.float32)
    MASKED[kind](a, b, d, masked_m, m_max, backend="cpu")
    ref = torch.einsum("gmk,gnk->gmn", af.float(), bf.float())
    live = torch.arange(m_max)[None, :] < masked_m[:, None].long()
    ctx = f"{kind=} {g=} {m_max=} masked_m={masked_m.tolist()}"
    assert torch.equal(d[~live], torch.full_like(d[~live], -3.0)), ctx + ": rows beyond masked_m must be untouched"
    assert_diff(d[live], ref[live], THRESH[kind], ctx)


def test_build_m_indices():
    assert get_mk_alignment_for_contiguous_layout() == 128
    assert build_m_indices([1, 0, 2], alignment=2).tolist() == [0, -1, 2, 2]
    ids = build_m_indices(torch.tensor([130, 0, 128]))
    assert ids.dtype == torch.int32 and ids.numel() == 256 + 128
    assert (ids[:130] == 0).all() and (ids[130:256] == -1).all() and (ids[256:] == 2).all()
    assert build_m_indices([]).numel() == 0
    with pytest.raises(ValueError, match="counts >= 0"):
        build_m_indices([3, -1])


def test_large_m_cpu():
    # M > 65536 rows (64-bit offsets), tiny N and K.
    g, n, k = 2, 16, 128
    m_indices = build_m_indices([40000, 30001])
    m = m_indices.numel()
    assert m > 65536
    a, b, af, bf = make_inputs("fp8", g, m, n, k, masked=False, seed=3)
    d = torch.empty((m, n), dtype=torch.bfloat16)
    gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, backend="cpu")
    assert_diff(d.float(), _ref_contiguous(af, bf, m_indices), 1e-3, f"{m=}")
    assert (d[m_indices < 0] == 0).all()


def test_bad_input():
    a, b, _, _ = make_inputs("fp8", 2, 8, 128, 256, masked=False)
    d = torch.empty(8, 128, dtype=torch.bfloat16)
    ok = torch.zeros(8, dtype=torch.int32)
    f = gemm.m_grouped_fp8_gemm_nt_contiguous
    with pytest.raises(ValueError, match=r"m_indices\[3\] = 2 is outside \[-1, 2\)"):
        f(a, b, d, torch.tensor([0, 0, 0, 2, 0, 0, 0, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"= -2 is outside"):
        f(a, b, d, torch.full((8,), -2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"sfa must have shape \(8, 2\)"):
        f((a[0], a[1][:, :1]), b, d, ok)
    with pytest.raises(ValueError, match="sfb must be torch.float32"):
        f(a, (b[0], b[1].double()), d, ok)
    with pytest.raises(ValueError, match="multiple of the scale block 128"):
        f((a[0][:, :200], a[1]), b, d, ok)
    with pytest.raises(ValueError, match=r"d must have shape \(8, 128\)"):
        f(a, b, torch.empty(8, 64, dtype=torch.bfloat16), ok)
    with pytest.raises(ValueError, match="m_indices must have shape"):
        f(a, b, d, ok[:5])
    with pytest.raises(ValueError, match="psum layout"):
        f(a, b, d, torch.tensor([6, 3], dtype=torch.int32), use_psum_layout=True)
    with pytest.raises(ValueError, match=r"m_indices\[4\] = 1 but the 128-row block from row 0 begins with"):
        f(a, b, d, torch.tensor([0] * 4 + [1] * 4, dtype=torch.int32))  # group 1 does not start a block
    with pytest.raises(ValueError, match=r"m_indices\[2\] = 0 but .* begins with m_indices\[0\] = -1"):
        f(a, b, d, torch.tensor([-1, -1] + [0] * 6, dtype=torch.int32))  # padding before the group's rows
    with pytest.raises(ValueError, match="share one device"):
        f(a, b, d.to("meta"), ok)
    am, bm, _, _ = make_inputs("fp8_fp4", 2, 8, 128, 256, masked=True)
    dm = torch.empty(2, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"masked_m\[1\] = 9 is outside \[0, M_max = 8\]"):
        gemm.m_grouped_fp8_fp4_gemm_nt_masked(am, bm, dm, torch.tensor([1, 9], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="b must be torch.uint8"):
        gemm.m_grouped_fp8_fp4_gemm_nt_masked(
            am, (bm[0].to(torch.int32), bm[1]), dm, torch.ones(2, dtype=torch.int32), 4
        )
    with pytest.raises(ValueError, match="single bf16 tensor"):
        gemm.m_grouped_bf16_gemm_nt_masked(am, bm, dm, torch.ones(2, dtype=torch.int32), 4)


# Rung 2: the Triton kernel sources under the interpreter (small shapes): the persistent TMA kernel (the
# default config) and the tile-grid kernel (an overridden config).

TRITON_KERNELS = ["persistent", "tiles"]


@pytest.fixture
def triton_kernel(request, monkeypatch):
    """Run the test with the named Triton kernel: the heuristic's persistent config, or a tile-grid config
    installed as the override."""
    from epkit.kernels.triton import grouped_gemm_configs as cfgs

    if request.param == "tiles":

        def tiles(kind, n, k, m_hint, device_type):
            return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64 if kind == "bf16" else 128, num_warps=4, num_stages=1)

        monkeypatch.setattr(cfgs, "_CONFIG_OVERRIDE", tiles)
    return request.param


@requires_triton
@pytest.mark.parametrize("triton_kernel", TRITON_KERNELS, indirect=True)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("g", [1, 4])
def test_contiguous_triton_interpreter(kind, g, triton_kernel):
    n, k = 128, 256
    counts = _counts(g, g + 1, hi=40)
    m_indices = build_m_indices(counts)
    m = m_indices.numel()
    a, b, af, bf = make_inputs(kind, g, m, n, k, masked=False, seed=g)
    d = torch.full((m, n), 5.0, dtype=torch.bfloat16)
    CONTIG[kind](a, b, d, m_indices, backend="triton")
    ctx = f"triton {triton_kernel} {kind=} {g=} counts={counts.tolist()}"
    assert (d[m_indices < 0] == 0).all(), ctx
    if m:
        assert_diff(d.float(), _ref_contiguous(af, bf, m_indices), THRESH[kind], ctx)
        want = CONTIG[kind](a, b, torch.empty_like(d), m_indices, backend="reference")
        assert_diff(d.float(), want.float(), 1e-5, ctx + " vs reference backend")


@requires_triton
@pytest.mark.parametrize("triton_kernel", TRITON_KERNELS, indirect=True)
@pytest.mark.parametrize("kind", KINDS)
def test_masked_triton_interpreter(kind, triton_kernel):
    g, m_max, n, k = 3, 40, 96, 256
    a, b, af, bf = make_inputs(kind, g, m_max, n, k, masked=True, seed=9)
    masked_m = torch.tensor([m_max, 0, 17], dtype=torch.int32)
    d = torch.full((g, m_max, n), 9.0, dtype=torch.float32)
    MASKED[kind](a, b, d, masked_m, 20, backend="triton")
    live = torch.arange(m_max)[None, :] < masked_m[:, None].long()
    ref = torch.einsum("gmk,gnk->gmn", af.float(), bf.float())
    assert (d[~live] == 9.0).all(), f"{kind} {triton_kernel}: rows beyond masked_m must be untouched"
    assert_diff(d[live], ref[live], THRESH[kind], f"triton {triton_kernel} masked {kind=}")


@requires_triton
@pytest.mark.parametrize("triton_kernel", TRITON_KERNELS, indirect=True)
def test_masked_kernel_clamps_counts_it_never_reads_on_the_host(triton_kernel):
    # On a GPU the op passes masked_m to the kernel unread (no sync): out-of-range counts must stay in
    # their group (a count above M_max once wrote the next group's first rows).
    from epkit.kernels.triton.grouped_gemm import grouped_gemm_masked

    g, m_max, n, k = 3, 40, 96, 256
    (aq, asf), (bq, bsf), af, bf = make_inputs("fp8", g, m_max, n, k, masked=True, seed=9)
    d = torch.full((g, m_max, n), 9.0, dtype=torch.float32)
    grouped_gemm_masked("fp8", aq, asf, bq, bsf, d, torch.tensor([m_max + 30, -5, 17], dtype=torch.int32), 20)
    live = torch.arange(m_max)[None, :] < torch.tensor([m_max, 0, 17])[:, None]
    ref = torch.einsum("gmk,gnk->gmn", af.float(), bf.float())
    assert (d[~live] == 9.0).all(), "rows outside the clamped counts must be untouched"
    assert_diff(d[live], ref[live], THRESH["fp8"], "clamped masked_m")


@requires_triton
def test_large_m_triton_interpreter_with_config_override():
    from epkit.kernels.triton import grouped_gemm as tk

    g, n, k = 2, 16, 128
    m_indices = build_m_indices([40000, 30001])
    a, b, af, bf = make_inputs("fp8", g, m_indices.numel(), n, k, masked=False, seed=4)
    d = torch.full((m_indices.numel(), n), 3.0, dtype=torch.bfloat16)
    seen = []

    def big_tiles(kind, n_, k_, m_hint, device_type):
        seen.append((kind, n_, k_))
        return dict(BLOCK_M=2048, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=1)

    tk.set_config_override(big_tiles)
    try:
        gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, backend="triton")
    finally:
        tk.set_config_override(None)
    assert seen == [("fp8", n, k)]
    assert (d[m_indices < 0] == 0).all()
    assert_diff(d.float(), _ref_contiguous(af, bf, m_indices), 1e-3, "large M interpreter")


@requires_triton
def test_tile_schedule():
    from epkit.kernels.triton.grouped_gemm import tile_schedule

    grp, start, end = tile_schedule(torch.tensor([0, 0, 0, -1, 2, 2, 2, 2, 2], dtype=torch.int32), 2)
    assert grp.tolist() == [0, 0, -1, 2, 2, 2]
    assert start.tolist() == [0, 2, 3, 4, 6, 8]
    assert end.tolist() == [3, 3, 4, 9, 9, 9]


def test_ops_registered_with_selfchecks():
    from epkit.backends import registered_ops

    ops = registered_ops()
    for kind in KINDS:
        for layout in ("contiguous", "masked"):
            spec = ops[f"m_grouped_{kind}_gemm_nt_{layout}"]
            assert spec.selfcheck is not None
            spec.selfcheck("cpu")


# Expert MLP (gate/up -> SwiGLU -> FP8 re-quantization -> down) against a per-expert plain-torch MLP.


def _mlp_weights(kind, g, inter, hidden, seed):
    from epkit.moe import fuse_gate_up
    from epkit.quant import cast_to_mxfp4, per_block_cast_to_fp8

    gen = torch.Generator().manual_seed(seed)
    wg = torch.randn(g, inter, hidden, generator=gen) / hidden**0.5
    wu = torch.randn(g, inter, hidden, generator=gen) / hidden**0.5
    wd = torch.randn(g, hidden, inter, generator=gen) / inter**0.5
    if kind == "bf16":
        wg, wu, wd = wg.bfloat16(), wu.bfloat16(), wd.bfloat16()
        return wg, wu, wd, fuse_gate_up(wg, wu), wd
    cast = per_block_cast_to_fp8 if kind == "fp8" else cast_to_mxfp4
    return wg, wu, wd, cast(fuse_gate_up(wg, wu)), cast(wd)


# two quantized GEMMs plus an FP8 re-quantization in a chain: looser than one GEMM
MLP_THRESH = {"fp8": 4e-3, "fp8_fp4": 4e-2, "bf16": 1e-4}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("limit", [None, 1.0])
def test_expert_mlp_contiguous(kind, limit):
    from epkit.moe import expert_mlp, expert_mlp_reference

    g, inter, hidden = 4, 256, 256
    wg, wu, wd, w13, w2 = _mlp_weights(kind, g, inter, hidden, seed=1)
    m_indices = build_m_indices([5, 0, 140, 33])
    x = torch.randn(m_indices.numel(), hidden, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = expert_mlp(x, "contiguous", w13, w2, m_indices=m_indices, swiglu_limit=limit)
    want = expert_mlp_reference(x, wg, wu, wd, m_indices, swiglu_limit=limit)
    assert got.dtype == torch.bfloat16 and got.shape == (m_indices.numel(), hidden)
    assert (got[m_indices < 0] == 0).all()
    assert_diff(got.float(), want, MLP_THRESH[kind], f"{kind=} {limit=}")
    if limit is not None:  # the clamp is active on these inputs
        unclamped = expert_mlp_reference(x, wg, wu, wd, m_indices)
        assert calc_diff(unclamped, want) > 5 * MLP_THRESH[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_expert_mlp_masked(kind):
    from epkit.moe import expert_mlp, expert_mlp_reference

    g, m_max, inter, hidden = 3, 24, 128, 256
    wg, wu, wd, w13, w2 = _mlp_weights(kind, g, inter, hidden, seed=3)
    x = torch.randn(g, m_max, hidden, generator=torch.Generator().manual_seed(4)) * 100  # large rows beyond masked_m
    masked_m = torch.tensor([m_max, 0, 7], dtype=torch.int32)
    got = expert_mlp(x, "masked", w13, w2, masked_m=masked_m, expected_m=10)
    live = torch.arange(m_max)[None, :] < masked_m[:, None].long()
    rows = torch.arange(g)[:, None].expand(g, m_max)
    want = expert_mlp_reference(x[live], wg, wu, wd, rows[live])
    assert (got[~live] == 0).all()
    assert_diff(got[live].float(), want, MLP_THRESH[kind], f"masked {kind=}")


def test_pack_moe_weight_round_trip():
    from epkit.moe import pack_moe_weight, unpack_moe_weight

    w = torch.arange(3 * 4 * 5, dtype=torch.float32).view(12, 5)
    p = pack_moe_weight(w, 3)
    assert p.shape == (3, 4, 5) and p.mT.is_contiguous()
    assert torch.equal(p[1], w[4:8])
    assert torch.equal(unpack_moe_weight(p), w)
    with pytest.raises(ValueError, match="num_experts"):
        pack_moe_weight(w, 5)


# The cpu backend's paths through the op, each forced by gemm_cpu's switches (the backend's own functions,
# called directly, are test_grouped_gemm_cpu.py's).


@pytest.mark.parametrize("kind", ["fp8", "fp8_fp4"])
def test_cpu_backend_same_bits_without_fused_dequant(kind, monkeypatch):
    monkeypatch.setattr(gemm_cpu, "_AMX_ENABLED", [False])  # the unfused path, with and without epkit._C
    # uneven groups (per-group matmuls) and equal, evenly spaced groups (one batched matmul)
    for counts in ([130, 0, 7, 128], [128, 128, 128]):
        m_indices = build_m_indices(counts)
        m = m_indices.numel()
        a, b, _, _ = make_inputs(kind, len(counts), m, 256, 512, masked=False, seed=len(counts))
        fused = CONTIG[kind](a, b, torch.empty(m, 256, dtype=torch.bfloat16), m_indices, backend="cpu")
        with monkeypatch.context() as mp:
            mp.setattr(gemm_cpu, "dequant_extension", lambda: None)
            plain = CONTIG[kind](a, b, torch.empty(m, 256, dtype=torch.bfloat16), m_indices, backend="cpu")
        assert_bitwise_equal(fused, plain, ctx=f"{kind=} {counts=}: fused C++ vs torch dequantization")


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_batched_and_per_group_paths_agree(kind, amx, monkeypatch):
    # Without AMX, equal groups take one batched matmul and the same rows with one group split off take
    # per-group matmuls; with AMX every case is the fused kernel's task list.
    monkeypatch.setattr(gemm_cpu, "_AMX_ENABLED", [amx])
    g, n, k, c = 4, 256, 512, 128
    m_indices = build_m_indices([c] * g)
    a, b, af, bf = make_inputs(kind, g, g * c, n, k, masked=False, seed=9)
    d_batched = CONTIG[kind](a, b, torch.full((g * c, n), 5.0, dtype=torch.bfloat16), m_indices, backend="cpu")
    assert_diff(d_batched.float(), _ref_contiguous(af, bf, m_indices), THRESH[kind], f"{kind=} batched")
    for grp in range(g):  # one group at a time: per-group path, same rows and weights
        ids = torch.where(m_indices == grp, m_indices, torch.full_like(m_indices, -1))
        d_one = CONTIG[kind](a, b, torch.full((g * c, n), 5.0, dtype=torch.bfloat16), ids, backend="cpu")
        sel = slice(grp * c, (grp + 1) * c)
        assert_diff(d_one[sel].float(), d_batched[sel].float(), 1e-6, f"{kind=} group {grp}")
    # masked layout, all groups at the same count below M_max: rows past it stay untouched
    am, bm, afm, bfm = make_inputs(kind, g, 96, n, k, masked=True, seed=10)
    masked_m = torch.full((g,), 40, dtype=torch.int32)
    dm = torch.full((g, 96, n), -3.0, dtype=torch.bfloat16)
    MASKED[kind](am, bm, dm, masked_m, 40, backend="cpu")
    assert torch.equal(dm[:, 40:], torch.full_like(dm[:, 40:], -3.0)), "rows beyond masked_m must be untouched"
    ref = torch.einsum("gmk,gnk->gmn", afm.float(), bfm.float())
    assert_diff(dm[:, :40].float(), ref[:, :40], THRESH[kind], f"{kind=} masked batched")


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_bits_do_not_depend_on_its_groups_size(kind, amx, monkeypatch):
    # The CPU BLAS computes some small row counts with other arithmetic (MKL on AVX2: 1-3 rows, with two
    # threads 5-7 and 9-11 too); an expert's first rows must not change bits when more tokens join it (two-batch
    # overlap, CP ranks and EP ranks all change the group sizes of the same token).
    monkeypatch.setattr(gemm_cpu, "_AMX_ENABLED", [amx])
    g, n, k, full = 2, 256, 512, 24
    m_indices = build_m_indices([full] * g)  # each group padded to the layout's alignment
    m = m_indices.numel()
    a, b, _, _ = make_inputs(kind, g, m, n, k, masked=False, seed=4)
    want = CONTIG[kind](a, b, torch.empty(m, n, dtype=torch.bfloat16), m_indices, backend="cpu")
    am, bm, _, _ = make_inputs(kind, g, full, n, k, masked=True, seed=5)
    all_m = torch.full((g,), full, dtype=torch.int32)
    want_m = MASKED[kind](am, bm, torch.empty(g, full, n, dtype=torch.bfloat16), all_m, full, backend="cpu")
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 5, 7, 9, 11, 13):
                # group 0 keeps its first `rows` rows (the others are padding), group 1 all of its rows
                ids = m_indices.clone()
                ids[rows:full] = -1
                d = CONTIG[kind](a, b, torch.empty(m, n, dtype=torch.bfloat16), ids, backend="cpu")
                ctx = f"{kind=} {amx=} {threads=} {rows=}"
                assert_bitwise_equal(d[:rows], want[:rows], ctx=ctx + " contiguous")
                masked_m = torch.tensor([rows, full - 1], dtype=torch.int32)
                dm = MASKED[kind](am, bm, torch.empty(g, full, n, dtype=torch.bfloat16), masked_m, full,
                                  backend="cpu")  # fmt: skip
                assert_bitwise_equal(dm[0, :rows], want_m[0, :rows], ctx=ctx + " masked")
                assert_bitwise_equal(dm[1, : full - 1], want_m[1, : full - 1], ctx=ctx + " masked group 1")
    finally:
        torch.set_num_threads(before)


# The fused AMX kernel (cpu backend, bf16 output, CPUs with AMX-BF16)

requires_amx = pytest.mark.skipif(
    gemm_cpu.amx_kernel() is None,
    reason="this CPU has no AMX-BF16 (or epkit._C lacks the kernel): the cpu backend uses "
    "the unfused path, which the other tests cover",
)


def _equal_values(got: torch.Tensor, want: torch.Tensor, ctx: str) -> None:
    """Exact equality of values. A sum of one product and exact zeros loses the sign of a zero, and AMX
    treats bf16 denormals as zero (as every AMX bf16 matmul does), so expected denormals read as zero."""
    want = want.float()
    want = torch.where(want.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(want), want)
    bad = (got.float() != want).nonzero()
    assert bad.numel() == 0, f"{ctx}: {bad.shape[0]} values differ, first at {bad[0].tolist()}"
    assert (want != 0).float().mean() > 0.5, f"{ctx}: the check needs mostly non-zero operands"


def _raw_fp8(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float8_e4m3fn)


@requires_amx
@pytest.mark.parametrize("kind", KINDS)
def test_amx_operands_are_the_dequantizers_bits(kind):
    """One-hot rows make each output a single operand value: the kernel's bf16 operands must be exactly
    ``epkit.quant``'s dequantized values rounded to bf16 (tiny scales exercise the exact slow path)."""
    from epkit.quant import dequant_mxfp4, dequant_per_block_fp8, dequant_per_token_group_fp8

    g, n, k = 2, 200, 256
    gen = torch.Generator().manual_seed(3)
    # weights, read back through one-hot activations: d[g, m, :] = W_bf16[g][:, m]
    a_hot = torch.zeros(g, k, k)
    a_hot[:, torch.arange(k), torch.arange(k)] = 1.0
    if kind == "bf16":
        b = (torch.randn(g, n, k, generator=gen) * 3).bfloat16()
        w_bits, a_in = b, a_hot.bfloat16()
    else:
        a_in = (_raw_fp8(a_hot), torch.ones(g, k, k // 128))
        if kind == "fp8":
            codes = torch.randint(0, 256, (g, n, k), generator=gen, dtype=torch.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0x11  # no NaN codes: a NaN times 0 would spread over the row
            bq = codes.view(torch.float8_e4m3fn)
            sfb = torch.rand(g, -(-n // 128), k // 128, generator=gen) * 4
            sfb[1, 0, 1] = 1e-38  # some products below float32's normal range: the exact conversion path
            b = (bq, sfb)
            w_bits = dequant_per_block_fp8(bq, sfb).bfloat16()
        else:
            bq = torch.randint(0, 256, (g, n, k // 2), generator=gen, dtype=torch.uint8)
            sfb = torch.randint(100, 150, (g, n, k // 32), generator=gen, dtype=torch.uint8)
            b = (bq, sfb)
            w_bits = dequant_mxfp4(bq, sfb).bfloat16()
    d = torch.empty(g, k, n, dtype=torch.bfloat16)
    MASKED[kind](a_in, b, d, torch.full((g,), k, dtype=torch.int32), k, backend="cpu")
    _equal_values(d, w_bits.transpose(1, 2), f"{kind}: weights through one-hot rows")
    if kind == "fp8":  # a NaN weight code gives NaN (not the 480 its bits would shift into)
        bq[0, 7, 130] = torch.tensor(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
        MASKED[kind](a_in, b, d, torch.full((g,), k, dtype=torch.int32), k, backend="cpu")
        assert bool(d[0, :, 7].isnan().all()) and not bool(d[0, :, 8].isnan().any())
    # activations, read back through one-hot weights: d[m, j] = A_bf16[m, j] for j < k
    m = 70
    b_hot = torch.zeros(1, k, k)
    b_hot[0, torch.arange(k), torch.arange(k)] = 1.0
    if kind == "bf16":
        a = (torch.randn(m, k, generator=gen) * 5).bfloat16()
        a_bits, b_in = a, b_hot.bfloat16()
    else:
        codes = torch.randint(0, 256, (m, k), generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x22
        aq = codes.view(torch.float8_e4m3fn)
        sfa = torch.rand(m, k // 128, generator=gen) * 2
        sfa[5, 1] = 2e-38
        a = (aq, sfa)
        a_bits = dequant_per_token_group_fp8(aq, sfa).bfloat16()
        if kind == "fp8":
            b_in = (_raw_fp8(b_hot), torch.ones(1, k // 128, k // 128))
        else:  # MXFP4 1.0 = code 2 with scale 2**0; pack two codes per byte, low nibble first
            packed = (b_hot[0].to(torch.uint8) * 2).view(k, k // 2, 2)
            b_in = ((packed[..., 0] | (packed[..., 1] << 4))[None], torch.full((1, k, k // 32), 127, dtype=torch.uint8))
    d = torch.empty(m, k, dtype=torch.bfloat16)
    CONTIG[kind](a, b_in, d, torch.zeros(m, dtype=torch.int32), backend="cpu")
    _equal_values(d, a_bits, f"{kind}: activations through one-hot weights")


# Tuning script (GPU runs use it; here its CPU dry run through the interpreter)


def test_tuning_script_dry_run_and_loading_its_table(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from epkit.kernels.triton import grouped_gemm as tg

    out = tmp_path / "tuned.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "bench", "tune_grouped_gemm.py"), "--device", "cpu", "--quick"]
        + ["--kinds", "fp8", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = json.loads(out.read_text())
    assert table["quick"] is True and len(table["runs"]) == 2
    for run in table["runs"]:  # every candidate was checked against the reference
        assert run["results"] and all(r["ok"] and r["calc_diff"] <= 1e-3 for r in run["results"]), run
    keys = {(e["kind"], e["n"], e["k"], e["bucket"]) for e in table["best"]}
    assert keys == {("fp8", 256, 256, "prefill"), ("fp8", 256, 256, "decode")}
    try:
        assert tg.load_tuned_configs(str(out), device_type="cpu") == 2
        best = {e["bucket"]: e["config"] for e in table["best"]}
        assert tg.get_config("fp8", 256, 256, 96, "cpu") == best["prefill"]
        assert tg.get_config("fp8", 256, 256, 40, "cpu") == best["decode"]
        heuristic = tg.persistent_config("fp8", 96, "cpu")
        assert tg.get_config("fp8", 512, 256, 96, "cpu") == heuristic  # other shapes keep the heuristic
        # the tuned config drives a real call
        counts = [96, 50]
        m_indices = build_m_indices(counts)
        a, b, af, bf = make_inputs("fp8", 2, m_indices.numel(), 256, 256, masked=False, seed=4)
        d = CONTIG["fp8"](a, b, torch.empty(m_indices.numel(), 256, dtype=torch.bfloat16), m_indices, backend="triton")
        assert_diff(d.float(), _ref_contiguous(af, bf, m_indices), THRESH["fp8"], "tuned config")
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"best": [{"kind": "fp8", "n": 1, "k": 128, "bucket": "decode", "config": {}}]}))
        with pytest.raises(ValueError, match="malformed entry"):
            tg.load_tuned_configs(str(bad))
        bad.write_text("[]")
        with pytest.raises(ValueError, match="not a tuning table"):
            tg.load_tuned_configs(str(bad))
    finally:
        tg.set_config_override(None)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_k_zero_gives_zeros_on_every_cpu_path(kind, monkeypatch):
    # An empty reduction: every live row is zero, on the AMX path and the unfused one alike.
    m_indices = build_m_indices([2, 1])  # two live rows and padding, then one live row
    m = m_indices.numel()
    if kind == "bf16":
        a, b = torch.zeros(m, 0, dtype=torch.bfloat16), torch.zeros(2, 8, 0, dtype=torch.bfloat16)
    else:
        a = (torch.zeros(m, 0, dtype=torch.float8_e4m3fn), torch.zeros(m, 0))
        b = (torch.zeros(2, 8, 0, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, 0))
    for amx in (True, False):
        monkeypatch.setattr(gemm_cpu, "_AMX_ENABLED", [amx])
        d = CONTIG[kind](a, b, torch.full((m, 8), 3.0, dtype=torch.bfloat16), m_indices, backend="cpu")
        assert_bitwise_equal(d, torch.zeros(m, 8, dtype=torch.bfloat16), ctx=f"{kind=} {amx=}")
