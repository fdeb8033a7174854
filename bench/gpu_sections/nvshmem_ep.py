"""EPBuffer(transport="nvshmem") over a group of one, in either NVSHMEM child of the nvshmem section.

Dispatch/combine (plain and expanded) and the low-latency pair on CUDA tensors, bit for bit against the CPU
reference exchange, with their time per call; the worst-case pair (``num_worst_tokens``) against the plain one,
its time beside the plain pair's; that the low-latency and the worst-case pairs make no synchronizing call and no
device-to-host copy; and ``fused_moe`` against dispatch -> ``expert_mlp`` -> combine.
"""

from __future__ import annotations

import contextlib

import torch

from gpu_sections.common import BudgetExceeded, Ctx, bits_equal, record_check

__all__ = ["ep_loopback"]


def ep_loopback(ctx: Ctx, res: dict) -> None:
    """EPBuffer(transport="nvshmem") on the group of one: dispatch/combine (plain and expanded) and the
    low-latency pair on CUDA tensors, bit for bit against the CPU reference exchange; time per call."""
    import torch.distributed as dist

    from epkit.collectives.ep_buffer import EPBuffer

    hidden, experts, topk, tokens, n_ll = 2048, 16, 4, 1024, 128
    out: dict = {"hidden": hidden, "experts": experts, "topk": topk, "tokens": tokens, "ll_tokens": n_ll}
    res["ep_buffer"] = out
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    idx[torch.rand(idx.shape, generator=g) < 0.1] = -1
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w = torch.rand(tokens, topk, generator=g)
    ctx.log("EPBuffer(nvshmem) world 1")
    buf = EPBuffer(
        dist.group.WORLD,
        hidden,
        experts,
        tokens,
        topk,
        transport="nvshmem",
        num_max_dispatch_tokens_per_rank=n_ll,
        timeout=10.0,
    )
    try:
        on_dev = _normal_mode(ctx, res, out, buf, x, idx, w)
        _worst_case(ctx, res, out, buf, *on_dev)
        _low_latency(ctx, res, out, buf, x[:n_ll], idx[:n_ll], w[:n_ll])
        try:
            ctx.check("fused_moe")
            _fused_moe_check(ctx, res, buf, *on_dev)
        except BudgetExceeded as exc:  # the loopback's own checks above stand; say what did not run
            res.setdefault("fused_moe", {})["status"] = f"not finished: {exc}"
        ctx.log(
            f"EPBuffer(nvshmem) world 1: dispatch+combine {out['dispatch_combine']['median_ms']:.2f} ms "
            f"({tokens} tokens), low-latency {out['low_latency']['median_ms']:.2f} ms ({n_ll} tokens)"
        )
    finally:
        with contextlib.suppress(Exception):  # a failure above is the one to report
            buf.buffer.close()


def _normal_mode(ctx: Ctx, res: dict, out: dict, buf, x, idx, w) -> tuple[torch.Tensor, ...]:
    """dispatch + combine, plain and expanded (expert alignment 128), bit for bit against the reference; then
    their time per call (``out["dispatch_combine"]``). Returns ``(x, idx, w)`` on the device."""
    from epkit.collectives.ep_reference import reference_combine, reference_dispatch

    dev, experts, tokens = ctx.device, out["experts"], out["tokens"]
    for expand, align in ((False, 1), (True, 128)):
        recv, _, _, _, handle = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev), expert_alignment=align, expand=expand)
        ref = reference_dispatch(x, idx, w, experts, expand=expand, expert_alignment=align)
        rows = ref["expanded_x"] if expand else ref["recv_x"]
        record_check(res, f"EPBuffer(nvshmem) dispatch expand={expand}: rows bit-exact", torch.equal(recv.cpu(), rows))
        y = (rows.float() * 0.5 + 1).to(torch.bfloat16)
        got = buf.combine(y.to(dev), handle)
        want = reference_combine(y, ref, tokens, expand=expand)
        record_check(res, f"EPBuffer(nvshmem) combine expand={expand}: bit-exact", torch.equal(got.cpu(), want))
    xd, idd, wd = x.to(dev), idx.to(dev), w.to(dev)

    def normal():
        r, _, _, _, h = buf.dispatch(xd, idd, wd)
        return buf.combine(r, h)

    out["dispatch_combine"] = ctx.time_wall(normal, calls=3, rounds=5)
    return xd, idd, wd


