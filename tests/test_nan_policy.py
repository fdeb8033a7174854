"""NaN policy of the grouped GEMMs and expert_mlp (README, "Using an op"): no check, IEEE propagation kept in rows.

The GEMMs never look for NaN/Inf (a check would read the data on the host: one device synchronisation per
call). A non-finite value in row ``m`` of ``a`` (or its scale) makes row ``m`` of ``d`` non-finite and leaves
every other row bit for bit as without it; one in group ``g``'s weights reaches only group ``g``'s rows;
padding rows (``m_indices = -1``) stay zeros and rows past ``masked_m`` stay untouched. The quantizer in
front of ``expert_mlp``'s FP8 path is the exception: it raises on non-finite input.

FP8 rows are poisoned through their scale, which is where ``cast_groups_to_fp8`` (the intermediate of
``expert_mlp``) puts a NaN row's NaN; a NaN *code* in an e4m3 ``a`` is the one case the backends differ on
CPU tensors (Triton 3.9's interpreter decodes it as +-480), pinned by the last GEMM test.
"""

import pytest
import torch

import epkit
from epkit.grouped_gemm import GROUPED_OPS, build_m_indices, make_inputs
from epkit.quant import dequant_per_block_fp8, dequant_per_token_group_fp8, per_block_cast_to_fp8

G, N, K = 2, 128, 256
COUNTS = [100, 128]  # contiguous: group 0 has rows 0..99 then padding to 128, group 1 rows 128..255
M_MAX, MASKED_M = 16, [5, 3]
NAN_ROW = {False: 1, True: (0, 2)}  # a live row
DEAD_ROW = {False: 110, True: (1, 10)}  # a padding row / a row past masked_m
SENTINEL = 7.0


def _inputs(kind: str, masked: bool):
    m = M_MAX if masked else sum(-(-c // 128) * 128 for c in COUNTS)
    a, b, _, _ = make_inputs(kind, G, m, N, K, masked, seed=3)
    return a, b


def _run(op: str, masked: bool, a, b, backend: str) -> torch.Tensor:
    fn = getattr(epkit, op)
    if masked:
        d = torch.full((G, M_MAX, N), SENTINEL, dtype=torch.bfloat16)
        fn(a, b, d, torch.tensor(MASKED_M, dtype=torch.int32), max(MASKED_M), backend=backend)
    else:
        d = torch.zeros(sum(-(-c // 128) * 128 for c in COUNTS), N, dtype=torch.bfloat16)
        fn(a, b, d, build_m_indices(COUNTS), backend=backend)
    return d


def _poison_row(kind: str, a, row):
    """``a`` with row ``row`` made NaN: the element for bf16, the first scale group for FP8 rows."""
    if kind == "bf16":
        a = a.clone()
        a[row][0] = float("nan")
        return a
    q, s = a[0], a[1].clone()
    s[row][0] = float("nan")
    return (q, s)


def _nan_rows(d: torch.Tensor) -> list:
    bad = torch.isnan(d.float()).any(-1)
    return [tuple(i) if d.dim() == 3 else i[0] for i in bad.nonzero().tolist()]


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
@pytest.mark.parametrize("op,kind,masked", GROUPED_OPS)
def test_a_nan_row_stays_in_its_row_and_dead_rows_are_never_read(op, kind, masked, backend):
    a, b = _inputs(kind, masked)
    clean = _run(op, masked, a, b, backend)
    poisoned = _poison_row(kind, _poison_row(kind, a, NAN_ROW[masked]), DEAD_ROW[masked])
    got = _run(op, masked, poisoned, b, backend)
    assert _nan_rows(got) == [NAN_ROW[masked]]
    keep = ~torch.isnan(got.float()).any(-1)
    assert torch.equal(got[keep], clean[keep]), "a NaN row changed other rows"
    dead = got[DEAD_ROW[masked]]
    assert bool((dead == (SENTINEL if masked else 0.0)).all()), "a padding row or a row past masked_m was written"


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_nan_weights_reach_only_their_group(kind, backend):
    op = f"m_grouped_{kind}_gemm_nt_contiguous"
    a, b = _inputs(kind, False)
    if kind == "bf16":
        b = b.clone()
        b[1, 5, 0] = float("nan")  # expert 1, output column 5
        cols = [5]
    else:
        b = (b[0], b[1].clone())
        b[1][1, 0, 0] = float("nan")  # expert 1's first 128x128 scale block: output columns 0..127
        cols = list(range(128))
    got = _run(op, False, a, b, backend)
    nan = torch.isnan(got.float())
    group1 = build_m_indices(COUNTS) == 1
    assert not nan[~group1].any(), "expert 1's NaN weights reached other groups' rows"
    assert nan[group1][:, cols].all() and not nan[group1].any(0)[[c for c in range(N) if c not in cols]].any()


def test_triton_interpreter_reads_the_e4m3_nan_code_as_480():
    """The known CPU deviation the README names: a NaN element (not scale) of an FP8 ``a``.

    cpu and reference give a NaN row, as a GPU does; the interpreter decodes the code 0x7F as 480, so its row
    is the product of a row holding 480 there (computed here in float32 from the dequantized operands).
    """
    op = "m_grouped_fp8_gemm_nt_contiguous"
    a, b = _inputs("fp8", False)
    q = a[0].clone()
    q[1, 0] = float("nan")  # e4m3fn code 0x7F
    got = {bk: _run(op, False, (q, a[1]), b, bk) for bk in ("cpu", "reference", "triton")}
    assert _nan_rows(got["cpu"]) == _nan_rows(got["reference"]) == [1]
    assert _nan_rows(got["triton"]) == []
    row = dequant_per_token_group_fp8(q[1:2], a[1][1:2]).nan_to_num(nan=480.0 * float(a[1][1, 0]))
    want = row @ dequant_per_block_fp8(b[0][0], b[1][0]).T  # row 1 is expert 0's
    assert torch.allclose(got["triton"][1].float(), want[0], rtol=1e-2, atol=1e-2)


def _mlp_inputs(kind: str):
    hidden, inter = 256, 128
    g = torch.Generator().manual_seed(5)
    w13 = torch.randn(G, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(G, hidden, inter, generator=g) / inter**0.5
    if kind == "bf16":
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    else:
        w13, w2 = per_block_cast_to_fp8(w13), per_block_cast_to_fp8(w2)
    m_indices = build_m_indices(COUNTS)
    x = torch.randn(m_indices.numel(), hidden, generator=g)
    return x, w13, w2, m_indices


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
def test_expert_mlp_keeps_a_nan_token_in_its_row(backend):
    x, w13, w2, m_indices = _mlp_inputs("bf16")
    clean = epkit.expert_mlp(x, "contiguous", w13, w2, m_indices=m_indices, backend=backend)
    x[3, 7] = float("nan")
    got = epkit.expert_mlp(x, "contiguous", w13, w2, m_indices=m_indices, backend=backend)
    assert _nan_rows(got) == [3]
    keep = torch.arange(x.shape[0]) != 3
    assert torch.equal(got[keep], clean[keep])


def test_expert_mlp_fp8_refuses_non_finite_input_naming_x():
    x, w13, w2, m_indices = _mlp_inputs("fp8")
    x[3, 7] = float("inf")
    with pytest.raises(ValueError, match=r"^x holds 1 NaN/Inf value"):
        epkit.expert_mlp(x, "contiguous", w13, w2, m_indices=m_indices)
