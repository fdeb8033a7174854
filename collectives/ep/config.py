"""An EPBuffer's fixed facts: the group's shape, the capacities, the sizes of its regions (made once, never
changed; every path reads them, none writes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from epkit.collectives.ep.ll_layout import COMBINE_HEADER
from epkit.collectives.ep.rows import FIELD_ALIGN, META_MSG, align_up, rank_name

__all__ = ["DEFAULT_LOW_LATENCY_TOKENS", "EPConfig", "RegionSizes", "region_sizes"]

#: Default low-latency capacity (tokens per rank per dispatch): DeepEP-style engines decode 128 per rank.
DEFAULT_LOW_LATENCY_TOKENS = 128


class RegionSizes(NamedTuple):
    """Bytes of one rank's region of an :class:`EPBuffer` (see :func:`region_sizes`)."""

    row_bytes: int  # one normal-mode row: x (up to 4 bytes/elem) + FP8 scales + local ids + weights + source index
    normal: int  # what normal mode needs (metadata message, rows, combine rows)
    low_latency: int  # what low-latency dispatch or combine needs (the larger)
    region_bytes: int  # the region: the largest need, 4 KiB aligned


def region_sizes(
    hidden: int,
    num_topk: int,
    num_local_experts: int,
    num_max_tokens_per_rank: int,
    num_max_dispatch_tokens_per_rank: int,
) -> RegionSizes:
    """The size of each of an EPBuffer's ``world_size`` regions for these capacities (the same sizing the
    constructor uses; DeepEP's size hints in :mod:`epkit.compat.deep_ep` call it too). The device kernels' area
    (CUDA only) comes on top of ``world_size * region_bytes``."""
    h, k, n, L, n_ll = hidden, num_topk, num_max_tokens_per_rank, num_local_experts, num_max_dispatch_tokens_per_rank
    sf = 4 * -(-h // 128)
    row = align_up(4 * h) + align_up(sf) + 2 * align_up(4 * k) + FIELD_ALIGN
    normal = max(align_up(8 * (2 + L)) + META_MSG, n * row, n * align_up(4 * h))
    low_latency = max(n_ll * L * (align_up(2 * h) + align_up(sf)) + align_up(4 * L), COMBINE_HEADER + n_ll * L * 2 * h)
    region = align_up(max(normal, low_latency, n_ll * k * align_up(2 * h)), 4096)
    return RegionSizes(row, normal, low_latency, region)


def _positive(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


@dataclass(frozen=True)
class EPConfig:
    """What an EPBuffer was made for. ``hosts``: the group's ranks by host (NVLink domain for CUDA ranks; one list
    on one host), which picks the combine order; ``sizes``: the flat regions' sizes for these capacities."""

    world_size: int
    rank: int
    hidden: int
    num_experts: int
    num_topk: int
    num_max_tokens_per_rank: int
    num_max_dispatch_tokens_per_rank: int
    timeout: float
    #: CPU rows take the formulations CUDA rows take (torch ops for the sums, the Triton copy kernel for the row
    #: moves, the stream-ordered low-latency protocol): how the tests run the GPU path's code on CPU ranks.
    portable: bool = False
    hosts: tuple[tuple[int, ...], ...] = ()
    #: The global rank of each position of the group (what every message names a rank by); empty: the positions.
    global_ranks: tuple[int, ...] = ()

    @classmethod
    def checked(
        cls,
        world_size: int,
        rank: int,
        hidden: int,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        n_ll: int | None,
        timeout: float,
        portable: bool = False,
        global_ranks: tuple[int, ...] = (),
    ) -> EPConfig:
        """The config of the constructor's arguments (ValueError for any it cannot take; ``n_ll`` None: the
        default low-latency capacity)."""
        for name, v in (
            ("hidden", hidden),
            ("num_experts", num_experts),
            ("num_max_tokens_per_rank", num_max_tokens_per_rank),
            ("num_topk", num_topk),
        ):
            _positive(name, v)
        if num_experts % world_size:
            raise ValueError(f"num_experts {num_experts} is not divisible by the EP group size {world_size}")
        if n_ll is None:
            n_ll = min(num_max_tokens_per_rank, DEFAULT_LOW_LATENCY_TOKENS)
        _positive("num_max_dispatch_tokens_per_rank", n_ll)
        if not isinstance(portable, bool):
            raise ValueError(f"portable must be a bool, got {portable!r}")
        n, k = num_max_tokens_per_rank, num_topk
        return cls(world_size, rank, hidden, num_experts, k, n, n_ll, timeout, portable, (), tuple(global_ranks))

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def sizes(self) -> RegionSizes:
        return region_sizes(
            self.hidden,
            self.num_topk,
            self.num_local_experts,
            self.num_max_tokens_per_rank,
            self.num_max_dispatch_tokens_per_rank,
        )

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global rank of each position of the group."""
        return self.global_ranks or tuple(range(self.world_size))

    def rank_name(self, r: int) -> str:
        """``"rank G"``: position ``r`` of the group by its global rank."""
        return rank_name(r, self.ranks)

    @property
    def host_lists(self) -> list[list[int]]:
        """``hosts`` as lists (what ``EPBuffer.hosts`` shows)."""
        return [list(g) for g in self.hosts]
