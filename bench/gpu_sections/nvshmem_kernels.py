"""The device dispatch/combine kernels at issue 18's target shapes, in epkit's own NVSHMEM child (one PE).

``EPBuffer(transport="nvshmem", kernels="device")`` over a group of one (every expert local, every row moved
through the symmetric heap by the kernels):

- normal mode: 4096 tokens, hidden 7168 with FP8 dispatch (e4m3 rows + float32 per-128 scales), bf16 combine,
  top-8 of 256 experts. Checked bit for bit (one PE: the received rows are the tokens' rows, the combine returns
  ``y``), then timed: device time per call by CUDA events (a dispatch includes the gap while the host reads its
  summary), host time per call by the host clock on an idle GPU, each against a same-run device copy of exactly
  the bytes the call moves (its rows written at the destination and into the outputs).
- low latency: 128 tokens, hidden 7168, FP8 dispatch, top-8 of 256, the pair captured in a CUDA graph: replay
  equals eager bit for bit; device time per replayed pair.

Writes ``res["ep_kernels"]`` with the issue's targets next to the figures.
"""

from __future__ import annotations

import time

import torch

from gpu_sections.common import Ctx, record_check

__all__ = ["TARGETS", "kernel_targets", "normal_moved_bytes", "verdicts"]

TARGETS = {
    "normal_fraction_of_copy_roof": ">= 0.60 (dispatch + combine)",
    "normal_host_us_per_call": "<= 100",
    "low_latency_graph_pair_us": "<= 30",
    "fused_moe_speedup_vs_composed": ">= 1.2 (res['fused_moe'], nvshmem_ep.py)",
    "symm_exchange_fraction_of_copy_roof": ">= 0.80 (res['symm_buffer'], nvshmem_symm.py)",
}


