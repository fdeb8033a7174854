"""Grouped (per-expert) GEMMs with DeepGEMM-compatible semantics: ``d = a @ b[g].T`` per group.

Layouts
-------
contiguous (prefill): ``a [M, K]`` holds every group's rows back to back;
    ``m_indices [M]`` int32 gives each row's group, ``-1`` for padding rows,
    whose outputs are written as exact zeros. Each group's rows start on a multiple of
    :func:`get_mk_alignment_for_contiguous_layout` (128) and the rows after them up to the next
    multiple are padding, as DeepGEMM requires (it reads a 128-row block's group from its first row, and
    so do epkit's GPU kernels). With ``use_psum_layout=True`` ``m_indices [G]`` holds cumulative row ends
    instead: group ``g`` owns rows ``[align(end[g-1]), end[g])`` (``end[-1] = 0``, ``align`` rounds up
    to 128); every other row is padding.
masked (decode): ``a [G, M_max, K]``; only the first ``masked_m[g]`` rows of
    group ``g`` are computed, the rest of ``d`` is left untouched.

Checks that read the layout tensor's values (index ranges, the 128-row alignment, psum ends, counts) run
for CPU tensors, where they cost no device synchronisation; for CUDA tensors the values are never read
on the host, so no call synchronises (with the default, persistent-kernel configs; an overridden tile-grid
config builds its tile schedule on the host): the kernels clamp what they read (an id outside ``[0, G)`` is a
padding row, a count is clamped to ``[0, M_max]``, a row outside its 128-row block's group is written as
zero) and never address memory outside the tensors. ``EPKIT_GEMM_CHECKS=1`` runs the data checks on
CUDA tensors too (each check then synchronises: a debugging aid; never during CUDA stream capture). Each GEMM
is ``torch.ops.epkit.<name>`` (``epkit.ops``), writing ``d`` in place; the data checks run inside it.

Formats
-------
``fp8``      a e4m3 + float32 ``sfa [M, K/128]`` (1x128 groups); b e4m3 [G, N, K] +
             float32 ``sfb [G, ceil(N/128), K/128]`` (128x128 blocks).
``fp8_fp4``  a as above; b MXFP4 ``uint8 [G, N, K/2]`` + e8m0 ``uint8 sfb [G, N, K/32]``.
``bf16``     a bf16 [M, K]; b bf16 [G, N, K]; no scales.
``d`` is bfloat16 or float32.

Backends: ``cpu`` - with a bf16 ``d`` on a CPU with AMX-BF16, the fused C++ kernel
``epkit._C.grouped_gemm_amx``: per expert it dequantizes the rows into a cache-resident bf16
block and the weights panel by panel straight into AMX's tile layout, and multiplies on AMX
tiles with float32 accumulation (no full-size dequantized copy is ever written). Otherwise
every call dequantizes the live groups' weights and rows in one threaded pass (fused C++
``epkit._C.dequant_blocks`` when built, else the ``epkit.quant`` dequantizers) and runs one
torch matmul per group, or one batched matmul when the groups are equal and evenly spaced,
written straight into d (bf16 operands when the CPU has fast bf16 and d is bf16, else
float32). Both paths multiply the same operands: the dequantizers' float32 values rounded to
bf16 (or kept in float32 for a float32 d without AMX); only the summation order differs.
``triton`` (the persistent TMA kernel of kernels/triton/grouped_gemm_persistent.py by default, the
tile-grid kernel of kernels/triton/grouped_gemm.py for an overridden config; the interpreter on CPU
tensors), ``reference`` (float32 matmul of dequantized inputs, group by group).
"""

from __future__ import annotations

import os

import torch

from epkit._details.grouped_gemm_checks import (
    ALIGN,
    check_layout_tensor,
    check_masked_m,
    check_masked_m_values,
    layout_row_ids,
    psum_to_m_indices,
    validate_operands,
)
from epkit._details.grouped_gemm_cpu import cpu_contiguous, cpu_masked
from epkit.backends import OpSpec, register_op, select
from epkit.ops import custom_op, host_checks
from epkit.quant import FP8_BLOCK, dequant_mxfp4, dequant_per_block_fp8, dequant_per_token_group_fp8
from epkit.utils import calc_diff

