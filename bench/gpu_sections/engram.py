"""gpu_check section ``engram_hash``: ``epkit.engram.engram_hash`` bit for bit against its reference on every
backend (the selfcheck config and the demo config, id extremes included), then its throughput at ``epkit
bench``'s largest engram shape against a device copy of the same bytes; on CUDA also the Triton kernel alone."""

from __future__ import annotations

import torch

from gpu_sections.common import Ctx, backends_for, bits_equal, gbps, record_check, run_backends

__all__ = ["sec_engram_hash"]


def sec_engram_hash(ctx: Ctx, res: dict):
    from epkit.engram import EngramConfig, engram_hash, engram_hash_reference, hash_params, selfcheck_config

    dev = ctx.device
    g = torch.Generator().manual_seed(5)
    small_cfg = selfcheck_config()
    demo = EngramConfig(vocab_size=129280)  # demo defaults: N=3, K=8, layers (1, 15)
    n_big = (1 << 20) if not ctx.quick else ((1 << 18) if ctx.cuda else (1 << 14))

    def ids_for(cfg: EngramConfig, n: int) -> torch.Tensor:
        ids = torch.randint(0, cfg.vocab_size, (n, cfg.max_ngram_size), generator=g, dtype=torch.int32)
        ids[:2] = torch.tensor([0, cfg.vocab_size - 1], dtype=torch.int32)[:, None]  # extremes
        return ids

    cases = [("selfcheck config, 97 tokens", small_cfg, ids_for(small_cfg, 97))]
    cases.append(("demo config, 4096 tokens", demo, ids_for(demo, 4096)))
    cases.append((f"demo config, {n_big} tokens", demo, ids_for(demo, n_big)))

    def correctness(backend: str) -> None:
        for label, cfg, ids in cases:
            if backend == "triton" and not ctx.cuda and ids.shape[0] > 100:
                continue  # the interpreter is for small inputs
            ctx.check(f"correctness[{backend}] {label}")
            params = hash_params(cfg)
            want = engram_hash_reference(ids, *params)
            got = engram_hash(ids.to(dev), *(p.to(dev) for p in params), backend=backend)
            ok, detail = bits_equal(got, want)
            record_check(res, f"{backend}: {label}", ok, detail)

    run_backends(ctx, res, backends_for(ctx, ("triton", "tilelang"), ("tilelang", "cpu", "triton")), correctness)
    timed = backends_for(ctx, ("triton", "tilelang"), ("tilelang", "cpu"))
    perf = _throughput(ctx, res, demo, cases[-1][2], timed)
    res["summary"] = ", ".join(
        f"{b} {perf[b]['median_ms']:.3f} ms ({perf[b]['fraction_of_copy_roof']:.0%} roof)"
        for b in (*timed, "triton_kernel")
        if b in perf
    )
    return None


def _throughput(ctx: Ctx, res: dict, cfg, ids_cpu: torch.Tensor, timed: tuple[str, ...]) -> dict:
    """Throughput at 1,048,576 tokens (``epkit bench``'s largest engram shape, N=3, K=8, L=2) against the copy
    roof, for each backend in ``timed`` that passed; ``res["throughput"]``, also returned."""
    from epkit.engram import engram_hash, hash_params

    dev = ctx.device
    n_big = ids_cpu.shape[0]
    mult, vocab, off = (t.to(dev) for t in hash_params(cfg))
    ids = ids_cpu.to(dev)
    out = torch.empty((cfg.num_layers, n_big, cfg.num_heads), dtype=torch.int32, device=dev)
    moved = ids.numel() * 4 + out.numel() * 4
    buf = torch.ones(moved, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(buf)
    ctx.check("throughput")
    roof = ctx.time_op(lambda: dst.copy_(buf), iters=10)
    perf = res["throughput"] = {
        "tokens": n_big,
        "bytes_moved_per_call": moved,
        "roof_copy_same_bytes": {**roof, "GBps": gbps(2 * moved, roof["median_ms"])},
    }
    roof_gbps = perf["roof_copy_same_bytes"]["GBps"]  # read + write counted, as the hash's traffic is
    for backend in timed:
        if res["backends"].get(backend) != "ok":
            continue
        ctx.check(f"throughput[{backend}]")
        t = ctx.time_op(lambda b=backend: engram_hash(ids, mult, vocab, off, out, backend=b), iters=10)
        perf[backend] = {
            **t,
            "GBps": gbps(moved, t["median_ms"]),
            "Mtokens_per_s": n_big / (t["median_ms"] * 1e-3) / 1e6,
            "fraction_of_copy_roof": gbps(moved, t["median_ms"]) / roof_gbps,
            "timed": "the public op: validation reads the tables back to the host (3 syncs per call)",
        }
        if ctx.cuda and backend == "triton":
            perf["triton_kernel"] = _kernel_alone(ctx, res, ids, mult, vocab, off, out, moved, roof_gbps)
        ctx.log(f"{backend}: {t['median_ms']:.3f} ms ({perf[backend]['fraction_of_copy_roof']:.0%} of copy roof)")
    return perf


def _kernel_alone(ctx: Ctx, res: dict, ids, mult, vocab, off, out, moved: int, roof_gbps: float) -> dict:
    """The Triton kernel alone, its tables prepared once as the op prepares them: the device-side figure.

    ``out`` holds the op's result from the timing before; the kernel must reproduce it."""
    from epkit._details.engram_params import kernel_tables
    from epkit.kernels.triton.engram import engram_hash_tokens

    args = (ids.contiguous(), mult.contiguous(), *kernel_tables(vocab, off))
    want = out.clone()
    out.zero_()
    engram_hash_tokens(*args, out)
    record_check(res, "the Triton kernel alone gives the op's result", torch.equal(out, want))
    k = ctx.time_op(lambda a=args: engram_hash_tokens(*a, out), iters=10)
    return {
        **k,
        "GBps": gbps(moved, k["median_ms"]),
        "fraction_of_copy_roof": gbps(moved, k["median_ms"]) / roof_gbps,
    }
