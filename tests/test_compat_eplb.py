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


def test_deepseeks_published_example():
    # the example of DeepSeek's EPLB README (2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs) and the
    # placement it prints: an expectation from outside epkit (compat.eplb calls epkit.eplb, so comparing the two
    # would compare the code with itself)
    weight = torch.tensor(
        [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    )
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, 16, 4, 2, 8)
    published = [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    assert phy2log.tolist() == published
    for layer in range(2):  # each logical expert has logcnt replicas, and log2phy lists exactly them
        counts = torch.bincount(phy2log[layer], minlength=12)
        assert torch.equal(counts, logcnt[layer])
        for e in range(12):
            slots = log2phy[layer, e, : int(logcnt[layer, e])]
            assert sorted(slots.tolist()) == (phy2log[layer] == e).nonzero().flatten().tolist()


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
