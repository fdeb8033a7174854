"""DeepEP's interface (deepseek-ai/DeepEP: the legacy ``deep_ep.Buffer`` and V2's ``deep_ep.ElasticBuffer``) on
:class:`~epkit.collectives.ep_buffer.EPBuffer`: ``import epkit.compat.deep_ep as deep_ep`` where an engine had
``import deep_ep``. This module is the legacy ``Buffer``; ``_details/deep_ep_elastic.py`` says how V2's calls map.

Every public method of DeepEP's legacy ``Buffer``, with DeepEP's names, parameter names and order, defaults,
return arity and tensor layouts (the low-latency FP8 scales column-major, packed UE8M0 with ``use_ue8m0``);
``Config``, ``EventOverlap``, ``EventHandle`` and ``topk_idx_t`` too. Handles are DeepEP's tuples, each element with
DeepEP's meaning on epkit's layout (``_details/deep_ep_handles.py`` defines the channel split), and carry the
EPBuffer state a later call checks. A group of more than 8 ranks is DeepEP's internode mode, RDMA ranks of 8
consecutive ranks (``_details/deep_ep_internode.py``: the per-RDMA-rank counts, the ten-tensor handle,
``internode_dispatch`` / ``internode_combine``), whatever path epkit's EPBuffer takes underneath (the hierarchical
one where the ranks are on several hosts).
Semantics follow DeepEP where the two differ: received top-k weights are 0 where the expert lives on another
rank; the low-latency receive tensors are never written again while the caller holds them (EPBuffer's pool reuses
memory only once it is dropped).

How it maps:

- DeepEP sizes its buffer in bytes and takes any shape; an EPBuffer has a hidden size, top-k and token
  capacities. The shim makes one EPBuffer per ``(hidden, num_experts, num_topk)`` at the first call that needs
  it (every rank makes the same calls, as DeepEP requires) and a larger one when a call needs more room: a
  normal dispatch needs its largest token count of any rank, a low-latency call ``num_max_dispatch_tokens_per
  _rank`` slots. Before a buffer is picked or made or a row moves, every call that moves rows (dispatch, cached
  dispatch, combine, both modes) agrees with the other ranks in one small all-gather over the group
  (``_details/deep_ep_agreement.py``; low-latency calls on CPU ranks only, not on an NCCL group, where they stay
  stream-ordered) on the token count and the arguments every rank must share (``x``'s hidden size and dtype,
  the experts, the top-k, the capacity, the handle's buffer and dispatch): a call rejected on one rank, or whose
  arguments differ across ranks, is the same ``ValueError`` on every rank, naming each argument that differs
  and which rank has which value, and the Buffer goes on. A second all-gather gives every rank the others'
  routing, for DeepEP's handles (and, without top-k, the per-expert counts). ``num_nvl_bytes`` /
  ``num_rdma_bytes`` are recorded, not a cap; the size hints
  return the bytes such a buffer takes (``Config.get_nvl_buffer_size_hint``, ``get_low_latency_rdma_size_hint``).
- Rows live on the tensors' device: CPU tensors over shared memory (or torch.distributed), CUDA tensors over
  NVSHMEM, whatever backend ``group`` has.
- The work is done (or queued on the current stream) when a call returns: ``async_finish=True`` returns an
  event on the current stream, ``previous_event`` is waited for first, ``return_recv_hook=True`` defers the
  receive to the hook. ``config``, ``num_qps_per_rank`` and ``allow_nvlink_for_low_latency_mode`` tune DeepEP's
  kernels and are checked, with no effect here; ``clean_low_latency_buffer`` has nothing to clean (each
  message carries its own header).
- ``enable_shrink=True`` (CPU ranks): the low-latency calls (and ``clean_low_latency_buffer``) meet through the
  job's store among the unmasked ranks; a rank silent past the Buffer's timeout is masked at that call on every
  other rank alike, and the rows then move among the unmasked ranks only (``EPBuffer.mask_ranks``, or a buffer
  over them alone): a dispatch receives nothing from a masked rank, a combine sums no term of its experts.
  ``low_latency_query_mask_buffer`` / ``update`` / ``clean`` read and set the mask (``_details/deep_ep_shrink.py``).
  The normal-mode calls mask nothing (as DeepEP's): they still meet over the whole group.

Refused, with a ``ValueError`` naming DeepEP's parameter: ``comm`` (an mpi4py communicator), ``enable_shrink``
on an NCCL group, ``num_tokens_per_rdma_rank`` given on 8 ranks or fewer or missing on more (DeepEP's modes), a
dispatch with a layout that does not match ``topk_idx`` (without top-k, rows go where ``is_token_in_rank`` says),
a normal-mode call on more than 8 ranks that are not whole domains of 8, ``dispatch_wait_recv_cost_stats`` /
``combine_wait_recv_cost_stats``, more scale columns than ``ceil(hidden / 128)``. :class:`Buffer` lists every
argument accepted with no effect; bench/README.md ("Drop-in interfaces: supported and refused") has the table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epkit.compat._details.deep_ep_config import HINT_TOPK, Config, EventHandle, EventOverlap, epbuffer_bytes
from epkit.compat._details.deep_ep_elastic import ElasticBuffer
from epkit.compat._details.deep_ep_handles import EPHandle
from epkit.compat._details.deep_ep_low_latency import LowLatencyCalls
from epkit.compat._details.deep_ep_normal import NormalCalls
from epkit.compat._details.deep_ep_session import Session, calls
from epkit.compat._details.deep_ep_shrink import RankMask

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventOverlap", "EventHandle", "topk_idx_t"]

#: DeepEP's dtype of expert ids (int32 ids are taken too).
topk_idx_t = torch.int64


class Buffer:
    """DeepEP's expert-parallel communication buffer (intranode, internode and low-latency modes) over EPBuffer.

    Parameters are DeepEP's (see the module docstring for how the calls map). What each DeepEP argument does
    here, where it is not DeepEP's own effect:

    - accepted with no effect (checked for type): ``num_nvl_bytes`` / ``num_rdma_bytes`` (recorded, not a
      cap), ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl`` (epkit's transport
      picks the path), ``config`` (no channels to tune; its SMs name the handle's channels), ``use_logfmt``
      (the rows go back as bf16, more precise than DeepEP's 10-bit LogFMT), ``allocate_on_comm_stream`` (no
      communication stream: tensors are made on the current one; DeepEP's condition, ``previous_event`` and
      ``async_finish``, is checked);
    - honoured in epkit's terms: ``previous_event`` is waited for on the current stream before the call;
      ``async_finish=True`` returns an event recorded on the current stream (on CPU ranks there is nothing
      to wait for: the work is done when the call returns); ``return_recv_hook=True`` defers the receive to
      the hook; ``num_worst_tokens`` gives outputs of that many rows (padding: zero rows, ids -1, weights 0,
      ``recv_src_idx`` -1) and, inside one domain, is EPBuffer's worst-case dispatch: the rows' exchange, its
      combine's and its cached dispatches' read no count back (on the device kernels a rank that receives more
      rows raises at its next call, on every rank), the handle is tensor ops, and the layout's values are not
      checked against ``topk_idx`` (its routing is ``topk_idx``'s). On an NCCL group, once an eager call made
      the buffer, such a call, its combine and its cached dispatches are stream-ordered as the low-latency
      calls are (no host agreement: a call one rank rejects is rejected by EPBuffer's own call, the same
      ValueError on every rank, on CUDA at their next call; the routing gather on the GPU), so
      a CUDA graph can capture them; elsewhere the call's agreement (host values) and routing gather meet on
      the host (on CPU ranks nothing is read back from a device; on CUDA over a gloo group they synchronize).
      A normal-mode call that meets on the host is refused under CUDA graph capture, naming what captures;
      ``num_worst_tokens`` pads internode dispatches too (on the host; DeepEP's Python refuses it there);
      ``round_scale`` quantizes the received bf16 rows at the receiver (epkit's per-128 cast with the scales
      rounded up to powers of two, as DeepEP's sender-side cast rounds them; twice the bytes on the wire);
    - ``enable_shrink=True`` masks ranks that stop taking part in the low-latency calls (module docstring; CPU
      ranks: a gloo group);
    - refused with a ``ValueError`` naming the parameter: ``comm``, ``enable_shrink=True`` on an NCCL group,
      ``num_tokens_per_rdma_rank`` on one domain (it must be None on 8 ranks or fewer, given on more),
      ``dispatch_wait_recv_cost_stats`` /
      ``combine_wait_recv_cost_stats``; and what DeepEP asserts against
      (``async_finish`` with ``return_recv_hook``, ``use_ue8m0`` without ``round_scale``, a low-latency call
      on a Buffer made without ``low_latency_mode``).
    """

    #: SMs of DeepEP's normal-mode kernels: what :meth:`get_dispatch_config` / :meth:`get_combine_config` put in
    #: their Configs (set with :meth:`set_num_sms`), and the channels of a handle made without ``config``.
    num_sms: int = 20

    def __init__(
        self,
        group: ProcessGroup,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: object = None,
    ) -> None:
        if comm is not None:
            raise ValueError("Buffer: comm (an mpi4py communicator) is not supported; pass a torch.distributed group")
        if group is None:
            raise ValueError("Buffer: group must be a torch.distributed process group (comm is not supported)")
        if not isinstance(enable_shrink, bool):
            raise ValueError(f"Buffer: enable_shrink must be a bool, got {enable_shrink!r}")
        if enable_shrink and "nccl" in str(torch.distributed.get_backend(group)):
            raise ValueError("Buffer: enable_shrink=True (masking failed ranks) needs CPU ranks (a gloo group) here")
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Buffer: {name} must be an int >= 0, got {v!r}")
        if low_latency_mode and (not isinstance(num_qps_per_rank, int) or num_qps_per_rank <= 0):
            raise ValueError(
                f"Buffer: num_qps_per_rank must be a positive int in low-latency mode, got {num_qps_per_rank!r}"
            )
        for name, v in (("low_latency_mode", low_latency_mode), ("explicitly_destroy", explicitly_destroy)):
            if not isinstance(v, bool):
                raise ValueError(f"Buffer: {name} must be a bool, got {v!r}")
        self.group, self.rank = group, torch.distributed.get_rank(group)
        self.group_size = torch.distributed.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        self.enable_shrink = enable_shrink
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode, self.allow_mnnvl = allow_nvlink_for_low_latency_mode, allow_mnnvl
        self._session = Session(group, 30.0)
        if enable_shrink:  # the low-latency calls meet among the unmasked ranks (deep_ep_shrink)
            agreement = self._session.agreement
            agreement.shrink = RankMask(group, self.rank, self.group_size, agreement.global_ranks)
        self._normal = NormalCalls(self._session, lambda: Buffer.num_sms)
        self._low_latency = LowLatencyCalls(self._session, low_latency_mode)

    @property
    def timeout(self) -> float:
        """Seconds any wait of a call may take: on the other ranks' agreement, and in the EPBuffers the Buffer makes
        (set it before the first call; 30 by default)."""
        return self._session.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._session.timeout = seconds

    def destroy(self) -> None:
        """Release every buffer (collective, as DeepEP's); needs ``explicitly_destroy=True``, as DeepEP's."""
        if not self.explicitly_destroy:
            raise RuntimeError("Buffer.destroy() needs Buffer(..., explicitly_destroy=True), as in DeepEP")
        self._session.destroy()

    # static settings

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: epkit's GPU kernels target SM90 (compiled for it on first use)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set :attr:`num_sms` (an even count, as DeepEP requires): the SMs the Configs of this class name."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"Buffer.set_num_sms: new_num_sms must be a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (for ``previous_event``)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes of the buffer a low-latency :class:`Buffer` makes on each rank for these sizes (top-k up to 8); on
        CUDA the device kernels' own area comes on top and is not counted."""
        n = num_max_dispatch_tokens_per_rank
        return epbuffer_bytes(hidden, num_experts, num_ranks, n, HINT_TOPK, n)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A Config for ``num_ranks`` ranks (``Config(Buffer.num_sms)``: epkit does not tune by rank count)."""
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks <= 0:
            raise ValueError(f"get_dispatch_config: num_ranks must be a positive int, got {num_ranks!r}")
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A Config for ``num_ranks`` ranks (as :meth:`get_dispatch_config`)."""
        return Buffer.get_dispatch_config(num_ranks)

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The stream the communication runs on: the current one (epkit has no stream of its own)."""
        if not torch.cuda.is_available():
            raise RuntimeError("Buffer.get_comm_stream: no CUDA device (CPU ranks have no stream)")
        return torch.cuda.current_stream()

    def get_local_buffer_tensor(
        self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0, use_rdma_buffer: bool = False
    ) -> torch.Tensor:
        """The raw bytes of this rank's (most recent) buffer as ``dtype`` from element ``offset`` (epkit has one buffer
        for both modes: ``use_rdma_buffer`` names the same memory); its layout is epkit's, not DeepEP's."""
        if not self._session.made:
            raise RuntimeError("Buffer.get_local_buffer_tensor: no buffer yet (epkit makes it at the first dispatch)")
        raw: torch.Tensor = self._session.made[-1].buffer.local.reshape(-1).view(torch.uint8)
        flat = raw[: raw.numel() // dtype.itemsize * dtype.itemsize].view(dtype)[offset:]
        if size is None:
            return flat
        if flat.numel() < torch.Size(size).numel():
            raise ValueError(f"get_local_buffer_tensor: size {tuple(size)} exceeds the buffer from offset {offset}")
        return flat[: torch.Size(size).numel()].view(size)

    # the calls (NormalCalls and LowLatencyCalls hold their signatures and docstrings)

    get_dispatch_layout = calls("_normal", NormalCalls.get_dispatch_layout)
    dispatch = calls("_normal", NormalCalls.dispatch)
    combine = calls("_normal", NormalCalls.combine)
    internode_dispatch = calls("_normal", NormalCalls.internode_dispatch)
    internode_combine = calls("_normal", NormalCalls.internode_combine)
    clean_low_latency_buffer = calls("_low_latency", LowLatencyCalls.clean_low_latency_buffer)
    low_latency_dispatch = calls("_low_latency", LowLatencyCalls.low_latency_dispatch)
    low_latency_combine = calls("_low_latency", LowLatencyCalls.low_latency_combine)
    get_next_low_latency_combine_buffer = calls("_low_latency", LowLatencyCalls.get_next_low_latency_combine_buffer)
    low_latency_update_mask_buffer = calls("_low_latency", LowLatencyCalls.low_latency_update_mask_buffer)
    low_latency_query_mask_buffer = calls("_low_latency", LowLatencyCalls.low_latency_query_mask_buffer)
    low_latency_clean_mask_buffer = calls("_low_latency", LowLatencyCalls.low_latency_clean_mask_buffer)
