"""What every ``epkit bench`` family shares: the run context, a case, a family, peers and roofs, and the row.

A **row** is one contender of one case: its median time (with min/max), its throughput, the fraction of
its **roof** reached (the same work at the roof's rate: a ``copy_`` of the bytes moved, a dense matmul of
the same FLOPs; the roof's rate is its fastest sample, since a roof bounds what the machine can do and a
neighbour's load only ever slows it) and its speed against each **peer** (another implementation of the same
task: the best single torch call, the textbook implementation, the Python reference). Both ratios are
medians over the rounds (the op's round ``i`` against the peer's round ``i``, or against the roof), with
their quartiles, which ``epkit bench compare`` uses to tell a real move from noise.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from epkit.bench.timing import L2Flusher, measure, quartiles, summarize

__all__ = ["SIZES", "UNITS", "BenchCtx", "Case", "Family", "Ref", "copy_roof", "make_row", "timed_backends"]

#: Size levels: ``tiny`` (tests and the gpu_check dry run), ``quick`` (``--quick``), ``full`` (default).
SIZES = ("tiny", "quick", "full")
#: Throughput units: the work per call is counted in bytes (read + written), FLOPs or tokens.
UNITS = {"GB/s": 1e9, "TFLOP/s": 1e12, "Mtok/s": 1e6, "tok/s": 1.0}
#: Rounds per case at each size (each round calls every contender once).
ROUNDS = {"tiny": 3, "quick": 7, "full": 15}
#: 8-byte words that torch's CPU ``copy_`` copies on one thread (``at::internal::GRAIN_SIZE`` elements).
ONE_THREAD_WORDS = 32768


@dataclass
class Ref:
    """A peer or a roof timed in the same rounds: its name and milliseconds per call per round.

    ``work``: what one call of it does, in the row's unit, when that differs from the row's own work (a roof
    that copies another number of bytes); None means the same task.
    """

    name: str
    samples: list[float]
    work: float | None = None


@dataclass
class Case:
    """One measurement of a family (a shape, or a sweep run by one set of spawned ranks)."""

    label: str
    run: Callable[[BenchCtx], None]


@dataclass
class Family:
    """An op family: its name (``--only``), a one-line title, and its cases for a context.

    ``devices``: where it runs (others record why not); ``ranks``: CPU processes it spawns (0: in process).
    """

    name: str
    title: str
    cases: Callable[[BenchCtx], list[Case]]
    devices: tuple[str, ...] = ("cpu", "cuda")
    ranks: int = 0
    why_not: dict[str, str] = field(default_factory=dict)


class BenchCtx:
    """The run's device, size and rounds, and what its cases record (rows and correctness checks)."""

    def __init__(
        self, device: torch.device, size: str = "full", rounds: int | None = None, seed: int = 0, threads=None
    ):
        if size not in SIZES:
            raise ValueError(f"size must be one of {SIZES}, got {size!r}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.size = size
        self.rounds = rounds or ROUNDS[size]
        self.seed = seed
        self.threads = threads  # the run's pinned threads per rank (None: torch's default; ranks share the cores)
        self.family = "-"
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.flush_l2 = L2Flusher(self.device)

    def pick(self, tiny, quick, full):
        """The value for this run's size."""
        return {"tiny": tiny, "quick": quick, "full": full}[self.size]

    def rank_threads(self, world: int) -> int:
        """torch threads for each of ``world`` spawned ranks: the cores shared out (``cores // world``, at least
        one), and no more than the run's pinned threads (``--threads``, or ``auto`` on a loaded machine)."""
        share = max(1, (os.cpu_count() or world) // world)
        return share if self.threads is None else min(share, self.threads)

    def measure(self, fns: dict, *, flush: bool = False, calls: int = 1) -> dict[str, list[float]]:
        """:func:`epkit.bench.timing.measure` with this run's rounds (``flush``: L2 flushed before each sample)."""
        return measure(
            fns, self.device, rounds=self.rounds, flush=self.flush_l2 if flush else None, calls=calls, seed=self.seed
        )

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record a correctness check of the benchmark input (a failed one fails the run); returns ``ok``."""
        self.checks.append({"family": self.family, "name": name, "ok": bool(ok), "detail": detail[:500]})
        return bool(ok)

    def row(self, op: str, shape: str, backend: str, samples: list[float], **kw) -> dict:
        """Add :func:`make_row`'s row for this family; returns it."""
        r = make_row(self.family, op, shape, backend, samples, **kw)
        self.rows.append(r)
        return r

    def rows_of(self, times: dict[str, list[float]], backends, op: str, shape: str, **kw) -> None:
        """A row for each of ``backends`` that ``times`` holds (one that failed its check was not timed)."""
        for b in backends:
            if b in times:
                self.row(op, shape, b, times[b], **kw)


def _ratios(num: list[float], den: list[float], scale: float) -> dict:
    """Median and quartiles of ``scale * num[i] / den[i]`` over the rounds both have."""
    vals = [scale * a / b for a, b in zip(num, den) if b > 0]
    lo, hi = quartiles(vals)
    return {"median": statistics.median(vals), "q25": lo, "q75": hi}


def make_row(
    family: str,
    op: str,
    shape: str,
    backend: str,
    samples: list[float],
    *,
    work: float,
    unit: str,
    roof: Ref | None = None,
    peers: tuple[Ref, ...] | list[Ref] = (),
    note: str = "",
    sweep: dict | None = None,
) -> dict:
    """One row: the op's timing and throughput, the fraction of ``roof`` it reaches and its speed against
    each of ``peers`` (the first is the table's peer column). ``work``: what one call does, in ``unit``'s
    quantity (bytes read + written for GB/s, FLOPs, tokens); ``sweep``: the swept parameter, for the plots."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {list(UNITS)}, got {unit!r}")
    if roof is None and not peers:
        raise ValueError(f"{family}/{op}/{backend}: every row needs a roof or a peer")
    stats = summarize(samples)

    def rate(w: float, ms: float) -> float:
        return w / (ms * 1e-3) / UNITS[unit] if ms > 0 else math.inf

    row = {
        "key": f"{family}|{op}|{shape}|{backend}",
        "family": family,
        "op": op,
        "shape": shape,
        "backend": backend,
        **stats,
        "samples_ms": [round(s, 4) for s in samples],
        "work": work,
        "unit": unit,
        "throughput": rate(work, stats["median_ms"]),
        "note": note,
        "sweep": sweep or {},
        "roof": None,
        "peers": [],
    }
    if roof is not None:
        roof_work = work if roof.work is None else roof.work
        best = min(roof.samples)  # a roof bounds what the machine can do: its fastest sample, not its median
        frac = _ratios([best] * len(samples), samples, work / roof_work)  # (work / t_op) / (roof_work / t_roof)
        row["roof"] = {"name": roof.name, **summarize(roof.samples), "throughput": rate(roof_work, best), **frac}
    for p in peers:
        x = _ratios(p.samples, samples, 1.0)  # > 1: the op is faster than the peer
        row["peers"].append(
            {"name": p.name, **summarize(p.samples), "throughput": rate(work, statistics.median(p.samples)), **x}
        )
    return row


def copy_roof(traffic_bytes: int, device: torch.device) -> tuple[str, Callable[[], object]]:
    """The memory roof of an op that reads + writes ``traffic_bytes``: a preallocated ``copy_`` of half of
    them (its own read + write are that traffic). Returns its name and the call.

    The bytes are copied as 8-byte words. On a CPU with several torch threads the roof is the faster of two
    copies, chosen by timing both a few times now: one ``copy_`` (split over the threads) and the same bytes
    in slices small enough that torch copies each on one thread. A split copy waits for its threads to wake,
    which on a machine shared with other jobs costs milliseconds: for a small copy, one thread is the roof."""
    half = max(8, traffic_bytes // 2)
    src = torch.ones(-(-half // 8), dtype=torch.int64, device=device)
    dst = torch.empty_like(src)
    name = f"copy_ {_mib(8 * src.numel())} (r+w {_mib(16 * src.numel())})"

    def split():
        dst.copy_(src)

    if device.type != "cpu" or torch.get_num_threads() == 1 or src.numel() <= ONE_THREAD_WORDS:
        return name, split
    pairs = list(zip(dst.split(ONE_THREAD_WORDS), src.split(ONE_THREAD_WORDS)))

    def one_thread():
        for d, s in pairs:
            d.copy_(s)

    t = measure({"split": split, "one": one_thread}, device, rounds=5)
    return (name, split) if min(t["split"]) <= min(t["one"]) else (f"{name}, 1 thread", one_thread)


def _mib(n: int) -> str:
    if n < 2**10:
        return f"{n} B"
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB"


def timed_backends(op: str, device: torch.device) -> list[str]:
    """The backends of ``op`` worth timing on ``device``: available there, the reference left to the peers,
    and Triton on CPU tensors left out (its interpreter says nothing about kernel speed)."""
    from epkit.backends import backend_info, registered_ops

    spec = registered_ops()[op]
    names = spec.cuda if device.type == "cuda" else spec.cpu
    out = []
    for b in names:
        if b == "reference" or (b == "triton" and device.type != "cuda"):
            continue
        if backend_info(b).available_on(device.type):
            out.append(b)
    return out
