"""``epkit run``: the reference model as a command, with the verdict, step latencies, a per-op breakdown
and the measured collective ledger of a decode step.

``epkit run --ranks N`` launches N CPU ranks itself (``epkit.cpu_ranks.run_ranks``); under
``torchrun --nproc-per-node N -m epkit run`` every process is one rank and rank 0 prints the report.
The ranks are ``world = dp x cp`` (``--cp C``: ``DP = N / C`` engines of ``C`` adjacent ranks, each engine's
prefill context-parallel, see :mod:`epkit.model.cp_prefill`); EP spans every rank (Wide-EP); the Engram tables are
sharded over ENP groups of ``--enp P`` ranks (a divisor of N; default all N). ``--tbo`` runs each decode step
as two overlapped micro-batches (:mod:`epkit.model.tbo`). A bad option or input is one line
(``epkit run: error: ...``) on every rank, and a non-zero exit on every rank.

What it prints:

- the verdict: every greedy token against the one-process float64 model (:func:`forward_reference`);
- prefill and decode: steps, seconds per step and tokens per second (rank 0's clock);
- where a decode step's time goes, per op (:class:`~epkit.model.profile.StepTimer`), and the share of
  dispatch + combine;
- the collective ledger of one decode step as it ran (:class:`~epkit.model.profile.CollectiveLedger`:
  torch.distributed calls and SymmBuffer exchanges, wrapped, counted and sized), beside the claim of the
  DeepInfer write-up (``000_*.txt``): no per-layer all-reduce, one dispatch and one combine per MoE
  layer, one DP liveness all-reduce per step, the Engram fetch; a difference is flagged.

Before the timed steps every rank runs its requests once off the clock (a prefill and a decode step): the
first calls set up the kernels and touch the buffers, seconds that would otherwise be the prefill's figure.

``epkit run --ranks N`` refuses more ranks than this machine can start (:func:`rank_limit`: cores, available
memory, the open-file limit), before launching any; ``--force`` launches them anyway.

``--dry-run --preset P`` prints the plan of the preset (``tiny``: the model ``epkit run`` runs; ``v4.1-flash``:
deployment scale) with ``--weights`` (default: the preset's own format) from :func:`epkit.plan.plan`, and its
ledger, without allocating any weight.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from epkit.model.args import EXPERT_FORMATS, ModelArgs
from epkit.model.report import CLAIM, check_ledger, cp_prefill_gathers, print_report, verdict

__all__ = [
    "CLAIM",
    "PREFILL_CAPACITY",
    "TRANSPORTS",
    "build_parser",
    "check_ledger",
    "cp_prefill_gathers",
    "end_process",
    "main",
    "rank_limit",
    "run_rank",
]

#: ``--transport`` choices (``nvshmem``: GPUs only).
TRANSPORTS = ("auto", "shm", "torch", "nvshmem")
#: Prefill rows one rank may bring to a step (the EP buffer's ``max_tokens_per_rank``).
PREFILL_CAPACITY = 256
#: Seconds a rank waits on its peers, in any one wait (the groups' collectives, the model's buffers): a rank that
#: stops is named by the others after this long.
PEER_WAIT_S = 30.0
#: Expert weights of a run where ``--weights`` is not given (a dry run: the preset's own format).
DEFAULT_WEIGHTS = "fp8"
#: Ranks per core :func:`rank_limit` allows: the ranks wait for each other by polling, and past this many they
#: mostly take turns (8 ranks on 2 cores: about 30 s for one decode step, with start-up).
RANKS_PER_CORE = 8
#: Resident memory of one rank of the tiny model (torch, the kernels, the model, its buffers): ~0.45 GiB measured.
RANK_BYTES = 2**29
#: Open files of one rank: about 32 of its own and 6 per peer (the gloo pairs of its groups, pipes, segments).
RANK_FILES, RANK_FILES_PER_PEER = 64, 8


def build_parser(prog: str = "epkit run") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Run the reference model (DP attention + Wide-EP) on CPU ranks and report where a step goes.",
        epilog="examples:\n  epkit run --ranks 2 --steps 3\n  epkit run --ranks 4 --weights fp4 --json run.json\n"
        "  epkit run --ranks 4 --cp 2 --tbo\n"
        "  epkit run --dry-run --preset v4.1-flash --ranks 64\n"
        "  torchrun --nproc-per-node 2 -m epkit run --steps 3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--ranks", type=int, default=None,
                    help="ranks to launch (under torchrun: its world size); at most "
                    "what this machine can start (cores, memory, open files) unless --force")  # fmt: skip
    ap.add_argument("--force", action="store_true", help="launch more ranks than this machine's limit")
    ap.add_argument("--dp", type=int, default=None, help="DP size (engines): must be ranks / cp")
    ap.add_argument("--cp", type=int, default=1, help="CP size: each engine's prefill over this many ranks (default 1)")
    ap.add_argument("--ep", type=int, default=None, help="EP size (must equal the ranks: Wide-EP)")
    ap.add_argument("--enp", type=int, default=None, help="Engram tables sharded over this many ranks (default: all)")
    ap.add_argument("--tbo", action="store_true", help="two-batch overlap in decode")
    ap.add_argument("--redundant-experts", type=int, default=None, metavar="N",
                    help="redundant expert slots at least (EPLB replicas; default: one per rank)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=3, help="decode steps per request (default 3)")
    ap.add_argument("--requests", type=int, default=2, help="random requests per engine, >= 1 (default 2)")
    ap.add_argument("--prompt", action="append", default=[], metavar="IDS",
                    help="a prompt as comma-separated token ids, instead of random ones (repeatable; "
                    "prompt j goes to engine j %% dp)")  # fmt: skip
    ap.add_argument("--idle", type=int, action="append", default=[], help="an engine (DP rank) with no requests")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens per random prompt (default 16)")
    ap.add_argument("--weights", choices=EXPERT_FORMATS, default=None,
                    help=f"expert weights (default {DEFAULT_WEIGHTS}; with --dry-run the preset's own: fp8 for "
                    "tiny, fp4 for v4.1-flash)")  # fmt: skip
    ap.add_argument("--transport", choices=TRANSPORTS, default="auto")
    ap.add_argument("--preset", choices=("tiny", "v4.1-flash"), default="tiny", help="model shapes")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan of --preset with --weights and its ledger; allocate nothing")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run (default 300)")
    ap.add_argument("--json", nargs="?", const="-", metavar="PATH",
                    help="write the report as JSON to PATH too; alone: JSON on stdout, no text")  # fmt: skip
    return ap


def _parse_prompts(a) -> list[list[int]] | str:
    """The ``--prompt`` lists, or why one is not a list of integers."""
    out = []
    for text in a.prompt:
        try:
            out.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            return f"--prompt {text!r} is not comma-separated token ids"
    return out


def _size_error(a, world: int) -> str | None:
    """Why the parallel sizes do not fit ``world`` ranks (one line), or None."""
    if world < 1:
        return f"--ranks must be >= 1, got {world}"
    if a.cp < 1 or world % a.cp:
        return f"--cp {a.cp} does not divide the {world} ranks (world = dp x cp)"
    dp = world // a.cp
    if a.dp is not None and a.dp != dp:
        return f"--dp {a.dp} does not match the {world} ranks with --cp {a.cp}: world = dp x cp gives dp {dp}"
    if a.ep is not None and a.ep != world:
        return f"--ep {a.ep} does not match the {world} ranks: Wide-EP runs EP = ranks"
    if a.enp is not None and (a.enp < 1 or world % a.enp):
        return f"--enp {a.enp} does not divide the {world} ranks (the model has no ranks that only hold Engram rows)"
    return None


def _config_error(a, world: int) -> str | None:
    """Why these options cannot run on ``world`` ranks (one line), or None."""
    from epkit.model.engine import max_prompt_len

    error = _size_error(a, world)
    if error is not None:
        return error
    checks = [("steps", a.steps, 0), ("requests", a.requests, 1), ("prompt-len", a.prompt_len, 1)]
    for name, v, lo in checks + [("redundant-experts", a.redundant_experts or 0, 0)]:
        if v < lo:
            return f"--{name} must be >= {lo}, got {v}"
    longest, vocab = max_prompt_len(PREFILL_CAPACITY, a.cp), ModelArgs().vocab_size
    prompts = _parse_prompts(a)
    if isinstance(prompts, str):
        return prompts
    for p in prompts if prompts else [[0] * a.prompt_len]:
        if not 1 <= len(p) <= longest:
            return f"a prompt of {len(p)} tokens exceeds the model's prefill capacity ({longest} tokens at --cp {a.cp})"
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {vocab})"
    bad = [r for r in a.idle if not 0 <= r < world // a.cp]
    if bad:
        return f"--idle {bad[0]} is not an engine (DP rank) of 0..{world // a.cp - 1}"
    if not prompts and set(a.idle) >= set(range(world // a.cp)):
        return f"--idle leaves no engine with a request (all {world // a.cp} are idle): nothing to run or check"
    if not a.timeout > 0:
        return f"--timeout must be > 0, got {a.timeout:g}"
    if a.preset != "tiny" and not a.dry_run:
        return f"--preset {a.preset} has deployment-scale weights: use it with --dry-run"
    if a.transport == "nvshmem" and not torch.cuda.is_available() and not a.dry_run:
        return "--transport nvshmem needs CUDA GPUs (NVSHMEM moves the rows between GPUs); use shm or torch on CPU"
    return None


def _weights(a) -> str:
    """The expert weight format of a run (``--weights``, else :data:`DEFAULT_WEIGHTS`)."""
    return a.weights or DEFAULT_WEIGHTS


def rank_limit() -> tuple[int, str]:
    """The most CPU ranks ``epkit run`` launches on this machine without ``--force``, and why (one phrase): the
    least of :data:`RANKS_PER_CORE` per core this process may run on, the ranks of :data:`RANK_BYTES` that fit
    the available memory (cgroup limit included), and the ranks whose open files (:data:`RANK_FILES` plus
    :data:`RANK_FILES_PER_PEER` per peer) fit the soft open-file limit (``ulimit -n``)."""
    from epkit.collectives.bootstrap import memory_available

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    bounds = [(RANKS_PER_CORE * cores, f"{RANKS_PER_CORE} per core on {cores} cores")]
    mem = memory_available()
    if mem is None:
        bounds.append((sys.maxsize, "available memory unknown"))
    else:
        per = RANK_BYTES / 2**30
        bounds.append((mem // RANK_BYTES, f"{mem / 2**30:.1f} GiB of available memory at ~{per:g} GiB per rank"))
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        soft = -1 if soft == resource.RLIM_INFINITY else soft
    except (ImportError, OSError, ValueError):  # no such limit here
        soft = -1
    if soft > 0:
        fit = (soft - RANK_FILES) // RANK_FILES_PER_PEER
        bounds.append((fit, f"open-file limit {soft} (ulimit -n) at ~{RANK_FILES_PER_PEER} files per peer"))
    limit = max(1, min(b for b, _ in bounds))
    return limit, ", ".join(why if b == sys.maxsize else f"{max(b, 0)} for {why}" for b, why in bounds)


def _prompts(a, engine: int, dp: int, vocab: int) -> list[list[int]]:
    """Engine ``engine``'s prompts: its share of ``--prompt``, else ``--requests`` random ones."""
    given = _parse_prompts(a)
    if given:
        return [p for j, p in enumerate(given) if j % dp == engine]
    if engine in a.idle:
        return []
    g = torch.Generator().manual_seed(1000 * a.seed + engine)
    return [torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.requests)]


