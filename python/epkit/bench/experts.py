"""``epkit bench`` family ``experts``: :func:`epkit.logical_to_physical` of ``T x 6`` gate ids over 384 experts at
EP64 (one redundant slot per rank), rank 5: each backend against one ``torch.index_select`` through a table of
each expert's first replica (the best single torch call; a lower bound, as it skips the round-robin over
replicas), the Python reference (CPU) or the vectorised torch path on the same device (GPU; on the CPU that is
the ``cpu`` backend itself), and the roof, a ``copy_`` of the ids read and written."""

from __future__ import annotations

import torch

from epkit.bench.core import BenchCtx, Case, Family, Ref, copy_roof, timed_backends
from epkit.experts import ExpertPlacement, logical_to_physical, logical_to_physical_cpu, logical_to_physical_reference

__all__ = ["FAMILY"]

EXPERTS, EP, RANK, TOPK = 384, 64, 5, 6


def _cases(ctx: BenchCtx) -> list[Case]:
    sweep = ctx.pick((1024,), (4096,), (4096, 16384))
    return [Case(f"logical_to_physical {n}x{TOPK}", lambda c, n=n: _run(c, n)) for n in sweep]


def _run(ctx: BenchCtx, tokens: int) -> None:
    dev = ctx.device
    placement = ExpertPlacement.default(EXPERTS, EP, 1)
    g = torch.Generator().manual_seed(0)
    topk_cpu = torch.randint(0, EXPERTS, (tokens, TOPK), generator=g, dtype=torch.int32)
    want = logical_to_physical_reference(topk_cpu, placement, RANK)
    on_dev, topk = placement.to(dev), topk_cpu.to(dev)
    fns = {}
    backends = timed_backends("logical_to_physical", dev)
    for b in backends:
        got = logical_to_physical(topk, on_dev, RANK, backend=b, check_index=False)
        if ctx.check(f"logical_to_physical[{b}] {tokens}x{TOPK} equals the reference", torch.equal(got.cpu(), want)):
            fns[b] = lambda b=b: logical_to_physical(topk, on_dev, RANK, backend=b, check_index=False)
    first = on_dev.log2phy[:, 0].to(torch.int32).contiguous()
    flat = topk.view(-1)
    fns["select"] = lambda: torch.index_select(first, 0, flat).view(topk.shape)
    if ctx.cuda:
        fns["vectorised"] = lambda: logical_to_physical_cpu(topk, on_dev, RANK, 0)
    else:
        fns["reference"] = lambda: logical_to_physical_reference(topk_cpu, placement, RANK)
    moved = 2 * topk.numel() * 4
    roof_name, fns["roof"] = copy_roof(moved, dev)
    t = ctx.measure(fns)
    peers = [Ref("index_select of first replicas (lower bound)", t["select"])]
    if ctx.cuda:
        peers.append(Ref("vectorised torch (logical_to_physical_cpu)", t["vectorised"]))
    else:
        peers.append(Ref("reference (Python loop)", t["reference"]))
    shape, roof = f"{tokens}x{TOPK} ids {EXPERTS}e EP{EP}", Ref(roof_name, t["roof"])
    sweep = {"tokens": tokens}
    ctx.rows_of(t, backends, "logical_to_physical", shape, work=moved, unit="GB/s", roof=roof, peers=peers, sweep=sweep)


FAMILY = Family("experts", "logical_to_physical: gate ids to replica ids", _cases)