def _worst_case(ctx: Ctx, res: dict, out: dict, buf, xd, idd, wd) -> None:
    """dispatch(num_worst_tokens) + combine on the device kernels: the plain pair's rows (padded with zeros) and
    combine bits; its time per call beside the plain pair's (``out["dispatch_combine_worst"]``, ``worst_vs_plain``:
    the plain pair's time over it); no synchronizing call and no device-to-host copy."""
    plain = buf.dispatch(xd, idd, wd)
    want = buf.combine(plain.recv_x, plain.handle)

    def worst():
        got = buf.dispatch(xd, idd, wd, num_worst_tokens=out["tokens"])
        return got, buf.combine(got.recv_x, got.handle)

    got, combined = worst()
    n = plain.recv_x.shape[0]
    same = torch.equal(got.recv_x[:n].cpu(), plain.recv_x.cpu()) and not got.recv_x[n:].any().item()
    record_check(
        res, "EPBuffer(nvshmem) worst-case dispatch+combine: the plain pair's rows (zero-padded) and combine bits",
        same and torch.equal(combined.cpu(), want.cpu()),
    )  # fmt: skip
    out["dispatch_combine_worst"] = ctx.time_wall(lambda: worst()[1], calls=3, rounds=5)
    out["worst_vs_plain"] = out["dispatch_combine"]["median_ms"] / out["dispatch_combine_worst"]["median_ms"]
    _no_synchronizing_call(res, worst, "worst-case dispatch+combine")
    _no_device_to_host_copy(res, worst, buf, "worst-case dispatch+combine", "worst_device_to_host_copies")


def _low_latency(ctx: Ctx, res: dict, out: dict, buf, xl, il, wl) -> None:
    """The low-latency pair on ``xl`` (bf16, no FP8) bit for bit against the reference, its time per call
    (``out["low_latency"]``), and that it makes no synchronizing call and no device-to-host copy."""
    from epkit.collectives.ep_reference import reference_low_latency_combine, reference_low_latency_dispatch

    dev, n_ll = ctx.device, xl.shape[0]
    recv, cnt, h, _ = buf.low_latency_dispatch(xl.to(dev), il.to(dev), n_ll, use_fp8=False)
    ref = reference_low_latency_dispatch(xl, il, n_ll, out["experts"], use_fp8=False)
    ok = cnt.cpu().tolist() == ref["counts"] and all(
        torch.equal(recv[e, :c].cpu(), ref["recv_x"][e]) for e, c in enumerate(ref["counts"])
    )
    record_check(res, "EPBuffer(nvshmem) low-latency dispatch: counts and rows bit-exact", ok)
    y = torch.zeros_like(recv)
    y_ref = []
    for e, c in enumerate(ref["counts"]):
        y[e, :c] = (recv[e, :c].float() * 2 - 1).to(torch.bfloat16)
        y_ref.append(y[e, :c].cpu())
    got = buf.low_latency_combine(y, il.to(dev), wl.to(dev), h)
    want = reference_low_latency_combine(y_ref, il, wl, ref)
    record_check(res, "EPBuffer(nvshmem) low-latency combine: bit-exact", torch.equal(got.cpu(), want))
    xld, ild, wld = xl.to(dev), il.to(dev), wl.to(dev)

    def low_latency():
        r, _, hh, _ = buf.low_latency_dispatch(xld, ild, n_ll, use_fp8=False)
        return buf.low_latency_combine(r, ild, wld, hh)

    out["low_latency"] = ctx.time_wall(low_latency, calls=3, rounds=5)
    buf.synchronize()  # raises what the stream-ordered calls' deferred checks found
    _no_synchronizing_call(res, low_latency, "low-latency dispatch+combine")
    buf.synchronize()
    _no_device_to_host_copy(res, low_latency, buf, "low-latency dispatch+combine", "ll_device_to_host_copies")


