"""``epkit bench`` family ``ep_hosts``: EPBuffer dispatch + combine across emulated hosts (2 hosts x 2 CPU ranks,
hidden 2048 bf16, top-4 of 64 experts, identity experts), ``transport="auto"`` (the hierarchy: shared memory
inside a host, each token once per destination host between them) against the flat ``torch`` transport on the
same hosts, and the bytes that cross hosts against what per-host deduplication predicts.

The ranks run in :func:`epkit.emulated_hosts.run_hosts` (each host its own network, UTS and mount namespaces; the
hosts talk over veth pairs on a bridge): where those namespaces cannot be made (not root), the family is
skipped and says why. Peers of the ``auto`` row: the flat ``torch`` transport (the target's peer) and the
minimal exchange of :mod:`epkit.bench.ep_buffer` (rows only, one ``all_to_all_single`` each way). Every figure
is the slowest rank's per round (each sample starts after a barrier; the same seeded order on every rank).

Before timing, each transport's received rows are checked equal to the minimal exchange's, and its combined output
(identity experts: token t comes back once from each destination rank) equal to that sum in the order of a group on
several hosts (per host in float32, cast, then over the hosts: ``ep_reference``'s). Bytes across hosts, per call,
summed over the ranks: the buffer's own count (``EPBuffer.bytes_across_hosts``: headers and payloads of its messages
to other hosts) and what each host's ``eth0`` sent (the wire: TCP/IP framing, acknowledgements and the barriers
included). Predictions from ``topk_idx``: per-host dedup sends each (token, remote host holding one of its experts)
pair once, a row plus its routing (``8 * top-k`` bytes) out and a row back; the flat transport sends each (token,
remote rank) pair. Each prediction allows :data:`CONTROL_BYTES` per (rank, remote rank) per call for headers,
agreements and padding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epkit.bench.core import BenchCtx, Case, Family, Ref
from epkit.bench.ep_buffer import minimal_exchange, routing_mask
from epkit.bench.timing import measure
from epkit.emulated_hosts import namespaces_unavailable

__all__ = ["CONTROL_BYTES", "FAMILY", "crossing_pairs", "host_order_sum", "rank_main"]

HIDDEN, EXPERTS, TOPK = 2048, 64, 4
ROW_BYTES = HIDDEN * 2
#: Bytes allowed per (rank, remote rank) per dispatch + combine beyond the rows: message headers (24 bytes
#: each), the layout and handle agreements, 16-byte alignment padding.
CONTROL_BYTES = 4096
CONTENDERS = ("auto", "torch")


def crossing_pairs(topk_idx: torch.Tensor, num_experts: int, hosts: list[list[int]], rank: int) -> tuple[int, int]:
    """``(per_rank, per_host)`` for this rank's tokens: the (token, rank on another host) pairs a flat exchange
    sends across hosts, and the (token, other host) pairs a per-host dedup sends (a host counts when one of its
    ranks holds one of the token's experts; ``hosts``: each host's ranks)."""
    world = sum(len(h) for h in hosts)
    in_rank = routing_mask(topk_idx, num_experts, world)
    mine = next(h for h, g in enumerate(hosts) if rank in g)
    remote = [g for h, g in enumerate(hosts) if h != mine]
    per_rank = sum(int(in_rank[:, g].sum()) for g in remote)
    per_host = sum(int(in_rank[:, g].any(1).sum()) for g in remote)
    return per_rank, per_host


def host_order_sum(x: torch.Tensor, in_rank: torch.Tensor, hosts: list[list[int]] | None) -> torch.Tensor:
    """What combine returns with identity experts: ``x[t]`` once per destination rank, summed in float32 per
    host (cast to ``x.dtype``), then over the hosts in float32 and cast (``hosts`` None: one host, one sum)."""
    groups = [list(range(in_rank.shape[1]))] if not hosts or len(hosts) == 1 else hosts
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for g in groups:
        part = x.float() * in_rank[:, g].sum(1, keepdim=True).float()
        acc += part if len(groups) == 1 else part.to(x.dtype).float()
    return acc.to(x.dtype)


def _inputs(rank: int, tokens: int):
    """This rank's tokens: x [T, H] bf16, TOPK distinct experts each (uniform), weights [T, TOPK] float32."""
    g = torch.Generator().manual_seed(7919 * rank + tokens)
    scores = torch.rand(tokens, EXPERTS, generator=g)
    return torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16), scores.argsort(1)[:, :TOPK], scores[:, :TOPK]


def _round_trip(buf, x, idx, w):
    """Dispatch, then combine the received rows as they came (identity experts): ``(received, combined)``."""
    got = buf.dispatch(x, idx, w)
    return got[0], buf.combine(got[0], got[4])


def _wire_bytes() -> int:
    """Bytes this emulated host's ``eth0`` has sent (every rank of the host shares it). ``/proc/self/net`` is
    this process's network namespace (``/sys/class/net`` is the namespace that mounted ``/sys``)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "eth0":
                return int(counters.split()[8])
    raise RuntimeError("no eth0 in this network namespace: not an emulated host")


def _bytes_per_call(buf, call, lead: bool) -> tuple[int, int]:
    """One call's bytes across hosts: ``(the buffer's count on this rank, this host's eth0 if lead else 0)``."""
    counted = getattr(buf, "bytes_across_hosts", lambda: 0)
    dist.barrier()
    before = (counted(), _wire_bytes() if lead else 0)
    call()
    dist.barrier()
    return counted() - before[0], (_wire_bytes() - before[1]) if lead else 0


