"""The facts a benchmark report carries about the machine and the code it ran: the machine kind (runs are
compared only within one), CPU model and cores, load average, GPU, package versions and the git commit; and how
many CPU threads a run uses (:func:`choose_threads`)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess

import torch

__all__ = ["choose_threads", "git_commit", "load_average", "machine_facts", "machine_kind", "resolve_device"]


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``auto`` (CUDA when torch sees a GPU); ``cuda`` without one is a RuntimeError."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
        return torch.device("cuda", torch.cuda.current_device())
    if name != "cpu":
        raise ValueError(f"device must be cpu, cuda or auto, got {name!r}")
    return torch.device("cpu")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _has_amx() -> bool:
    """The CPU reports AMX tiles (``amx_tile`` among its flags in ``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def machine_kind(device: torch.device) -> str:
    """``cpu-<cores>core`` for a CPU run (``cpu-<cores>core-amx`` on a CPU with AMX tiles, whose bf16 matmuls
    and fused grouped GEMM are another machine's), the GPU's model in lower case (``h200``) for a CUDA run."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        model = re.findall(r"\b[A-Za-z]{1,3}\d{2,4}[A-Za-z]*\b", name)
        return (model[0] if model else re.sub(r"\W+", "-", name)).lower()
    return f"cpu-{os.cpu_count()}core" + ("-amx" if _has_amx() else "")


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the OS has none."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def choose_threads(requested: int | str | None = "auto") -> dict:
    """How many torch CPU threads a run uses, and why: ``{"requested", "threads", "pinned", "why"}``.

    ``requested``: a number (``--threads N``: that many, pinned); ``None`` (torch's default, as it is now);
    ``"auto"`` (the default): one thread per rank when the 1-minute load average exceeds half the cores, since
    other jobs then hold the cores and a split op waits for its threads to wake (milliseconds on a shared
    2-core machine, which turns a 0.7 ms op into 20 ms and its ratios into noise), else torch's default.
    ``pinned``: the run sets that many threads (the spawned ranks at most that many each).
    """
    default = torch.get_num_threads()
    if requested is None:
        return {"requested": None, "threads": default, "pinned": False, "why": "torch's default"}
    if requested != "auto":
        n = int(requested)
        return {"requested": n, "threads": n, "pinned": True, "why": f"--threads {n}"}
    cores, load = os.cpu_count() or 1, load_average()
    if load is None:
        return {
            "requested": "auto",
            "threads": default,
            "pinned": False,
            "why": "auto: no load average, torch's default",
        }
    half = f"{load[0]:.2f} {{}} {cores / 2:g}, half of {cores} cores"
    if load[0] > cores / 2:
        why = f"auto: load average {half.format('>')}: other jobs share this machine"
        why += ", where an op split over threads waits for them"
        return {"requested": "auto", "threads": 1, "pinned": True, "why": why}
    why = f"auto: load average {half.format('<=')}: torch's default"
    return {"requested": "auto", "threads": default, "pinned": False, "why": why}


def git_commit(path: str | None = None) -> dict | None:
    """``{"commit", "dirty"}`` of the git checkout holding ``path`` (default: this epkit's sources), None when
    there is none (an install) or ``{"error"}`` when git cannot run.

    ``EPKIT_COMMIT`` in the environment names the commit instead: a copied tree (``bench/gpu_run.sh`` on a
    lent GPU machine) may carry no ``.git``, or a stale one whose HEAD is not the commit of its files; git's own
    answer is kept as ``git_reported``.
    """
    here = path or os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        found = {"commit": head.stdout.strip(), "dirty": bool(dirty)} if head.returncode == 0 else None
    except (OSError, subprocess.SubprocessError) as exc:
        found = {"error": str(exc)}
    if os.environ.get("EPKIT_COMMIT"):
        return {"commit": os.environ["EPKIT_COMMIT"], "source": "EPKIT_COMMIT", "git_reported": found}
    return found


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_facts(device: torch.device) -> dict:
    """Everything the report says about where it ran (the load average is taken again at the end)."""
    gpu = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        gpu = {"name": p.name, "capability": f"sm_{p.major}{p.minor}", "sms": p.multi_processor_count}
    return {
        "kind": machine_kind(device),
        "device": str(device),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": gpu,
        "versions": {d: _version(d) for d in ("epkit", "torch", "triton", "tilelang", "numpy")},
        "git": git_commit(),
        "loadavg_before": load_average(),
    }
