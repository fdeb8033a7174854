"""DeepEP V2's ``ElasticBuffer`` and ``EPHandle`` (``deep_ep.ElasticBuffer``) over EPBuffer's normal mode (its device
kernels where the planner picks them, else a flat host-driven path), for ``epkit.compat.deep_ep``.

How V2's calls map:

- **Domains.** epkit's group is one domain: ``get_logical_domain_size()`` and ``get_physical_domain_size()`` are
  ``(1, num_ranks)``, so every rank is a scale-up peer and the combine's order is V2's non-hybrid one.
- **Dispatch** agrees with the other ranks first (the Buffer's agreement: one small all-gather; a bad call on one
  rank is the same ``ValueError`` on every rank), then gathers every rank's ``is_token_in_rank`` (for
  ``recv_src_metadata`` and ``dst_buffer_slot_idx``), then moves the rows through an EPBuffer made for
  ``(hidden, num_experts, num_topk)`` with ``num_max_tokens_per_rank`` slots. Rows come ordered by source rank,
  then token, i.e. by V2's source token global index ``src_rank * num_max_tokens_per_rank + token``: the
  ``deterministic`` order whatever the flag. ``do_expand`` gives one row per (token, local expert), each expert's
  block at an ``expert_alignment``-aligned offset, padding zero (``do_zero_padding`` always holds), and
  ``psum_num_recv_tokens_per_expert`` as DeepGEMM's psum ``grouped_layout``.
- **Combine** sums each token's rows at the source in V2's order, in float32: the biases (``bias0 + bias1``) first,
  then each rank's row, ranks ordered by the last top-k slot of the token that names one of their experts; in
  expand mode each rank first sums its expanded rows of the token (k ascending, rounded to bf16), or, without
  ``allow_multiple_reduction``, every (token, k) row comes back and the terms are added k ascending. On the device
  kernels the combine kernel sums in that order (``EPBuffer.combine(order=)``); on a host path the rows come back
  unsummed (``EPBuffer.combine_unsummed``) and are summed here; without ``allow_multiple_reduction`` on the
  kernels, one combine per top-k slot brings each (token, k) row back alone, added at the source by tensor ops.
  ``topk_weights`` are routed back, not applied (as V2's).
- ``do_cpu_sync=False`` gives the worst-case shapes V2 gives (``num_max_tokens_per_rank * num_ranks`` rows, the
  expanded worst case), the valid rows first. On the device kernels it is EPBuffer's worst-case dispatch (the
  kernels size and pad the outputs, the handle is tensor ops): the dispatch, its combine and its cached dispatches
  read nothing back to the host (the call's agreement is host values over the group); elsewhere a plain dispatch
  padded. The calls' ``num_sms`` is their launches' programs on the device kernels.
- Accepted with no effect: the constructor's ``num_bytes`` / ``num_cpu_bytes`` (recorded; epkit sizes its
  EPBuffers per call shape), ``use_fp8_dispatch``, ``allow_hybrid_mode``, ``prefer_overlap_with_compute``,
  ``sl_idx``, ``num_gpu_timeout_secs`` (checked for type); the calls' ``num_sms`` on a host path (recorded in the
  handle, as V2's) and ``num_qps`` (checked against ``num_allocated_qps``; no epkit path uses QPs),
  ``previous_event_before_epilogue``, ``allocate_on_comm_stream`` (no communication stream),
  ``async_with_compute_stream`` (an event is returned either way) and ``do_zero_padding`` (padding is always
  zero). ``use_tma_aligned_col_major_sf`` gives the scales V2's TMA strides. ``num_cpu_timeout_secs`` is every
  wait's timeout.
- **Engram** (``engram_write`` / ``engram_fetch``, ``deep_ep_elastic_engram``) over epkit's ENP-sharded Engram
  table; epkit's fetch is collective where V2's is one-sided: every rank calls ``engram_fetch`` in the same order.
- **Pipeline send/receive** (``pp_set_config`` / ``pp_send`` / ``pp_recv``, ``deep_ep_elastic_pp``) to the ring's
  previous and next rank, over the group's ``isend`` / ``irecv``.
- **The all-gather session** (``agrs_set_config``, ``create_agrs_session`` / ``destroy_agrs_session`` /
  ``agrs_new_session``, ``agrs_get_inplace_tensor``, ``all_gather``; ``deep_ep_elastic_agrs``) over the group's
  ``all_gather_into_tensor`` into a session area.
- Accepted with no effect there: ``engram_fetch``'s ``num_qps``, ``pp_send`` / ``pp_recv``'s ``num_sms``, and
  ``barrier``'s ``use_comm_stream``, ``with_cpu_sync``, ``sequential`` (a barrier is a host wait).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epkit.collectives.ep.rows import align_up
from epkit.compat._details.deep_ep_config import HINT_TOPK, SIZE_ALIGN, EventHandle, epbuffer_bytes
from epkit.compat._details.deep_ep_elastic_agrs import (
    ElasticAGRS,
    Shapes,
    agrs_buffer_size_hint,
    agrs_num_max_session_bytes,
)
from epkit.compat._details.deep_ep_elastic_combine import ElasticCombine
from epkit.compat._details.deep_ep_elastic_dispatch import ElasticDispatch
from epkit.compat._details.deep_ep_elastic_engram import ElasticEngram, engram_storage_size_hint
from epkit.compat._details.deep_ep_elastic_pp import ElasticPP, pp_buffer_size_hint
from epkit.compat._details.deep_ep_session import Session, calls

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ElasticBuffer"]


class ElasticBuffer:
    """DeepEP V2's elastic buffer (expert-parallel dispatch and combine) on CPU ranks; on CUDA the same host-driven
    flat path over NVSHMEM, not yet run on a GPU (module docstring).

    Attributes (V2's): ``group``, ``rank_idx``, ``num_ranks``, ``num_bytes``, ``num_max_tokens_per_rank``,
    ``num_allocated_qps``, ``num_scaleout_ranks`` (1), ``num_scaleup_ranks`` (``num_ranks``),
    ``scaleout_rank_idx``, ``scaleup_rank_idx``, ``num_rdma_ranks``, ``num_nvlink_ranks``, ``deterministic``,
    ``allow_hybrid_mode``, ``allow_multiple_reduction``, ``prefer_overlap_with_compute``, ``explicitly_destroy``.
    """

    def __init__(
        self,
        group: ProcessGroup,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
    ) -> None:
        if group is None:
            raise ValueError("ElasticBuffer: group must be a torch.distributed process group")
        ints = {
            "num_cpu_bytes": num_cpu_bytes, "num_max_tokens_per_rank": num_max_tokens_per_rank, "hidden": hidden,
            "num_topk": num_topk, "sl_idx": sl_idx, "num_allocated_qps": num_allocated_qps,
        }  # fmt: skip
        if num_bytes is not None:
            ints["num_bytes"] = num_bytes
        for name, v in ints.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"ElasticBuffer: {name} must be an int >= 0, got {v!r}")
        for name, t in (("num_cpu_timeout_secs", num_cpu_timeout_secs), ("num_gpu_timeout_secs", num_gpu_timeout_secs)):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
                raise ValueError(f"ElasticBuffer: {name} must be a positive number of seconds, got {t!r}")
        flags = {
            "use_fp8_dispatch": use_fp8_dispatch, "deterministic": deterministic,
            "allow_hybrid_mode": allow_hybrid_mode, "allow_multiple_reduction": allow_multiple_reduction,
            "prefer_overlap_with_compute": prefer_overlap_with_compute, "explicitly_destroy": explicitly_destroy,
        }  # fmt: skip
        for name, v in flags.items():  # DeepEP's own tests pass 0 / 1
            if not isinstance(v, (bool, int)) or v not in (0, 1):
                raise ValueError(f"ElasticBuffer: {name} must be a bool (or 0 / 1), got {v!r}")
        deterministic, allow_hybrid_mode = bool(deterministic), bool(allow_hybrid_mode)
        allow_multiple_reduction, prefer_overlap_with_compute = (
            bool(allow_multiple_reduction),
            bool(prefer_overlap_with_compute),
        )
        explicitly_destroy = bool(explicitly_destroy)
        self._session = Session(group, float(num_cpu_timeout_secs))
        self.group, self.rank_idx, self.num_ranks = group, self._session.rank, self._session.group_size
        self.deterministic, self.allow_hybrid_mode = deterministic, allow_hybrid_mode
        self.allow_multiple_reduction, self.prefer_overlap_with_compute = (
            allow_multiple_reduction,
            prefer_overlap_with_compute,
        )
        self.explicitly_destroy, self.num_max_tokens_per_rank = explicitly_destroy, num_max_tokens_per_rank
        if num_bytes is None:
            num_bytes = self._size_hint(self.num_ranks, max(num_max_tokens_per_rank, 1), max(hidden, 1), num_topk)
        self.num_bytes, self.num_cpu_bytes = num_bytes, num_cpu_bytes
        self.num_allocated_qps = num_allocated_qps or (65 if allow_hybrid_mode else 17)
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()
        self._dispatch = ElasticDispatch(self._session, num_max_tokens_per_rank, self.num_allocated_qps)
        self._combine = ElasticCombine(self._session, allow_multiple_reduction)
        self._engram = ElasticEngram(self._session, num_bytes, num_cpu_bytes)
        self._pp = ElasticPP(self._session, num_bytes)
        self._agrs = ElasticAGRS(self._session, num_bytes)

    # sizes and resources

    @staticmethod
    def _size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> int:
        topk = num_topk or HINT_TOPK
        return align_up(epbuffer_bytes(hidden, num_ranks, num_ranks, num_max_tokens_per_rank, topk, 0), SIZE_ALIGN)

    @staticmethod
    def get_buffer_size_hint(
        group: ProcessGroup,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """Bytes (2 MiB aligned) of the EPBuffer such a buffer makes on each rank for these sizes (top-k 8 when 0;
        the device kernels' own area, on CUDA, comes on top)."""
        w = torch.distributed.get_world_size(group)
        return ElasticBuffer._size_hint(w, num_max_tokens_per_rank, hidden, num_topk)

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: ``(1, num_ranks)`` (epkit's group is one domain)."""
        return 1, self._session.group_size

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: ``(1, num_ranks)``."""
        return 1, self._session.group_size

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 200,
        sm_write_gbs: float = 50,
    ) -> int:
        """SMs for a dispatch of this shape: the even count that lets ``num_topk`` copies of each token's row be read
        and written at the SM rates given within the NVLink rate (at least 4, at most the device's SMs; 20 on CPU
        ranks, where it is only recorded in the handle)."""
        for name, v in (("num_experts", num_experts), ("num_topk", num_topk)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"get_theoretical_num_sms: {name} must be a positive int, got {v!r}")
        if not torch.cuda.is_available():
            return 20
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        link = nvlink_gbs or 450.0
        need = link * min(num_topk, num_experts) / max(min(sm_read_gbs, sm_write_gbs * num_topk), 1e-9)
        return max(4, min(total - total % 2, align_up(int(need), 2)))

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """QPs for ``num_sms`` SMs: V2's rule for one scale-out domain (epkit's group is one), ``min(num_sms, 9)``,
        capped by :attr:`num_allocated_qps`."""
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms <= 0:
            raise ValueError(f"get_theoretical_num_qps: num_sms must be a positive int, got {num_sms!r}")
        return min(num_sms, 9, self.num_allocated_qps)

    # streams and lifetime

    @staticmethod
    def capture() -> EventHandle:
        """An event on the current stream (for ``previous_event``)."""
        return EventHandle()

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The stream the communication runs on: the current one (epkit has no stream of its own)."""
        if not torch.cuda.is_available():
            raise RuntimeError("ElasticBuffer.get_comm_stream: no CUDA device (CPU ranks have no stream)")
        return torch.cuda.current_stream()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Wait until every rank has come here (the buffer's timeout; a silent rank is named)."""
        self._session.agree("barrier", None, [])

    def destroy(self) -> None:
        """Release every buffer (collective); needs ``explicitly_destroy=True``, as V2's."""
        if not self.explicitly_destroy:
            raise RuntimeError(
                "ElasticBuffer.destroy() needs ElasticBuffer(..., explicitly_destroy=True), as in DeepEP"
            )
        self._engram.close()
        self._pp.close()
        self._agrs.close()
        self._session.destroy()

    @staticmethod
    def get_engram_storage_size_hint(
        num_entries: int, hidden: int, num_max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16
    ) -> tuple[int, int]:
        """``(num_gpu_bytes, num_cpu_bytes)`` for Engram, 2 MiB aligned (V2's: ``engram_storage_size_hint``)."""
        return engram_storage_size_hint(num_entries, hidden, num_max_tokens_per_rank, dtype)

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """Bytes for pipeline send/receive, 2 MiB aligned (V2's: ``pp_buffer_size_hint``)."""
        return pp_buffer_size_hint(num_max_tensor_bytes, num_max_inflight_tensors)

    @staticmethod
    def get_agrs_num_max_session_bytes(group: ProcessGroup, shapes: Shapes, dtype: torch.dtype) -> int:
        """Session bytes the all-gathers of ``shapes`` take on ``group`` (V2's: ``agrs_num_max_session_bytes``)."""
        return agrs_num_max_session_bytes(torch.distributed.get_world_size(group), shapes, dtype)

    @staticmethod
    def get_agrs_buffer_size_hint(group: ProcessGroup, num_max_session_bytes: int) -> int:
        """Buffer bytes for sessions of ``num_max_session_bytes``: aligned to 2 MiB (V2's)."""
        return agrs_buffer_size_hint(num_max_session_bytes)

    # the calls (each part holds its signatures and docstrings)

    dispatch = calls("_dispatch", ElasticDispatch.dispatch)
    combine = calls("_combine", ElasticCombine.combine)
    engram_write = calls("_engram", ElasticEngram.engram_write)
    engram_fetch = calls("_engram", ElasticEngram.engram_fetch)
    pp_set_config = calls("_pp", ElasticPP.pp_set_config)
    pp_send = calls("_pp", ElasticPP.pp_send)
    pp_recv = calls("_pp", ElasticPP.pp_recv)
    agrs_set_config = calls("_agrs", ElasticAGRS.agrs_set_config)
    create_agrs_session = calls("_agrs", ElasticAGRS.create_agrs_session)
    destroy_agrs_session = calls("_agrs", ElasticAGRS.destroy_agrs_session)
    agrs_new_session = calls("_agrs", ElasticAGRS.agrs_new_session)
    agrs_get_inplace_tensor = calls("_agrs", ElasticAGRS.agrs_get_inplace_tensor)
    all_gather = calls("_agrs", ElasticAGRS.all_gather)
