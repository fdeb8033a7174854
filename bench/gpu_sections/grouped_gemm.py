"""gpu_check section ``grouped_gemm``: the grouped GEMMs of ``epkit.grouped_gemm`` (FP8, FP8 x MXFP4, bf16;
contiguous and masked) against float32 of the unquantized inputs, then FP8 TFLOP/s at DeepGEMM's published
shapes against a same-run bf16 ``torch.matmul`` at equal FLOPs, dense ``torch._scaled_mm`` FP8 and
DeepGEMM's H800 figure."""

from __future__ import annotations

import math

import torch

from gpu_sections.common import Ctx, record_check

__all__ = ["DEEPGEMM_H800_TFLOPS", "GEMM_THRESH", "sec_grouped_gemm"]

#: DeepGEMM's published H800 FP8 figure for contiguous grouped GEMM, 4 groups x 8192 rows, N=4096, K=7168.
DEEPGEMM_H800_TFLOPS = 1346.0
#: calc_diff thresholds against a float32 matmul of the unquantized inputs (as tests/test_grouped_gemm.py).
GEMM_THRESH = {"fp8": 1e-3, "fp8_fp4": 1e-2, "bf16": 1e-5}
KINDS = ("fp8", "fp8_fp4", "bf16")


def sec_grouped_gemm(ctx: Ctx, res: dict):
    import epkit.grouped_gemm as gemm

    backend = "triton" if ctx.cuda else "cpu"
    res["backend"] = backend
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 references must be float32
    try:
        _correctness(ctx, res, gemm, backend)
        ctx.log(f"correctness done ({len(res.get('checks', []))} checks)")
        _perf(ctx, res, gemm, backend)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    first = next(iter(res["perf"].values()), None)
    if first is not None:
        res["summary"] = (
            f"{next(iter(res['perf']))}: {first['epkit_fp8']['TFLOPs']:.1f} TFLOP/s, "
            f"{first['fraction_of_bf16_roof']:.0%} of torch bf16"
            + (
                f", {first['fraction_of_deepgemm_h800']:.0%} of DeepGEMM H800"
                if "fraction_of_deepgemm_h800" in first
                else ""
            )
        )
    return None


