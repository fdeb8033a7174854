"""gpu_check section ``grouped_gemm``: the grouped GEMMs of ``epkit.grouped_gemm`` (FP8, FP8 x MXFP4, bf16;
contiguous, psum and masked) against float32 of the unquantized inputs, then TFLOP/s at DeepGEMM's published
shapes with same-run peers and issue 19's targets read off into ``res["targets"]``.

Per shape (``res["perf"]``): the persistent kernel alone (its launch prepared once), the public op (and that
it does not synchronise), torch bf16 ``matmul`` at equal FLOPs, dense FP8 ``torch._scaled_mm`` with per-tensor
scales (the cuBLAS ceiling), the DeepSeek block-scaled recipe (1x128 activation, 128x128 weight scales) through
``torch._scaled_mm`` one call per group where this torch and cuBLASLt take it on the device, bf16
``torch.nn.functional.grouped_mm`` where present, and DeepGEMM's published H800 figure as context. At the first
shape also FP8 x MXFP4 and the tile-grid kernel. Items run in priority order (the targets' shapes first);
optional ones are skipped with a note when the section's budget is short.
"""

from __future__ import annotations

import math

import torch

from gpu_sections.common import Ctx, record_check

__all__ = ["DEEPGEMM_H800", "GEMM_THRESH", "TARGETS", "sec_grouped_gemm"]

#: DeepGEMM's published H800 FP8 TFLOP/s at these shapes (context only: another GPU, another run).
DEEPGEMM_H800 = {
    "contiguous 4x8192 N=4096 K=7168": 1346.0,
    "masked 1x1024 N=4096 K=7168": 1233.0,
    "masked 2x512 N=4096 K=7168": 1040.0,
    "masked 4x256 N=4096 K=7168": 932.0,
}
#: calc_diff thresholds against a float32 matmul of the unquantized inputs (as tests/test_grouped_gemm.py).
GEMM_THRESH = {"fp8": 1e-3, "fp8_fp4": 1e-2, "bf16": 1e-5}
KINDS = ("fp8", "fp8_fp4", "bf16")
FIRST, M1, M4 = "contiguous 4x8192 N=4096 K=7168", "masked 1x1024 N=4096 K=7168", "masked 4x256 N=4096 K=7168"
#: Issue 19's targets on one H200: (name, perf entry, field of the entry, threshold, True when higher is better).
TARGETS = (
    (f"{FIRST}: kernel >= 1300 TFLOP/s", FIRST, "kernel_TFLOPs", 1300.0, True),
    (f"{FIRST}: kernel >= 0.9x the same-run dense FP8 _scaled_mm", FIRST, "fraction_of_scaled_mm", 0.9, True),
    (f"{FIRST}: the op within 3% of the kernel (time ratio <= 1.03)", FIRST, "op_over_kernel_time", 1.03, False),
    (f"{M1}: kernel >= 1150 TFLOP/s", M1, "kernel_TFLOPs", 1150.0, True),
    (f"{M4}: kernel >= 900 TFLOP/s", M4, "kernel_TFLOPs", 900.0, True),
    (f"{FIRST}: FP8 x FP4 kernel >= 0.8x the FP8 x FP8 kernel", FIRST, "fp8_fp4_over_fp8", 0.8, True),
)  # fmt: skip


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
    finally:  # the targets are read off whatever was measured, also when the budget ran out
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
        _targets(ctx, res)
    first = res["perf"].get(FIRST) or next(iter(res["perf"].values()), None)
    if first is not None:
        met = [t["met"] for t in res["targets"].values()]
        res["summary"] = f"{first['epkit_fp8']['TFLOPs']:.1f} TFLOP/s at the first shape; targets: " + (
            f"{sum(met)}/{len(met)} met" if None not in met else "not measured in this run"
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
    """Contiguous (random rows per group incl. 0, padding rows exactly zero), psum and masked (masked_m incl. 0
    and M_max, rows beyond untouched), against float32 of the unquantized inputs; then the tile-grid kernel."""
    shapes = [(256, 512), (512, 256), (384, 1024)] if not ctx.dry else [(256, 512)]
    for kind in KINDS:
        for n, k in shapes:
            ctx.check(f"correctness {kind} contiguous {n}x{k}")
            _contiguous_check(ctx, res, gemm, backend, kind, n, k)
        ctx.check(f"correctness {kind} masked")
        _masked_check(ctx, res, gemm, backend, kind, *shapes[0])
    ctx.check("correctness fp8 psum")
    _contiguous_check(ctx, res, gemm, backend, "fp8", *shapes[0], psum=True)
    if ctx.cuda and ctx.remaining() > 0.7 * ctx.budget:  # the fallback kernel, when the budget allows
        _contiguous_check(ctx, res, gemm, backend, "fp8", *shapes[0], config=_TILE_GRID)
    elif ctx.cuda:
        res.setdefault("skipped", []).append("correctness of the tile-grid kernel: budget")


#: The tile-grid kernel's previous default config (the persistent kernel's same-run comparison).
_TILE_GRID = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)


