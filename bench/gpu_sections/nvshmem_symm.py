"""SymmBuffer(transport="nvshmem") over a group of one, in the two NVSHMEM children of the nvshmem section.

``symm_loopback`` runs inside ``--nvshmem-child`` on epkit's own job; ``torch_provider_child`` is the body of
``--torch-provider-child``, where torch starts the job and SymmBuffer takes torch's symmetric memory. Each
then runs ``nvshmem_ep``'s EPBuffer loopback on the same job; epkit's own job also ``nvshmem_mega``'s Mega MoE layers.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import traceback

import torch

from gpu_sections.common import BudgetExceeded, Ctx, gbps, record_check
from gpu_sections.nvshmem import one_host_nvshmem_env, torch_symm_reason
from gpu_sections.nvshmem_ep import ep_loopback
from gpu_sections.nvshmem_kernels import kernel_targets, verdicts
from gpu_sections.nvshmem_mega import mega_moe_check

__all__ = ["symm_loopback", "torch_provider_child"]


def symm_loopback(ctx: Ctx, res: dict) -> None:
    """SymmBuffer(transport="nvshmem") over a group of one, adopting the section's NVSHMEM job.

    Signals, a timed-out wait, a barrier, exchange round trips of 64 MiB to itself (bit-exact over two
    epochs), then the time per exchange against a device copy of the same bytes (host-inclusive both).
    """
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
            _signal_checks(res, out, buf, nbytes)
            _exchange_checks(ctx, res, out, buf, nbytes)
        finally:
            with contextlib.suppress(Exception):  # a failure above is the one to report
                buf.close()
        kernel_targets(ctx, res)  # the device kernels at issue 18's target shapes (first: the issue's figures)
        try:
            ep_loopback(ctx, res)
        except Exception:  # noqa: BLE001 - recorded as a failed check; the SymmBuffer results above stand
            record_check(res, "EPBuffer(nvshmem) loopback ran", False, traceback.format_exc())
        try:
            _mega_moe(ctx, res)
        except BudgetExceeded as exc:  # the checks above stand; say what did not run
            res.setdefault("mega_moe", {})["status"] = f"not finished: {exc}"
        except Exception:  # noqa: BLE001 - recorded as a failed check
            record_check(res, "Mega MoE (compat.deep_gemm) on the nvshmem path ran", False, traceback.format_exc())
        res.setdefault("ep_kernels", {})["verdicts"] = verdicts(res)
    finally:
        dist.destroy_process_group()
        tmp.cleanup()


def _mega_moe(ctx: Ctx, res: dict) -> None:
    """DeepGEMM's Mega MoE layers on a group of one over NCCL (the nvshmem path), against the gloo group's CPU rows."""
    import torch.distributed as dist

    ctx.check("mega_moe")
    nccl = dist.new_group(backend="nccl")
    try:
        mega_moe_check(ctx, res, nccl, dist.group.WORLD)
    finally:
        dist.destroy_process_group(nccl)


def _signal_checks(res: dict, out: dict, buf, nbytes: int) -> None:
    """The local view and its peer alias, signal set + add seen by a wait, a wait that times out, a barrier."""
    loc = buf.local
    record_check(
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
    record_check(res, "SymmBuffer signal set 5 + add 3: wait_until(== 8)", seen == 8, str(seen))
    t0 = time.perf_counter()
    msg = _timed_out_wait(buf)
    out["timeout_wait_s"] = time.perf_counter() - t0
    record_check(
        res,
        "SymmBuffer wait_until that cannot hold raises TimeoutError naming the word",
        "signal word 1 did not satisfy > 0 within 0.05 s" in msg,
        msg,
    )
    buf.barrier()


def _timed_out_wait(buf) -> str:
    """A wait on signal word 1 (never signalled) with a 50 ms timeout: the TimeoutError's message."""
    try:
        buf.wait_until(1, ">", 0, timeout=0.05)
        return "no TimeoutError"
    except TimeoutError as exc:
        return str(exc)


