"""A normal dispatch with worst-case outputs (``EPBuffer.dispatch(num_worst_tokens=N)``, DeepEP's
``num_worst_tokens`` and V2's ``do_cpu_sync=False``): the outputs are sized before anyone knows how many rows
arrive, ``N`` rows (``[worst_shape]`` expanded rows with ``expand=True``), so that no host read sizes them; rows
past the received ones are padding (expert ids -1, weights 0, zero rows, ``m_indices`` -1).

Every rank must pass the same ``N``, and no rank may receive more than it allows: both are judged on every rank
from every rank's counts, so that a violation is the same ``ValueError`` on every rank before any row moves. The
device kernels judge on the device (``ep_normal._judge_worst``: the call returns without a host read, and the
error surfaces at the rank's next call, retiring the buffer, as the low-latency mode's stream-ordered errors do;
the rank whose own call was invalid raises at once); the host-driven paths in one small exchange before the
dispatch (:func:`check_worst`; the buffer goes on).

The device kernels' notify messages carry ``N`` in their format word (:func:`format_word`): a rank whose ``N``
differs from another's (0 included: a plain dispatch) is told so there; the host paths' exchange marks its
messages (word 0 below -1), which a plain dispatch's agreement recognises (:func:`worst_message_of`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from epkit.collectives.ep.config import EPConfig
from epkit.collectives.ep.context import EPContext
from epkit.collectives.ep.handles import DispatchResult
from epkit.collectives.ep.ll_layout import describe_header
from epkit.collectives.ep.rows import META_MSG, align_up, check_formats, decode_error, encode_error, rank_name
from epkit.kernels.triton.ep_layout import OK, REJECTED

__all__ = [
    "FORMAT_UNIT",
    "REJECTED_WHAT",
    "agreement_mismatch",
    "check_worst",
    "format_word",
    "judge_notify",
    "pad_result",
    "worst_error",
    "worst_message_of",
    "worst_shape",
]

#: A notify message's format word: the row format code plus ``FORMAT_UNIT * num_worst_tokens``.
FORMAT_UNIT = 16
#: The start of every dispatch rejection.
REJECTED_WHAT = "dispatch rejected on every rank before any data moved"


def format_word(fmt: int, num_worst_tokens: int) -> int:
    """The format word of a notify message: row format ``fmt`` (``rows.format_code``) and ``num_worst_tokens``."""
    return fmt + FORMAT_UNIT * num_worst_tokens


def worst_shape(cfg: EPConfig, num_worst_tokens: int, alignment: int) -> tuple[int, int]:
    """``(rows, expanded rows)`` of a worst-case dispatch's outputs: ``num_worst_tokens`` received rows, and room
    for each of them to hold ``min(num_topk, num_local_experts)`` local experts, with every local expert's group
    padded to ``alignment`` (DeepEP V2's bound)."""
    n, k, local = num_worst_tokens, cfg.num_topk, cfg.num_local_experts
    return n, align_up(n * min(k, local) + (alignment - 1) * local, alignment)


def worst_error(num_worst_tokens: object) -> str | None:
    """This rank's own verdict on ``num_worst_tokens`` (an int >= 0; 0 is a plain dispatch), or None."""
    if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
        return f"num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}"
    return None


def _mismatch(ns: Sequence[int], ranks: Sequence[int]) -> str:
    each = "; ".join(f"{rank_name(r, ranks)}: {n}" for r, n in enumerate(ns))
    return f"{REJECTED_WHAT}: the ranks' num_worst_tokens differ ({each}); every rank must pass the same"


def judge_notify(
    codes: Sequence[int], words: Sequence[int], rows: Sequence[int] | None, expanded: Sequence[int] | None,
    shape: tuple[int, int] | None, ranks: Sequence[int], text_of: Callable[[int], str],
) -> ValueError | None:  # fmt: skip
    """The verdict of a dispatch's layout exchange from every rank's status ``codes`` (``OK``, ``REJECTED`` with the
    text ``text_of(rank)``, ...), format ``words`` (:func:`format_word`) and, for a worst-case dispatch, the
    ``rows`` and ``expanded`` rows each rank receives against its ``shape`` (:func:`worst_shape`): the same
    ValueError on every rank, or None. Order: rejected calls, different ``num_worst_tokens``, different row
    formats, a rank receiving more than the worst case."""
    errors = []
    for src, c in enumerate(codes):
        if c != OK:
            found = describe_header(src, c, 0, text_of(src) if c == REJECTED else "", ranks)
            assert found is not None  # every status but OK is an error
            errors.append(found)
    if errors:
        return ValueError(f"{REJECTED_WHAT}: " + "; ".join(errors))
    ns = [w // FORMAT_UNIT for w in words]
    if len(set(ns)) != 1:
        return ValueError(_mismatch(ns, ranks))
    try:
        check_formats([w % FORMAT_UNIT for w in words], ranks)
    except ValueError as exc:
        return exc
    if shape is None or rows is None or expanded is None:
        return None
    over = [r for r in range(len(rows)) if rows[r] > shape[0] or expanded[r] > shape[1]]
    if not over:
        return None
    each = "; ".join(f"{rank_name(r, ranks)}: {rows[r]} rows, {expanded[r]} expanded" for r in over)
    return ValueError(
        f"{REJECTED_WHAT}: num_worst_tokens={ns[0]} leaves room for {shape[0]} rows ({shape[1]} expanded rows) per "
        f"rank, but {each}; raise num_worst_tokens (the most a rank can receive is world_size * "
        f"num_max_tokens_per_rank)"
    )


def worst_message_of(word0: int) -> int | None:
    """The ``num_worst_tokens`` of a host-path worst-case count message, from its first word (None: not one)."""
    return -word0 - 2 if word0 < -1 else None


def _message_bytes(cfg: EPConfig) -> int:
    return 8 * (3 + cfg.world_size + cfg.num_experts) + META_MSG


def check_worst(
    ctx: EPContext, num_worst_tokens: int, error: str | None, fmt: int, counts: tuple[torch.Tensor, torch.Tensor],
    alignment: int,
) -> tuple[int, int]:  # fmt: skip
    """The host paths' judgement of a worst-case dispatch, before it (one exchange of every rank's
    ``[-(2 + N), status, format word, tokens per rank [W], pairs per expert [E]]`` and error text): the same
    ValueError on every rank (:func:`judge_notify`), or the outputs' shape. ``error``: this rank's own verdict on
    its call; ``counts``: its ``(num_tokens_per_rank [W], num_tokens_per_expert [E])``."""
    cfg = ctx.cfg
    w, e, n = cfg.world_size, cfg.num_experts, num_worst_tokens
    words = torch.zeros(3 + w + e, dtype=torch.int64)
    words[0] = -(2 + n)  # what marks the message as a worst-case dispatch's (a plain one's word 0 is -1 or more)
    if error is None:
        words[2] = format_word(fmt, n)
        words[3 : 3 + w] = counts[0].to(torch.int64).cpu()
        words[3 + w :] = counts[1].to(torch.int64).cpu()
    else:
        words[1] = REJECTED
    size = _message_bytes(cfg)
    msg = torch.zeros(size, dtype=torch.uint8)
    msg[: words.numel() * 8] = words.view(torch.uint8)
    if error is not None:
        msg[words.numel() * 8 :] = encode_error(error)
    got = ctx.buffer.all_to_all([msg] * w, [size] * w, ctx.region_bytes, tag="layout")
    ns = [worst_message_of(int(g[:8].view(torch.int64)[0])) for g in got]
    if any(m is None for m in ns):  # a plain dispatch's agreement message among them: num_worst_tokens 0 there
        raise ValueError(_mismatch([m or 0 for m in ns], cfg.ranks))
    mat = torch.stack([g[: words.numel() * 8].view(torch.int64) for g in got])  # [src, 3 + W + E]: all this size
    per_rank, per_expert = mat[:, 3 : 3 + w], mat[:, 3 + w :]
    shape = worst_shape(cfg, n, alignment)
    rows = per_rank.sum(0).tolist()
    pairs = per_expert.sum(0).view(w, cfg.num_local_experts)
    expanded = align_up(pairs, alignment).sum(1).tolist()
    found = judge_notify(
        mat[:, 1].tolist(), mat[:, 2].tolist(), rows, expanded, shape, cfg.ranks,
        lambda src: decode_error(got[src][8 * (3 + w + e) :]),
    )  # fmt: skip
    if found is not None:
        raise found
    return shape


def agreement_mismatch(got: Sequence[torch.Tensor], ranks: Sequence[int]) -> ValueError | None:
    """A plain dispatch's agreement among ranks some of which made a worst-case dispatch (their messages' first
    word says so): the mismatch error every rank raises, or None."""
    ns = [worst_message_of(int(g[:8].view(torch.int64)[0])) for g in got]
    if all(n is None for n in ns):
        return None
    return ValueError(_mismatch([n or 0 for n in ns], ranks))


def _pad(t: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """``t`` with rows appended up to ``rows``, filled with ``value``."""
    out = torch.full((rows, *t.shape[1:]), value, dtype=t.dtype, device=t.device)
    out[: t.shape[0]].copy_(t)
    return out


def pad_result(result: DispatchResult, shape: tuple[int, int], local: int) -> DispatchResult:
    """A host path's dispatch result in worst-case shape: ``x`` (and scales) ``shape[1]`` rows when expanded, else
    ``shape[0]``, zero-padded; expert ids -1 and weights 0 past the received rows; the counts as a ``[local]``
    int32 tensor on the rows' device (what the device path returns, which never reads them). The handle keeps the
    received rows and notes the shape (``DispatchHandle.worst``: a combine takes ``y`` of that many rows)."""
    handle = result.handle
    x_rows = shape[1] if handle.expand else shape[0]
    x = result.recv_x
    padded_x = tuple(_pad(t, x_rows, 0) for t in x) if isinstance(x, tuple) else _pad(x, x_rows, 0)
    handle.worst = shape
    counts = torch.tensor(result.num_recv_tokens_per_expert, dtype=torch.int32).to(handle.device)
    assert counts.numel() == local
    return DispatchResult(
        padded_x, _pad(result.recv_topk_idx, shape[0], -1), _pad(result.recv_topk_weights, shape[0], 0), counts,
        handle,
    )  # fmt: skip
