"""``epkit bench`` family ``engram_table``: the ENP-sharded Engram lookup
(:class:`epkit.collectives.engram_table.ShardedEngramTable`) on 2 CPU ranks: each rank holds half of an
``R x 256`` bf16 table and fetches ``R`` uniformly random row ids (duplicates included, as hashed n-grams have)
with ``fetch(ids)()``, and again into a reused result (``fetch(ids, out=)``).

Peer: one ``all_to_all_single`` of the same bytes per rank as the lookup's row exchange (the most unique rows
any rank receives, equal splits): the data movement alone, without the count and id exchanges, the dedup
and the gathers. Roof: a ``copy_`` of the rows delivered (read + write). Each figure is the slowest rank's
per round; the fetched rows are checked against the table's formula first.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from epkit.bench.core import BenchCtx, Case, Family, Ref, copy_roof
from epkit.bench.timing import measure

__all__ = ["FAMILY", "rank_main"]

DIM, WORLD = 256, 2


def _table_rows(start: int, n: int) -> torch.Tensor:
    """Rows ``[start, start + n)`` of the benchmark table: small integers, exact in bf16."""
    r = torch.arange(start, start + n, dtype=torch.int64)[:, None]
    return ((r * 31 + torch.arange(DIM)) % 251).to(torch.bfloat16)


def rank_main(rank: int, world: int, spec: dict) -> dict:
    """One rank (spawned by ``run_ranks``): per-round samples of the lookup, its peer and the roof."""
    from epkit.collectives.engram_table import ShardedEngramTable

    torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    rows = spec["rows"]
    table = ShardedEngramTable(rows, DIM, group=None, dtype=torch.bfloat16, timeout=120)
    lo, hi = table.row_start, min(table.row_start + table.num_per_part, rows)
    table.load_rows(lo, _table_rows(lo, hi - lo))
    ids = torch.randint(0, rows, (rows,), generator=torch.Generator().manual_seed(rank))
    got = table.fetch(ids)()
    checks = [{"name": f"{rows} rows fetched equal the table", "ok": torch.equal(got, _table_rows(0, rows)[ids])}]
    out = torch.empty_like(got)
    most = torch.tensor([int(torch.unique(ids).numel())])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # equal splits need one size on every rank
    per_peer = -(-int(most) // world)
    send = torch.zeros(per_peer * world, DIM, dtype=torch.bfloat16).view(torch.int32)  # bf16 rows as words
    recv = torch.empty_like(send)
    payload = ids.numel() * DIM * 2
    fns = {
        "fetch": lambda: table.fetch(ids)(),
        "fetch out=": lambda: table.fetch(ids, out=out)(),
        "all_to_all_single": lambda: dist.all_to_all_single(recv, send),
    }
    _, fns["roof"] = copy_roof(2 * payload, torch.device("cpu"))
    samples = measure(fns, torch.device("cpu"), rounds=spec["rounds"], before_each=dist.barrier, seed=spec["seed"])
    return {"samples": samples, "payload": payload, "checks": checks}


def _run(ctx: BenchCtx, rows: int) -> None:
    from epkit.testing.multiprocess import run_ranks

    results = run_ranks(rank_main, WORLD, {"rows": rows, "rounds": ctx.rounds, "seed": ctx.seed}, timeout=600)
    for r, res in enumerate(results):
        for c in res["checks"]:
            ctx.check(f"rank {r}: {c['name']}", c["ok"])
    t = {n: [max(res["samples"][n][i] for res in results) for i in range(ctx.rounds)] for n in results[0]["samples"]}
    payload = results[0]["payload"]
    roof = Ref(f"copy_ of the rows delivered ({payload / 2**20:.3g} MiB, r+w)", t["roof"])
    peers = [Ref("all_to_all_single of the unique rows' bytes", t["all_to_all_single"])]
    shape = f"{WORLD} ranks {rows}x{DIM} bf16, {rows} ids/rank"
    kw = {"work": 2 * payload, "unit": "GB/s", "roof": roof, "peers": peers, "sweep": {"rows": rows}}
    ctx.rows_of(t, ("fetch", "fetch out="), "ShardedEngramTable.fetch", shape, **kw)


def _cases(ctx: BenchCtx) -> list[Case]:
    rows = ctx.pick(4096, 16384, 65536)
    return [Case(f"Engram table lookup, {WORLD} CPU ranks, {rows} rows", lambda c: _run(c, rows))]


FAMILY = Family(
    "engram_table",
    "ShardedEngramTable.fetch on CPU ranks",
    _cases,
    devices=("cpu",),
    ranks=WORLD,
    why_not={"cuda": "measured on CPU ranks only (one GPU here)"},
)
