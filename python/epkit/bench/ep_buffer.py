"""``epkit bench`` family ``ep_buffer``: EPBuffer dispatch + combine on CPU ranks (hidden 2048 bf16, 64 experts,
top-4, identity experts): on 2 ranks for each transport at growing tokens per rank, and the low-latency pair at
128; on 4 ranks (quick and full runs; on 2 cores, 4 processes share them) the shm transport alone. Each row
names its rank count.

Peer: :func:`minimal_exchange`, the strongest simple torch.distributed implementation of the same data
movement: the counts, then each token's row once per destination rank in one ``all_to_all_single``, the rows
back and an ``index_add_`` at the source (rows only: EPBuffer also moves each row's expert ids and weights).
Full runs also time ``epkit.collectives.ep_reference`` at the largest size, EPBuffer's bit-exact
specification, which moves routing metadata too and is much slower: a weak peer, so it is never the first.
Roof: a ``copy_`` of the bytes each rank moves (rows sent + received, dispatch and combine; read + write
counted: a protocol that copies each moved byte once at memcpy speed is at 100%).

Every figure is the slowest rank's per round (each sample starts after a barrier; the same seeded order of
contenders on every rank). Before timing, EPBuffer's received rows and combined output are checked equal to
the minimal exchange's. Uses EPBuffer's public API only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epkit.bench.core import BenchCtx, Case, Family, Ref, copy_roof
from epkit.bench.timing import measure

__all__ = ["FAMILY", "minimal_exchange", "rank_main", "routing_mask"]

HIDDEN, EXPERTS, TOPK, LL_TOKENS = 2048, 64, 4, 128
TRANSPORTS = ("shm", "torch")
#: Ranks -> (transports, tokens per rank) per run size; the low-latency pair runs on 2 ranks.
WORLDS = {
    "tiny": {2: (TRANSPORTS, (128,))},
    "quick": {2: (TRANSPORTS, (256, 2048)), 4: (("shm",), (256,))},
    "full": {2: (TRANSPORTS, (256, 1024, 4096)), 4: (("shm",), (4096,))},
}
ROW_BYTES = HIDDEN * 2


def routing_mask(topk_idx: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """[T, world] bool: which ranks hold one of each token's experts (``-1`` ids go nowhere)."""
    t = topk_idx.shape[0]
    dest = torch.div(topk_idx.long(), num_experts // world, rounding_mode="floor")
    valid = topk_idx >= 0
    in_rank = torch.zeros(t, world, dtype=torch.bool)
    in_rank[torch.arange(t)[:, None].expand_as(dest)[valid], dest[valid]] = True
    return in_rank


def minimal_exchange(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, group=None):
    """The textbook dispatch + combine with identity experts over ``torch.distributed``.

    ``x`` [T, H], ``topk_idx`` [T, k] in ``[-1, num_experts)`` (experts split evenly over the ranks). Returns
    ``(received, combined)``: the rows received [R, H], by source rank then source token order, and [T, H]
    each token's row summed once per destination rank (``index_add_`` in ``x``'s dtype).
    """
    in_rank = routing_mask(topk_idx, num_experts, dist.get_world_size(group))
    src = in_rank.t().nonzero()[:, 1]  # tokens grouped by destination rank, in token order
    send_counts = in_rank.sum(0)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
    send = x.index_select(0, src)
    received = x.new_empty(sum(recv_split), x.shape[1])
    dist.all_to_all_single(received, send, recv_split, send_split, group=group)
    back = torch.empty_like(send)
    dist.all_to_all_single(back, received, send_split, recv_split, group=group)
    return received, torch.zeros_like(x).index_add_(0, src, back)


def _inputs(rank: int, tokens: int):
    g = torch.Generator().manual_seed(1000 * rank + tokens)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens)])
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    return x, idx, torch.rand(tokens, TOPK, generator=g)


def _normal(buf, x, idx, w):
    recv_x, _, _, _, handle = buf.dispatch(x, idx, w)
    return recv_x, buf.combine(recv_x, handle)


def _low_latency(buf, x, idx, w):
    recv, count, handle, _ = buf.low_latency_dispatch(x, idx, LL_TOKENS, use_fp8=False)
    return count, buf.low_latency_combine(recv, idx, w, handle)


def _one_size(bufs: dict, rank: int, world: int, tokens: int, spec: dict, checks: list) -> dict:
    """Samples of every contender at ``tokens`` per rank, and the bytes this rank moves."""
    x, idx, w = _inputs(rank, tokens)
    want_recv, want_out = minimal_exchange(x, idx, EXPERTS)
    fns = {}
    for name, buf in bufs.items():
        recv, out = _normal(buf, x, idx, w)
        ok = torch.equal(recv, want_recv) and torch.equal(out, want_out)
        checks.append({"name": f"{name}: {tokens} tokens, rows and sums equal the minimal exchange's", "ok": ok})
        fns[name] = lambda buf=buf: _normal(buf, x, idx, w)
    fns["minimal"] = lambda: minimal_exchange(x, idx, EXPERTS)
    if spec["ep_reference"] and tokens == max(spec["sweep"]):
        from epkit.collectives.ep_reference import reference_combine, reference_dispatch

        def ep_reference():
            state = reference_dispatch(x, idx, w, EXPERTS)
            return reference_combine(state["recv_x"], state, tokens)

        fns["ep_reference"] = ep_reference
    moved = 2 * (int(routing_mask(idx, EXPERTS, world).sum()) + want_recv.shape[0]) * ROW_BYTES
    _, fns["roof"] = copy_roof(2 * moved, torch.device("cpu"))
    samples = measure(fns, torch.device("cpu"), rounds=spec["rounds"], before_each=dist.barrier, seed=spec["seed"])
    return {"samples": samples, "moved": moved}


