"""EPBuffer: DeepEP-style dispatch/combine (normal and low-latency) on symmetric memory.

The protocol is written once against :class:`~epkit.collectives.symm_buffer.SymmBuffer`'s
exchange; only the transport differs (``shm``: one-sided copies into peers'
shared memory, no staging; ``torch``: torch.distributed all-to-all).

Semantics (shared with DeepEP where it has them):
* experts are split evenly: expert ``e`` lives on rank ``e // num_local_experts``;
* each token goes once to each destination rank that holds one of its experts;
* received rows are ordered by source rank, then source token order (deterministic);
* ``recv_topk_idx`` holds local expert ids, ``-1`` where the expert lives elsewhere;
* ``expand=True`` gives one row per (token, local expert), grouped by expert, each
  group padded to ``expert_alignment`` with zero rows, plus the ``m_indices`` the
  contiguous grouped GEMM takes (``-1`` on padding rows);
* combine sums in a fixed order (see :mod:`epkit.collectives.ep_reference`), so
  results are bitwise equal across transports and runs.

Every input is validated on every rank before any row moves: a bad call on one
rank raises the same ``ValueError`` on all ranks. Every wait has a timeout and a
``TimeoutError`` names the silent peer.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from epkit._details.host_memory import mark_host_memory
from epkit.collectives._details.ep_device import DevicePathMixin
from epkit.collectives._details.ep_device_ll import DeviceLowLatencyMixin
from epkit.collectives._details.ep_device_normal import DeviceNormalMixin
from epkit.collectives._details.ep_hier import HierarchyMixin
from epkit.collectives._details.ep_hier_rows import HIERARCHICAL, plan_transport
from epkit.collectives._details.ep_low_latency import LowLatencyMixin
from epkit.collectives._details.ep_low_latency_layout import COMBINE_HEADER, LowLatencyHandle
from epkit.collectives._details.ep_normal import DispatchHandle, NormalModeMixin
from epkit.collectives._details.ep_rows import (
    FIELD_ALIGN,
    META_MSG,
    align_up,
    check_biases,
)
from epkit.collectives.bootstrap import group_info
from epkit.kernels.triton.ep_layout import check_aligned
from epkit.ops import refuse_capture
from epkit.utils import check_topk_idx

__all__ = [
    "DEFAULT_LOW_LATENCY_TOKENS",
    "EPBuffer",
    "DispatchHandle",
    "LowLatencyHandle",
    "RegionSizes",
    "region_sizes",
]

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


class EPBuffer(
    HierarchyMixin, NormalModeMixin, LowLatencyMixin, DevicePathMixin, DeviceLowLatencyMixin, DeviceNormalMixin
):
    """Dispatch/combine for one EP group.

    Parameters
    ----------
    group : ProcessGroup
        The EP group (gloo for CPU ranks).
    hidden : int
        Hidden size of the rows moved.
    num_experts : int
        Routed (physical) experts; divisible by the group size.
    num_max_tokens_per_rank : int
        Capacity: the most tokens any rank dispatches in one call.
    num_topk : int
        Experts per token.
    transport : {"auto", "shm", "torch", "nvshmem", "hierarchical"}
        ``auto``: CUDA ranks (NCCL group) ``nvshmem`` in one NVLink domain, ``hierarchical`` across domains of
        one size (nvshmem inside and between); CPU ranks ``shm`` on one host, ``hierarchical`` on several hosts
        of one size (shm inside, torch between), else ``torch`` (``_details/ep_hier.py``; hosts and domains from
        one probe). On several hosts (domains) every transport combines in ``ep_reference``'s two-level order
        (``hosts``). Rows (x, y, received rows, outputs) live on the buffer's device (``self.device``: the GPU
        for nvshmem); routing metadata and handles stay on the CPU. On CUDA the row moves and sums are torch
        ops with the CPU's fused C++ rounding (tested on CPU through ``ep_rows.PORTABLE``, and over nvshmem
        with ``epkit.testing.nvshmem_emulator``). Normal mode synchronizes with the host (routing copied to the
        CPU, counts read back, as DeepEP's normal mode reads its counts); the low-latency mode does not (see
        ``_details/ep_low_latency.py``: on CUDA rows its failures surface at a later call or at :meth:`synchronize`).
    num_max_dispatch_tokens_per_rank : int, optional
        Capacity of the low-latency mode: the most tokens a rank sends in one low-latency dispatch (default
        ``min(num_max_tokens_per_rank, 128)``, a decode batch; every local expert reserves this many slots per
        source rank, so the memory grows with it times ``num_experts``).
    timeout : float
        Seconds any wait may take (default 30).
    kernels : {"auto", "device", "host"}
        ``auto``: device-side dispatch/combine kernels (``kernels/triton/ep_*.py``) for CUDA rows when every peer
        is directly addressable (nvshmem inside one NVLink domain), the host-driven protocol otherwise;
        ``device``: the kernels wherever every peer is addressable, CPU ranks on shm included (under the Triton
        interpreter: far slower than the C++ CPU path, for tests); ``host``: the host-driven protocol. The
        environment variable ``EPKIT_EP_KERNELS`` overrides ``auto``. Results are bitwise the same either way;
        see ``_details/ep_device.py``.

    Attributes
    ----------
    buffer : SymmBuffer
        The symmetric buffer the rows move through (``world_size`` regions of ``region_bytes``).
    region_bytes : int
        Bytes of one source's region in every rank's buffer: the largest message of any mode.
    transport, device
        The transport's name (the hierarchy's: ``"hierarchical(shm+torch)"``, ``"hierarchical(nvshmem+nvshmem)"``).
    hosts : list of list of int
        The group's ranks by host (NVLink domain for CUDA ranks; one list on one host); picks the combine order.
    result_slots : ResultSlots or None
        On ``shm`` (host kernels): where the senders of a normal dispatch write its x and scale rows straight into
        this rank's results (``_details/ep_result_slots.py``: 2 slots of every row a rank can receive, past the
        regions; ``result_slots.nbytes`` of the buffer; a result held keeps its slot; the environment variable
        ``EPKIT_RESULT_SLOTS`` sets the number, 0 for none). None elsewhere; a hierarchy on CPU ranks has its
        own in its ``intra`` buffer (the forwarders write into them).
    """

    def __init__(
        self,
        group,
        hidden: int,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        transport: str = "auto",
        num_max_dispatch_tokens_per_rank: int | None = None,
        timeout: float = 30.0,
        kernels: str = "auto",
    ):
        w = group_info(group)[1]
        for name, v in (
            ("hidden", hidden),
            ("num_experts", num_experts),
            ("num_max_tokens_per_rank", num_max_tokens_per_rank),
            ("num_topk", num_topk),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if num_experts % w:
            raise ValueError(f"num_experts {num_experts} is not divisible by the EP group size {w}")
        if transport not in ("auto", "shm", "torch", "nvshmem", HIERARCHICAL):
            raise ValueError(
                f"EPBuffer transport must be 'auto', 'shm', 'torch', 'nvshmem' or 'hierarchical', got {transport!r}"
            )
        # NCCL only: CUDA ranks, rows over nvshmem (BackendUnavailableError says what is missing), flat or across
        # NVLink domains; a gloo (or mixed cpu:gloo,cuda:nccl) group: its hosts pick shm, the hierarchy or torch.
        transport, self.hosts, rows = plan_transport(group, transport, timeout)
        self.group, self.world_size, self.rank = group, w, group_info(group)[0]
        self.hidden, self.num_experts, self.num_topk = hidden, num_experts, num_topk
        self.num_local_experts = num_experts // w
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        if num_max_dispatch_tokens_per_rank is None:
            num_max_dispatch_tokens_per_rank = min(num_max_tokens_per_rank, DEFAULT_LOW_LATENCY_TOKENS)
        if isinstance(num_max_dispatch_tokens_per_rank, bool) or not isinstance(num_max_dispatch_tokens_per_rank, int):
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank must be a positive integer, got {num_max_dispatch_tokens_per_rank!r}"
            )
        if num_max_dispatch_tokens_per_rank < 1:
            raise ValueError(f"num_max_dispatch_tokens_per_rank must be >= 1, got {num_max_dispatch_tokens_per_rank}")
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.timeout = timeout
        h, n, n_ll = hidden, num_max_tokens_per_rank, self.num_max_dispatch_tokens_per_rank
        sizes = region_sizes(hidden, num_topk, self.num_local_experts, n, n_ll)
        self._row_bytes, self.region_bytes = sizes.row_bytes, sizes.region_bytes
        ll_sized = sizes.low_latency >= sizes.normal
        knob = "num_max_dispatch_tokens_per_rank" if ll_sized else "num_max_tokens_per_rank"
        hint = (
            f"EPBuffer's {w} regions of {self.region_bytes} bytes are sized by its "
            f"{'low-latency' if ll_sized else 'normal'} mode (num_max_tokens_per_rank={n}, "
            f"num_max_dispatch_tokens_per_rank={n_ll}, hidden={h}, num_experts={num_experts}): lower {knob}"
        )
        self._open_buffers(group, transport, rows, sizes, kernels, timeout, hint)
        #: Where rows live (x, y, received rows, outputs); routing metadata is kept on the CPU.
        self.device = self.buffer.local.device
        #: Tokens received per local expert since the last reset (feeds EPLB's ExpertLoadCounter). The
        #: low-latency calls on CUDA rows count on the device instead (no host read): read the total, both
        #: included, with :meth:`take_expert_load`.
        self.recv_tokens_per_expert_total = mark_host_memory(torch.zeros(self.num_local_experts, dtype=torch.int64))
        self._ll_cache: dict = {}
        self._dispatches = self._ll_dispatches = 0  # normal / low-latency dispatch calls (handle epochs)
        #: The device path's state (``_details/ep_device.py``), or None on the host-driven path.
        self._dev = self._attach_kernels(self._kernel_mode, self._kernel_layout)

    def close(self) -> None:
        """Release the symmetric buffer; the EPBuffer cannot be used afterwards (DeepEP's ``destroy``).

        Collective on nvshmem: every rank closes its buffer (see :meth:`SymmBuffer.close`). Tensors that
        the calls returned stay valid (on shm, results in the result slots keep their memory mapped while they
        live; none on nvshmem is a view of the symmetric memory); closing twice is harmless,
        and a dispatch or combine afterwards raises ``RuntimeError``. Also ``with EPBuffer(...) as buf:``
        (leaving it by an exception skips the collective free, which could wait for the other ranks).
        """
        self._drop_caches()
        parts = [self.buffer, *(self._hier.buffers() if self._hier is not None else ())]
        failed = [b.broken for b in parts if b.broken is not None]  # one part failed: retire all (no collective
        for b in parts if failed else ():  # close, no wait on the job's store: out of reach on a cut-off host)
            b.mark_broken(failed[0])
        self.buffer.close()
        if self._hier is not None:
            self._hier.close()

    def _drop_caches(self) -> None:
        self._ll_cache.clear()
        self.__dict__.pop("_addr_tables", None)
        self.__dict__.pop("_row_pool", None)

    destroy = close  # DeepEP's name for it

    def __enter__(self) -> EPBuffer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._drop_caches()
        self.buffer.__exit__(exc_type, exc, tb)
        for buf in self._hier.buffers() if self._hier is not None else ():
            buf.__exit__(exc_type, exc, tb)

    def is_within_domain(self) -> bool:
        return self.buffer.is_within_domain()

    @property
    def uses_device_kernels(self) -> bool:
        """Whether dispatch/combine run as device kernels (``kernels=...``; see ``_details/ep_device.py``)."""
        return self._dev is not None

    @contextlib.contextmanager
    def retire_on_failure(self, what: str):
        """Context for code that moves rows after every rank agreed on the call: any exception inside leaves the
        ranks' exchange counters out of step, so it retires the buffer and tells the peers before it propagates
        (their waits on this rank end at once with PeerFailedError)."""
        try:
            yield
        except BaseException as exc:
            self.buffer.mark_broken(
                f"{what} failed on rank {self.rank}: {type(exc).__name__}: {exc}", culprit=self.rank
            )
            raise

    def _reject_locally(self, what: str, exc: Exception):
        """A call with no agreement step failed validation on this rank only: retire the buffer here, so the next
        call cannot pair with the peers' stale messages, and tell the peers, whose waits on this rank end at once
        (PeerFailedError) instead of timing out."""
        self.buffer.mark_broken(f"{what} rejected on rank {self.rank}: {exc}", culprit=self.rank)
        raise exc

    def take_expert_load(self) -> torch.Tensor:
        """Tokens received per local (physical) expert since the last call, ``[num_local_experts]`` int64; resets.

        To feed :class:`epkit.eplb.ExpertLoadCounter` (logical experts), all-gather these
        over the EP group (rank-major = physical ids) and fold them through the
        placement's ``phy2log``: ``counts_logical.index_add_(0, phy2log, counts_physical)``.
        """
        out = self.recv_tokens_per_expert_total.clone()
        self.recv_tokens_per_expert_total.zero_()
        device_load = self.__dict__.get("_device_load")  # the low-latency path's counts on CUDA rows
        if device_load is not None:
            out += device_load.cpu()
            device_load.zero_()
        return out

    def synchronize(self) -> None:
        """Wait for this rank's stream-ordered low-latency work; raise what it found (a silent peer as
        TimeoutError, a rank's invalid input as ValueError). Calls on CUDA rows never wait for the device
        themselves: their failures surface here or at the start of the next call on this buffer (on the
        device kernels, once this rank's queued kernels have finished: a bounded wait)."""
        self.buffer.synchronize()
        if self._dev is not None:
            self._dev.poll(drain=True)

    # layout

    def get_dispatch_layout(self, topk_idx: torch.Tensor):
        """``(num_tokens_per_rank [W] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool)``.

        Entries of -1 in ``topk_idx`` are skipped; a token counts once per rank however
        many of its experts live there.
        """
        self._check_topk(topk_idx, topk_idx.shape[0] if topk_idx.dim() == 2 else -1)
        dev, ids = topk_idx.device, topk_idx.cpu().long().contiguous()
        t, w = ids.shape[0], self.world_size
        in_rank = torch.empty((t, w), dtype=torch.bool)
        per_rank = torch.empty(w, dtype=torch.int32)
        per_expert = torch.empty(self.num_experts, dtype=torch.int32)
        from epkit import _C  # one pass over the routing (ids checked above)

        _C.dispatch_layout(
            ids.data_ptr(), t, ids.shape[1], self.num_local_experts, w, self.num_experts,
            in_rank.data_ptr(), per_rank.data_ptr(), per_expert.data_ptr(),
        )  # fmt: skip
        return per_rank.to(dev), per_expert.to(dev), in_rank.to(dev)

    # validation

    def _check_topk(self, topk_idx, num_tokens: int, check_values: bool = True) -> None:
        check_topk_idx(topk_idx, self.num_experts, self.num_topk, check_values)
        if topk_idx.shape[0] != num_tokens:
            raise ValueError(f"topk_idx has shape {tuple(topk_idx.shape)}, expected ({num_tokens}, {self.num_topk})")

    def validate_dispatch(self, x, scales, topk_idx, topk_weights, capacity: int, check_values: bool = True) -> None:
        """Raise ValueError for dispatch inputs this buffer cannot take (local checks: no data moves, nothing is
        agreed with the peers; callers carry the error into their agreement step). ``check_values=False`` leaves
        the expert ids' range to the caller (the device kernels check it on the device: no host read).

        ``x [T, hidden]`` on the buffer's device (bf16/fp16/fp32, or e4m3 with ``scales [T, ceil(hidden/128)]``
        float32), at most ``capacity`` tokens; ``topk_idx [T, num_topk]`` in ``[-1, num_experts)``;
        ``topk_weights [T, num_topk]`` or None.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [num_tokens, {self.hidden}], got {tuple(getattr(x, 'shape', ()))}")
        if x.device != self.device:
            raise ValueError(f"x is on {x.device} but this EPBuffer moves rows on {self.device}")
        if x.dtype not in (torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn):
            raise ValueError(f"x dtype {x.dtype} is not supported (bfloat16, float16, float32, float8_e4m3fn)")
        if (x.dtype == torch.float8_e4m3fn) != (scales is not None):
            raise ValueError("FP8 x must come as (x_fp8, scales) with float32 scales [num_tokens, ceil(hidden/128)]")
        t = x.shape[0]
        if t > capacity:
            raise ValueError(f"{t} tokens exceed num_max_tokens_per_rank = {capacity}")
        if scales is not None and (scales.dtype != torch.float32 or tuple(scales.shape) != (t, -(-self.hidden // 128))):
            raise ValueError(
                f"scales must be float32 [{t}, {-(-self.hidden // 128)}], got {scales.dtype} {tuple(scales.shape)}"
            )
        self._check_topk(topk_idx, t, check_values)
        if topk_weights is not None and tuple(topk_weights.shape) != (t, self.num_topk):
            raise ValueError(f"topk_weights must be [{t}, {self.num_topk}], got {tuple(topk_weights.shape)}")

    # normal mode

    def dispatch(
        self,
        x,
        topk_idx=None,
        topk_weights=None,
        expert_alignment: int = 1,
        expand: bool = False,
        handle: DispatchHandle | None = None,
    ):
        """Send each token to every rank holding one of its experts.

        Parameters
        ----------
        x : Tensor [T, hidden] (bf16/fp16/fp32) or tuple (x_fp8 [T, hidden] e4m3, scales [T, ceil(hidden/128)] f32)
        topk_idx : Tensor [T, num_topk] int32/int64, values in [-1, num_experts)
        topk_weights : Tensor [T, num_topk] float32, optional (zeros if omitted)
        expert_alignment : int
            Per-expert counts (and expanded groups) are padded to a multiple of this.
        expand : bool
            Also return one row per (token, local expert), grouped by expert (see module doc).
        handle : DispatchHandle, optional
            Reuse a previous layout (cached dispatch): skips the layout exchange; topk come from it.

        Returns
        -------
        recv_x : Tensor [R, hidden] (or (fp8, scales)); with ``expand=True`` [X, hidden] expanded rows
        recv_topk_idx : Tensor [R, num_topk] local expert ids, -1 elsewhere
        recv_topk_weights : Tensor [R, num_topk] float32
        num_recv_tokens_per_expert : list[int], per local expert, aligned to ``expert_alignment``
        handle : DispatchHandle (``handle.m_indices`` when expanded: see :attr:`DispatchHandle`)
        """
        refuse_capture("dispatch", self.device)
        scales = None
        if isinstance(x, (tuple, list)):
            x, scales = x
        if handle is not None:
            cached = self._dispatch_cached if self._hier is None else self._hier_dispatch_cached
            return cached(x, scales, handle)
        if self._dev is not None:
            return self._dev_dispatch(x, scales, topk_idx, topk_weights, expert_alignment, expand)
        # Counted on every rank at every call, rejected ones too, so that the ranks' handles stay comparable.
        self._dispatches += 1
        error = None
        try:
            if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment < 1:
                raise ValueError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
            self.validate_dispatch(x, scales, topk_idx, topk_weights, self.num_max_tokens_per_rank)
            if topk_weights is not None and not isinstance(topk_weights, torch.Tensor):
                raise ValueError(f"topk_weights must be a tensor, got {type(topk_weights).__name__}")
        except Exception as exc:  # every rank must learn of it: no exception may skip the agreement
            error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        if self._hier is not None:  # across hosts: the layout agreement, then rows over the rail and inside hosts
            return self._hier_dispatch(error, x, scales, topk_idx, topk_weights, expert_alignment, expand)
        return self._flat_dispatch(error, x, scales, topk_idx, topk_weights, expert_alignment, expand)

    @staticmethod
    def m_indices(handle: DispatchHandle) -> torch.Tensor:
        """``[X] int32`` local expert id per expanded row, -1 on padding (the contiguous grouped GEMM's input)."""
        if not handle.expand:
            raise ValueError("m_indices needs a dispatch with expand=True")
        if handle.kernel_state is not None:  # the device kernels wrote it
            return handle.kernel_state["m"]
        rows = handle.expanded_rows
        out = torch.full(rows.shape, -1, dtype=torch.int32)
        ok = handle.expanded_slot >= 0
        flat_slot = handle.expanded_slot[ok]
        out[flat_slot] = handle.recv_topk_idx[ok].to(torch.int32)
        return out.to(handle.device)

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None, bias=None
    ) -> torch.Tensor:
        """Return every token's expert outputs to its source rank and sum them there.

        Parameters
        ----------
        y : Tensor [R, hidden] (normal: one row per received row, routing weights already applied)
            or [X, hidden] (``expand=True``: one row per expanded row; weighted here)
        handle : DispatchHandle from the matching dispatch (of this buffer; every rank passes the handle of the
            same dispatch: checked on every rank before any row moves)
        topk_weights : Tensor [R, num_topk], optional
            Expanded mode: weights to apply (default: the weights carried in the handle).
        bias : Tensor [T, hidden] or a tuple of up to two, optional
            Added after the sum (e.g. the shared expert's output).

        Returns
        -------
        Tensor [T, hidden] of ``y.dtype``: float32 accumulation in a fixed order.
        """
        refuse_capture("combine", self.device)
        h = self.hidden
        error, biases, weights = None, [], None
        try:
            if not isinstance(handle, DispatchHandle):
                raise ValueError(f"handle must be the DispatchHandle of a dispatch, got {type(handle).__name__}")
            biases = check_biases(bias, handle.num_tokens, h)
            want_rows = handle.expanded_rows.numel() if handle.expand else sum(handle.recv_counts)
            if (
                not isinstance(y, torch.Tensor)
                or y.dim() != 2
                or tuple(y.shape) != (want_rows, h)
                or y.dtype not in (torch.bfloat16, torch.float32, torch.float16)
                or y.device != self.device
            ):
                raise ValueError(
                    f"y must be bf16/fp16/fp32 [{want_rows}, {h}] on {self.device}, got {getattr(y, 'dtype', None)} "
                    f"{tuple(getattr(y, 'shape', ()))} on {getattr(y, 'device', None)}"
                )
            if self._dev is not None:
                for what, t in (("y", y), *((f"bias {i}", b) for i, b in enumerate(biases))):
                    check_aligned(what, t)
            if handle.expand:
                weights = handle.recv_topk_weights if topk_weights is None else topk_weights.float()
                if tuple(weights.shape) != tuple(handle.recv_topk_idx.shape):
                    raise ValueError(
                        f"topk_weights must be {tuple(handle.recv_topk_idx.shape)}, got {tuple(weights.shape)}"
                    )
        except Exception as exc:  # noqa: BLE001 -- every rank must learn of it in the agreement
            error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        plan = {}  # the hierarchy's routing for this combine, from the handle, while the agreement is under way

        def prepare():
            try:
                self._hier_combine_plan(handle, plan)
            except Exception:  # noqa: BLE001 -- a handle the agreement rejects; a valid one's plan is made again
                plan.clear()

        valid = error is None and getattr(handle, "hier", None) is not None
        self.agree_on_handle("combine", handle, error, prepare if self._hier is not None and valid else None)
        if self._hier is not None:
            with self._hier_retire("combine"):
                return self._hier_combine(y, handle, weights, biases, plan)
        with self.retire_on_failure("combine"):
            if self._dev is not None:
                return self._dev_combine(y, handle, weights, biases)
            return self._combine_rows(y, handle, weights, biases)