#: (op name, weight kind, masked layout) of every grouped GEMM, the one list of them: ``__all__``, the
#: docstrings, the op table (``epkit.backends``) and ``epkit``'s top level are derived from it.
GROUPED_OPS = (
    ("m_grouped_fp8_gemm_nt_contiguous", "fp8", False),
    ("m_grouped_fp8_gemm_nt_masked", "fp8", True),
    ("m_grouped_fp8_fp4_gemm_nt_contiguous", "fp8_fp4", False),
    ("m_grouped_fp8_fp4_gemm_nt_masked", "fp8_fp4", True),
    ("m_grouped_bf16_gemm_nt_contiguous", "bf16", False),
    ("m_grouped_bf16_gemm_nt_masked", "bf16", True),
)
_OP_NAME = {(kind, masked): op for op, kind, masked in GROUPED_OPS}

__all__ = [
    "GROUPED_OPS",
    "get_mk_alignment_for_contiguous_layout",
    "build_m_indices",
    *(op for op, _, _ in GROUPED_OPS),
    "grouped_gemm_reference",
    "make_inputs",
]


def get_mk_alignment_for_contiguous_layout() -> int:
    """Row alignment of each group in the contiguous layout (128, as DeepGEMM)."""
    return ALIGN


def build_m_indices(
    num_tokens_per_group: torch.Tensor | list[int], alignment: int | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Per-row group ids for the contiguous layout, each group padded to ``alignment`` rows.

    Parameters
    ----------
    num_tokens_per_group : Tensor [G] or list of G ints (>= 0)
    alignment : int, optional
        Defaults to :func:`get_mk_alignment_for_contiguous_layout` (128), the layout the contiguous GEMMs take
        (a multiple of 128 works too; other alignments make layouts they reject).
    device : torch device of the result.

    Returns
    -------
    Tensor [sum(align_up(count_g))], int32: ``g`` for group g's rows, ``-1`` for padding rows.

    Examples
    --------
    >>> build_m_indices([1, 0, 2], alignment=2).tolist()
    [0, -1, 2, 2]
    """
    counts = torch.as_tensor(num_tokens_per_group, dtype=torch.int64).cpu()
    alignment = ALIGN if alignment is None else alignment
    if counts.dim() != 1 or (counts.numel() and int(counts.min()) < 0):
        raise ValueError(f"num_tokens_per_group must be a 1-D list of counts >= 0, got {counts.tolist()}")
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment must be a positive int, got {alignment!r}")
    padded = (counts + alignment - 1) // alignment * alignment
    g = counts.numel()
    ids = torch.arange(g, dtype=torch.int32).repeat_interleave(padded)
    pos = torch.arange(int(padded.sum())) - torch.repeat_interleave(torch.cumsum(padded, 0) - padded, padded)
    ids[pos >= torch.repeat_interleave(counts, padded)] = -1
    return ids.to(device)


# Validation (the checks themselves: epkit._details.grouped_gemm_checks)


def _data_checks(device: torch.device) -> bool:
    """Whether the checks that read a layout tensor's values run: always for CPU tensors, for CUDA tensors
    only with ``EPKIT_GEMM_CHECKS=1`` (they synchronise), and never during CUDA stream capture."""
    return (device.type == "cpu" or os.environ.get("EPKIT_GEMM_CHECKS", "") == "1") and host_checks(device)


# Reference


def _deq_a(kind: str, a: torch.Tensor, sfa: torch.Tensor | None) -> torch.Tensor:
    return a.float() if kind == "bf16" else dequant_per_token_group_fp8(a, sfa, FP8_BLOCK)


def _deq_b(kind: str, b: torch.Tensor, sfb: torch.Tensor | None) -> torch.Tensor:
    if kind == "fp8":
        return dequant_per_block_fp8(b, sfb, (FP8_BLOCK, FP8_BLOCK))
    if kind == "fp8_fp4":
        return dequant_mxfp4(b, sfb)
    return b.float()


def grouped_gemm_reference(kind, a, sfa, b, sfb, d, m_indices=None, masked_m=None) -> torch.Tensor:
    """Readable specification: float32 matmul of dequantized inputs, group by group.

    ``kind`` is ``"fp8"``, ``"fp8_fp4"`` or ``"bf16"``; pass per-row ``m_indices [M]``
    (contiguous; padding rows become zeros) or ``masked_m [G]`` (masked; other rows untouched).
    """
    for grp in range(b.shape[0]):
        w = _deq_b(kind, b[grp], None if sfb is None else sfb[grp])  # [N, K] float32
        if masked_m is not None:
            rows = int(masked_m[grp])
            x = _deq_a(kind, a[grp, :rows], None if sfa is None else sfa[grp, :rows])
            d[grp, :rows] = (x @ w.T).to(d.dtype)
        else:
            sel = m_indices == grp
            x = _deq_a(kind, a[sel], None if sfa is None else sfa[sel])
            d[sel] = (x @ w.T).to(d.dtype)
    if masked_m is None:
        d[m_indices < 0] = 0
    return d


# Public ops


def _contiguous(kind, a, b, d, m_indices, use_psum_layout, backend):
    a, sfa, b, sfb, g, m, n, k = validate_operands(kind, a, b, d, masked=False)
    check_layout_tensor(m_indices, g, m, a.device, use_psum_layout)
    _OPS[kind, False](a, sfa, b, sfb, d, m_indices, bool(use_psum_layout), 0, backend)
    return d


def _masked(kind, a, b, d, masked_m, expected_m, backend):
    a, sfa, b, sfb, g, m_max, n, k = validate_operands(kind, a, b, d, masked=True)
    check_masked_m(masked_m, g, a.device, expected_m)
    _OPS[kind, True](a, sfa, b, sfb, d, masked_m, False, expected_m, backend)
    return d


def _run_contiguous(kind, a, sfa, b, sfb, d, m_indices, use_psum_layout, backend) -> None:
    """The contiguous op's body: the layout's value checks (see :func:`_data_checks`), then the backend."""
    g, m, n = b.shape[0], a.shape[0], b.shape[1]
    rows_ids = layout_row_ids(m_indices, g, m, use_psum_layout) if _data_checks(a.device) else None
    impl = select(_OP_NAME[kind, False], a.device, backend)
    if m == 0 or n == 0:
        return
    if impl == "triton":
        from epkit.kernels.triton.grouped_gemm import grouped_gemm_contiguous

        grouped_gemm_contiguous(kind, a, sfa, b, sfb, d, m_indices, use_psum_layout=use_psum_layout)
        return
    if rows_ids is None:  # the reference on CUDA tensors: it reads them anyway
        rows_ids = psum_to_m_indices(m_indices, m) if use_psum_layout else m_indices
    if impl == "reference":
        grouped_gemm_reference(kind, a, sfa, b, sfb, d, m_indices=rows_ids)
    else:
        cpu_contiguous(kind, a, sfa, b, sfb, d, rows_ids)


def _run_masked(kind, a, sfa, b, sfb, d, masked_m, expected_m, backend) -> None:
    """The masked op's body: the counts' value checks (see :func:`_data_checks`), then the backend."""
    g, m_max, n = b.shape[0], a.shape[1], b.shape[1]
    if _data_checks(masked_m.device):  # on a GPU the counts stay unread (no sync); the kernel clamps them
        check_masked_m_values(masked_m, m_max)
    impl = select(_OP_NAME[kind, True], a.device, backend)
    if g == 0 or m_max == 0 or n == 0:
        return
    if impl == "reference":
        grouped_gemm_reference(kind, a, sfa, b, sfb, d, masked_m=masked_m)
    elif impl == "cpu":
        cpu_masked(kind, a, sfa, b, sfb, d, masked_m)
    else:
        from epkit.kernels.triton.grouped_gemm import grouped_gemm_masked

        grouped_gemm_masked(kind, a, sfa, b, sfb, d, masked_m, expected_m)


def _no_output(*args):
    return None


def _register(op: str, kind: str, masked: bool):
    """``torch.ops.epkit.<op>``: one schema for both layouts, ``layout`` being ``m_indices`` (contiguous; with
    ``use_psum_layout``) or ``masked_m`` (masked; with ``expected_m``), the other layout's setting unused."""

    @custom_op(op, _no_output, mutates_args=("d",))
    def run(
        a: torch.Tensor,
        sfa: torch.Tensor | None,
        b: torch.Tensor,
        sfb: torch.Tensor | None,
        d: torch.Tensor,
        layout: torch.Tensor,
        use_psum_layout: bool,
        expected_m: int,
        backend: str,
    ) -> None:
        if masked:
            _run_masked(kind, a, sfa, b, sfb, d, layout, expected_m, backend)
        else:
            _run_contiguous(kind, a, sfa, b, sfb, d, layout, use_psum_layout, backend)

    return run


#: ``torch.ops.epkit.<op>`` of every entry of GROUPED_OPS, by (kind, masked): ``d`` is written in place
#: (``Tensor(a!) d``), ``sfa``/``sfb`` are None for bf16.
_OPS = {(kind, masked): _register(op, kind, masked) for op, kind, masked in GROUPED_OPS}


_CONTIG_DOC = """Contiguous-layout grouped GEMM ``d[i] = a[i] @ b[m_indices[i]].T`` ({what}).

    Parameters
    ----------
    a : {a}
    b : {b}
    d : Tensor [M, N], bfloat16 or float32, contiguous
        Written in place; rows with ``m_indices == -1`` become exact zeros.
    m_indices : Tensor [M] int32
        Group per row in ``[-1, G)``, each group's rows starting a 128-row block (as
        :func:`build_m_indices` lays them out; checked for CPU tensors); or, with ``use_psum_layout=True``,
        Tensor [G] int32 of cumulative row ends (group g owns rows ``[align(end[g-1], 128), end[g])``).
    use_psum_layout : bool
    backend : ``"auto"``, ``"cpu"``, ``"triton"`` or ``"reference"``.

    Returns
    -------
    d
    """

_MASKED_DOC = """Masked-layout grouped GEMM ``d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T`` ({what}).

    Parameters
    ----------
    a : {a_masked}
    b : {b}
    d : Tensor [G, M_max, N], bfloat16 or float32, contiguous
        Rows ``>= masked_m[g]`` of group g are left untouched.
    masked_m : Tensor [G] int32, values in ``[0, M_max]`` (checked for CPU tensors; on a GPU they are
        never read on the host, so the call does not synchronize, and the kernel clamps them to that range)
    expected_m : int
        Expected rows per group (a hint for kernel configuration).
    backend : ``"auto"``, ``"cpu"``, ``"triton"`` or ``"reference"``.

    Returns
    -------
    d
    """

_FMT = {
    "fp8": dict(
        what="FP8 x FP8",
        a="(Tensor [M, K] float8_e4m3fn, Tensor [M, K/128] float32) - K a multiple of 128",
        a_masked="(Tensor [G, M_max, K] float8_e4m3fn, Tensor [G, M_max, K/128] float32)",
        b="(Tensor [G, N, K] float8_e4m3fn, Tensor [G, ceil(N/128), K/128] float32) - 128x128 block scales",
    ),
    "fp8_fp4": dict(
        what="FP8 activations x MXFP4 weights",
        a="(Tensor [M, K] float8_e4m3fn, Tensor [M, K/128] float32) - K a multiple of 128",
        a_masked="(Tensor [G, M_max, K] float8_e4m3fn, Tensor [G, M_max, K/128] float32)",
        b="(Tensor [G, N, K/2] uint8 e2m1 pairs (even element low nibble), Tensor [G, N, K/32] uint8 e8m0)",
    ),
    "bf16": dict(
        what="BF16 x BF16",
        a="Tensor [M, K] bfloat16",
        a_masked="Tensor [G, M_max, K] bfloat16",
        b="Tensor [G, N, K] bfloat16",
    ),
}


# One wrapper per entry of GROUPED_OPS (the import-time loop below fails on a missing one).


def m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, use_psum_layout=False, *, backend="auto"):
    return _contiguous("fp8", a, b, d, m_indices, use_psum_layout, backend)


