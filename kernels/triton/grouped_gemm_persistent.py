"""Persistent grouped GEMM for sm_90 ``d = a @ b[g].T``: TMA tiles, device-side tile schedule (Triton).

Why Triton and what it leaves out: the tiles come in through host-built TMA descriptors
(``triton.tools.tensor_descriptor.TensorDescriptor``: ``cp.async.bulk.tensor`` into shared memory,
completing on mbarriers, ``num_stages`` deep) and feed ``wgmma`` directly; Triton expresses all of
that, and the same source runs under the interpreter on CPU tensors (rung 2). What Triton does not
expose on sm_90 is warp specialisation (its ``warp_specialize`` is Blackwell-only in 3.6 and 3.9) or a
ping-pong of two consumer warpgroups, so the scale promotion after each 128-wide K block runs on the
warps that issued the ``wgmma`` while the TMA loads of the next ``num_stages - 1`` blocks are in flight.
A CUDA kernel under ``csrc/cuda/`` would be the next step if the measured figures need that overlap.

One launch covers every tile of every group: a persistent grid of at most one program per SM walks the
tiles ``pid, pid + grid, ...`` in grouped (L2-aware) order, ``GROUP_M`` M tiles per N sweep. Each
program finds the group of its M tile on the device from the layout tensor (``LAYOUT``):

- 0, per-row ids (``m_indices [M]``): the group is the id of the tile's first row, as DeepGEMM reads it
  (groups start on multiples of 128, ``BLOCK_M`` divides 128); rows whose id differs (``-1`` padding, or
  an id outside ``[0, G)``, which is never read as a group) are written as zeros;
- 1, cumulative ends (``psum [G]``): group ``g`` owns rows ``[align128(end[g-1]), end[g])``, found by
  counting the ends ``<=`` the tile's first row; every other row is written as zero;
- 2, masked counts (``masked_m [G]``, clamped to ``[0, M_max]``): rows ``>= masked_m[g]`` stay untouched.

A tile with no live row skips its K loop (padding tiles only write their zeros). Weight kinds
(``B_KIND``): 0 bf16; 1 FP8 with 1x128 activation and 128x128 weight scales, promoted per K block as
``acc += dot(a, b) * sa[row] * sb[col block]`` (``BLOCK_N = 256`` takes two weight-scale values);
2 FP8 x MXFP4, the e2m1 codes and e8m0 scales dequantised in registers to e5m2 (exact: for each weight
row and 128-wide K block the scale exponent common to its four 32-element blocks is taken out and applied
in the promotion, the remaining shift fits e5m2's range whenever the four exponents lie within 26
binades; an element further below is flushed to zero) and fed to the FP8 ``wgmma`` with the e4m3
activations.
"""

from __future__ import annotations

import functools
import types

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from epkit.kernels.triton.grouped_gemm_configs import GROUP_ALIGN, check_config
from epkit.kernels.triton.launch import launch, target

__all__ = [
    "LAYOUTS",
    "FP4_DECODES",
    "E2M1_PRMT",
    "persistent_supported",
    "persistent_launcher",
    "stand_ins",
    "num_programs",
    "tma_operand",
]

#: Layout tensors the kernel reads, by name: per-row ids, cumulative ends, masked counts.
LAYOUTS = {"contiguous": 0, "psum": 1, "masked": 2}
_KINDS = {"bf16": 0, "fp8": 1, "fp8_fp4": 2}
_ALIGN = tl.constexpr(GROUP_ALIGN)  # as the kernel reads it
#: e5m2 exponent bias of the dequantised e2m1 weights (6 * 2**13 is the largest value; see the module docstring).
_FP4_SHIFT = 13
#: Programs of a CPU (interpreter) launch: small, so that each program walks several tiles.
_CPU_PROGRAMS = 3
#: How FP8 x MXFP4 weights are dequantised (config key ``FP4_DECODE``): per element, or through byte-permute
#: tables in inline PTX (CUDA only; the interpreter always takes the first).
FP4_DECODES = ("plain", "prmt")


@triton.jit
def _add(x, y):
    return x + y


