"""DeepSeek's EPLB interface (``eplb.py`` of deepseek-ai/EPLB) on :mod:`epkit.eplb`: ``import epkit.compat.eplb as
eplb`` where an engine had ``import eplb``.

Same names, parameter names and order, return arity, shapes and dtypes (int64, on the CPU). Loads are summed in
float64 where DeepSeek's code uses float32, and ties go to the lowest index where it uses torch's unstable
sort: placements can differ where two loads tie, with the same maximum GPU load. The minimal-movement option
(the previous placement in) is :func:`epkit.eplb.rebalance_experts`'s ``old_global_expert_indices``, vLLM's
extension; DeepSeek's function has no such parameter, and neither has this one.
"""

from __future__ import annotations

import torch

from epkit import eplb as _eplb

__all__ = ["balanced_packing", "replicate_experts", "rebalance_experts_hierarchical", "rebalance_experts"]


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``n`` weighted items into ``num_packs`` packs of ``n / num_packs`` items each: ``(pack_index,
    rank_in_pack)``, both ``[X, n]`` int64 (see :func:`epkit.eplb.balanced_packing`)."""
    return _eplb.balanced_packing(weight, num_packs)


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replicate ``num_log`` experts into ``num_phy`` slots minimising the largest load per replica: ``(phy2log
    [X, num_phy], rank [X, num_phy], logcnt [X, num_log])`` int64 (see :func:`epkit.eplb.replicate_experts`)."""
    return _eplb.replicate_experts(weight, num_phy)


def rebalance_experts_hierarchical(
    weight: torch.Tensor, num_physical_experts: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hierarchical policy: ``(phy2log, phyrank, logcnt)`` (see
    :func:`epkit.eplb.rebalance_experts_hierarchical`)."""
    return _eplb.rebalance_experts_hierarchical(weight, num_physical_experts, num_groups, num_nodes, num_gpus)


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(phy2log [layers, num_replicas], log2phy [layers, num_logical, X], logcnt [layers, num_logical])``, int64:
    the hierarchical policy when ``num_groups % num_nodes == 0``, else the global one (see
    :func:`epkit.eplb.rebalance_experts`)."""
    return _eplb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
