"""Rung 4 of the verification ladder: every GPU correctness check and microbenchmark of epkit in one script.

Run on a machine with one CUDA GPU (an H200 for the figures the project quotes)::

    python bench/gpu_check.py                      # all sections, ~5-7 minutes, bench/results/gpu_check.json
    python bench/gpu_check.py --quick              # smaller shapes, same checks
    python bench/gpu_check.py --sections env,grouped_gemm --out /tmp/g.json

and on a CPU-only machine as a dry run of the control flow (what CI does)::

    python bench/gpu_check.py --device cpu --quick --out /tmp/dry.json

Sections (default order): ``env``, ``gather_rows``, ``logical_to_physical``, ``prepare_cp_mirror``,
``engram_hash``, ``grouped_gemm``, ``nvshmem``; ``--sections`` runs the ones it names in its order.
Each one runs inside its own try/except with its own time budget (scaled by ``--budget``, or fixed by
``--section-budget``): a failing or slow section records its status, its traceback and what it
measured so far, and the next section still runs. A watchdog thread interrupts a section
that overruns its budget by far, and writes the JSON and exits if it stays stuck (a hung kernel).
The JSON is rewritten after every section, so a run killed from outside keeps the sections it finished.

Section status: ``ok``; ``fail`` (a correctness check disagreed; see ``checks``); ``error`` (a Python
exception; see ``error`` and ``traceback``); ``budget_exceeded`` (stopped early; partial results kept);
``hung`` (interrupted by the watchdog); ``skipped: <reason>`` (e.g. ``skipped: no CUDA``).

Timing: CUDA events around each call after warm-up, median of N (CPU: ``time.perf_counter``); the
GEMMs flush L2 between calls. Every figure is paired with a peer or roof measured in the same run:
``torch.index_select`` and a device-to-device copy for the gathers, ``torch.matmul`` in bf16 at equal
FLOPs (and dense ``torch._scaled_mm`` FP8 where torch has it) for the grouped GEMMs, a device copy for
the NVSHMEM loopback put and the SymmBuffer(nvshmem) loopback exchange. The nvshmem section also runs
SymmBuffer(nvshmem) with its memory from torch's NVSHMEM symmetric memory, in a child process (torch
must start that process's NVSHMEM job); where torch lacks NVSHMEM it records why. Exit status: 0 when every
section is ok or skipped, 1 otherwise.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: Seconds per section at ``--budget 450`` (they sum to it); scaled linearly with ``--budget``, except
#: the sections given a fixed ``--section-budget`` (the others then share what is left).
BUDGETS = {
    "env": 15,
    "gather_rows": 70,
    "logical_to_physical": 35,
    "prepare_cp_mirror": 50,
    "engram_hash": 50,
    "grouped_gemm": 140,
    "nvshmem": 90,
}
SECTIONS = tuple(BUDGETS)
DEFAULT_TOTAL = sum(BUDGETS.values())

#: DeepGEMM's published H800 FP8 figure for contiguous grouped GEMM, 4 groups x 8192 rows, N=4096, K=7168.
DEEPGEMM_H800_TFLOPS = 1346.0
#: calc_diff thresholds against a float32 matmul of the unquantized inputs (as tests/test_grouped_gemm.py).
GEMM_THRESH = {"fp8": 1e-3, "fp8_fp4": 1e-2, "bf16": 1e-5}


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
        self._flush_buf = None

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
        """Overwrite 256 MiB so that the next call starts with a cold L2 (CUDA only)."""
        if not self.cuda:
            return
        if self._flush_buf is None:
            self._flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=self.device)
        self._flush_buf.zero_()

    def time_op(
        self, fn, *, warmup: int = 3, iters: int = 20, flush: bool = False, min_iters: int = 3, calls: int = 1
    ) -> dict:
        """Median/min/max milliseconds per call: CUDA events on GPU, perf_counter on CPU.

        ``calls`` back-to-back calls per sample (divided out): the host's launch overhead then overlaps the
        GPU's work, as in a real stream. Stops early (after ``min_iters``) when the section's deadline has
        passed; ``n`` says how many samples ran.
        """
        for _ in range(warmup):
            fn()
        self.sync()
        samples = []
        for i in range(iters):
            if i >= min_iters and time.perf_counter() > self.deadline:
                break
            if flush:
                self.flush_l2()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples.append((time.perf_counter() - t0) * 1e3 / calls)
        return {
            "median_ms": statistics.median(samples),
            "min_ms": min(samples),
            "max_ms": max(samples),
            "n": len(samples),
            "truncated": len(samples) < iters,
        }

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


def _check(res: dict, name: str, ok: bool, detail: str = "") -> bool:
    entry = {"name": name, "ok": bool(ok)}
    if detail:
        entry["detail"] = detail[:2000]
    res.setdefault("checks", []).append(entry)
    if not ok:
        print(f"    CHECK FAILED: {name}: {detail[:500]}", flush=True)
    return bool(ok)


def _bits_equal(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
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


def _garbage_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's dtype and shape filled with 0xAB bytes (so that unwritten output is visible)."""
    raw = torch.full((t.numel() * t.element_size(),), 0xAB, dtype=torch.uint8)
    return raw.view(t.dtype).view(t.shape)


def _unavailable(exc: Exception) -> bool:
    from epkit.backends import BackendUnavailableError

    return isinstance(exc, BackendUnavailableError)


def _backends(ctx: Ctx, cuda: tuple[str, ...], cpu: tuple[str, ...]) -> tuple[str, ...]:
    return cuda if ctx.cuda else cpu


def _gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


# Section: env


def sec_env(ctx: Ctx, res: dict):
    def version(dist: str):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    res["python"] = platform.python_version()
    res["platform"] = platform.platform()
    res["packages"] = {
        p: version(p)
        for p in ("torch", "triton", "tilelang", "numpy", "epkit", "nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13")
    }
    res["torch_cuda"] = torch.version.cuda
    res["cpu"] = {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "machine": platform.machine()}
    try:
        commit = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        res["git"] = {"commit": commit or None, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError) as exc:
        res["git"] = {"error": str(exc)}
    if os.environ.get("EPKIT_COMMIT"):
        # A copied tree (a lent GPU machine) may carry no .git, or a stale one (the H200 copy's said f3fc33b
        # while its files were 650623a): the commit the caller says it sent wins, and git's answer is kept.
        seen = res["git"]
        res["git"] = {"commit": os.environ["EPKIT_COMMIT"], "source": "EPKIT_COMMIT", "git_reported": seen}
    from epkit.cli import collect_info

    info = collect_info()
    res["backends"] = info["backends"]
    res["transports"] = info["transports"]
    res["c_extension"] = info["c_extension"]
    try:
        import epkit._C_cuda  # noqa: F401

        res["c_cuda_extension"] = "importable"
    except ImportError as exc:
        res["c_cuda_extension"] = f"not importable: {exc}"
    res["device"] = str(ctx.device)
    if not ctx.cuda:
        res["gpu"] = None
        res["summary"] = f"CPU dry run on {platform.machine()}, torch {torch.__version__}"
        return None
    props = torch.cuda.get_device_properties(ctx.device)
    gpu = {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "total_memory_GiB": round(props.total_memory / 2**30, 1),
        "l2_cache_MiB": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
    }
    gpu["clocks"] = _clocks(ctx)
    res["gpu"] = gpu
    res["summary"] = f"{props.name} (sm_{props.major}{props.minor}), torch {torch.__version__}"
    return None