def _exchange_to_self(buf, data: torch.Tensor, compare: bool = True) -> bool | None:
    """One exchange round trip of ``data`` (uint8) to this rank; whether what came back equals it (or None)."""
    nbytes = data.numel()
    ex = buf.exchange(nbytes, tag="loopback")
    ex.send_region(0).copy_(data)
    ex.commit(0, nbytes)
    got = ex.receive([nbytes])[0]
    ok = torch.equal(got, data) if compare else None
    ex.release()
    return ok


def _exchange_checks(ctx: Ctx, res: dict, out: dict, buf, nbytes: int) -> None:
    """Exchanges of ``nbytes`` to self, bit-exact over two epochs, then timed against a device copy."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=ctx.device)
    for epoch, data in enumerate((src.flip(0), 255 - src), start=1):
        record_check(res, f"SymmBuffer exchange to self, epoch {epoch}: 64 MiB bit-exact", _exchange_to_self(buf, data))
    ctx.check("SymmBuffer exchange timing")
    t_ex = ctx.time_wall(lambda: _exchange_to_self(buf, src, compare=False), calls=5, rounds=5)
    dst = torch.empty_like(src)
    t_copy = ctx.time_wall(lambda: dst.copy_(src), calls=5, rounds=5)
    out["exchange"] = {**t_ex, "GBps_one_way": gbps(nbytes, t_ex["median_ms"])}
    out["roof_device_copy"] = {**t_copy, "GBps_one_way": gbps(nbytes, t_copy["median_ms"])}
    out["fraction_of_copy_roof"] = t_copy["median_ms"] / t_ex["median_ms"]
    line = (
        f"SymmBuffer exchange {t_ex['median_ms']:.3f} ms per 64 MiB, {out['fraction_of_copy_roof']:.0%} of device copy"
    )
    res["summary"] = f"{res['summary']}; {line}" if res.get("summary") else line
    ctx.log(line)


def torch_provider_child(ep_budget: float) -> int:
    """Body of ``--torch-provider-child``: one JSON line on stdout (the EPBuffer loopback gets ``ep_budget`` s)."""
    import torch.distributed as dist

    one_host_nvshmem_env()
    os.environ["EPKIT_NVSHMEM_PROVIDER"] = "torch"
    out: dict = {"torch_symm_reason": torch_symm_reason()}
    if out["torch_symm_reason"] is None:
        torch.cuda.set_device(0)
        tmp = tempfile.TemporaryDirectory(prefix="epkit-gpu-check-torch-")
        store = dist.FileStore(os.path.join(tmp.name, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        _on_torch_memory(out, ep_budget)
        dist.destroy_process_group()
        tmp.cleanup()
    print(json.dumps(out, default=str), flush=True)
    os._exit(0)  # torch's NVSHMEM teardown at exit can crash after the result is out


def _on_torch_memory(out: dict, ep_budget: float) -> None:
    """SymmBuffer's signal, exchange and timeout checks on torch's symmetric memory, then the EPBuffer loopback;
    into ``out`` (the parent turns its entries into checks)."""
    import torch.distributed as dist

    from epkit.backends import BackendUnavailableError
    from epkit.collectives.symm_buffer import SymmBuffer

    nbytes = 16 << 20
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
    out["exchange"] = bool(_exchange_to_self(buf, data))
    out["timeout"] = _timed_out_wait(buf)
    buf.close()
    ctx = Ctx(torch.device("cuda", 0), True, time.perf_counter())
    ctx.begin("torch_provider", ep_budget)
    ep: dict = {}
    try:
        ep_loopback(ctx, ep)
    except Exception:  # noqa: BLE001 -- reported to the parent as a failed check
        ep["error"] = traceback.format_exc()[-2000:]
    out.update(ep_checks=ep.get("checks", []), ep_error=ep.get("error"))
