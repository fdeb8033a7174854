"""Runs ``epkit bench``'s families in turn: plans every case first (so the progress bar knows the total),
then runs them within an optional time budget, each failure recorded with its traceback while the rest go on,
and returns the report document (machine facts, per-family status, rows, checks)."""

from __future__ import annotations

import importlib
import math
import sys
import time
import traceback

import torch

from epkit.bench import FAMILIES
from epkit.bench.core import BenchCtx
from epkit.bench.machine import choose_threads, load_average, machine_facts, resolve_device

__all__ = ["SCHEMA", "Progress", "finish_doc", "run_bench", "run_families", "start_doc"]

#: The report document's format (``epkit bench compare`` reads only this one).
SCHEMA = "epkit-bench/1"


class Progress:
    """A progress bar on a terminal (one line, redrawn), else one line per case; silent when disabled."""

    WIDTH = 24

    def __init__(self, total: int, stream=None, enabled: bool = True):
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        """Case ``done + 1`` of ``total`` starts."""
        if not self.enabled:
            return
        self.done += 1
        filled = self.WIDTH * (self.done - 1) // max(1, self.total)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        line = f"[{bar}] {self.done}/{self.total} {time.perf_counter() - self.t0:5.0f} s  {label}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:160])
        else:
            self.stream.write(f"epkit bench {line}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            done = f"[{'#' * self.WIDTH}] {self.total}/{self.total} {time.perf_counter() - self.t0:5.0f} s  done"
            self.stream.write(("\r\033[K" if self.tty else "epkit bench ") + done + "\n")
            self.stream.flush()


def _plan(names, ctx: BenchCtx, families: dict) -> list:
    """``(family, cases)`` for each family that runs on this device; the others' status into ``families``."""
    plan = []
    for name in names:
        ctx.family = name
        try:
            fam = importlib.import_module(f"epkit.bench.{name}").FAMILY
            if ctx.device.type not in fam.devices:
                why = fam.why_not.get(ctx.device.type, f"does not run on {ctx.device.type}")
                families[name] = {"status": f"skipped: {why}"}
                continue
            plan.append((fam, fam.cases(ctx)))
        except Exception as exc:  # noqa: BLE001 - an unimportable family is reported, the others run
            families[name] = {
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
    return plan


def run_families(names, ctx: BenchCtx, *, deadline: float = math.inf, progress: Progress | None = None) -> dict:
    """Run the cases of ``names`` into ``ctx`` (its rows and checks); returns each family's status.

    Status: ``ok``; ``error`` (a case raised: ``error``/``traceback``; its other cases still ran);
    ``budget: N of M cases not run`` (``deadline``, a ``time.perf_counter()`` value, passed);
    ``skipped: <why>`` (not on this device).
    """
    families: dict[str, dict] = {}
    plan = _plan(names, ctx, families)
    progress = progress or Progress(sum(len(c) for _, c in plan), enabled=False)
    progress.total = sum(len(c) for _, c in plan)
    for fam, cases in plan:
        ctx.family = fam.name
        entry = families[fam.name] = {"status": "ok", "title": fam.title, "cases_run": 0}
        t0 = time.perf_counter()
        for i, case in enumerate(cases):
            if time.perf_counter() > deadline:
                entry["status"] = f"budget: {len(cases) - i} of {len(cases)} cases not run"
                break
            progress.step(f"{fam.name}: {case.label}")
            try:
                case.run(ctx)
                entry["cases_run"] += 1
            except Exception as exc:  # noqa: BLE001 - every failure is recorded, then the next case runs
                entry.update(status="error", error=f"{case.label}: {type(exc).__name__}: {exc}")
                entry["traceback"] = traceback.format_exc()
        entry["elapsed_s"] = round(time.perf_counter() - t0, 2)
    progress.close()
    return {name: families[name] for name in names if name in families}


def start_doc(device, names, size: str, threads: dict | None = None) -> dict:
    """The report document before its families run: schema, machine facts (load average now), what runs.

    ``threads``: :func:`~epkit.bench.machine.choose_threads`'s choice (how many threads, and why), shown above
    the table."""
    args = {"families": list(names), "device": str(device), "size": size}
    if threads is not None:
        args["threads"] = threads
    return {
        "schema": SCHEMA,
        "machine": machine_facts(device),
        "args": args,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "timing": "interleaved rounds (each round calls every contender once, seeded random order) after a "
        "warm-up; medians with min/max; ratios are medians of per-round ratios; CUDA events and an L2 flush "
        "for the GEMMs on a GPU; multi-rank figures are each round's slowest rank",
    }


def finish_doc(doc: dict, ctx: BenchCtx, families: dict, seconds: float) -> dict:
    """Add what ran (``families``, ``ctx``'s rows and checks), the load average now and the verdict ``ok``."""
    doc["families"] = families
    doc["rows"], doc["checks"] = ctx.rows, ctx.checks
    doc["machine"]["loadavg_after"] = load_average()
    doc["elapsed_s"] = round(seconds, 1)
    fine = all(f["status"] == "ok" or f["status"].startswith("skipped") for f in families.values())
    doc["ok"] = fine and all(c["ok"] for c in ctx.checks)
    return doc


def run_bench(
    names=FAMILIES,
    device: str = "cpu",
    size: str = "full",
    *,
    budget_s: float | None = None,
    progress: bool = True,
    rounds: int | None = None,
    threads: int | str | None = "auto",
) -> dict:
    """Run ``names`` on ``device`` (``cpu``, ``cuda`` or ``auto``) at ``size`` and return the report document.

    ``budget_s``: stop starting cases after that many seconds. ``threads``: torch's CPU threads meanwhile, for
    the in-process families and, at most, each spawned rank (which otherwise gets ``cores // ranks``): a number,
    ``None`` (torch's default) or ``"auto"`` (one on a machine whose load average exceeds half its cores, else
    torch's default: :func:`~epkit.bench.machine.choose_threads`); the report says which and why. Raises
    RuntimeError for ``cuda`` without a GPU.
    """
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown benchmark families {unknown}; expected some of {', '.join(FAMILIES)}")
    if threads not in (None, "auto") and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"--threads must be >= 1, got {threads}")
    dev = resolve_device(device)
    before = torch.get_num_threads()
    choice = choose_threads(threads)
    if choice["pinned"]:
        torch.set_num_threads(choice["threads"])
    try:
        t0 = time.perf_counter()
        doc = start_doc(dev, names, size, choice)  # its machine facts record torch's threads
        ctx = BenchCtx(dev, size, rounds=rounds, threads=choice["threads"] if choice["pinned"] else None)
        deadline = math.inf if budget_s is None else t0 + budget_s
        families = run_families(names, ctx, deadline=deadline, progress=Progress(0, enabled=progress))
        return finish_doc(doc, ctx, families, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