def _contiguous_check(ctx, res, gemm, backend, kind, n, k, psum=False, config=None) -> None:
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
    layout = m_indices
    if psum:  # the same rows as cumulative ends: each group starts at the previous end rounded up to 128
        starts = torch.cumsum((counts + 127) // 128 * 128, 0) - (counts + 127) // 128 * 128
        layout = torch.where(counts > 0, starts + counts, starts).to(torch.int32)
        layout = torch.cummax(layout, 0).values.to(torch.int32)
    a, b = _to_device(kind, a, dev), _to_device(kind, b, dev)
    if config is None:
        contig(a, b, d, layout.to(dev), psum, backend=backend)
    else:  # the kernel layer with this config (the op takes the heuristic's)
        from epkit.kernels.triton.grouped_gemm import grouped_gemm_contiguous

        grouped_gemm_contiguous(kind, *a, *b, d, m_indices.to(dev), config=config)
    d = d.cpu()
    what = "psum" if psum else "tile-grid kernel" if config is not None else "contiguous"
    ctx_s = f"{kind} {what} G=4 counts={counts.tolist()} N={n} K={k}"
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


# Throughput


def _perf(ctx: Ctx, res: dict, gemm, backend: str) -> None:
    """TFLOP/s at DeepGEMM's published shapes, FP8 x FP8 (1x128 activation, 128x128 weight scales), bf16 out,
    into ``res["perf"]`` in priority order (CPU: small shapes, for the control flow)."""
    shapes = _shapes(ctx)
    iters = 15 if not ctx.quick else 5
    res["perf"] = perf = {}
    for i, (layout, grp, rows, n_, k_) in enumerate(shapes):
        name = f"{layout} {grp}x{rows} N={n_} K={k_}"
        if i >= 3 and ctx.remaining() < 20:  # past the targets' shapes: skipped, not failed, when time is short
            res.setdefault("skipped", []).append(f"perf {name}: {ctx.remaining():.0f} s of the budget left")
            continue
        ctx.check(f"perf {name}")
        case = _Case(ctx, gemm, layout, grp, rows, n_, k_)
        perf[name] = entry = _gemm_perf(ctx, res, case, backend, iters)
        ctx.log(f"{name}: {entry['epkit_fp8']['TFLOPs']:.1f} TFLOP/s ({_peer_note(entry)})")
        if i == 0:  # the FP4 target is at this shape: before anything optional
            first_case, first = case, entry
            _extra(ctx, res, first, first_case, backend, iters, "fp8_fp4")
        if i < 3:
            _variants(ctx, res, entry, case, iters)
        del case
    _extra(ctx, res, first, first_case, backend, iters, "tiles")  # a comparison, when the budget allows
    del first_case
    if ctx.cuda:
        torch.cuda.empty_cache()


def _persistent(bm, bn, warps, stages, group_m=8, **more) -> dict:
    return dict(kernel="persistent", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=group_m, num_warps=warps,
                num_stages=stages, **more)  # fmt: skip


#: Other configs timed at the targets' shapes when the budget allows (what a tuned table would pick among).
VARIANTS = {
    "contiguous": {
        "128x128 8 warps 4 stages": _persistent(128, 128, 8, 4),
        "128x128 8 warps 5 stages GROUP_M 16": _persistent(128, 128, 8, 5, 16),
        "64x256 8 warps 4 stages": _persistent(64, 256, 8, 4),
        "64x128 4 warps 3 stages 2 per SM": _persistent(64, 128, 4, 3, CTAS_PER_SM=2),
    },
    "masked": {
        "64x128 4 warps 3 stages 2 per SM": _persistent(64, 128, 4, 3, CTAS_PER_SM=2),
        "64x128 4 warps 6 stages": _persistent(64, 128, 4, 6),
        "64x256 8 warps 4 stages": _persistent(64, 256, 8, 4),
    },
}


def _variants(ctx: Ctx, res: dict, entry: dict, case: _Case, iters: int) -> None:
    """The shape's other configs (``VARIANTS``), each checked against the op's result, then timed; skipped when
    less than half the section's budget is left."""
    from epkit.testing import calc_diff

    if not ctx.cuda or not isinstance(entry.get("epkit_fp8_op"), dict):
        return
    if ctx.remaining() < 0.5 * ctx.budget:
        entry["variants"] = f"skipped: {ctx.remaining():.0f} of {ctx.budget:.0f} s left"
        return
    entry["variants"] = out = {}
    want = case.d.clone()
    for label, config in VARIANTS[case.layout].items():
        if ctx.remaining() < 0.3 * ctx.budget:
            out[label] = "skipped: budget"
            continue
        d = torch.empty_like(case.d)
        kernel = case.launcher("fp8", case.b, d, config)
        kernel()
        diff = calc_diff(d.float(), want.float())
        if not record_check(res, f"perf {case.layout} {case.grp}x{case.rows} variant {label}: agrees", diff <= 1e-6):
            out[label] = f"wrong result (calc_diff {diff:.2e} against the op's)"
            continue
        out[label] = dict(_timed(ctx, kernel, case.flops, iters), config=config)
    timed = {k: v["TFLOPs"] for k, v in out.items() if isinstance(v, dict)}
    timed["heuristic"] = entry["kernel_TFLOPs"]
    entry["best_variant"] = max(timed, key=timed.get)
    entry["best_variant_TFLOPs"] = timed[entry["best_variant"]]


def _shapes(ctx: Ctx) -> list:
    """(layout, groups, rows per group, N, K) of the timed shapes, the targets' first."""
    if ctx.cuda:
        rows_c, rows_m = (8192, (1024, 512, 256)) if not ctx.quick else (2048, (256, 128, 64))
        n, k, n2, k2 = 4096, 7168, 7168, 2048
    else:
        rows_c, rows_m, n, k, n2, k2 = 128, (128, 64, 32), 256, 512, 512, 256
    return [
        ("contiguous", 4, rows_c, n, k),
        ("masked", 1, rows_m[0], n, k),
        ("masked", 4, rows_m[2], n, k),
        ("contiguous", 4, rows_c, n2, k2),
        ("masked", 2, rows_m[1], n, k),
    ]


def _peer_note(entry: dict) -> str:
    sm = entry.get("torch_scaled_mm_fp8")
    note = f"{entry['fraction_of_bf16_roof']:.0%} of torch bf16"
    if isinstance(sm, dict):
        note += f", {entry['fraction_of_scaled_mm']:.0%} of dense FP8 _scaled_mm {sm['TFLOPs']:.0f}"
    return note


class _Case:
    """One timed shape: FP8 operands on the device (all groups full), the output, and the float32 reference."""

    def __init__(self, ctx: Ctx, gemm, layout: str, grp: int, rows: int, n: int, k: int):
        from epkit.quant import per_block_cast_to_fp8, per_token_group_cast_to_fp8

        dev = ctx.device
        self.layout, self.grp, self.rows, self.n, self.k = layout, grp, rows, n, k
        self.m = grp * rows
        self.flops = 2.0 * self.m * n * k
        torch.manual_seed(grp * rows + n)
        x = torch.randn((self.m, k) if layout == "contiguous" else (grp, rows, k), device=dev)
        self.w = torch.randn(grp, n, k, device=dev) / k**0.5
        self.a, self.b = per_token_group_cast_to_fp8(x), per_block_cast_to_fp8(self.w)
        self.d = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16, device=dev)
        if layout == "contiguous":
            self.groups = gemm.build_m_indices([rows] * grp, device=dev)
        else:
            self.groups = torch.full((grp,), rows, dtype=torch.int32, device=dev)
        ids = torch.arange(grp, device=dev).repeat_interleave(rows)
        self.ref = _group_ref(x.reshape(self.m, k), self.w, ids)
        self.op = getattr(gemm, f"m_grouped_fp8_gemm_nt_{layout}")

    def run_op(self, backend: str):
        if self.layout == "contiguous":
            return self.op(self.a, self.b, self.d, self.groups, backend=backend)
        return self.op(self.a, self.b, self.d, self.groups, self.rows, backend=backend)

    def launcher(self, kind: str, b, d, config=None):
        """The kernel's launch with everything derived from the inputs done once (CUDA, Triton backend)."""
        from epkit.kernels.triton import grouped_gemm as tg

        (a8, sfa), (bq, sfb) = self.a, b
        if self.layout == "contiguous":
            return tg.contiguous_launcher(kind, a8, sfa, bq, sfb, d, self.groups, config)
        return tg.masked_launcher(kind, a8, sfa, bq, sfb, d, self.groups, self.rows, config)


