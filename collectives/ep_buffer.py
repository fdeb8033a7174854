"""EPBuffer: DeepEP-style dispatch/combine (normal and low-latency) on symmetric memory.

A facade: it checks the constructor's arguments, lets the planner (``ep/planner.py``) choose one normal-mode
path and one low-latency path for the group's transport, and hands every call to them (``ep/``: the flat
host-driven path over ``shm`` or ``torch``, the hierarchical one across hosts, the device kernels).

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

import torch

from epkit.collectives.bootstrap import group_info
from epkit.collectives.deadline import within
from epkit.collectives.ep import routing
from epkit.collectives.ep.config import DEFAULT_LOW_LATENCY_TOKENS, EPConfig, RegionSizes, region_sizes
from epkit.collectives.ep.handles import DispatchHandle, DispatchResult
from epkit.collectives.ep.ll_host import HostLowLatencyPath
from epkit.collectives.ep.ll_layout import LowLatencyHandle
from epkit.collectives.ep.normal_device import DeviceNormalPath
from epkit.collectives.ep.normal_flat import FlatNormalPath
from epkit.collectives.ep.planner import open_paths
from epkit.collectives.ep.routing import dispatch_layout, validate_dispatch
from epkit.collectives.ep.rows import format_code
from epkit.collectives.ep.worst import check_worst, pad_result, worst_error
from epkit.ops import refuse_capture

__all__ = [
    "DEFAULT_LOW_LATENCY_TOKENS",
    "EPBuffer",
    "DispatchHandle",
    "LowLatencyHandle",
    "RegionSizes",
    "region_sizes",
]


class EPBuffer:
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
        of one size (shm inside, torch between), else ``torch`` (``ep/planner.py``; hosts and domains from
        one probe). On several hosts (domains) every transport combines in ``ep_reference``'s two-level order
        (``hosts``). Rows (x, y, received rows, outputs) live on the buffer's device (``self.device``: the GPU
        for nvshmem); routing metadata and handles stay on the CPU. On CUDA the row moves and sums are torch
        ops with the CPU's fused C++ rounding (tested on CPU through ``portable=True``, and over nvshmem
        with ``epkit.testing.nvshmem_emulator``). Normal mode synchronizes with the host (routing copied to the
        CPU, counts read back, as DeepEP's normal mode reads its counts; not a worst-case dispatch on the device
        kernels: ``dispatch(num_worst_tokens=...)``); the low-latency mode does not (see
        ``ep/ll_host.py``: on CUDA rows its failures surface at a later call or at :meth:`synchronize`).
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
        see ``ep/device_state.py``.
    portable : bool
        CPU rows take the formulations CUDA rows take: the sums in torch ops, the row moves through the Triton copy
        kernel (under the interpreter), the stream-ordered low-latency protocol (no host read of the routing; its
        errors surface at a later call). Bitwise the same results, far slower: how an engine's CPU tests (and
        epkit's) run the GPU path's code on CPU ranks. Default False.

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
    paths : tuple of str
        The normal-mode and low-latency paths the planner chose (``ep/planner.py``'s table), by class name.
    result_slots : ResultSlots or None
        On ``shm`` (host kernels): where the senders of a normal dispatch write its x and scale rows straight into
        this rank's results (``ep/result_slots.py``: 2 slots of every row a rank can receive, past the
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
        portable: bool = False,
    ):
        rank, w, ranks = group_info(group)[:3]
        n_ll, n = num_max_dispatch_tokens_per_rank, num_max_tokens_per_rank
        cfg = EPConfig.checked(w, rank, hidden, num_experts, n, num_topk, n_ll, timeout, portable, ranks)
        with within(timeout):  # every wait of the construction together: one timeout, end to end
            self._ctx, self._normal, self._ll = open_paths(group, cfg, transport, kernels)
        self.group, self.cfg = group, self._ctx.cfg

    # what the buffer is

    world_size = property(lambda self: self.cfg.world_size)
    rank = property(lambda self: self.cfg.rank)
    hidden = property(lambda self: self.cfg.hidden)
    num_experts = property(lambda self: self.cfg.num_experts)
    num_topk = property(lambda self: self.cfg.num_topk)
    num_local_experts = property(lambda self: self.cfg.num_local_experts)
    num_max_tokens_per_rank = property(lambda self: self.cfg.num_max_tokens_per_rank)
    num_max_dispatch_tokens_per_rank = property(lambda self: self.cfg.num_max_dispatch_tokens_per_rank)
    timeout = property(lambda self: self.cfg.timeout)
    hosts = property(lambda self: self.cfg.host_lists)
    buffer = property(lambda self: self._ctx.buffer)
    region_bytes = property(lambda self: self._ctx.region_bytes)
    transport = property(lambda self: self._ctx.transport)
    device = property(lambda self: self._ctx.device, doc="Where rows live; routing metadata is kept on the CPU.")
    result_slots = property(lambda self: self._ctx.result_slots)

    @property
    def recv_tokens_per_expert_total(self) -> torch.Tensor:
        """Tokens received per local expert since the last reset (feeds EPLB's ExpertLoadCounter). The
        low-latency calls on CUDA rows count on the device instead (no host read): read the total, both
        included, with :meth:`take_expert_load`."""
        return self._ctx.recv_tokens_per_expert_total

    @property
    def paths(self) -> tuple[str, str]:
        """The paths the planner chose at construction (``ep/planner.py``), by class name: the normal mode's and the
        low-latency mode's, e.g. ``("FlatNormalPath", "HostLowLatencyPath")``; they do not change afterwards."""
        return type(self._normal).__name__, type(self._ll).__name__

    @property
    def uses_device_kernels(self) -> bool:
        """Whether dispatch/combine run as device kernels (``kernels=...``; see ``ep/device_state.py``)."""
        return self._normal.on_device

    def is_within_domain(self) -> bool:
        return self.buffer.is_within_domain()

    def bytes_across_hosts(self) -> int:
        """Bytes this rank has sent to ranks on other hosts (NVLink domains) through this EPBuffer so far: the
        flat buffer's messages to ranks of other hosts and, on a hierarchy, every rail message to another host -
        headers and payloads on ``torch``, the payloads put with a signal on ``nvshmem``. 0 on ``shm``. Sum over
        the ranks for a job's."""
        return self._normal.bytes_across_hosts()

    # life

    def close(self) -> None:
        """Release the symmetric buffer; the EPBuffer cannot be used afterwards (DeepEP's ``destroy``).

        Collective on nvshmem: every rank closes its buffer (see :meth:`SymmBuffer.close`). Tensors that
        the calls returned stay valid (on shm, results in the result slots keep their memory mapped while they
        live; none on nvshmem is a view of the symmetric memory); closing twice is harmless,
        and a dispatch or combine afterwards raises ``RuntimeError``. Also ``with EPBuffer(...) as buf:``
        (leaving it by an exception skips the collective free, which could wait for the other ranks).
        """
        self._ctx.drop_caches()
        parts = self._ctx.all_buffers()
        failed = [b.broken for b in parts if b.broken is not None]  # one part failed: retire all (no collective
        for b in parts if failed else ():  # close, no wait on the job's store: out of reach on a cut-off host)
            b.mark_broken(failed[0])
        for b in parts:
            b.close()

    destroy = close  # DeepEP's name for it

    def __enter__(self) -> EPBuffer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._ctx.drop_caches()
        for b in self._ctx.all_buffers():
            b.__exit__(exc_type, exc, tb)

    def retire_on_failure(self, what: str):
        """Context for code that moves rows after every rank agreed on the call: any exception inside retires the
        buffer and tells the peers before it propagates (their waits on this rank end at once)."""
        return self._ctx.retire_on_failure(what)

    def take_expert_load(self) -> torch.Tensor:
        """Tokens received per local (physical) expert since the last call, ``[num_local_experts]`` int64; resets.

        To feed :class:`epkit.eplb.ExpertLoadCounter` (logical experts), all-gather these
        over the EP group (rank-major = physical ids) and fold them through the
        placement's ``phy2log``: ``counts_logical.index_add_(0, phy2log, counts_physical)``.
        """
        return self._ctx.take_expert_load()

    def synchronize(self) -> None:
        """Wait for this rank's stream-ordered low-latency work; raise what it found (a silent peer as
        TimeoutError, a rank's invalid input as ValueError). Calls on CUDA rows never wait for the device
        themselves: their failures surface here or at the start of the next call on this buffer (on the
        device kernels, once this rank's queued kernels have finished: a bounded wait)."""
        self._ll.synchronize()

    def mask_ranks(self, ranks) -> None:
        """Leave the group's ranks at positions ``ranks`` out of the later low-latency calls (DeepEP's shrink mode;
        an empty set: none): nothing is sent to them or awaited from them, a dispatch receives no row from them
        and a combine sums no term of their experts (a pair routed there adds nothing). Every other rank must mask
        the same ranks before the same call, and a masked rank takes no further part in this buffer. Host-checked
        low-latency calls (CPU rows on ``shm``) only (elsewhere only the empty set); the normal mode ignores no rank:
        do not call it meanwhile."""
        ranks = list(ranks)
        host = isinstance(self._ll, HostLowLatencyPath) and not self.cfg.portable and self.device.type == "cpu"
        if ranks and not host:
            raise RuntimeError("EPBuffer.mask_ranks needs the host-checked low-latency path (CPU rows, not portable)")
        self._ctx.buffer.mask(ranks)

    @property
    def masked_ranks(self) -> frozenset[int]:
        """The positions :meth:`mask_ranks` left out (empty: none)."""
        return self._ctx.buffer.masked

    # normal mode

    def get_dispatch_layout(self, topk_idx: torch.Tensor):
        """``(num_tokens_per_rank [W] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool)``.

        Entries of -1 in ``topk_idx`` are skipped; a token counts once per rank however
        many of its experts live there.
        """
        return dispatch_layout(self.cfg, topk_idx)

    def validate_dispatch(self, x, scales, topk_idx, topk_weights, capacity: int, check_values: bool = True) -> None:
        """Raise ValueError for dispatch inputs this buffer cannot take (local checks: no data moves, nothing is
        agreed with the peers; callers carry the error into their agreement step). ``check_values=False`` leaves
        the expert ids' range to the caller (the device kernels check it on the device: no host read).

        ``x [T, hidden]`` on the buffer's device (bf16/fp16/fp32, or e4m3 with ``scales [T, ceil(hidden/128)]``
        float32), at most ``capacity`` tokens; ``topk_idx [T, num_topk]`` in ``[-1, num_experts)``;
        ``topk_weights [T, num_topk]`` or None.
        """
        validate_dispatch(self.cfg, self.device, x, scales, topk_idx, topk_weights, capacity, check_values)

    def dispatch(
        self,
        x,
        topk_idx=None,
        topk_weights=None,
        expert_alignment: int = 1,
        expand: bool = False,
        handle: DispatchHandle | None = None,
        num_worst_tokens: int = 0,
        num_sms: int | None = None,
        reject: str | None = None,
    ) -> DispatchResult:
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
            Reuse a previous layout (cached dispatch): skips the layout exchange; topk come from it (and the
            worst-case shape, if its dispatch had one).
        num_worst_tokens : int
            Worst-case outputs (DeepEP's ``num_worst_tokens``; 0: none): ``R = num_worst_tokens`` rows and, with
            ``expand=True``, ``X = align(num_worst_tokens * min(num_topk, L) + (alignment - 1) * L, alignment)``
            expanded rows (L local experts), so that nothing has to be read back to size them: on the device kernels
            the call makes no host read (``ep/worst.py``). Rows past the received ones are padding: zero rows, expert
            ids -1, weights 0, ``m_indices`` -1; a combine takes ``y`` of the padded shape. Every rank passes the same
            value and none may receive more rows than it: else ValueError on every rank before any row moves (on
            the device kernels at the rank's next call, retiring the buffer: the host learns of it only then; at once
            on CPU ranks, whose kernels have finished when the call returns). Such a call, its combine and its cached
            dispatches are the normal mode's only ones a CUDA graph can capture (warm up eagerly first: the first
            call allocates the buffer's host words).
        num_sms : int, optional
            The SM budget of this call on the device kernels (DeepEP's ``num_sms``): the programs of each of its
            multi-program launches (an int >= 2; None: the buffer's, 128 on CUDA). Each rank may pass its own. Its
            cached dispatches keep it (their layout's chunks are its programs). Under the interpreter the count
            is honoured too (programs run one after another); no effect on the host-driven paths, which reject a
            bad value alike (the same ValueError on every rank).
        reject : str, optional
            This rank's verdict on a wrapper's arguments (``epkit.compat.deep_ep``'s calls without an agreement of
            their own): rejected on every rank with this text, as a bad argument would be (pass stand-ins: no rows).

        Returns
        -------
        :class:`DispatchResult` (a named tuple):
        recv_x : Tensor [R, hidden] (or (fp8, scales)); with ``expand=True`` [X, hidden] expanded rows
        recv_topk_idx : Tensor [R, num_topk] local expert ids, -1 elsewhere
        recv_topk_weights : Tensor [R, num_topk] float32
        num_recv_tokens_per_expert : list[int], per local expert, aligned to ``expert_alignment`` (with
            ``num_worst_tokens``: a ``[L]`` int32 tensor on the buffer's device)
        handle : DispatchHandle (``handle.m_indices`` when expanded: see :attr:`DispatchHandle`)
        """
        if isinstance(handle, DispatchHandle):
            worst = handle.worst is not None
        else:
            worst = worst_error(num_worst_tokens) is None and num_worst_tokens > 0
        if not (worst and self.uses_device_kernels):  # only a worst-case call on the kernels reads nothing back
            refuse_capture("dispatch", self.device)
        x, scales = x if isinstance(x, (tuple, list)) else (x, None)
        if handle is not None:  # a cached dispatch keeps its dispatch's num_sms
            result = self._normal.dispatch_cached(x, scales, handle, reject)
            if handle.worst is not None and not self.uses_device_kernels:  # the kernels padded it themselves
                result = pad_result(result, handle.worst, self.num_local_experts)
            return result
        plain = isinstance(num_worst_tokens, int) and not isinstance(num_worst_tokens, bool) and num_worst_tokens == 0
        if isinstance(self._normal, DeviceNormalPath):
            bad = worst_error(num_worst_tokens)  # a bad value is this rank's rejection: the others learn why
            n = num_worst_tokens if bad is None else 0
            args = (expert_alignment, expand, n, bad or reject, num_sms)
            return self._normal.dispatch(x, scales, topk_idx, topk_weights, *args)
        sms = reject or routing.num_sms_error(num_sms)  # num_sms: no effect here, a bad value rejected alike
        if plain:
            return self._normal.dispatch(x, scales, topk_idx, topk_weights, expert_alignment, expand, sms)
        return self._dispatch_worst(x, scales, topk_idx, topk_weights, expert_alignment, expand, num_worst_tokens, sms)

    def _dispatch_worst(
        self, x, scales, topk_idx, topk_weights, alignment: int, expand: bool, n, sms: str | None
    ) -> DispatchResult:
        """``dispatch`` with ``num_worst_tokens=n`` (see there) on a host path: first an exchange of every rank's
        counts (``worst.check_worst``), then the dispatch, padded; ``sms``: the verdict on ``num_sms``."""
        bad = worst_error(n)
        n = n if bad is None else 0  # a bad value is this rank's rejection: its peers learn why in the agreement
        cfg = self.cfg
        error = bad or routing.dispatch_error(cfg, self.device, x, scales, topk_idx, topk_weights, alignment, False)
        error = error or sms
        counts = dispatch_layout(cfg, topk_idx.cpu())[:2] if error is None else (torch.zeros(0), torch.zeros(0))
        fmt = format_code(x.dtype, scales is not None) if error is None else 0
        shape = check_worst(self._ctx, n, error, fmt, counts, alignment)
        result = self._normal.dispatch(x, scales, topk_idx, topk_weights, alignment, expand)
        return pad_result(result, shape, self.num_local_experts)

    @staticmethod
    def m_indices(handle: DispatchHandle) -> torch.Tensor:
        """``[X] int32`` local expert id per expanded row, -1 on padding (the contiguous grouped GEMM's input)."""
        if not handle.expand:
            raise ValueError("m_indices needs a dispatch with expand=True")
        if handle.kernel_state is not None:  # the device kernels wrote it
            return handle.kernel_state.m
        rows = handle.expanded_rows
        out = torch.full((handle.worst[1],) if handle.worst else rows.shape, -1, dtype=torch.int32)
        ok = handle.expanded_slot >= 0
        flat_slot = handle.expanded_slot[ok]
        out[flat_slot] = handle.recv_topk_idx[ok].to(torch.int32)
        return out.to(handle.device)

    def combine(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias=None,
        num_sms: int | None = None,
        reject: str | None = None,
        order: torch.Tensor | None = None,
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
        num_sms : int, optional
            This call's SM budget on the device kernels (as :meth:`dispatch`'s; no effect elsewhere).
        reject : str, optional
            This rank's own verdict on a wrapper's arguments (as :meth:`dispatch`'s).
        order : Tensor [T, W] int32 on the buffer's device, optional
            Another summation order (DeepEP V2's combine): per token, the ranks whose rows are added, in this
            order (-1, or a value outside ``[0, W)``: no term; list each rank holding one of the token's experts
            once: the values are not read back to be checked), after the biases. Device kernels only (the
            host-driven paths reject it alike on every rank: there :meth:`combine_unsummed` gives the rows).

        Returns
        -------
        Tensor [T, hidden] of ``y.dtype``: float32 accumulation in a fixed order (the rows by destination rank
        ascending, then the biases; or ``order``'s), rounded once.
        """
        # only a worst-case dispatch's combine on the kernels reads nothing back: a graph can capture it
        if not (isinstance(handle, DispatchHandle) and handle.worst and self.uses_device_kernels):
            refuse_capture("combine", self.device)
        reject = reject or routing.order_error(order, handle, self.world_size, self.device, self.uses_device_kernels)
        if isinstance(self._normal, DeviceNormalPath):
            return self._normal.combine(y, handle, topk_weights, bias, num_sms, reject, order)
        return self._normal.combine(y, handle, topk_weights, bias, reject or routing.num_sms_error(num_sms))

    def combine_unsummed(
        self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """:meth:`combine` up to the sum: each rank's rows come back to their source unsummed, for a caller that
        sums them in an order (or with terms) of its own, e.g. DeepEP V2's (``epkit.compat.deep_ep``).

        Same ``y``, ``handle`` and ``topk_weights`` as :meth:`combine` (with ``expand=True`` each received row's
        expanded rows are summed on the expert side, weighted, k ascending, as there). Returns, per rank ``r``,
        ``[n_r, hidden]`` rows of ``y.dtype``: what rank ``r`` sent back for the ``n_r`` tokens this rank sent it, in
        ascending token order. Host-driven flat buffers only (ValueError elsewhere: the hierarchy sums inside
        each host, the device kernels at the source).
        """
        refuse_capture("combine", self.device)
        if not isinstance(self._normal, FlatNormalPath):
            raise ValueError(
                f"combine_unsummed needs a flat host-driven buffer; this one's normal path is {self.paths[0]}"
            )
        return self._normal.combine_unsummed(y, handle, topk_weights)

    def run_fused(self, x, topk_idx, topk_weights, alignment: int, error: str | None, biases, experts):
        """``fused_moe`` on the device kernels (:func:`epkit.collectives.fused_moe.fused_moe` calls it when
        :attr:`uses_device_kernels`): dispatch (expanded) -> ``experts(rows, m_indices)`` -> combine."""
        if not isinstance(self._normal, DeviceNormalPath):
            raise RuntimeError("run_fused needs a buffer on the device kernels (uses_device_kernels)")
        return self._normal.fused(x, topk_idx, topk_weights, alignment, error, biases, experts)

    # low-latency mode

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        use_fp8: bool = True,
        return_recv_hook: bool = False,
        out=None,
    ):
        """Fixed-slot dispatch into the masked layout (decode).

        Each (token, expert) pair goes to the expert's rank into fixed slots, so shapes never
        depend on the routing (on CUDA rows neither do the messages' sizes). On CUDA rows the call never
        waits for the device (``ep/ll_host.py``: errors found on the device are raised by a later call on every
        rank, or by :meth:`synchronize`).

        Parameters
        ----------
        x : Tensor [T, hidden] bfloat16, T <= num_max_dispatch_tokens_per_rank
        topk_idx : Tensor [T, num_topk] int32/int64 in [-1, num_experts), on the buffer's device
        num_max_dispatch_tokens_per_rank : int
            Slots per (source rank, local expert); at most the buffer's capacity.
        use_fp8 : bool
            Send e4m3 rows with float32 per-128 scales (the grouped GEMM's activation format).
        return_recv_hook : bool
            Only send now; ``hook()`` waits and fills the outputs.
        out : the receive tensor(s) to fill and return, contiguous on the buffer's device, as ``recv_x`` below
            (N = num_max_dispatch_tokens_per_rank, L local experts, W ranks); a wrong one: ValueError on every rank.
            Without it they come from the buffer's pool, whose memory is reused only once the caller holds no
            tensor or view of it: a kept result is never overwritten (``ep/ll_out.py``).

        Returns
        -------
        recv_x : Tensor [L, N * W, hidden] bf16, or (e4m3 tensor, scales [L, N * W, hidden/128]) (``out`` if given)
            Rows of expert e ordered by source rank, then source token order; rows past
            ``recv_count[e]`` are unspecified.
        recv_count : Tensor [num_local_experts] int32
        handle : LowLatencyHandle
        hook : callable; receives the data (a no-op when ``return_recv_hook`` is False). Call it
            before the next collective on this buffer.
        """
        return self._ll.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, use_fp8, return_recv_hook, out)

    def low_latency_combine(
        self,
        y: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        return_recv_hook: bool = False,
        out=None,
    ):
        """Send expert outputs back and reduce them at the source.

        Parameters
        ----------
        y : Tensor [num_local_experts, N * W, hidden] bfloat16 (the masked layout of the dispatch)
        topk_idx, topk_weights : Tensor [T, num_topk] as given to the dispatch (weights float32, on the
            buffer's device)
        handle : LowLatencyHandle
        out : Tensor [T, hidden] bfloat16, contiguous on the buffer's device, optional
            Written and returned (as DeepEP's ``out``); without it, a tensor of the buffer's pool (see
            ``low_latency_dispatch``). A wrong one is rejected as a bad ``y`` is.

        Returns
        -------
        Tensor [T, hidden] bfloat16: ``sum over k ascending of w[t, k] * y_row(t, k)`` in float32
        (and the hook, if ``return_recv_hook``).
        """
        return self._ll.combine(y, topk_idx, topk_weights, handle, return_recv_hook, out)
