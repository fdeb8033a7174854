"""``gpu_check.py --nvshmem-child``: epkit's own single-PE NVSHMEM job through ``epkit._C_cuda``.

Init, symmetric malloc, a loopback put-with-signal checked bit for bit, signal add, a timed-out wait,
``signal_wait_all`` with abort words and the sticky word, the guards that stop writes behind a failed wait,
put bandwidth against a device copy; then the SymmBuffer and EPBuffer loopbacks on the same job
(``nvshmem_symm``). The results go to a JSON file, saved at every step (NVSHMEM may end the process).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

import torch

from gpu_sections.common import BudgetExceeded, Ctx, gbps, record_check
from gpu_sections.nvshmem import device_view, one_host_nvshmem_env
from gpu_sections.nvshmem_symm import symm_loopback

__all__ = ["ChildCtx", "nvshmem_child"]


class _DevicePtr:
    """A raw device pointer as a ``__cuda_array_interface__`` (so torch can view NVSHMEM memory)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class ChildCtx(Ctx):
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


def nvshmem_child(budget: float, quick: bool, path: str) -> int:
    """Body of ``--nvshmem-child``: epkit's own single-PE NVSHMEM job; results in the JSON file ``path``."""
    res: dict = {}
    ctx = ChildCtx(path, res, quick)
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
    """Start the job (one PE, unique-id bootstrap), run the loopback checks on a symmetric buffer, then the
    SymmBuffer loopback; the job ends however they end."""
    import epkit._C_cuda as cc

    nbytes = (256 << 20) if not ctx.quick else (64 << 20)
    res["nbytes"] = nbytes
    stream = torch.cuda.current_stream().cuda_stream
    one_host_nvshmem_env()
    res["nvshmem_env"] = {k: v for k, v in os.environ.items() if k.startswith("NVSHMEM_")}
    ctx.log("nvshmem init (single PE, unique-id bootstrap)")
    t0 = time.perf_counter()
    cc.init(cc.get_unique_id(), 0, 1)
    res["init_s"] = time.perf_counter() - t0
    try:
        record_check(
            res, "my_pe() == 0 and n_pes() == 1", cc.my_pe() == 0 and cc.n_pes() == 1, f"{cc.my_pe()}/{cc.n_pes()}"
        )
        buf = cc.malloc(nbytes + 64)
        try:
            _loopback(ctx, res, cc, buf, nbytes, stream)
        finally:
            torch.cuda.synchronize()
            cc.free(buf)
        ctx.check("SymmBuffer loopback")
        symm_loopback(ctx, res)
    finally:
        cc.finalize()


def _loopback(ctx: Ctx, res: dict, cc, buf: int, nbytes: int, stream: int) -> None:
    """On ``buf`` (``nbytes`` of data, then the signal words): puts with a signal to this PE, the waits, the
    guards, and the put bandwidth."""
    record_check(res, "peer_ptr(buf, 0) == buf", cc.peer_ptr(buf, 0) == buf)
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
    record_check(
        res,
        "signal_wait after put_signal(set 7): [7, not timed out]",
        result.tolist() == [7, 0],
        str(result.tolist()),
    )
    if data is not None:
        record_check(res, f"loopback put of {nbytes >> 20} MiB lands bit-exact", torch.equal(data, src))
    cc.put_signal(buf, src.data_ptr(), 0, sig, 5, "add", 0, stream)
    cc.signal_wait(sig, "==", 12, 5.0, result.data_ptr(), stream)
    torch.cuda.synchronize()
    record_check(res, "signal op add: 7 + 5 == 12", result.tolist() == [12, 0], str(result.tolist()))
    # A wait that cannot be satisfied must time out after ~timeout, and say so.
    ctx.check("timed signal_wait")
    t0 = time.perf_counter()
    cc.signal_wait(sig, ">", 1 << 40, 0.05, result.data_ptr(), stream)
    torch.cuda.synchronize()
    waited = time.perf_counter() - t0
    res["timeout_wait_s"] = waited
    record_check(
        res,
        "signal_wait(> 2**40, timeout 50 ms) reports a timeout",
        result.tolist() == [12, 1],
        str(result.tolist()),
    )
    record_check(res, "the timed-out wait returned within 0.03-2 s", 0.03 <= waited <= 2.0, f"{waited:.3f} s")
    ctx.check("signal_wait_all: strided words, abort mask, sticky word")
    _wait_all_checks(cc, res, sig, stream, ctx.device)
    ctx.check("bandwidth")
    _put_bandwidth(ctx, res, cc, buf, src, sig, result, stream)


