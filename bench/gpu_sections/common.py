"""What every gpu_check section shares: the run context (device, budget, timing), BudgetExceeded, and the
helpers that record a check, compare tensors bit for bit and run a correctness pass per backend."""

from __future__ import annotations

import math
import os
import statistics
import time

import torch

from epkit.bench.timing import L2Flusher, time_calls

__all__ = [
    "BENCH",
    "ROOT",
    "BudgetExceeded",
    "Ctx",
    "backends_for",
    "bits_equal",
    "garbage_like",
    "gbps",
    "is_unavailable",
    "record_check",
    "run_backends",
]

#: ``bench/`` (gpu_check.py's folder) and the checkout above it.
BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)


class BudgetExceeded(Exception):
    """A section's time budget is spent; what it measured so far is kept."""


# Run context: device, deadlines, logging, timing


class Ctx:
    def __init__(self, device: torch.device, quick: bool, t_start: float):
        self.device = device
        self.cuda = device.type == "cuda"
        self.quick = quick
        #: ``--device cpu --quick``: a dry run of the control flow; the slowest CPU stand-ins shrink further.
        self.dry = quick and self.device.type == "cpu"
        self.t_start = t_start
        self.section = "-"
        self.deadline = math.inf
        self._flusher = L2Flusher(device)
        #: The report's path (gpu_check.py sets it): sections may write files next to it.
        self.out_path: str | None = None

    def begin(self, name: str, budget: float) -> None:
        self.section = name
        self.budget = budget
        self.deadline = time.perf_counter() + budget

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def check(self, what: str) -> None:
        """Raise BudgetExceeded when the section's budget is spent (called between steps)."""
        if time.perf_counter() > self.deadline:
            raise BudgetExceeded(f"{self.section}: budget of {self.budget:.0f} s spent before {what}")

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t_start:7.1f}s] {self.section}: {msg}", flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def flush_l2(self) -> None:
        """Overwrite 256 MiB so that the next call starts with a cold L2 (CUDA only; ``epkit bench``'s flusher)."""
        self._flusher()

    def time_op(
        self, fn, *, warmup: int = 3, iters: int = 20, flush: bool = False, min_iters: int = 3, calls: int = 1
    ) -> dict:
        """Median/min/max milliseconds per call: CUDA events on GPU, perf_counter on CPU (``epkit bench``'s
        :func:`~epkit.bench.timing.time_calls`, so that both time a call the same way).

        ``calls`` back-to-back calls per sample (divided out): the host's launch overhead then overlaps the
        GPU's work, as in a real stream. Stops early (after ``min_iters``) when the section's deadline has
        passed; ``n`` says how many samples ran, ``truncated`` whether that was fewer than ``iters``.
        """
        return time_calls(
            fn,
            self.device,
            warmup=warmup,
            iters=iters,
            flush=self.flush_l2 if flush else None,
            min_iters=min_iters,
            calls=calls,
            deadline=self.deadline,
        )

    def time_wall(self, fn, *, calls: int = 20, rounds: int = 5) -> dict:
        """Host-inclusive milliseconds per call: ``calls`` back-to-back calls then a sync, median of rounds."""
        fn()
        self.sync()
        samples = []
        for r in range(rounds):
            if r >= 1 and time.perf_counter() > self.deadline:
                break
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            self.sync()
            samples.append((time.perf_counter() - t0) / calls * 1e3)
        return {"median_ms": statistics.median(samples), "min_ms": min(samples), "n_rounds": len(samples)}


def record_check(res: dict, name: str, ok: bool, detail: str = "") -> bool:
    """Append ``{"name", "ok"[, "detail"]}`` to ``res["checks"]`` (a failure is also printed); returns ``ok``."""
    entry = {"name": name, "ok": bool(ok)}
    if detail:
        entry["detail"] = detail[:2000]
    res.setdefault("checks", []).append(entry)
    if not ok:
        print(f"    CHECK FAILED: {name}: {detail[:500]}", flush=True)
    return bool(ok)


def bits_equal(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
    """Same dtype, shape and bytes (compared on the CPU); the detail names the first differing element."""
    got, want = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
    if got.dtype != want.dtype or got.shape != want.shape:
        return False, f"got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    if got.numel() == 0:
        return True, ""
    gb = got.reshape(-1).view(torch.uint8).view(got.numel(), -1)
    wb = want.reshape(-1).view(torch.uint8).view(want.numel(), -1)
    bad = (gb != wb).any(dim=1)
    if not bool(bad.any()):
        return True, ""
    flat = int(bad.nonzero()[0])
    return False, (
        f"{int(bad.sum())} of {got.numel()} elements differ; first at flat index {flat}: "
        f"got {got.reshape(-1)[flat].item()!r}, want {want.reshape(-1)[flat].item()!r}"
    )


def garbage_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's dtype and shape filled with 0xAB bytes (so that unwritten output is visible)."""
    raw = torch.full((t.numel() * t.element_size(),), 0xAB, dtype=torch.uint8)
    return raw.view(t.dtype).view(t.shape)


def is_unavailable(exc: Exception) -> bool:
    """True for epkit's BackendUnavailableError (a backend this machine lacks), False for any other failure."""
    from epkit.backends import BackendUnavailableError

    return isinstance(exc, BackendUnavailableError)


def backends_for(ctx: Ctx, cuda: tuple[str, ...], cpu: tuple[str, ...]) -> tuple[str, ...]:
    """The backends a section exercises: ``cuda`` on a GPU run, ``cpu`` on a CPU run."""
    return cuda if ctx.cuda else cpu


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def run_backends(ctx: Ctx, res: dict, backends: tuple[str, ...], correctness, note: str = "") -> None:
    """``correctness(backend)`` for each backend in turn; ``res["backends"][backend]`` is ``"ok"``, or
    ``"unavailable: <why>"`` when epkit says the backend is missing here (any other exception propagates).

    ``note`` ends the progress line of each backend (e.g. how many cases it runs).
    """
    res["backends"] = {}
    for backend in backends:
        ctx.log(f"correctness, backend {backend}{note}")
        try:
            correctness(backend)
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            res["backends"][backend] = f"unavailable: {exc}"
            ctx.log(f"backend {backend} unavailable: {exc}")
        else:
            res["backends"][backend] = "ok"