def _timed(ctx: Ctx, fn, flops: float, iters: int) -> dict:
    t = ctx.time_op(fn, iters=iters, flush=True, warmup=2)
    return {**t, "TFLOPs": flops / (t["median_ms"] * 1e-3) / 1e12}


def _gemm_perf(ctx: Ctx, res: dict, case: _Case, backend: str, iters: int) -> dict:
    """TFLOP/s of one FP8 grouped GEMM shape with its same-run peers and an accuracy check."""
    from epkit.testing import calc_diff

    name = f"{case.layout} {case.grp}x{case.rows} N={case.n} K={case.k}"
    case.run_op(backend)
    diff = calc_diff(case.d.reshape(case.m, case.n).float(), case.ref)
    record_check(res, f"perf shape {name}: calc_diff {diff:.2e} <= 1e-3", diff <= 1e-3, f"calc_diff={diff}")
    entry = {"groups": case.grp, "rows_per_group": case.rows, "n": case.n, "k": case.k, "flops": case.flops}
    entry["calc_diff"] = diff
    if ctx.cuda and backend == "triton":
        _no_sync_check(res, name, lambda: case.run_op(backend))
        kernel = case.launcher("fp8", case.b, case.d)
        want = case.d.clone()
        case.d.zero_()
        kernel()
        record_check(res, f"perf shape {name}: the kernel alone gives the op's result", torch.equal(case.d, want))
        entry["epkit_fp8"] = dict(_timed(ctx, kernel, case.flops, iters), timed="the persistent kernel's launch")
        entry["epkit_fp8_op"] = _timed(ctx, lambda: case.run_op(backend), case.flops, iters)
        entry["op_over_kernel_time"] = entry["epkit_fp8_op"]["median_ms"] / entry["epkit_fp8"]["median_ms"]
    else:
        entry["epkit_fp8"] = dict(_timed(ctx, lambda: case.run_op(backend), case.flops, iters), timed="the public op")
    entry["kernel_TFLOPs"] = entry["epkit_fp8"]["TFLOPs"]
    _peers(ctx, entry, case, iters)
    if name in DEEPGEMM_H800 and not ctx.quick:
        entry["deepgemm_h800_TFLOPs"] = DEEPGEMM_H800[name]
        entry["fraction_of_deepgemm_h800"] = entry["kernel_TFLOPs"] / DEEPGEMM_H800[name]
    return entry


