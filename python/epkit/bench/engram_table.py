"""``epkit bench`` family ``engram_table``: the ENP-sharded Engram lookup
(:class:`epkit.collectives.engram_table.ShardedEngramTable`) on CPU ranks of one host (4 in the quick and full
runs, 2 in the tiny one): each rank holds 1/world of an ``R x 256`` bf16 table and fetches ``R`` uniformly random
row ids (duplicates included, as hashed n-grams have) with ``fetch(ids)()`` and into a reused result
(``fetch(ids, out=)``), on both paths: ``shm`` (rows read straight out of the owners' shards in shared memory)
and ``torch`` (the all_to_all exchanges of ids and rows that ranks on several hosts use).

Peer: one bare ``all_to_all_single`` of the rows each rank receives on the exchange path (the most unique rows
any rank asks for, equal splits, as int32 words): the data movement alone, without the count and id
exchanges, the dedup and the gathers. Roof: a ``copy_`` of the rows delivered (read + write). Each figure is
the slowest rank's per round; the fetched rows are checked against the table's formula first, on both paths.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epkit.bench.core import BenchCtx, Case, Family, Ref, copy_roof
from epkit.bench.timing import measure

__all__ = ["FAMILY", "rank_main"]

DIM = 256
#: The lookup paths timed (``ShardedEngramTable(transport=)``), each with a fresh and a reused result.
PATHS = ("shm", "torch")


def _table_rows(start: int, n: int) -> torch.Tensor:
    """Rows ``[start, start + n)`` of the benchmark table: small integers, exact in bf16."""
    r = torch.arange(start, start + n, dtype=torch.int64)[:, None]
    return ((r * 31 + torch.arange(DIM)) % 251).to(torch.bfloat16)


def rank_main(rank: int, world: int, spec: dict) -> dict:
    """One rank (spawned by ``run_ranks``): per-round samples of the lookups, their peer and the roof."""
    from epkit.collectives.engram_table import ShardedEngramTable

    torch.set_num_threads(spec["threads"])  # BenchCtx.rank_threads
    rows = spec["rows"]
    ids = torch.randint(0, rows, (rows,), generator=torch.Generator().manual_seed(rank))
    want = _table_rows(0, rows)[ids]
    fns, checks = {}, []
    for path in PATHS:
        table = ShardedEngramTable(rows, DIM, group=None, dtype=torch.bfloat16, timeout=120, transport=path)
        lo, hi = table.row_start, min(table.row_start + table.num_per_part, rows)
        table.load_rows(lo, _table_rows(lo, hi - lo))
        ok = torch.equal(table.fetch(ids)(), want) and table.transport == path
        checks.append({"name": f"{path}: {rows} rows fetched equal the table", "ok": ok})
        out = torch.empty_like(want)
        fns[f"{path} fetch"] = lambda t=table: t.fetch(ids)()
        fns[f"{path} fetch out="] = lambda t=table, o=out: t.fetch(ids, out=o)()
    most = torch.tensor([int(torch.unique(ids).numel())])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # equal splits need one size on every rank
    per_peer = -(-int(most) // world)
    send = torch.zeros(per_peer * world, DIM, dtype=torch.bfloat16).view(torch.int32)  # bf16 rows as words
    recv = torch.empty_like(send)
    fns["all_to_all_single"] = lambda: dist.all_to_all_single(recv, send)
    payload = ids.numel() * DIM * 2
    _, fns["roof"] = copy_roof(2 * payload, torch.device("cpu"))
    samples = measure(fns, torch.device("cpu"), rounds=spec["rounds"], before_each=dist.barrier, seed=spec["seed"])
    return {"samples": samples, "payload": payload, "a2a_bytes": send.numel() * 4, "checks": checks}


def _run(ctx: BenchCtx, rows: int, world: int) -> None:
    from epkit.cpu_ranks import run_ranks

    spec = {"rows": rows, "rounds": ctx.rounds, "seed": ctx.seed, "threads": ctx.rank_threads(world)}
    results = run_ranks(rank_main, world, spec, timeout=600)
    for r, res in enumerate(results):
        for c in res["checks"]:
            ctx.check(f"rank {r}: {c['name']}", c["ok"])
    t = {n: [max(res["samples"][n][i] for res in results) for i in range(ctx.rounds)] for n in results[0]["samples"]}
    payload, a2a = results[0]["payload"], results[0]["a2a_bytes"]
    roof = Ref(f"copy_ of the rows delivered ({payload / 2**20:.3g} MiB, r+w)", t["roof"])
    peer = f"all_to_all_single of the rows received on the exchange path ({a2a / 2**20:.3g} MiB per rank)"
    shape = f"{world} ranks {rows}x{DIM} bf16, {rows} ids/rank"
    kw = {"work": 2 * payload, "unit": "GB/s", "roof": roof, "peers": [Ref(peer, t["all_to_all_single"])]}
    for path in PATHS:
        names = (f"{path} fetch", f"{path} fetch out=")
        ctx.rows_of(t, names, "ShardedEngramTable.fetch", shape, sweep={"rows": rows, "path": path}, **kw)


def _cases(ctx: BenchCtx) -> list[Case]:
    rows, world = ctx.pick((4096, 2), (8192, 4), (65536, 4))
    return [Case(f"Engram table lookup, {world} CPU ranks, {rows} rows", lambda c: _run(c, rows, world))]


FAMILY = Family(
    "engram_table",
    "ShardedEngramTable.fetch on CPU ranks (shm one-sided reads; torch all_to_all)",
    _cases,
    devices=("cpu",),
    ranks=4,
    why_not={"cuda": "measured on CPU ranks only (one GPU here)"},
)
