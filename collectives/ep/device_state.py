"""EPBuffer's device-kernel path: the memory it adds to the buffer, its addresses, and how its failures surface.

When every peer is directly addressable (``Transport.within_domain()``: shm on one host, nvshmem inside one
NVLink domain), dispatch and combine can run as kernels that write straight into the peers' memory and wait
on 64-bit signal words themselves (``kernels/triton/ep_*.py``), with no host round trip. Which path a buffer
takes (``EPBuffer(kernels=...)``, or ``EPKIT_EP_KERNELS``):

- ``"auto"`` (default): the kernels for CUDA rows inside one domain; the host-driven protocol otherwise (the
  torch transport, peers out of reach, and CPU rows, whose C++ path is far faster than the interpreter);
- ``"device"``: the kernels wherever the peers are in reach, on CPU ranks under the Triton interpreter (how the
  tests run the kernels' own source across processes); ValueError where they are not;
- ``"host"``: the host-driven protocol everywhere.

The kernels' memory is an area after the host protocol's regions in every rank's buffer (the same offsets on
every rank)::

    [ control words | low-latency dispatch x2 | low-latency combine x2 | notify x2 | agree x2 | rows ]

Every area of a kind of exchange that can follow itself (a dispatch after a dispatch) is doubled, by parity.

A kernel that fails (a wait past its deadline, a peer's gave-up notice, a header that rejects the call) writes
the status block (host memory: pinned on a GPU) and sets its rank's sticky failed word, after which every
kernel of the rank does nothing. :meth:`DeviceState.poll` (at the start and end of every call; on CPU ranks
the kernels have finished by then) turns the record into the error, retires the buffer (telling the peers of
a silent one) and raises it.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from epkit._details.host_memory import mark_host_memory
from epkit.collectives.ep.agreement import agreement_error
from epkit.collectives.ep.config import EPConfig
from epkit.collectives.ep.context import EPContext
from epkit.collectives.ep.ll_layout import describe_handles, judge_headers
from epkit.collectives.ep.rows import META_MSG, align_up, decode_error, encode_error
from epkit.collectives.ep.worst import judge_notify
from epkit.collectives.peer_failure import is_notice, notice_error, silence_error
from epkit.collectives.transports.base import MASK64, NOTICE, word
from epkit.kernels.triton.ep_layout import (
    CODE_AGREE,
    CODE_HANDLES,
    CODE_HEADERS,
    CODE_NOTIFY,
    CODE_WAIT,
    COMBINE_HEAD,
    KINDS,
    STATUS_DETAIL,
    STATUS_WORDS,
    control_words,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ENV",
    "MODES",
    "DeviceState",
    "attach",
    "device_layout",
    "kernel_area",
    "may_be_nvshmem",
    "resolve_mode",
    "use_device_kernels",
]

#: The values of ``EPBuffer(kernels=...)`` and of the environment variable :data:`ENV`.
MODES = ("auto", "device", "host")
#: Overrides ``kernels="auto"`` for every EPBuffer of the process.
ENV = "EPKIT_EP_KERNELS"
#: What each kind of exchange is called in the errors.
_WHAT = {
    "ll_dispatch": "low-latency dispatch",
    "ll_combine": "low-latency combine",
    "notify": "dispatch layout",
    "dispatch": "dispatch data",
    "agree": "combine agreement",
    "combine": "combine data",
}
_AREA_ALIGN = 256


def resolve_mode(kernels: str) -> str:
    """``kernels`` checked, with ``"auto"`` replaced by :data:`ENV` where that is set."""
    if kernels not in MODES:
        raise ValueError(f"kernels must be one of {MODES}, got {kernels!r}")
    if kernels == "auto":
        kernels = os.environ.get(ENV, "auto") or "auto"
        if kernels not in MODES:
            raise ValueError(f"{ENV} must be one of {MODES}, got {kernels!r}")
    return kernels


def use_device_kernels(mode: str, device: torch.device, transport: str, in_reach: bool) -> bool:
    """Whether a buffer takes the device kernels (``mode`` from :func:`resolve_mode`; ``in_reach``: every peer is
    directly addressable and the rows suit 16-byte accesses); ValueError for ``"device"`` where it cannot."""
    if mode == "device" and not in_reach:
        raise ValueError(
            f"kernels='device' needs every EP peer directly addressable (shm on one host, nvshmem inside one NVLink "
            f"domain) and hidden a multiple of 16; this buffer ({transport!r} transport) does not have both"
        )
    return mode == "device" or (mode == "auto" and in_reach and device.type == "cuda")


def kernel_area(cfg: EPConfig, kernels: str, transport: str, group: ProcessGroup | None) -> tuple[str, dict[str, int]]:
    """``(mode, layout)`` of a buffer of ``cfg`` asking for ``kernels`` on ``transport``: the device area's layout
    (:func:`device_layout`), or ``{}`` when the kernels cannot be used (CPU rows on ``auto``, the torch transport, a
    hidden size that is not a multiple of 16; ValueError where ``"device"`` was asked for)."""
    mode = resolve_mode(kernels)
    possible = transport != "torch" and cfg.hidden % 16 == 0
    if mode == "host" or not possible or (mode == "auto" and not may_be_nvshmem(transport, group)):
        use_device_kernels(mode, torch.device("cpu"), transport, possible and mode != "device")
        return mode, {}
    n_ll, n = cfg.num_max_dispatch_tokens_per_rank, cfg.num_max_tokens_per_rank
    return mode, device_layout(cfg.world_size, cfg.hidden, cfg.num_experts, cfg.num_topk, n_ll, n)


def attach(ctx: EPContext, mode: str, layout: dict[str, int]) -> DeviceState | None:
    """The DeviceState of a buffer that takes the device path (else None); its area is past the regions."""
    if not layout:
        return None
    in_reach = ctx.buffer.impl.direct and ctx.buffer.is_within_domain()
    if not use_device_kernels(mode, ctx.device, ctx.transport, in_reach):
        return None
    return DeviceState(ctx, ctx.cfg.world_size * ctx.region_bytes, layout)


def may_be_nvshmem(transport: str, group: ProcessGroup | None) -> bool:
    """Whether a buffer asking for ``transport`` on ``group`` may get the nvshmem transport (``auto`` picks it
    for an NCCL group whose every rank can run it: this rank's view decides how the buffer is sized; the
    transport the buffer gets decides whether the kernels run)."""
    if transport != "auto":
        return transport == "nvshmem"
    if "nccl" not in str(dist.get_backend(group)):
        return False
    from epkit.collectives.transports import nvshmem_job

    return nvshmem_job.missing_reason() is None


def device_layout(world: int, hidden: int, num_experts: int, num_topk: int, n_ll: int, n_normal: int) -> dict[str, int]:
    """Byte offsets (and sizes) of the device area's parts; ``total`` bytes in all (see the module docstring).

    Low-latency messages hold ``n_ll`` slots per local expert of bf16 rows (FP8 rows and scales fit in them);
    the rows part holds, per source, ``n_normal`` rows of the widest normal-mode row (float32 rows or combine
    outputs, scales, local expert ids and weights).
    """
    w, h, k, local = world, hidden, num_topk, num_experts // world
    out = {"header": align_up(4 * (3 + local)) + META_MSG, "text": META_MSG}
    out["ll_dispatch_msg"] = align_up(out["header"] + local * n_ll * 2 * h, _AREA_ALIGN)
    out["ll_combine_msg"] = align_up(COMBINE_HEAD + local * n_ll * 2 * h, _AREA_ALIGN)
    out["notify_msg"] = align_up(8 * (2 + w + num_experts) + META_MSG, _AREA_ALIGN)
    out["agree_msg"] = align_up(8 * 4 + META_MSG, _AREA_ALIGN)
    rows = w * n_normal
    out["rows_bytes"] = max(
        align_up(rows * 4 * h) + align_up(rows * 4 * -(-h // 128)) + 2 * align_up(rows * 4 * k), rows * 4 * h
    )
    at = align_up(8 * control_words(w), 4096)
    for name in ("ll_dispatch", "ll_combine", "notify", "agree"):
        out[f"{name}_area"] = w * out[f"{name}_msg"]  # one parity
        out[name] = at
        at += 2 * out[f"{name}_area"]
    out["rows"] = at
    out["total"] = align_up(at + out["rows_bytes"], 4096)
    return out


_CLOCK: list[torch.Tensor] = []


def host_clock() -> torch.Tensor:
    """A ``[1]`` int64 word holding ``time.monotonic_ns()``, kept current (every millisecond) by a daemon thread:
    the interpreter's stand-in for ``%globaltimer``, so that a kernel's wait has a deadline in real time. The
    thread writes through ctypes (no torch call on it, so it can be stopped anywhere when the process exits)."""
    if not _CLOCK:
        word_ = mark_host_memory(torch.full((1,), time.monotonic_ns(), dtype=torch.int64))
        cell = ctypes.c_int64.from_address(word_.data_ptr())

        def tick() -> None:
            while True:
                cell.value = time.monotonic_ns()
                time.sleep(0.001)

        threading.Thread(target=tick, name="epkit-ep-clock", daemon=True).start()
        _CLOCK.append(word_)
    return _CLOCK[0]


class DeviceState:
    """The device path's addresses and failure state for one EPBuffer (context ``ctx``), whose buffer holds the device
    area at byte ``area_offset`` of every rank's data (laid out by :func:`device_layout`)."""

    def __init__(self, ctx: EPContext, area_offset: int, layout: dict[str, int]) -> None:
        sb, w, dev = ctx.buffer, ctx.cfg.world_size, ctx.device
        self.sb, self.layout, self.device, self.area_offset = sb, layout, dev, area_offset
        self.rank, self.world, self.timeout = ctx.cfg.rank, w, ctx.cfg.timeout
        self.cfg = ctx.cfg
        self.bases = [sb.peer(r).data_ptr() + area_offset for r in range(w)]
        me = self.bases[self.rank]
        self.ctrl = me
        notices = sb.impl.word_address(word(NOTICE, 0, w))
        assert notices is not None  # the device path runs on direct transports only, which have signal words
        self.notices = notices
        self.tables = {
            name: torch.tensor([b + layout[name] for b in self.bases], dtype=torch.int64).to(dev)
            for name in ("ll_dispatch", "ll_combine", "notify", "agree", "rows")
        }
        self.tables["ctrl"] = torch.tensor(self.bases, dtype=torch.int64).to(dev)
        self.local = {name: me + layout[name] for name in ("ll_dispatch", "ll_combine", "notify", "agree", "rows")}
        status = torch.zeros(STATUS_WORDS + STATUS_DETAIL * w, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.status = mark_host_memory(status)  # read without a device sync
        self._status = self.status.numpy()
        # The clock word's address: the interpreter's waits read it; a GPU's read %globaltimer and never touch it,
        # but the argument is still a real 64-bit address (a 0 would launch as an i32).
        self.clock = host_clock().data_ptr() if dev.type == "cpu" else self.status.data_ptr()
        self.timeout_ns = int(self.timeout * 1e9)
        self.no_text = torch.zeros(META_MSG, dtype=torch.uint8, device=dev)

    def error_text(self, error: str | None) -> torch.Tensor:
        """The ``[META_MSG]`` error field a kernel copies into its messages (a cached zero field when None)."""
        return self.no_text if error is None else encode_error(error).to(self.device)

    # failures

    def poll(self, wait: bool = False, drain: bool = False) -> None:
        """Raise (and retire the buffer for) the failure a kernel of this rank recorded, if any; never blocks
        while there is none, unless ``drain`` or ``wait``: then first wait (bounded) for this rank's queued
        kernels; ``wait`` raises even if none failed (the caller's own input was rejected: its rejecting header
        is in every message)."""
        if (wait or drain) and self.device.type == "cuda":
            try:
                _drain(self.device, self.timeout)
            except TimeoutError as exc:
                self.retire(exc)  # the buffer is broken: its later calls raise at once
                raise
        if self._status[0] == 0:
            if wait:
                raise RuntimeError(f"{self.cfg.rank_name(self.rank)}: a rejected call left no failure record")
            return
        if self.device.type == "cuda":  # the record is complete once the failing kernel has finished
            _drain(self.device, self.timeout)
        error = self._error()
        self.retire(error)
        raise error

    def retire(self, exc: BaseException) -> None:
        """Retire the buffer for ``exc`` and tell the peers (its later calls raise at once)."""
        on_failure = self.sb.deferred.on_failure
        assert on_failure is not None  # a SymmBuffer's checks always retire it
        on_failure(exc)

    def _error(self) -> BaseException:
        code, kind, peer, seen, target, epoch = (int(v) for v in self._status[:6])
        what = _WHAT[KINDS[kind]]
        detail = self._status[STATUS_WORDS:].reshape(self.world, STATUS_DETAIL)
        if code == CODE_WAIT:
            if is_notice(seen & MASK64):
                return notice_error(self.rank, seen & MASK64, what, self.sb.global_ranks)
            return silence_error(self.rank, peer, what, self.timeout, epoch, self.sb.global_ranks)
        if code == CODE_HEADERS:
            heads = [[int(v) for v in detail[src, :3]] for src in range(self.world)]
            at = self.layout["header"] - META_MSG
            errors = judge_headers(heads, lambda src: self.message_text("ll_dispatch", src, epoch, at), True,
                                   self.cfg.ranks)  # fmt: skip
            return ValueError("low-latency dispatch rejected on every rank: " + "; ".join(errors))
        if code == CODE_NOTIFY:  # a worst-case dispatch's layout exchange, judged on the device (ep/worst.py)
            codes, words, rows, expanded = ([int(v) for v in detail[:, c]] for c in range(4))
            found = judge_notify(codes, words, rows, expanded, (seen, target), self.cfg.ranks,
                                 lambda src: self.notify_text(src, epoch))  # fmt: skip
            if found is not None:
                return found
        if code == CODE_AGREE:  # an agreement after a worst-case dispatch, judged on the device
            heads = [[int(v) for v in detail[src, :3]] for src in range(self.world)]
            what = ("combine", "cached dispatch")[target]
            found = agreement_error(what, heads, lambda src: self.message_text("agree", src, epoch, 32),
                                    self.sb.buffer_id, self.cfg.ranks)  # fmt: skip
            if found is not None:
                return found
        if code == CODE_HANDLES:
            idents = [[int(v) for v in detail[src, :2]] for src in range(self.world)]
            return ValueError(describe_handles(idents, self.sb.buffer_id, "low-latency combine", self.cfg.ranks))
        return RuntimeError(f"{self.cfg.rank_name(self.rank)}: corrupt device status record (code {code})")

    def message_text(self, area: str, src: int, epoch: int, offset: int) -> str:
        """The error text at byte ``offset`` of source ``src``'s message in this rank's ``area`` ("ll_dispatch",
        "notify", "agree") of exchange ``epoch`` (whose parity picks the half): the error path's one read."""
        lay = self.layout
        at = lay[area] + (epoch % 2) * lay[f"{area}_area"] + src * lay[f"{area}_msg"] + offset
        mem = self.sb.local[self.area_offset :]
        return decode_error(mem[at : at + META_MSG].cpu())

    def notify_text(self, src: int, epoch: int) -> str:
        """The error text of source ``src``'s notify message of exchange ``epoch`` (after its words)."""
        return self.message_text("notify", src, epoch, 8 * (2 + self.world + self.cfg.num_experts))


def _drain(device: torch.device, timeout: float) -> None:
    """Wait (bounded) for the current stream: a failing kernel's record is complete when it has finished.
    TimeoutError where the stream has not finished ``timeout`` + 10 s later."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event's __init__ unannotated
    event.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + timeout + 10.0
    while not event.query():  # type: ignore[no-untyped-call]  # torch leaves Event.query unannotated
        if time.monotonic() >= deadline:  # past the kernels' own timeouts: the stream itself is stuck
            raise TimeoutError(
                f"the device kernels of this EPBuffer did not finish within {timeout + 10.0:g} s (the buffer's "
                f"timeout + 10 s), although each of their waits is bounded by the timeout: the stream is stuck"
            )
        time.sleep(50e-6)
