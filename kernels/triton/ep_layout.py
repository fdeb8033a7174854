"""Constants the dispatch/combine kernels and their host side share (plain Python: no Triton needed to import).

Exchange kinds (each with its own counters and epoch words), the status block's layout and codes, the
low-latency header's status codes, and the control words' size. ``ep_common.py`` documents the layouts.
"""

from __future__ import annotations

__all__ = [
    "ALIGN",
    "BAD_IDS",
    "CODE_AGREE",
    "CODE_HANDLES",
    "CODE_HEADERS",
    "CODE_NOTIFY",
    "CODE_WAIT",
    "COMBINE_HEAD",
    "INV_FP8_MAX",
    "KINDS",
    "NUM_KINDS",
    "OK",
    "OVERFLOW",
    "REJECTED",
    "STATUS_DETAIL",
    "STATUS_WORDS",
    "check_aligned",
    "control_words",
]

#: Exchange kinds, each with its own counters and epoch words (index = position).
KINDS = ("ll_dispatch", "ll_combine", "notify", "dispatch", "agree", "combine")
NUM_KINDS = len(KINDS)
#: Byte alignment of every row field the kernels move (16-byte vector accesses).
ALIGN = 16
#: Status codes of the status block: a wait that ended without its signal (timeout or notice), rejected
#: low-latency headers, combine messages of different dispatches, a worst-case dispatch's notify judged on the
#: device (a rejecting rank, different ``num_worst_tokens`` or formats, more rows than the worst case), an
#: agreement judged on the device (a worst-case dispatch's combine or cached dispatch: a rejecting rank, handles
#: of different dispatches).
CODE_WAIT, CODE_HEADERS, CODE_HANDLES, CODE_NOTIFY, CODE_AGREE = 1, 2, 3, 4, 5
#: Words of the status block before the per-source details, and detail words per source.
STATUS_WORDS, STATUS_DETAIL = 8, 4
#: Status word of a low-latency message header (and of a normal-mode notify message).
OK, REJECTED, BAD_IDS, OVERFLOW = 0, -1, -2, -3
#: Bytes before the rows of a low-latency combine message: int64 [buffer id, dispatch epoch] of the handle.
COMBINE_HEAD = 64
#: 1 / 448, the e4m3 maximum's inverse: scales are ``max(amax, 1e-4) * INV_FP8_MAX`` (epkit.quant's arithmetic).
INV_FP8_MAX = 1.0 / 448.0


def control_words(world_size: int) -> int:
    """Control words per rank: a counter per (kind, source), an epoch pair per kind, the failed word."""
    return NUM_KINDS * world_size + 2 * NUM_KINDS + 1


def check_aligned(what: str, t) -> None:
    """ValueError unless the rows of tensor ``t`` (None passes) can be moved with the kernels' 16-byte accesses:
    a contiguous tensor must start on an :data:`ALIGN`-byte boundary (a sliced view may not, and would fault on a
    GPU); a non-contiguous one is copied before any kernel reads it."""
    if t is None or not t.is_contiguous() or t.data_ptr() % ALIGN == 0:
        return
    raise ValueError(
        f"{what} must start on a {ALIGN}-byte boundary (the device kernels move rows with {ALIGN}-byte accesses); "
        f"its address is {t.data_ptr() % ALIGN} bytes past one: pass a fresh tensor (.clone())"
    )