def _clocks(ctx: Ctx) -> dict:
    """SM / memory clocks now and at most, via NVML (nvidia-ml-py) or nvidia-smi; {} with a reason if neither."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(ctx.device.index or 0)
            return {
                "source": "nvml",
                "sm_MHz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "sm_max_MHz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                "mem_MHz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                "mem_max_MHz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM),
                "driver": str(pynvml.nvmlSystemGetDriverVersion()),
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - any NVML failure falls back to nvidia-smi
        nvml_err = f"{type(exc).__name__}: {exc}"
    try:
        q = "clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,driver_version"
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits", "-i", str(ctx.device.index or 0)],
            capture_output=True,
            text=True,
            timeout=15,
        ).stdout.strip()
        vals = [v.strip() for v in out.split(",")]
        if len(vals) == 5:
            keys = ("sm_MHz", "sm_max_MHz", "mem_MHz", "mem_max_MHz", "driver")
            return {"source": "nvidia-smi", **dict(zip(keys, vals, strict=True))}
        return {"unavailable": f"nvml: {nvml_err}; nvidia-smi printed {out!r}"}
    except (OSError, subprocess.SubprocessError) as exc:
        return {"unavailable": f"nvml: {nvml_err}; nvidia-smi: {exc}"}


# Section: gather_rows


def sec_gather_rows(ctx: Ctx, res: dict):
    from epkit.gather import gather_rows, gather_rows_reference

    dev = ctx.device
    g = torch.Generator().manual_seed(0)

    def rand_rows(n: int, row: tuple, dtype: torch.dtype) -> torch.Tensor:
        nbytes = n * math.prod(row) * torch.empty((), dtype=dtype).element_size()
        return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype).view(n, *row)

    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
    dtypes.append(torch.int64)
    cases = []  # (label, x_cpu, index_cpu)
    for dt in dtypes[:4] if ctx.dry else dtypes:
        n = 257
        idx = torch.randint(-1, n, (300,), generator=g, dtype=torch.int32)
        cases.append((f"{dt} [257, 96] int32 index", rand_rows(n, (96,), dt), idx))
    for dt in (torch.bfloat16, torch.float8_e4m3fn):  # odd row bytes: 2- and 1-byte words
        idx = torch.randint(-1, 33, (50,), generator=g, dtype=torch.int64)
        cases.append((f"{dt} [33, 7] int64 index", rand_rows(33, (7,), dt), idx))
    cases.append(("bf16 [64, 4, 8] 3-D rows", rand_rows(64, (4, 8), torch.bfloat16), torch.arange(63, -2, -1)))
    cases.append(("empty index", rand_rows(5, (16,), torch.float32), torch.empty(0, dtype=torch.int32)))

    res["backends"] = {}
    for backend in _backends(ctx, ("triton", "tilelang"), ("cpu", "tilelang", "triton")):
        ctx.check(f"correctness[{backend}]")
        ctx.log(f"correctness, backend {backend} ({len(cases)} cases)")
        try:
            for label, x, idx in cases:
                want = gather_rows_reference(x, idx)
                got = gather_rows(x.to(dev), idx.to(dev), backend=backend)
                ok, detail = _bits_equal(got, want)
                _check(res, f"{backend}: {label}", ok, detail)
                out = _garbage_like(want).to(dev)
                gather_rows(x.to(dev), idx.to(dev), out, backend=backend)
                ok, detail = _bits_equal(out, want)
                _check(res, f"{backend}: {label} (out=)", ok, detail)
            res["backends"][backend] = "ok"
        except Exception as exc:
            if not _unavailable(exc):
                raise
            res["backends"][backend] = f"unavailable: {exc}"
            ctx.log(f"backend {backend} unavailable: {exc}")

    # Bandwidth: a random permutation of bf16 rows against torch.index_select and the copy roof.
    rows, hidden = (65536, 7168) if not ctx.quick else ((16384, 7168) if ctx.cuda else (8192, 512))
    ctx.check("bandwidth")
    ctx.log(f"bandwidth at {rows} x {hidden} bf16")
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=dev)
    idx = torch.randperm(rows, device=dev).to(torch.int32)
    out = torch.empty_like(x)
    ref = torch.index_select(x, 0, idx)
    xbytes = x.numel() * x.element_size()
    moved = 2 * xbytes + idx.numel() * 4
    perf = res["bandwidth"] = {"shape": [rows, hidden], "dtype": "bfloat16", "bytes_moved_per_call": moved}
    iters = 20 if ctx.cuda else 5
    calls = 5 if ctx.cuda else 1  # back to back: launch overhead overlaps the previous call, for every party
    perf["calls_per_sample"] = calls
    t_sel = ctx.time_op(lambda: torch.index_select(x, 0, idx, out=out), iters=iters, calls=calls)
    t_clone = ctx.time_op(lambda: x.clone(), iters=iters, calls=calls)
    t_copy = ctx.time_op(lambda: out.copy_(x), iters=iters, calls=calls)
    perf["torch.index_select"] = {**t_sel, "GBps": _gbps(moved, t_sel["median_ms"])}
    perf["roof_clone"] = {**t_clone, "GBps": _gbps(2 * xbytes, t_clone["median_ms"])}
    perf["roof_copy_"] = {**t_copy, "GBps": _gbps(2 * xbytes, t_copy["median_ms"])}
    roof = perf["roof_clone"]["GBps"]
    timed = _backends(ctx, ("triton", "tilelang"), ("cpu", "tilelang"))
    for backend in timed:
        if not res["backends"].get(backend, "").startswith("ok"):
            continue
        ctx.check(f"bandwidth[{backend}]")
        out.zero_()
        gather_rows(x, idx, out, backend=backend, check_index=False)
        _check(res, f"{backend}: {rows} x {hidden} permutation equals torch.index_select", torch.equal(out, ref))
        t = ctx.time_op(
            lambda b=backend: gather_rows(x, idx, out, backend=b, check_index=False), iters=iters, calls=calls
        )
        gbps = _gbps(moved, t["median_ms"])
        perf[backend] = {
            **t,
            "GBps": gbps,
            "speedup_vs_index_select": t_sel["median_ms"] / t["median_ms"],
            "fraction_of_clone_roof": gbps / roof,
            "fraction_of_copy__roof": gbps / perf["roof_copy_"]["GBps"],
        }
        ctx.log(f"{backend}: {gbps:.0f} GB/s ({gbps / roof:.0%} of clone roof {roof:.0f} GB/s)")
    best = [
        f"{b} {perf[b]['GBps']:.0f} GB/s ({perf[b]['fraction_of_clone_roof']:.0%} roof)" for b in timed if b in perf
    ]
    res["summary"] = "; ".join(best) + f"; index_select {perf['torch.index_select']['GBps']:.0f} GB/s"
    return None


# Section: logical_to_physical


def sec_logical_to_physical(ctx: Ctx, res: dict):
    from epkit.experts import (
        ExpertPlacement,
        logical_to_physical,
        logical_to_physical_cpu,
        logical_to_physical_reference,
    )

    dev = ctx.device
    g = torch.Generator().manual_seed(3)
    phy2log = torch.cat([torch.arange(12), torch.randint(0, 12, (6,), generator=g)])
    small = ExpertPlacement.from_phy2log(phy2log[torch.randperm(18, generator=g)], num_logical=12, ep_size=6)
    big_phy = torch.cat([torch.arange(384), torch.randint(0, 384, (64,), generator=g)])
    big = ExpertPlacement.from_phy2log(big_phy[torch.randperm(448, generator=g)], num_logical=384, ep_size=64)
    tokens = 512 if ctx.dry else 4096
    cases = [
        ("12 experts EP6", small, torch.randint(-1, 12, (41, 4), generator=g, dtype=torch.int32), range(6), (0, 7)),
        (
            f"384 experts EP64 {tokens}x6",
            big,
            torch.randint(-1, 384, (tokens, 6), generator=g, dtype=torch.int64),
            (0, 5, 63),
            (0, 12345),
        ),
    ]
    res["backends"] = {}
    for backend in _backends(ctx, ("triton",), ("cpu", "triton")):
        ctx.log(f"correctness, backend {backend}")
        try:
            for label, placement, topk, ranks, offsets in cases:
                pd, td = placement.to(dev), topk.to(dev)
                for rank in ranks:
                    for off in offsets:
                        ctx.check(f"correctness[{backend}] {label} rank {rank}")
                        want = logical_to_physical_reference(topk, placement, rank, off)
                        got = logical_to_physical(td, pd, rank, token_offset=off, backend=backend)
                        ok, detail = _bits_equal(got, want)
                        _check(res, f"{backend}: {label} ep_rank={rank} token_offset={off}", ok, detail)
            res["backends"][backend] = "ok"
        except Exception as exc:
            if not _unavailable(exc):
                raise
            res["backends"][backend] = f"unavailable: {exc}"

    # Latency at the bench sizes (bench_eplb.py: 4096 x 6; experts._bench_main: 16384 x 6), 384 experts EP64.
    placement = ExpertPlacement.default(384, 64, 1).to(dev)
    backend = "triton" if ctx.cuda else "cpu"
    lat = res["latency"] = {}
    if res["backends"].get(backend) == "ok":
        it, calls = (5, 3) if ctx.dry else (30, 20)
        for n in (4096,) if ctx.dry else (4096, 16384):
            ctx.check(f"latency {n}x6")
            topk = torch.randint(0, 384, (n, 6), dtype=torch.int32, device=dev)
            fn = lambda t=topk: logical_to_physical(t, placement, 5, backend=backend, check_index=False)  # noqa: E731
            peer = lambda t=topk: logical_to_physical_cpu(t, placement, 5, 0)  # noqa: E731
            ok = torch.equal(fn(), peer())
            _check(res, f"{backend}: {n}x6 equals the vectorised torch path on {dev.type}", ok)
            lat[f"{n}x6"] = {
                backend: {"events_one_call": ctx.time_op(fn, iters=it), "wall": ctx.time_wall(fn, calls=calls)},
                "torch_vectorised_same_device": {
                    "events_one_call": ctx.time_op(peer, iters=it),
                    "wall": ctx.time_wall(peer, calls=calls),
                },
            }
            e = lat[f"{n}x6"]
            e["speedup_wall_vs_torch"] = (
                e["torch_vectorised_same_device"]["wall"]["median_ms"] / e[backend]["wall"]["median_ms"]
            )
            ctx.log(f"{n}x6: {e[backend]['wall']['median_ms'] * 1e3:.1f} us/call wall ({backend})")
    if lat:
        e = lat["16384x6"] if "16384x6" in lat else next(iter(lat.values()))
        res["summary"] = (
            f"{backend} {e[backend]['wall']['median_ms'] * 1e3:.1f} us/call wall, "
            f"{e['speedup_wall_vs_torch']:.1f}x vectorised torch"
        )
    return None


# Section: prepare_cp_mirror


def sec_prepare_cp_mirror(ctx: Ctx, res: dict):
    from epkit.cp_mirror import mirrors_equal, prepare_cp_mirror, prepare_cp_mirror_reference, random_batch

    dev = ctx.device
    ratios = (1, 4, 128)
    fixed = (
        torch.tensor([0, 5, 5, 6, 40, 43], dtype=torch.int32),
        torch.tensor([0, 9, 12, 13, 60, 63], dtype=torch.int32),
    )
    cases = [
        ("6 seqs incl. empty", *fixed, (1, 2, 4, 8), None),
        ("9 seqs / 700", *random_batch(9, 700, 100, 1), (4,), None),
    ]
    big_seqs, big_q = (64, 131072) if not ctx.quick else (16, 16384)
    big = random_batch(big_seqs, big_q, 4096, seed=0)
    cases.append((f"{big_seqs} seqs / {big_q}", *big, (8,), (0, 3, 7)))
    res["backends"] = {}
    for backend in _backends(ctx, ("triton", "tilelang"), ("cpu", "tilelang", "triton")):
        ctx.log(f"correctness, backend {backend}")
        try:
            for label, cu_q, cu_k, cp_sizes, ranks in cases:
                if backend == "triton" and not ctx.cuda and cu_q[-1] > 1000:
                    continue  # the interpreter is for small inputs
                if backend == "triton" and ctx.dry:
                    cp_sizes = cp_sizes[:2]
                for cp in cp_sizes:
                    for rank in ranks if ranks is not None else range(cp):
                        ctx.check(f"correctness[{backend}] {label} cp={cp} rank={rank}")
                        want = prepare_cp_mirror_reference(cu_q, cu_k, cp, rank, ratios)
                        got = prepare_cp_mirror(cu_q.to(dev), cu_k.to(dev), cp, rank, ratios, backend=backend)
                        diff = mirrors_equal(got, want)
                        _check(res, f"{backend}: {label} cp={cp} rank={rank}", diff is None, diff or "")
            res["backends"][backend] = "ok"
        except Exception as exc:
            if not _unavailable(exc):
                raise
            res["backends"][backend] = f"unavailable: {exc}"

    # Latency at bench_cp_mirror.py's shape: 64 seqs, 131072 tokens, max prefix 4096, cp 8, ratios (1, 4, 128).
    cu_q, cu_k = big[0].to(dev), big[1].to(dev)
    lat = res["latency"] = {
        "shape": {"num_seqs": big_seqs, "total_q": big_q, "cp_size": 8, "cp_rank": 3, "ratios": list(ratios)}
    }
    timed = _backends(ctx, ("triton", "tilelang"), ("cpu", "tilelang"))
    for backend in timed:
        if res["backends"].get(backend) != "ok":
            continue
        ctx.check(f"latency[{backend}]")
        fn = lambda b=backend: prepare_cp_mirror(cu_q, cu_k, 8, 3, ratios, backend=b)  # noqa: E731
        lat[backend] = {"wall": ctx.time_wall(fn, calls=5), "events_one_call": ctx.time_op(fn, iters=10)}
        ctx.log(f"{backend}: {lat[backend]['wall']['median_ms']:.3f} ms/call wall")
    if ctx.cuda:  # the CPU backend on host tensors, same run, as the peer
        ctx.check("latency[cpu peer]")
        cq, ck = big
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            prepare_cp_mirror(cq, ck, 8, 3, ratios, backend="cpu")
            samples.append((time.perf_counter() - t0) * 1e3)
        lat["cpu_backend_on_host"] = {"wall": {"median_ms": statistics.median(samples[1:]), "n_rounds": 4}}
    res["summary"] = ", ".join(f"{b} {lat[b]['wall']['median_ms']:.3f} ms/call" for b in timed if b in lat)
    return None


# Section: engram_hash


def sec_engram_hash(ctx: Ctx, res: dict):
    from epkit.engram import EngramConfig, engram_hash, engram_hash_reference, hash_params, selfcheck_config

    dev = ctx.device
    g = torch.Generator().manual_seed(5)
    small_cfg = selfcheck_config()
    demo = EngramConfig(vocab_size=129280)  # demo defaults: N=3, K=8, layers (1, 15)
    n_big = (1 << 20) if not ctx.quick else ((1 << 18) if ctx.cuda else (1 << 14))

    def ids_for(cfg: EngramConfig, n: int) -> torch.Tensor:
        ids = torch.randint(0, cfg.vocab_size, (n, cfg.max_ngram_size), generator=g, dtype=torch.int32)
        ids[:2] = torch.tensor([0, cfg.vocab_size - 1], dtype=torch.int32)[:, None]  # extremes
        return ids

    cases = [("selfcheck config, 97 tokens", small_cfg, ids_for(small_cfg, 97))]
    cases.append(("demo config, 4096 tokens", demo, ids_for(demo, 4096)))
    cases.append((f"demo config, {n_big} tokens", demo, ids_for(demo, n_big)))
    res["backends"] = {}
    for backend in _backends(ctx, ("triton", "tilelang"), ("tilelang", "cpu", "triton")):
        ctx.log(f"correctness, backend {backend}")
        try:
            for label, cfg, ids in cases:
                if backend == "triton" and not ctx.cuda and ids.shape[0] > 100:
                    continue  # the interpreter is for small inputs
                ctx.check(f"correctness[{backend}] {label}")
                params = hash_params(cfg)
                want = engram_hash_reference(ids, *params)
                got = engram_hash(ids.to(dev), *(p.to(dev) for p in params), backend=backend)
                ok, detail = _bits_equal(got, want)
                _check(res, f"{backend}: {label}", ok, detail)
            res["backends"][backend] = "ok"
        except Exception as exc:
            if not _unavailable(exc):
                raise
            res["backends"][backend] = f"unavailable: {exc}"

    # Throughput at bench_engram.py's shape (1,048,576 tokens, N=3, K=8, L=2) against the copy roof.
    mult, vocab, off = (t.to(dev) for t in hash_params(demo))
    ids = cases[-1][2].to(dev)
    out = torch.empty((demo.num_layers, n_big, demo.num_heads), dtype=torch.int32, device=dev)
    moved = ids.numel() * 4 + out.numel() * 4
    buf = torch.ones(moved, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(buf)
    ctx.check("throughput")
    roof = ctx.time_op(lambda: dst.copy_(buf), iters=10)
    perf = res["throughput"] = {
        "tokens": n_big,
        "bytes_moved_per_call": moved,
        "roof_copy_same_bytes": {**roof, "GBps": _gbps(2 * moved, roof["median_ms"])},
    }
    roof_gbps = perf["roof_copy_same_bytes"]["GBps"]  # read + write counted, as the hash's traffic is
    timed = _backends(ctx, ("triton", "tilelang"), ("tilelang", "cpu"))
    for backend in timed:
        if res["backends"].get(backend) != "ok":
            continue
        ctx.check(f"throughput[{backend}]")
        t = ctx.time_op(lambda b=backend: engram_hash(ids, mult, vocab, off, out, backend=b), iters=10)
        perf[backend] = {
            **t,
            "GBps": _gbps(moved, t["median_ms"]),
            "Mtokens_per_s": n_big / (t["median_ms"] * 1e-3) / 1e6,
            "fraction_of_copy_roof": _gbps(moved, t["median_ms"]) / roof_gbps,
            "timed": "the public op: validation reads the tables back to the host (3 syncs per call)",
        }
        if ctx.cuda and backend == "triton":
            # The kernel alone, its tables prepared once as the op prepares them: the device-side figure.
            from epkit.engram import _kernel_tables
            from epkit.kernels.triton.engram import engram_hash_tokens

            args = (ids.contiguous(), mult.contiguous(), *_kernel_tables(vocab, off))
            want = out.clone()  # the op's result from the timing above
            out.zero_()
            engram_hash_tokens(*args, out)
            _check(res, "the Triton kernel alone gives the op's result", torch.equal(out, want))
            k = ctx.time_op(lambda a=args: engram_hash_tokens(*a, out), iters=10)
            perf["triton_kernel"] = {
                **k,
                "GBps": _gbps(moved, k["median_ms"]),
                "fraction_of_copy_roof": _gbps(moved, k["median_ms"]) / roof_gbps,
            }
        ctx.log(f"{backend}: {t['median_ms']:.3f} ms ({perf[backend]['fraction_of_copy_roof']:.0%} of copy roof)")
    res["summary"] = ", ".join(
        f"{b} {perf[b]['median_ms']:.3f} ms ({perf[b]['fraction_of_copy_roof']:.0%} roof)"
        for b in (*timed, "triton_kernel")
        if b in perf
    )
    return None


# Section: grouped_gemm


def _group_ref(af: torch.Tensor, bf: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 ``af[i] @ bf[ids[i]].T`` group by group (zeros for ids -1), on af's device."""
    out = torch.zeros(af.shape[0], bf.shape[1], dtype=torch.float32, device=af.device)
    for grp in range(bf.shape[0]):
        sel = ids == grp
        if bool(sel.any()):
            out[sel] = af[sel].float() @ bf[grp].float().T
    return out