def _low_latency_size(bufs: dict, rank: int, spec: dict, checks: list) -> dict:
    x, idx, w = _inputs(rank, LL_TOKENS)
    fns = {}
    want = w.sum(1, keepdim=True) * x.float()  # identity experts: sum over k of w[t, k] * x[t]
    for name, buf in bufs.items():
        count, out = _low_latency(buf, x, idx, w)
        ok = torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2)
        checks.append({"name": f"{name}: low-latency combine equals sum_k w[t, k] * x[t] (bf16)", "ok": ok})
        fns[name] = lambda buf=buf: _low_latency(buf, x, idx, w)
    fns["minimal"] = lambda: minimal_exchange(x, idx, EXPERTS)
    moved = 2 * (idx.numel() + int(count.sum())) * ROW_BYTES  # one row per (token, expert) each way
    _, fns["roof"] = copy_roof(2 * moved, torch.device("cpu"))
    samples = measure(fns, torch.device("cpu"), rounds=spec["rounds"], before_each=dist.barrier, seed=spec["seed"])
    return {"samples": samples, "moved": moved}


def rank_main(rank: int, world: int, spec: dict) -> dict:
    """One rank of the family (spawned by ``run_ranks``): every size, then (on 2 ranks) the low-latency pair."""
    from epkit.collectives.ep_buffer import EPBuffer

    torch.set_num_threads(spec["threads"])  # BenchCtx.rank_threads
    cap = max(spec["sweep"])
    bufs = {
        t: EPBuffer(
            dist.group.WORLD,
            HIDDEN,
            EXPERTS,
            cap,
            TOPK,
            transport=t,
            num_max_dispatch_tokens_per_rank=LL_TOKENS,
            timeout=120,
        )
        for t in spec["transports"]
    }
    checks: list[dict] = []
    low_latency = None
    try:
        sizes = {n: _one_size(bufs, rank, world, n, spec, checks) for n in spec["sweep"]}
        if world == 2:
            low_latency = _low_latency_size(bufs, rank, spec, checks)
    finally:
        for buf in bufs.values():
            buf.close()
    return {"sizes": sizes, "low_latency": low_latency, "checks": checks}


def _slowest(per_rank: list[dict]) -> dict[str, list[float]]:
    """Per contender, each round's slowest rank."""
    names = per_rank[0]["samples"]
    return {
        n: [max(r["samples"][n][i] for r in per_rank) for i in range(len(per_rank[0]["samples"][n]))] for n in names
    }


def _rows(ctx: BenchCtx, op: str, shape: str, per_rank: list[dict], sweep: dict, transports) -> None:
    t = _slowest(per_rank)
    moved = max(r["moved"] for r in per_rank)
    roof = Ref(f"copy_ of the bytes moved ({moved / 2**20:.3g} MiB, r+w)", t["roof"])
    peers = [Ref("minimal all_to_all_single exchange (rows only)", t["minimal"])]
    if "ep_reference" in t:
        peers.append(Ref("collectives.ep_reference (with metadata)", t["ep_reference"]))
    kw = {"work": 2 * moved, "unit": "GB/s", "roof": roof, "peers": peers, "sweep": sweep}
    ctx.rows_of(t, transports, op, shape, **kw)


def _run(ctx: BenchCtx, world: int, transports: tuple[str, ...], sweep: tuple[int, ...]) -> None:
    from epkit.cpu_ranks import run_ranks

    spec = {
        "sweep": sweep,
        "transports": transports,
        "rounds": ctx.rounds,
        "seed": ctx.seed,
        "ep_reference": ctx.size == "full" and world == 2,
        "threads": ctx.rank_threads(world),
    }
    results = run_ranks(rank_main, world, spec, timeout=900)
    for r, res in enumerate(results):
        for c in res["checks"]:
            ctx.check(f"{world} ranks, rank {r}: {c['name']}", c["ok"])
    for n in sweep:
        shape = f"{world} ranks {n} tok/rank H{HIDDEN} top{TOPK}"
        sizes = [res["sizes"][n] for res in results]
        # the plot draws the 2-rank sweep against tokens per rank; other rank counts are single points
        sweep_key = {"tokens_per_rank": n} if world == 2 else {"ranks": world}
        _rows(ctx, "dispatch+combine", shape, sizes, sweep_key, transports)
    if results[0]["low_latency"] is not None:
        shape = f"{world} ranks {LL_TOKENS} tok/rank H{HIDDEN} top{TOPK}"
        _rows(ctx, "low_latency dispatch+combine", shape, [res["low_latency"] for res in results], {}, transports)


def _cases(ctx: BenchCtx) -> list[Case]:
    cases = []
    for world, (transports, sweep) in ctx.pick(*(WORLDS[s] for s in ("tiny", "quick", "full"))).items():
        label = f"dispatch+combine, {world} CPU ranks, {', '.join(map(str, sweep))} tokens per rank"
        cases.append(Case(label, lambda c, w=world, t=transports, s=sweep: _run(c, w, t, s)))
    return cases


FAMILY = Family(
    "ep_buffer",
    "EPBuffer dispatch + combine on CPU ranks",
    _cases,
    devices=("cpu",),
    ranks=max(WORLDS["full"]),
    why_not={"cuda": "needs several GPUs; one-GPU nvshmem dispatch/combine is gpu_check's nvshmem section"},
)
