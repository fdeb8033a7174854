import pytest
import torch

import epkit.experts as ex
from epkit.backends import registered_ops, select
from epkit.experts import ExpertPlacement, logical_to_physical, logical_to_physical_reference, resolve_num_extra_experts
from epkit.testing import assert_bitwise_equal
from epkit.testing.markers import requires_cuda, requires_triton

CPU_BACKENDS = ["reference", "cpu", pytest.param("triton", marks=requires_triton)]


# Counts from the source document (000_*): V4.1-Flash, 384 routed experts.


@pytest.mark.parametrize(
    "routed,ep,minimum,extra",
    [
        (384, 64, 1, 64),  # padding = -(384 + 1) % 64 = 63 -> 448 physical, 7 per rank
        (384, 8, 1, 8),
        (384, 64, 0, 0),
        (384, 1, 0, 0),
        (10, 4, 0, 2),
        (10, 4, 3, 6),
        (3, 8, 0, 5),
        (256, 32, 32, 32),
    ],
)
def test_resolve_num_extra_experts(routed, ep, minimum, extra):
    got = resolve_num_extra_experts(routed, ep, minimum)
    assert got == extra, f"{routed=} {ep=} {minimum=}"
    assert (routed + got) % ep == 0 and got >= minimum


def test_v41_flash_default_placement():
    p = ExpertPlacement.default(384, 64, 1)
    assert (p.num_logical, p.num_extra, p.num_physical, p.num_local, p.ep_size) == (384, 64, 448, 7, 64)
    assert p.phy2log.dtype == p.log2phy.dtype == p.logcnt.dtype == torch.int32
    # Redundant slot 384 + j holds logical j: experts 0..63 have two replicas, the rest one.
    assert p.logcnt[:64].tolist() == [2] * 64 and p.logcnt[64:].tolist() == [1] * 320
    assert p.log2phy.shape == (384, 2)
    assert p.log2phy[5].tolist() == [5, 389] and p.log2phy[100].tolist() == [100, -1]
    assert p.local_experts(0).tolist() == list(range(7))
    assert p.local_experts(54).tolist() == [378, 379, 380, 381, 382, 383, 0]
    assert p.local_experts(63).tolist() == list(range(57, 64))
    assert p.physical_range(63) == range(441, 448)
    p8 = ExpertPlacement.default(384, 8, 1)
    assert (p8.num_extra, p8.num_physical, p8.num_local) == (8, 392, 49)


def test_from_phy2log_inverse():
    p = ExpertPlacement.from_phy2log(torch.tensor([2, 0, 1, 2, 3, 2, 0, 1]), num_logical=4, ep_size=2)
    assert p.num_extra == 4 and p.num_local == 4
    assert p.log2phy.tolist() == [[1, 6, -1], [2, 7, -1], [0, 3, 5], [4, -1, -1]]
    assert p.logcnt.tolist() == [2, 2, 3, 1]
    assert p.local_experts(1).tolist() == [3, 2, 0, 1]
    moved = p.to("cpu")
    assert torch.equal(moved.phy2log, p.phy2log)


def test_placement_bad_input():
    with pytest.raises(ValueError, match=r"ep_size \(8\) is larger than the physical expert count \(4\)"):
        ExpertPlacement.from_phy2log([0, 1, 2, 3], num_logical=4, ep_size=8)
    with pytest.raises(ValueError, match=r"num_physical \(6\) is not divisible by ep_size \(4\)"):
        ExpertPlacement.from_phy2log([0, 1, 2, 3, 0, 1], num_logical=4, ep_size=4)
    with pytest.raises(ValueError, match=r"logical experts \[2\] have no replica"):
        ExpertPlacement.from_phy2log([0, 1, 3, 3, 0, 1], num_logical=4, ep_size=2)
    with pytest.raises(ValueError, match=r"phy2log\[2\] = 7 is outside \[0, 4\)"):
        ExpertPlacement.from_phy2log([0, 1, 7, 3], num_logical=4, ep_size=2)
    with pytest.raises(ValueError, match="fewer than num_logical=4"):
        ExpertPlacement.from_phy2log([0, 1, 2], num_logical=4, ep_size=1)
    with pytest.raises(ValueError, match="must be 1-D"):
        ExpertPlacement.from_phy2log([[0, 1]], num_logical=2, ep_size=1)
    with pytest.raises(ValueError, match="must hold integers"):
        ExpertPlacement.from_phy2log(torch.tensor([0.0, 1.0]), num_logical=2, ep_size=1)
    with pytest.raises(ValueError, match="num_logical must be >= 1, got 0"):
        ExpertPlacement.default(0, 4, 1)
    with pytest.raises(ValueError, match="ep_size must be >= 1, got -2"):
        ExpertPlacement.default(8, -2, 1)
    with pytest.raises(ValueError, match="min_num_extra_experts must be >= 0, got -1"):
        resolve_num_extra_experts(8, 2, -1)
    with pytest.raises(ValueError, match="ep_size must be an int"):
        resolve_num_extra_experts(8, 2.0, 0)
    with pytest.raises(ValueError, match="ep_size must be an int"):
        resolve_num_extra_experts(8, True, 0)
    p = ExpertPlacement.default(8, 4, 0)
    with pytest.raises(ValueError, match=r"ep_rank must be in \[0, 4\) \(ep_size=4\), got 4"):
        p.local_experts(4)
    with pytest.raises(ValueError, match="not the inverse of phy2log"):
        ExpertPlacement(
            4,
            0,
            4,
            2,
            2,
            p.phy2log[:4].clone() % 4,
            torch.tensor([[1], [0], [2], [3]], dtype=torch.int32),
            p.logcnt[:4],
        )
    with pytest.raises(ValueError, match=r"num_physical \(8\) must equal ep_size \(3\) \* num_local \(2\)"):
        ExpertPlacement(8, 0, 8, 3, 2, p.phy2log, p.log2phy, p.logcnt)