def sec_grouped_gemm(ctx: Ctx, res: dict):
    import epkit.grouped_gemm as gemm
    from epkit.testing import calc_diff

    dev = ctx.device
    backend = "triton" if ctx.cuda else "cpu"
    res["backend"] = backend
    kinds = ("fp8", "fp8_fp4", "bf16")
    shapes = [(256, 512), (512, 256), (384, 1024)] if not ctx.dry else [(256, 512)]
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 references must be float32
    try:
        # Correctness: contiguous (random rows per group incl. 0, padding rows exactly zero) and masked
        # (masked_m incl. 0 and M_max, rows beyond untouched), against float32 of the unquantized inputs.
        for kind in kinds:
            contig = getattr(gemm, f"m_grouped_{kind}_gemm_nt_contiguous")
            masked = getattr(gemm, f"m_grouped_{kind}_gemm_nt_masked")
            for n, k in shapes:
                ctx.check(f"correctness {kind} contiguous {n}x{k}")
                gen = torch.Generator().manual_seed(n + k)
                counts = torch.randint(0, 150, (4,), generator=gen)
                counts[1] = 0
                m_indices = gemm.build_m_indices(counts)
                m = m_indices.numel()
                a, b, af, bf = gemm.make_inputs(kind, 4, m, n, k, masked=False, seed=n + k)
                to = (lambda t: tuple(x.to(dev) for x in t)) if kind != "bf16" else (lambda t: t.to(dev))
                d = torch.full((m, n), 7.0, dtype=torch.bfloat16, device=dev)
                contig(to(a), to(b), d, m_indices.to(dev), backend=backend)
                d = d.cpu()
                ctx_s = f"{kind} contiguous G=4 counts={counts.tolist()} N={n} K={k}"
                pad = m_indices < 0
                _check(res, ctx_s + ": padding rows are zero", bool((d[pad] == 0).all()))
                diff = calc_diff(d.float(), _group_ref(af, bf, m_indices))
                ok = math.isfinite(diff) and diff <= GEMM_THRESH[kind] and bool(torch.isfinite(d.float()).all())
                _check(res, ctx_s + f": calc_diff {diff:.2e} <= {GEMM_THRESH[kind]:.0e}", ok, f"calc_diff={diff}")
            ctx.check(f"correctness {kind} masked")
            m_max, (n, k) = 96, shapes[0]
            a, b, af, bf = gemm.make_inputs(kind, 4, m_max, n, k, masked=True, seed=17)
            masked_m = torch.tensor([m_max, 0, 37, 95], dtype=torch.int32)
            to = (lambda t: tuple(x.to(dev) for x in t)) if kind != "bf16" else (lambda t: t.to(dev))
            d = torch.full((4, m_max, n), -3.0, dtype=torch.float32, device=dev)
            masked(to(a), to(b), d, masked_m.to(dev), m_max, backend=backend)
            d = d.cpu()
            live = torch.arange(m_max)[None, :] < masked_m[:, None].long()
            ref = torch.einsum("gmk,gnk->gmn", af.float(), bf.float())
            ctx_s = f"{kind} masked G=4 M_max={m_max} masked_m={masked_m.tolist()} N={n} K={k}"
            _check(res, ctx_s + ": rows beyond masked_m untouched", bool((d[~live] == -3.0).all()))
            diff = calc_diff(d[live], ref[live])
            ok = math.isfinite(diff) and diff <= GEMM_THRESH[kind]
            _check(res, ctx_s + f": calc_diff {diff:.2e} <= {GEMM_THRESH[kind]:.0e}", ok, f"calc_diff={diff}")
        ctx.log(f"correctness done ({len(res.get('checks', []))} checks)")

        # TFLOP/s at DeepGEMM's published shapes, FP8 x FP8 (1x128 activation, 128x128 weight scales), bf16 out.
        if ctx.cuda:
            rows_c, rows_m = (8192, (1024, 512, 256)) if not ctx.quick else (2048, (256, 128, 64))
            contig_shapes = [(4, rows_c, 4096, 7168), (4, rows_c, 7168, 2048)]
            masked_shapes = [(1, rows_m[0], 4096, 7168), (2, rows_m[1], 4096, 7168), (4, rows_m[2], 4096, 7168)]
        else:
            contig_shapes = [(4, 128, 256, 512), (4, 128, 512, 256)]
            masked_shapes = [(1, 128, 256, 512), (2, 64, 256, 512), (4, 32, 256, 512)]
        iters = 15 if not ctx.quick else 5
        perf = {}
        res["perf"] = perf
        for layout, shape_list in (("contiguous", contig_shapes), ("masked", masked_shapes)):
            for grp, rows, n, k in shape_list:
                name = f"{layout} {grp}x{rows} N={n} K={k}"
                ctx.check(f"perf {name}")
                entry = _gemm_perf(ctx, res, gemm, layout, grp, rows, n, k, backend, iters)
                perf[name] = entry
                ctx.log(
                    f"{name}: {entry['epkit_fp8']['TFLOPs']:.1f} TFLOP/s "
                    f"({entry['fraction_of_bf16_roof']:.0%} of torch bf16 "
                    f"{entry['torch_matmul_bf16_roof']['TFLOPs']:.1f})"
                )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    first = next(iter(res["perf"].values()), None)
    if first is not None:
        res["summary"] = (
            f"{next(iter(res['perf']))}: {first['epkit_fp8']['TFLOPs']:.1f} TFLOP/s, "
            f"{first['fraction_of_bf16_roof']:.0%} of torch bf16"
            + (
                f", {first['fraction_of_deepgemm_h800']:.0%} of DeepGEMM H800"
                if "fraction_of_deepgemm_h800" in first
                else ""
            )
        )
    return None


