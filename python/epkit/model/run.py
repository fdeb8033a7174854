"""``epkit run``: the reference model as a command, with the verdict, step latencies, a per-op breakdown
and the measured collective ledger of a decode step.

``epkit run --ranks N`` launches N CPU ranks itself (``epkit.testing.run_ranks``); under
``torchrun --nproc-per-node N -m epkit.run`` every process is one rank and rank 0 prints the report.
DP = EP = the number of ranks (DP attention + Wide-EP; the ENP group is every rank too).

What it prints:

- the verdict: every greedy token against the one-process float64 model (:func:`forward_reference`);
- prefill and decode: steps, seconds per step and tokens per second (rank 0's clock);
- where a decode step's time goes, per op (:class:`~epkit.model.profile.StepTimer`), and the share of
  dispatch + combine;
- the collective ledger of one decode step as it ran (:class:`~epkit.model.profile.CollectiveLedger`:
  torch.distributed calls and SymmBuffer exchanges, wrapped, counted and sized), beside the claim of the
  DeepInfer write-up (``000_*.txt``): no per-layer all-reduce, one dispatch and one combine per MoE
  layer, one DP liveness all-reduce per step, the Engram fetch; a difference is flagged.

``--dry-run --preset v4.1-flash`` prints the deployment-scale plan and its ledger from
:func:`epkit.plan.plan` without allocating any weight.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from epkit.model.args import EXPERT_FORMATS, ModelArgs

__all__ = ["CLAIM", "build_parser", "check_ledger", "main", "run_rank"]

#: The claim of the source engine's write-up for one decode step, per collective kind (M MoE layers,
#: G Engram layers). Our Engram fetch is one ENP all-to-all exchange in three all_to_all_single calls
#: (request counts, row ids, rows).
CLAIM = {
    "exchange:ll_dispatch": ("M", "one dispatch per MoE layer"),
    "exchange:ll_combine": ("M", "one combine per MoE layer"),
    "dist.all_reduce": ("1", "one DP liveness all-reduce, no per-layer all-reduce"),
    "dist.all_to_all_single": ("3G", "the Engram fetch (counts, ids, rows) per Engram layer"),
}


def build_parser(prog: str = "epkit run") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Run the reference model (DP attention + Wide-EP) on CPU ranks and report where a step goes.",
        epilog="examples:\n  epkit run --ranks 2 --steps 3\n  epkit run --ranks 4 --weights fp4 --json run.json\n"
        "  epkit run --dry-run --preset v4.1-flash --ranks 64\n"
        "  torchrun --nproc-per-node 2 -m epkit.run --steps 3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--ranks", "--world", dest="ranks", type=int, default=None,
                    help="ranks to launch (under torchrun: its world size; --world is the old spelling)")  # fmt: skip
    ap.add_argument("--dp", type=int, default=None, help="DP size (must equal the ranks: DP attention)")
    ap.add_argument("--ep", type=int, default=None, help="EP size (must equal the ranks: Wide-EP)")
    ap.add_argument("--steps", type=int, default=3, help="decode steps per request (default 3)")
    ap.add_argument("--requests", type=int, default=2, help="requests per rank (default 2)")
    ap.add_argument("--idle", type=int, action="append", default=[], help="a rank with no requests (repeatable)")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt (default 16)")
    ap.add_argument("--weights", choices=EXPERT_FORMATS, default="fp8", help="expert weights (default fp8)")
    ap.add_argument("--transport", choices=("auto", "shm", "torch"), default="auto")
    ap.add_argument("--preset", choices=("tiny", "v4.1-flash"), default="tiny", help="model shapes")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its ledger; allocate nothing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    return ap


def _config_error(a, world: int) -> str | None:
    """Why these options cannot run on ``world`` ranks (one line), or None."""
    if world < 1:
        return f"--ranks must be >= 1, got {world}"
    for name in ("dp", "ep"):
        v = getattr(a, name)
        if v is not None and v != world:
            return f"--{name} {v} does not match the {world} ranks: DP attention + Wide-EP runs DP = EP = ranks"
    for name, v, lo in (("steps", a.steps, 0), ("requests", a.requests, 0), ("prompt-len", a.prompt_len, 1)):
        if v < lo:
            return f"--{name} must be >= {lo}, got {v}"
    if a.prompt_len > 256:
        return f"--prompt-len {a.prompt_len} exceeds the model's prefill capacity (256 tokens per rank)"
    bad = [r for r in a.idle if not 0 <= r < world]
    if bad:
        return f"--idle {bad[0]} is not a rank of 0..{world - 1}"
    if a.preset != "tiny" and not a.dry_run:
        return f"--preset {a.preset} has deployment-scale weights: use it with --dry-run"
    return None


def _prompts(a, rank: int, vocab: int) -> list[list[int]]:
    if rank in a.idle:
        return []
    g = torch.Generator().manual_seed(1000 * a.seed + rank)
    return [torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.requests)]


def run_rank(rank: int, world_size: int, a) -> dict:
    """One rank of ``epkit run`` (torch.distributed already up): generate, timing each step and op, with
    the collectives of every step recorded. Returns what the report needs from this rank."""
    from epkit.model.engine import generate
    from epkit.model.model import DPEPModel
    from epkit.model.profile import CollectiveLedger, StepTimer
    from epkit.topology import ParallelGroups

    groups = ParallelGroups.create(dp_size=world_size, device="cpu")
    args = ModelArgs(expert_format=a.weights, seed=a.seed)
    # the low-latency capacity sized to the decode batch, as an engine sizes it
    cap = max(1, a.requests)
    model = DPEPModel(
        args, groups, transport=a.transport, min_num_extra_experts=world_size, max_decode_tokens_per_rank=cap
    )
    model.timer = StepTimer(model.device)
    prompts = _prompts(a, rank, args.vocab_size)
    steps, marks = [], []
    with CollectiveLedger() as ledger:
        last = [time.perf_counter()]

        def on_step(is_prefill, batch, _forward_seconds):
            now = time.perf_counter()  # a step: from the end of the last one (its lockstep vote included)
            steps.append({"prefill": is_prefill, "tokens": 0 if batch is None else batch.num_tokens,
                          "seconds": now - last[0], "ops": model.timer.take()})  # fmt: skip
            marks.append(len(ledger.calls))
            last[0] = now

        t0 = last[0]
        tokens, stats = generate(model, prompts, a.steps + 1, on_step=on_step)
        seconds = time.perf_counter() - t0
    per_step = [ledger.calls[(marks[i - 1] if i else 0) : marks[i]] for i in range(len(marks))]
    info = {"transport": model.buffer.transport, "prefill_moe": model.prefill_moe, "args": args.__dict__}
    model.close()
    return {"prompts": prompts, "tokens": tokens, "stats": stats, "steps": steps, "ledger": per_step,
            "seconds": seconds, "info": info}  # fmt: skip


def _verdict(args: ModelArgs, results: list[dict]) -> dict:
    """Every greedy token against the float64 reference: the chosen token's logit within 0.15 of the best."""
    from epkit.model.reference import forward_reference

    seqs = [(p, o) for r in results for p, o in zip(r["prompts"], r["tokens"])]
    if not seqs:
        return {"tokens": 0, "exact": 0, "worst_gap": 0.0, "ok": True}
    ref = forward_reference(args, [p + o[:-1] for p, o in seqs])
    exact = total = 0
    worst = 0.0
    for (p, o), lg in zip(seqs, ref):
        lg = lg[len(p) - 1 :]
        chosen = lg.gather(1, torch.tensor(o)[:, None])[:, 0]
        worst = max(worst, float((lg.max(-1).values - chosen).max()))
        exact += int((lg.argmax(-1) == torch.tensor(o)).sum())
        total += len(o)
    return {"tokens": total, "exact": exact, "worst_gap": worst, "ok": worst < 0.15}


