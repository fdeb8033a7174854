"""``epkit bench`` family ``grouped_gemm``: the contiguous-layout grouped FP8 GEMM (FP8 e4m3 activations with
1x128 scales; FP8 weights with 128x128 scales, or MXFP4 weights; bf16 out) at growing rows per expert.

Roof: one dense ``torch.matmul`` of the same FLOPs (``[G*rows, K] x [K, N]``) in the backend's compute dtype
(``epkit._details.grouped_gemm_cpu.compute_dtype`` on the CPU, bf16 on a GPU) on operands dequantized
beforehand. Peers: the textbook per-expert loop (one ``torch.matmul`` per expert, on those operands) and, on a
GPU, a dense FP8 ``torch._scaled_mm`` with per-tensor scales at equal FLOPs. The grouped GEMM dequantizes its
operands inside every call, the roof and peers get them for free. Before timing, each backend's output is
compared with the ``reference`` backend's (``calc_diff``). On a GPU, L2 is flushed before every sample.
"""

from __future__ import annotations

import torch

from epkit.bench.core import BenchCtx, Case, Family, Ref, timed_backends
from epkit.grouped_gemm import build_m_indices, m_grouped_fp8_fp4_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_contiguous
from epkit.quant import cast_to_mxfp4, per_block_cast_to_fp8, per_token_group_cast_to_fp8
from epkit.utils import calc_diff

__all__ = ["FAMILY"]

OPS = {"fp8": m_grouped_fp8_gemm_nt_contiguous, "fp8_fp4": m_grouped_fp8_fp4_gemm_nt_contiguous}
OP_NAMES = {"fp8": "m_grouped_fp8_gemm_nt_contiguous", "fp8_fp4": "m_grouped_fp8_fp4_gemm_nt_contiguous"}


def _cases(ctx: BenchCtx) -> list[Case]:
    if ctx.cuda:
        groups, n, k = 4, 4096, 7168
        sweep = ctx.pick((256,), (1024, 8192), (512, 1024, 2048, 4096, 8192))
    else:
        groups, n, k = ctx.pick((2, 256, 256), (8, 1024, 1024), (8, 1024, 1024))
        sweep = ctx.pick((128,), (128, 1024), (128, 256, 512, 1024, 2048))
    cases = [
        Case(f"grouped GEMM fp8 {groups}x{rows} rows, N={n} K={k}", lambda c, r=rows: _run(c, "fp8", groups, r, n, k))
        for rows in sweep
    ]
    if ctx.size == "full":
        rows = sweep[-1]
        label = f"grouped GEMM fp8 x mxfp4 {groups}x{rows} rows, N={n} K={k}"
        cases.append(Case(label, lambda c: _run(c, "fp8_fp4", groups, rows, n, k)))
    return cases


def _inputs(ctx: BenchCtx, kind: str, groups: int, rows: int, n: int, k: int):
    """Quantized operands on the device, and the float32 originals (``[M, K]``, ``[G, N, K]``)."""
    g = torch.Generator(device=ctx.device).manual_seed(0)
    af = torch.randn(groups * rows, k, generator=g, device=ctx.device)
    bf = torch.randn(groups, n, k, generator=g, device=ctx.device) / k**0.5
    a = per_token_group_cast_to_fp8(af)
    b = per_block_cast_to_fp8(bf) if kind == "fp8" else cast_to_mxfp4(bf)
    return a, b, af, bf


def _dense_dtype(ctx: BenchCtx, d: torch.Tensor) -> torch.dtype:
    if ctx.cuda:
        return torch.bfloat16
    from epkit._details.grouped_gemm_cpu import compute_dtype

    return compute_dtype(d)


def _scaled_mm(af: torch.Tensor, bf: torch.Tensor):
    """Dense FP8 ``torch._scaled_mm`` ``[M, K] x [K, N]`` with per-tensor scales, or None where it cannot run."""
    if not hasattr(torch, "_scaled_mm"):
        return None
    a8 = af.to(torch.float8_e4m3fn)
    bt = bf[0].to(torch.float8_e4m3fn).t()  # [K, N] column-major, as cuBLASLt wants
    one = torch.ones((), dtype=torch.float32, device=af.device)

    def fn():
        return torch._scaled_mm(a8, bt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    try:
        fn()
    except (RuntimeError, NotImplementedError):
        return None
    return fn


def _run(ctx: BenchCtx, kind: str, groups: int, rows: int, n: int, k: int) -> None:
    a, b, af, bf = _inputs(ctx, kind, groups, rows, n, k)
    m_indices = build_m_indices([rows] * groups, device=ctx.device)
    op = OPS[kind]
    want = op(
        a, b, torch.empty(groups * rows, n, dtype=torch.bfloat16, device=ctx.device), m_indices, backend="reference"
    )
    fns, d = {}, torch.empty_like(want)
    backends = timed_backends(OP_NAMES[kind], ctx.device)
    for be in backends:
        diff = calc_diff(op(a, b, d, m_indices, backend=be), want)
        if ctx.check(
            f"{OP_NAMES[kind]}[{be}] {groups}x{rows} matches the reference", diff < 1e-4, f"calc_diff {diff:.2e}"
        ):
            fns[be] = lambda be=be: op(a, b, d, m_indices, backend=be)
    cd = _dense_dtype(ctx, d)
    x, w = af.to(cd), bf.to(cd)
    w_t = w[0].t().contiguous()  # [K, N]
    dense_out = torch.empty(groups * rows, n, dtype=cd, device=ctx.device)
    fns["dense"] = lambda: torch.matmul(x, w_t, out=dense_out)
    xs, ws = x.view(groups, rows, k), w.transpose(1, 2)
    loop_out = dense_out.view(groups, rows, n)

    def per_expert():
        for e in range(groups):
            torch.matmul(xs[e], ws[e], out=loop_out[e])

    fns["loop"] = per_expert
    sm = _scaled_mm(af, bf) if ctx.cuda else None
    if sm is not None:
        fns["scaled_mm"] = sm
    t = ctx.measure(fns, flush=ctx.cuda)
    name = str(cd).removeprefix("torch.")
    peers = [Ref(f"per-expert torch.matmul loop {name}", t["loop"])]
    if "scaled_mm" in t:
        peers.insert(0, Ref("torch._scaled_mm fp8 dense", t["scaled_mm"]))
    kw = {"work": 2.0 * groups * rows * n * k, "unit": "TFLOP/s", "sweep": {"rows_per_expert": rows, "kind": kind}}
    roof = Ref(f"dense torch.matmul {name}", t["dense"])
    shape = f"{groups}x{rows} rows N{n} K{k}"
    ctx.rows_of(t, backends, OP_NAMES[kind], shape, roof=roof, peers=peers, **kw)


FAMILY = Family("grouped_gemm", "grouped FP8 GEMM, contiguous layout", _cases)