def _gemm_perf(ctx: Ctx, res: dict, gemm, layout: str, grp: int, rows: int, n: int, k: int, backend: str, iters: int):
    """TFLOP/s of one FP8 grouped GEMM shape (all groups full) with its same-run peers and an accuracy check."""
    from epkit.quant import per_block_cast_to_fp8, per_token_group_cast_to_fp8
    from epkit.testing import calc_diff

    dev = ctx.device
    name = f"{layout} {grp}x{rows} N={n} K={k}"
    torch.manual_seed(grp * rows + n)
    m = grp * rows
    x = torch.randn((m, k) if layout == "contiguous" else (grp, rows, k), device=dev)
    w = torch.randn(grp, n, k, device=dev) / k**0.5
    a, b = per_token_group_cast_to_fp8(x), per_block_cast_to_fp8(w)
    d = torch.empty((m, n) if layout == "contiguous" else (grp, rows, n), dtype=torch.bfloat16, device=dev)
    if layout == "contiguous":
        m_indices = gemm.build_m_indices([rows] * grp, device=dev)

        def fn():
            gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, backend=backend)
    else:
        masked_m = torch.full((grp,), rows, dtype=torch.int32, device=dev)

        def fn():
            gemm.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, rows, backend=backend)

    fn()
    ids = torch.arange(grp, device=dev).repeat_interleave(rows)
    diff = calc_diff(d.reshape(m, n).float(), _group_ref(x.reshape(m, k), w, ids))
    del x
    _check(res, f"perf shape {name}: calc_diff {diff:.2e} <= 1e-3", diff <= 1e-3, f"calc_diff={diff}")
    flops = 2.0 * m * n * k
    entry = {"groups": grp, "rows_per_group": rows, "n": n, "k": k, "flops": flops, "calc_diff": diff}
    kernel = _gemm_kernel_call(ctx, backend, layout, a, b, d, m_indices if layout == "contiguous" else masked_m, rows)
    if kernel is not None:
        # The kernel alone (its tile schedule built once), as the peers are timed: the public op also
        # validates its inputs on the host, which syncs and leaves the GPU idle inside the timed window.
        want = d.clone()
        d.zero_()
        kernel()
        _check(res, f"perf shape {name}: the kernel alone gives the op's result", torch.equal(d, want))
        t = ctx.time_op(kernel, iters=iters, flush=True, warmup=2)
        t_op = ctx.time_op(fn, iters=iters, flush=True, warmup=1)
        entry["epkit_fp8_op"] = {**t_op, "TFLOPs": flops / (t_op["median_ms"] * 1e-3) / 1e12}
    else:
        t = ctx.time_op(fn, iters=iters, flush=True, warmup=2)
    entry["epkit_fp8"] = {**t, "TFLOPs": flops / (t["median_ms"] * 1e-3) / 1e12}
    entry["epkit_fp8"]["timed"] = "the Triton kernel launch" if kernel is not None else "the public op"
    a16, b16 = a[0].reshape(m, k).to(torch.bfloat16), w[0].to(torch.bfloat16)
    tb = ctx.time_op(lambda: torch.matmul(a16, b16.T), iters=iters, flush=True, warmup=2)
    entry["torch_matmul_bf16_roof"] = {**tb, "TFLOPs": flops / (tb["median_ms"] * 1e-3) / 1e12}
    entry["fraction_of_bf16_roof"] = entry["epkit_fp8"]["TFLOPs"] / entry["torch_matmul_bf16_roof"]["TFLOPs"]
    sm = _scaled_mm_peer(ctx, a[0].reshape(m, k), b[0][0], flops, iters)
    entry["torch_scaled_mm_fp8"] = sm
    if isinstance(sm, dict):
        entry["fraction_of_scaled_mm"] = entry["epkit_fp8"]["TFLOPs"] / sm["TFLOPs"]
    if layout == "contiguous" and (grp, rows, n, k) == (4, 8192, 4096, 7168):
        entry["deepgemm_h800_TFLOPs"] = DEEPGEMM_H800_TFLOPS
        entry["fraction_of_deepgemm_h800"] = entry["epkit_fp8"]["TFLOPs"] / DEEPGEMM_H800_TFLOPS
        entry["meets_first_milestone_0.6"] = entry["fraction_of_deepgemm_h800"] >= 0.6
    return entry


