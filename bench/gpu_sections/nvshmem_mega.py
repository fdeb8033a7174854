"""DeepGEMM's Mega MoE interface (``epkit.compat.deep_gemm``) on the nvshmem path, in the nvshmem section's epkit
child: a group of one over NCCL, so the layer's EPBuffer is NVSHMEM's and its rows are CUDA tensors.

Each MMA type (``bf16xbf16``, ``fp8xfp4``) runs the same call twice there and once on CPU rows (the child's gloo
group, the shm path: what DeepGEMM's own ``test_mega_moe.py`` accepted on CPU ranks): the two CUDA calls equal bit for
bit, CUDA against CPU within rounding noise (calc_diff < 1e-4; one wrong row of 96 would be ~1e-2), the BF16 layer
against a float64 reference, and the expert statistics exact on both devices.
"""

from __future__ import annotations

import torch

from gpu_sections.common import Ctx, record_check

__all__ = ["mega_moe_check"]

HIDDEN, INTER, EXPERTS, TOPK, TOKENS, CLAMP = 512, 256, 8, 4, 96, 1.5


def mega_moe_check(ctx: Ctx, res: dict, device_group, cpu_group) -> None:
    """Both Mega MoE layers on ``device_group`` (rows on ``ctx.device``) against ``cpu_group`` (CPU rows) and the
    references in the module docstring; figures in ``res["mega_moe"]``."""
    out: dict = {"hidden": HIDDEN, "intermediate_hidden": INTER, "experts": EXPERTS, "topk": TOPK, "tokens": TOKENS}
    res["mega_moe"] = out
    for mma in ("bf16xbf16", "fp8xfp4"):
        ctx.check(f"mega_moe {mma}")
        inputs = _inputs(mma == "fp8xfp4")
        ys, stats = [], []
        for group, dev, calls in ((device_group, ctx.device, 2), (cpu_group, torch.device("cpu"), 1)):
            got, transport, st = _layer(mma, group, dev, inputs, calls)
            ys.append(got)
            stats.append(st)
            out[f"{mma}_{dev.type}_transport"] = transport
        (y_dev, y_again), (y_cpu,) = ys
        if ctx.device.type == "cuda":  # the point of the check: the layer's rows went through NVSHMEM
            got = out[f"{mma}_cuda_transport"]
            record_check(res, f"mega_moe {mma}: the EPBuffer on the NCCL group is nvshmem", got == "nvshmem", got)
        record_check(
            res,
            f"mega_moe {mma} on {ctx.device.type}: the same call twice gives the same bits",
            torch.equal(y_dev, y_again),
        )
        diff = calc_diff(y_dev, y_cpu)
        out[f"{mma}_diff_vs_cpu"] = diff
        record_check(
            res,
            f"mega_moe {mma}: {ctx.device.type} rows against CPU rows, calc_diff < 1e-4",
            diff < 1e-4,
            f"{diff:.3g}",
        )
        counts = torch.bincount(inputs["ids"][inputs["ids"] >= 0], minlength=EXPERTS).int()
        record_check(
            res,
            f"mega_moe {mma}: expert statistics exact on both devices",
            all(torch.equal(s, counts) for s in stats),
            f"{[s.tolist() for s in stats]} vs {counts.tolist()}",
        )
        if mma == "bf16xbf16":
            diff = calc_diff(y_dev, _reference(inputs))
            out["bf16xbf16_diff_vs_float64"] = diff
            record_check(
                res, "mega_moe bf16xbf16 against a float64 reference, calc_diff < 1e-4", diff < 1e-4, f"{diff:.3g}"
            )
    ctx.log(f"mega_moe: {out}")


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity measure (0 for equal tensors), in float64 on the CPU."""
    x, y = x.double().cpu(), y.double().cpu()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _inputs(fp8: bool) -> dict:
    """Tokens, routing and weights on the CPU (weights already in the layer's layout), the same on every run."""
    import epkit.compat.deep_gemm as deep_gemm

    g = torch.Generator().manual_seed(11)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(TOKENS)])
    ids[torch.rand(ids.shape, generator=g) < 0.1] = -1
    weights = torch.rand(TOKENS, TOPK, generator=g)
    weights[ids < 0] = 0
    w1 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5).bfloat16()
    inp = {"x": x, "ids": ids, "weights": weights, "w1": w1, "w2": w2, "x_sf": None}
    if fp8:
        inp["x"], inp["x_sf"] = deep_gemm.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
        w1, w2 = (_fp4(deep_gemm, w) for w in (w1, w2))
    inp["l1"], inp["l2"] = deep_gemm.transform_weights_for_mega_moe(w1, w2)
    return inp


