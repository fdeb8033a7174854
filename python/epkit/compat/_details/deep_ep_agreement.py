"""How the ranks of ``epkit.compat.deep_ep.Buffer`` agree on each call that moves rows before anything collective
depends on its arguments.

The shim picks (or makes) its EPBuffer from a call's arguments: hidden size, experts, top-k, token counts, the
handle. Ranks whose arguments differ would go separate ways, one into a buffer's exchange, another into making a
new buffer or into another buffer's exchange, and both would wait out their timeouts; a rank that raised alone
would leave its peers' messages to pair with its next call. So every dispatch, cached dispatch and combine (normal
and low-latency) first gathers one fixed-size int64 row from every rank (one all-gather over the group): the
call's kind and number on this Buffer, whether this rank rejected it (and its error text), its token count, and
the arguments every rank must share. Every rank reads the same rows and raises the same ``ValueError``: the
arguments that differ, each with which global rank has which value; else, calls out of step; else, each rejecting
rank's error. Only then is a buffer picked or made, the same one on every rank, and a row moved.

In shrink mode (``Buffer(..., enable_shrink=True)``) the low-latency calls' rows (:data:`SHRINK_KINDS`) meet through
the job's store among the unmasked ranks instead, masking the ranks that stay silent (``deep_ep_shrink``); the
errors name the unmasked ranks only.

The wait has the Buffer's timeout. A rank still waiting after :data:`NOTE_AFTER` seconds notes in the job's
store which call it waits in, so that at the timeout the ranks without that note are named as the silent
ones (a call that completes in time costs no store access). On an NCCL group the rows are CUDA tensors, the
wait is NCCL's own, and the Buffer's low-latency calls make no agreement (they stay stream-ordered).
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from epkit._details.host_memory import mark_host_memory
from epkit.collectives.bootstrap import Rendezvous
from epkit.collectives.deadline import deadline_after
from epkit.collectives.ep.rows import META_MSG, decode_error, encode_error
from epkit.collectives.transports.base import rank_name

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from epkit.compat._details.deep_ep_shrink import RankMask

__all__ = ["SHRINK_KINDS", "CallAgreement", "FieldValue", "all_gather_into", "describe_differences", "size_of"]

#: int64 words of a rank's row before its error text (every row has the same size, whatever the call: a row of
#: another call must pair).
HEAD_WORDS = 16
#: int64 words of a rejecting rank's error text (``encode_error``'s field), after the head: every rank reads every
#: rejection's text, so all of them raise the same message.
TEXT_WORDS = META_MSG // 8
ROW_WORDS = HEAD_WORDS + TEXT_WORDS
#: The calls that agree, by their code in a row (1-based): every call of a buffer that moves rows, and its barrier;
#: then ``epkit.compat.deep_gemm``'s Mega MoE layer calls, which agree the same way; then the ElasticBuffer's
#: collective calls past dispatch and combine (Engram, pipeline configuration, the all-gather session).
KINDS = ("dispatch", "low_latency_dispatch", "cached dispatch", "combine", "low_latency_combine", "barrier",
         "fp8_fp4_mega_moe", "bf16_mega_moe", "clean_low_latency_buffer", "engram_write", "engram_fetch",
         "pp_set_config", "agrs_set_config", "all_gather", "destroy_agrs_session")  # fmt: skip
#: The calls that meet through the job's store among the unmasked ranks in shrink mode (``deep_ep_shrink``); the
#: normal mode's meet as without it.
SHRINK_KINDS = ("low_latency_dispatch", "low_latency_combine", "clean_low_latency_buffer")
#: dtypes by their code in a row (another dtype is ``len(DTYPES)``); -1 is a value a rejected call could not tell.
DTYPES = (
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
#: Seconds a rank waits in an agreement before it notes in the job's store that it waits there.
NOTE_AFTER = 1.0
#: One tensor gathered into one (torch 2.13 renamed it; a list of tensors would cost gloo half as much again).
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: A value of an agreement's field: an int, a dtype, or None where a rejected call could not tell it.
FieldValue = int | torch.dtype | None


def size_of(t: object, dim: int) -> int | None:
    """``t.shape[dim]`` of a 2-D tensor ``t``, else None (a value a rejected call could not tell)."""
    return t.shape[dim] if isinstance(t, torch.Tensor) and t.dim() == 2 else None


def _code(value: FieldValue) -> int:
    if value is None:
        return -1
    if isinstance(value, torch.dtype):
        return DTYPES.index(value) if value in DTYPES else len(DTYPES)
    return int(value)


def _show(code: int, is_dtype: bool) -> str:
    if not is_dtype:
        return str(code)
    return str(DTYPES[code]) if code < len(DTYPES) else "another dtype"


def _ranks(ranks: list[int], global_ranks: list[int] | None) -> str:
    names = [global_ranks[r] if global_ranks is not None else r for r in ranks]
    return f"rank {names[0]} has" if len(names) == 1 else f"ranks {', '.join(map(str, names))} have"


def describe_differences(
    fields: list[tuple[str, bool]], rows: list[list[int]], global_ranks: list[int] | None = None
) -> str | None:
    """``"name: rank 0 has 64, rank 1 has 128; ..."`` for each field ``(name, is_dtype)`` whose values differ
    across ``rows`` (one per rank, one value per field; -1 unknown, left out), ranks grouped by value in the order
    of their first rank and named by ``global_ranks`` (the group's global rank of each position; None: the
    positions); None when every field agrees."""
    parts = []
    for i, (name, is_dtype) in enumerate(fields):
        by_value: dict[int, list[int]] = {}
        for r, row in enumerate(rows):
            if row[i] != -1:
                by_value.setdefault(row[i], []).append(r)
        if len(by_value) > 1:
            groups = sorted(by_value.items(), key=lambda kv: kv[1][0])
            parts.append(
                f"{name}: " + ", ".join(f"{_ranks(rs, global_ranks)} {_show(v, is_dtype)}" for v, rs in groups)
            )
    return "; ".join(parts) or None


class CallAgreement:
    """The agreement of one Buffer's dispatches (see the module docstring); made with the Buffer, on every rank."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        #: Shrink mode (``deep_ep_shrink``): the rows meet through the job's store among the unmasked ranks only.
        self.shrink: RankMask | None = None
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self.nccl = "nccl" in str(dist.get_backend(group))
        self._calls = 0
        # where a waiting rank notes its call (no communication: made in the same order everywhere)
        self._rv: Rendezvous | None = None
        if not self.nccl:
            try:
                self._rv = Rendezvous(group, 30.0, "deep_ep Buffer call")
            except Exception:  # noqa: BLE001 -- no job store to note in: a timeout then names no rank
                self._rv = None

    def __call__(
        self, fn: str, error: str | None, fields: list[tuple[str, FieldValue]], timeout: float, tokens: int = 0
    ) -> int:
        """Agree on call ``fn`` (``error``: this rank's rejection, or None; ``fields``: ``(name, value)`` of the
        arguments every rank must share, a value an int, a dtype or None for unknown; a name ending in ``dtype``
        shows dtypes). Returns the largest ``tokens`` of any rank, or raises the same ValueError on every rank."""
        self._calls += 1
        values = [_code(v) for _, v in fields]
        head = [KINDS.index(fn) + 1, self._calls, int(error is not None), tokens, *values]
        if len(head) > HEAD_WORDS:
            raise AssertionError(f"{fn}: {len(fields)} fields do not fit an agreement row")
        text = mark_host_memory(encode_error(error or "").view(torch.int64)).tolist()  # the host's own text
        row = head + [0] * (HEAD_WORDS - len(head)) + text
        names = [(name, name.endswith("dtype")) for name, _ in fields]
        who = self.global_ranks
        if self.shrink is None or fn not in SHRINK_KINDS:
            rows = self._gather(row, fn, timeout)
        else:  # the unmasked ranks' rows, named by their global ranks
            got = self.shrink.gather(torch.tensor(row, dtype=torch.int64), fn, timeout, 0)
            present = self.shrink.unmasked()
            rows, who = got[list(present)].tolist(), [self.global_ranks[r] for r in present]
        if all(r[:2] == rows[0][:2] for r in rows):
            differ = describe_differences(names, [r[4 : 4 + len(fields)] for r in rows], who)
            if differ is not None:
                raise ValueError(
                    f"{fn} rejected on every rank: the ranks' arguments differ ({differ}); every rank must pass the "
                    "same shapes and dtypes"
                )
        else:
            calls = "; ".join(
                f"{rank_name(r, who)}: {KINDS[k - 1] if 0 < k <= len(KINDS) else 'another call'} (call {n} on this "
                "Buffer)"
                for r, (k, n) in enumerate(r[:2] for r in rows)
            )
            raise ValueError(f"{fn} rejected on every rank: the ranks' calls are out of step ({calls})")
        bad = [r for r, row in enumerate(rows) if row[2]]
        if bad:
            texts = "; ".join(
                f"{rank_name(r, who)}: {decode_error(torch.tensor(rows[r][HEAD_WORDS:]).view(torch.uint8))}"
                for r in bad
            )
            raise ValueError(f"{fn} rejected on every rank before any row moved: {texts}")
        return max(row[3] for row in rows)

    def _gather(self, row: list[int], fn: str, timeout: float) -> list[list[int]]:
        mine = torch.tensor(row, dtype=torch.int64, device="cuda" if self.nccl else "cpu")
        got = self.gather(mine, fn, timeout)
        if self.nccl:  # an NCCL group gathers on the GPU: the agreement's one read back there (of host values)
            got = got.cpu()
        return mark_host_memory(got).tolist()  # a gloo group's gather is host memory

    def gather(self, mine: torch.Tensor, fn: str, timeout: float, fill: int = 0) -> torch.Tensor:
        """Every rank's ``mine`` (contiguous, the same shape and dtype on every rank: call it only after an
        agreement that makes it so), ``[W, *mine.shape]``: a wait of ``timeout`` naming the silent ranks on CPU
        ranks; on an NCCL group stream-ordered, no host read. In shrink mode the masked ranks' rows are ``fill``."""
        if self.shrink is not None and fn in SHRINK_KINDS:
            return self.shrink.gather(mine, fn, timeout, fill).to(mine.device)
        flat = mine.contiguous().view(-1)
        got = flat.new_empty(self.world_size * flat.numel())
        if self.nccl:
            all_gather_into(got, flat, group=self.group)
        else:
            self.wait(all_gather_into(got, flat, group=self.group, async_op=True), fn, timeout)
        return got.view(self.world_size, *mine.shape)

    def wait(self, work: dist.Work, fn: str, timeout: float) -> None:
        """Wait up to ``timeout`` (or the enclosing ``within`` block's deadline) for ``work``, a collective over the
        group that call ``fn`` (agreed, this buffer's latest) started on a gloo group; a TimeoutError names the
        ranks that noted no wait in this call (they died, or stopped calling)."""
        deadline = deadline_after(timeout)
        noted = False
        while True:
            left = deadline - time.monotonic()
            try:
                work.wait(timedelta(seconds=max(left if noted else min(left, NOTE_AFTER), 1e-3)))
                return
            except RuntimeError as exc:  # gloo: a timeout, or the connection to a peer that died
                timed_out = "timed out" in str(exc).lower()
                if timed_out and not noted and left > NOTE_AFTER:
                    noted = self._note()
                    continue
                cause = None if timed_out else str(exc).strip().splitlines()[0][:200]
                raise TimeoutError(self._silence(fn, timeout, cause)) from None

    def _note(self) -> bool:
        """Note in the job's store that this rank waits in its current call (True once noted)."""
        with contextlib.suppress(Exception):  # no store (or none left): the timeout names no rank
            if self._rv is not None:
                self._rv.store.set(f"waiting/{self.rank}", str(self._calls))
        return True

    def _silence(self, fn: str, timeout: float, cause: str | None) -> str:
        """The TimeoutError's text: the ranks that noted no wait in this call, by group and global rank; ``cause``:
        gloo's error when the wait ended early (a peer's connection closed), None for a timeout."""
        silent = None
        if self._rv is not None:
            try:
                store = self._rv.store
                silent = [
                    r
                    for r in range(self.world_size)
                    if r != self.rank
                    and not (store.check([f"waiting/{r}"]) and store.get(f"waiting/{r}").decode() == str(self._calls))
                ]
            except Exception:  # noqa: BLE001 -- no store left: name no rank
                silent = None
        who = "a rank of the group" if not silent else ", ".join(rank_name(r, self.global_ranks) for r in silent)
        what = f"did not come within {timeout:g} s" if cause is None else f"is gone ({cause})"
        return (
            f"{rank_name(self.rank, self.global_ranks)}: {fn}'s agreement (call {self._calls} on this Buffer): {who} "
            f"{what}; it died, or stopped calling"
        )