def _group_ref(af: torch.Tensor, bf: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 ``af[i] @ bf[ids[i]].T`` group by group (zeros for ids -1), on af's device."""
    out = torch.zeros(af.shape[0], bf.shape[1], dtype=torch.float32, device=af.device)
    for grp in range(bf.shape[0]):
        sel = ids == grp
        if bool(sel.any()):
            out[sel] = af[sel].float() @ bf[grp].float().T
    return out


def _to_device(kind: str, operand, dev: torch.device):
    """An operand of ``make_inputs`` on ``dev``: a (values, scales) pair for the quantized kinds, a tensor for bf16."""
    return tuple(x.to(dev) for x in operand) if kind != "bf16" else operand.to(dev)


def _correctness(ctx: Ctx, res: dict, gemm, backend: str) -> None:
    """Contiguous (random rows per group incl. 0, padding rows exactly zero) and masked (masked_m incl. 0 and
    M_max, rows beyond untouched), against float32 of the unquantized inputs."""
    shapes = [(256, 512), (512, 256), (384, 1024)] if not ctx.dry else [(256, 512)]
    for kind in KINDS:
        for n, k in shapes:
            ctx.check(f"correctness {kind} contiguous {n}x{k}")
            _contiguous_check(ctx, res, gemm, backend, kind, n, k)
        ctx.check(f"correctness {kind} masked")
        _masked_check(ctx, res, gemm, backend, kind, *shapes[0])


def _contiguous_check(ctx: Ctx, res: dict, gemm, backend: str, kind: str, n: int, k: int) -> None:
    from epkit.testing import calc_diff

    dev = ctx.device
    contig = getattr(gemm, f"m_grouped_{kind}_gemm_nt_contiguous")
    gen = torch.Generator().manual_seed(n + k)
    counts = torch.randint(0, 150, (4,), generator=gen)
    counts[1] = 0
    m_indices = gemm.build_m_indices(counts)
    m = m_indices.numel()
    a, b, af, bf = gemm.make_inputs(kind, 4, m, n, k, masked=False, seed=n + k)
    d = torch.full((m, n), 7.0, dtype=torch.bfloat16, device=dev)
    contig(_to_device(kind, a, dev), _to_device(kind, b, dev), d, m_indices.to(dev), backend=backend)
    d = d.cpu()
    ctx_s = f"{kind} contiguous G=4 counts={counts.tolist()} N={n} K={k}"
    pad = m_indices < 0
    record_check(res, ctx_s + ": padding rows are zero", bool((d[pad] == 0).all()))
    diff = calc_diff(d.float(), _group_ref(af, bf, m_indices))
    ok = math.isfinite(diff) and diff <= GEMM_THRESH[kind] and bool(torch.isfinite(d.float()).all())
    record_check(res, ctx_s + f": calc_diff {diff:.2e} <= {GEMM_THRESH[kind]:.0e}", ok, f"calc_diff={diff}")


def _masked_check(ctx: Ctx, res: dict, gemm, backend: str, kind: str, n: int, k: int) -> None:
    from epkit.testing import calc_diff

    dev = ctx.device
    masked = getattr(gemm, f"m_grouped_{kind}_gemm_nt_masked")
    m_max = 96
    a, b, af, bf = gemm.make_inputs(kind, 4, m_max, n, k, masked=True, seed=17)
    masked_m = torch.tensor([m_max, 0, 37, 95], dtype=torch.int32)
    d = torch.full((4, m_max, n), -3.0, dtype=torch.float32, device=dev)
    masked(_to_device(kind, a, dev), _to_device(kind, b, dev), d, masked_m.to(dev), m_max, backend=backend)
    d = d.cpu()
    live = torch.arange(m_max)[None, :] < masked_m[:, None].long()
    ref = torch.einsum("gmk,gnk->gmn", af.float(), bf.float())
    ctx_s = f"{kind} masked G=4 M_max={m_max} masked_m={masked_m.tolist()} N={n} K={k}"
    record_check(res, ctx_s + ": rows beyond masked_m untouched", bool((d[~live] == -3.0).all()))
    diff = calc_diff(d[live], ref[live])
    ok = math.isfinite(diff) and diff <= GEMM_THRESH[kind]
    record_check(res, ctx_s + f": calc_diff {diff:.2e} <= {GEMM_THRESH[kind]:.0e}", ok, f"calc_diff={diff}")


def _perf(ctx: Ctx, res: dict, gemm, backend: str) -> None:
    """TFLOP/s at DeepGEMM's published shapes, FP8 x FP8 (1x128 activation, 128x128 weight scales), bf16 out,
    into ``res["perf"]`` (CPU: small shapes, for the control flow)."""
    if ctx.cuda:
        rows_c, rows_m = (8192, (1024, 512, 256)) if not ctx.quick else (2048, (256, 128, 64))
        contig_shapes = [(4, rows_c, 4096, 7168), (4, rows_c, 7168, 2048)]
        masked_shapes = [(1, rows_m[0], 4096, 7168), (2, rows_m[1], 4096, 7168), (4, rows_m[2], 4096, 7168)]
    else:
        contig_shapes = [(4, 128, 256, 512), (4, 128, 512, 256)]
        masked_shapes = [(1, 128, 256, 512), (2, 64, 256, 512), (4, 32, 256, 512)]
    iters = 15 if not ctx.quick else 5
    perf = {}
    res["perf"] = perf
    for layout, shape_list in (("contiguous", contig_shapes), ("masked", masked_shapes)):
        for grp, rows, n, k in shape_list:
            name = f"{layout} {grp}x{rows} N={n} K={k}"
            ctx.check(f"perf {name}")
            entry = _gemm_perf(ctx, res, gemm, layout, grp, rows, n, k, backend, iters)
            perf[name] = entry
            ctx.log(
                f"{name}: {entry['epkit_fp8']['TFLOPs']:.1f} TFLOP/s "
                f"({entry['fraction_of_bf16_roof']:.0%} of torch bf16 "
                f"{entry['torch_matmul_bf16_roof']['TFLOPs']:.1f})"
            )


def _gemm_perf(ctx: Ctx, res: dict, gemm, layout: str, grp: int, rows: int, n: int, k: int, backend: str, iters: int):
    """TFLOP/s of one FP8 grouped GEMM shape (all groups full) with its same-run peers and an accuracy check."""
    from epkit.quant import per_block_cast_to_fp8, per_token_group_cast_to_fp8
    from epkit.testing import calc_diff

    dev = ctx.device
    name = f"{layout} {grp}x{rows} N={n} K={k}"
    torch.manual_seed(grp * rows + n)
    m = grp * rows
    x = torch.randn((m, k) if layout == "contiguous" else (grp, rows, k), device=dev)
    w = torch.randn(grp, n, k, device=dev) / k**0.5
    a, b = per_token_group_cast_to_fp8(x), per_block_cast_to_fp8(w)
    d = torch.empty((m, n) if layout == "contiguous" else (grp, rows, n), dtype=torch.bfloat16, device=dev)
    if layout == "contiguous":
        m_indices = gemm.build_m_indices([rows] * grp, device=dev)

        def fn():
            gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, backend=backend)
    else:
        masked_m = torch.full((grp,), rows, dtype=torch.int32, device=dev)

        def fn():
            gemm.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, rows, backend=backend)

    fn()
    ids = torch.arange(grp, device=dev).repeat_interleave(rows)
    diff = calc_diff(d.reshape(m, n).float(), _group_ref(x.reshape(m, k), w, ids))
    del x
    record_check(res, f"perf shape {name}: calc_diff {diff:.2e} <= 1e-3", diff <= 1e-3, f"calc_diff={diff}")
    flops = 2.0 * m * n * k
    entry = {"groups": grp, "rows_per_group": rows, "n": n, "k": k, "flops": flops, "calc_diff": diff}
    kernel = _gemm_kernel_call(ctx, backend, layout, a, b, d, m_indices if layout == "contiguous" else masked_m, rows)
    if kernel is not None:
        # The kernel alone (its tile schedule built once), as the peers are timed: the public op also
        # validates its inputs on the host, which syncs and leaves the GPU idle inside the timed window.
        want = d.clone()
        d.zero_()
        kernel()
        record_check(res, f"perf shape {name}: the kernel alone gives the op's result", torch.equal(d, want))
        t = ctx.time_op(kernel, iters=iters, flush=True, warmup=2)
        t_op = ctx.time_op(fn, iters=iters, flush=True, warmup=1)
        entry["epkit_fp8_op"] = {**t_op, "TFLOPs": flops / (t_op["median_ms"] * 1e-3) / 1e12}
    else:
        t = ctx.time_op(fn, iters=iters, flush=True, warmup=2)
    entry["epkit_fp8"] = {**t, "TFLOPs": flops / (t["median_ms"] * 1e-3) / 1e12}
    entry["epkit_fp8"]["timed"] = "the Triton kernel launch" if kernel is not None else "the public op"
    a16, b16 = a[0].reshape(m, k).to(torch.bfloat16), w[0].to(torch.bfloat16)
    tb = ctx.time_op(lambda: torch.matmul(a16, b16.T), iters=iters, flush=True, warmup=2)
    entry["torch_matmul_bf16_roof"] = {**tb, "TFLOPs": flops / (tb["median_ms"] * 1e-3) / 1e12}
    entry["fraction_of_bf16_roof"] = entry["epkit_fp8"]["TFLOPs"] / entry["torch_matmul_bf16_roof"]["TFLOPs"]
    sm = _scaled_mm_peer(ctx, a[0].reshape(m, k), b[0][0], flops, iters)
    entry["torch_scaled_mm_fp8"] = sm
    if isinstance(sm, dict):
        entry["fraction_of_scaled_mm"] = entry["epkit_fp8"]["TFLOPs"] / sm["TFLOPs"]
    if layout == "contiguous" and (grp, rows, n, k) == (4, 8192, 4096, 7168):
        entry["deepgemm_h800_TFLOPs"] = DEEPGEMM_H800_TFLOPS
        entry["fraction_of_deepgemm_h800"] = entry["epkit_fp8"]["TFLOPs"] / DEEPGEMM_H800_TFLOPS
        entry["meets_first_milestone_0.6"] = entry["fraction_of_deepgemm_h800"] >= 0.6
    return entry


