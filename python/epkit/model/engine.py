"""The engine loop around :class:`epkit.model.DPEPModel`: :func:`generate`, greedy decoding in lockstep
with every DP rank (:class:`epkit.lockstep.LockstepDriver`: one all-reduce per step for liveness and
the prefill vote; placeholder steps for idle ranks, so every rank enters every dispatch/combine)."""

from __future__ import annotations

import time
from collections import deque

import torch.distributed as dist

from epkit.lockstep import LockstepDriver
from epkit.model.layers import Batch
from epkit.model.model import DPEPModel

__all__ = ["generate"]


def _agree(group, error: str | None, settings) -> None:
    """Every rank of ``group`` learns every rank's input error (and settings) before any step."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    reports = [(error, settings)]
    if world > 1:
        reports = [None] * world
        dist.all_gather_object(reports, (error, settings), group=group)
    bad = [f"rank {r}: {e}" for r, (e, _) in enumerate(reports) if e is not None]
    if bad:
        raise ValueError("generate rejected on every rank before the first step: " + "; ".join(bad))
    if len({tuple(st) for _, st in reports}) > 1:
        raise ValueError(f"generate: the ranks pass different prefill vote intervals: {[st for _, st in reports]}")


def _input_error(model: DPEPModel, prompts, budget: list, max_new_tokens, cap: int) -> str | None:
    """Why this rank's prompts or ``max_new_tokens`` are rejected (None: they are valid)."""
    try:
        if len(budget) != len(prompts) or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budget):
            raise ValueError(f"max_new_tokens must be an int >= 1 or one per prompt, got {max_new_tokens!r}")
        vocab = model.args.vocab_size
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= cap:
                raise ValueError(f"prompt {i} has {len(p)} tokens; each must have 1..{cap} (the prefill capacity)")
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in p):
                raise ValueError(f"prompt {i} holds a token id outside [0, {vocab})")
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def _next_batch(is_prefill: bool, prompts, out, pending: deque, running: list, cap: int, decode_cap: int):
    """This step's ``(batch, active)``: the batch (None: nothing of the step's kind to run here) and
    the prompts it runs. A prefill step admits pending prompts (popped from ``pending``) while they
    fit the prefill capacity ``cap`` and the decode capacity; a decode step runs every running one."""
    if is_prefill:
        admitted, tokens = [], 0
        while pending and tokens + len(prompts[pending[0]]) <= cap and len(running) + len(admitted) < decode_cap:
            tokens += len(prompts[pending[0]])
            admitted.append(pending.popleft())
        return (Batch.prefill([prompts[i] for i in admitted], admitted) if admitted else None), admitted
    active = list(running)
    if not active:
        return None, active
    positions = [len(prompts[i]) + len(out[i]) - 1 for i in active]  # the last token's, after the cached ones
    return Batch.decode([out[i][-1] for i in active], positions, active), active


def _step(model: DPEPModel, is_prefill: bool, batch, stats: dict, on_step) -> list[int]:
    """One forward (a placeholder when ``batch`` is None: its output is discarded); the next token ids."""
    t0 = time.perf_counter()
    if batch is None:
        stats["placeholder_steps"] += 1
        model.forward(Batch.placeholder(is_prefill))
        ids = []
    else:
        stats["tokens"] += batch.num_tokens
        ids = model.forward(batch).argmax(-1).tolist()
    if on_step is not None:
        on_step(is_prefill, batch, time.perf_counter() - t0)
    return ids


def generate(
    model: DPEPModel,
    prompts: list[list[int]],
    max_new_tokens,
    *,
    prefill_attempt_interval: int = 1,
    prefill_any_attempt_interval: int = 16,
    max_steps: int = 100_000,
    on_step=None,
) -> tuple[list[list[int]], dict]:
    """Greedy generation for this rank's prompts, in lockstep with every DP rank (collective).

    Each step, one all-reduce decides whether any rank still has work and whether the group
    prefills (:class:`epkit.lockstep.LockstepDriver`); a rank with nothing of that kind to run
    runs a placeholder batch, so every rank enters every dispatch/combine. A prefill step admits
    pending prompts while they fit the prefill capacity and the decode capacity (a rank whose
    decode slots are full does not ask for prefill). No end-of-sequence token: each prompt gets
    exactly its ``max_new_tokens``.

    Parameters
    ----------
    model : DPEPModel
    prompts : list of lists of token ids (this rank's requests; may be empty)
    max_new_tokens : int or list of int (per prompt), >= 1
    prefill_attempt_interval, prefill_any_attempt_interval : int
        The prefill vote's intervals (see :class:`epkit.lockstep.PrefillVote`).
    max_steps : int
        Safety bound on the number of steps.
    on_step : callable, optional
        ``on_step(is_prefill, batch, seconds)`` after every step (``batch`` None for a placeholder step):
        what ``epkit run`` times.

    Returns
    -------
    (tokens, stats): the generated ids per prompt, and ``{"steps", "prefill_steps",
    "placeholder_steps", "tokens"}`` for this rank (``tokens``: the tokens of its real batches,
    which are what the expert load counts; placeholders excluded).

    Raises
    ------
    ValueError
        On every rank, before the first step, if any rank's prompts or ``max_new_tokens`` are
        invalid or the ranks pass different vote intervals (the message names the rank).
    """
    n = len(prompts)
    budget = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    cap = model.buffer.num_max_tokens_per_rank
    error = _input_error(model, prompts, budget, max_new_tokens, cap)
    _agree(model.groups.cpu_dp_group, error, (prefill_attempt_interval, prefill_any_attempt_interval))
    driver = LockstepDriver(model.groups.cpu_dp_group, prefill_attempt_interval, prefill_any_attempt_interval)
    pending, running = deque(range(n)), []
    out: list[list[int]] = [[] for _ in range(n)]
    stats = {"steps": 0, "prefill_steps": 0, "placeholder_steps": 0, "tokens": 0}
    decode_cap = model.max_decode_tokens_per_rank if model.decode_moe == "low_latency" else cap
    while True:
        with model.timer("lockstep"):
            plan = driver.next_step(
                has_unfinished=bool(pending or running),
                # only a prompt this rank could admit now counts: a full rank that voted for prefill could
                # hold every rank in prefill steps it cannot use while its own sequences never decode
                has_pending_prefill=bool(pending) and len(running) < decode_cap,
                has_running_decode=bool(running),
            )
        if plan is None:
            return out, stats
        stats["steps"] += 1
        stats["prefill_steps"] += int(plan.is_prefill)
        if stats["steps"] > max_steps:
            raise RuntimeError(f"generate: more than max_steps={max_steps} steps")
        batch, active = _next_batch(plan.is_prefill, prompts, out, pending, running, cap, decode_cap)
        for i, t in zip(active, _step(model, plan.is_prefill, batch, stats, on_step)):  # none for a placeholder
            out[i].append(int(t))
            if plan.is_prefill:
                running.append(i)
            if len(out[i]) >= budget[i]:  # finished: its state is released at once
                running.remove(i)
                model.release(i)
