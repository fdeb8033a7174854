"""Rank layout (pure) and process groups on real CPU ranks."""

import pytest
import torch
import torch.distributed as dist

from epkit.testing.multiprocess import run_ranks
from epkit.topology import ParallelGroups, rank_groups, resolve_sizes


def _by_formula(dp, cp, ep, enp):
    """Independent derivation from the source document's rank formula: g = engine_rank * cp + cp_rank."""
    world = max(dp * cp, enp)
    groups = {k: {} for k in ("dp", "cp", "ep", "enp")}
    for g in range(world):
        replica, d, c = g // (dp * cp), (g // cp) % dp, g % cp
        groups["dp"].setdefault((replica, c), []).append(g)  # fixed (replica, cp rank), varying dp
        groups["cp"].setdefault(g // cp, []).append(g)  # one engine's cp workers
        groups["ep"].setdefault(g // ep, []).append(g)
        groups["enp"].setdefault(g // enp, []).append(g)
        assert g == (replica * dp + d) * cp + c
    return {k: [v[key] for key in sorted(v)] for k, v in groups.items()}


def test_worked_example():
    g = rank_groups(dp_size=4, cp_size=2)
    assert g["world"] == [list(range(8))]
    assert g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["cp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["ep"] == g["ep_in_dp"] == g["enp"] == [list(range(8))]


def test_enp_wider_than_a_replica():
    g = rank_groups(dp_size=2, cp_size=2, ep_size=4, enp_size=8)
    assert g["world"] == [list(range(8))]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["enp"] == [list(range(8))]


@pytest.mark.parametrize(
    "dp,cp,ep,enp",
    [
        (8, 1, None, None),
        (4, 2, 4, None),
        (2, 4, 2, 16),
        (64, 1, 64, None),
        (3, 2, 3, 12),
        (1, 1, None, None),
        (16, 1, 8, 4),
    ],
)
def test_matches_formula(dp, cp, ep, enp):
    s = resolve_sizes(dp, cp, ep, enp)
    g = rank_groups(dp, cp, ep, enp)
    want = _by_formula(s["dp"], s["cp"], s["ep"], s["enp"])
    for kind in ("dp", "cp", "ep", "enp"):
        assert g[kind] == want[kind], f"{kind=} {dp=} {cp=} {ep=} {enp=}"
    assert g["ep_in_dp"] == g["ep"]
    for kind, groups in g.items():
        flat = sorted(r for grp in groups for r in grp)
        assert flat == list(range(s["world"])), f"{kind} groups must partition the world"
        assert all(grp == sorted(grp) for grp in groups)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dp_size=0), "dp_size must be a positive integer, got 0"),
        (dict(dp_size=4, cp_size=-1), "cp_size must be a positive integer"),
        (dict(dp_size=4, ep_size=3), "not divisible by ep_size 3"),
        (dict(dp_size=4, cp_size=2, enp_size=12), "not divisible by dp_size\\*cp_size = 4\\*2"),
        (dict(dp_size=4, cp_size=2, enp_size=6), "not divisible by enp_size 6"),
        (dict(dp_size=2.0), "dp_size must be a positive integer, got 2.0"),
    ],
)
def test_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rank_groups(**kwargs)


def _groups_on_ranks(rank, world_size, dp, cp, ep, enp):
    pg = ParallelGroups.create(dp, cp, ep, enp, device="cpu", timeout=30)
    layout = rank_groups(dp, cp, ep, enp)
    out = {}
    for kind in ("world", "dp", "cp", "ep", "enp", "ep_in_dp"):
        mine = [grp for grp in layout[kind] if rank in grp]
        assert pg.ranks[kind] == mine[0], kind
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pg.groups[kind])
        c = torch.tensor([1.0])
        dist.all_reduce(c, group=pg.cpu_groups[kind])
        out[kind] = (t.item(), c.item())
    assert pg.engine_rank == rank // cp and pg.cp_rank == rank % cp
    assert pg.dp_group is pg.groups["dp"] and pg.cpu_dp_group is pg.cpu_groups["dp"]
    return out


@pytest.mark.parametrize("world,dp,cp,ep,enp", [(4, 2, 2, 2, None), (8, 4, 2, 8, None), (8, 2, 2, 4, 8)])
def test_parallel_groups_on_cpu_ranks(world, dp, cp, ep, enp):
    results = run_ranks(_groups_on_ranks, world, dp, cp, ep, enp, timeout=90)
    layout = rank_groups(dp, cp, ep, enp)
    for rank, res in enumerate(results):
        for kind, (rank_sum, count) in res.items():
            grp = next(g for g in layout[kind] if rank in g)
            assert rank_sum == sum(grp) and count == len(grp), f"{rank=} {kind=}"


def _wrong_world(rank, world_size):
    ParallelGroups.create(dp_size=4, device="cpu")


def test_parallel_groups_world_mismatch_is_clear():
    from epkit.testing.multiprocess import RankError

    with pytest.raises(RankError, match="has 2 ranks but dp_size=4"):
        run_ranks(_wrong_world, 2, timeout=30)