def normal_moved_bytes(tokens: int, hidden: int, topk: int, fp8: bool = True) -> dict:
    """The fewest bytes a normal dispatch + combine on one PE moves, as a device copy's operand (each byte is read
    once and written once): the dispatch writes every row (e4m3 + float32 scales per 128, or bf16) into the
    receive rows and copies it to the outputs, with its ids (int64) and weights (float32) per slot; the combine
    writes every bf16 output row back into the source's rows and sums it into the result."""
    row = hidden + 4 * -(-hidden // 128) if fp8 else 2 * hidden
    dispatch = 2 * tokens * row + tokens * topk * (8 + 4)
    combine = 2 * tokens * 2 * hidden
    return {"dispatch": dispatch, "combine": combine, "total": dispatch + combine}


def verdicts(res: dict) -> dict:
    """Each issue-18 target against what this run measured (``None``: not measured in this run)."""
    ep = res.get("ep_kernels", {})
    normal, ll = ep.get("normal", {}), ep.get("low_latency", {})
    fused, symm = res.get("fused_moe", {}), res.get("symm_buffer", {})
    host = [normal.get(k) for k in ("dispatch_host_us_per_call", "combine_host_us_per_call")]

    def judge(value, ok):
        return None if value is None else {"value": value, "met": bool(ok(value))}

    return {
        "normal_fraction_of_copy_roof": judge(normal.get("fraction_of_copy_roof"), lambda v: v >= 0.60),
        "normal_host_us_per_call": judge(max(host) if None not in host else None, lambda v: v <= 100),
        "low_latency_graph_pair_us": judge(ll.get("graph_pair_us"), lambda v: v <= 30),
        "fused_moe_speedup_vs_composed": judge(fused.get("speedup_vs_composed"), lambda v: v >= 1.2),
        "symm_exchange_fraction_of_copy_roof": judge(symm.get("fraction_of_copy_roof"), lambda v: v >= 0.80),
    }


def kernel_targets(ctx: Ctx, res: dict) -> None:
    """Both target measurements (each skipped, saying so, when the section's budget is spent)."""
    out = res.setdefault("ep_kernels", {"targets": TARGETS})
    for name, fn in (("normal", _normal), ("low_latency", _low_latency)):
        if ctx.remaining() < 20:
            out[name] = {"status": f"not run: {ctx.remaining():.0f} s of the budget left"}
            continue
        try:
            fn(ctx, res, out)
        except Exception as exc:  # noqa: BLE001 - one failed measurement leaves the other standing
            out.setdefault(name, {})["error"] = f"{type(exc).__name__}: {exc}"
            record_check(res, f"EPBuffer kernels {name} target run", False, out[name]["error"])


def _routing(dev, tokens: int, experts: int, topk: int):
    g = torch.Generator(device=dev).manual_seed(18)
    idx = torch.argsort(torch.rand(tokens, experts, device=dev, generator=g), dim=1)[:, :topk].contiguous()
    x = torch.randn(tokens, 7168, device=dev, generator=g).bfloat16()
    w = torch.rand(tokens, topk, device=dev, generator=g)
    return x, idx, w


def _events(fn, iters: int) -> float:
    """Median device milliseconds of ``fn`` by CUDA events (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _host_us(fn, iters: int) -> float:
    """Median host microseconds of one call of ``fn`` started on an idle GPU."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def _copy_ms(nbytes: int, iters: int) -> float:
    """A device-to-device copy of ``nbytes`` (read + write), the roof of a call that moves them."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _events(lambda: dst.copy_(src), iters)


def _normal(ctx: Ctx, res: dict, out: dict) -> None:
    import torch.distributed as dist

    from epkit.collectives.ep_buffer import EPBuffer
    from epkit.quant import per_token_group_cast_to_fp8

    t, h, e, k = 4096, 7168, 256, 8
    ctx.log(f"EPBuffer kernels, normal mode: {t} tokens, hidden {h} FP8, top-{k} of {e}")
    buf = EPBuffer(dist.group.WORLD, h, e, t, k, transport="nvshmem", num_max_dispatch_tokens_per_rank=1,
                   kernels="device", timeout=20.0)  # fmt: skip
    try:
        x, idx, w = _routing(ctx.device, t, e, k)
        xq, xs = per_token_group_cast_to_fp8(x)
        recv, recv_idx, recv_w, counts, handle = buf.dispatch((xq, xs), idx, w)
        y = (recv[0].float() * recv[1].repeat_interleave(128, 1)).bfloat16()
        got = buf.combine(y, handle)
        ok = (
            torch.equal(recv[0].view(torch.uint8), xq.view(torch.uint8))
            and torch.equal(recv[1], xs)
            and torch.equal(recv_idx, idx)
            and torch.equal(recv_w, w)
            and torch.equal(got, y)
        )
        record_check(res, "EPBuffer kernels normal dispatch + combine at the target shape: bit-exact", ok)
        iters = 5 if ctx.quick else 20
        d_ms = _events(lambda: buf.dispatch((xq, xs), idx, w), iters)
        c_ms = _events(lambda: buf.combine(y, handle), iters)
        moved = normal_moved_bytes(t, h, k, fp8=True)
        roof = _copy_ms(moved["total"], iters)
        out["normal"] = {
            "tokens": t, "hidden": h, "experts": e, "topk": k, "ranks": 1,
            "dispatch_device_ms": d_ms, "combine_device_ms": c_ms,
            "moved_bytes": moved["total"], "copy_roof_ms": roof,
            "fraction_of_copy_roof": roof / (d_ms + c_ms),
            "dispatch_host_us_per_call": _host_us(lambda: buf.dispatch((xq, xs), idx, w), iters),
            "combine_host_us_per_call": _host_us(lambda: buf.combine(y, handle), iters),
            "note": "a dispatch includes the gap while the host reads its summary; host time is on an idle GPU",
        }  # fmt: skip
        ctx.log(f"normal: dispatch {d_ms:.3f} ms, combine {c_ms:.3f} ms, roof {roof:.3f} ms")
    finally:
        buf.buffer.close()


def _low_latency(ctx: Ctx, res: dict, out: dict) -> None:
    import torch.distributed as dist

    from epkit.collectives.ep_buffer import EPBuffer

    t, h, e, k = 128, 7168, 256, 8
    ctx.log(f"EPBuffer kernels, low-latency pair in a CUDA graph: {t} tokens, hidden {h}, top-{k} of {e}")
    buf = EPBuffer(dist.group.WORLD, h, e, t, k, transport="nvshmem", kernels="device", timeout=20.0)
    try:
        x, idx, w = _routing(ctx.device, t, e, k)
        y = torch.randn(e, t, h, device=ctx.device).bfloat16()

        def pair():
            recv, count, handle, _ = buf.low_latency_dispatch(x, idx, t, use_fp8=True)
            return recv, count, buf.low_latency_combine(y, idx, w, handle)

        first = pair()
        eager = [first[0][0].clone(), first[0][1].clone(), first[2].clone()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pair()  # warm-up on the capturing stream's side, as torch's graph recipe asks
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = pair()
        graph.replay()
        torch.cuda.synchronize()
        replayed = [captured[0][0], captured[0][1], captured[2]]
        ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(replayed, eager))
        record_check(res, "EPBuffer kernels low-latency pair: CUDA graph replay equals eager bit for bit", ok)
        ms = _events(graph.replay, 10 if ctx.quick else 50)
        buf.synchronize()
        out["low_latency"] = {
            "tokens": t, "hidden": h, "experts": e, "topk": k, "ranks": 1, "fp8": True,
            "graph_pair_us": ms * 1e3, "eager_pair_us": _events(pair, 10) * 1e3,
        }  # fmt: skip
        ctx.log(f"low latency: {ms * 1e3:.1f} us per replayed pair")
    finally:
        buf.buffer.close()
