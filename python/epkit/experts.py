"""Expert accounting for Wide-EP: logical vs physical experts, placements, logical -> physical ids.

Four counts, as the production engine's MoE container names them:

``num_logical``   routed experts the gate chooses from (``n_routed_experts``)
``num_extra``     redundant replicas written by EPLB (``n_redundant_experts``)
``num_physical``  ``num_logical + num_extra``: expert slots actually allocated
``num_local``     ``num_physical // ep_size``: slots held by one EP rank

Physical expert ``p`` lives on EP rank ``p // num_local``, in slot ``p % num_local``
of that rank's grouped-GEMM weights. The gate produces logical ids; engines call
:func:`logical_to_physical` right after it so that dispatch sends each token to
one concrete replica. :func:`logical_to_physical` is ``torch.ops.epkit.logical_to_physical`` (``epkit.ops``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from epkit.backends import OpSpec, register_op, select
from epkit.ops import custom_op, host_checks
from epkit.utils import check_int as _check_int
from epkit.utils import check_topk_idx

__all__ = [
    "resolve_num_extra_experts",
    "ExpertPlacement",
    "logical_to_physical",
    "logical_to_physical_cpu",
    "logical_to_physical_reference",
]


def resolve_num_extra_experts(num_routed_experts: int, ep_size: int, min_num_extra_experts: int) -> int:
    """Smallest redundant count ``>= min_num_extra_experts`` making ``routed + extra`` divisible by ``ep_size``.

    ``extra = min + (-(routed + min) % ep_size)``: the minimum is a lower bound, padded
    up to the next multiple of ``ep_size`` so that every EP rank holds the same number
    of physical experts (the grouped GEMM splits ``num_physical / ep_size`` evenly).

    Parameters
    ----------
    num_routed_experts : int
        Logical routed experts (> 0).
    ep_size : int
        Expert-parallel group size (> 0).
    min_num_extra_experts : int
        Lower bound on redundant replicas (>= 0).

    Returns
    -------
    int
        The number of redundant (extra) physical experts.

    Examples
    --------
    >>> resolve_num_extra_experts(384, 64, 1)  # V4.1-Flash at EP64: 448 physical, 7 per rank
    64
    >>> resolve_num_extra_experts(384, 8, 1)
    8
    """
    _check_int("num_routed_experts", num_routed_experts, 1)
    _check_int("ep_size", ep_size, 1)
    _check_int("min_num_extra_experts", min_num_extra_experts, 0)
    return min_num_extra_experts + (-(num_routed_experts + min_num_extra_experts)) % ep_size


def _as_index_tensor(name: str, value, dim: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{name} must be an integer tensor or sequence, got {type(value).__name__}") from exc
    if value.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        raise ValueError(f"{name} must hold integers, got {value.dtype}")
    if value.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(value.shape)}")
    return value


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """Where every logical expert's replicas live across an EP group (one MoE layer).

    Physical expert ``p`` lives on EP rank ``p // num_local``. Construct with
    :meth:`default` or :meth:`from_phy2log`; direct construction is validated too.

    Attributes
    ----------
    num_logical, num_extra, num_physical, ep_size, num_local : int
        Counts; ``num_physical = num_logical + num_extra = ep_size * num_local``.
    phy2log : Tensor [num_physical], int32
        Logical expert held by each physical slot.
    log2phy : Tensor [num_logical, max_replicas], int32
        Physical slots of each logical expert in ascending order, padded with -1.
    logcnt : Tensor [num_logical], int32
        Replica count of each logical expert (>= 1).
    """

    num_logical: int
    num_extra: int
    num_physical: int
    ep_size: int
    num_local: int
    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor

    def __post_init__(self) -> None:
        _check_int("num_logical", self.num_logical, 1)
        _check_int("num_extra", self.num_extra, 0)
        _check_int("ep_size", self.ep_size, 1)
        _check_int("num_local", self.num_local, 1)
        _check_int("num_physical", self.num_physical, 1)
        if self.num_physical != self.num_logical + self.num_extra:
            raise ValueError(
                f"num_physical ({self.num_physical}) must equal num_logical ({self.num_logical}) + "
                f"num_extra ({self.num_extra})"
            )
        if self.num_physical != self.ep_size * self.num_local:
            raise ValueError(
                f"num_physical ({self.num_physical}) must equal ep_size ({self.ep_size}) * num_local ({self.num_local})"
            )
        for name, t, dim in (("phy2log", self.phy2log, 1), ("log2phy", self.log2phy, 2), ("logcnt", self.logcnt, 1)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dim:
                raise ValueError(f"{name} must be a {dim}-D int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if self.phy2log.shape[0] != self.num_physical:
            raise ValueError(f"phy2log has {self.phy2log.shape[0]} entries, expected num_physical={self.num_physical}")
        if self.logcnt.shape[0] != self.num_logical or self.log2phy.shape[0] != self.num_logical:
            raise ValueError(
                f"log2phy {tuple(self.log2phy.shape)} and logcnt {tuple(self.logcnt.shape)} must have "
                f"num_logical={self.num_logical} rows"
            )
        want = _inverse(self.phy2log.cpu().long(), self.num_logical, self.log2phy.shape[1])
        if want is None or not (
            torch.equal(want[0], self.log2phy.cpu().long()) and torch.equal(want[1], self.logcnt.cpu().long())
        ):
            raise ValueError("log2phy/logcnt are not the inverse of phy2log (use ExpertPlacement.from_phy2log)")

    # Constructors

    @classmethod
    def default(cls, num_logical: int, ep_size: int, min_num_extra_experts: int = 0) -> ExpertPlacement:
        """The layout before any EPLB statistics exist.

        ``num_extra = resolve_num_extra_experts(num_logical, ep_size, min_num_extra_experts)``;
        physical slot ``p`` holds logical expert ``p % num_logical``: slots ``0..num_logical-1``
        hold the logical experts in order, and the redundant slots ``num_logical + j`` hold
        logical ``j % num_logical`` (round-robin from expert 0), so a redundant slot is never
        empty and each rank's slots are contiguous in ``phy2log``.

        Parameters
        ----------
        num_logical : int
            Logical routed experts (> 0).
        ep_size : int
            EP group size (> 0).
        min_num_extra_experts : int
            Lower bound on redundant replicas (>= 0); padded as in :func:`resolve_num_extra_experts`.

        Returns
        -------
        ExpertPlacement
        """
        _check_int("num_logical", num_logical, 1)
        _check_int("ep_size", ep_size, 1)
        num_extra = resolve_num_extra_experts(num_logical, ep_size, min_num_extra_experts)
        phy2log = torch.arange(num_logical + num_extra, dtype=torch.int32) % num_logical
        return cls.from_phy2log(phy2log, num_logical, ep_size)

    @classmethod
    def from_phy2log(cls, phy2log, num_logical: int, ep_size: int) -> ExpertPlacement:
        """Build a placement from a physical -> logical map (e.g. one layer of :func:`epkit.eplb.rebalance_experts`).

        Parameters
        ----------
        phy2log : Tensor or sequence [num_physical], integer
            Logical expert of each physical slot, each in ``[0, num_logical)``; every
            logical expert must appear at least once.
        num_logical : int
            Logical routed experts (> 0).
        ep_size : int
            EP group size; must divide ``num_physical`` and be <= it.

        Returns
        -------
        ExpertPlacement
            With ``log2phy`` listing each expert's physical slots in ascending order.
        """
        _check_int("num_logical", num_logical, 1)
        _check_int("ep_size", ep_size, 1)
        phy2log = _as_index_tensor("phy2log", phy2log, 1).cpu().long()
        num_physical = phy2log.shape[0]
        if num_physical < num_logical:
            raise ValueError(f"phy2log has {num_physical} physical experts, fewer than num_logical={num_logical}")
        if ep_size > num_physical:
            raise ValueError(f"ep_size ({ep_size}) is larger than the physical expert count ({num_physical})")
        if num_physical % ep_size:
            raise ValueError(f"num_physical ({num_physical}) is not divisible by ep_size ({ep_size})")
        lo, hi = int(phy2log.min()), int(phy2log.max())
        if lo < 0 or hi >= num_logical:
            bad = lo if lo < 0 else hi
            pos = int((phy2log == bad).nonzero()[0])
            raise ValueError(f"phy2log[{pos}] = {bad} is outside [0, {num_logical}) (num_logical={num_logical})")
        logcnt = torch.bincount(phy2log, minlength=num_logical)
        if bool((logcnt == 0).any()):
            missing = (logcnt == 0).nonzero().flatten()[:8].tolist()
            raise ValueError(f"logical experts {missing} have no replica in phy2log (every expert needs >= 1)")
        log2phy, logcnt = _inverse(phy2log, num_logical, int(logcnt.max()))
        return cls(
            num_logical=num_logical,
            num_extra=num_physical - num_logical,
            num_physical=num_physical,
            ep_size=ep_size,
            num_local=num_physical // ep_size,
            phy2log=phy2log.to(torch.int32),
            log2phy=log2phy.to(torch.int32),
            logcnt=logcnt.to(torch.int32),
        )

    # Queries

    @property
    def max_replicas(self) -> int:
        """Columns of ``log2phy``: the largest replica count."""
        return self.log2phy.shape[1]

    def _check_rank(self, ep_rank) -> int:
        ep_rank = _check_int("ep_rank", ep_rank, 0)
        if ep_rank >= self.ep_size:
            raise ValueError(f"ep_rank must be in [0, {self.ep_size}) (ep_size={self.ep_size}), got {ep_rank}")
        return ep_rank

    def local_experts(self, ep_rank: int) -> torch.Tensor:
        """Logical experts held by ``ep_rank``, one per local slot.

        Returns
        -------
        Tensor [num_local], int32
            ``phy2log[ep_rank * num_local : (ep_rank + 1) * num_local]``; a logical
            expert may appear more than once.
        """
        ep_rank = self._check_rank(ep_rank)
        return self.phy2log[ep_rank * self.num_local : (ep_rank + 1) * self.num_local].clone()

    def physical_range(self, ep_rank: int) -> range:
        """Physical expert ids held by ``ep_rank``: ``range(ep_rank * num_local, (ep_rank + 1) * num_local)``."""
        ep_rank = self._check_rank(ep_rank)
        return range(ep_rank * self.num_local, (ep_rank + 1) * self.num_local)

    def to(self, device: torch.device | str) -> ExpertPlacement:
        """The same placement with its tensors on ``device`` (avoids a copy per call on GPU)."""
        return ExpertPlacement(
            self.num_logical,
            self.num_extra,
            self.num_physical,
            self.ep_size,
            self.num_local,
            self.phy2log.to(device),
            self.log2phy.to(device),
            self.logcnt.to(device),
        )


def _inverse(phy2log: torch.Tensor, num_logical: int, max_replicas: int):
    """(log2phy [E, R] int64 ascending + padded -1, logcnt [E] int64) from int64 phy2log, or None if R is too small."""
    if phy2log.numel() and (int(phy2log.min()) < 0 or int(phy2log.max()) >= num_logical):
        return None
    logcnt = torch.bincount(phy2log, minlength=num_logical)
    if logcnt.numel() and int(logcnt.max()) > max_replicas:
        return None
    order = torch.sort(phy2log, stable=True).indices  # physical ids grouped by expert, ascending within
    starts = torch.cumsum(logcnt, 0) - logcnt
    rank = torch.arange(phy2log.numel()) - starts[phy2log[order]]
    log2phy = torch.full((num_logical, max_replicas), -1, dtype=torch.int64)
    log2phy[phy2log[order], rank] = order
    return log2phy, logcnt


# Reference


def logical_to_physical_reference(
    topk_idx: torch.Tensor, placement: ExpertPlacement, ep_rank: int, token_offset: int = 0
) -> torch.Tensor:
    """Readable specification, one (token, k) at a time (slow; for tests). See :func:`logical_to_physical`."""
    log2phy = placement.log2phy.tolist()
    logcnt = placement.logcnt.tolist()
    rows = topk_idx.tolist()
    out = []
    for t, row in enumerate(rows):
        out_row = []
        for e in row:
            if e < 0:
                out_row.append(-1)
                continue
            replicas = log2phy[e][: logcnt[e]]
            local = [p for p in replicas if p // placement.num_local == ep_rank]
            out_row.append(local[0] if local else replicas[(t + token_offset) % logcnt[e]])
        out.append(out_row)
    return torch.tensor(out, dtype=torch.int32, device=topk_idx.device).view(topk_idx.shape)


# Implementation


def _validate(topk_idx, placement, ep_rank, token_offset) -> tuple[int, int]:
    """Static checks (nothing read from the tensors); the id range is checked in the op (``_check_ids``)."""
    if not isinstance(placement, ExpertPlacement):
        raise ValueError(f"placement must be an ExpertPlacement, got {type(placement).__name__}")
    ep_rank = placement._check_rank(ep_rank)
    token_offset = _check_int("token_offset", token_offset, 0)
    check_topk_idx(topk_idx, placement.num_logical, check_values=False)
    return ep_rank, token_offset


class _Tables(NamedTuple):
    """What the backends read of an ExpertPlacement (the op receives its tensors, not the placement)."""

    log2phy: torch.Tensor
    logcnt: torch.Tensor
    num_local: int


def _local_choice(placement: ExpertPlacement, ep_rank: int, device) -> torch.Tensor:
    """[num_logical] int32: each expert's first replica on ``ep_rank``, or -1 if it has none there."""
    log2phy = placement.log2phy.to(device)
    on_rank = (log2phy >= 0) & (torch.div(log2phy, placement.num_local, rounding_mode="floor") == ep_rank)
    first = on_rank.to(torch.uint8).argmax(dim=1, keepdim=True)  # first True (0 when none)
    return torch.where(on_rank.any(dim=1), log2phy.gather(1, first).squeeze(1), -1).to(torch.int32)