def rank_main(rank: int, world: int, spec: dict) -> dict:
    """One rank of the family (in :func:`~epkit.emulated_hosts.run_hosts`): check, count bytes, then time."""
    from epkit.collectives.ep_buffer import EPBuffer

    torch.set_num_threads(spec["threads"])  # BenchCtx.rank_threads
    per_host, tokens = spec["ranks_per_host"], spec["tokens"]
    hosts = [list(range(h, h + per_host)) for h in range(0, world, per_host)]
    bufs = {t: EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, tokens, TOPK, transport=t, timeout=120) for t in CONTENDERS}
    x, idx, w = _inputs(rank, tokens)
    out = {"checks": [], "bytes": {}, "wire": {}, "transport": bufs["auto"].transport}
    out["pairs"] = crossing_pairs(idx, EXPERTS, hosts, rank)
    in_rank = routing_mask(idx, EXPERTS, world)
    want_recv, _ = minimal_exchange(x, idx, EXPERTS)
    out["moved"] = 2 * (int(in_rank.sum()) + want_recv.shape[0]) * ROW_BYTES
    fns = {}
    try:
        for name, buf in bufs.items():
            recv, got = _round_trip(buf, x, idx, w)
            want = host_order_sum(x, in_rank, hosts)
            ok = torch.equal(recv, want_recv) and torch.equal(got, want)
            what = f"{name} ({buf.transport}): rows equal the minimal exchange's, sums the host-ordered sum"
            out["checks"].append({"name": what, "ok": ok})
            fns[name] = lambda buf=buf: _round_trip(buf, x, idx, w)
            out["bytes"][name], out["wire"][name] = _bytes_per_call(buf, fns[name], rank % per_host == 0)
        fns["minimal"] = lambda: minimal_exchange(x, idx, EXPERTS)
        rounds, seed = spec["rounds"], spec["seed"]
        out["samples"] = measure(fns, torch.device("cpu"), rounds=rounds, before_each=dist.barrier, seed=seed)
    finally:
        for buf in bufs.values():
            buf.close()
    return out


def _slowest(per_rank: list[dict]) -> dict[str, list[float]]:
    names = per_rank[0]["samples"]
    return {n: [max(vals) for vals in zip(*(r["samples"][n] for r in per_rank))] for n in names}


def _bytes_checks(ctx: BenchCtx, res: list[dict], world: int, per_host: int) -> dict[str, str]:
    """Check each contender's bytes across hosts against its prediction; returns a note per contender."""
    remote = world - per_host
    flat = sum(r["pairs"][0] for r in res) * (2 * ROW_BYTES + 8 * TOPK) + world * remote * CONTROL_BYTES
    dedup = sum(r["pairs"][1] for r in res) * (2 * ROW_BYTES + 8 * TOPK) + world * remote * CONTROL_BYTES
    notes = {}
    for name in CONTENDERS:
        counted, wire = sum(r["bytes"][name] for r in res), sum(r["wire"][name] for r in res)
        hierarchical = res[0]["transport"] != "torch" and name == "auto"
        model, bound = ("per-host dedup", dedup) if hierarchical else ("flat per-rank", flat)
        ctx.check(
            f"{name} ({res[0]['transport'] if name == 'auto' else 'torch'}): bytes across hosts <= {model}'s",
            0 < counted <= bound,
            f"{counted} B counted, {wire} B on the wire, {bound} B predicted",
        )
        notes[name] = (
            f"across hosts per call: {counted / 2**20:.3g} MiB counted, {wire / 2**20:.3g} MiB on the wire; "
            f"dedup predicts {dedup / 2**20:.3g} MiB, flat {flat / 2**20:.3g} MiB"
        )
    return notes


def _run(ctx: BenchCtx, hosts: int, per_host: int, tokens: int) -> None:
    from epkit.emulated_hosts import run_hosts

    world = hosts * per_host
    spec = {
        "ranks_per_host": per_host,
        "tokens": tokens,
        "rounds": ctx.rounds,
        "seed": ctx.seed,
        "threads": ctx.rank_threads(world),
    }
    res = run_hosts(rank_main, hosts, per_host, spec, timeout=900)
    for r, out in enumerate(res):
        for c in out["checks"]:
            ctx.check(f"rank {r}: {c['name']}", c["ok"])
    notes = _bytes_checks(ctx, res, world, per_host)
    t = _slowest(res)
    minimal = Ref("minimal all_to_all_single exchange (rows only)", t["minimal"])
    shape = f"{hosts} hosts x {per_host} ranks {tokens} tok/rank H{HIDDEN} top{TOPK}"
    kw = {"work": 2 * max(r["moved"] for r in res), "unit": "GB/s", "sweep": {"tokens_per_rank": tokens}}
    flat = Ref("flat torch transport, same hosts", t["torch"])
    ctx.row("dispatch+combine", shape, f"auto: {res[0]['transport']}", t["auto"], peers=[flat, minimal],
            note=notes["auto"], **kw)  # fmt: skip
    ctx.row("dispatch+combine", shape, "torch", t["torch"], peers=[minimal], note=notes["torch"], **kw)


def _cases(ctx: BenchCtx) -> list[Case]:
    hosts, per_host, tokens = ctx.pick((2, 1, 64), (2, 2, 512), (2, 2, 4096))
    label = f"dispatch+combine, {hosts} emulated hosts x {per_host} CPU ranks, {tokens} tokens per rank"
    return [Case(label, lambda c: _run(c, hosts, per_host, tokens))]


_WHY = namespaces_unavailable()
FAMILY = Family(
    "ep_hosts",
    "EPBuffer dispatch + combine across emulated hosts",
    _cases,
    devices=("cpu",) if _WHY is None else (),
    ranks=4,
    why_not={
        "cpu": f"emulated hosts unavailable: {_WHY}",
        "cuda": "runs on CPU ranks in emulated hosts (one machine, one GPU); multi-node GPU jobs are not emulated",
    },
)