def check_ledger(step: list, n_moe: int, n_engram: int) -> list[dict]:
    """The measured ledger of one decode step beside :data:`CLAIM`: one row per kind seen or claimed, with
    ``ok`` False where the count differs."""
    from collections import Counter

    count, size = Counter(), Counter()
    for kind, nbytes in step:
        count[kind] += 1
        size[kind] += nbytes
    expect = {k: {"M": n_moe, "1": 1, "3G": 3 * n_engram}[n] for k, (n, _) in CLAIM.items()}
    rows = []
    for kind in sorted(set(count) | set(expect)):
        want = expect.get(kind, 0)  # a kind the claim has no room for: should not happen at all
        claim = CLAIM[kind][1] if kind in CLAIM else "not in the claim"
        rows.append({"kind": kind, "count": count[kind], "bytes": size[kind], "claim": want, "what": claim,
                     "ok": count[kind] == want})  # fmt: skip
    return rows


def _summary(a, results: list[dict], world: int) -> dict:
    """The report as a dict (what ``--json`` writes and :func:`_print` prints)."""
    r0 = results[0]
    args = ModelArgs(expert_format=a.weights, seed=a.seed)
    phases = {}
    for phase, is_prefill in (("prefill", True), ("decode", False)):
        st = [s for s in r0["steps"] if s["prefill"] == is_prefill]
        sec = sum(s["seconds"] for s in st)
        toks = sum(sum(s["tokens"] for s in r["steps"] if s["prefill"] == is_prefill) for r in results)
        phases[phase] = {"steps": len(st), "seconds_per_step": sec / len(st) if st else 0.0,
                         "tokens_per_s": toks / sec if sec else 0.0}  # fmt: skip
    decode = [s for s in r0["steps"] if not s["prefill"]]
    ops: dict[str, float] = {}
    for s in decode:
        for k, v in s["ops"].items():
            ops[k] = ops.get(k, 0.0) + v / len(decode)
    step_s = phases["decode"]["seconds_per_step"]
    comm = ops.get("dispatch", 0.0) + ops.get("combine", 0.0)
    idx = next((i for i, s in enumerate(r0["steps"]) if not s["prefill"]), None)
    ledger = [] if idx is None else check_ledger(r0["ledger"][idx], args.n_moe_layers, len(args.engram_layer_ids))
    return {"ranks": world, "transport": r0["info"]["transport"], "weights": a.weights, "steps": a.steps,
            "verdict": _verdict(args, results), "phases": phases, "decode_ops_s": ops,
            "dispatch_combine_share": comm / step_s if step_s else 0.0, "ledger": ledger,
            "ledger_ok": all(row["ok"] for row in ledger)}  # fmt: skip


