"""gpu_check section ``env``: versions, the checkout's commit, epkit's backends and transports, the GPU and
its clocks (``gpu`` is None on a CPU run)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess

import torch

from epkit.bench.machine import git_commit
from gpu_sections.common import ROOT, Ctx

__all__ = ["sec_env"]


def sec_env(ctx: Ctx, res: dict):
    res["python"] = platform.python_version()
    res["platform"] = platform.platform()
    res["packages"] = {
        p: _version(p)
        for p in ("torch", "triton", "tilelang", "numpy", "epkit", "nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13")
    }
    res["torch_cuda"] = torch.version.cuda
    res["cpu"] = {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "machine": platform.machine()}
    res["git"] = git_commit(ROOT)
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


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
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