@triton.jit
def _raster(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(M tile, N tile) of a linear tile id: ``GROUP_M`` M tiles per sweep over N, so the A rows and B
    columns that neighbouring programs read stay in L2."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    local = tile % per_group
    return first_m + local % size_m, local // size_m


@triton.jit
def _tile_rows(layout_ptr, pm, M, G, M_MAX, LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr):
    """The M tile ``pm`` on the device: (group, first row, rows, live rows, rows to write, any live row).

    Rows index the 2-D view of ``a`` (``[M, K]``, masked: ``[G * M_max, K]``); see the module docstring.
    """
    offs = tl.arange(0, BLOCK_M)
    if LAYOUT == 2:
        tiles = (M_MAX + BLOCK_M - 1) // BLOCK_M
        g = pm // tiles
        local = (pm % tiles) * BLOCK_M + offs
        count = tl.minimum(tl.maximum(tl.load(layout_ptr + g), 0), M_MAX)
        row0 = g * M_MAX + (pm % tiles) * BLOCK_M
        ok = local < count
        write = ok
        live = (pm % tiles) * BLOCK_M < count
    else:
        row0 = pm * BLOCK_M
        rows = row0 + offs
        write = rows < M
        if LAYOUT == 0:
            g = tl.load(layout_ptr + row0)
            ids = tl.load(layout_ptr + rows, mask=write, other=-1)
            live = (g >= 0) & (g < G)  # the first row is the group's (ids outside [0, G) are padding)
            ok = (ids == g) & live
        else:
            gs = tl.arange(0, G_PAD)
            ends = tl.load(layout_ptr + gs, mask=gs < G, other=2147483647)
            g = tl.reduce((ends <= row0).to(tl.int32), 0, _add)  # the first group whose end is past row0
            prev = tl.load(layout_ptr + g - 1, mask=(g > 0) & (g <= G), other=0)
            end = tl.load(layout_ptr + g, mask=g < G, other=0)
            start = (prev + _ALIGN - 1) // _ALIGN * _ALIGN
            ok = (rows >= start) & (rows < end) & write
            live = (g < G) & (tl.maximum(row0, start) < tl.minimum(tl.minimum(row0 + BLOCK_M, end), M))
        g = tl.minimum(tl.maximum(g, 0), G - 1)
    return g, row0, row0 + offs, ok, write, live


@triton.jit
def _mainloop_fp8(
    a_desc, b_desc, sfa_ptr, sfb_ptr, row0, rows, rows_in, b_row, n0, g, N, num_k,
    stride_sfa, stride_sfbg, stride_sfbn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """``sum_kb dot(a, b)_kb * sa[row, kb] * sb[col // 128, kb]`` over the tile's K blocks, float32."""
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros is a jit function
    sb_ptr = sfb_ptr + g.to(tl.int64) * stride_sfbg + (n0 // 128) * stride_sfbn
    has_hi = n0 + 128 < N
    for kb in tl.range(0, num_k, num_stages=STAGES):
        a = a_desc.load([row0, kb * BLOCK_K])
        b = b_desc.load([b_row, kb * BLOCK_K])
        sa = tl.load(sfa_ptr + rows * stride_sfa + kb, mask=rows_in, other=0.0)
        if BLOCK_N > 128:  # two 128-column weight blocks
            sb_lo = tl.load(sb_ptr + kb)
            sb_hi = tl.load(sb_ptr + stride_sfbn + kb, mask=has_hi, other=0.0)
            sb = tl.where(tl.arange(0, BLOCK_N) < 128, sb_lo, sb_hi)
            acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
        else:
            acc += tl.dot(a, b.T) * (sa * tl.load(sb_ptr + kb))[:, None]
    return acc


# e2m1 -> e5m2 through byte-permute lookup tables, for four packed bytes (eight codes) per call: for byte i of
# $2, ``prmt`` with its table ($3+i low half, $7+i high half, entries for magnitude codes 0..7) puts the low
# nibble's e5m2 byte at byte i of $0 (the selector's other nibbles read entry 0, which is zero) and likewise
# the high nibble's into $1; the e2m1 sign bits become the e5m2 sign bits.
E2M1_PRMT = tl.constexpr("""{
.reg .b32 s, r0, r1, r2, r3;
and.b32 s, $2, 0x7; prmt.b32 r0, $3, $7, s;
shr.b32 s, $2, 4; and.b32 s, s, 0x70; prmt.b32 r1, $4, $8, s;
shr.b32 s, $2, 8; and.b32 s, s, 0x700; prmt.b32 r2, $5, $9, s;
shr.b32 s, $2, 12; and.b32 s, s, 0x7000; prmt.b32 r3, $6, $10, s;
or.b32 r0, r0, r1; or.b32 r2, r2, r3; or.b32 r0, r0, r2;
and.b32 s, $2, 0x08080808; shl.b32 s, s, 4; or.b32 $0, r0, s;
shr.b32 s, $2, 4; and.b32 s, s, 0x7; prmt.b32 r0, $3, $7, s;
shr.b32 s, $2, 8; and.b32 s, s, 0x70; prmt.b32 r1, $4, $8, s;
shr.b32 s, $2, 12; and.b32 s, s, 0x700; prmt.b32 r2, $5, $9, s;
shr.b32 s, $2, 16; and.b32 s, s, 0x7000; prmt.b32 r3, $6, $10, s;
or.b32 r0, r0, r1; or.b32 r2, r2, r3; or.b32 r0, r0, r2;
and.b32 s, $2, 0x80808080; or.b32 $1, r0, s;
}""")


@triton.jit
def _e5m2_entry(base, step, mantissa):
    """The e5m2 byte of magnitude code ``2 * step + (mantissa > 0)`` (``step`` >= 1, or the 0.5 of step 0),
    given the exponent field ``base`` of code 1; 0 where it would be subnormal (flushed)."""
    ef = base + step
    return tl.where(ef > 0, (ef << 2) | mantissa, 0)


@triton.jit
def _fp4_to_e5m2(packed, e8m0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHIFT: tl.constexpr,
                 DECODE: tl.constexpr):  # fmt: skip
    """e2m1 pairs ``[BLOCK_N, BLOCK_K / 2]`` (even element low) and their e8m0 bytes ``[BLOCK_N, BLOCK_K / 32]``
    as e5m2 values ``[BLOCK_N, BLOCK_K]`` and the per-row factor ``2**(max byte - 127 - SHIFT)`` float32.

    e2m1 magnitude code ``t``: ``t >= 1`` has e5m2 exponent field ``(t >> 1) + 14 + shift`` and, for
    ``t >= 2``, mantissa ``(t & 1) << 1`` (``t = 1`` is 0.5, e2m1's only subnormal); ``shift`` is the
    block's byte minus the row's largest, plus ``SHIFT``. ``DECODE`` 0 computes that per element, 1 (CUDA
    only: inline PTX) looks it up in per-block tables of the eight magnitudes (:data:`E2M1_PRMT`), 2 does
    the same lookups in Triton operations (the interpreter's stand-in for 1).
    """
    e = e8m0.to(tl.int32)
    lo, hi = tl.split(tl.reshape(e, (BLOCK_N, 2, 2)))  # the largest of the four bytes, BLOCK_K = 128
    lo, hi = tl.split(tl.maximum(lo, hi))
    e_max = tl.maximum(lo, hi)
    base = e - e_max[:, None] + (14 + SHIFT)  # [BLOCK_N, BLOCK_K / 32]: the exponent field of code 1
    if DECODE >= 1:  # tables: bytes 0-3 of t_lo hold codes 0-3, bytes 0-3 of t_hi codes 4-7
        t_lo = (_e5m2_entry(base, 0, 0) << 8) | (_e5m2_entry(base, 1, 0) << 16) | (_e5m2_entry(base, 1, 2) << 24)
        t_hi = _e5m2_entry(base, 2, 0) | (_e5m2_entry(base, 2, 2) << 8)
        t_hi = t_hi | (_e5m2_entry(base, 3, 0) << 16) | (_e5m2_entry(base, 3, 2) << 24)
        t_lo = tl.reshape(tl.broadcast_to(t_lo[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
        t_hi = tl.reshape(tl.broadcast_to(t_hi[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
        if DECODE == 1:
            even, odd = tl.inline_asm_elementwise(
                E2M1_PRMT, "=r,=r,r,r,r,r,r,r,r,r,r", [packed, t_lo, t_hi], dtype=(tl.uint8, tl.uint8),
                is_pure=True, pack=4,
            )  # fmt: skip
        else:  # the interpreter's stand-in for the PTX: the same table lookups, byte by byte
            p = packed.to(tl.int32)
            lo, hi = p & 7, (p >> 4) & 7
            even = tl.where(lo < 4, t_lo >> ((lo & 3) * 8), t_hi >> ((lo & 3) * 8)) & 255 | ((p & 8) << 4)
            odd = tl.where(hi < 4, t_lo >> ((hi & 3) * 8), t_hi >> ((hi & 3) * 8)) & 255 | (p & 128)
            even, odd = even.to(tl.uint8), odd.to(tl.uint8)
        w = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K)).to(tl.float8e5, bitcast=True)
    else:
        p = packed.to(tl.int32)
        code = tl.reshape(tl.join(p & 15, p >> 4), (BLOCK_N, BLOCK_K // 32, 32))
        t = code & 7
        ef = (t >> 1) + base[:, :, None]
        bits = (ef << 2) | tl.where(t >= 2, (t & 1) << 1, 0) | ((code & 8) << 4)
        bits = tl.where((t == 0) | (ef <= 0), 0, bits)
        w = tl.reshape(bits.to(tl.uint8), (BLOCK_N, BLOCK_K)).to(tl.float8e5, bitcast=True)
    eb = e_max - SHIFT  # 2**(eb - 127), built from its bits (exact; subnormal below eb = 1)
    sub = tl.where(eb + 22 >= 0, 1 << tl.maximum(eb + 22, 0), 0)
    scale = tl.where(eb >= 1, eb << 23, sub).to(tl.float32, bitcast=True)
    return w, scale


@triton.jit
def _mainloop_fp4(
    a_desc, b_desc, sfa_ptr, sfb_ptr, row0, rows, rows_in, b_row, cols, g, N, num_k,
    stride_sfa, stride_sfbg, stride_sfbn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    SHIFT: tl.constexpr, DECODE: tl.constexpr,
):  # fmt: skip
    """FP8 x MXFP4: per K block, the weights dequantised to e5m2 (:func:`_fp4_to_e5m2`), one FP8 dot,
    promoted by ``sa[row, kb] * 2**e[col, kb]``."""
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    sidx = tl.arange(0, BLOCK_K // 32)
    col_ok = cols < N
    s_ptr = sfb_ptr + g.to(tl.int64) * stride_sfbg + cols.to(tl.int64)[:, None] * stride_sfbn + sidx[None, :]
    for kb in tl.range(0, num_k, num_stages=STAGES):
        a = a_desc.load([row0, kb * BLOCK_K])
        packed = b_desc.load([b_row, kb * (BLOCK_K // 2)])
        e8m0 = tl.load(s_ptr + kb * (BLOCK_K // 32), mask=col_ok[:, None], other=127)
        sa = tl.load(sfa_ptr + rows * stride_sfa + kb, mask=rows_in, other=0.0)
        w, sw = _fp4_to_e5m2(packed, e8m0, BLOCK_N, BLOCK_K, SHIFT, DECODE)
        acc += tl.dot(a, w.T) * (sa[:, None] * sw[None, :])
    return acc


@triton.jit
def _mainloop_bf16(a_desc, b_desc, row0, b_row, num_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, STAGES: tl.constexpr, UPCAST_DOT: tl.constexpr):  # fmt: skip
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kb in tl.range(0, num_k, num_stages=STAGES):
        a = a_desc.load([row0, kb * BLOCK_K])
        b = b_desc.load([b_row, kb * BLOCK_K])
        if UPCAST_DOT:  # the interpreter's bf16 dot is wrong (triton 3.9); bf16 products are exact in fp32
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32).T)
        else:
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _persistent_kernel(
    a_desc, b_desc, sfa_ptr, sfb_ptr, d_ptr, layout_ptr,
    M, N, K, G, M_MAX, num_m_tiles, stride_sfa, stride_sfbg, stride_sfbn,
    LAYOUT: tl.constexpr, B_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr, G_PAD: tl.constexpr,
    UPCAST_DOT: tl.constexpr, FP4_SHIFT: tl.constexpr, FP4_DECODE: tl.constexpr,
):  # fmt: skip
    """Every tile ``pid, pid + grid, ...`` of the grouped GEMM; see the module docstring."""
    num_n = (N + BLOCK_N - 1) // BLOCK_N  # tl.cdiv is a jit function (see _twin)
    k_blocks = (K + BLOCK_K - 1) // BLOCK_K
    for tile in range(tl.program_id(0), num_m_tiles * num_n, tl.num_programs(0)):
        pm, pn = _raster(tile, num_m_tiles, num_n, GROUP_M)
        g, row0, rows, ok, write, live = _tile_rows(layout_ptr, pm, M, G, M_MAX, LAYOUT, BLOCK_M, G_PAD)
        num_k = tl.where(live, k_blocks, 0)  # all-padding tiles skip the K loop
        n0 = pn * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        b_row = g * N + n0
        rows_in = rows < M
        if B_KIND == 1:
            acc = _mainloop_fp8(a_desc, b_desc, sfa_ptr, sfb_ptr, row0, rows, rows_in, b_row, n0, g, N, num_k,
                                stride_sfa, stride_sfbg, stride_sfbn, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)  # fmt: skip
        elif B_KIND == 2:
            acc = _mainloop_fp4(a_desc, b_desc, sfa_ptr, sfb_ptr, row0, rows, rows_in, b_row, cols, g, N, num_k,
                                stride_sfa, stride_sfbg, stride_sfbn, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                                FP4_SHIFT, FP4_DECODE)  # fmt: skip
        else:
            acc = _mainloop_bf16(a_desc, b_desc, row0, b_row, num_k, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, UPCAST_DOT)
        out = tl.where(ok[:, None], acc, 0.0).to(d_ptr.dtype.element_ty)
        tl.store(d_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], out, mask=write[:, None] & (cols < N)[None, :])


@functools.cache
def _twin():
    """The kernel under the interpreter, calling the interpreter twins of this module's jit helpers.

    ``InterpretedFunction`` runs a function with its module's globals, where a helper is a JITFunction
    that cannot be called outside a compiled kernel; the twin runs on a copy of the globals in which
    every jit helper is replaced by its own interpreter twin.
    """
    from triton.runtime.interpreter import InterpretedFunction

    scope = dict(globals())

    def clone(fn):
        return types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)

    for name, value in globals().items():
        if isinstance(value, triton.runtime.JITFunction) and value is not _persistent_kernel:
            scope[name] = InterpretedFunction(clone(value.fn))
    return InterpretedFunction(clone(_persistent_kernel.fn))


#: SMs of the GPUs the kernels are made for (H100 SXM, H200): what a CUDA twin of a CPU call assumes.
HOPPER_SMS = 132


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device, tiles: int, per_sm: int = 1) -> int:
    """Programs of a persistent launch: ``per_sm`` per SM at most (config ``CTAS_PER_SM``: two programs of
    one warpgroup each let one promote while the other's wgmma runs; CPU: a few, so programs loop)."""
    if target(device) != "cuda":
        return max(1, min(tiles, _CPU_PROGRAMS))
    if device.type != "cuda":  # a CUDA twin of a CPU call (epkit.kernels.triton.launch)
        sms = HOPPER_SMS
    else:
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(tiles, sms * per_sm))


def persistent_supported(kind: str, k: int, cfg: dict) -> bool:
    """Whether the persistent kernel takes a call: a persistent config and a K whose rows TMA can address
    (K > 0; row strides of 16-byte multiples: any K the scaled kinds accept, K % 8 == 0 for bf16). The
    operands go through :func:`tma_operand`."""
    return cfg.get("kernel") == "persistent" and k > 0 and (kind != "bf16" or k % 8 == 0)


def tma_operand(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as a TMA descriptor can address it: itself when contiguous on a 16-byte aligned address, else a
    contiguous copy (a device copy: no host read)."""
    if t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _descriptors(kind, a, b, cfg):
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a2 = a.reshape(-1, a.shape[-1])
    b2 = b.reshape(-1, b.shape[-1])
    b_block = [bn, bk // 2 if kind == "fp8_fp4" else bk]
    return TensorDescriptor.from_tensor(a2, [bm, bk]), TensorDescriptor.from_tensor(b2, b_block), a2.shape[0]


def _fp4_decode(cfg: dict, cuda: bool) -> int:
    """The ``DECODE`` constexpr of a config: 0 per element, 1 the PTX tables (2: their interpreter stand-in)."""
    decode = cfg.get("FP4_DECODE", FP4_DECODES[0])
    if decode not in FP4_DECODES:
        raise ValueError(f"FP4_DECODE must be one of {FP4_DECODES}, got {decode!r}")
    return 0 if decode == "plain" else 1 if cuda else 2


def _args(kind, layout, a, sfa, b, sfb, d, groups, cfg, m_max, cuda: bool):
    """(positional args, constexprs, tiles): the kernel's arguments for one launch (``cuda``: compiled, not
    interpreted)."""
    check_config(cfg, kind)
    g, n, k = b.shape[0], b.shape[1], a.shape[-1]
    a_desc, b_desc, rows = _descriptors(kind, a, b, cfg)
    bm = cfg["BLOCK_M"]
    num_m = g * -(-m_max // bm) if layout == "masked" else -(-rows // bm)  # (triton.cdiv: a slow call per launch)
    dummy = d
    args = (
        a_desc, b_desc, sfa if sfa is not None else dummy, sfb if sfb is not None else dummy, d, groups,
        rows, n, k, g, m_max, num_m,
        k // 128 if sfa is not None else 0,
        sfb.stride(0) if sfb is not None else 0,
        sfb.stride(1) if sfb is not None else 0,
    )  # fmt: skip
    consts = dict(
        LAYOUT=LAYOUTS[layout],
        B_KIND=_KINDS[kind],
        BLOCK_M=bm,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"],
        STAGES=cfg["num_stages"],
        G_PAD=triton.next_power_of_2(g) if layout == "psum" else 1,
        UPCAST_DOT=not cuda,
        FP4_SHIFT=_FP4_SHIFT,
        FP4_DECODE=_fp4_decode(cfg, cuda),
    )
    return args, consts, num_m * -(-n // cfg["BLOCK_N"])


def _options(cfg: dict) -> dict:
    """Launch options: the config's warps and stages, and FP fusion on (epkit.kernels.triton turns Triton's
    default off so that elementwise kernels round like their references; the promotion here is one FFMA per
    element instead of a multiply and an add, and the GEMMs are compared by calc_diff, not bits)."""
    return dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=True)


def persistent_launcher(kind, layout, a, sfa, b, sfb, d, groups, cfg, m_max: int = 0):
    """One launch of the persistent kernel on validated operands, as a callable of no arguments.

    ``layout`` is ``"contiguous"`` (``groups`` = per-row ids ``[M]``), ``"psum"`` (cumulative ends ``[G]``)
    or ``"masked"`` (counts ``[G]``, with ``m_max`` rows per group); ``groups`` is int32 and contiguous,
    on the operands' device. Nothing here reads device data: the schedule is found by the kernel.
    """
    cuda = target(d.device) == "cuda"
    args, consts, tiles = _args(kind, layout, a, sfa, b, sfb, d, groups, cfg, m_max, cuda)
    grid = (num_programs(d.device, tiles, cfg.get("CTAS_PER_SM", 1)),)
    options = _options(cfg) if cuda else {}
    return lambda: launch(_persistent_kernel, grid, d.device, *args, interpret=_interpreted, **consts, **options)


def _interpreted(kernel):
    return _twin()


def stand_ins(kind: str, masked: bool, g: int, rows: int, n: int, k: int, out=torch.bfloat16):
    """CPU tensors of a launch's shapes and dtypes, ``(a, sfa, b, sfb, d)``, never written (``torch.empty``
    touches no memory): what an ahead-of-time compile specialises on."""
    a_dt = torch.bfloat16 if kind == "bf16" else torch.float8_e4m3fn
    a = torch.empty((g, rows, k) if masked else (g * rows, k), dtype=a_dt)
    sfa = None if kind == "bf16" else torch.empty((*a.shape[:-1], k // 128), dtype=torch.float32)
    if kind == "fp8_fp4":
        b, sfb = torch.empty((g, n, k // 2), dtype=torch.uint8), torch.empty((g, n, k // 32), dtype=torch.uint8)
    else:
        b = torch.empty((g, n, k), dtype=a_dt)
        sfb = None if kind == "bf16" else torch.empty((g, -(-n // 128), k // 128), dtype=torch.float32)
    return a, sfa, b, sfb, torch.empty((*a.shape[:-1], n), dtype=out)