def _gemm_kernel_call(ctx: Ctx, backend: str, layout: str, a, b, d, groups, rows: int):
    """On CUDA with the Triton backend: the FP8 grouped GEMM's launch, with everything the op derives from
    its inputs (config, tile schedule, contiguous operands) done once; None otherwise."""
    if not ctx.cuda or backend != "triton":
        return None
    from epkit.kernels.triton import grouped_gemm as tg

    (a8, sfa), (b8, sfb) = a, b
    if layout == "contiguous":
        return tg.contiguous_launcher("fp8", a8, sfa, b8, sfb, d, groups)
    return tg.masked_launcher("fp8", a8, sfa, b8, sfb, d, groups, rows)


def _scaled_mm_peer(ctx: Ctx, a8: torch.Tensor, b8: torch.Tensor, flops: float, iters: int):
    """Dense ``torch._scaled_mm`` FP8 (per-tensor scales, bf16 out) at equal FLOPs, or why it is unavailable."""
    if not hasattr(torch, "_scaled_mm"):
        return "unavailable: this torch has no torch._scaled_mm"
    if not ctx.cuda:
        return "skipped on CPU: torch._scaled_mm has no fast CPU kernel (seconds per call)"
    one = torch.ones((), dtype=torch.float32, device=a8.device)
    bt = b8.t()  # [K, N] column-major, as cuBLASLt wants

    def fn():
        return torch._scaled_mm(a8, bt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - an unsupported device/dtype is a fact to record, not a failure
        return f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    t = ctx.time_op(fn, iters=iters, flush=True, warmup=2)
    return {**t, "TFLOPs": flops / (t["median_ms"] * 1e-3) / 1e12}
