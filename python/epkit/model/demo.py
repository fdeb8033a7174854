"""One rank of ``python -m epkit.model`` (the textbook experiment of the EP chapter, on epkit's ops).

A module of its own, not ``__main__``: the ranks are spawned processes, which find the function they
run by its module's name, and a spawned process does not re-run a package's ``__main__``.
"""

from __future__ import annotations

import time

import torch

from epkit.model.args import ModelArgs
from epkit.model.engine import generate
from epkit.model.model import DPEPModel
from epkit.topology import ParallelGroups

__all__ = ["demo_rank"]


def _demo_prompts(rank: int, num_requests: int, seed: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    n = int(torch.randint(0, num_requests + 1, (1,), generator=g))  # uneven, possibly none
    prompts = [
        torch.randint(0, ModelArgs().vocab_size, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    budget = [int(torch.randint(1, 9, (1,), generator=g)) for _ in range(n)]
    return prompts, budget


def demo_rank(rank: int, world_size: int, transport: str, num_requests: int, seed: int) -> dict:
    """Generate for this rank's random prompts (up to ``num_requests``, from ``seed``) on CPU ranks.

    Returns ``{"prompts", "tokens", "stats", "load"}``: the prompts, the generated ids, generate's
    stats (with ``seconds``, ``prefill_moe`` and ``transport``) and the expert load (equal on every rank).
    """
    groups = ParallelGroups.create(dp_size=world_size, device="cpu")
    model = DPEPModel(ModelArgs(), groups, transport=transport, min_num_extra_experts=world_size)
    prompts, budget = _demo_prompts(rank, num_requests, seed)
    t0 = time.perf_counter()
    tokens, stats = generate(model, prompts, budget)
    stats["seconds"] = time.perf_counter() - t0
    stats["prefill_moe"], stats["transport"] = model.prefill_moe, model.buffer.transport
    load = model.expert_load()
    model.close()
    return {"prompts": prompts, "tokens": tokens, "stats": stats, "load": load}
