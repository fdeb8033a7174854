"""The persistent TMA grouped GEMM (kernels/triton/grouped_gemm_persistent.py) up the ladder: its source under
the interpreter (rung 2: psum layout, ids the kernel must treat as padding, wide tiles, the FP4 decode read back
bit for bit), the ops' host work read-free on the CUDA path, its sm_90 binaries (rung 3: wgmma fed by TMA, no
local memory, shared memory within a block's limit) and, on a GPU, the ops without a synchronisation (rung 4)."""

from __future__ import annotations

import math

import pytest
import torch

import epkit.grouped_gemm as gemm
from epkit.grouped_gemm import build_m_indices, grouped_gemm_reference, make_inputs
from epkit.quant import dequant_mxfp4
from epkit.testing import assert_bitwise_equal, assert_diff, calc_diff
from epkit.testing.host_sync import HostSyncDetector
from epkit.testing.markers import requires_cuda, requires_triton

KINDS = ["fp8", "fp8_fp4", "bf16"]
THRESH = {"fp8": 1e-3, "fp8_fp4": 1e-2, "bf16": 1e-5}
CONTIG = {k: getattr(gemm, f"m_grouped_{k}_gemm_nt_contiguous") for k in KINDS}
MASKED = {k: getattr(gemm, f"m_grouped_{k}_gemm_nt_masked") for k in KINDS}


def _split(kind, a, b):
    """(a, sfa, b, sfb) of an op's operands (no scales for bf16)."""
    return (*a, *b) if kind != "bf16" else (a, None, b, None)


def _psum_case():
    """Cumulative ends with empty groups, gaps up to aligned starts, groups ending inside a tile and the last
    one before M; and the per-row ids they mean, written out by hand."""
    ends = torch.tensor([5, 5, 258, 258, 420], dtype=torch.int32)  # [0, 5), -, [128, 258), -, [384, 420)
    m = 448
    ids = torch.full((m,), -1, dtype=torch.int32)
    ids[:5] = 0
    ids[128:258] = 2
    ids[384:420] = 4
    return ends, ids, m


@requires_triton
@pytest.mark.parametrize("kind", KINDS)
def test_psum_layout_found_on_the_device(kind):
    from epkit.kernels.triton.grouped_gemm import psum_rows

    ends, ids, m = _psum_case()
    assert torch.equal(psum_rows(ends, m), ids), "the device-side psum -> rows conversion"
    n, k = 96, 256
    a, b, af, bf = make_inputs(kind, 5, m, n, k, masked=False, seed=4)
    d = torch.full((m, n), 3.0, dtype=torch.bfloat16)
    CONTIG[kind](a, b, d, ends, use_psum_layout=True, backend="triton")
    want = CONTIG[kind](a, b, torch.full((m, n), 3.0, dtype=torch.bfloat16), ids, backend="reference")
    assert_bitwise_equal(d[ids < 0], torch.zeros_like(d[ids < 0]), ctx=f"{kind}: padding and gap rows are zeros")
    assert_diff(d.float(), want.float(), 1e-5, f"{kind} psum vs the reference on per-row ids")


