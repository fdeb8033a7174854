"""``python -m epkit.model``: DP attention + Wide-EP generation on CPU ranks, checked against the
one-process float64 model (the textbook experiment of the EP chapter, on epkit's ops)."""

from __future__ import annotations

import torch

from epkit.model import DPEPModel, ModelArgs, forward_reference, generate


def _demo_prompts(rank: int, num_requests: int, seed: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    n = int(torch.randint(0, num_requests + 1, (1,), generator=g))  # uneven, possibly none
    prompts = [
        torch.randint(0, ModelArgs().vocab_size, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    budget = [int(torch.randint(1, 9, (1,), generator=g)) for _ in range(n)]
    return prompts, budget


def _demo_rank(rank: int, world_size: int, transport: str, num_requests: int, seed: int) -> dict:
    import time

    from epkit.topology import ParallelGroups

    groups = ParallelGroups.create(dp_size=world_size, device="cpu")
    model = DPEPModel(ModelArgs(), groups, transport=transport, min_num_extra_experts=world_size)
    prompts, budget = _demo_prompts(rank, num_requests, seed)
    t0 = time.perf_counter()
    tokens, stats = generate(model, prompts, budget)
    stats["seconds"] = time.perf_counter() - t0
    stats["prefill_moe"], stats["transport"] = model.prefill_moe, model.buffer.transport
    load = model.expert_load()
    model.close()
    return {"prompts": prompts, "tokens": tokens, "stats": stats, "load": load}


def main(argv=None) -> int:
    import argparse

    from epkit.testing.multiprocess import run_ranks

    ap = argparse.ArgumentParser(
        prog="python -m epkit.model",
        description="DP attention + Wide-EP generation on CPU ranks, checked against the one-process float64 model.",
    )
    ap.add_argument("--world", type=int, default=4, help="ranks (DP = EP = world; default 4)")
    ap.add_argument("--transport", default="auto", choices=["auto", "shm", "torch"])
    ap.add_argument("--requests", type=int, default=3, help="at most this many requests per rank (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    a = ap.parse_args(argv)
    res = run_ranks(_demo_rank, a.world, a.transport, a.requests, a.seed, timeout=a.timeout)
    args = ModelArgs()
    seqs = [(p, o) for r in res for p, o in zip(r["prompts"], r["tokens"])]
    ref = forward_reference(args, [p + o[:-1] for p, o in seqs])
    exact = total = 0
    worst = 0.0
    for (p, o), lg in zip(seqs, ref):
        lg = lg[len(p) - 1 :]
        chosen = lg.gather(1, torch.tensor(o)[:, None])[:, 0]
        worst = max(worst, float((lg.max(-1).values - chosen).max()))
        exact += int((lg.argmax(-1) == torch.tensor(o)).sum())
        total += len(o)
    s0 = res[0]["stats"]
    print(
        f"{a.world} ranks, transport {s0['transport']}, prefill MoE {s0['prefill_moe']}, decode MoE low_latency; "
        f"{args.n_routed_experts} experts (+ redundant), top-{args.n_activated_experts}"
    )
    print("rank  requests  tokens out  steps  prefill  placeholder  tokens forwarded  s")
    for r, out in enumerate(res):
        st = out["stats"]
        print(
            f"{r:4d}  {len(out['prompts']):8d}  {sum(len(o) for o in out['tokens']):10d}  {st['steps']:5d}  "
            f"{st['prefill_steps']:7d}  {st['placeholder_steps']:11d}  {st['tokens']:16d}  {st['seconds']:.2f}"
        )
    load = res[0]["load"].sum(0)
    print(f"tokens per logical expert (all MoE layers): {load.tolist()}")
    print(
        f"greedy tokens equal to the float64 reference's argmax: {exact}/{total}; largest gap between the "
        f"reference's best logit and the chosen token's: {worst:.4f}"
    )
    return 0 if worst < 0.15 else 1
