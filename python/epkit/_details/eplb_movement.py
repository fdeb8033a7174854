"""Minimal movement for ``epkit.eplb.rebalance_experts``: relabel a new placement so that as many physical slots as
possible keep the logical expert they held before, without changing any GPU's load.

A placement's nodes are interchangeable (its policy packed expert groups onto nodes of equal standing), so are
the GPUs of one node, and so are the slots of one GPU: permuting any of them gives the same load on every GPU
and keeps every replica of a group in its node. :func:`keep_in_place` chooses, layer by layer, the permutation
that matches the previous placement best:

1. nodes: each new node goes to an old node, greedily by the number of logical experts they share (counted
   with multiplicity: a multiset intersection), largest first (ties: lowest indices); the identity is taken
   instead when it keeps more slots in the end;
2. the GPUs of each node pair, the same way;
3. the slots of each GPU pair: a slot whose previous expert is on the new GPU keeps it; the new GPU's other
   experts fill the remaining slots in their order.

The identity at every level is a candidate and step 3 never loses a match, so the result moves no more expert
weights than the placement it started from (tested), and its maximum GPU load is the same.
"""

from __future__ import annotations

from collections import Counter

import torch

__all__ = ["check_old_placement", "keep_in_place", "num_moved_experts"]


def num_moved_experts(old_phy2log: torch.Tensor, new_phy2log: torch.Tensor) -> torch.Tensor:
    """``[num_layers]`` int64: physical slots whose logical expert changes, each one expert's weights to copy in."""
    return (old_phy2log.to("cpu", torch.int64) != new_phy2log.to("cpu", torch.int64)).sum(-1)


def _shared(a: list[int], b: list[int]) -> int:
    return sum((Counter(a) & Counter(b)).values())


def _pairing(new: list[list[int]], old: list[list[int]]) -> list[int]:
    """``pair[i]``: the old unit new unit ``i`` takes: greedy by shared experts, or the identity if that shares more."""
    n = len(new)
    score = [[_shared(new[i], old[j]) for j in range(n)] for i in range(n)]
    order = sorted((-score[i][j], i, j) for i in range(n) for j in range(n))
    pair, used = [-1] * n, set()
    for _, i, j in order:
        if pair[i] < 0 and j not in used:
            pair[i] = j
            used.add(j)
    greedy = sum(score[i][pair[i]] for i in range(n))
    return pair if greedy > sum(score[i][i] for i in range(n)) else list(range(n))


def _slots(new: list[int], old: list[int]) -> list[int]:
    """The order of ``new``'s slots (indices into ``new``) that keeps ``old``'s experts where they were."""
    free = list(range(len(new)))
    placed = [-1] * len(old)
    for s, e in enumerate(old):
        for i in free:
            if new[i] == e:
                placed[s] = i
                free.remove(i)
                break
    rest = iter(free)
    return [p if p >= 0 else next(rest) for p in placed]


def _layer(new: list[int], old: list[int], num_nodes: int, num_gpus: int) -> list[int]:
    """The new order of one layer's physical slots (indices into ``new``): the node pairing of :func:`_pairing` or
    the identity, whichever keeps more slots (the GPU pairing and step 3 keep exactly the shared experts)."""
    per_gpu = len(new) // num_gpus
    gpus_per_node = num_gpus // num_nodes
    per_node = per_gpu * gpus_per_node

    def units(flat: list[int], base: int, size: int, count: int) -> list[list[int]]:
        return [flat[base + u * size : base + (u + 1) * size] for u in range(count)]

    def arrange(node_pair: list[int]) -> list[int]:
        order = [0] * len(new)
        for n_new, n_old in enumerate(node_pair):
            new_gpus = units(new, n_new * per_node, per_gpu, gpus_per_node)
            old_gpus = units(old, n_old * per_node, per_gpu, gpus_per_node)
            for g_new, g_old in enumerate(_pairing(new_gpus, old_gpus)):
                src = n_new * per_node + g_new * per_gpu
                dst = n_old * per_node + g_old * per_gpu
                for s, i in enumerate(_slots(new_gpus[g_new], old_gpus[g_old])):
                    order[dst + s] = src + i
        return order

    def kept(order: list[int]) -> int:
        return sum(new[i] == e for i, e in zip(order, old))

    identity = arrange(list(range(num_nodes)))
    paired = arrange(_pairing(units(new, 0, per_node, num_nodes), units(old, 0, per_node, num_nodes)))
    return paired if kept(paired) > kept(identity) else identity


def keep_in_place(
    phy2log: torch.Tensor, replica_rank: torch.Tensor, old_phy2log: torch.Tensor, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(phy2log, replica_rank)`` ``[num_layers, P]`` int64 with their slots permuted (nodes, the GPUs of a node,
    the slots of a GPU) to match ``old_phy2log`` ``[num_layers, P]`` as well as the module docstring says.

    ``num_nodes`` is the number of nodes the policy packed onto (1 for the global policy): slots never move
    between them otherwise than as whole nodes.
    """
    old = old_phy2log.to("cpu", torch.int64)
    perms = [_layer(new, prev, num_nodes, num_gpus) for new, prev in zip(phy2log.tolist(), old.tolist())]
    index = torch.tensor(perms, dtype=torch.int64).view(phy2log.shape)
    return phy2log.gather(1, index), replica_rank.gather(1, index)


def check_old_placement(old, num_layers: int, num_logical: int, num_replicas: int) -> torch.Tensor | None:
    """The previous ``phy2log`` as int64 on the CPU once it fits this rebalance (or None)."""
    if old is None:
        return None
    name = "old_global_expert_indices"
    if not isinstance(old, torch.Tensor) or old.dtype.is_floating_point or old.dtype in (torch.bool, torch.complex64):
        raise ValueError(f"{name} (the previous phy2log) must be an integer tensor, got {getattr(old, 'dtype', old)}")
    if tuple(old.shape) != (num_layers, num_replicas):
        raise ValueError(
            f"{name} (the previous phy2log) must have shape [num_layers, num_replicas] = {(num_layers, num_replicas)} "
            f"(the same layers and physical experts as this rebalance), got {tuple(old.shape)}"
        )
    old = old.to("cpu", torch.int64)
    if old.numel() and (int(old.min()) < 0 or int(old.max()) >= num_logical):
        raise ValueError(f"{name} values must be logical experts in [0, {num_logical})")
    return old
