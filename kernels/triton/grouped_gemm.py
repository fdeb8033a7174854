"""Triton grouped GEMMs ``d = a @ b[g].T`` (contiguous, psum and masked layouts; FP8, FP8 x MXFP4, BF16).

The launchers here run the persistent TMA kernel of ``grouped_gemm_persistent.py`` for a persistent config
(the default, see ``grouped_gemm_configs.py``; the tile schedule is found on the device, nothing is read
on the host), and the tile-grid kernel of this file for any other config (``set_config_override``).

The tile-grid kernel serves every variant through constexprs:

- ``B_KIND`` 0 = bf16 x bf16, 1 = FP8 x FP8 with 1x128 activation and 128x128
  weight block scales (block-scaled ``tl.dot``: per 128-wide K block, an e4m3
  dot accumulated in fp32 then multiplied by ``sfa[row, kb] * sfb[nb, kb]``),
  2 = FP8 x MXFP4 (weights decoded in the kernel: e2m1 nibbles times the e8m0
  scale are exact in bf16; the e4m3 activations are exact in bf16 too).
- ``MASKED``: program ``(g, t)`` covers rows ``[t*BLOCK_M, masked_m[g])`` of group
  g; otherwise a host-built tile schedule (group, first row, run end) covers
  the contiguous layout, including ``-1`` padding runs whose rows get zeros (building it reads
  ``m_indices``: on CUDA tensors a synchronisation, which the persistent kernel does not need).

Row offsets are int64, so M beyond 2**31 / K elements is safe.
``python bench/kernel_check.py grouped_gemm --backend triton`` checks it against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epkit.kernels.triton.grouped_gemm_configs import (
    GROUP_ALIGN,
    check_config,
    get_config,
    load_tuned_configs,
    m_bucket,
    persistent_config,
    set_config_override,
)
from epkit.kernels.triton.grouped_gemm_persistent import (
    persistent_launcher,
    persistent_supported,
    tma_operand,
)
from epkit.kernels.triton.launch import launch, launcher, target

# The config functions live in grouped_gemm_configs and are importable from here as well (the launch API).
__all__ = [
    "grouped_gemm_contiguous",
    "grouped_gemm_masked",
    "contiguous_launcher",
    "masked_launcher",
    "tile_schedule",
    "psum_rows",
    "get_config",
    "persistent_config",
    "set_config_override",
    "load_tuned_configs",
    "m_bucket",
]

_KINDS = {"bf16": 0, "fp8": 1, "fp8_fp4": 2}


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    sfa_ptr,
    b_ptr,
    sfb_ptr,
    d_ptr,
    tile_group_ptr,
    tile_start_ptr,
    tile_end_ptr,
    masked_m_ptr,
    N,
    K,
    M_MAX,
    TILES_PER_GROUP,
    stride_am,
    stride_sfam,
    stride_bg,
    stride_bn,
    stride_sfbg,
    stride_sfbn,
    stride_dm,
    B_KIND: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``d``: program (tile, column block); see the module docstring.

    Over 80 lines as one function on purpose: on CPU tensors this kernel runs as its interpreter twin
    (``launch.interpreted``), which wraps only the outer ``@triton.jit`` function, and a twin cannot call
    nested ``@triton.jit`` helpers ("Cannot call @triton.jit'd outside of the scope of a kernel"), so
    the variants' loads and the e2m1 decode stay inline rather than in helper functions.
    """
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    if MASKED:
        g = pid // TILES_PER_GROUP
        t = pid % TILES_PER_GROUP
        # clamped to [0, M_MAX]: CUDA callers' counts are not read on the host (no sync), so a bad
        # count must not move a tile into the next group
        rows_in_group = tl.minimum(tl.maximum(tl.load(masked_m_ptr + g), 0), M_MAX)
        row0 = g.to(tl.int64) * M_MAX + t * BLOCK_M
        row_end = g.to(tl.int64) * M_MAX + rows_in_group
        num_k = tl.where(t * BLOCK_M < rows_in_group, (K + BLOCK_K - 1) // BLOCK_K, 0)
    else:
        g = tl.load(tile_group_ptr + pid)
        row0 = tl.load(tile_start_ptr + pid).to(tl.int64)
        row_end = tl.load(tile_end_ptr + pid).to(tl.int64)
        num_k = tl.where(g >= 0, (K + BLOCK_K - 1) // BLOCK_K, 0)  # padding tiles: zeros
        g = tl.maximum(g, 0)
    rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + g.to(tl.int64) * stride_bg + cols.to(tl.int64)[:, None] * stride_bn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros is a jit fn the interpreter twin cannot call
    for kb in range(0, num_k):
        ks = kb * BLOCK_K + offs_k
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if B_KIND == 0:
            b = tl.load(b_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST_DOT:  # interpreter: its bf16 dot is wrong (triton 3.9); bf16 products are exact in fp32
                acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
            else:
                acc += tl.dot(a, tl.trans(b))
        elif B_KIND == 1:
            b = tl.load(b_base + ks[None, :], mask=col_ok[:, None], other=0.0)
            sa = tl.load(sfa_ptr + rows * stride_sfam + kb, mask=row_ok, other=0.0)
            sb = tl.load(sfb_ptr + g.to(tl.int64) * stride_sfbg + ((pid_n * BLOCK_N) // 128) * stride_sfbn + kb)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb)
        else:
            half = tl.arange(0, BLOCK_K // 2)
            packed = tl.load(b_base + kb * (BLOCK_K // 2) + half[None, :], mask=col_ok[:, None], other=0).to(tl.int32)
            # e2m1 decode (inlined: the interpreter twin cannot call nested jit functions)
            code = tl.join(packed & 15, packed >> 4)  # [BLOCK_N, BLOCK_K/2, 2]
            e = (code >> 1) & 3
            m = (code & 1).to(tl.float32)
            mag = tl.where(e == 0, m * 0.5, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
            vals = tl.where((code & 8) != 0, -mag, mag)
            w = tl.reshape(vals, (BLOCK_N, BLOCK_K))  # even element from the low nibble
            sidx = tl.arange(0, BLOCK_K // 32)
            sbytes = tl.load(
                sfb_ptr
                + g.to(tl.int64) * stride_sfbg
                + cols.to(tl.int64)[:, None] * stride_sfbn
                + kb * (BLOCK_K // 32)
                + sidx[None, :],
                mask=col_ok[:, None],
                other=127,
            )
            sw = tl.exp2(sbytes.to(tl.float32) - 127.0)
            w = tl.reshape(tl.reshape(w, (BLOCK_N, BLOCK_K // 32, 32)) * sw[:, :, None], (BLOCK_N, BLOCK_K))
            sa = tl.load(sfa_ptr + rows * stride_sfam + kb, mask=row_ok, other=0.0)
            if UPCAST_DOT:
                part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.bfloat16).to(tl.float32)))
            else:
                part = tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
            acc += part * sa[:, None]
    tl.store(
        d_ptr + rows[:, None] * stride_dm + cols[None, :],
        acc.to(d_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _launch_args(kind, a, sfa, b, sfb, d, sched, masked_m, m_max, tiles_per_group, cfg):
    """The kernel's arguments for one launch: (positional, constexpr keywords, launch options)."""
    check_config(cfg, kind)
    n, k = b.shape[1], a.shape[-1]
    dummy = d  # any pointer for the arguments a variant does not read
    args = (
        a,
        sfa if sfa is not None else dummy,
        b,
        sfb if sfb is not None else dummy,
        d,
        *(sched if sched is not None else (dummy, dummy, dummy)),
        masked_m if masked_m is not None else dummy,
        n,
        k,
        m_max,
        tiles_per_group,
        k,
        k // 128 if sfa is not None else 0,
        b.stride(0),
        b.stride(1),
        sfb.stride(0) if sfb is not None else 0,
        sfb.stride(1) if sfb is not None else 0,
        n,
    )
    consts = dict(
        B_KIND=_KINDS[kind],
        MASKED=masked_m is not None,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        UPCAST_DOT=target(d.device) != "cuda",
    )
    options = {} if target(d.device) != "cuda" else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return args, consts, options


def _launch(kind, a, sfa, b, sfb, d, grid, sched, masked_m, m_max, tiles_per_group, cfg):
    args, consts, options = _launch_args(kind, a, sfa, b, sfb, d, sched, masked_m, m_max, tiles_per_group, cfg)
    launch(_grouped_gemm_kernel, grid, d.device, *args, **consts, **options)


def psum_rows(ends: torch.Tensor, m: int) -> torch.Tensor:
    """Per-row group ids ``[m]`` int32 of the psum layout (group g owns rows ``[align128(ends[g-1]), ends[g])``,
    -1 elsewhere), computed on ``ends``' device without reading it on the host."""
    rows = torch.arange(m, device=ends.device, dtype=torch.int64)
    e = ends.to(torch.int64)
    g = torch.searchsorted(e, rows, right=True)  # the first group whose end is past the row
    prev = torch.where(g > 0, e[(g - 1).clamp(min=0, max=e.numel() - 1)], torch.zeros_like(g))
    start = (prev + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    live = (g < e.numel()) & (rows >= start) & (rows < e[g.clamp(max=e.numel() - 1)])
    return torch.where(live, g, torch.full_like(g, -1)).to(torch.int32)


def tile_schedule(m_indices: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split runs of equal ``m_indices`` into tiles of ``block_m`` rows: (group, start, run end), int32 each."""
    ids = m_indices.to(torch.int32)
    m = ids.numel()
    change = torch.ones(m, dtype=torch.bool, device=ids.device)
    change[1:] = ids[1:] != ids[:-1]
    starts = change.nonzero().flatten()
    ends = torch.cat((starts[1:], torch.tensor([m], device=ids.device)))
    ntiles = (ends - starts + block_m - 1) // block_m
    run = torch.repeat_interleave(torch.arange(starts.numel(), device=ids.device), ntiles)
    first_tile = torch.cumsum(ntiles, 0) - ntiles
    t = torch.arange(run.numel(), device=ids.device) - first_tile[run]
    tile_start = starts[run] + t * block_m
    return ids[starts][run].contiguous(), tile_start.to(torch.int32), ends[run].to(torch.int32)


def _operands(a, sfa, b, sfb):
    """The operands as the kernel reads them: contiguous (the bf16 kind has no scales)."""
    return tuple(t.contiguous() if t is not None else None for t in (a, sfa, b, sfb))


@launcher
def contiguous_launcher(kind, a, sfa, b, sfb, d, m_indices, config: dict | None = None, use_psum_layout=False):
    """Everything a contiguous-layout launch derives from its inputs (config, TMA-ready operands, the tile
    schedule of the tile-grid kernel), done once: returns the launch, a callable of no arguments (repeatable,
    as a benchmark needs). ``m_indices`` holds per-row group ids ``[M]``, or with ``use_psum_layout`` the
    cumulative ends ``[G]``. A persistent config reads nothing on the host."""
    m, n = d.shape
    if m == 0 or n == 0:
        return lambda: None
    g, k = b.shape[0], a.shape[1]
    if g == 0:  # no groups: every row is padding
        return lambda: d.zero_()
    cfg = config or get_config(kind, n, k, max(1, m // max(g, 1)), target(d.device))
    if persistent_supported(kind, k, cfg):
        ops = (tma_operand(t) for t in (a, sfa, b, sfb))
        layout = "psum" if use_psum_layout else "contiguous"
        return persistent_launcher(kind, layout, *ops, d, m_indices.to(torch.int32).contiguous(), cfg)
    ids = psum_rows(m_indices, m) if use_psum_layout else m_indices
    sched = tile_schedule(ids, cfg["BLOCK_M"])
    grid = (sched[0].numel(), triton.cdiv(n, cfg["BLOCK_N"]))
    a, sfa, b, sfb = _operands(a, sfa, b, sfb)
    return lambda: _launch(kind, a, sfa, b, sfb, d, grid, sched, None, 0, 1, cfg)


@launcher
def masked_launcher(kind, a, sfa, b, sfb, d, masked_m, expected_m: int, config: dict | None = None):
    """As :func:`contiguous_launcher`, for the masked layout."""
    g, m_max, n = d.shape
    if g == 0 or m_max == 0 or n == 0:
        return lambda: None
    k = a.shape[-1]
    cfg = config or get_config(kind, n, k, max(1, expected_m), target(d.device))
    masked_m = masked_m.to(torch.int32).contiguous()
    if persistent_supported(kind, k, cfg):
        ops = (tma_operand(t) for t in (a, sfa, b, sfb))
        return persistent_launcher(kind, "masked", *ops, d, masked_m, cfg, m_max=m_max)
    tiles = triton.cdiv(m_max, cfg["BLOCK_M"])
    grid = (g * tiles, triton.cdiv(n, cfg["BLOCK_N"]))
    a, sfa, b, sfb = _operands(a, sfa, b, sfb)
    return lambda: _launch(kind, a, sfa, b, sfb, d, grid, None, masked_m, m_max, tiles, cfg)


def grouped_gemm_contiguous(
    kind, a, sfa, b, sfb, d, m_indices, config: dict | None = None, use_psum_layout: bool = False
) -> None:
    """Contiguous layout on validated inputs (see epkit.grouped_gemm): ``m_indices [M]`` per-row groups, -1
    padding (or, with ``use_psum_layout``, ``[G]`` cumulative ends)."""
    contiguous_launcher(kind, a, sfa, b, sfb, d, m_indices, config, use_psum_layout)()


def grouped_gemm_masked(kind, a, sfa, b, sfb, d, masked_m, expected_m: int, config: dict | None = None) -> None:
    """Masked layout on validated inputs: ``a [G, M_max, K]``, rows ``>= masked_m[g]`` untouched."""
    masked_launcher(kind, a, sfa, b, sfb, d, masked_m, expected_m, config)()