def _gemm_kernel_call(ctx: Ctx, backend: str, layout: str, a, b, d, groups, rows: int):
    """On CUDA with the Triton backend: the FP8 grouped GEMM's launch, with everything the op derives from
    its inputs (config, tile schedule, contiguous operands) done once; None otherwise."""
    if not ctx.cuda or backend != "triton":
        return None
    from epkit.kernels.triton import grouped_gemm as tg

    (a8, sfa), (b8, sfb) = a, b
    if layout == "contiguous":
        return tg.contiguous_launcher("fp8", a8, sfa, b8, sfb, d, groups)
    return tg.masked_launcher("fp8", a8, sfa, b8, sfb, d, groups, rows)


def _scaled_mm_peer(ctx: Ctx, a8: torch.Tensor, b8: torch.Tensor, flops: float, iters: int):
    """Dense ``torch._scaled_mm`` FP8 (per-tensor scales, bf16 out) at equal FLOPs, or why it is unavailable."""
    if not hasattr(torch, "_scaled_mm"):
        return "unavailable: this torch has no torch._scaled_mm"
    if not ctx.cuda:
        return "skipped on CPU: torch._scaled_mm has no fast CPU kernel (seconds per call)"
    one = torch.ones((), dtype=torch.float32, device=a8.device)
    bt = b8.t()  # [K, N] column-major, as cuBLASLt wants

    def fn():
        return torch._scaled_mm(a8, bt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - an unsupported device/dtype is a fact to record, not a failure
        return f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    t = ctx.time_op(fn, iters=iters, flush=True, warmup=2)
    return {**t, "TFLOPs": flops / (t["median_ms"] * 1e-3) / 1e12}


# Section: nvshmem


class _DevicePtr:
    """A raw device pointer as a ``__cuda_array_interface__`` (so torch can view NVSHMEM memory)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _one_host_nvshmem_env() -> None:
    """One PE on one GPU: no network transport (no InfiniBand probing), bootstrap over loopback."""
    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")


#: Share of the nvshmem section's budget for epkit's own job; the torch provider's child gets the rest.
NVSHMEM_EPKIT_SHARE = 0.6


def sec_nvshmem(ctx: Ctx, res: dict):
    """NVSHMEM checks, each job in a child process of its own.

    NVSHMEM ends the process on most of its failures (``exit()`` in the library), and a process holds one
    job. So epkit's own job (``--nvshmem-child``) and the one torch starts (``--torch-provider-child``) run in
    children; the JSON keeps what a child reported before it died, and the next sections still run.
    """
    try:
        import epkit._C_cuda  # noqa: F401 - the children use it; loading it starts nothing
    except ImportError as exc:
        res["c_cuda_extension"] = f"not importable: {exc}"
        if not ctx.cuda:
            return "no CUDA"
        # On a GPU this section is the collectives' evidence: a missing extension is a failure, not a skip.
        raise RuntimeError(
            f"epkit._C_cuda not importable ({exc}); build it with nvcc + nvidia-nvshmem (EPKIT_CUDA=1)"
        ) from None
    res["c_cuda_extension"] = "importable"
    if not ctx.cuda:
        return "no CUDA"
    budget = max(20.0, ctx.remaining() * NVSHMEM_EPKIT_SHARE)
    ctx.log(f"epkit's NVSHMEM job (child process, budget {budget:.0f} s)")
    child = _run_child(
        ["--nvshmem-child", f"{budget:.1f}", "quick" if ctx.quick else "full"], budget + 30.0, json_file=True
    )
    res.update(child["result"])
    res["child_exit"] = child["exit"]
    if child["exit"] != 0:
        _check(res, "epkit's NVSHMEM child exited normally", False, child["detail"])
    _torch_provider(ctx, res)  # last, in a fresh process: torch must start that process's NVSHMEM job
    status = child["result"].get("child_status", "no report")
    if status == "budget_exceeded":
        raise BudgetExceeded(child["result"].get("error", "nvshmem child: budget spent"))
    if status != "ok":
        raise RuntimeError(f"nvshmem child: {child['result'].get('error') or status} (its traceback: child_traceback)")
    return None


def _run_child(args: list[str], limit: float, json_file: bool = False) -> dict:
    """Run this script with ``args`` in a child process for at most ``limit`` seconds.

    Its progress lines go to this process's stdout. Returns ``{"exit", "detail", "result"}``: ``result`` is
    the dict the child left in its JSON file (``json_file``: the path is the argument after ``args``;
    rewritten at every step, so a child that died keeps what it reported), else its last JSON stdout line.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="epkit-gpu-check-") as tmp:
        path = os.path.join(tmp, "child.json")
        cmd = [sys.executable, os.path.abspath(__file__), *args] + ([path] if json_file else [])
        out = {"exit": None, "detail": "", "result": {}}
        try:
            proc = subprocess.run(
                cmd, stdout=None if json_file else subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=limit
            )
            out["exit"], stdout, stderr = proc.returncode, proc.stdout or "", proc.stderr or ""
        except subprocess.TimeoutExpired as exc:

            def text(b):  # TimeoutExpired carries bytes even in text mode
                return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

            out["exit"], stdout, stderr = "timeout", text(exc.stdout), text(exc.stderr)
            out["detail"] = f"killed after {limit:.0f} s. "
        if out["exit"] != 0:
            out["detail"] += f"exit {out['exit']}; stderr tail: {stderr[-3000:]}"
        if json_file:
            with contextlib.suppress(OSError, ValueError), open(path) as f:
                out["result"] = json.load(f)
        else:
            for line in stdout.splitlines():
                if not line.startswith("{"):
                    print(f"  (child) {line}", flush=True)
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            with contextlib.suppress(ValueError, IndexError):
                out["result"] = json.loads(lines[-1])
    return out


class _ChildCtx(Ctx):
    """A child's context: every step boundary also saves the child's results so far to its JSON file."""

    def __init__(self, path: str, res: dict, quick: bool):
        super().__init__(torch.device("cuda", 0), quick, time.perf_counter())
        self.path, self.res = path, res

    def save(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.res, f, default=str)
        os.replace(tmp, self.path)

    def check(self, what: str) -> None:
        self.save()
        super().check(what)


def _nvshmem_child(budget: float, quick: bool, path: str) -> int:
    """Body of ``--nvshmem-child``: epkit's own single-PE NVSHMEM job; results in the JSON file ``path``."""
    res: dict = {}
    ctx = _ChildCtx(path, res, quick)
    torch.cuda.set_device(0)
    ctx.begin("nvshmem", budget)
    try:
        _nvshmem_epkit(ctx, res)
        res["child_status"] = "ok"
    except BudgetExceeded as exc:
        res["child_status"], res["error"] = "budget_exceeded", str(exc)
    except Exception as exc:  # noqa: BLE001 - reported through the file
        res["child_status"], res["error"] = "error", f"{type(exc).__name__}: {exc}"
        res["child_traceback"] = traceback.format_exc()
        print(res["child_traceback"], flush=True)
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()
    ctx.save()
    sys.stdout.flush()
    os._exit(0)  # what NVSHMEM and torch do at exit can crash after the results are safe


