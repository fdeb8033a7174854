"""EPLB: expert-parallel load balancing by redundant experts and re-placement.

Same interface and conventions as DeepSeek's public EPLB (``rebalance_experts``),
so engines can swap it in with an import change:

1. **replicate** - starting from one replica per logical expert, repeatedly give one
   more replica to the expert with the highest load per replica (ties: lowest id);
2. **balanced packing** - items sorted heaviest first (ties: lowest index) go one by
   one into the lightest pack that still has room (ties: lowest pack), every pack
   ending with exactly ``n / m`` items; with one item per pack, item ``i`` goes to
   pack ``i``;
3. **hierarchical policy** (``num_groups % num_nodes == 0``) - pack expert groups onto
   nodes, replicate within each node, pack the node's physical experts onto its GPUs,
   so every replica of a group stays in the group's node; **global policy** otherwise -
   the same with one group and one node.

Loads are computed in float64 (the public code uses float32; decisions differ only
where two float32-rounded loads tie). Physical expert ``p`` lives on GPU
``p // (num_replicas // num_gpus)``.

Also here: :func:`gpu_load` and :func:`imbalance` to score a placement, and
:class:`ExpertLoadCounter`, the sliding-window token counter that feeds
:func:`rebalance_experts`.
"""

from __future__ import annotations

import heapq
from typing import Literal, overload

import torch

from epkit._details.eplb_movement import check_old_placement, keep_in_place, num_moved_experts
from epkit.utils import check_int as _check_int
from epkit.utils import check_topk_idx

__all__ = [
    "balanced_packing",
    "replicate_experts",
    "rebalance_experts",
    "rebalance_experts_hierarchical",
    "num_moved_experts",
    "gpu_load",
    "imbalance",
    "ExpertLoadCounter",
]


def _check_weight(weight, name: str = "weight") -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor [num_layers, n], got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"{name} must be 2-D [num_layers, n], got shape {tuple(weight.shape)}")
    if weight.dtype == torch.bool or weight.is_complex():
        raise ValueError(f"{name} must hold real numbers (float or int), got {weight.dtype}")
    if weight.shape[0] < 1 or weight.shape[1] < 1:
        raise ValueError(f"{name} must have at least one layer and one entry, got shape {tuple(weight.shape)}")
    w = weight.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"{name} must be finite and non-negative")
    return w


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items each.

    Greedy: items heaviest first (ties: lowest index) each go to the lightest pack
    that still has room (ties: lowest pack index). With one item per pack, item
    ``i`` goes to pack ``i``.

    Parameters
    ----------
    weight : Tensor [X, n], float or int
        Item weights, one packing problem per row; finite and non-negative.
    num_packs : int
        Number of packs; must divide ``n``.

    Returns
    -------
    pack_index : Tensor [X, n], int64
        Pack of each item.
    rank_in_pack : Tensor [X, n], int64
        Position of the item in its pack, in the order items were placed.
    """
    w = _check_weight(weight)
    num_packs = _check_int("num_packs", num_packs, 1)
    rows, n = w.shape
    if n % num_packs:
        raise ValueError(f"the item count ({n}) is not divisible by num_packs ({num_packs})")
    per_pack = n // num_packs
    if per_pack == 1:
        pack_index = torch.arange(n, dtype=torch.int64).expand(rows, n).clone()
        return pack_index, torch.zeros(rows, n, dtype=torch.int64)
    pack_index = torch.empty(rows, n, dtype=torch.int64)
    rank_in_pack = torch.empty(rows, n, dtype=torch.int64)
    for r, row in enumerate(w.tolist()):
        order = sorted(range(n), key=lambda i: (-row[i], i))
        heap = [(0.0, p) for p in range(num_packs)]  # (pack weight, pack index): lightest, then lowest index
        filled = [0] * num_packs
        pidx, prank = [0] * n, [0] * n
        for item in order:
            load, p = heapq.heappop(heap)
            pidx[item], prank[item] = p, filled[p]
            filled[p] += 1
            if filled[p] < per_pack:  # a full pack leaves the heap for good
                heapq.heappush(heap, (load + row[item], p))
        pack_index[r] = torch.tensor(pidx)
        rank_in_pack[r] = torch.tensor(prank)
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replicate ``num_logical`` experts into ``num_physical`` slots, minimising the largest load per replica.

    Slot ``i < num_logical`` holds expert ``i``; each further slot goes to the expert
    with the highest ``load / replicas`` at that moment (ties: lowest expert id).

    Parameters
    ----------
    weight : Tensor [X, num_logical], float or int
        Load of each expert, one problem per row; finite and non-negative.
    num_physical : int
        Slots after replication, ``>= num_logical``.

    Returns
    -------
    phy2log : Tensor [X, num_physical], int64
        Logical expert of each slot.
    replica_rank : Tensor [X, num_physical], int64
        Which replica of its expert the slot is (0 for the original).
    logcnt : Tensor [X, num_logical], int64
        Replica count of each expert.
    """
    w = _check_weight(weight)
    rows, num_logical = w.shape
    num_physical = _check_int("num_physical", num_physical, 1)
    if num_physical < num_logical:
        raise ValueError(f"num_physical ({num_physical}) must be >= the number of logical experts ({num_logical})")
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(rows, 1)
    replica_rank = torch.zeros(rows, num_physical, dtype=torch.int64)
    logcnt = torch.ones(rows, num_logical, dtype=torch.int64)
    r = torch.arange(rows)
    for slot in range(num_logical, num_physical):
        hottest = (w / logcnt).argmax(dim=1)  # first maximum: lowest expert id on ties
        phy2log[:, slot] = hottest
        replica_rank[:, slot] = logcnt[r, hottest]
        logcnt[r, hottest] += 1
    return phy2log, replica_rank, logcnt