# Replica choice.


def _expected(topk, phy2log, num_local, ep_rank, offset=0):
    """Independent of the module: scan every physical slot per id (own rank first, else round-robin)."""
    out = []
    for t, row in enumerate(topk.tolist()):
        r_out = []
        for e in row:
            if e == -1:
                r_out.append(-1)
                continue
            slots = [p for p, lg in enumerate(phy2log) if lg == e]
            mine = [p for p in slots if p // num_local == ep_rank]
            r_out.append(min(mine) if mine else slots[(t + offset) % len(slots)])
        out.append(r_out)
    return torch.tensor(out, dtype=torch.int32).view(topk.shape)


def _random_placement(num_logical, ep_size, max_replicas, g):
    """Random layout whose replica counts cover 1..max_replicas."""
    counts = torch.ones(num_logical, dtype=torch.int64)
    counts[: max_replicas - 1] = torch.arange(2, max_replicas + 1)
    total = int(counts.sum())
    pad = (-total) % ep_size
    counts.index_add_(0, torch.randint(0, num_logical, (pad,), generator=g), torch.ones(pad, dtype=torch.int64))
    phy2log = torch.repeat_interleave(torch.arange(num_logical), counts)
    phy2log = phy2log[torch.randperm(phy2log.numel(), generator=g)]
    return ExpertPlacement.from_phy2log(phy2log, num_logical, ep_size)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "num_logical,ep_size,max_rep,tokens,top_k",
    [(16, 4, 4, 37, 3), (9, 3, 1, 20, 2), (33, 8, 6, 64, 8), (5, 5, 5, 1, 5), (16, 4, 3, 0, 4)],
)
def test_logical_to_physical_random(backend, num_logical, ep_size, max_rep, tokens, top_k):
    g = torch.Generator().manual_seed(num_logical * 100 + tokens)
    p = _random_placement(num_logical, ep_size, max_rep, g)
    topk = torch.randint(-1, num_logical, (tokens, top_k), generator=g, dtype=torch.int32)
    phy2log = p.phy2log.tolist()
    for rank in range(ep_size):
        ctx = f"{backend=} {num_logical=} {ep_size=} {max_rep=} {tokens=} {rank=}"
        got = logical_to_physical(topk, p, rank, backend=backend)
        assert_bitwise_equal(got, _expected(topk, phy2log, p.num_local, rank), ctx=ctx)
        # Each output is a replica of the chosen expert.
        ok = topk >= 0
        assert torch.equal(p.phy2log.long()[got[ok].long()], topk[ok].long()), ctx


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_logical_to_physical_edges(backend):
    p = ExpertPlacement.from_phy2log([0, 1, 2, 3, 0, 0], num_logical=4, ep_size=3)
    # The hand-worked case: expert 0 lives on ranks 0 (slot 0) and 2 (slots 4, 5).
    topk = torch.tensor([[0, 3], [0, -1], [0, 1]])
    want = {
        0: [[0, 3], [0, -1], [0, 1]],  # own-rank replica 0
        1: [[0, 3], [4, -1], [5, 1]],  # no replica on rank 1: round-robin 0, 4, 5 by token
        2: [[4, 3], [4, -1], [4, 1]],  # two replicas on rank 2: the lowest
    }
    for rank, w in want.items():
        got = logical_to_physical(topk, p, rank, backend=backend)
        assert got.tolist() == w, f"{backend=} {rank=}"
    got = logical_to_physical(topk, p, 1, token_offset=2, backend=backend)
    assert got[:, 0].tolist() == [5, 0, 4], backend
    # All -1, zero tokens, zero top_k, int64, non-contiguous input.
    assert logical_to_physical(torch.full((5, 2), -1), p, 0, backend=backend).tolist() == [[-1, -1]] * 5
    assert logical_to_physical(torch.empty(0, 6, dtype=torch.int32), p, 0, backend=backend).shape == (0, 6)
    assert logical_to_physical(torch.empty(3, 0, dtype=torch.int32), p, 0, backend=backend).shape == (3, 0)
    nc = torch.tensor([[0, 9, 1, 9], [0, 9, 2, 9], [0, 9, 0, 9]])[:, ::2]
    assert logical_to_physical(nc, p, 1, backend=backend).tolist() == [[0, 1], [4, 2], [5, 5]]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_one_hot_expert_spreads_evenly(backend):
    # Expert 3 has 4 replicas on ranks 1, 2, 3, 3; every token picks it.
    phy2log = [0, 1, 3, 2, 3, 4, 3, 3]
    p = ExpertPlacement.from_phy2log(phy2log, num_logical=5, ep_size=4)
    topk = torch.full((40, 1), 3, dtype=torch.int32)
    got0 = logical_to_physical(topk, p, 0, backend=backend).flatten()
    assert torch.bincount(got0.long(), minlength=8).tolist() == [0, 0, 10, 0, 10, 0, 10, 10]
    assert set(logical_to_physical(topk, p, 3, backend=backend).flatten().tolist()) == {6}
    assert set(logical_to_physical(topk, p, 2, backend=backend).flatten().tolist()) == {4}


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=requires_triton)])
def test_backends_agree_v41_flash(backend):
    g = torch.Generator().manual_seed(11)
    phy2log = torch.cat([torch.arange(384), torch.randint(0, 384, (64,), generator=g)])
    p = ExpertPlacement.from_phy2log(phy2log[torch.randperm(448, generator=g)], 384, 64)
    topk = torch.randint(-1, 384, (300, 6), generator=g, dtype=torch.int64)
    for rank in (0, 17, 63):
        assert_bitwise_equal(
            logical_to_physical(topk, p, rank, token_offset=rank, backend=backend),
            logical_to_physical_reference(topk, p, rank, token_offset=rank),
            ctx=f"{backend=} {rank=}",
        )


