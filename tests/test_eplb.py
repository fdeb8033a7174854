import heapq
import itertools
import random

import pytest
import torch

from epkit.eplb import (
    ExpertLoadCounter,
    balanced_packing,
    gpu_load,
    imbalance,
    rebalance_experts,
    replicate_experts,
)
from epkit.experts import ExpertPlacement, logical_to_physical

# The example of the source document (004_*, EPLB section): 64 experts, 8 GPUs, 8 redundant slots.


def _doc_loads():
    random.seed(0)
    load = [1 / (i + 1) ** 0.8 for i in range(64)]
    random.shuffle(load)
    return load


def _ratio(xs):
    return max(xs) / (sum(xs) / len(xs))


def _per_gpu_from_phy2log(load, phy2log, num_gpus):
    """From first principles: an expert's load splits evenly over its replicas; GPU g holds a contiguous block."""
    count = [0] * len(load)
    for e in phy2log:
        count[e] += 1
    per = len(phy2log) // num_gpus
    return [sum(load[e] / count[e] for e in phy2log[g * per : (g + 1) * per]) for g in range(num_gpus)]


def _doc_balanced(load, num_gpus, num_redundant):
    """The document's own procedure: replicate the hottest per replica, then a heap-based greedy placement."""
    n = len(load)
    replicas = [1] * n
    for _ in range(num_redundant):
        hottest = max(range(n), key=lambda e: load[e] / replicas[e])
        replicas[hottest] += 1
    items = sorted((load[e] / replicas[e] for e in range(n) for _ in range(replicas[e])), reverse=True)
    slots = (n + num_redundant) // num_gpus
    heap = [(0.0, g, 0) for g in range(num_gpus)]
    for w in items:
        skipped = []
        while True:
            lo, g, k = heapq.heappop(heap)
            if k < slots:
                break
            skipped.append((lo, g, k))
        heapq.heappush(heap, (lo + w, g, k + 1))
        for s in skipped:
            heapq.heappush(heap, s)
    return replicas, sorted(lo for lo, _, _ in heap)


def test_doc_example_sequential_vs_eplb():
    load = _doc_loads()
    sequential = [sum(load[g * 8 : (g + 1) * 8]) for g in range(8)]
    assert abs(_ratio(sequential) - 2.26) < 0.01  # the document's figure for sequential placement

    weight = torch.tensor([load], dtype=torch.float64)
    phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas=72, num_groups=1, num_nodes=1, num_gpus=8)
    per_gpu = _per_gpu_from_phy2log(load, phy2log[0].tolist(), 8)
    assert _ratio(per_gpu) <= 1.01, f"busiest GPU / mean = {_ratio(per_gpu):.4f}"
    assert round(_ratio(per_gpu), 2) == 1.00  # the document prints 1.00

    # Same replica counts and the same per-GPU loads as the document's own procedure.
    replicas, doc_loads = _doc_balanced(load, 8, 8)
    assert logcnt[0].tolist() == replicas
    assert sorted(per_gpu) == pytest.approx(doc_loads, rel=1e-12, abs=0)
    assert gpu_load(weight, phy2log, 8)[0].tolist() == pytest.approx(per_gpu, rel=1e-12, abs=0)
    assert imbalance(per_gpu) == pytest.approx(_ratio(per_gpu), rel=1e-12)

    # The global policy also runs when num_groups % num_nodes != 0, and gives the same answer.
    again = rebalance_experts(weight, 72, 3, 2, 8)
    for a, b in zip(again, (phy2log, log2phy, logcnt)):
        assert torch.equal(a, b)


# Invariants.