def m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m, *, backend="auto"):
    return _masked("fp8", a, b, d, masked_m, expected_m, backend)


def m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, m_indices, use_psum_layout=False, *, backend="auto"):
    return _contiguous("fp8_fp4", a, b, d, m_indices, use_psum_layout, backend)


def m_grouped_fp8_fp4_gemm_nt_masked(a, b, d, masked_m, expected_m, *, backend="auto"):
    return _masked("fp8_fp4", a, b, d, masked_m, expected_m, backend)


def m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices, use_psum_layout=False, *, backend="auto"):
    return _contiguous("bf16", a, b, d, m_indices, use_psum_layout, backend)


def m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, *, backend="auto"):
    return _masked("bf16", a, b, d, masked_m, expected_m, backend)


# Self-checks and registration


def make_inputs(kind: str, g: int, m: int, n: int, k: int, masked: bool, seed: int = 0):
    """Random quantized inputs ``(a, b, a_ref_f32, b_ref_f32)`` for tests and benchmarks.

    ``a``/``b`` are what the op takes (pairs for scaled kinds); the float32 tensors are the
    unquantized originals (``[M, K]`` or ``[G, M, K]``, and ``[G, N, K]``).
    """
    from epkit.quant import cast_to_mxfp4, per_block_cast_to_fp8, per_token_group_cast_to_fp8

    gen = torch.Generator().manual_seed(seed)
    af = torch.randn((g, m, k) if masked else (m, k), generator=gen)
    bf = torch.randn(g, n, k, generator=gen) / k**0.5
    if kind == "bf16":
        af, bf = af.bfloat16(), bf.bfloat16()
        return af, bf, af.float(), bf.float()
    a = per_token_group_cast_to_fp8(af)
    b = per_block_cast_to_fp8(bf) if kind == "fp8" else cast_to_mxfp4(bf)
    return a, b, af, bf