def test_logical_to_physical_bad_input():
    p = ExpertPlacement.default(8, 4, 0)
    with pytest.raises(ValueError, match=r"topk_idx\[1, 0\] = 8 is outside \[-1, 8\)"):
        logical_to_physical(torch.tensor([[0, 1], [8, 1]]), p, 0)
    with pytest.raises(ValueError, match=r"= -3 is outside"):
        logical_to_physical(torch.tensor([[-3, 1]]), p, 0)
    with pytest.raises(ValueError, match="2-D"):
        logical_to_physical(torch.tensor([0, 1]), p, 0)
    with pytest.raises(ValueError, match="int32 or int64"):
        logical_to_physical(torch.tensor([[0.0]]), p, 0)
    with pytest.raises(ValueError, match=r"ep_rank must be in \[0, 4\)"):
        logical_to_physical(torch.tensor([[0]]), p, 4)
    with pytest.raises(ValueError, match="ep_rank must be >= 0"):
        logical_to_physical(torch.tensor([[0]]), p, -1)
    with pytest.raises(ValueError, match="token_offset must be >= 0"):
        logical_to_physical(torch.tensor([[0]]), p, 0, token_offset=-1)
    with pytest.raises(ValueError, match="placement must be an ExpertPlacement"):
        logical_to_physical(torch.tensor([[0]]), "p", 0)
    with pytest.raises(ValueError, match="unknown backend"):
        logical_to_physical(torch.tensor([[0]]), p, 0, backend="magic")


def test_registered_op_and_selfcheck():
    spec = registered_ops()["logical_to_physical"]
    assert select("logical_to_physical", "cpu") == "cpu"
    assert spec.selfcheck is not None
    for backend in ("reference", "cpu"):
        spec.selfcheck(backend)


@requires_triton
def test_selfcheck_triton():
    registered_ops()["logical_to_physical"].selfcheck("triton")


# Rung 3: compiled for sm_90 without a GPU.


# Rung 4: executed on a GPU.


@requires_cuda
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_logical_to_physical_gpu(backend):
    g = torch.Generator().manual_seed(5)
    p = _random_placement(384, 64, 5, g)
    topk = torch.randint(-1, 384, (4096, 6), generator=g, dtype=torch.int32)
    for rank in (0, 31, 63):
        got = logical_to_physical(topk.cuda(), p.to("cuda"), rank, backend=backend)
        assert_bitwise_equal(got.cpu(), ex.logical_to_physical_cpu(topk, p, rank, 0), ctx=f"{backend=} {rank=}")
