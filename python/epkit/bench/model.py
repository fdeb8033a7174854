"""``epkit bench`` family ``model``: one decode step of the reference model (``epkit.model``, the tiny preset, FP8
experts, low-latency dispatch/combine) on 2 CPU ranks (DP = EP = 2), against the same model in one process for
the same total batch (DP = EP = 1), with the share of the step spent in dispatch + combine.

Both runs go through :func:`epkit.model.run.run_rank` (what ``epkit run`` runs; rank 0's clock, a step from
the end of the previous one, its lockstep vote included; prefill not counted). They are separate jobs, one
after the other: round ``i`` pairs decode step ``i`` of each. Both decode as many tokens in as many steps
(checked); the prompts differ (``epkit run`` seeds them by rank) but not their lengths, so the work is equal.
"""

from __future__ import annotations

import statistics

from epkit.bench.core import BenchCtx, Case, Family, Ref

__all__ = ["FAMILY"]

WORLD = 2


def _job(world: int, requests: int, steps: int) -> dict:
    """``epkit run``'s rank results for ``world`` ranks with ``requests`` each: rank 0's decode steps."""
    from epkit.cpu_ranks import run_ranks
    from epkit.model.run import build_parser, run_rank

    a = build_parser().parse_args(["--ranks", str(world), "--requests", str(requests), "--steps", str(steps)])
    results = run_ranks(run_rank, world, a, timeout=600)
    decode = [s for s in results[0]["steps"] if not s["prefill"]]
    batch = [sum(s["tokens"] for s in r["steps"] if not s["prefill"]) for r in results]
    return {"decode": decode, "tokens": sum(batch), "transport": results[0]["info"]["transport"]}


def _run(ctx: BenchCtx, requests: int, steps: int) -> None:
    dist = _job(WORLD, requests, steps)
    one = _job(1, WORLD * requests, steps)
    same = dist["tokens"] == one["tokens"] and len(dist["decode"]) == len(one["decode"]) > 0
    ctx.check(
        "both runs decode the same tokens in the same number of steps", same, f"{dist['tokens']} vs {one['tokens']}"
    )
    ms = [s["seconds"] * 1e3 for s in dist["decode"]]
    peer = [s["seconds"] * 1e3 for s in one["decode"]]
    comm = [(s["ops"].get("dispatch", 0.0) + s["ops"].get("combine", 0.0)) / s["seconds"] for s in dist["decode"]]
    batch = WORLD * requests
    ctx.row(
        "decode step",
        f"tiny, {WORLD} ranks x {requests} seqs",
        dist["transport"],
        ms,
        work=batch,
        unit="tok/s",
        peers=[Ref(f"one-process model, {batch} seqs", peer)],
        note=f"dispatch+combine {statistics.median(comm):.0%} of the step",
        sweep={"batch": batch},
    )


def _cases(ctx: BenchCtx) -> list[Case]:
    requests, steps = ctx.pick((1, 3), (2, 6), (4, 16))
    label = f"reference model decode, {WORLD} CPU ranks x {requests} seqs vs one process"
    return [Case(label, lambda c: _run(c, requests, steps))]


FAMILY = Family(
    "model",
    "reference model decode step (DP attention + Wide-EP)",
    _cases,
    devices=("cpu",),
    ranks=WORLD,
    why_not={"cuda": "the reference model runs its distributed step on CPU ranks here (one GPU)"},
)