@requires_triton
def test_ids_the_kernel_cannot_use_are_padding():
    # The op checks ids on CPU tensors only; on a GPU the kernel reads them unchecked, so an id outside
    # [0, G) and rows whose id differs from their 128-row block's group must come out as zeros, never as
    # reads of another group's weights or outside the tensors.
    from epkit.kernels.triton.grouped_gemm import grouped_gemm_contiguous

    g, n, k = 3, 64, 256
    ids = build_m_indices([100, 128, 60])
    ids[5] = 7  # beyond G inside group 0's block
    ids[300:310] = -9  # below -1 inside group 2's block
    ids[200] = 0  # group 0 inside group 1's block
    ids[320] = 2  # a group's own id after -9s: still its block's group
    m = ids.numel()
    (aq, sfa), (bq, sfb), af, bf = make_inputs("fp8", g, m, n, k, masked=False, seed=8)
    d = torch.full((m, n), 4.0, dtype=torch.bfloat16)
    grouped_gemm_contiguous("fp8", aq, sfa, bq, sfb, d, ids)
    first = ids[torch.arange(m) // 128 * 128]
    live = (ids >= 0) & (ids < g) & (ids == first)
    ref = grouped_gemm_reference("fp8", aq, sfa, bq, sfb, torch.zeros(m, n), m_indices=torch.where(live, ids, -1))
    assert bool((d[~live] == 0).all()), "rows the kernel cannot use are zeros"
    assert_diff(d.float(), ref, 1e-5, "live rows")


@requires_triton
def test_wide_tiles_take_two_weight_scales(monkeypatch):
    # BLOCK_N = 256 spans two 128-column weight blocks: each half is promoted by its own scale (N = 384:
    # the second tile's upper half lies past N).
    from epkit.kernels.triton import grouped_gemm_configs as cfgs

    wide = dict(kernel="persistent", BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, GROUP_M=2, num_warps=8, num_stages=1)
    monkeypatch.setattr(cfgs, "_CONFIG_OVERRIDE", lambda *args: wide)
    ids = build_m_indices([70, 20])
    m, n, k = ids.numel(), 384, 256
    a, b, _, _ = make_inputs("fp8", 2, m, n, k, masked=False, seed=6)
    got = CONTIG["fp8"](a, b, torch.empty(m, n, dtype=torch.float32), ids, backend="triton")
    want = CONTIG["fp8"](a, b, torch.empty(m, n, dtype=torch.float32), ids, backend="reference")
    assert calc_diff(got, want) < 1e-6


def _one_hot_fp8(k: int):
    """``(e4m3 identity [k, k], unit scales)``: as activations they read the weights back, d[m, n] = w[n, m]."""
    return torch.eye(k).to(torch.float8_e4m3fn), torch.ones(k, k // 128)


FP4_PRMT = dict(kernel="persistent", BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=2, num_warps=4, num_stages=1)


@requires_triton
@pytest.mark.parametrize("decode", ["plain", "prmt"])
def test_fp4_weights_dequantised_in_registers_read_back_exactly(decode, monkeypatch):
    """Through one-hot activations the kernel's dequantised weights are the output itself: the e5m2 values
    times the row's common scale must be ``dequant_mxfp4``'s values bit for bit while the four e8m0
    exponents of a 128-wide K block lie within 26 binades; an element of a block further below its row's
    largest is flushed to zero (the module docstring's stated limit)."""
    from epkit.kernels.triton import grouped_gemm_configs as cfgs

    if decode == "prmt":  # on CPU tensors the table lookups run as Triton operations (the PTX needs a GPU)
        monkeypatch.setattr(cfgs, "_CONFIG_OVERRIDE", lambda *args: dict(FP4_PRMT, FP4_DECODE="prmt"))
    n, k = 64, 256
    gen = torch.Generator().manual_seed(12)
    packed = torch.randint(0, 256, (1, n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(110, 137, (1, n, k // 32), generator=gen, dtype=torch.uint8)  # spread <= 26
    scale[0, 0, :4] = torch.tensor([140, 114, 127, 139], dtype=torch.uint8)  # spread 26, the exact limit
    scale[0, 1, 4:] = torch.tensor([150, 110, 150, 150], dtype=torch.uint8)  # spread 40: block 1 flushes
    a = _one_hot_fp8(k)
    d = CONTIG["fp8_fp4"](a, (packed, scale), torch.empty(k, n), torch.zeros(k, dtype=torch.int32), backend="triton")
    want = dequant_mxfp4(packed, scale)[0].T.contiguous()  # [k, n]
    flushed = torch.zeros(k, n, dtype=torch.bool)
    flushed[128 + 32 : 128 + 64, 1] = True  # weight row 1, K block 1, its 32-element block 1
    # values, not bits: a sum of one product and exact zeros loses the sign of a zero weight
    assert torch.equal(d[~flushed], want[~flushed]), "dequantised weights within 26 binades"
    assert bool((want[~flushed] != 0).float().mean() > 0.8), "the check needs mostly non-zero weights"
    assert bool((d[flushed] == 0).all()) and bool((want[flushed] != 0).any()), "a block 40 binades down flushes"


def _e5m2_byte(v: float) -> int:
    """The e5m2 encoding of v from its definition (2**(E - 15) * (1 + M/4), E in 1..30), values below the
    normal range flushed to (signed) zero, as the kernel documents."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    m, e = math.frexp(abs(v))  # abs(v) = m * 2**e, 0.5 <= m < 1
    if v == 0 or e - 1 < -14:
        return sign
    mant = (m * 2 - 1) * 4
    assert mant == int(mant) and 1 <= e - 1 + 15 <= 30, v
    return sign | ((e - 1 + 15) << 2) | int(mant)


def _run_ptx(text: str, regs: dict) -> dict:
    """Execute the straight-line b32 PTX of the kernel's inline asm (and, or, shl, shr, prmt) on Python ints;
    ``$i`` operands are looked up in ``regs`` (prmt: default mode, selector nibbles pick bytes of b:a)."""
    env = dict(regs)
    val = lambda x: env[x] if x in env else int(x, 0)  # noqa: E731
    for ins in (i.strip() for i in text.replace("{", ";").replace("}", ";").split(";")):
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        d, *src = [x.strip() for x in rest.split(",")]
        x = [val(t) for t in src]
        if op == "and.b32":
            env[d] = x[0] & x[1]
        elif op == "or.b32":
            env[d] = x[0] | x[1]
        elif op == "shl.b32":
            env[d] = (x[0] << x[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            env[d] = x[0] >> x[1]
        elif op == "prmt.b32":
            pool = x[0] | (x[1] << 32)
            out = 0
            for i in range(4):
                sel = (x[2] >> (4 * i)) & 0xF
                byte = (pool >> (8 * (sel & 7))) & 0xFF
                out |= (0xFF if sel & 8 and byte & 0x80 else 0 if sel & 8 else byte) << (8 * i)
            env[d] = out
        else:
            raise AssertionError(f"unexpected instruction {ins!r}")
    return env


def test_fp4_prmt_tables_decode_every_byte_at_every_shift():
    """The kernel's inline PTX, executed instruction by instruction on lookup tables built from the e5m2
    definition, turns each of the 256 bytes (two e2m1 codes) into the two e5m2 bytes of their values, at
    every exponent shift, including those that flush."""
    from epkit.kernels.triton.grouped_gemm_persistent import E2M1_PRMT

    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for base in range(-3, 28):  # the e5m2 exponent field of code 1 (0.5)
        scale = 2.0 ** (base - 14)
        table = [_e5m2_byte(e2m1[t] * scale) for t in range(8)]
        t_lo, t_hi = (sum(table[4 * h + i] << (8 * i) for i in range(4)) for h in (0, 1))
        for word in range(0, 256**4, 0x01030507):  # four bytes at a time, every byte value in each position
            regs = {"$2": word, **{f"${3 + i}": t_lo for i in range(4)}, **{f"${7 + i}": t_hi for i in range(4)}}
            out = _run_ptx(E2M1_PRMT.value, regs)
            for i in range(4):
                b = (word >> (8 * i)) & 0xFF
                for nib, got in ((b & 15, out["$0"]), (b >> 4, out["$1"])):
                    want = _e5m2_byte(math.copysign(e2m1[nib & 7] * scale, -1.0 if nib & 8 else 1.0))
                    assert (got >> (8 * i)) & 0xFF == want, (base, hex(word), i, nib)


# The CUDA path's host work, shown on CPU tensors: the op skips the data checks only for CUDA tensors, so with
# them switched off (as for a GPU) the op must read nothing of the tensors on the host.

LAYOUTS = ["contiguous", "psum", "masked"]


def _layout_case(kind, layout, seed=0):
    """``(op, args, keywords, reference result)`` of one small case of ``layout``, on CPU tensors."""
    n, k = 64, 256
    if layout == "masked":
        a, b, _, _ = make_inputs(kind, 3, 40, n, k, masked=True, seed=seed)
        mm = torch.tensor([40, 0, 11], dtype=torch.int32)
        ref = MASKED[kind](a, b, torch.zeros(3, 40, n), mm, 20, backend="reference")
        return MASKED[kind], (a, b, torch.zeros(3, 40, n), mm, 20), {}, ref
    ends, ids, m = _psum_case()
    a, b, _, _ = make_inputs(kind, 5, m, n, k, masked=False, seed=seed)
    ref = CONTIG[kind](a, b, torch.zeros(m, n), ids, backend="reference")
    groups, psum = (ends, True) if layout == "psum" else (ids, False)
    return CONTIG[kind], (a, b, torch.zeros(m, n), groups), {"use_psum_layout": psum}, ref


def _to(x, dev):
    """Tensors (and pairs of them) of an op's arguments on ``dev``; other values as they are."""
    if isinstance(x, tuple):
        return tuple(_to(t, dev) for t in x)
    return x.to(dev) if isinstance(x, torch.Tensor) else x


@requires_triton
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["fp8", "fp8_fp4"])
def test_ops_read_no_tensor_on_the_host_without_data_checks(kind, layout, monkeypatch):
    monkeypatch.setattr(gemm, "_data_checks", lambda device: False)
    op, args, kw, ref = _layout_case(kind, layout)
    with HostSyncDetector(strict=True):
        got = op(*args, **kw, backend="triton")
    assert_diff(got, ref, 1e-5, f"{kind} {layout}")


@requires_triton
def test_the_tile_grid_kernel_is_seen_reading_the_host(monkeypatch):
    # negative control: the previous kernel's host-built schedule (nonzero, repeat_interleave) is caught
    from epkit.kernels.triton import grouped_gemm_configs as cfgs

    tiles = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1)
    monkeypatch.setattr(cfgs, "_CONFIG_OVERRIDE", lambda *args: tiles)
    monkeypatch.setattr(gemm, "_data_checks", lambda device: False)
    op, args, kw, _ = _layout_case("fp8", "contiguous")
    with HostSyncDetector() as det:
        op(*args, **kw, backend="triton")
    assert any("nonzero" in e for e in det.events), det.events


# Configurations of the GPU tests below.

WIDE = dict(kernel="persistent", BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
PREFILL_CFG = dict(WIDE, BLOCK_M=128, BLOCK_N=128)


# Rung 4 (a GPU): no synchronisation, the kernel's clamps, the debug checks.


@requires_cuda
@requires_triton
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_ops_never_synchronise(kind, layout):
    op, args, kw, ref = _layout_case(kind, layout, seed=3)
    args = _to(args, torch.device("cuda"))
    op(*args, **kw, backend="triton")  # compile outside the guarded call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = op(*args, **kw, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_diff(got.cpu(), ref, 1e-5, f"{kind} {layout} on the GPU")


@requires_cuda
@requires_triton
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_ops_capture_into_a_cuda_graph(layout):
    # no host read of device data: the op records into a CUDA graph, whose replay on new values is correct
    op, args, kw, _ = _layout_case("fp8", layout, seed=7)
    args = _to(args, torch.device("cuda"))
    op(*args, **kw, backend="triton")  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(*args, **kw, backend="triton")
    aq, d = args[0][0], args[2]
    aq.copy_((aq.float() * -1).to(aq.dtype))  # new activations, same buffers
    d.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    want = op(*_to(args, torch.device("cpu")), **kw, backend="reference")
    assert_diff(d.cpu(), want, 1e-5, f"{layout}: graph replay on new activations")


@requires_cuda
@requires_triton
def test_gpu_fp4_prmt_decode_matches_the_reference(monkeypatch):
    from epkit.kernels.triton import grouped_gemm_configs as cfgs

    monkeypatch.setattr(cfgs, "_CONFIG_OVERRIDE", lambda *args: dict(PREFILL_CFG, FP4_DECODE="prmt"))
    op, args, kw, ref = _layout_case("fp8_fp4", "contiguous", seed=5)
    got = op(*_to(args, torch.device("cuda")), **kw, backend="triton")
    assert_diff(got.cpu(), ref, 1e-5, "FP8 x MXFP4 through the PTX tables on the GPU")


@requires_cuda
@requires_triton
def test_gpu_debug_checks_catch_a_misaligned_layout(monkeypatch):
    a, b, _, _ = make_inputs("fp8", 2, 256, 64, 128, masked=False)
    a, b = tuple(t.cuda() for t in a), tuple(t.cuda() for t in b)
    bad = torch.tensor([0] * 100 + [1] * 156, dtype=torch.int32, device="cuda")
    d = torch.zeros(256, 64, device="cuda")
    CONTIG["fp8"](a, b, d, bad, backend="triton")  # unchecked: group 1's rows in group 0's block are zeros
    assert bool((d[100:128] == 0).all()) and bool((d[:100] != 0).any())
    monkeypatch.setenv("EPKIT_GEMM_CHECKS", "1")
    with pytest.raises(ValueError, match=r"m_indices\[100\] = 1 but the 128-row block from row 0"):
        CONTIG["fp8"](a, b, d, bad, backend="triton")
