"""CP communication: async all-gather handles and driver broadcasts on real CPU ranks."""

import torch
import torch.distributed as dist

from epkit.collectives.cp_group import CPGroup, cp_broadcast_object, cp_broadcast_tensor_dict
from epkit.testing.multiprocess import run_ranks
from epkit.topology import ParallelGroups


def _gather_and_broadcast(rank, world_size):
    pg = ParallelGroups.create(dp_size=world_size // 2, cp_size=2, device="cpu")
    cp = CPGroup.from_parallel_groups(pg, timeout=20)
    assert cp.size == 2 and cp.rank == rank % 2
    x = torch.full((3, 4), float(rank), dtype=torch.bfloat16)
    wait = cp.all_gather(x)
    overlapped = (x.float() * 2).sum()  # compute while the gather is in flight
    gathered = wait()
    assert wait() is gathered  # waiting twice returns the same tensor
    base = rank - rank % 2
    want = torch.cat([torch.full((3, 4), float(base)), torch.full((3, 4), float(base + 1))]).bfloat16()
    assert torch.equal(gathered, want)
    obj = cp_broadcast_object({"call": "forward", "engine": rank // 2} if cp.rank == 0 else None, cp)
    assert obj == {"call": "forward", "engine": rank // 2}
    if cp.rank == 0:
        payload = {"positions": torch.arange(5, dtype=torch.int32) + rank, "scale": 0.5, "hidden": torch.ones(2, 3)}
    else:
        payload = None
    d = cp_broadcast_tensor_dict(payload, cp)
    assert d["scale"] == 0.5 and d["positions"].dtype == torch.int32
    assert torch.equal(d["positions"], torch.arange(5, dtype=torch.int32) + base)
    assert torch.equal(d["hidden"], torch.ones(2, 3))
    dist.barrier()
    return float(overlapped)


def test_cp_group_on_four_ranks():
    out = run_ranks(_gather_and_broadcast, 4, timeout=60)
    assert out == [float(2 * r * 12) for r in range(4)]


def test_single_rank_cp_group_needs_no_communication():
    def fake_group():
        return None

    cp = CPGroup.__new__(CPGroup)
    cp.group = cp.cpu_group = fake_group()
    cp.size, cp.rank, cp.timeout = 1, 0, 1.0
    x = torch.arange(6.0).view(3, 2)
    assert torch.equal(cp.all_gather(x)(), x)
    assert cp_broadcast_object("same", cp) == "same"
    assert cp_broadcast_tensor_dict({"a": x}, cp)["a"] is x
