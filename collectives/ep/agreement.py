"""The agreement every normal-mode call makes before any row moves, on the host-driven paths: one small exchange
in which every rank tells every rank its verdict on its own call (or the rows it will send), so that a bad call on
one rank is the same ``ValueError`` on every rank and the buffer goes on. The device path makes the same
agreement in a kernel (``normal_device``) and judges it here too (:func:`judge_agreement`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from epkit.collectives.ep.context import EPContext
from epkit.collectives.ep.handles import DispatchHandle
from epkit.collectives.ep.rows import (
    META_MSG,
    ROW_DTYPES,
    check_formats,
    decode_error,
    encode_error,
    format_code,
    rank_name,
)
from epkit.collectives.ep.worst import agreement_mismatch

__all__ = ["Meanwhile", "agree_on_handle", "agree_rows", "agreement_error", "error_text", "judge_agreement"]

#: Work of this rank's to do while an exchange's messages move (``Exchange.receive``'s ``meanwhile``), or None.
Meanwhile = Callable[[], None] | None


def error_text(exc: BaseException) -> str:
    """What a rank tells its peers of its own call's failure: a ValueError's text, anything else's type too."""
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def agree_rows(
    ctx: EPContext, error: str | None, rows: list[torch.Tensor], num_words: int, meanwhile: Meanwhile = None
) -> list[torch.Tensor]:
    """Send each destination its int64 meta row (or this rank's error); raise if any rank failed. ``meanwhile``:
    work of this rank's to do while the messages move (``Exchange.receive``'s). Returns the rows received."""
    w = ctx.cfg.world_size
    nbytes = num_words * 8 + META_MSG
    send = []
    for r in range(w):
        msg = torch.zeros(nbytes, dtype=torch.uint8)
        if error is None:
            msg[: num_words * 8].copy_(rows[r].view(torch.uint8))
        else:
            msg[:8].view(torch.int64)[0] = -1
            msg[num_words * 8 :].copy_(encode_error(error))
        send.append(msg)
    got = ctx.buffer.all_to_all(send, [nbytes] * w, ctx.region_bytes, tag="layout", meanwhile=meanwhile)
    mismatch = agreement_mismatch(got, ctx.cfg.ranks)  # some rank made a worst-case dispatch (ep/worst.py)
    if mismatch is not None:
        raise mismatch
    errors = []
    for src, g in enumerate(got):
        if int(g[:8].view(torch.int64)[0]) == -1:
            errors.append(f"{ctx.cfg.rank_name(src)}: {decode_error(g[num_words * 8 :])}")
    if errors:
        raise ValueError("dispatch rejected on every rank before any data moved: " + "; ".join(errors))
    return [g[: num_words * 8].view(torch.int64) for g in got]


def agree_on_handle(
    ctx: EPContext,
    what: str,
    handle: DispatchHandle,
    error: str | None,
    meanwhile: Meanwhile = None,
    fmt: tuple[torch.dtype, bool] | None = None,
) -> None:
    """Before any row of a combine or cached dispatch moves: every rank tells every rank which dispatch its
    handle comes from and the format of the rows it will send (``fmt``: their dtype and whether FP8 scales come
    with them), or why its call is invalid (one small exchange). Raises the same ValueError on every rank unless
    every call is valid, every handle is this buffer's, from one and the same dispatch (a handle of another buffer,
    or a stale one on some ranks, would pair rows that do not belong together), and every rank's rows have one
    format (each rank sizes what it receives by its own). The buffer stays usable either way. ``meanwhile``: work
    of this rank's to do while the messages move."""
    w = ctx.cfg.world_size
    head = torch.zeros(4, dtype=torch.int64)
    if error is None:
        code = format_code(*fmt) if fmt is not None and fmt[0] in ROW_DTYPES else 0
        head[:] = torch.tensor([0, handle.buffer_id, handle.epoch, code])
    else:
        head[0] = -1
    msg = torch.cat([head.view(torch.uint8), encode_error(error or "")])
    got = ctx.buffer.all_to_all(
        [msg] * w, [msg.numel()] * w, ctx.region_bytes, tag=f"{what} agreement", meanwhile=meanwhile
    )
    heads = [g[:32].view(torch.int64).tolist() for g in got]
    judge_agreement(ctx, what, [h[:3] for h in heads], lambda r: decode_error(got[r][32:]))
    formats = [h[3] for h in heads]
    if len(set(formats)) != 1:
        try:
            check_formats(formats, ctx.cfg.ranks, "the rows (x)" if what == "cached dispatch" else "the rows (y)")
        except ValueError as exc:
            raise ValueError(f"{what} rejected on every rank before any row moved: {exc}") from None


def judge_agreement(ctx: EPContext, what: str, heads: list[list[int]], text_of: Callable[[int], str]) -> None:
    """The agreement's verdict from every rank's ``[status (0: valid), buffer id, dispatch epoch]``;
    ``text_of(rank)`` reads a rejecting rank's error text. The same ValueError on every rank, or None."""
    found = agreement_error(what, heads, text_of, ctx.buffer.buffer_id, ctx.cfg.ranks)
    if found is not None:
        raise found


def agreement_error(
    what: str, heads: list[list[int]], text_of: Callable[[int], str], buffer_id: int, ranks: Sequence[int]
) -> ValueError | None:
    """:func:`judge_agreement`'s error (None: every call valid, every handle from one dispatch of the buffer
    ``buffer_id``), from every rank's words; ``ranks``: the global rank of each position."""
    errors = [f"{rank_name(r, ranks)}: {text_of(r)}" for r, h in enumerate(heads) if h[0] != 0]
    if errors:
        return ValueError(f"{what} rejected on every rank before any row moved: " + "; ".join(errors))
    if any(h[1:] != heads[0][1:] for h in heads) or heads[0][1] != buffer_id:
        desc = "; ".join(
            f"{rank_name(r, ranks)}: {'this buffer' if h[1] == buffer_id else f'another buffer ({h[1]:x})'}'s "
            f"dispatch {h[2]}"
            for r, h in enumerate(heads)
        )
        return ValueError(
            f"{what} rejected on every rank before any row moved: the handles do not come from one dispatch of "
            f"this buffer ({desc}); give every rank the handle its matching dispatch returned"
        )
    return None