def _fp4(deep_gemm, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed FP4 ``[E, N, K/2]`` with float32 1x32 scales ``[E, N, K/32]``, as DeepGEMM's test casts its weights."""
    pairs = [deep_gemm.per_token_cast_to_fp4(w[e], use_ue8m0=True, gran_k=32) for e in range(w.shape[0])]
    return torch.stack([p for p, _ in pairs]), torch.stack([s for _, s in pairs])


def _on(t, dev: torch.device):
    return tuple(_on(v, dev) for v in t) if isinstance(t, tuple) else t.to(dev)


def _layer(mma: str, group, dev: torch.device, inp: dict, calls: int) -> tuple[list[torch.Tensor], str, torch.Tensor]:
    """``calls`` calls of the layer on ``group`` with rows on ``dev``: the outputs (CPU), the EP buffer's transport,
    the expert statistics after the first call."""
    import epkit.compat.deep_gemm as deep_gemm

    buf = deep_gemm.get_symm_buffer_for_mega_moe(group, EXPERTS, TOKENS, TOPK, HIDDEN, INTER, mma_type=mma)
    try:
        assert buf.ep_buffer is not None and buf.x is not None and buf.topk_idx is not None
        if buf.ep_buffer.device.type != dev.type:
            raise RuntimeError(f"the layer's EPBuffer put its rows on {buf.ep_buffer.device}, not {dev}")
        buf.x.copy_(inp["x"].to(dev))
        if buf.x_sf is not None:
            buf.x_sf.copy_(inp["x_sf"].to(dev))
        buf.topk_idx.copy_(inp["ids"].to(dev))
        buf.topk_weights.copy_(inp["weights"].to(dev))
        layer = deep_gemm.fp8_fp4_mega_moe if mma == "fp8xfp4" else deep_gemm.bf16_mega_moe
        l1, l2 = _on(inp["l1"], dev), _on(inp["l2"], dev)
        ys, stats = [], torch.zeros(EXPERTS, dtype=torch.int32, device=dev)
        for i in range(calls):
            y = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=dev)
            layer(
                y=y,
                l1_weights=l1,
                l2_weights=l2,
                sym_buffer=buf,
                activation_clamp=CLAMP,
                cumulative_local_expert_recv_stats=stats if i == 0 else None,
            )
            ys.append(y.cpu())
        return ys, buf.ep_buffer.transport, stats.cpu()
    finally:
        buf.destroy()


def _reference(inp: dict) -> torch.Tensor:
    """float64 BF16 layer: each token's experts (SwiGLU, clamped), weighted and summed."""
    x, w1, w2 = inp["x"].double(), inp["w1"].double(), inp["w2"].double()
    ref = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
    for t in range(TOKENS):
        for j, e in enumerate(inp["ids"][t].tolist()):
            if e >= 0:
                gate, up = (x[t] @ w1[e].T).chunk(2)
                gate, up = gate.clamp(max=CLAMP), up.clamp(-CLAMP, CLAMP)
                ref[t] += inp["weights"][t, j].double() * ((gate * torch.sigmoid(gate) * up) @ w2[e].T)
    return ref