def _nvshmem_epkit(ctx: Ctx, res: dict) -> None:
    import epkit._C_cuda as cc

    nbytes = (256 << 20) if not ctx.quick else (64 << 20)
    res["nbytes"] = nbytes
    stream = torch.cuda.current_stream().cuda_stream
    _one_host_nvshmem_env()
    res["nvshmem_env"] = {k: v for k, v in os.environ.items() if k.startswith("NVSHMEM_")}
    ctx.log("nvshmem init (single PE, unique-id bootstrap)")
    t0 = time.perf_counter()
    cc.init(cc.get_unique_id(), 0, 1)
    res["init_s"] = time.perf_counter() - t0
    try:
        _check(res, "my_pe() == 0 and n_pes() == 1", cc.my_pe() == 0 and cc.n_pes() == 1, f"{cc.my_pe()}/{cc.n_pes()}")
        buf = cc.malloc(nbytes + 64)
        try:
            _check(res, "peer_ptr(buf, 0) == buf", cc.peer_ptr(buf, 0) == buf)
            sig = buf + nbytes  # nvshmem_malloc zero-fills: the signal word starts at 0
            try:
                data = torch.as_tensor(_DevicePtr(buf, nbytes), device=ctx.device)
            except Exception as exc:  # noqa: BLE001 - without a view the data check is skipped, not the section
                data = None
                res["data_view"] = f"unavailable: {type(exc).__name__}: {exc}"
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=ctx.device)
            result = torch.zeros(2, dtype=torch.int64, device=ctx.device)
            ctx.check("put_signal")
            cc.put_signal(buf, src.data_ptr(), nbytes, sig, 7, "set", 0, stream)
            cc.signal_wait(sig, ">=", 7, 5.0, result.data_ptr(), stream)
            torch.cuda.synchronize()
            _check(
                res,
                "signal_wait after put_signal(set 7): [7, not timed out]",
                result.tolist() == [7, 0],
                str(result.tolist()),
            )
            if data is not None:
                _check(res, f"loopback put of {nbytes >> 20} MiB lands bit-exact", torch.equal(data, src))
            cc.put_signal(buf, src.data_ptr(), 0, sig, 5, "add", 0, stream)
            cc.signal_wait(sig, "==", 12, 5.0, result.data_ptr(), stream)
            torch.cuda.synchronize()
            _check(res, "signal op add: 7 + 5 == 12", result.tolist() == [12, 0], str(result.tolist()))
            # A wait that cannot be satisfied must time out after ~timeout, and say so.
            ctx.check("timed signal_wait")
            t0 = time.perf_counter()
            cc.signal_wait(sig, ">", 1 << 40, 0.05, result.data_ptr(), stream)
            torch.cuda.synchronize()
            waited = time.perf_counter() - t0
            res["timeout_wait_s"] = waited
            _check(
                res,
                "signal_wait(> 2**40, timeout 50 ms) reports a timeout",
                result.tolist() == [12, 1],
                str(result.tolist()),
            )
            _check(res, "the timed-out wait returned within 0.03-2 s", 0.03 <= waited <= 2.0, f"{waited:.3f} s")
            ctx.check("signal_wait_all: strided words, abort mask, sticky word")
            _wait_all_checks(cc, res, sig, stream, ctx.device)
            # Loopback bandwidth against the device copy roof (same bytes, same run).
            ctx.check("bandwidth")
            counter = [12]

            def put():
                counter[0] += 1
                cc.put_signal(buf, src.data_ptr(), nbytes, sig, counter[0], "set", 0, stream)

            t_put = ctx.time_op(put, iters=10, warmup=2)
            cc.signal_wait(sig, "==", counter[0], 5.0, result.data_ptr(), stream)
            torch.cuda.synchronize()
            _check(res, "last timed put's signal observed", result.tolist() == [counter[0], 0], str(result.tolist()))
            t_wait = ctx.time_op(
                lambda: cc.signal_wait(sig, "==", counter[0], 5.0, result.data_ptr(), stream), iters=20
            )
            dst = torch.empty_like(src)
            t_copy = ctx.time_op(lambda: dst.copy_(src), iters=10, warmup=2)
            res["put_signal"] = {**t_put, "GBps_one_way": _gbps(nbytes, t_put["median_ms"])}
            res["signal_wait_satisfied"] = t_wait
            res["roof_device_copy"] = {**t_copy, "GBps_one_way": _gbps(nbytes, t_copy["median_ms"])}
            frac = t_copy["median_ms"] / t_put["median_ms"]
            res["fraction_of_copy_roof"] = frac
            res["summary"] = (
                f"put_signal loopback {res['put_signal']['GBps_one_way']:.0f} GB/s one-way, "
                f"{frac:.0%} of device copy {res['roof_device_copy']['GBps_one_way']:.0f} GB/s"
            )
            ctx.log(res["summary"])
        finally:
            torch.cuda.synchronize()
            cc.free(buf)
        ctx.check("SymmBuffer loopback")
        _symm_loopback(ctx, res)
    finally:
        cc.finalize()


def _wait_all_checks(cc, res: dict, sig: int, stream: int, device) -> None:
    """signal_wait_all on words 1-3 after ``sig`` (zero; abort words 4-6): success, a notice in an abort word,
    the sticky skip, and a wait that must not be skipped."""
    mask64, notice = (1 << 64) - 1, (1 << 63) | 5
    result = torch.zeros(2, dtype=torch.int64, device=device)
    sticky = torch.zeros(1, dtype=torch.int64, device=device)
    words = [sig + 8 * k for k in range(8)]

    def wait_all(count, value, abort_words, skip=True):
        cc.signal_wait_all(
            words[1], 1, count, ">=", value, 5.0, result.data_ptr(), stream, sticky.data_ptr(), abort_words, skip
        )
        torch.cuda.synchronize()
        return [v & mask64 for v in result.tolist()]

    cc.signal_op(words[1], 3, "set", 0, stream)
    cc.signal_op(words[2], 4, "set", 0, stream)
    got = wait_all(2, 3, 3)
    _check(res, "signal_wait_all over 2 words: [last value 4, ok]", got == [4, 0], str(got))
    cc.signal_op(words[6], notice, "set", 0, stream)  # word 3's abort word
    t0 = time.perf_counter()
    got = wait_all(3, 3, 3)
    waited = time.perf_counter() - t0
    _check(
        res,
        "abort word: a notice ends the wait on word 3 at once as its failure",
        got == [notice, 3] and sticky.item() == 1 and waited < 1.0,
        f"{got}, sticky {sticky.item()}, {waited:.3f} s",
    )
    got = wait_all(1, 0, 0)
    _check(res, "a wait behind a failed one returns at once on the sticky word", got == [0, mask64], str(got))
    got = wait_all(1, 3, 0, skip=False)
    _check(res, "skip_on_sticky=False: the wait still runs", got == [3, 0], str(got))
    _guard_checks(cc, res, words[7], sticky, stream, device)


def _guard_checks(cc, res: dict, word: int, sticky: torch.Tensor, stream: int, device) -> None:
    """The sticky word (set above by the failed wait) as a guard: a guarded signal and a guarded row copy do
    nothing, and with a clear guard both happen."""
    from epkit.collectives._nvshmem import device_view
    from epkit.kernels.triton.copy_rows import copy_rows_by_address

    clear = torch.zeros(1, dtype=torch.int64, device=device)
    cell = device_view(word, 8, device).view(torch.int64)
    cc.signal_op(word, 9, "set", 0, stream, sticky.data_ptr())
    torch.cuda.synchronize()
    _check(res, "guarded signal_op behind a failed wait sets nothing", cell.item() == 0, str(cell.item()))
    src = torch.arange(256, dtype=torch.uint8, device=device).view(2, 128)
    dst = torch.zeros_like(src)
    d = dst.data_ptr() + torch.arange(2, device=device) * 128
    s = src.data_ptr() + torch.arange(2, device=device) * 128
    copy_rows_by_address(d, s, 128, 8, guard=sticky)
    torch.cuda.synchronize()
    _check(res, "guarded row copy behind a failed wait writes nothing", not bool(dst.any()))
    copy_rows_by_address(d, s, 128, 8, guard=clear)
    cc.signal_op(word, 11, "set", 0, stream, clear.data_ptr())
    torch.cuda.synchronize()
    _check(res, "row copy with a clear guard copies every byte", torch.equal(dst, src))
    _check(res, "signal_op with a clear guard sets the word", cell.item() == 11, str(cell.item()))