def _check_invariants(weight, out, num_replicas, num_groups, num_nodes, num_gpus, ctx):
    phy2log, log2phy, logcnt = out
    num_layers, num_logical = weight.shape
    assert phy2log.shape == (num_layers, num_replicas) and phy2log.dtype == torch.int64, ctx
    assert logcnt.shape == (num_layers, num_logical) and logcnt.dtype == torch.int64, ctx
    max_rep = int(logcnt.max())
    assert log2phy.shape == (num_layers, num_logical, max_rep) and log2phy.dtype == torch.int64, ctx
    assert bool((logcnt >= 1).all()), f"{ctx}: an expert has no replica"
    assert logcnt.sum(1).tolist() == [num_replicas] * num_layers, ctx
    for layer in range(num_layers):
        p2l = phy2log[layer].tolist()
        assert torch.bincount(phy2log[layer], minlength=num_logical).tolist() == logcnt[layer].tolist(), ctx
        seen = []
        for e in range(num_logical):
            row = log2phy[layer, e].tolist()
            cnt = int(logcnt[layer, e])
            assert all(p == -1 for p in row[cnt:]), f"{ctx}: padding of expert {e}"
            for p in row[:cnt]:
                assert p2l[p] == e, f"{ctx}: log2phy[{layer}, {e}] names physical {p} holding {p2l[p]}"
            seen += row[:cnt]
        assert sorted(seen) == list(range(num_replicas)), f"{ctx}: log2phy does not cover every physical expert once"
        if num_groups % num_nodes == 0:
            group_size = num_logical // num_groups
            per_node = num_replicas // num_nodes
            node_groups = [set() for _ in range(num_nodes)]
            for p, e in enumerate(p2l):
                node_groups[p // per_node].add(e // group_size)
            assert all(len(s) == num_groups // num_nodes for s in node_groups), f"{ctx}: {node_groups}"
            assert set().union(*node_groups) == set(range(num_groups)), ctx
            assert sum(len(s) for s in node_groups) == num_groups, f"{ctx}: a group spans two nodes"


CASES = [
    # num_layers, num_logical, num_replicas, num_groups, num_nodes, num_gpus
    (3, 12, 16, 4, 2, 8),  # hierarchical
    (2, 64, 72, 8, 2, 8),
    (2, 256, 288, 8, 4, 32),  # DeepSeek-V3-like prefill layout
    (2, 32, 48, 4, 3, 8),  # 4 % 3 != 0: global
    (2, 16, 16, 4, 2, 4),  # no redundancy
    (1, 384, 448, 8, 1, 64),  # V4.1-Flash at EP64
    (2, 6, 12, 6, 6, 6),  # one group per node, one expert per group
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rebalance_invariants(case):
    num_layers, num_logical, num_replicas, num_groups, num_nodes, num_gpus = case
    g = torch.Generator().manual_seed(sum(case))
    weight = torch.randint(0, 1000, (num_layers, num_logical), generator=g)
    weight[0, : num_logical // 8] *= 20  # a few hot experts
    out = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    _check_invariants(weight, out, num_replicas, num_groups, num_nodes, num_gpus, f"{case=}")
    # Ints and floats give the same answer; the answer is deterministic.
    again = rebalance_experts(weight.double(), num_replicas, num_groups, num_nodes, num_gpus)
    for a, b in zip(out, again):
        assert torch.equal(a, b), f"{case=}"


def test_rebalance_never_worse_than_sequential():
    g = torch.Generator().manual_seed(9)
    for _ in range(5):
        weight = (torch.rand(1, 64, generator=g, dtype=torch.float64) ** 6) * 1000
        phy2log, _, _ = rebalance_experts(weight, 72, 1, 1, 8)
        load = weight[0].tolist()
        eplb = _ratio(_per_gpu_from_phy2log(load, phy2log[0].tolist(), 8))
        sequential = _ratio(_per_gpu_from_phy2log(load, list(range(64)), 8))
        assert eplb <= sequential + 1e-12


def test_rebalance_small_hand_case():
    # Loads 9, 1, 1, 1; 6 slots on 2 GPUs. Replication: slot 4 -> expert 0 (9 > 1), slot 5 -> expert 0 (4.5 > 1);
    # per-replica loads by slot: 3, 1, 1, 1, 3, 3. Packing heaviest first (slots 0, 4, 5, 1, 2, 3):
    # 0 -> GPU0 (3), 4 -> GPU1 (3), 5 -> GPU0 (tie: lowest, 6), 1 -> GPU1 (4), 2 -> GPU1 (5, full), 3 -> GPU0 (7).
    phy2log, log2phy, logcnt = rebalance_experts(torch.tensor([[9.0, 1, 1, 1]]), 6, 1, 1, 2)
    assert logcnt.tolist() == [[3, 1, 1, 1]]
    assert phy2log.tolist() == [[0, 0, 3, 0, 1, 2]]
    # log2phy is indexed by replica rank: expert 0's original (slot 0) is now 0, slot 4 is 3, slot 5 is 1.
    assert log2phy.tolist() == [[[0, 3, 1], [4, -1, -1], [5, -1, -1], [2, -1, -1]]]
    assert gpu_load(torch.tensor([[9.0, 1, 1, 1]]), phy2log, 2).tolist() == [[7.0, 5.0]]


# The two building blocks.


def test_replicate_minimises_max_load_per_replica():
    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        w = torch.randint(0, 50, (1, 4), generator=g).double()
        for num_phy in range(4, 9):
            phy2log, rank, logcnt = replicate_experts(w, num_phy)
            best = min(
                max(float(w[0, e]) / c[e] for e in range(4))
                for c in itertools.product(range(1, num_phy - 2), repeat=4)
                if sum(c) == num_phy
            )
            got = max(float(w[0, e]) / int(logcnt[0, e]) for e in range(4))
            assert got == pytest.approx(best), f"{w.tolist()} {num_phy=}"
            assert phy2log[0, :4].tolist() == [0, 1, 2, 3] and rank[0, :4].tolist() == [0, 0, 0, 0]
            # Replica ranks count up per expert in slot order.
            seen = [0] * 4
            for p in range(num_phy):
                e = int(phy2log[0, p])
                assert int(rank[0, p]) == seen[e]
                seen[e] += 1
            assert seen == logcnt[0].tolist()


def _greedy_packing(weights, num_packs):
    """Independent statement of the rule: scan for the lightest pack with room."""
    n = len(weights)
    per = n // num_packs
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    totals, sizes = [0.0] * num_packs, [0] * num_packs
    pack, rank = [None] * n, [None] * n
    for i in order:
        best = None
        for p in range(num_packs):
            if sizes[p] < per and (best is None or totals[p] < totals[best]):
                best = p
        pack[i], rank[i] = best, sizes[best]
        totals[best] += weights[i]
        sizes[best] += 1
    return pack, rank


@pytest.mark.parametrize("n,m", [(12, 3), (16, 4), (9, 9), (10, 1), (64, 8), (7, 7)])
def test_balanced_packing(n, m):
    g = torch.Generator().manual_seed(n * m)
    w = torch.randint(0, 20, (3, n), generator=g).double()  # small ints: plenty of ties
    pack, rank = balanced_packing(w, m)
    assert pack.dtype == rank.dtype == torch.int64 and pack.shape == rank.shape == (3, n)
    for row in range(3):
        assert torch.bincount(pack[row], minlength=m).tolist() == [n // m] * m, f"{n=} {m=} pack sizes"
        for p in range(m):
            assert sorted(rank[row][pack[row] == p].tolist()) == list(range(n // m))
        if n // m > 1:
            want_pack, want_rank = _greedy_packing(w[row].tolist(), m)
            assert pack[row].tolist() == want_pack and rank[row].tolist() == want_rank, f"{n=} {m=} {row=}"
        else:
            assert pack[row].tolist() == list(range(n)) and rank[row].tolist() == [0] * n


def test_balanced_packing_bad_input():
    with pytest.raises(ValueError, match=r"item count \(10\) is not divisible by num_packs \(3\)"):
        balanced_packing(torch.ones(1, 10), 3)
    with pytest.raises(ValueError, match="num_packs must be >= 1, got 0"):
        balanced_packing(torch.ones(1, 10), 0)
    with pytest.raises(ValueError, match=r"num_physical \(3\) must be >= the number of logical experts \(4\)"):
        replicate_experts(torch.ones(1, 4), 3)


# Bad input.


def test_rebalance_bad_input():
    w = torch.ones(2, 16)
    with pytest.raises(ValueError, match=r"weight must be 2-D \[num_layers, n\], got shape \(16,\)"):
        rebalance_experts(torch.ones(16), 16, 1, 1, 4)
    with pytest.raises(ValueError, match=r"got shape \(1, 2, 16\)"):
        rebalance_experts(torch.ones(1, 2, 16), 16, 1, 1, 4)
    with pytest.raises(ValueError, match="weight must be a torch.Tensor"):
        rebalance_experts([[1.0] * 16], 16, 1, 1, 4)
    with pytest.raises(ValueError, match=r"num_replicas \(15\) must be >= the number of logical experts \(16\)"):
        rebalance_experts(w, 15, 1, 1, 3)
    with pytest.raises(ValueError, match=r"num_replicas \(18\) is not divisible by num_gpus \(4\)"):
        rebalance_experts(w, 18, 1, 1, 4)
    with pytest.raises(ValueError, match=r"logical experts \(16\) is not divisible by num_groups \(6\)"):
        rebalance_experts(w, 24, 6, 2, 4)
    with pytest.raises(ValueError, match=r"num_gpus \(6\) is not divisible by num_nodes \(4\)"):
        rebalance_experts(w, 24, 4, 4, 6)
    with pytest.raises(ValueError, match="num_gpus must be >= 1, got 0"):
        rebalance_experts(w, 16, 1, 1, 0)
    with pytest.raises(ValueError, match="num_nodes must be >= 1, got -1"):
        rebalance_experts(w, 16, 1, -1, 4)
    with pytest.raises(ValueError, match="finite and non-negative"):
        rebalance_experts(torch.tensor([[1.0, float("nan")]]), 2, 1, 1, 1)
    with pytest.raises(ValueError, match="finite and non-negative"):
        rebalance_experts(torch.tensor([[1, -1]]), 2, 1, 1, 1)
    with pytest.raises(ValueError, match="real numbers"):
        rebalance_experts(torch.ones(1, 4, dtype=torch.bool), 4, 1, 1, 1)
    with pytest.raises(ValueError, match="at least one layer"):
        rebalance_experts(torch.ones(0, 4), 4, 1, 1, 1)


def test_gpu_load_and_imbalance():
    weight = torch.tensor([[6.0, 2.0, 4.0]])
    # Expert 0 on slots 0 and 3 (3 each); GPU0 = slots 0,1 -> 3 + 2; GPU1 = slots 2,3 -> 4 + 3.
    assert gpu_load(weight, torch.tensor([[0, 1, 2, 0]]), 2).tolist() == [[5.0, 7.0]]
    assert imbalance([1, 1, 1, 1]) == 1.0
    assert imbalance(torch.tensor([4.0, 0.0, 0.0, 0.0])) == 4.0
    assert imbalance([0, 0]) == 1.0
    with pytest.raises(ValueError, match="1-D"):
        imbalance([[1.0, 2.0]])
    with pytest.raises(ValueError, match="1-D with at least one GPU"):
        imbalance([])
    with pytest.raises(ValueError, match="non-negative"):
        imbalance([1.0, -1.0])
    with pytest.raises(ValueError, match=r"num_physical \(4\) is not divisible by num_gpus \(3\)"):
        gpu_load(weight, torch.tensor([[0, 1, 2, 0]]), 3)
    with pytest.raises(ValueError, match="at least one replica"):
        gpu_load(weight, torch.tensor([[0, 1, 1, 0]]), 2)


# Load counter.


def test_load_counter_window():
    c = ExpertLoadCounter(num_layers=2, num_logical=4, window=2)
    c.add(0, torch.tensor([1, 0, 2, 0]))
    c.add_topk(1, torch.tensor([[3, -1], [3, 0]], dtype=torch.int32))
    assert c.load().tolist() == [[1, 0, 2, 0], [1, 0, 0, 2]]
    assert c.num_steps == 1
    c.step()
    c.add(0, torch.tensor([0, 5, 0, 0], dtype=torch.int32))
    assert c.load().tolist() == [[1, 5, 2, 0], [1, 0, 0, 2]]
    c.step()  # the first step leaves the window
    assert c.num_steps == 2
    c.add_topk(0, torch.tensor([[2]]))
    assert c.load().tolist() == [[0, 5, 1, 0], [0, 0, 0, 0]]
    c.step()
    c.step()
    assert c.load().tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]
    c.add(1, torch.tensor([1, 1, 1, 1]))
    c.reset()
    assert c.load().sum() == 0 and c.num_steps == 1


def test_load_counter_feeds_rebalance_and_placement():
    g = torch.Generator().manual_seed(2)
    num_layers, num_logical, ep = 2, 16, 4
    counter = ExpertLoadCounter(num_layers, num_logical, window=8)
    hot = torch.tensor([3] * 40 + list(range(16)) * 2)
    for _ in range(3):
        for layer in range(num_layers):
            topk = hot[torch.randint(0, hot.numel(), (64, 2), generator=g)]
            counter.add_topk(layer, topk)
        counter.step()
    load = counter.load()
    assert load.dtype == torch.int64 and int(load.sum()) == 3 * num_layers * 64 * 2
    phy2log, _, logcnt = rebalance_experts(load, 20, 1, 1, ep)
    assert int(logcnt[0, 3]) >= 2  # the hot expert got replicas
    placement = ExpertPlacement.from_phy2log(phy2log[0], num_logical, ep)
    assert placement.logcnt.tolist() == logcnt[0].tolist()
    topk = torch.full((8, 1), 3)
    phys = logical_to_physical(topk, placement, 0)
    assert bool((placement.phy2log[phys.long()] == 3).all())


def test_load_counter_bad_input():
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        ExpertLoadCounter(2, 4, 0)
    c = ExpertLoadCounter(2, 4, 3)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\), got 2"):
        c.add(2, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        c.add(0, torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="integers"):
        c.add(0, torch.zeros(4))
    with pytest.raises(ValueError, match=">= 0"):
        c.add(0, torch.tensor([0, -1, 0, 0]))
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        c.add_topk(0, torch.tensor([[4]]))
    with pytest.raises(ValueError, match="2-D \\[num_tokens, top_k\\] int32 or int64"):
        c.add_topk(0, torch.tensor([1, 2]))


# Minimal movement: the previous placement in, as few expert weights moved as the load allows.


def _shuffled(phy2log, num_nodes, num_gpus, g):
    """The same placement with its nodes, the GPUs of each node and the slots of each GPU permuted at random:
    the same load on every GPU, every slot possibly elsewhere."""
    num_layers, num_physical = phy2log.shape
    per_gpu, gpus_per_node = num_physical // num_gpus, num_gpus // num_nodes
    out = []
    for layer in phy2log.view(num_layers, num_nodes, gpus_per_node, per_gpu):
        layer = layer[torch.randperm(num_nodes, generator=g)]
        layer = torch.stack([node[torch.randperm(gpus_per_node, generator=g)] for node in layer])
        layer = torch.stack(
            [torch.stack([gpu[torch.randperm(per_gpu, generator=g)] for gpu in node]) for node in layer]
        )
        out.append(layer.reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_minimal_movement_against_a_rebalance_without_it(case):
    num_layers, num_logical, num_replicas, num_groups, num_nodes, num_gpus = case
    g = torch.Generator().manual_seed(7 + sum(case))
    before = torch.randint(0, 1000, (num_layers, num_logical), generator=g)
    after = before + torch.randint(0, 300, (num_layers, num_logical), generator=g)  # the load drifted
    old = rebalance_experts(before, num_replicas, num_groups, num_nodes, num_gpus)[0]
    *plain, plain_moved = rebalance_experts(after, num_replicas, num_groups, num_nodes, num_gpus, return_num_moved=True)
    *kept, moved = rebalance_experts(after, num_replicas, num_groups, num_nodes, num_gpus, old, return_num_moved=True)
    _check_invariants(after, kept, num_replicas, num_groups, num_nodes, num_gpus, f"{case=}")
    assert torch.equal(plain_moved, torch.full((num_layers,), num_replicas))  # no previous placement: all slots
    assert torch.equal(moved, (kept[0] != old).sum(1))
    without = (plain[0] != old).sum(1)  # what the placement without the option would move
    assert bool((moved <= without).all()), (moved, without)
    # the same load on every GPU, up to the order of the GPUs: the same maximum, the same replica counts
    assert torch.equal(kept[2], plain[2])
    ours, theirs = gpu_load(after, kept[0], num_gpus), gpu_load(after, plain[0], num_gpus)
    assert torch.allclose(ours.sort(1).values, theirs.sort(1).values, rtol=0, atol=1e-9)
    assert torch.equal(ours.max(1).values, theirs.max(1).values)
    # a previous placement that is this one shuffled: nothing needs to move, though every slot may differ
    if num_groups % num_nodes:
        num_nodes = 1  # the global policy packs onto one node of every GPU
    shuffled = _shuffled(plain[0], num_nodes, num_gpus, g)
    *_, none = rebalance_experts(after, num_replicas, case[3], case[4], num_gpus, shuffled, return_num_moved=True)
    assert torch.equal(none, torch.zeros(num_layers, dtype=torch.int64)), none
    assert int((plain[0] != shuffled).sum()) > 0 or num_replicas == num_gpus


def test_minimal_movement_moves_fewer_weights_on_a_realistic_drift():
    # DeepSeek-V3-like prefill layout, loads drifting by up to 30%: a measured figure, not a bound
    g = torch.Generator().manual_seed(3)
    before = (torch.rand(4, 256, generator=g) ** 4 * 1000).round()
    after = (before * (1 + 0.3 * torch.rand(4, 256, generator=g))).round()
    old = rebalance_experts(before, 288, 8, 4, 32)[0]
    *_, plain = rebalance_experts(after, 288, 8, 4, 32, return_num_moved=True)
    without = (rebalance_experts(after, 288, 8, 4, 32)[0] != old).sum(1)
    *_, moved = rebalance_experts(after, 288, 8, 4, 32, old, return_num_moved=True)
    assert bool((moved <= without).all()) and int(moved.sum()) < int(without.sum()), (moved, without)


def test_minimal_movement_bad_previous_placement():
    w = torch.ones(2, 8)
    with pytest.raises(ValueError, match=r"old_global_expert_indices .*shape \[num_layers, num_replicas\] = \(2, 12\)"):
        rebalance_experts(w, 12, 2, 1, 4, torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"old_global_expert_indices values must be logical experts in \[0, 8\)"):
        rebalance_experts(w, 12, 2, 1, 4, torch.full((2, 12), 8))
    with pytest.raises(ValueError, match="must be an integer tensor"):
        rebalance_experts(w, 12, 2, 1, 4, torch.zeros(2, 12))
