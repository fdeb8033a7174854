"""``epkit bench`` family ``gather``: :func:`epkit.gather_rows` of bf16 and float32 rows (4 KiB each in the full
run) by a random permutation into a preallocated output, at a result that fits the caches and one that does not,
each backend against ``torch.index_select(out=)`` (the best single torch call), the Python reference (CPU) and the
roof: a ``copy_`` of the bytes a gather reads and writes (rows + index). ``--threads`` sets the threads of both."""

from __future__ import annotations

import torch

from epkit.bench.core import BenchCtx, Case, Family, Ref, copy_roof, timed_backends
from epkit.gather import gather_rows, gather_rows_reference

__all__ = ["FAMILY"]


#: The dtypes gathered; each at the same row bytes (its hidden size scaled by the element size).
DTYPES = (torch.bfloat16, torch.float32)
_NAME = {torch.bfloat16: "bf16", torch.float32: "float32"}


def _cases(ctx: BenchCtx) -> list[Case]:
    sizes = ctx.pick([(4096, 1024)], [(16384, 2048)], [(2048, 2048), (65536, 2048)])
    return [
        Case(
            f"gather_rows {rows}x{hidden * 2 // dt.itemsize} {_NAME[dt]}",
            lambda c, r=rows, h=hidden, d=dt: _run(c, r, h, d),
        )
        for rows, hidden in sizes
        for dt in DTYPES
    ]


def _run(ctx: BenchCtx, rows: int, bf16_hidden: int, dtype: torch.dtype) -> None:
    dev = ctx.device
    hidden = bf16_hidden * 2 // dtype.itemsize
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, hidden, generator=g, device=dev).to(dtype)
    index = torch.randperm(rows, generator=g, device=dev).to(torch.int32)
    want = torch.index_select(x, 0, index)
    moved = 2 * x.numel() * x.element_size() + index.numel() * index.element_size()
    fns = {}
    backends = timed_backends("gather_rows", dev)
    for b in backends:
        out = torch.empty_like(x)
        gather_rows(x, index, out, backend=b, check_index=False)
        if ctx.check(f"gather_rows[{b}] equals torch.index_select on the benchmark input", torch.equal(out, want)):
            fns[b] = lambda b=b, out=out: gather_rows(x, index, out, backend=b, check_index=False)
    sel_out = torch.empty_like(x)
    fns["torch.index_select"] = lambda: torch.index_select(x, 0, index, out=sel_out)
    roof_name, fns["roof"] = copy_roof(moved, dev)
    if not ctx.cuda:  # one row at a time from Python: on a GPU, a kernel launch per row
        fns["reference"] = lambda: gather_rows_reference(x, index)
    t = ctx.measure(fns)
    peers = [Ref("torch.index_select", t["torch.index_select"])]
    if "reference" in t:
        peers.append(Ref("reference (Python loop)", t["reference"]))
    roof = Ref(roof_name, t["roof"])
    shape = f"{rows}x{hidden} {_NAME[dtype]} perm"
    sweep = {"rows": rows, "dtype": _NAME[dtype]}
    ctx.rows_of(t, backends, "gather_rows", shape, work=moved, unit="GB/s", roof=roof, peers=peers, sweep=sweep)


FAMILY = Family("gather", "gather_rows: bf16 and float32 rows by a random permutation", _cases)