def _torch_provider(ctx: Ctx, res: dict) -> None:
    """SymmBuffer(nvshmem) with its memory from torch's NVSHMEM symmetric memory, in a child process.

    NVSHMEM is one job per process and epkit's own job ran in another child, so the torch provider runs in a
    fresh process (``--torch-provider-child``) where torch starts the job and epkit attaches to it.
    """
    limit = ctx.remaining() + 10.0
    if limit < 30.0:
        res["torch_provider"] = {"status": f"not run: {ctx.remaining():.0f} s of the section's budget left"}
        return
    ctx.log(f"SymmBuffer/EPBuffer(nvshmem) through torch's symmetric memory (child process, up to {limit:.0f} s)")
    child = _run_child(["--torch-provider-child", f"{max(10.0, limit - 40.0):.1f}"], limit)
    out = child["result"]
    res["torch_provider"] = out
    res["torch_provider_exit"] = child["exit"]
    if child["exit"] != 0:
        _check(res, "torch provider child exited normally", False, child["detail"])
    if not out:
        _check(res, "torch provider child reported its results", False, child["detail"] or "no JSON line")
        return
    if out.get("torch_symm_reason"):
        out["status"] = f"not run: {out['torch_symm_reason']}"
        return
    _check(res, "torch provider: SymmBuffer took torch's memory", out.get("provider") == "torch", out.get("note", ""))
    _check(res, "torch provider: signal set 5 + add 3 seen as 8", out.get("signal") == 8, str(out.get("signal")))
    _check(res, "torch provider: 16 MiB exchange to self bit-exact", out.get("exchange") is True)
    timeout_msg = out.get("timeout", "")
    _check(res, "torch provider: timed-out wait raises", "did not satisfy" in timeout_msg, timeout_msg)
    for check in out.get("ep_checks", []):  # EPBuffer's loopback checks, on torch's memory
        _check(res, f"torch provider: {check['name']}", check["ok"], check.get("detail", ""))
    if out.get("ep_error"):
        _check(res, "torch provider: EPBuffer(nvshmem) loopback ran", False, out["ep_error"])


def _torch_provider_child(ep_budget: float) -> int:
    """Body of ``--torch-provider-child``: one JSON line on stdout (the EPBuffer loopback gets ``ep_budget`` s)."""
    import tempfile

    import torch.distributed as dist

    from epkit.collectives import _nvshmem
    from epkit.collectives.symm_buffer import SymmBuffer

    _one_host_nvshmem_env()
    os.environ["EPKIT_NVSHMEM_PROVIDER"] = "torch"
    out: dict = {"torch_symm_reason": _nvshmem.torch_symm_reason()}
    if out["torch_symm_reason"] is None:
        torch.cuda.set_device(0)
        tmp = tempfile.TemporaryDirectory(prefix="epkit-gpu-check-torch-")
        store = dist.FileStore(os.path.join(tmp.name, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        nbytes = 16 << 20
        from epkit.backends import BackendUnavailableError

        try:
            buf = SymmBuffer(dist.group.WORLD, nbytes, transport="nvshmem", num_signals=2, timeout=10.0)
        except BackendUnavailableError as exc:  # e.g. a one-rank job, which torch's rendezvous refuses
            out["torch_symm_reason"] = str(exc)
            print(json.dumps(out, default=str), flush=True)
            os._exit(0)
        out.update(provider=buf.nvshmem_provider, note=buf.nvshmem_note)
        buf.signal(0, 0, 5, op="set")
        buf.signal(0, 0, 3, op="add")
        out["signal"] = buf.wait_until(0, "==", 8, timeout=5.0)
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        ex = buf.exchange(nbytes, tag="loopback")
        ex.send_region(0).copy_(data)
        ex.commit(0, nbytes)
        out["exchange"] = bool(torch.equal(ex.receive([nbytes])[0], data))
        ex.release()
        try:
            buf.wait_until(1, ">", 0, timeout=0.05)
            out["timeout"] = "no TimeoutError"
        except TimeoutError as exc:
            out["timeout"] = str(exc)
        buf.close()
        ctx = Ctx(torch.device("cuda", 0), True, time.perf_counter())
        ctx.begin("torch_provider", ep_budget)
        ep: dict = {}
        try:
            _ep_loopback(ctx, ep)
        except Exception:  # noqa: BLE001 -- reported to the parent as a failed check
            import traceback

            ep["error"] = traceback.format_exc()[-2000:]
        out.update(ep_checks=ep.get("checks", []), ep_error=ep.get("error"))
        dist.destroy_process_group()
        tmp.cleanup()
    print(json.dumps(out, default=str), flush=True)
    os._exit(0)  # torch's NVSHMEM teardown at exit can crash after the result is out


def _symm_loopback(ctx: Ctx, res: dict) -> None:
    """SymmBuffer(transport="nvshmem") over a group of one, adopting the section's NVSHMEM job.

    Signals, a timed-out wait, a barrier, exchange round trips of 64 MiB to itself (bit-exact over two
    epochs), then the time per exchange against a device copy of the same bytes (host-inclusive both).
    """
    import tempfile

    import torch.distributed as dist

    from epkit.collectives.symm_buffer import SymmBuffer

    nbytes = 64 << 20
    out: dict = {"nbytes": nbytes}
    res["symm_buffer"] = out
    if dist.is_initialized():
        out["status"] = "not run: torch.distributed is already initialised in this process"
        return
    tmp = tempfile.TemporaryDirectory(prefix="epkit-gpu-check-")
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp.name, "store"), 1), rank=0, world_size=1)
    try:
        ctx.log("SymmBuffer(nvshmem) world 1")
        buf = SymmBuffer(dist.group.WORLD, nbytes, transport="nvshmem", num_signals=4, timeout=10.0)
        try:
            loc = buf.local
            _check(
                res,
                "SymmBuffer(nvshmem): local is a CUDA uint8 view of num_bytes; peer(0) aliases it",
                loc.is_cuda
                and loc.dtype == torch.uint8
                and loc.numel() == nbytes
                and buf.peer(0).data_ptr() == loc.data_ptr()
                and buf.is_within_domain(),
                f"{loc.device} {loc.dtype} {loc.numel()}",
            )
            buf.signal(0, 0, 5, op="set")
            buf.signal(0, 0, 3, op="add")
            seen = buf.wait_until(0, "==", 8, timeout=5.0)
            _check(res, "SymmBuffer signal set 5 + add 3: wait_until(== 8)", seen == 8, str(seen))
            t0 = time.perf_counter()
            try:
                buf.wait_until(1, ">", 0, timeout=0.05)
                msg = "no TimeoutError"
            except TimeoutError as exc:
                msg = str(exc)
            out["timeout_wait_s"] = time.perf_counter() - t0
            _check(
                res,
                "SymmBuffer wait_until that cannot hold raises TimeoutError naming the word",
                "signal word 1 did not satisfy > 0 within 0.05 s" in msg,
                msg,
            )
            buf.barrier()
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=ctx.device)

            def exchange(data: torch.Tensor) -> bool | None:
                ex = buf.exchange(nbytes, tag="loopback")
                ex.send_region(0).copy_(data)
                ex.commit(0, nbytes)
                got = ex.receive([nbytes])[0]
                ok = torch.equal(got, data) if data is not src else None
                ex.release()
                return ok

            for epoch, data in enumerate((src.flip(0), 255 - src), start=1):
                _check(res, f"SymmBuffer exchange to self, epoch {epoch}: 64 MiB bit-exact", exchange(data))
            ctx.check("SymmBuffer exchange timing")
            t_ex = ctx.time_wall(lambda: exchange(src), calls=5, rounds=5)
            dst = torch.empty_like(src)
            t_copy = ctx.time_wall(lambda: dst.copy_(src), calls=5, rounds=5)
            out["exchange"] = {**t_ex, "GBps_one_way": _gbps(nbytes, t_ex["median_ms"])}
            out["roof_device_copy"] = {**t_copy, "GBps_one_way": _gbps(nbytes, t_copy["median_ms"])}
            out["fraction_of_copy_roof"] = t_copy["median_ms"] / t_ex["median_ms"]
            line = (
                f"SymmBuffer exchange {t_ex['median_ms']:.3f} ms per 64 MiB, "
                f"{out['fraction_of_copy_roof']:.0%} of device copy"
            )
            res["summary"] = f"{res['summary']}; {line}" if res.get("summary") else line
            ctx.log(line)
        finally:
            with contextlib.suppress(Exception):  # a failure above is the one to report
                buf.close()
        try:
            _ep_loopback(ctx, res)
        except Exception:  # noqa: BLE001 - recorded as a failed check; the SymmBuffer results above stand
            import traceback

            _check(res, "EPBuffer(nvshmem) loopback ran", False, traceback.format_exc())
    finally:
        dist.destroy_process_group()
        tmp.cleanup()