def _selfcheck_for(op: str, kind: str, masked: bool):
    def check(backend: str) -> None:
        fn = globals()[op]
        a, b, _, _ = make_inputs(kind, 3, 40 if masked else 272, 96, 256, masked, seed=11)
        if masked:
            mm = torch.tensor([0, 40, 17], dtype=torch.int32)
            got = fn(a, b, torch.zeros(3, 40, 96, dtype=torch.bfloat16), mm, 40, backend=backend)
            want = fn(a, b, torch.zeros(3, 40, 96, dtype=torch.bfloat16), mm, 40, backend="reference")
        else:  # group 2's 20 rows, a padding block, group 0's 10 rows (each group starts a 128-row block)
            idx = torch.tensor([2] * 20 + [-1] * 236 + [0] * 10 + [-1] * 6, dtype=torch.int32)
            got = fn(a, b, torch.ones(272, 96, dtype=torch.bfloat16), idx, backend=backend)
            want = fn(a, b, torch.ones(272, 96, dtype=torch.bfloat16), idx, backend="reference")
        if calc_diff(got, want) > 1e-4 or not torch.isfinite(got.float()).all():
            raise AssertionError(f"{op}[{backend}] differs from the reference: calc_diff {calc_diff(got, want):.2e}")

    return check


for _op, _kind, _masked_layout in GROUPED_OPS:
    globals()[_op].__doc__ = (_MASKED_DOC if _masked_layout else _CONTIG_DOC).format(**_FMT[_kind])
    register_op(
        OpSpec(
            name=_op,
            cpu=("cpu", "reference", "triton"),
            cuda=("triton", "reference"),
            doc=f"grouped GEMM ({_kind}, {'masked' if _masked_layout else 'contiguous'} layout)",
            selfcheck=_selfcheck_for(_op, _kind, _masked_layout),
        )
    )
