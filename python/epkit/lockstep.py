"""DP lockstep: keep every DP engine on the same step so no rank misses an EP collective.

Three mechanisms (DP attention + Wide-EP engines use all three):

* :func:`has_unfinished` - one ``all_reduce(MAX)`` over the CPU DP group: while
  any rank has work, every rank steps.
* :class:`PrefillVote` - prefill is a group decision. Every
  ``prefill_attempt_interval`` decode steps an ALL vote runs (prefill only if
  every rank has prefill pending); every ``prefill_any_attempt_interval`` steps
  an ANY vote runs (prefill if any rank has), so no rank's prefill starves.
  When no rank is decoding, an ANY vote runs every step (nothing to protect).
* :func:`placeholder_batch` - a rank with nothing scheduled still runs a forward
  on a one-token dummy batch, so it enters every dispatch/combine.

:class:`LockstepDriver` fuses the liveness check and the vote into one
all-reduce per step.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import dataclass

import torch

__all__ = ["has_unfinished", "PrefillVote", "StepPlan", "LockstepDriver", "PlaceholderBatch", "placeholder_batch"]


def _group_size(group) -> int:
    import torch.distributed as dist

    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


_CALLS: dict[tuple[int, ...], int] = {}  # lockstep all-reduces this process made, per group (its global ranks)


def _store():
    import torch.distributed as dist

    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):  # no default group, or one made without a store
        return None


def _all_reduce_max(values: list[int], group) -> list[int]:
    """One ``all_reduce(MAX)`` of ``values`` over ``group``, bounded by the group's timeout. Each rank first
    writes how many lockstep all-reduces of this group it has entered to the job's store (one word, overwritten),
    so that when the all-reduce fails (a peer died, or stopped: the gloo timeout) every rank can say which global
    ranks never got this far: a TimeoutError naming them instead of gloo's message, which names no rank."""
    import torch.distributed as dist

    if _group_size(group) == 1:
        return list(values)
    members = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(_group_size(None)))
    n = _CALLS[members] = _CALLS.get(members, 0) + 1
    store, me = _store(), dist.get_rank()
    prefix = f"epkit/lockstep/{'-'.join(map(str, members))}/"
    if store is not None:  # best effort, off this thread: a store out of reach must not hold the step
        _WORDS.put((store, f"{prefix}{me}", str(n)))
        _start_writer()
    t = torch.tensor(values, dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as exc:
        raise TimeoutError(_who_stopped(store, prefix, members, me, n, exc)) from None
    return t.tolist()


#: Seconds a failed lockstep step gives its peers' words to show they reached it: a dead peer's reset can end
#: the all-reduce at once, before a live but slower peer has got there (it is not the one to name).
BEHIND_GRACE_S = 1.0


#: The words to write to the job's store, in order: ``(store, key, value)``; one daemon thread writes them.
_WORDS: queue.SimpleQueue = queue.SimpleQueue()
_WRITER: list[threading.Thread] = []


def _start_writer() -> None:
    if _WRITER and _WRITER[0].is_alive():
        return

    def write() -> None:
        while True:
            store, key, value = _WORDS.get()
            with contextlib.suppress(Exception):  # best effort: without the word a failure names nobody
                store.set(key, value)

    _WRITER[:] = [threading.Thread(target=write, daemon=True, name="epkit-lockstep-words")]
    _WRITER[0].start()


def _behind(store, prefix: str, members: tuple[int, ...], n: int) -> list[int] | None:
    """The members whose word says they have not entered step ``n``; None when the store cannot tell (it raised,
    or did not answer within a second: a store out of reach must not hold the failing step)."""
    from epkit.collectives.bootstrap import bounded_call

    def read() -> list[int]:
        return [r for r in members if (int(store.get(f"{prefix}{r}")) if store.check([f"{prefix}{r}"]) else 0) < n]

    finished, out = bounded_call(read, 1.0)
    return out if finished and isinstance(out, list) else None


def _who_stopped(store, prefix: str, members: tuple[int, ...], me: int, n: int, exc: Exception) -> str:
    import time

    cause = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
    where = f"rank {me}: lockstep step {n} of DP group {list(members)}"
    behind = None if store is None else _behind(store, prefix, members, n)
    deadline = time.monotonic() + BEHIND_GRACE_S
    while behind and time.monotonic() < deadline:
        time.sleep(0.02)
        behind = _behind(store, prefix, members, n)
    if behind is None:
        return f"{where} failed ({cause}); which rank stopped is unknown (the job's store cannot be read)"
    if behind:
        names = ", ".join(map(str, behind))
        return (
            f"{where}: rank{'s' * (len(behind) > 1)} {names} never reached it (died or stopped; the all-reduce "
            f"ended: {cause})"
        )
    return f"{where} failed ({cause}); every rank had reached it (one failed inside the all-reduce)"


def has_unfinished(local: bool, group=None) -> bool:
    """True while any rank of ``group`` (a CPU/gloo group; None = default group) has unfinished work.

    Collective: every rank of the group must call it once per step.
    """
    return bool(_all_reduce_max([int(bool(local))], group)[0])


def _interval(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class StepPlan:
    """What every rank of the DP group does this step.

    ``is_prefill``: the whole group runs a prefill step (ranks without pending
    prefill run a placeholder prefill); ``vote``: ``"all"``, ``"any"`` or
    ``None`` (no vote this step: decode).
    """

    is_prefill: bool
    vote: str | None


class PrefillVote:
    """Group-wide prefill decisions.

    Parameters
    ----------
    group : ProcessGroup or None
        The CPU DP group (None: the default group).
    prefill_attempt_interval : int
        Decode steps between ALL votes (default 1: every step).
    prefill_any_attempt_interval : int
        Decode steps between ANY votes (default 16). An ANY vote replaces the
        ALL vote on steps where both are due.

    The step counter counts decode steps since the last prefill; it is equal on
    every rank because every decision is collective.
    """

    def __init__(self, group=None, prefill_attempt_interval: int = 1, prefill_any_attempt_interval: int = 16):
        self.group = group
        self.prefill_attempt_interval = _interval("prefill_attempt_interval", prefill_attempt_interval)
        self.prefill_any_attempt_interval = _interval("prefill_any_attempt_interval", prefill_any_attempt_interval)
        self.decode_steps = 0

    def due(self, any_running_decode: bool = True) -> str | None:
        """Which vote the next step runs: ``"any"``, ``"all"`` or None."""
        if not any_running_decode:
            return "any"
        n = self.decode_steps + 1
        if n % self.prefill_any_attempt_interval == 0:
            return "any"
        if n % self.prefill_attempt_interval == 0:
            return "all"
        return None

    def decide(self, any_pending: bool, all_pending: bool, any_running_decode: bool = True) -> StepPlan:
        """Apply the vote to already-reduced flags (no communication) and advance the counter."""
        vote = self.due(any_running_decode)
        is_prefill = (vote == "any" and any_pending) or (vote == "all" and all_pending)
        self.decode_steps = 0 if is_prefill else self.decode_steps + 1
        return StepPlan(is_prefill=is_prefill, vote=vote)

    def step(self, has_pending_prefill: bool, has_running_decode: bool = True) -> StepPlan:
        """Collective: one all-reduce, then the group's plan for this step."""
        p = int(bool(has_pending_prefill))
        any_p, not_all, any_run = _all_reduce_max([p, 1 - p, int(bool(has_running_decode))], self.group)
        return self.decide(bool(any_p), not not_all, bool(any_run))


class LockstepDriver:
    """One all-reduce per step: liveness and the prefill vote together.

    ``next_step(...)`` returns None when no rank of the group has unfinished work
    (every rank then leaves its loop on the same step), else the :class:`StepPlan`.
    """

    def __init__(self, group=None, prefill_attempt_interval: int = 1, prefill_any_attempt_interval: int = 16):
        self.vote = PrefillVote(group, prefill_attempt_interval, prefill_any_attempt_interval)
        self.group = group
        self.steps = 0

    def next_step(
        self, *, has_unfinished: bool, has_pending_prefill: bool, has_running_decode: bool
    ) -> StepPlan | None:
        p = int(bool(has_pending_prefill))
        flags = [int(bool(has_unfinished)), p, 1 - p, int(bool(has_running_decode))]
        alive, any_p, not_all, any_run = _all_reduce_max(flags, self.group)
        if not alive:
            return None
        self.steps += 1
        return self.vote.decide(bool(any_p), not not_all, bool(any_run))


@dataclass(frozen=True)
class PlaceholderBatch:
    """A dummy batch for a rank with nothing scheduled; its outputs are discarded.

    ``token_ids [num_tokens] int32`` (``token_id``), ``positions [num_tokens] int32`` (0..),
    ``cu_seqlens [2] int32`` (one sequence), ``is_prompt``.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    is_prompt: bool
    is_placeholder: bool = True


def placeholder_batch(
    is_prompt: bool, num_tokens: int = 1, token_id: int = 0, device: torch.device | str = "cpu"
) -> PlaceholderBatch:
    """Build the one-sequence dummy batch an idle rank runs so that it still enters every EP collective."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if token_id < 0:
        raise ValueError(f"token_id must be >= 0, got {token_id}")
    return PlaceholderBatch(
        token_ids=torch.full((num_tokens,), token_id, dtype=torch.int32, device=device),
        positions=torch.arange(num_tokens, dtype=torch.int32, device=device),
        cu_seqlens=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        is_prompt=is_prompt,
    )
