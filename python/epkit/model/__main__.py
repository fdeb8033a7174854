"""``python -m epkit.model``: DP attention + Wide-EP generation on CPU ranks, checked against the
one-process float64 model (the textbook experiment of the EP chapter, on epkit's ops)."""

from __future__ import annotations

import argparse

import torch

from epkit.model.args import ModelArgs
from epkit.model.demo import demo_rank
from epkit.model.reference import forward_reference
from epkit.testing.multiprocess import run_ranks

__all__ = ["main"]


def main(argv=None) -> int:
    """Run the experiment and print its table; 0 when every greedy token is within 0.15 of the
    reference's best logit."""
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
    res = run_ranks(demo_rank, a.world, a.transport, a.requests, a.seed, timeout=a.timeout)
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


if __name__ == "__main__":
    raise SystemExit(main())
