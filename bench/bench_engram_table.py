"""Sharded Engram lookup benchmark: 65,536 rows x 256 dims (bf16) over 4 gloo ranks.

Each rank holds 1/4 of a ``--table-rows x --dim`` bf16 table
(:class:`epkit.collectives.engram_table.ShardedEngramTable`) and fetches ``--rows`` uniformly
random row ids (duplicates included, as hashed n-grams have) with ``fetch`` +
``hook()``. The peer, timed in the same processes on the same group, is one
``torch.distributed.all_to_all_single`` moving the same bytes per rank as the
lookup's row exchange (the most unique rows any rank receives, equal splits): the
cost of the data movement alone, without the count/id exchanges, dedup and
gathers. Reported per rank-averaged iteration (slowest rank):

* ``ms_fetch_hook``   time of one fetch + hook;
* ``payload_GBps``    requested rows x dim x 2 B / time (rows delivered to the caller);
* ``wire_GBps``       unique rows x dim x 2 B / time (rows that cross the exchange);
* ``*_with_out``      the same with a reused result buffer (``fetch(ids, out=...)``);
* ``peer_*``          the same for the plain all_to_all_single; ``ratio`` = peer time / lookup time.

Writes ``bench/results/engram_lookup.json``. Absolute CPU numbers are noise on a
shared machine; the ratio to the same-run peer is the figure to compare.

Run: ``python bench/bench_engram_table.py [--world 4] [--rows 65536] [--dim 256] [--iters 10]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def _worker(rank, world, table_rows, dim, rows, iters):
    import torch
    import torch.distributed as dist

    from epkit.collectives.engram_table import ShardedEngramTable

    torch.manual_seed(0)
    table = ShardedEngramTable(table_rows, dim, group=None, dtype=torch.bfloat16, timeout=120)
    lo, hi = table.row_start, min(table.row_start + table.num_per_part, table_rows)
    g = torch.Generator().manual_seed(1000)
    for s in range(lo // 8192 * 8192, hi, 8192):  # only the blocks this rank owns (a seeded table, block by block)
        n = min(8192, table_rows - s)
        table.load_rows(s, torch.randn(n, dim, generator=g.manual_seed(s)).to(torch.bfloat16))
    ids = torch.randint(0, table_rows, (rows,), generator=torch.Generator().manual_seed(rank))
    got = table.fetch(ids)()  # warm-up and spot check against locally regenerated rows
    for i in (0, rows // 2, rows - 1):
        r = int(ids[i])
        block = (r // 8192) * 8192
        want = torch.randn(min(8192, table_rows - block), dim, generator=g.manual_seed(block)).to(torch.bfloat16)
        if not torch.equal(got[i].view(torch.int16), want[r - block].view(torch.int16)):
            raise AssertionError(f"rank {rank}: row {r} differs from the generated table")
    unique = int(torch.unique(ids).numel())

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        table.fetch(ids)()
    dist.barrier()
    lookup_s = (time.perf_counter() - t0) / iters

    out = torch.empty_like(got)  # reused result buffer: no fresh allocation / first touch per lookup
    table.fetch(ids, out=out)()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        table.fetch(ids, out=out)()
    dist.barrier()
    lookup_out_s = (time.perf_counter() - t0) / iters

    # Peer: all_to_all_single of the same per-rank byte volume (the unique rows received), equal splits.
    most = torch.tensor([unique])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # equal splits need one size on every rank
    per_peer = -(-int(most) // world)
    send = torch.randn(per_peer * world, dim).to(torch.bfloat16).view(torch.int32)  # bf16 rows as words
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_to_all_single(recv, send)
    dist.barrier()
    peer_s = (time.perf_counter() - t0) / iters
    return {
        "lookup_s": lookup_s,
        "lookup_out_s": lookup_out_s,
        "peer_s": peer_s,
        "unique": unique,
        "peer_rows": per_peer * world,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--table-rows", type=int, default=65536)
    ap.add_argument("--rows", type=int, default=65536, help="row ids each rank fetches")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "engram_lookup.json"))
    args = ap.parse_args()

    from epkit.testing.multiprocess import run_ranks

    res = run_ranks(_worker, args.world, args.table_rows, args.dim, args.rows, args.iters, timeout=900)
    row_bytes = args.dim * 2
    lookup_s = max(r["lookup_s"] for r in res)
    lookup_out_s = max(r["lookup_out_s"] for r in res)
    peer_s = max(r["peer_s"] for r in res)
    unique = sum(r["unique"] for r in res) / len(res)
    peer_rows = sum(r["peer_rows"] for r in res) / len(res)
    out = {
        "case": f"{args.table_rows} x {args.dim} bf16 table over {args.world} ranks, {args.rows} row ids per rank",
        "world": args.world,
        "table_rows": args.table_rows,
        "dim": args.dim,
        "rows_per_rank": args.rows,
        "mean_unique_rows_per_rank": unique,
        "iters": args.iters,
        "ms_fetch_hook": lookup_s * 1e3,
        "payload_GBps": args.rows * row_bytes / lookup_s / 1e9,
        "wire_GBps": unique * row_bytes / lookup_s / 1e9,
        "ms_fetch_hook_with_out": lookup_out_s * 1e3,
        "payload_GBps_with_out": args.rows * row_bytes / lookup_out_s / 1e9,
        "peer": "torch.distributed.all_to_all_single (gloo), same bytes per rank as the unique-row exchange",
        "peer_ms": peer_s * 1e3,
        "peer_wire_GBps": peer_rows * row_bytes / peer_s / 1e9,
        "ratio_peer_time_over_lookup_time": peer_s / lookup_s,
        "ratio_with_out": peer_s / lookup_out_s,
        "per_rank": res,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(
        f"{out['case']}: fetch+hook {out['ms_fetch_hook']:.2f} ms, payload {out['payload_GBps']:.2f} GB/s, "
        f"wire {out['wire_GBps']:.2f} GB/s; peer all_to_all_single {out['peer_ms']:.2f} ms "
        f"({out['peer_wire_GBps']:.2f} GB/s); lookup reaches {out['ratio_peer_time_over_lookup_time']:.2f}x "
        f"of the peer's speed ({out['ms_fetch_hook_with_out']:.2f} ms, {out['ratio_with_out']:.2f}x with a reused "
        f"out=). Wrote {args.out}"
    )


if __name__ == "__main__":
    main()
