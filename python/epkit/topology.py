"""Rank layout and process groups for DP attention + Wide-EP (+ CP, ENP).

Global ranks are laid out ``(replica dp cp)``: CP innermost (one engine's CP
workers are adjacent, inside one scale-up domain), DP in the middle, replicas
outermost. ``world_size = max(dp*cp, enp)``: the Engram axis may span more
ranks than one model replica; the extra ranks only hold Engram table rows.

Group patterns (einops notation over ``arange(world_size)``):

=========  ============================================  ========================================
kind       pattern                                       meaning
=========  ============================================  ========================================
world      all ranks                                     one group
dp         ``(replica dp cp) -> (replica cp) dp``        fixed (replica, cp rank), stride cp
cp         ``(dp cp) -> dp cp``                          cp adjacent ranks (one engine)
ep         ``(edp ep) -> edp ep``                        ep contiguous ranks
enp        ``(replica enp) -> replica enp``              enp contiguous ranks
ep_in_dp   ``(edp ep_in_dp) -> edp ep_in_dp``            contiguous, ``ep_in_dp = ep``
=========  ============================================  ========================================

Example: ``rank_groups(dp_size=4, cp_size=2)`` gives world 8, DP groups
``[[0, 2, 4, 6], [1, 3, 5, 7]]``, CP groups ``[[0, 1], [2, 3], [4, 5], [6, 7]]``
and one EP group of all 8 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
from einops import rearrange

__all__ = ["GROUP_KINDS", "resolve_sizes", "rank_groups", "ParallelGroups"]

GROUP_KINDS = ("world", "dp", "cp", "ep", "enp", "ep_in_dp")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def resolve_sizes(
    dp_size: int, cp_size: int = 1, ep_size: int | None = None, enp_size: int | None = None
) -> dict[str, int]:
    """Fill defaults and check divisibility: ``enp = dp*cp``, ``world = max(dp*cp, enp)``, ``ep = world``.

    Returns ``{"dp", "cp", "ep", "enp", "world", "replica"}`` where ``replica = world // (dp*cp)``.

    Raises
    ------
    ValueError
        A size is not a positive integer, or ``world`` is not divisible by ``dp*cp``,
        ``ep`` or ``enp`` (the message names the sizes).
    """
    dp = _positive("dp_size", dp_size)
    cp = _positive("cp_size", cp_size)
    enp = dp * cp if enp_size is None else _positive("enp_size", enp_size)
    world = max(dp * cp, enp)
    ep = world if ep_size is None else _positive("ep_size", ep_size)
    if world % (dp * cp):
        raise ValueError(f"world_size {world} (= enp_size {enp}) is not divisible by dp_size*cp_size = {dp}*{cp}")
    if world % enp:
        raise ValueError(f"world_size {world} (= dp_size*cp_size = {dp}*{cp}) is not divisible by enp_size {enp}")
    if world % ep:
        raise ValueError(
            f"world_size {world} is not divisible by ep_size {ep} (dp_size={dp}, cp_size={cp}, enp_size={enp})"
        )
    return {"dp": dp, "cp": cp, "ep": ep, "enp": enp, "world": world, "replica": world // (dp * cp)}


def rank_groups(
    dp_size: int, cp_size: int = 1, ep_size: int | None = None, enp_size: int | None = None
) -> dict[str, list[list[int]]]:
    """Every group of every kind, as ascending rank lists (a pure function; no torch.distributed).

    Parameters
    ----------
    dp_size, cp_size : int
        Data- and context-parallel sizes.
    ep_size : int, optional
        Expert-parallel size (default: world size).
    enp_size : int, optional
        Engram-parallel size (default: ``dp_size * cp_size``).

    Returns
    -------
    dict[str, list[list[int]]]
        Keys ``"world", "dp", "cp", "ep", "enp", "ep_in_dp"``; each value lists
        the groups of that kind, every group in ascending rank order.
    """
    s = resolve_sizes(dp_size, cp_size, ep_size, enp_size)
    ranks = torch.arange(s["world"])
    groups = {
        "world": [ranks.tolist()],
        "dp": rearrange(ranks, "(replica dp cp) -> (replica cp) dp", dp=s["dp"], cp=s["cp"]).tolist(),
        "cp": rearrange(ranks, "(dp cp) -> dp cp", cp=s["cp"]).tolist(),
        "ep": rearrange(ranks, "(edp ep) -> edp ep", ep=s["ep"]).tolist(),
        "enp": rearrange(ranks, "(replica enp) -> replica enp", enp=s["enp"]).tolist(),
        "ep_in_dp": rearrange(ranks, "(edp ep_in_dp) -> edp ep_in_dp", ep_in_dp=s["ep"]).tolist(),
    }
    return {k: [sorted(g) for g in v] for k, v in groups.items()}


@dataclass
class ParallelGroups:
    """The torch.distributed groups of the current rank, for every kind in :data:`GROUP_KINDS`.

    Build with :meth:`create`. ``<kind>_group`` is the device group (NCCL on CUDA;
    on CPU the gloo group), ``cpu_<kind>_group`` its gloo twin for control
    messages; ``ranks[kind]`` is the global ranks of this rank's group,
    ``rank_in[kind]`` this rank's index in it, ``sizes`` the resolved sizes.
    """

    rank: int
    sizes: dict[str, int]
    ranks: dict[str, list[int]]
    rank_in: dict[str, int]
    device: torch.device
    groups: dict[str, object] = field(repr=False)
    cpu_groups: dict[str, object] = field(repr=False)

    # Convenience accessors with the names engines use.
    @property
    def world_group(self):
        return self.groups["world"]

    @property
    def dp_group(self):
        return self.groups["dp"]

    @property
    def cp_group(self):
        return self.groups["cp"]

    @property
    def ep_group(self):
        return self.groups["ep"]

    @property
    def enp_group(self):
        return self.groups["enp"]

    @property
    def ep_in_dp_group(self):
        return self.groups["ep_in_dp"]

    @property
    def cpu_dp_group(self):
        return self.cpu_groups["dp"]

    @property
    def cpu_cp_group(self):
        return self.cpu_groups["cp"]

    @property
    def dp_rank(self) -> int:
        return self.rank_in["dp"]

    @property
    def cp_rank(self) -> int:
        return self.rank_in["cp"]

    @property
    def ep_rank(self) -> int:
        return self.rank_in["ep"]

    @property
    def enp_rank(self) -> int:
        return self.rank_in["enp"]

    @property
    def engine_rank(self) -> int:
        """``global_rank // cp_size``: the engine (DP replica member) this rank's CP group forms."""
        return self.rank // self.sizes["cp"]

    @classmethod
    def create(
        cls,
        dp_size: int,
        cp_size: int = 1,
        ep_size: int | None = None,
        enp_size: int | None = None,
        device: torch.device | str | None = None,
        timeout: float = 60.0,
    ) -> ParallelGroups:
        """Create every group (collective: all ranks of the default group must call it).

        Parameters
        ----------
        dp_size, cp_size, ep_size, enp_size : int
            As in :func:`rank_groups`; ``world_size`` must equal the default group's size.
        device : torch.device or str, optional
            ``"cuda"`` (NCCL device groups) or ``"cpu"`` (gloo only). Default: cuda if available.
        timeout : float
            Seconds any collective on these groups may wait.

        Every device group is warmed with one all-reduce, single-rank groups included
        (lazily initialised communicators would otherwise be created mid-forward).
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ParallelGroups.create needs torch.distributed initialised (init_process_group)")
        sizes = resolve_sizes(dp_size, cp_size, ep_size, enp_size)
        world = dist.get_world_size()
        if world != sizes["world"]:
            raise ValueError(
                f"torch.distributed has {world} ranks but dp_size={sizes['dp']}, "
                f"cp_size={sizes['cp']}, enp_size={sizes['enp']} need world_size {sizes['world']}"
            )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device_backend = "nccl" if device.type == "cuda" else None
        me = dist.get_rank()
        td = timedelta(seconds=timeout)
        layout = rank_groups(dp_size, cp_size, ep_size, enp_size)
        groups, cpu_groups, ranks, rank_in = {}, {}, {}, {}
        for kind in GROUP_KINDS:
            for members in layout[kind]:
                # new_group is collective over the default group: every rank creates every group, in order.
                cpu_g = dist.new_group(members, backend="gloo", timeout=td)
                dev_g = dist.new_group(members, backend=device_backend, timeout=td) if device_backend else cpu_g
                if me in members:
                    groups[kind], cpu_groups[kind] = dev_g, cpu_g
                    ranks[kind], rank_in[kind] = members, members.index(me)
        for kind in GROUP_KINDS:  # warm-up, single-rank groups included
            dist.all_reduce(torch.zeros(1, device=device), group=groups[kind])
        return cls(
            rank=me, sizes=sizes, ranks=ranks, rank_in=rank_in, device=device, groups=groups, cpu_groups=cpu_groups
        )
