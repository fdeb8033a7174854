"""Rung 4 of the verification ladder: every GPU correctness check and microbenchmark of epkit in one script.

Run on a machine with one CUDA GPU (an H200 for the figures the project quotes)::

    python bench/gpu_check.py                      # all sections, ~5-7 minutes, build/bench/gpu_check.json
    python bench/gpu_check.py --quick              # smaller shapes, same checks
    python bench/gpu_check.py --sections env,grouped_gemm --out /tmp/g.json

and on a CPU-only machine as a dry run of the control flow (what CI does)::

    python bench/gpu_check.py --device cpu --quick --out /tmp/dry.json

Sections (default order): ``env``, ``gather_rows``, ``logical_to_physical``, ``prepare_cp_mirror``,
``engram_hash``, ``grouped_gemm``, ``nvshmem``, ``bench`` (``epkit bench``'s in-process families on the
device, its own report also written as ``<out stem>.bench.json`` / ``.md``); ``--sections`` runs the ones it
names in its order.
Each one runs inside its own try/except with its own time budget (scaled by ``--budget``, or fixed by
``--section-budget``): a failing or slow section records its status, its traceback and what it
measured so far, and the next section still runs. A watchdog thread interrupts a section
that overruns its budget by far, and writes the JSON and exits if it stays stuck (a hung kernel).
The JSON is rewritten after every section, so a run killed from outside keeps the sections it finished.

Section status: ``ok``; ``fail`` (a correctness check disagreed; see ``checks``); ``error`` (a Python
exception; see ``error`` and ``traceback``); ``budget_exceeded`` (stopped early; partial results kept);
``hung`` (interrupted by the watchdog); ``skipped: <reason>`` (e.g. ``skipped: no CUDA``).

Timing (``epkit.bench.timing``, the harness ``epkit bench`` uses): CUDA events around each call after warm-up,
median of N (CPU: ``time.perf_counter``); the GEMMs flush L2 between calls. Every figure is paired with a peer
or roof measured in the same run: ``torch.index_select`` and a device-to-device copy for the gathers,
``torch.matmul`` in bf16 at equal FLOPs (and dense ``torch._scaled_mm`` FP8 where torch has it) for the grouped
GEMMs, a device copy for the NVSHMEM loopback put and the SymmBuffer(nvshmem) loopback exchange. The nvshmem
section also runs SymmBuffer(nvshmem) with its memory from torch's NVSHMEM symmetric memory, in a child process
(torch must start that process's NVSHMEM job); where torch lacks NVSHMEM it records why; epkit's own job also
runs DeepGEMM's Mega MoE interface (``epkit.compat.deep_gemm``) over an NCCL group of one, its EPBuffer on NVSHMEM
(``gpu_sections/nvshmem_mega.py``). Exit status: 0 when every section is ok or skipped, 1 otherwise.

This file is the harness (arguments, budgets, the section runner, the watchdog, the JSON report, the child
modes); each section is a module of ``bench/gpu_sections/`` named after its op family.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # loaded by path (as the tests do): the section modules live next to this file
    sys.path.insert(0, HERE)

from gpu_sections.bench import sec_bench  # noqa: E402
from gpu_sections.common import BudgetExceeded, Ctx  # noqa: E402
from gpu_sections.cp_mirror import sec_prepare_cp_mirror  # noqa: E402
from gpu_sections.engram import sec_engram_hash  # noqa: E402
from gpu_sections.env import sec_env  # noqa: E402
from gpu_sections.experts import sec_logical_to_physical  # noqa: E402
from gpu_sections.gather import sec_gather_rows  # noqa: E402
from gpu_sections.grouped_gemm import sec_grouped_gemm  # noqa: E402
from gpu_sections.nvshmem import sec_nvshmem  # noqa: E402
from gpu_sections.nvshmem_child import nvshmem_child  # noqa: E402
from gpu_sections.nvshmem_symm import torch_provider_child  # noqa: E402

#: Seconds per section at ``--budget 490`` (they sum to it); scaled linearly with ``--budget``, except
#: the sections given a fixed ``--section-budget`` (the others then share what is left).
BUDGETS = {
    "env": 15,
    "gather_rows": 70,
    "logical_to_physical": 35,
    "prepare_cp_mirror": 50,
    "engram_hash": 50,
    "grouped_gemm": 140,
    "nvshmem": 90,
    "bench": 40,
}
SECTIONS = tuple(BUDGETS)
DEFAULT_TOTAL = sum(BUDGETS.values())

SECTION_FUNCS = {
    "env": sec_env,
    "gather_rows": sec_gather_rows,
    "logical_to_physical": sec_logical_to_physical,
    "prepare_cp_mirror": sec_prepare_cp_mirror,
    "engram_hash": sec_engram_hash,
    "grouped_gemm": sec_grouped_gemm,
    "nvshmem": sec_nvshmem,
    "bench": sec_bench,
}


# Driver: JSON writing, watchdog, section runner


class Report:
    def __init__(self, path: str, meta: dict):
        self.path = path
        self.data = {"meta": meta, "sections": {}}
        self.lock = threading.Lock()

    def write(self) -> None:
        with self.lock:
            for _ in range(3):  # the watchdog may write while the main thread mutates; retry
                try:
                    text = json.dumps(self.data, indent=2, default=str, allow_nan=True)
                    break
                except RuntimeError:
                    time.sleep(0.05)
            else:
                return
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            tmp = f"{self.path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)


class Watchdog(threading.Thread):
    """Interrupts a section that overruns its hard limit; if it stays stuck, writes the JSON and exits."""

    GRACE_S = 20.0

    def __init__(self, report: Report):
        super().__init__(daemon=True, name="gpu_check-watchdog")
        self.report = report
        self.current: str | None = None
        self.hard_deadline = math.inf
        self.fired_for: str | None = None
        self.stop = threading.Event()

    def arm(self, name: str, budget: float) -> None:
        self.current, self.fired_for = name, None
        self.hard_deadline = time.perf_counter() + 1.25 * budget + 15.0

    def disarm(self) -> None:
        self.current, self.hard_deadline = None, math.inf

    def run(self) -> None:
        while not self.stop.wait(0.5):
            name, now = self.current, time.perf_counter()
            if name is None or now < self.hard_deadline:
                continue
            if self.fired_for != name:
                self.fired_for = name
                print(f"[watchdog] {name} overran its hard limit; interrupting it", flush=True)
                _thread.interrupt_main()
            elif now > self.hard_deadline + self.GRACE_S:
                sec = self.report.data["sections"].get(name, {})
                sec["status"] = "hung"
                sec["error"] = "stuck past its hard limit (a kernel or a wait that never returned); process exited"
                self.report.data["meta"]["exit"] = f"watchdog killed the run in section {name}"
                self.report.write()
                print(f"[watchdog] {name} is stuck; wrote {self.report.path} and exiting", flush=True)
                os._exit(3)


def run_section(name: str, ctx: Ctx, budget: float, report: Report, watchdog: Watchdog) -> dict:
    res: dict = {"status": "running", "budget_s": round(budget, 1)}
    report.data["sections"][name] = res
    report.write()
    ctx.begin(name, budget)
    ctx.log(f"start (budget {budget:.0f} s)")
    watchdog.arm(name, budget)
    t0 = time.perf_counter()
    status = "ok"
    try:
        skip = SECTION_FUNCS[name](ctx, res)
        if skip:
            status = f"skipped: {skip}"
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)  # surface asynchronous kernel faults inside this section
    except BudgetExceeded as exc:
        status = "budget_exceeded"
        res["error"] = str(exc)
    except KeyboardInterrupt as exc:
        if watchdog.fired_for != name:
            res["status"] = "interrupted"
            res["error"] = f"interrupted ({exc or 'Ctrl-C'}) after {time.perf_counter() - t0:.1f} s"
            raise
        status = "hung"
        res["error"] = "interrupted by the watchdog after overrunning its hard limit"
        res["traceback"] = traceback.format_exc()
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, then the next section runs
        status = "error"
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()
        print(res["traceback"], flush=True)
    finally:
        watchdog.disarm()
    failed = [c["name"] for c in res.get("checks", []) if not c["ok"]]
    res["checks_passed"] = sum(1 for c in res.get("checks", []) if c["ok"])
    res["checks_failed"] = len(failed)
    if failed and status in ("ok", "budget_exceeded"):
        status = "fail"
    res["status"] = status
    res["elapsed_s"] = round(time.perf_counter() - t0, 2)
    if ctx.cuda:
        with contextlib.suppress(Exception):  # a broken context was already recorded above
            torch.cuda.empty_cache()
    ctx.log(f"{status} in {res['elapsed_s']:.1f} s ({res['checks_passed']} checks passed, {len(failed)} failed)")
    report.write()
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="default: cuda if present")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (same checks)")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}, run in the order given",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="JSON path (default build/bench/gpu_check.json on CUDA, build/bench/gpu_check_cpu.json on CPU: "
        "nothing is written into the committed bench/results/ unless asked)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_TOTAL,
        help=f"total seconds, split over sections (default {DEFAULT_TOTAL})",
    )
    ap.add_argument(
        "--section-budget",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="give one section a fixed budget (repeatable); the other sections share what is left of --budget",
    )
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTION_FUNCS]
    if unknown or not names:
        ap.error(f"--sections: unknown {unknown}; expected a comma-separated subset of {','.join(SECTIONS)}")
    args.sections = list(dict.fromkeys(names))  # the order given: a lent machine's minutes go first to what matters
    if args.budget <= 0:
        ap.error(f"--budget must be > 0 seconds, got {args.budget}")
    fixed = {}
    for item in args.section_budget:
        name, _, secs = item.partition("=")
        try:
            value = float(secs)
        except ValueError:
            value = -1.0
        if name not in SECTION_FUNCS or value <= 0:
            ap.error(f"--section-budget: expected NAME=SECONDS with NAME in {','.join(SECTIONS)}, got {item!r}")
        fixed[name] = value
    fixed = {n: b for n, b in fixed.items() if n in names}  # a section not run takes nothing
    left = args.budget - sum(fixed.values())
    if left <= 0 and any(n not in fixed for n in names):
        ap.error(f"--section-budget: the fixed budgets ({sum(fixed.values()):g} s) leave nothing of --budget")
    # --budget is split over the sections that run, in their default proportions.
    scale = left / max(1, sum(BUDGETS[n] for n in names if n not in fixed))
    args.budgets = {n: fixed.get(n, BUDGETS[n] * scale) for n in names}
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--torch-provider-child"]:
        return torch_provider_child(float(argv[1]) if len(argv) > 1 else 80.0)
    if argv[:1] == ["--nvshmem-child"] and len(argv) == 4:
        return nvshmem_child(float(argv[1]), argv[2] == "quick", argv[3])
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    default_name = "gpu_check.json" if device.type == "cuda" else "gpu_check_cpu.json"
    out = args.out or os.path.join(os.path.dirname(HERE), "build", "bench", default_name)
    meta = {
        "script": "bench/gpu_check.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "device": str(device),
        "quick": args.quick,
        "sections_requested": args.sections,
        "budget_s": args.budget,
        "section_budgets_s": {n: round(args.budgets[n], 1) for n in args.sections},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "timing": "CUDA events per call after warm-up, median of N (CPU: perf_counter); GEMMs flush L2 per call; "
        "'events_one_call' brackets one call with events, host work inside the call included (the ops that read "
        "routing or sequence lengths back sync there); 'wall' is host-inclusive over back-to-back calls",
    }
    report = Report(out, meta)

    def on_sigterm(signum, frame):  # an outer `timeout`: end like Ctrl-C, so the report is written first
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    watchdog = Watchdog(report)
    watchdog.start()
    ctx = Ctx(device, args.quick, t_start)
    ctx.out_path = out
    for name in args.sections:  # every requested section appears in the JSON, even if the run dies early
        report.data["sections"][name] = {"status": "not run"}
    print(f"gpu_check: device {device}, quick={args.quick}, sections {','.join(args.sections)} -> {out}", flush=True)
    try:
        for name in args.sections:
            run_section(name, ctx, args.budgets[name], report, watchdog)
    except KeyboardInterrupt as exc:
        report.data["meta"]["exit"] = f"interrupted ({exc or 'Ctrl-C'})"
        for sec in report.data["sections"].values():  # also one interrupted before its own handler ran
            if sec.get("status") == "running":
                sec["status"] = "interrupted"
        report.write()
        raise
    finally:
        watchdog.stop.set()
    sections = report.data["sections"]
    report.data["meta"]["total_s"] = round(time.perf_counter() - t_start, 1)
    bad = [n for n, s in sections.items() if not (s["status"] == "ok" or s["status"].startswith("skipped"))]
    report.data["meta"]["all_ok"] = not bad
    report.write()
    print(f"\n== gpu_check summary ({report.data['meta']['total_s']:.0f} s, {device}) -> {out}", flush=True)
    for n, s in sections.items():
        line = f"{n:>20}: {s['status']:<16} {s.get('elapsed_s', 0):6.1f} s"
        if s.get("checks_passed") or s.get("checks_failed"):
            line += f"  checks {s['checks_passed']}/{s['checks_passed'] + s['checks_failed']}"
        if s.get("summary"):
            line += f"  | {s['summary']}"
        print(line, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
