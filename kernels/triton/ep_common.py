"""Shared pieces of the device-side dispatch/combine kernels (``ep_low_latency.py``, ``ep_normal.py``,
``ep_combine.py``): the launcher and its launch counter, the control words, timed waits on 64-bit signal
words, release signals, failure records, exact float conversions and the row copy.

Why Triton and not CUDA C++ for these kernels: they are memory-bound row moves and small scans, where
Triton's 16-byte vector accesses and persistent grids are enough, and the same source runs on CPU ranks
under the Triton interpreter over shared memory (rung 2 of the verification ladder), which a CUDA kernel
could not. Everything a kernel touches in another rank's memory goes through int64 addresses (a table of
every rank's area) cast with ``.to(tl.pointer_type(...))``; no shared memory is passed as a tensor argument
(the interpreter copies tensor arguments back after a launch, which would race with the peers' writes).

Control words (int64, at the start of every rank's device area; word ``i`` is ``8 * i`` bytes in)::

    counter(kind, src)  = kind * W + src       added to by rank src's programs (release), read here (acquire)
    epoch_in(kind)      = NUM_KINDS * W + 2 * kind       the last finished exchange of ``kind`` (receiver)
    epoch_out(kind)     = NUM_KINDS * W + 2 * kind + 1   the exchange in flight (sender)
    failed              = NUM_KINDS * W + 2 * NUM_KINDS  nonzero once a kernel of this rank failed (sticky)

An exchange of one kind is numbered on the device (the sender kernel reads ``epoch_in`` and writes
``epoch_out``; the receiver reads ``epoch_out`` and writes ``epoch_in``: no kernel reads a word it writes),
so a captured CUDA graph replays correctly. A single-program sender (notify, agree) adds 1 to the receiver's
counter after its writes, and exchange ``e`` is complete at the receiver when the counter reaches ``e``; each of a
multi-program sender's ``P`` programs adds its share of :data:`SIGNAL_TOTAL` (the shares sum to it, none is 0),
and exchange ``e`` is complete when the counter reaches ``e * SIGNAL_TOTAL``: whatever ``P`` the sender ran,
which each rank may choose per call (``num_sms``) without telling the others.

Waits are bounded: by ``%globaltimer`` on a GPU (``HW_TIMER``), by a clock word a host thread keeps current
under the interpreter. A wait also ends when the source's gave-up notice (its NOTICE signal word) turns
nonzero. A failed wait writes a record into the host-visible status block and sets ``failed``; every later
kernel of this rank then does nothing (no write lands in a peer's memory behind a failed wait).

Under the interpreter a loop index is a Python int (``wide`` makes it int64 either way), and a mask must be a
block comparison: a scalar boolean combined with a block one is not a boolean there.

Status block (int64, host memory: pinned on a GPU)::

    [CODE, KIND, PEER, SEEN, TARGET, EPOCH, -, -, detail[W][4]]
"""

from __future__ import annotations

import functools
import time
import types

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from epkit.kernels.triton.ep_layout import CODE_WAIT, INV_FP8_MAX, NUM_KINDS
from epkit.kernels.triton.launch import launch as run
from epkit.kernels.triton.launch import target, twin_active

__all__ = [
    "DEFAULT_CTAS",
    "LAUNCHES",
    "SIGNAL_TOTAL",
    "alive",
    "begin_send",
    "end_exchange",
    "next_epoch",
    "sent_epoch",
    "wait_sources",
    "copy_rows",
    "copy_rows_at",
    "ctrl_counter",
    "ctrl_epoch_in",
    "ctrl_epoch_out",
    "ctrl_failed",
    "e4m3_bits",
    "f32_from_bf16_bits",
    "f32_to_bf16_bits",
    "claim_failure",
    "fail_wait",
    "record",
    "row_words",
    "interpreted",
    "launch",
    "load_f32",
    "now_ns",
    "programs",
    "ptr",
    "quantize_row",
    "publish_ready",
    "read_word",
    "signal_peers",
    "signal_share",
    "shared_target",
    "store_f32",
    "vcumsum",
    "vmax",
    "vsum",
    "wait_counters",
    "wide",
    "zero_rows_at",
]