def _fused_moe_check(ctx: Ctx, res: dict, buf, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
    """fused_moe on ``buf`` (FP8 experts) against dispatch(expand) -> expert_mlp -> combine: bit for bit, and
    the time of each (host-inclusive, back to back)."""
    from epkit.collectives.ep_buffer import EPBuffer
    from epkit.collectives.fused_moe import fused_moe
    from epkit.moe import expert_mlp
    from epkit.quant import per_block_cast_to_fp8

    hidden, inter, local = buf.hidden, 256, buf.num_local_experts
    g = torch.Generator().manual_seed(5)
    w13 = per_block_cast_to_fp8((torch.randn(local, 2 * inter, hidden, generator=g) / hidden**0.5).to(x.device))
    w2 = per_block_cast_to_fp8((torch.randn(local, hidden, inter, generator=g) / inter**0.5).to(x.device))
    shared = (x.float() * 0.25).to(torch.bfloat16)  # stands in for the shared expert's output

    def composed():
        recv, _, _, _, handle = buf.dispatch(x, idx, w, expand=True, expert_alignment=128)
        y = expert_mlp(recv, "contiguous", w13, w2, m_indices=EPBuffer.m_indices(handle))
        return buf.combine(y, handle, bias=shared)

    def fused():
        return fused_moe(x, idx, w, w13, w2, buf, bias=shared, expert_alignment=128)

    want, got = composed(), fused()
    ok, detail = bits_equal(got, want)
    record_check(res, f"fused_moe on {buf.transport} equals dispatch -> expert_mlp -> combine bit for bit", ok, detail)
    # Both paths share the expert MLP: equal outputs must also be the experts' work, not the bias alone.
    moved = (got != shared).any(dim=1).float().mean().item()
    finite = bool(torch.isfinite(got.float()).all())
    record_check(
        res,
        "fused_moe output is finite and differs from the bias on >= 90% of tokens",
        finite and moved >= 0.9,
        f"finite={finite}, tokens changed by the experts: {moved:.1%}",
    )
    out = res.setdefault("fused_moe", {"tokens": x.shape[0], "hidden": hidden, "inter": inter, "experts": local})
    ctx.check("fused_moe timing")  # in a child this also saves the checks above
    if ctx.remaining() < 15:
        out["status"] = f"timing skipped: {ctx.remaining():.0f} s of the budget left"
        return
    out["composed"] = ctx.time_wall(composed, calls=3, rounds=3)
    out["fused"] = ctx.time_wall(fused, calls=3, rounds=3)
    out["speedup_vs_composed"] = out["composed"]["median_ms"] / out["fused"]["median_ms"]
    ctx.log(f"fused_moe {out['fused']['median_ms']:.2f} ms, composed {out['composed']['median_ms']:.2f} ms")


def _no_synchronizing_call(res: dict, call, what: str) -> None:
    """``call`` (the pair named ``what``) under torch's sync debug mode "error": any synchronizing call raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
        sync_msg = ""
    except RuntimeError as exc:
        sync_msg = str(exc)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    record_check(res, f"EPBuffer(nvshmem) {what}: no synchronizing call", not sync_msg, sync_msg)


def _no_device_to_host_copy(res: dict, call, buf, what: str, key: str) -> None:
    """``call`` (the pair named ``what``) under the CUDA profiler: no device-to-host memcpy at all (its status words
    reach the host through a kernel's stores into pinned memory); the copies seen go to ``res[key]``."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()]
    except Exception as exc:  # noqa: BLE001 - no CUPTI: say so instead of failing the section
        res[key] = f"not measured: profiler unavailable ({type(exc).__name__}: {exc})"
        return
    buf.synchronize()
    d2h = [n for n in names if "DtoH" in n or "Device -> Pinned" in n or "Device -> Pageable" in n]
    res[key] = d2h
    record_check(
        res,
        f"EPBuffer(nvshmem) {what}: no device-to-host memcpy (CUDA profiler)",
        not d2h and len(names) > 0,  # (an empty trace would prove nothing)
        f"{len(d2h)} device-to-host copies: {d2h[:4]}; {len(names)} events",
    )