def _model(a, world_size: int):
    """This rank's groups and :class:`DPEPModel` for the options ``a``."""
    from epkit.model.model import DPEPModel
    from epkit.model.profile import StepTimer
    from epkit.topology import ParallelGroups

    if a.transport == "nvshmem":  # rows on this rank's GPU; control over the gloo groups
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())) % torch.cuda.device_count())
    # one wait for everything a rank waits on: the groups' collectives (the lockstep all-reduce) and the model's
    groups = ParallelGroups.create(
        dp_size=world_size // a.cp, cp_size=a.cp, enp_size=a.enp, device="cpu", timeout=PEER_WAIT_S
    )
    args = ModelArgs(expert_format=_weights(a), seed=a.seed)
    # the low-latency capacity sized to the decode batch, as an engine sizes it
    cap = max(1, a.requests, -(-len(a.prompt) // groups.sizes["dp"]))
    extra = world_size if a.redundant_experts is None else a.redundant_experts
    model = DPEPModel(args, groups, transport=a.transport, min_num_extra_experts=extra,
                      max_tokens_per_rank=PREFILL_CAPACITY, max_decode_tokens_per_rank=cap, tbo=a.tbo,
                      timeout=PEER_WAIT_S)  # fmt: skip
    model.timer = StepTimer(model.device)
    return model


def run_rank(rank: int, world_size: int, a) -> dict:
    """One rank of ``epkit run`` (torch.distributed already up): generate, timing each step and op, with
    the collectives of every step recorded. Returns what the report needs from this rank (``error``: the one
    line this rank printed for an input every rank rejected).

    With ``--cp C`` the ranks form ``world / C`` engines of ``C`` adjacent ranks (``world = dp x cp``); every
    CP rank of an engine runs the engine's prompts (the prefill context-parallel, each sequence then decoded
    on one of them) and CP rank 0 reports them. ``prefill_logits``: each reported prompt's prefill logits;
    ``logits``: every step's logits of each sequence this rank ran (prompt index -> rows); ``warm_up``: the steps
    and seconds of the untimed run of the same prompts (one prefill, one decode step) before the timed one, where
    the first calls set up the kernels and touch the buffers (an idle engine warms up with one prompt of
    ``--prompt-len`` zeros)."""
    from epkit.model.engine import generate
    from epkit.model.profile import CollectiveLedger

    # torch 2.13 deprecates the call CPGroup makes; the run's output stays the report
    warnings.filterwarnings("ignore", r"`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning)
    model = _model(a, world_size)
    dp, engine, lead = world_size // a.cp, model.groups.engine_rank, model.cp_rank == 0
    prompts = _prompts(a, engine % dp, dp, model.args.vocab_size)
    steps, marks, logits = [], [], {}
    forward = model.forward

    def recording_forward(batch):
        out = forward(batch)
        for sid, row in zip(batch.seq_ids, out.cpu().tolist()):
            if sid is not None:
                logits.setdefault(sid, []).append(row)
        return out

    def rejected(exc: ValueError) -> dict:  # the same on every rank, before the first step
        model.close()
        sys.stderr.write(f"epkit run: error: rank {rank}: {exc}\n")  # one write: ranks share the terminal
        sys.stderr.flush()
        return {"error": str(exc)}

    # off the clock, out of the ledger and of the logits: the same prompts, a prefill and a decode step
    warm = {"steps": 0, "seconds": 0.0}

    def count_warm_up(*_):
        warm["steps"] += 1

    w0 = time.perf_counter()
    try:
        generate(model, prompts or [[0] * a.prompt_len], 2, on_step=count_warm_up)
    except ValueError as exc:
        return rejected(exc)
    warm["seconds"] = time.perf_counter() - w0
    model.timer.take()
    model.routed_load.zero_()  # the warm-up's routing is no load

    model.forward = recording_forward
    with CollectiveLedger() as ledger:
        last = [time.perf_counter()]

        def on_step(is_prefill, batch, _forward_seconds):
            now = time.perf_counter()  # a step: from the end of the last one (its lockstep vote included)
            tokens = 0 if batch is None or (is_prefill and not lead) else batch.num_tokens  # a CP prefill: once
            steps.append({"prefill": is_prefill, "tokens": tokens, "seconds": now - last[0],
                          "ops": model.timer.take()})  # fmt: skip
            marks.append(len(ledger.calls))
            last[0] = now

        t0 = last[0]
        try:
            tokens, stats = generate(model, prompts, a.steps + 1, on_step=on_step)
        except ValueError as exc:
            return rejected(exc)
        seconds = time.perf_counter() - t0
    per_step = [ledger.calls[(marks[i - 1] if i else 0) : marks[i]] for i in range(len(marks))]
    info = {"transport": model.buffer.transport, "prefill_moe": model.prefill_moe, "args": model.args.__dict__}
    model.close()
    mine = range(len(prompts)) if lead else range(0)
    return {"prompts": [prompts[i] for i in mine], "tokens": [tokens[i] for i in mine], "stats": stats,
            "steps": steps, "ledger": per_step, "seconds": seconds, "info": info, "warm_up": warm,
            "prefill_logits": [logits[i][0] for i in mine], "logits": logits}  # fmt: skip


def _summary(a, results: list[dict], world: int) -> dict:
    """The report as a dict (what ``--json`` writes and :func:`~epkit.model.report.print_report` prints)."""
    r0 = results[0]
    args = ModelArgs(expert_format=_weights(a), seed=a.seed)
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
    n_engram, micro = len(args.engram_layer_ids), 2 if a.tbo else 1
    ledger = [] if idx is None else check_ledger(r0["ledger"][idx], args.n_moe_layers, n_engram, micro, world // a.cp)
    first = next((i for i, s in enumerate(r0["steps"]) if s["prefill"] and s["tokens"]), None)
    gathers = None if a.cp == 1 or first is None else cp_prefill_gathers(r0["ledger"][first], args)
    return {"ranks": world, "dp": world // a.cp, "cp": a.cp, "tbo": a.tbo, "transport": r0["info"]["transport"],
            "weights": _weights(a), "steps": a.steps, "verdict": verdict(args, results), "phases": phases,
            "warm_up": {"steps": r0["warm_up"]["steps"], "seconds": r0["warm_up"]["seconds"]},
            "decode_ops_s": ops, "dispatch_combine_share": comm / step_s if step_s else 0.0, "ledger": ledger,
            "cp_prefill_gathers": gathers,
            "ledger_ok": all(row["ok"] for row in ledger) and (gathers is None or gathers["ok"])}  # fmt: skip


def _dry_run(a, world: int) -> int:
    """The plan of ``--preset`` on ``world`` ranks with ``--weights`` (default: the preset's own), as the run
    would lay it out (``--redundant-experts``, default one per rank); text: the table, which holds the ledger."""
    from epkit.plan import PRESETS, format_plan, plan

    model = ModelArgs(seed=a.seed).model_config() if a.preset == "tiny" else PRESETS[a.preset]
    extra = world if a.redundant_experts is None else a.redundant_experts
    try:
        p = plan(model, dp=world // a.cp, cp=a.cp, enp=a.enp, weight_format=a.weights, min_num_extra_experts=extra)
    except ValueError as exc:
        return _fail(str(exc))
    if a.json == "-":
        print(json.dumps(p.to_dict(), indent=1))
        return 0
    print(format_plan(p))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(p.to_dict(), f, indent=1)
    return 0


def end_process(code: int) -> int:
    """Where ``epkit run`` ends: under torchrun, the rank's process ends here with
    ``code`` once its output is flushed, without the interpreter's teardown; elsewhere ``code`` is returned.

    A runtime the CPU kernels load (TVM, under TileLang's) can abort in its static destructors at exit ("terminate
    called without an active exception"): about one run in twenty of ``torchrun --nproc-per-node 2 -m epkit run``
    on the 2-core machine, none in 40 with ``EPKIT_BACKEND=cpu``; torchrun then reports a rank whose work and output
    are complete as failed. The process group is already destroyed and every file closed by then.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _fail(msg: str) -> int:
    print(f"epkit run: error: {msg}", file=sys.stderr)
    return 2


def main(argv=None, prog: str = "epkit run") -> int:
    """``epkit run``; returns the exit status (0: verdict
    and ledger agree; 1: they do not, or the ranks did not finish within ``--timeout``; 2: bad usage)."""
    a = build_parser(prog).parse_args(argv)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (a.ranks if a.ranks is not None else 2)
    error = _config_error(a, world)
    if error is not None:
        return _fail(error)
    if a.dry_run:
        return _dry_run(a, world)
    if not torchrun and not a.force:
        limit, why = rank_limit()
        if world > limit:
            return _fail(f"--ranks {world} is more than this machine can start: at most {limit} ({why}); --force "
                         "launches them anyway")  # fmt: skip
    if torchrun:
        results, rank = _under_torchrun(a, world)
        if rank != 0:
            return 2 if "error" in results[rank] else 0
    else:
        from epkit.cpu_ranks import run_ranks

        print(f"epkit run: launching {world} CPU ranks ...", file=sys.stderr, flush=True)
        try:
            results = run_ranks(run_rank, world, a, timeout=a.timeout)
        except TimeoutError as exc:  # every rank killed; the message names those that had not finished
            print(f"epkit run: error: {exc} (--timeout {a.timeout:g})", file=sys.stderr)
            return 1
    if any("error" in r for r in results):
        return 2  # every rank printed its line
    rep = _summary(a, results, world)
    if a.json == "-":
        print(json.dumps(rep, indent=1))
    else:
        print_report(rep)
    if a.json and a.json != "-":
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if rep["verdict"]["ok"] and rep["ledger_ok"] else 1


def _under_torchrun(a, world: int) -> tuple[list[dict] | None, int]:
    """This process is one rank of a torchrun job: run it, and gather every rank's result on rank 0. A process
    whose launcher already joined the job (torch.distributed initialised) runs in that group and leaves it up."""
    joined = dist.is_initialized()
    if not joined:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    mine = run_rank(rank, world, a)
    results = [None] * world
    dist.all_gather_object(results, mine)
    if not joined:
        dist.destroy_process_group()
    return results, rank