def _inverse_perm(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=perm.dtype).expand_as(perm).contiguous())
    return inv


def _hierarchical(w: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int):
    num_layers, num_logical = w.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    logical_per_node = num_logical // num_nodes
    physical_per_node = num_physical // num_nodes
    slots_per_gpu = num_physical // num_gpus

    # 1. Expert groups -> nodes. "mlog" numbers logical experts node-major: node n owns
    #    mlog ids [n * logical_per_node, (n + 1) * logical_per_node).
    group_load = w.view(num_layers, num_groups, group_size).sum(-1)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    group_base = (group_node * groups_per_node + group_rank) * group_size  # [L, G]
    log2mlog = (group_base.unsqueeze(-1) + torch.arange(group_size)).flatten(1)  # [L, E]
    mlog2log = _inverse_perm(log2mlog)

    # 2. Replicate within each node: one problem per (layer, node).
    node_load = w.gather(1, mlog2log).view(num_layers * num_nodes, logical_per_node)
    phy2mlog, phy_rank, mlogcnt = replicate_experts(node_load, physical_per_node)

    # 3. A node's physical experts -> its GPUs; position in the node = gpu * slots_per_gpu + rank.
    replica_load = (node_load / mlogcnt).gather(1, phy2mlog)
    gpu, rank_in_gpu = balanced_packing(replica_load, num_gpus // num_nodes)
    slot2phy = _inverse_perm(gpu * slots_per_gpu + rank_in_gpu)  # node slot -> pre-packing physical index

    node_offset = (torch.arange(num_nodes) * logical_per_node).view(1, num_nodes, 1)
    slot2mlog = (phy2mlog.gather(1, slot2phy).view(num_layers, num_nodes, -1) + node_offset).flatten(1)
    phy2log = mlog2log.gather(1, slot2mlog)
    replica_rank = phy_rank.gather(1, slot2phy).view(num_layers, -1)
    logcnt = mlogcnt.view(num_layers, -1).gather(1, log2mlog)
    return phy2log, replica_rank, logcnt


def rebalance_experts_hierarchical(
    weight: torch.Tensor, num_physical_experts: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hierarchical policy alone (DeepSeek's function of this name): ``(phy2log, replica_rank, logcnt)``, each
    int64 on the CPU, ``[num_layers, num_physical_experts]`` twice and ``[num_layers, num_logical]``.
    ``replica_rank`` says which replica of its expert each slot is. The arguments are checked as in
    :func:`rebalance_experts` (here ``num_groups`` must divide the experts and ``num_nodes`` the groups and GPUs)."""
    w = _check_weight(weight)
    num_physical_experts = _check_int("num_physical_experts", num_physical_experts, 1)
    num_groups = _check_int("num_groups", num_groups, 1)
    num_nodes = _check_int("num_nodes", num_nodes, 1)
    num_gpus = _check_int("num_gpus", num_gpus, 1)
    num_logical = w.shape[1]
    if num_physical_experts < num_logical or num_physical_experts % num_gpus:
        raise ValueError(
            f"num_physical_experts ({num_physical_experts}) must be >= the logical experts ({num_logical}) and a "
            f"multiple of num_gpus ({num_gpus})"
        )
    if num_logical % num_groups or num_groups % num_nodes or num_gpus % num_nodes:
        raise ValueError(
            f"num_groups ({num_groups}) must divide the logical experts ({num_logical}), and num_nodes ({num_nodes}) "
            f"num_groups and num_gpus ({num_gpus})"
        )
    return _hierarchical(w, num_physical_experts, num_groups, num_nodes, num_gpus)


# fmt: off
@overload
def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
    old_global_expert_indices: torch.Tensor | None = None, *, return_num_moved: Literal[False] = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
    old_global_expert_indices: torch.Tensor | None = None, *, return_num_moved: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
    old_global_expert_indices: torch.Tensor | None = None, *, return_num_moved: bool = False,
) -> tuple[torch.Tensor, ...]: ...
# fmt: on
def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    old_global_expert_indices: torch.Tensor | None = None,
    *,
    return_num_moved: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Choose replica counts and physical placement of experts from their measured loads.

    Hierarchical policy when ``num_groups % num_nodes == 0`` (groups -> nodes by balanced
    packing, replication within each node, physical experts -> the node's GPUs by balanced
    packing); global policy otherwise (the same with one group and one node).

    With the previous placement (``old_global_expert_indices``, vLLM's name), nodes, the GPUs of a node and the
    slots of a GPU are permuted (no GPU's load changes) so that as many slots as possible keep their expert
    (``epkit._details.eplb_movement``): never more weights move than without it, at the same maximum load.

    Parameters
    ----------
    weight : Tensor [num_layers, num_logical], float or int
        Load statistics (e.g. tokens routed to each expert over a window); finite, >= 0.
    num_replicas : int
        Physical experts after replication, ``>= num_logical`` and a multiple of ``num_gpus``.
    num_groups : int
        Expert groups (group-limited routing); must divide ``num_logical`` under the
        hierarchical policy.
    num_nodes : int
        Server nodes (fast intra-node links); must divide ``num_gpus`` under the hierarchical policy.
    num_gpus : int
        GPUs (EP ranks); physical expert ``p`` lives on GPU ``p // (num_replicas // num_gpus)``.
    old_global_expert_indices : Tensor [num_layers, num_replicas], integer, optional
        The previous ``phy2log`` (same layers, replicas and GPUs). ``return_num_moved``: also return ``num_moved``.

    Returns
    -------
    phy2log : Tensor [num_layers, num_replicas], int64
        Logical expert of each physical expert.
    log2phy : Tensor [num_layers, num_logical, max_replicas], int64
        Physical experts of each logical expert, indexed by replica rank, padded with -1;
        ``max_replicas`` is the largest count over all layers.
    logcnt : Tensor [num_layers, num_logical], int64
        Replica count of each logical expert (>= 1).
    num_moved : Tensor [num_layers], int64, only with ``return_num_moved=True``
        Physical slots whose logical expert differs from ``old_global_expert_indices`` (each an expert's
        weights to copy in); every slot when there is no previous placement.

    Examples
    --------
    >>> phy2log, log2phy, logcnt = rebalance_experts(torch.tensor([[9.0, 1, 1, 1]]), 6, 1, 1, 2)
    >>> logcnt.tolist()
    [[3, 1, 1, 1]]
    """
    w = _check_weight(weight)
    num_layers, num_logical = w.shape
    num_replicas, num_groups, num_nodes, num_gpus = _check_counts(
        num_logical, num_replicas, num_groups, num_nodes, num_gpus
    )
    old = check_old_placement(old_global_expert_indices, num_layers, num_logical, num_replicas)
    if num_groups % num_nodes == 0:
        if num_logical % num_groups or num_gpus % num_nodes:
            raise ValueError(
                f"the number of logical experts ({num_logical}) is not divisible by num_groups ({num_groups})"
                if num_logical % num_groups
                else f"num_gpus ({num_gpus}) is not divisible by num_nodes ({num_nodes})"
            )
        phy2log, replica_rank, logcnt = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        num_nodes = 1  # the global policy: one node of every GPU
        phy2log, replica_rank, logcnt = _hierarchical(w, num_replicas, 1, 1, num_gpus)
    if old is not None:
        phy2log, replica_rank = keep_in_place(phy2log, replica_rank, old, num_nodes, num_gpus)
    out = (phy2log, _log2phy(phy2log, replica_rank, logcnt), logcnt)
    if not return_num_moved:
        return out
    return (*out, num_moved_experts(old, phy2log) if old is not None else torch.full((num_layers,), num_replicas))


def _check_counts(num_logical: int, num_replicas, num_groups, num_nodes, num_gpus) -> tuple[int, int, int, int]:
    """:func:`rebalance_experts`'s counts as ints, once each is >= 1 and the replicas fit the experts and GPUs."""
    num_replicas, num_groups, num_nodes, num_gpus = (
        _check_int(n, v, 1)
        for n, v in (
            ("num_replicas", num_replicas),
            ("num_groups", num_groups),
            ("num_nodes", num_nodes),
            ("num_gpus", num_gpus),
        )
    )
    if num_replicas < num_logical:
        raise ValueError(f"num_replicas ({num_replicas}) must be >= the number of logical experts ({num_logical})")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas ({num_replicas}) is not divisible by num_gpus ({num_gpus})")
    return num_replicas, num_groups, num_nodes, num_gpus


def _log2phy(phy2log: torch.Tensor, replica_rank: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """``[num_layers, num_logical, max_replicas]`` physical slot of each (expert, replica rank), -1 padded."""
    (num_layers, num_replicas), num_logical = phy2log.shape, logcnt.shape[1]
    max_replicas = int(logcnt.max())
    log2phy = torch.full((num_layers, num_logical * max_replicas), -1, dtype=torch.int64)
    log2phy.scatter_(1, phy2log * max_replicas + replica_rank, torch.arange(num_replicas).expand(num_layers, -1))
    return log2phy.view(num_layers, num_logical, max_replicas)


def gpu_load(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Load per GPU when each expert's load splits evenly over its replicas.

    Parameters
    ----------
    weight : Tensor [num_layers, num_logical], float or int
        Load of each logical expert.
    phy2log : Tensor [num_layers, num_physical], integer
        Logical expert of each physical expert; GPU ``g`` holds physical experts
        ``[g * num_physical // num_gpus, (g + 1) * num_physical // num_gpus)``.
    num_gpus : int
        Must divide ``num_physical``.

    Returns
    -------
    Tensor [num_layers, num_gpus], float64
    """
    w = _check_weight(weight)
    num_gpus = _check_int("num_gpus", num_gpus, 1)
    if not isinstance(phy2log, torch.Tensor) or phy2log.dim() != 2 or phy2log.shape[0] != w.shape[0]:
        raise ValueError(
            f"phy2log must be a [num_layers={w.shape[0]}, num_physical] tensor, got "
            f"{tuple(getattr(phy2log, 'shape', ()))}"
        )
    if phy2log.dtype.is_floating_point or phy2log.dtype == torch.bool:
        raise ValueError(f"phy2log must hold integers, got {phy2log.dtype}")
    p2l = phy2log.to("cpu", torch.int64)
    num_layers, num_physical = p2l.shape
    if num_physical % num_gpus:
        raise ValueError(f"num_physical ({num_physical}) is not divisible by num_gpus ({num_gpus})")
    if int(p2l.min()) < 0 or int(p2l.max()) >= w.shape[1]:
        raise ValueError(f"phy2log values must be in [0, {w.shape[1]})")
    cnt = torch.zeros_like(w).scatter_add_(1, p2l, torch.ones_like(p2l, dtype=torch.float64))
    if bool((cnt == 0).any()):
        raise ValueError("every logical expert needs at least one replica in phy2log")
    per_replica = (w / cnt).gather(1, p2l)
    return per_replica.view(num_layers, num_gpus, -1).sum(-1)


def imbalance(load_per_gpu) -> float:
    """Busiest GPU over the mean: ``max(load) / mean(load)`` (1.0 is perfect balance).

    Parameters
    ----------
    load_per_gpu : Tensor or sequence [num_gpus], float or int
        Non-negative load of each GPU. All-zero load counts as balanced (returns 1.0).

    Returns
    -------
    float
    """
    if isinstance(load_per_gpu, torch.Tensor):
        t = load_per_gpu
    else:
        try:
            t = torch.as_tensor(load_per_gpu, dtype=torch.float64)  # Python floats keep double precision
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"load_per_gpu must be a tensor or a sequence of numbers: {exc}") from exc
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"load_per_gpu must be 1-D with at least one GPU, got shape {tuple(t.shape)}")
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"load_per_gpu must hold real numbers, got {t.dtype}")
    t = t.to("cpu", torch.float64)
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError("load_per_gpu must be finite and non-negative")
    mean = float(t.mean())
    return 1.0 if mean == 0.0 else float(t.max()) / mean


class ExpertLoadCounter:
    """Per-layer, per-expert token counts over a sliding window of steps (feeds :func:`rebalance_experts`).

    The dispatch layer calls :meth:`add` (or :meth:`add_topk`) for every MoE layer of a
    step and :meth:`step` once per forward step. The window holds the step in progress
    plus the ``window - 1`` most recent finished ones; older steps drop out.

    Parameters
    ----------
    num_layers : int
        MoE layers (> 0).
    num_logical : int
        Logical experts per layer (> 0).
    window : int
        Steps kept (> 0).
    device : torch.device or str
        Where the counts live (default CPU); counts added from elsewhere are moved here.
    """

    def __init__(self, num_layers: int, num_logical: int, window: int, device: torch.device | str = "cpu"):
        num_layers = _check_int("num_layers", num_layers, 1)
        num_logical = _check_int("num_logical", num_logical, 1)
        window = _check_int("window", window, 1)
        self.num_layers, self.num_logical, self.window = num_layers, num_logical, window
        self.device = torch.device(device)
        self._counts = torch.zeros(window, num_layers, num_logical, dtype=torch.int64, device=self.device)
        self._pos = 0
        self._steps = 1  # steps currently held, the open one included

    def _check_layer(self, layer) -> int:
        layer = _check_int("layer", layer, 0)
        if layer >= self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return layer

    def add(self, layer: int, counts: torch.Tensor) -> None:
        """Add token counts of one layer to the step in progress.

        Parameters
        ----------
        layer : int
            MoE layer index in ``[0, num_layers)``.
        counts : Tensor [num_logical], integer
            Tokens routed to each logical expert (>= 0).
        """
        layer = self._check_layer(layer)
        if not isinstance(counts, torch.Tensor) or counts.shape != (self.num_logical,):
            raise ValueError(
                f"counts must be a tensor of shape ({self.num_logical},), got {tuple(getattr(counts, 'shape', ()))}"
            )
        if counts.dtype.is_floating_point or counts.dtype == torch.bool or counts.is_complex():
            raise ValueError(f"counts must hold integers (token counts), got {counts.dtype}")
        if counts.numel() and int(counts.min()) < 0:
            raise ValueError(f"counts must be >= 0, got a minimum of {int(counts.min())}")
        self._counts[self._pos, layer] += counts.to(self.device, torch.int64)

    def add_topk(self, layer: int, topk_idx: torch.Tensor) -> None:
        """Count the gate's choices of one layer: every id in ``topk_idx`` adds one token; ``-1`` is skipped.

        Parameters
        ----------
        layer : int
            MoE layer index in ``[0, num_layers)``.
        topk_idx : Tensor [num_tokens, top_k], int32 or int64
            Logical expert ids in ``[-1, num_logical)``.
        """
        layer = self._check_layer(layer)
        check_topk_idx(topk_idx, self.num_logical)
        ids = topk_idx.reshape(-1).to(self.device, torch.int64)
        ids = ids[ids >= 0]
        self._counts[self._pos, layer] += torch.bincount(ids, minlength=self.num_logical)

    def step(self) -> None:
        """Close the step in progress and open a new one; the oldest step leaves a full window."""
        self._pos = (self._pos + 1) % self.window
        self._counts[self._pos].zero_()
        self._steps = min(self._steps + 1, self.window)

    @property
    def num_steps(self) -> int:
        """Steps currently in the window (the open one included), at most ``window``."""
        return self._steps

    def load(self) -> torch.Tensor:
        """Tokens per expert summed over the window.

        Returns
        -------
        Tensor [num_layers, num_logical], int64
            The ``weight`` argument of :func:`rebalance_experts`.
        """
        return self._counts.sum(0)

    def reset(self) -> None:
        """Drop every count."""
        self._counts.zero_()
        self._pos = 0
        self._steps = 1
