"""gpu_check section ``nvshmem``, the parent's side: it runs each NVSHMEM job in a child process of
``gpu_check.py`` and folds what the child reported into the section's results.

The children's bodies: ``nvshmem_child`` (``--nvshmem-child``: epkit's own single-PE job, with
``nvshmem_symm``'s SymmBuffer and ``nvshmem_ep``'s EPBuffer loopbacks on it) and ``nvshmem_symm``
(``--torch-provider-child``: SymmBuffer and EPBuffer on torch's NVSHMEM symmetric memory).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile

from gpu_sections.common import BENCH, BudgetExceeded, Ctx, record_check

__all__ = [
    "NVSHMEM_EPKIT_SHARE",
    "SCRIPT",
    "device_view",
    "one_host_nvshmem_env",
    "run_child",
    "sec_nvshmem",
    "torch_symm_reason",
]

#: The script a child runs (with a child mode's arguments); read at each call, so a test can point it elsewhere.
SCRIPT = os.path.join(BENCH, "gpu_check.py")

#: Share of the nvshmem section's budget for epkit's own job; the torch provider's child gets the rest.
NVSHMEM_EPKIT_SHARE = 0.6


# epkit's NVSHMEM job helpers: these two functions are the only place gpu_check imports their module (lazily,
# so that loading gpu_check loads no epkit).


def device_view(addr: int, nbytes: int, device):
    """A uint8 torch view of ``nbytes`` of NVSHMEM memory at device address ``addr`` (epkit's own helper)."""
    from epkit.collectives.transports.nvshmem_job import device_view as view

    return view(addr, nbytes, device)


def torch_symm_reason() -> str | None:
    """Why torch's NVSHMEM symmetric memory cannot serve here, or None when it can (epkit's own helper)."""
    from epkit.collectives.transports.nvshmem_torch import torch_symm_reason as reason

    return reason()


def one_host_nvshmem_env() -> None:
    """One PE on one GPU: no network transport (no InfiniBand probing), bootstrap over loopback; a symmetric heap
    large enough for the device kernels' buffers at issue 18's target shapes (about 2.5 GB each)."""
    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(6 << 30))
    os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")


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
    child = run_child(
        ["--nvshmem-child", f"{budget:.1f}", "quick" if ctx.quick else "full"], budget + 30.0, json_file=True
    )
    res.update(child["result"])
    res["child_exit"] = child["exit"]
    if child["exit"] != 0:
        record_check(res, "epkit's NVSHMEM child exited normally", False, child["detail"])
    _torch_provider(ctx, res)  # last, in a fresh process: torch must start that process's NVSHMEM job
    status = child["result"].get("child_status", "no report")
    if status == "budget_exceeded":
        raise BudgetExceeded(child["result"].get("error", "nvshmem child: budget spent"))
    if status != "ok":
        raise RuntimeError(f"nvshmem child: {child['result'].get('error') or status} (its traceback: child_traceback)")
    return None


def run_child(args: list[str], limit: float, json_file: bool = False) -> dict:
    """Run ``SCRIPT`` with ``args`` in a child process for at most ``limit`` seconds.

    Its progress lines go to this process's stdout. Returns ``{"exit", "detail", "result"}``: ``result`` is
    the dict the child left in its JSON file (``json_file``: the path is the argument after ``args``;
    rewritten at every step, so a child that died keeps what it reported), else its last JSON stdout line.
    """
    with tempfile.TemporaryDirectory(prefix="epkit-gpu-check-") as tmp:
        path = os.path.join(tmp, "child.json")
        cmd = [sys.executable, os.path.abspath(SCRIPT), *args] + ([path] if json_file else [])
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
    child = run_child(["--torch-provider-child", f"{max(10.0, limit - 40.0):.1f}"], limit)
    out = child["result"]
    res["torch_provider"] = out
    res["torch_provider_exit"] = child["exit"]
    if child["exit"] != 0:
        record_check(res, "torch provider child exited normally", False, child["detail"])
    if not out:
        record_check(res, "torch provider child reported its results", False, child["detail"] or "no JSON line")
        return
    if out.get("torch_symm_reason"):
        out["status"] = f"not run: {out['torch_symm_reason']}"
        return
    record_check(
        res, "torch provider: SymmBuffer took torch's memory", out.get("provider") == "torch", out.get("note", "")
    )
    record_check(res, "torch provider: signal set 5 + add 3 seen as 8", out.get("signal") == 8, str(out.get("signal")))
    record_check(res, "torch provider: 16 MiB exchange to self bit-exact", out.get("exchange") is True)
    timeout_msg = out.get("timeout", "")
    record_check(res, "torch provider: timed-out wait raises", "did not satisfy" in timeout_msg, timeout_msg)
    for check in out.get("ep_checks", []):  # EPBuffer's loopback checks, on torch's memory
        record_check(res, f"torch provider: {check['name']}", check["ok"], check.get("detail", ""))
    if out.get("ep_error"):
        record_check(res, "torch provider: EPBuffer(nvshmem) loopback ran", False, out["ep_error"])