def _no_sync_check(res: dict, name: str, fn) -> None:
    """The op once under ``torch.cuda.set_sync_debug_mode("error")``: a host synchronisation raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        ok, detail = True, ""
    except RuntimeError as exc:
        ok, detail = False, str(exc).splitlines()[0][:300]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    record_check(res, f"perf shape {name}: the op does not synchronise", ok, detail)


def _peers(ctx: Ctx, entry: dict, case: _Case, iters: int) -> None:
    """Same-run peers of one shape (see the module docstring); each either a timing or why it is absent."""
    m, k = case.m, case.k
    a16, b16 = case.a[0].reshape(m, k).to(torch.bfloat16), case.w[0].to(torch.bfloat16)
    entry["torch_matmul_bf16_roof"] = _timed(ctx, lambda: torch.matmul(a16, b16.T), case.flops, iters)
    entry["fraction_of_bf16_roof"] = entry["kernel_TFLOPs"] / entry["torch_matmul_bf16_roof"]["TFLOPs"]
    sm = _scaled_mm_peer(ctx, case.a[0].reshape(m, k), case.b[0][0], case.flops, iters)
    entry["torch_scaled_mm_fp8"] = sm
    if isinstance(sm, dict):
        entry["fraction_of_scaled_mm"] = entry["kernel_TFLOPs"] / sm["TFLOPs"]
    entry["torch_scaled_mm_blockwise_per_group"] = _blockwise_peer(ctx, case, iters)
    entry["torch_grouped_mm_bf16"] = _grouped_mm_peer(ctx, case, iters)


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
    return _timed(ctx, fn, flops, iters)


def _blockwise_calls(case: _Case):
    """Candidate per-group calls of the block-scaled recipe: ``torch._scaled_mm`` taking the recipe from the
    scales' shapes and strides (1x128: ``[rows, K/128]`` M-major; 128x128: ``[K/128, N/128]`` of the ``[N/128,
    K/128]`` blocks), then ``torch.nn.functional.scaled_mm`` naming the recipes, where this torch has it."""
    (a8, sfa), (b8, sfb) = case.a, case.b
    a8, sfa = a8.reshape(case.m, case.k), sfa.reshape(case.m, -1)
    parts = []
    for g in range(case.grp):
        rows = slice(g * case.rows, (g + 1) * case.rows)
        sa = sfa[rows].t().contiguous().t()  # M-major
        parts.append((a8[rows], b8[g].t(), sa, sfb[g].t(), case.d.reshape(case.m, case.n)[rows]))

    def v1():
        for a_g, b_g, sa, sb, out in parts:
            torch._scaled_mm(a_g, b_g, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, out=out)

    calls = [("torch._scaled_mm", v1)]
    fn = getattr(torch.nn.functional, "scaled_mm", None)
    st = getattr(torch.nn.functional, "ScalingType", None)
    one = st and (getattr(st, "BlockWise1x128", None) or getattr(st, "Blockwise_1x128", None))
    blk = st and (getattr(st, "BlockWise128x128", None) or getattr(st, "Blockwise_128x128", None))
    if fn is not None and one is not None and blk is not None:

        def v2():
            for a_g, b_g, sa, sb, out in parts:
                out.copy_(fn(a_g, b_g, sa, one, sb, blk, output_dtype=torch.bfloat16))

        calls.append(("torch.nn.functional.scaled_mm", v2))
    return calls


def _blockwise_peer(ctx: Ctx, case: _Case, iters: int):
    """The DeepSeek block-scaled recipe through torch, one call per group, checked against epkit's result
    (same quantized operands) before it is timed; or why it is absent."""
    from epkit.testing import calc_diff

    if not ctx.cuda:
        return "skipped on CPU: torch's block-scaled FP8 GEMM is a CUDA path"
    want = case.d.clone()
    why = []
    for label, fn in _blockwise_calls(case):
        try:
            case.d.zero_()
            fn()
            diff = calc_diff(case.d.float(), want.float())
        except Exception as exc:  # noqa: BLE001 - unsupported here (torch/cuBLASLt/sm_90): recorded
            why.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        if not diff <= 1e-4:
            why.append(f"{label}: ran but differs from epkit's result (calc_diff {diff:.2e}): not timed")
            continue
        out = dict(_timed(ctx, fn, case.flops, iters), call=label, calls=case.grp, calc_diff_vs_epkit=diff)
        case.d.copy_(want)
        return out
    case.d.copy_(want)
    return "unavailable: " + "; ".join(why)


def _grouped_mm_peer(ctx: Ctx, case: _Case, iters: int):
    """bf16 ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` before it) over the same groups, checked
    on group 0 against a bf16 ``torch.matmul``; or why it is absent."""
    from epkit.testing import calc_diff

    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return "unavailable: this torch has neither torch.nn.functional.grouped_mm nor torch._grouped_mm"
    if not ctx.cuda:
        return "skipped on CPU: a CUDA path"
    a16 = case.a[0].to(torch.bfloat16)  # [M, K] or [G, rows, K]
    b16 = case.w.to(torch.bfloat16).transpose(1, 2)  # [G, K, N], column-major as grouped GEMMs want
    offs = None
    if case.layout == "contiguous":
        offs = torch.arange(1, case.grp + 1, device=a16.device, dtype=torch.int32) * case.rows

    def call():
        return fn(a16, b16, offs=offs, out_dtype=torch.bfloat16) if offs is not None else fn(a16, b16)

    try:
        got = call().reshape(case.m, case.n)[: case.rows].float()
    except Exception as exc:  # noqa: BLE001 - unsupported here: recorded
        return f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    want = (a16.reshape(case.m, case.k)[: case.rows] @ b16[0]).float()
    diff = calc_diff(got, want)
    if not diff <= 1e-4:
        return f"unavailable: ran but group 0 differs from torch.matmul (calc_diff {diff:.2e})"
    return dict(_timed(ctx, call, case.flops, iters), call=getattr(fn, "__module__", "") + "." + fn.__name__)


#: The FP8 x MXFP4 variants timed at the first shape: the heuristic's config (None) and the PTX-table decode
#: on full-width tiles (``FP4_DECODE``, see kernels/triton/grouped_gemm_persistent.py).
_FP4_VARIANTS = {
    "epkit_fp8_fp4": None,
    "epkit_fp8_fp4_prmt": dict(
        kernel="persistent", BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4,
        FP4_DECODE="prmt",
    ),
}  # fmt: skip


def _extra(ctx: Ctx, res: dict, entry: dict, case: _Case, backend: str, iters: int, what: str) -> None:
    """At the first shape: the FP8 x MXFP4 kernel's variants (a target) or the tile-grid kernel (a comparison)."""
    from epkit.quant import cast_to_mxfp4
    from epkit.testing import calc_diff

    runs = _FP4_VARIANTS if what == "fp8_fp4" else {"epkit_fp8_tile_grid_kernel": _TILE_GRID}
    b4 = cast_to_mxfp4(case.w) if what == "fp8_fp4" and ctx.cuda else None
    for key, config in runs.items():
        if not ctx.cuda or backend != "triton":
            entry[key] = "skipped: CUDA with the Triton backend only"
            continue
        if ctx.remaining() < 15:
            entry[key] = f"skipped: {ctx.remaining():.0f} s of the section's budget left"
            continue
        d = torch.empty_like(case.d)
        if what == "fp8_fp4":
            kernel = case.launcher("fp8_fp4", b4, d, config)
            kernel()
            diff = calc_diff(d.reshape(case.m, case.n).float(), case.ref)
            ok = record_check(res, f"perf {FIRST} {key}: calc_diff {diff:.2e} <= 1e-2", diff <= 1e-2, f"{diff}")
        else:
            kernel = case.launcher("fp8", case.b, d, config)
            kernel()
            case.run_op(backend)
            diff = calc_diff(d.float(), case.d.float())
            ok = record_check(res, f"perf {FIRST} {key}: agrees with the persistent kernel", diff <= 1e-6, f"{diff}")
        if ok:
            entry[key] = dict(_timed(ctx, kernel, case.flops, iters), calc_diff=diff, config=config or "heuristic")
            ctx.log(f"{FIRST} {key}: {entry[key]['TFLOPs']:.1f} TFLOP/s")
    timed = {k: entry[k]["TFLOPs"] for k in _FP4_VARIANTS if isinstance(entry.get(k), dict)}
    if what == "fp8_fp4" and timed:
        best = max(timed, key=timed.get)
        entry["fp8_fp4_over_fp8"] = timed[best] / entry["kernel_TFLOPs"]
        entry["fp8_fp4_best_variant"] = best


def _targets(ctx: Ctx, res: dict) -> None:
    """Issue 19's targets read off this run: value, threshold, met (None where this run cannot say)."""
    res["targets"] = out = {}
    full = ctx.cuda and not ctx.quick
    for name, shape, field, target, higher in TARGETS:
        value = res.get("perf", {}).get(shape, {}).get(field)
        if not full or not isinstance(value, (int, float)):
            why = "not measured: needs a full (not --quick) CUDA run" if not full else "not measured in this run"
            out[name] = {"value": None, "target": target, "met": None, "why": why}
            continue
        out[name] = {"value": value, "target": target, "met": bool(value >= target if higher else value <= target)}
        best = res["perf"][shape].get("best_variant_TFLOPs")
        if field == "kernel_TFLOPs" and best is not None:  # what the best config timed here would give
            out[name].update(best_variant=res["perf"][shape]["best_variant"], best_variant_met=bool(best >= target))