def _print(rep: dict, out=None) -> None:
    out = sys.stdout if out is None else out
    v, ph = rep["verdict"], rep["phases"]
    print(f"epkit run: {rep['ranks']} ranks (DP = EP = {rep['ranks']}), transport {rep['transport']}, "
          f"{rep['weights']} experts, {rep['steps']} decode steps per request", file=out)  # fmt: skip
    print(f"verdict: {v['exact']}/{v['tokens']} greedy tokens are the float64 reference's argmax, largest gap "
          f"{v['worst_gap']:.4f} (< 0.15): {'PASS' if v['ok'] else 'FAIL'}", file=out)  # fmt: skip
    for name, p in ph.items():
        print(f"{name:>7}: {p['steps']} steps, {p['seconds_per_step'] * 1e3:.1f} ms per step, "
              f"{p['tokens_per_s']:.1f} tokens/s (all ranks)", file=out)  # fmt: skip
    step = ph["decode"]["seconds_per_step"] or 1.0
    print("one decode step on rank 0, by op (ms, share of the step):", file=out)
    for k, s in sorted(rep["decode_ops_s"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:<20} {s * 1e3:8.2f}  {100 * s / step:5.1f}%", file=out)
    print(f"  dispatch + combine: {100 * rep['dispatch_combine_share']:.1f}% of the decode step", file=out)
    print("collective ledger of one decode step on rank 0 (measured) beside the source engine's claim:", file=out)
    for row in rep["ledger"]:
        flag = "ok" if row["ok"] else "DIFFERS"
        print(f"  {row['kind']:<24} {row['count']:3d} calls {row['bytes']:10d} B   claim {row['claim']:3d} "
              f"({row['what']})  {flag}", file=out)  # fmt: skip


def _dry_run(a, world: int) -> int:
    from epkit.plan import format_plan, plan

    p = plan(a.preset if a.preset != "tiny" else "v4.1-flash", dp=world)
    print(format_plan(p))
    print(json.dumps({"ledger": p.ledger}, indent=1))
    return 0


def _fail(msg: str) -> int:
    print(f"epkit run: error: {msg}", file=sys.stderr)
    return 2


def main(argv=None, prog: str = "epkit run") -> int:
    """``epkit run`` (and ``python -m epkit.run``, ``python -m epkit.model``); returns the exit status (0: verdict
    and ledger agree)."""
    a = build_parser(prog).parse_args(argv)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (a.ranks if a.ranks is not None else 2)
    error = _config_error(a, world)
    if error is not None:
        return _fail(error)
    if a.dry_run:
        return _dry_run(a, world)
    if torchrun:
        results, rank = _under_torchrun(a, world)
        if rank != 0:
            return 0
    else:
        from epkit.testing.multiprocess import run_ranks

        print(f"epkit run: launching {world} CPU ranks ...", file=sys.stderr, flush=True)
        results = run_ranks(run_rank, world, a, timeout=a.timeout)
    rep = _summary(a, results, world)
    _print(rep)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if rep["verdict"]["ok"] and rep["ledger_ok"] else 1


def _under_torchrun(a, world: int) -> tuple[list[dict] | None, int]:
    """This process is one rank of a torchrun job: run it, and gather every rank's result on rank 0."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mine = run_rank(rank, world, a)
    results = [None] * world
    dist.all_gather_object(results, mine)
    dist.destroy_process_group()
    return results, rank
