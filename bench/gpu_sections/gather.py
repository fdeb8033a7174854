"""gpu_check section ``gather_rows``: ``epkit.gather.gather_rows`` bit for bit against its reference on every
backend (seven dtypes, odd row bytes, 3-D rows, an empty index; with and without ``out=``), then its GB/s on
a random permutation of bf16 rows against ``torch.index_select`` and the device copy roof, same run."""

from __future__ import annotations

import math

import torch

from gpu_sections.common import Ctx, backends_for, bits_equal, garbage_like, gbps, record_check, run_backends

__all__ = ["sec_gather_rows"]


def sec_gather_rows(ctx: Ctx, res: dict):
    from epkit.gather import gather_rows, gather_rows_reference

    dev = ctx.device
    cases = _cases(ctx)

    def correctness(backend: str) -> None:
        ctx.check(f"correctness[{backend}]")
        for label, x, idx in cases:
            want = gather_rows_reference(x, idx)
            got = gather_rows(x.to(dev), idx.to(dev), backend=backend)
            ok, detail = bits_equal(got, want)
            record_check(res, f"{backend}: {label}", ok, detail)
            out = garbage_like(want).to(dev)
            gather_rows(x.to(dev), idx.to(dev), out, backend=backend)
            ok, detail = bits_equal(out, want)
            record_check(res, f"{backend}: {label} (out=)", ok, detail)

    backends = backends_for(ctx, ("triton", "tilelang"), ("cpu", "tilelang", "triton"))
    run_backends(ctx, res, backends, correctness, note=f" ({len(cases)} cases)")
    timed = backends_for(ctx, ("triton", "tilelang"), ("cpu", "tilelang"))
    perf = _bandwidth(ctx, res, timed)
    best = [
        f"{b} {perf[b]['GBps']:.0f} GB/s ({perf[b]['fraction_of_clone_roof']:.0%} roof)" for b in timed if b in perf
    ]
    res["summary"] = "; ".join(best) + f"; index_select {perf['torch.index_select']['GBps']:.0f} GB/s"
    return None


def _cases(ctx: Ctx) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(label, x, index)`` on the CPU: random bytes as rows of each dtype, indices incl. -1 (a zero row)."""
    g = torch.Generator().manual_seed(0)

    def rand_rows(n: int, row: tuple, dtype: torch.dtype) -> torch.Tensor:
        nbytes = n * math.prod(row) * torch.empty((), dtype=dtype).element_size()
        return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype).view(n, *row)

    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
    dtypes.append(torch.int64)
    cases = []
    for dt in dtypes[:4] if ctx.dry else dtypes:
        n = 257
        idx = torch.randint(-1, n, (300,), generator=g, dtype=torch.int32)
        cases.append((f"{dt} [257, 96] int32 index", rand_rows(n, (96,), dt), idx))
    for dt in (torch.bfloat16, torch.float8_e4m3fn):  # odd row bytes: 2- and 1-byte words
        idx = torch.randint(-1, 33, (50,), generator=g, dtype=torch.int64)
        cases.append((f"{dt} [33, 7] int64 index", rand_rows(33, (7,), dt), idx))
    cases.append(("bf16 [64, 4, 8] 3-D rows", rand_rows(64, (4, 8), torch.bfloat16), torch.arange(63, -2, -1)))
    cases.append(("empty index", rand_rows(5, (16,), torch.float32), torch.empty(0, dtype=torch.int32)))
    return cases


def _bandwidth(ctx: Ctx, res: dict, timed: tuple[str, ...]) -> dict:
    """A random permutation of bf16 rows: each backend in ``timed`` that passed its correctness checks against
    torch.index_select and the copy roof (``res["bandwidth"]``, also returned)."""
    from epkit.gather import gather_rows

    dev = ctx.device
    rows, hidden = (65536, 7168) if not ctx.quick else ((16384, 7168) if ctx.cuda else (8192, 512))
    ctx.check("bandwidth")
    ctx.log(f"bandwidth at {rows} x {hidden} bf16")
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=dev)
    idx = torch.randperm(rows, device=dev).to(torch.int32)
    out = torch.empty_like(x)
    ref = torch.index_select(x, 0, idx)
    xbytes = x.numel() * x.element_size()
    moved = 2 * xbytes + idx.numel() * 4
    perf = res["bandwidth"] = {"shape": [rows, hidden], "dtype": "bfloat16", "bytes_moved_per_call": moved}
    iters = 20 if ctx.cuda else 5
    calls = 5 if ctx.cuda else 1  # back to back: launch overhead overlaps the previous call, for every party
    perf["calls_per_sample"] = calls
    t_sel = ctx.time_op(lambda: torch.index_select(x, 0, idx, out=out), iters=iters, calls=calls)
    t_clone = ctx.time_op(lambda: x.clone(), iters=iters, calls=calls)
    t_copy = ctx.time_op(lambda: out.copy_(x), iters=iters, calls=calls)
    perf["torch.index_select"] = {**t_sel, "GBps": gbps(moved, t_sel["median_ms"])}
    perf["roof_clone"] = {**t_clone, "GBps": gbps(2 * xbytes, t_clone["median_ms"])}
    perf["roof_copy_"] = {**t_copy, "GBps": gbps(2 * xbytes, t_copy["median_ms"])}
    roof = perf["roof_clone"]["GBps"]
    for backend in timed:
        if not res["backends"].get(backend, "").startswith("ok"):
            continue
        ctx.check(f"bandwidth[{backend}]")
        out.zero_()
        gather_rows(x, idx, out, backend=backend, check_index=False)
        record_check(res, f"{backend}: {rows} x {hidden} permutation equals torch.index_select", torch.equal(out, ref))
        t = ctx.time_op(
            lambda b=backend: gather_rows(x, idx, out, backend=b, check_index=False), iters=iters, calls=calls
        )
        rate = gbps(moved, t["median_ms"])
        perf[backend] = {
            **t,
            "GBps": rate,
            "speedup_vs_index_select": t_sel["median_ms"] / t["median_ms"],
            "fraction_of_clone_roof": rate / roof,
            "fraction_of_copy__roof": rate / perf["roof_copy_"]["GBps"],
        }
        ctx.log(f"{backend}: {rate:.0f} GB/s ({rate / roof:.0%} of clone roof {roof:.0f} GB/s)")
    return perf
