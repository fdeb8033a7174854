"""What ``epkit run`` reports beyond its timings: the verdict of the greedy tokens against the float64 oracle,
the collective ledger of one decode step beside the source engine's claim, the CP prefill's all-gathers, and
the report printed as text."""

from __future__ import annotations

import sys

import torch

from epkit.model.args import ModelArgs

__all__ = ["CLAIM", "CLAIM_ENGRAM_A2A", "check_ledger", "cp_prefill_gathers", "print_report", "verdict"]

#: The claim of the source engine's write-up for one decode step, per collective kind (M MoE layers,
#: G Engram layers). Our Engram fetch, where the ENP ranks share a host (ShardedEngramTable on shm), is one
#: small exchange of error flags per Engram layer, the rows read straight out of their owners' shards;
#: across hosts it is one ENP all-to-all exchange in three all_to_all_single calls (counts, row ids, rows).
CLAIM = {
    "exchange:ll_dispatch": ("M", "one dispatch per MoE layer (per micro-batch under TBO)"),
    "exchange:ll_combine": ("M", "one combine per MoE layer (per micro-batch under TBO)"),
    "dist.all_reduce": ("1", "one DP liveness all-reduce (none at DP 1), no per-layer all-reduce"),
    "exchange:engram table request": ("G", "the Engram fetch per Engram layer (rows read one-sided)"),
}
#: The Engram fetch's claim where the tables take the all_to_all path (ENP ranks on several hosts).
CLAIM_ENGRAM_A2A = {"dist.all_to_all_single": ("3G", "the Engram fetch (counts, ids, rows) per Engram layer")}


def verdict(args: ModelArgs, results: list[dict]) -> dict:
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


def check_ledger(step: list, n_moe: int, n_engram: int, micro_batches: int = 1, dp: int = 2) -> list[dict]:
    """The measured ledger of one decode step beside :data:`CLAIM`: one row per kind seen or claimed, with
    ``ok`` False where the count differs. Under two-batch overlap (``micro_batches=2``) each micro-batch has
    its own dispatch and combine per MoE layer; with ``dp`` 1 there is no DP peer to agree with (no liveness
    all-reduce, as in the source engine)."""
    from collections import Counter

    count, size = Counter(), Counter()
    for kind, nbytes in step:
        count[kind] += 1
        size[kind] += nbytes
    claims = dict(CLAIM)
    if "dist.all_to_all_single" in count:  # the tables' all_to_all path (several hosts)
        del claims["exchange:engram table request"]
        claims.update(CLAIM_ENGRAM_A2A)
    counts = {"M": n_moe * micro_batches, "1": int(dp > 1), "G": n_engram, "3G": 3 * n_engram}
    expect = {k: counts[n] for k, (n, _) in claims.items()}
    rows = []
    for kind in sorted(set(count) | set(expect)):
        want = expect.get(kind, 0)  # a kind the claim has no room for: should not happen at all
        claim = claims[kind][1] if kind in claims else "not in the claim"
        rows.append({"kind": kind, "count": count[kind], "bytes": size[kind], "claim": want, "what": claim,
                     "ok": count[kind] == want})  # fmt: skip
    return rows


def cp_prefill_gathers(step: list, args: ModelArgs) -> dict:
    """The CP all-gathers of one context-parallel prefill step against this model's design: one per attention
    layer (keys and values), one per Engram layer (its input and rows), one at the model end (the source's
    model start is a local index gather: the batch is already on every CP rank)."""
    want = args.n_layers + len(args.engram_layer_ids) + 1
    got = sum(1 for kind, _ in step if kind in ("dist.all_gather_into_tensor", "dist.all_gather_single"))
    return {"count": got, "claim": want, "ok": got == want}


def print_report(rep: dict, out=None) -> None:
    """The report of :func:`epkit.model.run.main` as text (``--json`` writes the dict itself)."""
    out = sys.stdout if out is None else out
    v, ph = rep["verdict"], rep["phases"]
    print(f"epkit run: {rep['ranks']} ranks (DP {rep['dp']} x CP {rep['cp']}, EP {rep['ranks']}), transport "
          f"{rep['transport']}, {rep['weights']} experts, {rep['steps']} decode steps per request"
          f"{', two-batch overlap' if rep['tbo'] else ''}", file=out)  # fmt: skip
    print(f"verdict: {v['exact']}/{v['tokens']} greedy tokens are the float64 reference's argmax, largest gap "
          f"{v['worst_gap']:.4f} (< 0.15): {'PASS' if v['ok'] else 'FAIL'}", file=out)  # fmt: skip
    w = rep.get("warm_up")
    if w:
        print(f"warm-up: {w['steps']} steps, {w['seconds']:.2f} s on rank 0 before the timed steps (the first calls "
              "set up the kernels and buffers; not in the figures below)", file=out)  # fmt: skip
    for name, p in ph.items():
        print(f"{name:>7}: {p['steps']} steps, {p['seconds_per_step'] * 1e3:.1f} ms per step, "
              f"{p['tokens_per_s']:.1f} tokens/s (all ranks)", file=out)  # fmt: skip
    step = ph["decode"]["seconds_per_step"] or 1.0
    print("one decode step on rank 0, by op (ms, share of the step):", file=out)
    for k, s in sorted(rep["decode_ops_s"].items(), key=lambda kv: -kv[1]):
        note = "  (in flight behind the other micro-batch's compute)" if k == "overlapped_comm" else ""
        print(f"  {k:<20} {s * 1e3:8.2f}  {100 * s / step:5.1f}%{note}", file=out)
    print(f"  dispatch + combine: {100 * rep['dispatch_combine_share']:.1f}% of the decode step", file=out)
    print("collective ledger of one decode step on rank 0 (measured) beside the source engine's claim:", file=out)
    for row in rep["ledger"]:
        flag = "ok" if row["ok"] else "DIFFERS"
        print(f"  {row['kind']:<24} {row['count']:3d} calls {row['bytes']:10d} B   claim {row['claim']:3d} "
              f"({row['what']})  {flag}", file=out)  # fmt: skip
    g = rep.get("cp_prefill_gathers")
    if g is not None:
        print(f"CP prefill step: {g['count']} all-gathers on the CP group, by design {g['claim']} (one per attention "
              f"and Engram layer, one at the model end)  {'ok' if g['ok'] else 'DIFFERS'}", file=out)  # fmt: skip
