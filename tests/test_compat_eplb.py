"""``epkit.compat.eplb`` is DeepSeek's EPLB interface (``eplb.py`` of deepseek-ai/EPLB): its names, parameter names,
return arity, shapes and dtypes, over epkit.eplb's placements."""

from __future__ import annotations

import inspect

import pytest
import torch

import epkit.compat.eplb as eplb
from epkit import eplb as epkit_eplb

SIGNATURES = {
    "balanced_packing": ["weight", "num_packs"],
    "replicate_experts": ["weight", "num_phy"],
    "rebalance_experts_hierarchical": ["weight", "num_physical_experts", "num_groups", "num_nodes", "num_gpus"],
    "rebalance_experts": ["weight", "num_replicas", "num_groups", "num_nodes", "num_gpus"],
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signatures_are_deepseeks(name):
    assert list(inspect.signature(getattr(eplb, name)).parameters) == SIGNATURES[name]


@pytest.mark.parametrize("case", [(2, 16, 24, 4, 2, 4), (1, 12, 16, 3, 2, 4)], ids=["hierarchical", "global"])
def test_the_example_call_and_its_shapes(case):
    num_layers, num_logical, num_replicas, num_groups, num_nodes, num_gpus = case
    weight = torch.randint(0, 100, (num_layers, num_logical), generator=torch.Generator().manual_seed(1))
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    assert phy2log.shape == (num_layers, num_replicas) and logcnt.shape == (num_layers, num_logical)
    assert log2phy.shape == (num_layers, num_logical, int(logcnt.max()))
    assert all(t.dtype == torch.int64 and t.device.type == "cpu" for t in (phy2log, log2phy, logcnt))
    for a, b in zip((phy2log, log2phy, logcnt), epkit_eplb.rebalance_experts(weight, *case[2:])):
        assert torch.equal(a, b)
    # log2phy indexes the physical experts by replica rank, as the hierarchical step's phyrank says
    if num_groups % num_nodes == 0:
        p2l, rank, cnt = eplb.rebalance_experts_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
        assert torch.equal(p2l, phy2log) and torch.equal(cnt, logcnt)
        slots = torch.arange(num_replicas).expand(num_layers, -1)
        assert torch.equal(log2phy.view(num_layers, -1).gather(1, p2l * log2phy.shape[2] + rank), slots)


def test_steps():
    w = torch.tensor([[5.0, 1, 3, 3]])
    pack, rank = eplb.balanced_packing(w, 2)
    assert pack.tolist() == [[0, 0, 1, 1]] and rank.tolist() == [[0, 1, 0, 1]]  # heaviest first, to the lightest
    phy2log, rank, logcnt = eplb.replicate_experts(w, 6)
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 2]] and logcnt.tolist() == [[2, 1, 2, 1]]
    with pytest.raises(ValueError, match="num_groups"):
        eplb.rebalance_experts_hierarchical(w, 4, 3, 1, 2)