_NK = tl.constexpr(NUM_KINDS)
_INV_FP8 = tl.constexpr(INV_FP8_MAX)
_CODE_WAIT = tl.constexpr(CODE_WAIT)
#: Timer reads per program in a GPU wait: at least one per thread of the largest program (32 warps).
_TIMER_LANES = tl.constexpr(1024)

#: Launches per kernel name in this process (the launch counter tests read it).
LAUNCHES: dict[str, int] = {}


#: Programs of a multi-program EP launch on CUDA unless a geometry says otherwise (``ctas``).
DEFAULT_CTAS = 128
#: What a multi-program sender's programs add to a receiver's counter per exchange, all together (see above).
SIGNAL_TOTAL = 1 << 20
_TOTAL = tl.constexpr(SIGNAL_TOTAL)


def programs(device: torch.device, ctas: int = DEFAULT_CTAS, exact: bool = False) -> int:
    """Programs of a multi-program launch: ``ctas`` on CUDA (at least 2: the low-latency send keeps program 0 for
    the headers; any count per rank and call: a receiver's target does not depend on it, see :func:`signal_share`),
    under the interpreter, which runs them one after another, 2 unless ``exact`` (a count the caller chose)."""
    if isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < 2:
        raise ValueError(f"the EP kernels' CTA count must be an int >= 2, got {ctas!r}")
    return ctas if target(device) == "cuda" or exact else 2


