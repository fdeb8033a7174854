"""The engine loop around :class:`epkit.model.DPEPModel`: :func:`generate`, greedy decoding in lockstep
with every DP rank (:class:`epkit.lockstep.LockstepDriver`: one all-reduce per step for liveness and
the prefill vote; placeholder steps for idle ranks, so every rank enters every dispatch/combine).

With context parallelism (``cp_size > 1``) every CP rank of an engine passes the engine's same prompts: a
prefill step runs them context-parallel (:func:`~epkit.model.cp_prefill.cp_prefill`), after which sequence ``i`` is
decoded by CP rank ``i % cp`` alone, from the gathered KV (the other CP ranks drop it); the CP ranks keep the
same schedule, so their votes agree. The tokens are gathered over the CP group at the end: every CP rank
returns every sequence's."""

from __future__ import annotations

import time
from collections import deque

import torch.distributed as dist

from epkit.lockstep import LockstepDriver
from epkit.model.cp_prefill import cp_prefill_slots
from epkit.model.layers import Batch
from epkit.model.model import DPEPModel

__all__ = ["generate", "max_prompt_len"]


def max_prompt_len(cap: int, cp_size: int) -> int:
    """The longest prompt a prefill capacity of ``cap`` rows per rank takes (over ``cp_size`` CP ranks)."""
    return cap if cp_size == 1 else cap // 2 * 2 * cp_size


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
    """Why this rank's prompts or ``max_new_tokens`` are rejected (None: they are valid). With CP a prompt
    fits when its zigzag share does (:func:`~epkit.model.cp_prefill.cp_prefill_slots`)."""
    try:
        if len(budget) != len(prompts) or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budget):
            raise ValueError(f"max_new_tokens must be an int >= 1 or one per prompt, got {max_new_tokens!r}")
        vocab = model.args.vocab_size
        longest = max_prompt_len(cap, model.cp_size)
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= longest:
                over = "" if model.cp_size == 1 else f" over CP {model.cp_size}"
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; each must have 1..{longest} (the prefill capacity{over})"
                )
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in p):
                raise ValueError(f"prompt {i} holds a token id outside [0, {vocab})")
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


class _Engine:
    """The sequences of one engine (its CP ranks share them; without CP, this rank's): which are pending and
    running, and which CP rank decodes each (sequence ``i``: CP rank ``i % cp``). Every CP rank of an engine
    keeps the same state, so they admit and finish the same sequences in the same steps."""

    def __init__(self, model: DPEPModel, prompts, cap: int, decode_cap: int):
        self.cp, self.rank = model.cp_size, model.cp_rank
        self.prompts, self.cap, self.decode_cap = prompts, cap, decode_cap
        self.pending, self.running = deque(range(len(prompts))), []
        self.produced = [0] * len(prompts)

    def mine(self, i: int) -> bool:
        return i % self.cp == self.rank

    def has_room(self, i: int, admitted=()) -> bool:
        """Whether sequence ``i``'s decoding CP rank has a low-latency slot left."""
        owner = i % self.cp
        return sum(1 for j in (*self.running, *admitted) if j % self.cp == owner) < self.decode_cap

    def next_batch(self, is_prefill: bool, out):
        """This step's ``(batch, active)``: the batch (None: nothing of the step's kind to run here) and the
        prompts it runs. A prefill step admits pending prompts while they fit the prefill capacity (a CP
        rank's zigzag share of them) and their decoding rank's low-latency slots; a decode step runs every
        running sequence this rank decodes."""
        if is_prefill:
            admitted, tokens = [], 0
            while self.pending and self.has_room(self.pending[0], admitted):
                need = cp_prefill_slots(len(self.prompts[self.pending[0]]), self.cp)
                if tokens + need > self.cap:
                    break
                tokens += need
                admitted.append(self.pending.popleft())
            return (Batch.prefill([self.prompts[i] for i in admitted], admitted) if admitted else None), admitted
        active = [i for i in self.running if self.mine(i)]
        if not active:
            return None, active
        positions = [len(self.prompts[i]) + len(out[i]) - 1 for i in active]  # the last token's, after the cache
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
    exactly its ``max_new_tokens``. With CP, every CP rank of an engine passes its prompts (see the module).

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
    out: list[list[int]] = [[] for _ in range(n)]
    stats = {"steps": 0, "prefill_steps": 0, "placeholder_steps": 0, "tokens": 0}
    eng = _Engine(model, prompts, cap, model.max_decode_tokens_per_rank if model.decode_moe == "low_latency" else cap)
    while True:
        with model.timer("lockstep"):
            plan = driver.next_step(
                has_unfinished=bool(eng.pending or eng.running),
                # only a prompt this rank could admit now counts: a full rank that voted for prefill could
                # hold every rank in prefill steps it cannot use while its own sequences never decode
                has_pending_prefill=bool(eng.pending) and eng.has_room(eng.pending[0]),
                has_running_decode=bool(eng.running),  # the engine's: its CP ranks vote alike
            )
        if plan is None:
            return _collect_cp(model, eng, out), stats
        stats["steps"] += 1
        stats["prefill_steps"] += int(plan.is_prefill)
        if stats["steps"] > max_steps:
            raise RuntimeError(f"generate: more than max_steps={max_steps} steps")
        batch, active = eng.next_batch(plan.is_prefill, out)
        for i, t in zip(active, _step(model, plan.is_prefill, batch, stats, on_step)):  # none for a placeholder
            out[i].append(int(t))
            if plan.is_prefill:
                eng.running.append(i)
                if not eng.mine(i):  # another CP rank decodes it: keep nothing of it here
                    model.release(i)
        for i in active if plan.is_prefill else list(eng.running):  # a decode step runs the engine's every one
            eng.produced[i] += 1
            if eng.produced[i] >= budget[i]:  # finished: its state is released at once
                eng.running.remove(i)
                model.release(i)


def _collect_cp(model: DPEPModel, eng: _Engine, out: list) -> list:
    """Every sequence's tokens on every CP rank of the engine (each decoded on one of them): one gather at the
    end of the generation; without CP, ``out`` as it is."""
    if model.cp_size == 1:
        return out
    outs = [None] * model.cp_size
    dist.all_gather_object(outs, out, group=model.groups.cpu_cp_group)
    return [outs[i % model.cp_size][i] for i in range(len(out))]