def _put_bandwidth(ctx: Ctx, res: dict, cc, buf: int, src: torch.Tensor, sig: int, result, stream: int) -> None:
    """Loopback put-with-signal bandwidth against the device copy roof (same bytes, same run); the signal word
    holds 12 when this starts, and every timed put sets the next value."""
    nbytes = src.numel()
    counter = [12]

    def put():
        counter[0] += 1
        cc.put_signal(buf, src.data_ptr(), nbytes, sig, counter[0], "set", 0, stream)

    t_put = ctx.time_op(put, iters=10, warmup=2)
    cc.signal_wait(sig, "==", counter[0], 5.0, result.data_ptr(), stream)
    torch.cuda.synchronize()
    record_check(res, "last timed put's signal observed", result.tolist() == [counter[0], 0], str(result.tolist()))
    t_wait = ctx.time_op(lambda: cc.signal_wait(sig, "==", counter[0], 5.0, result.data_ptr(), stream), iters=20)
    dst = torch.empty_like(src)
    t_copy = ctx.time_op(lambda: dst.copy_(src), iters=10, warmup=2)
    res["put_signal"] = {**t_put, "GBps_one_way": gbps(nbytes, t_put["median_ms"])}
    res["signal_wait_satisfied"] = t_wait
    res["roof_device_copy"] = {**t_copy, "GBps_one_way": gbps(nbytes, t_copy["median_ms"])}
    frac = t_copy["median_ms"] / t_put["median_ms"]
    res["fraction_of_copy_roof"] = frac
    res["summary"] = (
        f"put_signal loopback {res['put_signal']['GBps_one_way']:.0f} GB/s one-way, "
        f"{frac:.0%} of device copy {res['roof_device_copy']['GBps_one_way']:.0f} GB/s"
    )
    ctx.log(res["summary"])


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
    record_check(res, "signal_wait_all over 2 words: [last value 4, ok]", got == [4, 0], str(got))
    cc.signal_op(words[6], notice, "set", 0, stream)  # word 3's abort word
    t0 = time.perf_counter()
    got = wait_all(3, 3, 3)
    waited = time.perf_counter() - t0
    record_check(
        res,
        "abort word: a notice ends the wait on word 3 at once as its failure",
        got == [notice, 3] and sticky.item() == 1 and waited < 1.0,
        f"{got}, sticky {sticky.item()}, {waited:.3f} s",
    )
    got = wait_all(1, 0, 0)
    record_check(res, "a wait behind a failed one returns at once on the sticky word", got == [0, mask64], str(got))
    got = wait_all(1, 3, 0, skip=False)
    record_check(res, "skip_on_sticky=False: the wait still runs", got == [3, 0], str(got))
    _guard_checks(cc, res, words[7], sticky, stream, device)


def _guard_checks(cc, res: dict, word: int, sticky: torch.Tensor, stream: int, device) -> None:
    """The sticky word (set above by the failed wait) as a guard: a guarded signal and a guarded row copy do
    nothing, and with a clear guard both happen."""
    from epkit.kernels.triton.copy_rows import copy_rows_by_address

    clear = torch.zeros(1, dtype=torch.int64, device=device)
    cell = device_view(word, 8, device).view(torch.int64)
    cc.signal_op(word, 9, "set", 0, stream, sticky.data_ptr())
    torch.cuda.synchronize()
    record_check(res, "guarded signal_op behind a failed wait sets nothing", cell.item() == 0, str(cell.item()))
    src = torch.arange(256, dtype=torch.uint8, device=device).view(2, 128)
    dst = torch.zeros_like(src)
    d = dst.data_ptr() + torch.arange(2, device=device) * 128
    s = src.data_ptr() + torch.arange(2, device=device) * 128
    copy_rows_by_address(d, s, 128, 8, guard=sticky)
    torch.cuda.synchronize()
    record_check(res, "guarded row copy behind a failed wait writes nothing", not bool(dst.any()))
    copy_rows_by_address(d, s, 128, 8, guard=clear)
    cc.signal_op(word, 11, "set", 0, stream, clear.data_ptr())
    torch.cuda.synchronize()
    record_check(res, "row copy with a clear guard copies every byte", torch.equal(dst, src))
    record_check(res, "signal_op with a clear guard sets the word", cell.item() == 11, str(cell.item()))