def logical_to_physical_cpu(
    topk_idx: torch.Tensor, placement: ExpertPlacement, ep_rank: int, token_offset: int
) -> torch.Tensor:
    """The ``cpu`` backend of :func:`logical_to_physical` without its checks: vectorised torch on any device
    (the baseline the kernel benchmarks compare with)."""
    device = topk_idx.device
    log2phy = placement.log2phy.to(device)
    logcnt = placement.logcnt.to(device).long()
    e = topk_idx.long()
    valid = e >= 0
    ec = e.clamp(min=0)
    tok = torch.arange(topk_idx.shape[0], dtype=torch.int64, device=device).unsqueeze(1) + token_offset
    rep = tok % logcnt[ec]
    remote = log2phy[ec, rep]
    local = _local_choice(placement, ep_rank, device)[ec]
    out = torch.where(local >= 0, local, remote)
    return torch.where(valid, out, torch.full_like(out, -1)).to(torch.int32)


def logical_to_physical(
    topk_idx: torch.Tensor,
    placement: ExpertPlacement,
    ep_rank: int,
    *,
    token_offset: int = 0,
    backend: str = "auto",
    check_index: bool = True,
) -> torch.Tensor:
    """Map the gate's logical expert ids to physical expert ids (one replica per token and slot).

    Replica choice, deterministic: for ``e = topk_idx[t, k]``

    1. ``e == -1`` (no expert) stays ``-1``;
    2. if some replica of ``e`` lives on ``ep_rank`` (the token's own rank), the first
       such replica in ``log2phy[e]`` order (ascending physical id), so the token never
       leaves its rank for that expert;
    3. otherwise replica ``log2phy[e, (t + token_offset) % logcnt[e]]``: tokens are spread
       over the replicas round-robin by their row index ``t``.

    Parameters
    ----------
    topk_idx : Tensor [num_tokens, top_k], int32 or int64
        Logical expert ids from the gate, in ``[-1, num_logical)``.
    placement : ExpertPlacement
        Replica layout of this layer (tensors are moved to ``topk_idx``'s device if needed;
        use ``placement.to(device)`` once to avoid a copy per call).
    ep_rank : int
        The calling rank in the EP group, ``[0, ep_size)``.
    token_offset : int
        Added to the row index before the round-robin (default 0). Engines whose batches
        are tiny (decode) can pass e.g. a step counter or ``ep_rank`` to spread replicas
        across ranks and steps.
    backend : str
        ``"auto"`` (default), ``"cpu"`` (vectorised torch), ``"triton"`` or ``"reference"``.
    check_index : bool
        Validate the ids (one device->host sync on GPU). Default True. During CUDA stream capture (where
        nothing can be read on the host) an id outside ``[-1, num_logical)`` maps to ``-1`` instead.

    Returns
    -------
    Tensor [num_tokens, top_k], int32
        Physical expert ids in ``[-1, num_physical)``; ``-1`` exactly where ``topk_idx`` is ``-1``.

    Examples
    --------
    >>> p = ExpertPlacement.from_phy2log([0, 1, 2, 3, 0, 0], num_logical=4, ep_size=3)
    >>> logical_to_physical(torch.tensor([[0, 3], [0, -1], [0, 1]]), p, ep_rank=1)
    tensor([[ 0,  3],
            [ 4, -1],
            [ 5,  1]], dtype=torch.int32)
    """
    ep_rank, token_offset = _validate(topk_idx, placement, ep_rank, token_offset)
    return _l2p_op(
        topk_idx, placement.log2phy, placement.logcnt, placement.num_local, ep_rank, token_offset, backend, check_index
    )