def row_words(row_bytes: int, rows: int = 1) -> int:
    """int32 words per block of a row copy: up to 4 KiB of a row per step, and at most 4096 words in a
    ``[rows, words]`` step (a bigger tile holds more than a thread's registers: the normal dispatch send copies 16
    rows at once at W=8 and spilled under Triton 3.6 with 1024-word blocks)."""
    cap = 4096 // triton.next_power_of_2(max(rows, 1))
    return max(1, min(1024, cap, triton.next_power_of_2(max(row_bytes // 4, 1))))


_TWINS: dict = {}


def interpreted(kernel) -> InterpretedFunction:
    """The interpreter twin of a ``@triton.jit`` function, with every ``@triton.jit`` helper it calls (through its
    module's globals, recursively) replaced by that helper's twin, so that helpers run as device functions."""
    fn = getattr(kernel, "fn", kernel)
    if fn in _TWINS:
        return _TWINS[fn]
    names = dict(fn.__globals__)
    clone = types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)
    functools.update_wrapper(clone, fn)
    del clone.__wrapped__  # the interpreter reads the source through the clone, whose globals hold the twins
    twin = _TWINS[fn] = InterpretedFunction(clone)
    for name, value in fn.__globals__.items():
        # Triton's own (the reductions' combine functions) stay: the interpreter recognises them by identity.
        if isinstance(value, JITFunction) and not value.fn.__module__.startswith("triton"):
            names[name] = interpreted(value)
    if fn.__globals__.get("now_ns") is now_ns:
        names["now_ns"] = _now_ns_interpreted
    return twin


def _now_ns_interpreted(clock, HW_TIMER):
    """``now_ns`` under the interpreter: the clock word, read after giving the CPU away for 0.1 ms, so that a rank
    spinning in a wait does not starve the ranks it waits for (CPU ranks often outnumber the cores)."""
    time.sleep(1e-4)
    return tl.load(clock, volatile=True)


def launch(kernel, grid: tuple[int, ...], device: torch.device, *args, **kwargs) -> None:
    """Launch ``kernel`` compiled (CUDA) or interpreted (CPU) through ``epkit.kernels.triton.launch`` (on
    ``device``'s current stream); counted in :data:`LAUNCHES` when it runs. FP fusion is off on a GPU (products
    round before they are added, as on the CPU)."""
    if target(device) == "cuda":
        kwargs["enable_fp_fusion"] = False
    run(kernel, grid, device, *args, interpret=interpreted, **kwargs)
    if not twin_active():
        name = getattr(kernel, "__name__", None) or kernel.fn.__name__
        LAUNCHES[name] = LAUNCHES.get(name, 0) + 1


# reductions (Triton's combine functions: the interpreter runs them as numpy reductions; tl.sum and tl.max are
# themselves @triton.jit functions, which only TRITON_INTERPRET=1 at import would make interpretable)

_ADD = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


@triton.jit
def vsum(x, axis):
    return tl.reduce(x, axis, _ADD)


@triton.jit
def vmax(x, axis):
    return tl.reduce(x, axis, _MAX)


@triton.jit
def vcumsum(x, axis):
    return tl.associative_scan(x, axis, _ADD)


# control words


@triton.jit
def wide(x):
    """``x`` as int64 (a loop index is a Python int under the interpreter, a tensor when compiled)."""
    return tl.full([], 0, tl.int64) + x


@triton.jit
def ptr(addr, DTYPE: tl.constexpr):
    """An address as a pointer to ``DTYPE``, widened to int64 first: an address argument whose value a launch
    specializes (0 fits 32 bits: an ``i32``) still casts."""
    return wide(addr).to(tl.pointer_type(DTYPE))


@triton.jit
def read_word(word, SCOPE: tl.constexpr):
    """An int64 word read by one thread and broadcast to the whole program (a scalar atomic), so that every thread
    takes the same branch on it: a volatile load is each thread's own read, and threads that disagree at a
    ``bar.sync`` hang the program."""
    return tl.atomic_add(word, 0, sem="relaxed", scope=SCOPE)


@triton.jit
def publish_ready(ready_addr, ready):
    """The last store of a program whose results the host reads: ``ready`` (the host's call number) into the word
    at ``ready_addr`` (host memory), after a barrier, with a system-scope release, so that a host that sees it
    sees every result word. Made whatever happened before it (a failed wait too), so the host's spin ends."""
    tl.debug_barrier()
    tl.atomic_xchg(ptr(ready_addr, tl.int64), wide(ready), sem="release", scope="sys")


@triton.jit
def ctrl_counter(ctrl, kind, src, W):
    return ctrl + kind * W + src


@triton.jit
def ctrl_epoch_in(ctrl, kind, W):
    return ctrl + _NK * W + 2 * kind


@triton.jit
def ctrl_epoch_out(ctrl, kind, W):
    return ctrl + _NK * W + 2 * kind + 1


@triton.jit
def ctrl_failed(ctrl, W):
    return ctrl + _NK * W + 2 * _NK


# waits and signals


@triton.jit
def now_ns(clock, HW_TIMER: tl.constexpr):
    """Nanoseconds, the same value in every thread of the program: on a GPU the latest ``%globaltimer`` its
    threads read (a block of reads reduced across the whole program: each thread's own read would let threads
    leave a wait at different iterations), else the clock word (a host thread keeps it current)."""
    if HW_TIMER:
        lanes = tl.full([_TIMER_LANES], 0, tl.int64)
        reads = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,l", [lanes], dtype=tl.int64, is_pure=False, pack=1
        )
        t = vmax(reads, 0)
    else:
        t = tl.load(clock, volatile=True)
    return t


@triton.jit
def wait_counters(words, notices, count, target, deadline, clock, HW_TIMER: tl.constexpr):
    """Wait until each of the ``count`` int64 words from ``words`` reaches ``target`` (acquire), watching the
    matching NOTICE words, until ``deadline`` (ns). Returns ``(1 + first source that failed or 0, seen)``, seen
    being the notice word when one ended the wait, else the counter's last value."""
    failed = tl.full([], 0, tl.int32)
    seen = tl.full([], 0, tl.int64)
    for i in range(count):
        if failed == 0:
            # Every value the loop decides on is the same in every thread (scalar atomics, a reduced timer).
            v = tl.atomic_add(words + i, 0, sem="acquire", scope="sys")
            n = read_word(notices + i, "sys")
            t = now_ns(clock, HW_TIMER)
            while (v < target) & (n == 0) & (t < deadline):
                v = tl.atomic_add(words + i, 0, sem="acquire", scope="sys")
                n = read_word(notices + i, "sys")
                t = now_ns(clock, HW_TIMER)
            if v < target:
                failed = i + 1
                seen = tl.where(n != 0, n, v)
    return failed, seen


@triton.jit
def signal_peers(ctrl_table, W, word, amount):
    """After every thread's writes: add ``amount`` (1, or :func:`signal_share`) to control word ``word`` of every
    rank (release, system scope)."""
    tl.debug_barrier()
    for dst in range(W):
        c = ptr(tl.load(ctrl_table + dst), tl.int64)
        tl.atomic_add(c + word, amount, sem="release", scope="sys")


@triton.jit
def shared_target(e):
    """The counter value at which exchange ``e`` of a multi-program sender is complete (``e * SIGNAL_TOTAL``)."""
    return e.to(tl.int64) * _TOTAL


@triton.jit
def signal_share():
    """This program's share of :data:`SIGNAL_TOTAL` (``SIGNAL_TOTAL // P``, one more for the first ``SIGNAL_TOTAL %
    P`` programs): the shares of a launch of ``P <= SIGNAL_TOTAL`` programs sum to it, and none is 0, so the total
    is reached only once every program has signalled."""
    p, P = tl.program_id(0), tl.num_programs(0)
    total = tl.full([], _TOTAL, tl.int32)
    base = total // P
    return tl.where(p < total - base * P, base + 1, base).to(tl.int64)


@triton.jit
def claim_failure(ctrl, W):
    """Set this rank's failed word; True for the first failure (its program writes the status record)."""
    zero, one = tl.full([], 0, tl.int64), tl.full([], 1, tl.int64)
    return tl.atomic_cas(ctrl_failed(ctrl, W), zero, one, sem="acq_rel", scope="gpu") == 0


@triton.jit
def record(status, code, kind, peer, seen, target, epoch):
    """Write the status record of a claimed failure (``claim_failure``), the code word last."""
    tl.store(status + 1, kind)
    tl.store(status + 2, peer)
    tl.store(status + 3, seen)
    tl.store(status + 4, target)
    tl.store(status + 5, epoch)
    tl.store(status, code)


@triton.jit
def record_verdict(ctrl, W, status_addr, code, kind, nbad, seen, target, epoch, w0, w1, w2, w3, NW: tl.constexpr,
                   W_P2: tl.constexpr):  # fmt: skip
    """A rejection reached on the device from every rank's words, the same on every rank: the rank's first failure
    (:func:`claim_failure`) stores each rank's ``NW`` detail words (``w0``, ``w1``, ...: ``[W_P2]`` each, by rank)
    and the record (``nbad`` ranks at fault; ``seen`` / ``target``: what the host needs to word the error)."""
    if claim_failure(ctrl, W):
        status = ptr(status_addr, tl.int64)
        s = tl.arange(0, W_P2)
        live = s < W
        tl.store(status + 8 + 4 * s, w0, mask=live)
        if NW > 1:
            tl.store(status + 9 + 4 * s, w1, mask=live)
        if NW > 2:
            tl.store(status + 10 + 4 * s, w2, mask=live)
        if NW > 3:
            tl.store(status + 11 + 4 * s, w3, mask=live)
        record(status, code, kind, nbad, seen, target, epoch)


@triton.jit
def fail_wait(ctrl, W, status, kind, failed, seen, target, epoch):
    """A wait on source ``failed - 1`` ended without its signal: record it (first failure only)."""
    if claim_failure(ctrl, W):
        record(status, _CODE_WAIT, kind, failed - 1, seen, target, epoch)


# one exchange, as every kernel takes part in it


@triton.jit
def alive(ctrl, W):
    """True while no kernel of this rank has failed (after a failure every kernel does nothing); the same in every
    thread (:func:`read_word`)."""
    return read_word(ctrl_failed(ctrl, W), "gpu") == 0


@triton.jit
def next_epoch(ctrl, kind, W):
    """The number of the exchange of ``kind`` this rank starts (one past the last one it finished)."""
    return tl.load(ctrl_epoch_in(ctrl, kind, W)) + 1


@triton.jit
def begin_send(ctrl, kind, W):
    """A sender kernel's exchange number (:func:`next_epoch`), kept in ``epoch_out`` for its receiver kernel."""
    e = next_epoch(ctrl, kind, W)
    tl.store(ctrl_epoch_out(ctrl, kind, W), e)
    return e


@triton.jit
def sent_epoch(ctrl, kind, W):
    """A receiver kernel's exchange number: the one its sender kernel started (:func:`begin_send`)."""
    return tl.load(ctrl_epoch_out(ctrl, kind, W))


@triton.jit
def end_exchange(ctrl, kind, W, e):
    """Exchange ``e`` of ``kind`` is finished on this rank (the next one gets ``e + 1``)."""
    tl.store(ctrl_epoch_in(ctrl, kind, W), e)


@triton.jit
def wait_sources(ctrl, kind, W, target, epoch, notice_addr, status_addr, clock_addr, timeout_ns,
                 HW_TIMER: tl.constexpr):  # fmt: skip
    """Wait until every source's counter of ``kind`` reaches ``target`` (acquire), for at most ``timeout_ns``;
    True when every source came, else the failure is recorded (:func:`fail_wait`, exchange ``epoch``)."""
    clock = ptr(clock_addr, tl.int64)
    deadline = now_ns(clock, HW_TIMER) + timeout_ns
    words = ctrl_counter(ctrl, kind, 0, W)
    failed, seen = wait_counters(words, ptr(notice_addr, tl.int64), W, target, deadline, clock, HW_TIMER)
    if failed != 0:
        fail_wait(ctrl, W, ptr(status_addr, tl.int64), kind, failed, seen, target, epoch)
    return failed == 0


# exact conversions (integer arithmetic: the same bits on a GPU and in the interpreter)


@triton.jit
def f32_from_bf16_bits(b):
    """float32 of bfloat16 bits (int16): exact."""
    return (b.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """bfloat16 bits (int16) of float32 ``x``, rounded to nearest even (NaN: 0x7FC0), as torch rounds."""
    u = x.to(tl.int32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def e4m3_bits(v):
    """e4m3fn bits (int32, 0..255) of float32 ``v`` in [-448, 448], rounded to nearest even (torch's rounding)."""
    u = v.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    exp = a >> 23
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960  # (127 - 7) << 3: rebias, 3 mantissa bits
    m = ((a & 0x7FFFFF) | 0x800000).to(tl.int64)
    s = tl.minimum(141 - exp, 40).to(tl.int64)  # |v| * 2**9 = m >> s for |v| < 2**-6
    sub = ((m + (tl.full(m.shape, 1, tl.int64) << (s - 1)) - 1 + ((m >> s) & 1)) >> s).to(tl.int32)
    code = tl.where(exp >= 121, normal, tl.where(exp == 0, 0, sub))
    return code | sign


@triton.jit
def quantize_row(x):
    """e4m3 bits and float32 scales of a ``[G, 128]`` float32 tile (padding zero): epkit.quant's arithmetic,
    ``scale = max(amax, 1e-4) * (1 / 448)``, ``q = clamp(x / scale, -448, 448)`` (an IEEE division)."""
    amax = tl.maximum(vmax(tl.abs(x), 1), 1e-4)
    scale = amax * _INV_FP8
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return e4m3_bits(q).to(tl.int8), scale


# row copies


@triton.jit
def copy_rows_at(dst, src, live, ROW_WORDS: tl.constexpr, BLOCK_W: tl.constexpr, VEC: tl.constexpr):
    """Copy rows of ``ROW_WORDS`` int32 words from the int64 addresses ``src`` to ``dst`` (blocks of addresses;
    ``live`` masks them); ``VEC``: every address is a multiple of 16 bytes (16-byte vector accesses), else 4.

    The alignment is stated on the ``[rows, words]`` address tensors themselves, where they are made: a hint on the
    row addresses alone gives 16-byte accesses under Triton 3.9 but not under 3.7 (torch 2.13's)."""
    sa = ptr(src, tl.int32)
    da = ptr(dst, tl.int32)
    c = tl.arange(0, BLOCK_W)
    for c0 in tl.static_range(0, ROW_WORDS, BLOCK_W):
        cols = c0 + c
        m = live[:, None] & (cols < ROW_WORDS)[None, :]
        s2 = tl.max_contiguous(tl.multiple_of(sa[:, None] + cols[None, :], [VEC, VEC]), [1, VEC // 4])
        d2 = tl.max_contiguous(tl.multiple_of(da[:, None] + cols[None, :], [VEC, VEC]), [1, VEC // 4])
        tl.store(d2, tl.load(s2, mask=m), mask=m)


@triton.jit
def zero_rows_at(dst, live, ROW_WORDS: tl.constexpr, BLOCK_W: tl.constexpr, VEC: tl.constexpr):
    """Zero rows of ``ROW_WORDS`` int32 words at the int64 addresses ``dst`` where ``live``."""
    da = tl.multiple_of(ptr(dst, tl.int32), VEC)
    c = tl.arange(0, BLOCK_W)
    for c0 in tl.static_range(0, ROW_WORDS, BLOCK_W):
        cols = c0 + c
        m = live[:, None] & (cols < ROW_WORDS)[None, :]
        tl.store(da[:, None] + cols[None, :], tl.full([1, BLOCK_W], 0, tl.int32), mask=m)


@triton.jit
def copy_rows(
    dst, src, rows, nrows, dst_stride, src_stride, ROW_WORDS: tl.constexpr, BLOCK_W: tl.constexpr, VEC: tl.constexpr
):
    """Copy rows ``rows`` (a block of row indices, ``< nrows`` live) from address ``src`` to ``dst`` (int64
    addresses, byte strides); see :func:`copy_rows_at`."""
    r64 = rows.to(tl.int64)
    copy_rows_at(dst + r64 * dst_stride, src + r64 * src_stride, rows < nrows, ROW_WORDS, BLOCK_W, VEC)


@triton.jit
def _row_cols(rows, cols, VEC: tl.constexpr):
    """``[R, C]`` pointers to columns ``cols`` (runs of ``VEC`` elements = 16 bytes) of the 16-byte aligned rows
    ``rows``, with that alignment stated on the tensor made here (where Triton 3.7 keeps it; a hint on ``rows``
    alone gives 16-byte accesses under 3.9 only)."""
    return tl.max_contiguous(tl.multiple_of(rows[:, None] + cols[None, :], [16, 16]), [1, VEC])


@triton.jit
def load_f32(rows, cols, mask, DT: tl.constexpr):
    """float32 ``[R, C]`` of columns ``cols`` of rows at the int64 addresses ``rows`` (16-byte aligned) holding
    bf16 (``DT`` 0), float32 (1) or float16 (2) values: exact."""
    if DT == 0:
        v = f32_from_bf16_bits(tl.load(_row_cols(ptr(rows, tl.int16), cols, 8), mask=mask, other=0))
    elif DT == 1:
        v = tl.load(_row_cols(ptr(rows, tl.float32), cols, 4), mask=mask, other=0.0)
    else:
        v = tl.load(_row_cols(ptr(rows, tl.float16), cols, 8), mask=mask, other=0.0)
        v = v.to(tl.float32)
    return v


@triton.jit
def store_f32(rows, cols, x, mask, DT: tl.constexpr):
    """Store float32 ``x [R, C]`` as bf16 (``DT`` 0), float32 (1) or float16 (2), rounded to nearest even, into
    columns ``cols`` of the rows at the int64 addresses ``rows`` (16-byte aligned)."""
    if DT == 0:
        tl.store(_row_cols(ptr(rows, tl.int16), cols, 8), f32_to_bf16_bits(x), mask=mask)
    elif DT == 1:
        tl.store(_row_cols(ptr(rows, tl.float32), cols, 4), x, mask=mask)
    else:
        tl.store(_row_cols(ptr(rows, tl.float16), cols, 8), x.to(tl.float16), mask=mask)