def _ep_loopback(ctx: Ctx, res: dict) -> None:
    """EPBuffer(transport="nvshmem") on the group of one: dispatch/combine (plain and expanded) and the
    low-latency pair on CUDA tensors, bit for bit against the CPU reference exchange; time per call."""
    import torch.distributed as dist

    from epkit.collectives.ep_buffer import EPBuffer
    from epkit.collectives.ep_reference import (
        reference_combine,
        reference_dispatch,
        reference_low_latency_combine,
        reference_low_latency_dispatch,
    )

    hidden, experts, topk, tokens, n_ll = 2048, 16, 4, 1024, 128
    out: dict = {"hidden": hidden, "experts": experts, "topk": topk, "tokens": tokens, "ll_tokens": n_ll}
    res["ep_buffer"] = out
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    idx[torch.rand(idx.shape, generator=g) < 0.1] = -1
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w = torch.rand(tokens, topk, generator=g)
    dev = ctx.device
    ctx.log("EPBuffer(nvshmem) world 1")
    buf = EPBuffer(
        dist.group.WORLD,
        hidden,
        experts,
        tokens,
        topk,
        transport="nvshmem",
        num_max_dispatch_tokens_per_rank=n_ll,
        timeout=10.0,
    )
    try:
        for expand, align in ((False, 1), (True, 128)):
            recv, _, _, _, handle = buf.dispatch(
                x.to(dev), idx.to(dev), w.to(dev), expert_alignment=align, expand=expand
            )
            ref = reference_dispatch(x, idx, w, experts, expand=expand, expert_alignment=align)
            rows = ref["expanded_x"] if expand else ref["recv_x"]
            _check(res, f"EPBuffer(nvshmem) dispatch expand={expand}: rows bit-exact", torch.equal(recv.cpu(), rows))
            y = (rows.float() * 0.5 + 1).to(torch.bfloat16)
            got = buf.combine(y.to(dev), handle)
            want = reference_combine(y, ref, tokens, expand=expand)
            _check(res, f"EPBuffer(nvshmem) combine expand={expand}: bit-exact", torch.equal(got.cpu(), want))
        xd, idd, wd = x.to(dev), idx.to(dev), w.to(dev)

        def normal():
            r, _, _, _, h = buf.dispatch(xd, idd, wd)
            return buf.combine(r, h)

        out["dispatch_combine"] = ctx.time_wall(normal, calls=3, rounds=5)
        xl, il, wl = x[:n_ll], idx[:n_ll], w[:n_ll]
        recv, cnt, h, _ = buf.low_latency_dispatch(xl.to(dev), il.to(dev), n_ll, use_fp8=False)
        ref = reference_low_latency_dispatch(xl, il, n_ll, experts, use_fp8=False)
        ok = cnt.cpu().tolist() == ref["counts"] and all(
            torch.equal(recv[e, :c].cpu(), ref["recv_x"][e]) for e, c in enumerate(ref["counts"])
        )
        _check(res, "EPBuffer(nvshmem) low-latency dispatch: counts and rows bit-exact", ok)
        y = torch.zeros_like(recv)
        y_ref = []
        for e, c in enumerate(ref["counts"]):
            y[e, :c] = (recv[e, :c].float() * 2 - 1).to(torch.bfloat16)
            y_ref.append(y[e, :c].cpu())
        got = buf.low_latency_combine(y, il.to(dev), wl.to(dev), h)
        want = reference_low_latency_combine(y_ref, il, wl, ref)
        _check(res, "EPBuffer(nvshmem) low-latency combine: bit-exact", torch.equal(got.cpu(), want))
        xld, ild, wld = xl.to(dev), il.to(dev), wl.to(dev)

        def low_latency():
            r, _, hh, _ = buf.low_latency_dispatch(xld, ild, n_ll, use_fp8=False)
            return buf.low_latency_combine(r, ild, wld, hh)

        out["low_latency"] = ctx.time_wall(low_latency, calls=3, rounds=5)
        buf.synchronize()  # raises what the stream-ordered calls' deferred checks found
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call inside raises
        try:
            low_latency()
            sync_msg = ""
        except RuntimeError as exc:
            sync_msg = str(exc)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        buf.synchronize()
        _check(res, "EPBuffer(nvshmem) low-latency dispatch+combine: no synchronizing call", not sync_msg, sync_msg)
        _no_device_to_host_copy(res, low_latency, buf)
        try:
            ctx.check("fused_moe")
            _fused_moe_check(ctx, res, buf, xd, idd, wd)
        except BudgetExceeded as exc:  # the loopback's own checks above stand; say what did not run
            res.setdefault("fused_moe", {})["status"] = f"not finished: {exc}"
        ctx.log(
            f"EPBuffer(nvshmem) world 1: dispatch+combine {out['dispatch_combine']['median_ms']:.2f} ms "
            f"({tokens} tokens), low-latency {out['low_latency']['median_ms']:.2f} ms ({n_ll} tokens)"
        )
    finally:
        with contextlib.suppress(Exception):  # a failure above is the one to report
            buf.buffer.close()


def _fused_moe_check(ctx: Ctx, res: dict, buf, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
    """fused_moe on ``buf`` (FP8 experts) against dispatch(expand) -> expert_mlp -> combine: bit for bit, and
    the time of each (host-inclusive, back to back)."""
    from epkit.collectives.ep_buffer import EPBuffer
    from epkit.collectives.fused_moe import fused_moe
    from epkit.moe import expert_mlp
    from epkit.quant import per_block_cast_to_fp8

    hidden, inter, local = buf.hidden, 256, buf.num_local_experts
    g = torch.Generator().manual_seed(5)
    w13 = per_block_cast_to_fp8((torch.randn(local, 2 * inter, hidden, generator=g) / hidden**0.5).to(x.device))
    w2 = per_block_cast_to_fp8((torch.randn(local, hidden, inter, generator=g) / inter**0.5).to(x.device))
    shared = (x.float() * 0.25).to(torch.bfloat16)  # stands in for the shared expert's output

    def composed():
        recv, _, _, _, handle = buf.dispatch(x, idx, w, expand=True, expert_alignment=128)
        y = expert_mlp(recv, "contiguous", w13, w2, m_indices=EPBuffer.m_indices(handle))
        return buf.combine(y, handle, bias=shared)

    def fused():
        return fused_moe(x, idx, w, w13, w2, buf, bias=shared, expert_alignment=128)

    want, got = composed(), fused()
    ok, detail = _bits_equal(got, want)
    _check(res, f"fused_moe on {buf.transport} equals dispatch -> expert_mlp -> combine bit for bit", ok, detail)
    # Both paths share the expert MLP: equal outputs must also be the experts' work, not the bias alone.
    moved = (got != shared).any(dim=1).float().mean().item()
    finite = bool(torch.isfinite(got.float()).all())
    _check(
        res,
        "fused_moe output is finite and differs from the bias on >= 90% of tokens",
        finite and moved >= 0.9,
        f"finite={finite}, tokens changed by the experts: {moved:.1%}",
    )
    out = res.setdefault("fused_moe", {"tokens": x.shape[0], "hidden": hidden, "inter": inter, "experts": local})
    ctx.check("fused_moe timing")  # in a child this also saves the checks above
    if ctx.remaining() < 15:
        out["status"] = f"timing skipped: {ctx.remaining():.0f} s of the budget left"
        return
    out["composed"] = ctx.time_wall(composed, calls=3, rounds=3)
    out["fused"] = ctx.time_wall(fused, calls=3, rounds=3)
    out["speedup_vs_composed"] = out["composed"]["median_ms"] / out["fused"]["median_ms"]
    ctx.log(f"fused_moe {out['fused']['median_ms']:.2f} ms, composed {out['composed']['median_ms']:.2f} ms")


def _no_device_to_host_copy(res: dict, call, buf) -> None:
    """The low-latency pair under the CUDA profiler: no device-to-host memcpy at all (its status words reach
    the host through a kernel's stores into pinned memory)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()]
    except Exception as exc:  # noqa: BLE001 - no CUPTI: say so instead of failing the section
        res["ll_device_to_host_copies"] = f"not measured: profiler unavailable ({type(exc).__name__}: {exc})"
        return
    buf.synchronize()
    d2h = [n for n in names if "DtoH" in n or "Device -> Pinned" in n or "Device -> Pageable" in n]
    res["ll_device_to_host_copies"] = d2h
    _check(
        res,
        "EPBuffer(nvshmem) low-latency dispatch+combine: no device-to-host memcpy (CUDA profiler)",
        not d2h and len(names) > 0,  # (an empty trace would prove nothing)
        f"{len(d2h)} device-to-host copies: {d2h[:4]}; {len(names)} events",
    )


SECTION_FUNCS = {
    "env": sec_env,
    "gather_rows": sec_gather_rows,
    "logical_to_physical": sec_logical_to_physical,
    "prepare_cp_mirror": sec_prepare_cp_mirror,
    "engram_hash": sec_engram_hash,
    "grouped_gemm": sec_grouped_gemm,
    "nvshmem": sec_nvshmem,
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
        help="JSON path (default bench/results/gpu_check.json on CUDA, bench/results/gpu_check_cpu.json on CPU)",
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
        return _torch_provider_child(float(argv[1]) if len(argv) > 1 else 80.0)
    if argv[:1] == ["--nvshmem-child"] and len(argv) == 4:
        return _nvshmem_child(float(argv[1]), argv[2] == "quick", argv[3])
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    out = args.out or os.path.join(HERE, "results", "gpu_check.json" if device.type == "cuda" else "gpu_check_cpu.json")
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