def _fake_l2p(topk_idx, log2phy, logcnt, num_local, ep_rank, token_offset, backend, check_index):
    return topk_idx.new_empty(topk_idx.shape, dtype=torch.int32)


@custom_op("logical_to_physical", _fake_l2p)
def _l2p_op(
    topk_idx: torch.Tensor,
    log2phy: torch.Tensor,
    logcnt: torch.Tensor,
    num_local: int,
    ep_rank: int,
    token_offset: int,
    backend: str,
    check_index: bool,
) -> torch.Tensor:
    """``torch.ops.epkit.logical_to_physical``: the ids checked on the host (outside CUDA stream capture: ids
    outside ``[-1, num_logical)`` map to -1 there), then the selected backend."""
    if check_index and host_checks(topk_idx.device):
        check_topk_idx(topk_idx, log2phy.shape[0])
    elif check_index:
        valid = (topk_idx >= -1) & (topk_idx < log2phy.shape[0])
        topk_idx = torch.where(valid, topk_idx, torch.full_like(topk_idx, -1))
    tables = _Tables(log2phy, logcnt, num_local)
    impl = select("logical_to_physical", topk_idx.device, backend)
    if impl == "reference":
        return logical_to_physical_reference(topk_idx, tables, ep_rank, token_offset)
    if impl == "cpu":
        return logical_to_physical_cpu(topk_idx, tables, ep_rank, token_offset)
    from epkit.kernels.triton.experts import logical_to_physical_flat

    device = topk_idx.device
    num_tokens, top_k = topk_idx.shape
    out = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    logical_to_physical_flat(
        topk_idx.contiguous().view(-1),
        log2phy.to(device).contiguous(),
        logcnt.to(device).contiguous(),
        out.view(-1),
        num_tokens,
        top_k,
        num_local,
        ep_rank,
        token_offset,
    )
    return out


def _selfcheck(backend: str, device: str = "cpu") -> None:
    """``logical_to_physical[backend]`` on ``device`` for every rank of a random 18-slot placement, against the
    reference."""
    g = torch.Generator().manual_seed(3)
    phy2log = torch.cat([torch.arange(12), torch.randint(0, 12, (6,), generator=g)])
    phy2log = phy2log[torch.randperm(18, generator=g)]
    placement = ExpertPlacement.from_phy2log(phy2log, num_logical=12, ep_size=6)
    topk = torch.randint(-1, 12, (41, 4), generator=g, dtype=torch.int32)
    dev_placement, dev_topk = placement.to(device), topk.to(device)
    for rank in range(6):
        got = logical_to_physical(dev_topk, dev_placement, rank, backend=backend).cpu()
        want = logical_to_physical_reference(topk, placement, rank)
        if not torch.equal(got, want):
            raise AssertionError(f"logical_to_physical[{backend}] differs from the reference at ep_rank={rank}")


_DOC = "logical expert ids -> physical replica ids (prefer the own rank, else round-robin by token)"
SPEC = register_op(
    OpSpec("logical_to_physical", ("cpu", "reference", "triton"), ("triton", "reference"), _DOC, _selfcheck)
)
