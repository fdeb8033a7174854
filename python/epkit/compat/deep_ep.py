"""DeepEP's legacy ``Buffer`` interface (deepseek-ai/DeepEP, ``deep_ep.Buffer``) on
:class:`~epkit.collectives.ep_buffer.EPBuffer`: ``import epkit.compat.deep_ep as deep_ep`` where an engine had
``import deep_ep``.

Every public method of DeepEP's legacy ``Buffer`` but the internode and rank-masking ones, with DeepEP's names,
parameter names and order, defaults, return arity and tensor layouts (the low-latency FP8 scales column-major,
packed UE8M0 with ``use_ue8m0``); ``Config``, ``EventOverlap``, ``EventHandle`` and ``topk_idx_t`` too. Handles are
DeepEP's tuples, each element with DeepEP's meaning on epkit's layout (``_details/deep_ep_handles.py`` defines the
channel split), and carry the EPBuffer state a later call checks.
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

Refused, with a ``ValueError`` naming DeepEP's parameter: ``comm`` (an mpi4py communicator), ``enable_shrink``,
``num_tokens_per_rdma_rank`` (internode), a dispatch with a layout that does not match ``topk_idx`` (without
top-k, rows go where ``is_token_in_rank`` says), ``use_logfmt``, ``dispatch_wait_recv_cost_stats`` /
``combine_wait_recv_cost_stats``, more scale columns than ``ceil(hidden / 128)``. :class:`Buffer` lists every
argument accepted with no effect; bench/README.md ("Drop-in interfaces: supported and refused") has the table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

import torch
import torch.distributed as dist

from epkit.collectives.ep_buffer import EPBuffer
from epkit.collectives.ep_reference import reference_layout
from epkit.compat._details.deep_ep_agreement import CallAgreement, FieldValue, size_of
from epkit.compat._details.deep_ep_config import HINT_TOPK, Config, EventHandle, EventOverlap, epbuffer_bytes
from epkit.compat._details.deep_ep_handles import NormalHandle, normal_handle
from epkit.compat._details.deep_ep_layouts import DeepEPRows, carry_scales, restore_scales
from epkit.compat._details.deep_ep_low_latency import LowLatencyMixin
from epkit.utils import check_topk_idx

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from epkit.collectives.ep.handles import DispatchResult

__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t"]

#: DeepEP's dtype of expert ids (int32 ids are taken too).
topk_idx_t = torch.int64

#: What :meth:`Buffer.dispatch` returns: ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
#: handle, event)``; a cached dispatch (with a handle) returns only ``recv_x`` and the event, the rest None.
DispatchOutput = tuple[
    DeepEPRows, torch.Tensor | None, torch.Tensor | None, list[int] | None, NormalHandle | None, EventOverlap
]


def _check_events(
    fn: str, previous_event: EventOverlap | None, async_finish: object, allocate_on_comm_stream: object
) -> None:
    """Check the stream arguments DeepEP's calls take (ValueError)."""
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise ValueError(f"{fn}: previous_event must be an EventOverlap (Buffer.capture()) or None")
    for name, v in (("async_finish", async_finish), ("allocate_on_comm_stream", allocate_on_comm_stream)):
        if not isinstance(v, bool):
            raise ValueError(f"{fn}: {name} must be a bool, got {v!r}")
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError(
            f"{fn}: allocate_on_comm_stream=True needs previous_event and async_finish=True (as in DeepEP)"
        )


def _wait_for(previous_event: EventOverlap | None) -> None:
    """Make the current stream wait for ``previous_event`` (checked by :func:`_check_events`)."""
    if previous_event is not None and previous_event.event is not None:
        previous_event.event.current_stream_wait()


def _events(
    fn: str, previous_event: EventOverlap | None, async_finish: object, allocate_on_comm_stream: object
) -> None:
    """Check the stream arguments and wait for ``previous_event`` (the local calls: no agreement)."""
    _check_events(fn, previous_event, async_finish, allocate_on_comm_stream)
    _wait_for(previous_event)


def _rows(x: DeepEPRows, num_worst_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, scales or None)`` of a dispatch's ``x`` once it and ``num_worst_tokens`` are DeepEP's kinds."""
    x0, scales = x if isinstance(x, tuple) else (x, None)
    if not isinstance(x0, torch.Tensor) or x0.dim() != 2:
        raise ValueError(f"dispatch: x must be a [num_tokens, hidden] tensor or an (x, scales) pair, got {x!r:.60}")
    if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
        raise ValueError(f"dispatch: num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}")
    return x0, scales


def _rows_of(x0: torch.Tensor | None) -> int:
    return x0.shape[0] if x0 is not None else 0


def _dispatch_fields(x: object, topk_idx: object, per_expert: object) -> list[tuple[str, FieldValue]]:
    """What every rank's normal dispatch must share (``CallAgreement``'s fields): read from the arguments as they
    are, None where a rejected call has no such value."""
    x0, scales = x if isinstance(x, tuple) and len(x) == 2 else (x, None)
    tensor = isinstance(x0, torch.Tensor)
    experts = per_expert.numel() if isinstance(per_expert, torch.Tensor) else None
    return [
        ("x hidden size", size_of(x0, 1)),
        ("x dtype", x0.dtype if isinstance(x0, torch.Tensor) else None),
        ("x scales dtype", scales.dtype if isinstance(scales, torch.Tensor) else None),
        ("x scale columns", (size_of(scales, 1) if scales is not None else 0) if tensor else None),
        ("num_experts (num_tokens_per_expert's size)", experts),
        ("topk_idx columns (num_topk)", size_of(topk_idx, 1)),
        ("topk_idx given", int(topk_idx is not None)),
    ]


def _event(async_finish: bool, extra: tuple[torch.Tensor, ...] | None = None) -> EventOverlap:
    return EventOverlap(EventHandle() if async_finish else None, extra if async_finish else None)


@overload
def _pad_rows(t: torch.Tensor, n: int, fill: int) -> torch.Tensor: ...
@overload
def _pad_rows(t: torch.Tensor | None, n: int, fill: int) -> torch.Tensor | None: ...
def _pad_rows(t: torch.Tensor | None, n: int, fill: int) -> torch.Tensor | None:
    """Received rows ``t`` padded to ``n`` rows of ``fill`` (DeepEP's num_worst_tokens: ids -1, weights and rows
    0); None stays None."""
    if t is None:
        return None
    have = t.shape[0]
    if have > n:
        raise ValueError(f"dispatch: {have} rows were received, more than num_worst_tokens = {n}")
    return torch.cat([t, t.new_full((n - have, *t.shape[1:]), fill)])


def _with_scales(recv_x: torch.Tensor, recv_s: torch.Tensor | None, s: int, sdtype: torch.dtype | None) -> DeepEPRows:
    """DeepEP's recv_x: ``recv_x``, or ``(recv_x, scales)`` with the scales in the columns and dtype x's came in."""
    if recv_s is None:
        return recv_x
    assert sdtype is not None  # rows come back with scales only where x carried them (carry_scales set sdtype)
    return recv_x, restore_scales(recv_s, s, sdtype)


def _channels(config: Config | None) -> int:
    """DeepEP's channels for a call's ``config`` (its SMs over two), which the handle's channel matrices describe."""
    return max((config.num_sms if config is not None else Buffer.num_sms) // 2, 1)


def _check_config(fn: str, config: object) -> None:
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"{fn}: config must be a deep_ep Config (epkit.compat.deep_ep.Config) or None, got {config!r}")


class Buffer(LowLatencyMixin):
    """DeepEP's expert-parallel communication buffer (intranode and low-latency modes) over EPBuffer.

    Parameters are DeepEP's (see the module docstring for how the calls map). What each DeepEP argument does
    here, where it is not DeepEP's own effect:

    - accepted with no effect (checked for type): ``num_nvl_bytes`` / ``num_rdma_bytes`` (recorded, not a
      cap), ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl`` (epkit's transport
      picks the path), ``config`` (no channels to tune), ``allocate_on_comm_stream`` (no communication stream:
      tensors are made on the current one; DeepEP's condition, ``previous_event`` and ``async_finish``, is
      checked);
    - honoured in epkit's terms: ``previous_event`` is waited for on the current stream before the call;
      ``async_finish=True`` returns an event recorded on the current stream (on CPU ranks there is nothing
      to wait for: the work is done when the call returns); ``return_recv_hook=True`` defers the receive to
      the hook; ``num_worst_tokens`` pads the outputs to that many rows, but a normal dispatch still
      synchronizes with the host (epkit's normal mode reads its counts), so it is not for CUDA graphs;
      ``round_scale`` quantizes the received bf16 rows at the receiver (epkit's per-128 cast with the scales
      rounded up to powers of two, as DeepEP's sender-side cast rounds them; twice the bytes on the wire);
    - refused with a ``ValueError`` naming the parameter: ``comm``, ``enable_shrink=True``,
      ``num_tokens_per_rdma_rank`` (not None), ``dispatch_wait_recv_cost_stats`` /
      ``combine_wait_recv_cost_stats``, ``use_logfmt=True``; and what DeepEP asserts against
      (``async_finish`` with ``return_recv_hook``, ``use_ue8m0`` without ``round_scale``, a low-latency call
      on a Buffer made without ``low_latency_mode``).
    """

    #: SMs of DeepEP's normal-mode kernels: what :meth:`get_dispatch_config` / :meth:`get_combine_config` put in
    #: their Configs (set with :meth:`set_num_sms`).
    num_sms: int = 20
    #: Seconds any wait of a call may take: on the other ranks' agreement, and in the EPBuffers the Buffer makes
    #: (set it before the first call).
    timeout: float = 30.0

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
        if enable_shrink:
            raise ValueError("Buffer: enable_shrink=True (masking failed ranks) is not supported; pass False")
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
        self.group, self.rank, self.group_size = group, dist.get_rank(group), dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy, self.enable_shrink = low_latency_mode, explicitly_destroy, False
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode, self.allow_mnnvl = allow_nvlink_for_low_latency_mode, allow_mnnvl
        self._current: dict[
            tuple[int, int, int], EPBuffer
        ] = {}  # (hidden, num_experts, num_topk) -> the buffer calls use
        self._made: list[EPBuffer] = []  # every buffer made, in order (outstanding handles keep using theirs)
        self._destroyed = False
        self._broken: str | None = None  # why an agreement failed: the Buffer is then unusable
        self._agreement = CallAgreement(group)  # what every rank's dispatch agrees on before it picks a buffer

    # buffers

    def _epbuffer(
        self, hidden: int, num_experts: int, num_topk: int, device: torch.device, tokens: int, ll_tokens: int = 0
    ) -> EPBuffer:
        """The EPBuffer for these shapes, made (collectively: every rank gets here with the same arguments) when
        there is none yet or the current one is too small."""
        if self._destroyed:
            raise RuntimeError("Buffer: destroy() was called; make a new Buffer")
        key = (hidden, num_experts, num_topk)
        buf = self._current.get(key)
        if (
            buf is not None
            and buf.num_max_tokens_per_rank >= tokens
            and buf.num_max_dispatch_tokens_per_rank >= ll_tokens
        ):
            return buf
        if num_experts % self.group_size:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group size ({self.group_size})")
        cap = max(tokens, ll_tokens, 1)
        cap = 1 << (cap - 1).bit_length()  # grow by powers of two: few buffers however the batches vary
        if buf is not None:
            cap = max(cap, buf.num_max_tokens_per_rank)
            ll_tokens = max(ll_tokens, buf.num_max_dispatch_tokens_per_rank)
        transport = "nvshmem" if torch.device(device).type == "cuda" else "auto"
        ll = ll_tokens or None
        buf = EPBuffer(
            self.group, hidden, num_experts, cap, num_topk, transport, num_max_dispatch_tokens_per_rank=ll,
            timeout=self.timeout,
        )  # fmt: skip
        self._current[key] = buf
        self._made.append(buf)
        return buf

    def destroy(self) -> None:
        """Release every buffer (collective, as DeepEP's); needs ``explicitly_destroy=True``, as DeepEP's."""
        if not self.explicitly_destroy:
            raise RuntimeError("Buffer.destroy() needs Buffer(..., explicitly_destroy=True), as in DeepEP")
        self._settle()
        for buf in self._made:
            buf.close()
        self._made, self._current, self._destroyed = [], {}, True

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
        if not self._made:
            raise RuntimeError("Buffer.get_local_buffer_tensor: no buffer yet (epkit makes it at the first dispatch)")
        raw: torch.Tensor = self._made[-1].buffer.local.reshape(-1).view(torch.uint8)
        flat = raw[: raw.numel() // dtype.itemsize * dtype.itemsize].view(dtype)[offset:]
        if size is None:
            return flat
        if flat.numel() < torch.Size(size).numel():
            raise ValueError(f"get_local_buffer_tensor: size {tuple(size)} exceeds the buffer from offset {offset}")
        return flat[: torch.Size(size).numel()].view(size)

    # normal mode

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, EventOverlap]:
        """``(num_tokens_per_rank [W] int32, None, num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool,
        event)``, on ``topk_idx``'s device; ``-1`` ids are skipped. The second value, DeepEP's per-RDMA-rank
        counts, is None: epkit's group is one domain (DeepEP's intranode answer)."""
        _events("get_dispatch_layout", previous_event, async_finish, allocate_on_comm_stream)
        try:  # the shape and dtype (the values are counted below, -1 skipped)
            check_topk_idx(topk_idx, 0, check_values=False)  # num_experts is read by the value scan only
        except ValueError as exc:
            raise ValueError(f"get_dispatch_layout: {exc}") from None
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts % self.group_size:
            raise ValueError(
                f"get_dispatch_layout: num_experts must be a multiple of {self.group_size}, got {num_experts!r}"
            )
        per_rank, per_expert, in_rank = reference_layout(topk_idx.cpu(), num_experts, self.group_size)
        dev = topk_idx.device
        return per_rank.to(dev), None, per_expert.to(dev), in_rank.to(dev), _event(async_finish)

    def _agree(self, fn: str, error: str | None, fields: list[tuple[str, FieldValue]], tokens: int = 0) -> int:
        """The call's agreement (``CallAgreement``): the largest token count of any rank, or the same ValueError on
        every rank (a rank's rejection, or ``fields`` that differ across ranks)."""
        if self._destroyed:
            raise RuntimeError("Buffer: destroy() was called; make a new Buffer")
        if self._broken is not None:
            raise RuntimeError(f"Buffer: an earlier call's agreement failed ({self._broken}); make a new Buffer")
        try:
            return self._agreement(fn, error, fields, self.timeout, tokens)
        except (TimeoutError, RuntimeError) as exc:
            # the group's all-gather may still be pending: a later call would pair with it, out of step
            self._broken = f"{type(exc).__name__}: {exc}"
            raise

    def dispatch(
        self,
        x: DeepEPRows,
        handle: NormalHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> DispatchOutput:
        """``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``.

        ``x``: bf16 ``[T, hidden]``, or ``(e4m3 [T, hidden], scales [T, S])`` (float32 or int32, ``S <=
        ceil(hidden/128)``, any strides; returned ``[R, S]`` row-major). Rows come ordered by source rank, then
        token; ``recv_topk_idx`` holds local expert ids (-1 elsewhere) and ``recv_topk_weights`` 0 there. The
        per-expert counts are aligned to ``expert_alignment``; with ``num_worst_tokens > 0`` the outputs have that
        many rows (the rest padding: ids -1, weights 0) and the list is empty. With ``handle`` (cached dispatch)
        only ``recv_x`` is returned, the other four values None.
        """
        fn = "dispatch"
        self._settle()
        if handle is not None:
            return self._dispatch_cached(
                x, handle, topk_idx, topk_weights, num_worst_tokens, config, previous_event, async_finish,
                allocate_on_comm_stream,
            )  # fmt: skip
        error: str | None = None
        words: torch.Tensor | None = None
        s, sdtype = 0, None
        x0: torch.Tensor | None = None
        try:  # a call rejected on one rank is rejected on every rank (one agreement below)
            _check_events(fn, previous_event, async_finish, allocate_on_comm_stream)
            _check_config(fn, config)
            x0, scales = _rows(x, num_worst_tokens)
            self._check_layout(topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                               num_tokens_per_expert, x0.shape[0])  # fmt: skip
            if scales is not None:
                words, s, sdtype = carry_scales(scales, x0.shape[0], x0.shape[1])
        except ValueError as exc:
            error = str(exc)
        tokens = self._agree(fn, error, _dispatch_fields(x, topk_idx, num_tokens_per_expert), _rows_of(x0))
        _wait_for(previous_event)
        # the agreement raised unless every check passed on every rank: x and the routing arguments are all given
        assert x0 is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        num_experts = num_tokens_per_expert.numel()
        routes = self._routes(fn, is_token_in_rank, num_tokens_per_expert, tokens)
        with_topk = topk_idx is not None
        if topk_idx is None:  # route by is_token_in_rank: each token once to each of its ranks (their expert 0)
            first = torch.arange(self.group_size, device=x0.device) * (num_experts // self.group_size)
            topk_idx = torch.where(is_token_in_rank, first, -1)
        buf = self._epbuffer(x0.shape[1], num_experts, topk_idx.shape[1], x0.device, tokens)
        dispatched: DispatchResult = buf.dispatch(
            (x0, words) if words is not None else x0, topk_idx, topk_weights, expert_alignment=expert_alignment
        )
        recv_rows, recv_idx, recv_w, counts, h = dispatched
        recv_x, recv_s = recv_rows if isinstance(recv_rows, tuple) else (recv_rows, None)
        tensors = normal_handle(routes[0], routes[1], self.rank, _channels(config), is_token_in_rank)
        out = NormalHandle(tensors, buf, h, topk_idx.shape[1] if with_topk else None)
        if not with_topk:  # DeepEP: no top-k out; the counts are the sources' num_tokens_per_expert, summed
            local = num_experts // self.group_size
            summed = routes[2][:, self.rank * local : (self.rank + 1) * local].sum(0)
            counts = [-(-int(c) // expert_alignment) * expert_alignment for c in summed.tolist()]
            recv_idx_out: torch.Tensor | None = None
            recv_w_out: torch.Tensor | None = None
        else:
            recv_w = torch.where(recv_idx >= 0, recv_w, torch.zeros_like(recv_w))  # DeepEP: 0 for another rank's
            recv_idx_out, recv_w_out = recv_idx, recv_w
        if num_worst_tokens:
            n = num_worst_tokens
            recv_x, recv_s = _pad_rows(recv_x, n, 0), _pad_rows(recv_s, n, 0)
            recv_idx_out, recv_w_out, counts = _pad_rows(recv_idx_out, n, -1), _pad_rows(recv_w_out, n, 0), []
        return _with_scales(recv_x, recv_s, s, sdtype), recv_idx_out, recv_w_out, counts, out, _event(async_finish)

    def _routes(
        self, fn: str, in_rank: torch.Tensor, per_expert: torch.Tensor, tokens_max: int
    ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """Every rank's routing, for DeepEP's handle and a dispatch without top-k (one small all-gather after the
        agreement, which made its size the same on every rank): ``(is_token_in_rank [W, tokens_max, W] bool,
        tokens per rank, num_tokens_per_expert [W, E] int64)``, on the CPU."""
        w, t = self.group_size, in_rank.shape[0]
        dev = "cuda" if self._agreement.nccl else "cpu"
        mine = torch.zeros(1 + tokens_max * w + per_expert.numel(), dtype=torch.int32, device=dev)
        mine[0] = t
        mine[1 : 1 + t * w] = in_rank.reshape(-1).to(dev, torch.int32)
        mine[1 + tokens_max * w :] = per_expert.reshape(-1).to(dev, torch.int32)
        got = self._agreement.gather(mine, fn, self.timeout).cpu()
        in_rank_all = got[:, 1 : 1 + tokens_max * w].reshape(w, tokens_max, w).bool()
        return in_rank_all, got[:, 0].tolist(), got[:, 1 + tokens_max * w :].long()

    def _check_layout(
        self,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        per_rank: torch.Tensor | None,
        per_rdma_rank: torch.Tensor | None,
        in_rank: torch.Tensor | None,
        per_expert: torch.Tensor | None,
        num_tokens: int,
    ) -> None:
        """A non-cached dispatch's routing arguments: the layout given, and ``topk_idx``'s when top-k is given (a
        dispatch without top-k routes each token to the ranks ``is_token_in_rank`` names)."""
        if per_rdma_rank is not None:
            raise ValueError(
                "dispatch: num_tokens_per_rdma_rank must be None (internode RDMA layouts are not supported; pass "
                "what get_dispatch_layout returned)"
            )
        missing = [n for n, v in (("num_tokens_per_rank", per_rank), ("is_token_in_rank", in_rank),
                                  ("num_tokens_per_expert", per_expert)) if v is None]  # fmt: skip
        if missing:
            raise ValueError(
                f"dispatch: {', '.join(missing)} must be given (from get_dispatch_layout) without a handle"
            )
        assert per_rank is not None and in_rank is not None and per_expert is not None  # none is missing
        w = self.group_size
        for name, t, shape, dtypes in (
            ("num_tokens_per_rank", per_rank, (w,), (torch.int32, torch.int64)),
            ("is_token_in_rank", in_rank, (num_tokens, w), (torch.bool,)),
            ("num_tokens_per_expert", per_expert, None, (torch.int32, torch.int64)),
        ):
            if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or (shape is not None and t.shape != shape):
                want = f"{list(shape) if shape is not None else '[num_experts]'} {' or '.join(map(str, dtypes))}"
                raise ValueError(f"dispatch: {name} must be {want}, got {t!r:.60}")
        if per_expert.dim() != 1 or per_expert.numel() % w or per_expert.numel() == 0:
            raise ValueError(
                f"dispatch: num_tokens_per_expert has {per_expert.numel()} experts, not a positive multiple of the "
                f"{w} ranks"
            )
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("dispatch: topk_idx and topk_weights must both be given, or both None (no top-k)")
        if topk_idx is None:
            if not torch.equal(in_rank.sum(0).cpu(), per_rank.cpu().to(torch.int64)):
                raise ValueError("dispatch: num_tokens_per_rank is not is_token_in_rank's count of tokens per rank")
            return
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
            raise ValueError(f"dispatch: topk_idx must be [num_tokens = {num_tokens}, num_topk], got {topk_idx!r:.60}")
        check_topk_idx(topk_idx, per_expert.numel())
        want = reference_layout(topk_idx.cpu(), per_expert.numel(), w)  # get_dispatch_layout's answer
        for name, got, ref in zip(("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"),
                                  (per_rank, per_expert, in_rank), want):  # fmt: skip
            if got.shape != ref.shape or not torch.equal(got.cpu().to(ref.dtype), ref):
                raise ValueError(
                    f"dispatch: {name} does not match topk_idx's layout (pass what get_dispatch_layout returned for it)"
                )

    def _dispatch_cached(
        self,
        x: DeepEPRows,
        handle: NormalHandle,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        num_worst_tokens: int,
        config: Config | None,
        previous_event: EventOverlap | None,
        async_finish: bool,
        allocate_on_comm_stream: bool,
    ) -> DispatchOutput:
        """A dispatch along ``handle``'s routing: every check in the call's agreement, which also holds every rank
        to the same handle (the same buffer's same dispatch), so no rank enters another exchange."""
        fn = "cached dispatch"
        error: str | None = None
        words: torch.Tensor | None = None
        s, sdtype = 0, None
        x0: torch.Tensor | None = None
        try:
            _check_events("dispatch", previous_event, async_finish, allocate_on_comm_stream)
            _check_config("dispatch", config)
            x0, scales = _rows(x, num_worst_tokens)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("dispatch: with a handle (cached dispatch), topk_idx and topk_weights must be None")
            self._check_handle("dispatch", handle)
            if scales is not None:
                words, s, sdtype = carry_scales(scales, x0.shape[0], x0.shape[1])
        except ValueError as exc:
            error = str(exc)
        self._agree(fn, error, self._handle_fields(handle) + _dispatch_fields(x, None, None)[:4])
        _wait_for(previous_event)
        assert x0 is not None  # the agreement raised unless every rank's checks passed
        dispatched: DispatchResult = handle.buffer.dispatch(
            (x0, words) if words is not None else x0, handle=handle.handle
        )
        recv_rows = dispatched[0]
        recv_x, recv_s = recv_rows if isinstance(recv_rows, tuple) else (recv_rows, None)
        if num_worst_tokens:
            recv_x, recv_s = _pad_rows(recv_x, num_worst_tokens, 0), _pad_rows(recv_s, num_worst_tokens, 0)
        return _with_scales(recv_x, recv_s, s, sdtype), None, None, None, None, _event(async_finish)

    def _check_handle(self, fn: str, handle: object) -> None:
        """``handle`` is a normal-mode handle of this Buffer's (ValueError)."""
        if not isinstance(handle, NormalHandle) or not any(handle.buffer is b for b in self._made):
            raise ValueError(f"{fn}: handle must be the handle a dispatch of this Buffer returned, got {handle!r:.60}")

    def _handle_fields(self, handle: object) -> list[tuple[str, FieldValue]]:
        """What every rank's handle must share: which of this Buffer's EPBuffers, which dispatch of it (None where
        the handle is not this Buffer's: that rank's check rejects the call)."""
        index = next((i for i, b in enumerate(self._made) if getattr(handle, "buffer", None) is b), None)
        inner = getattr(handle, "handle", None)
        return [
            ("handle's buffer", index),
            ("handle's dispatch", getattr(inner, "epoch", None) if index is not None else None),
        ]

    def combine(
        self,
        x: torch.Tensor,
        handle: NormalHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """``(combined_x [T, hidden], combined_topk_weights [T, num_topk] or None, event)``: each token's rows summed
        over the ranks it went to (no weights applied: the rows are the expert outputs already weighted), plus
        ``bias`` (a tensor or two); ``topk_weights`` ``[R, num_topk]`` are summed the same way (in float32)."""
        fn = "combine"
        self._settle()
        error: str | None = None
        try:  # every check in the call's agreement: a rank never raises alone
            _check_events(fn, previous_event, async_finish, allocate_on_comm_stream)
            _check_config(fn, config)
            self._check_handle(fn, handle)
            n, k = handle.num_recv, handle.num_topk
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] < n:
                raise ValueError(f"combine: x must be [{n} (or num_worst_tokens), hidden], got {x!r:.60}")
            if isinstance(bias, tuple) and len(bias) != 2:
                raise ValueError(f"combine: bias must be a tensor or a tuple of two, got a tuple of {len(bias)}")
            if topk_weights is not None:
                if k is None:
                    raise ValueError("combine: topk_weights given, but the handle's dispatch had no top-k")
                if (
                    not isinstance(topk_weights, torch.Tensor)
                    or topk_weights.shape[0] < n
                    or topk_weights.shape[1:] != (k,)
                ):
                    raise ValueError(f"combine: topk_weights must be [{n}, {k}], got {topk_weights!r:.60}")
                if k > handle.buffer.hidden:
                    raise ValueError(
                        f"combine: topk_weights has more columns ({k}) than hidden ({handle.buffer.hidden})"
                    )
        except ValueError as exc:
            error = str(exc)
        fields: list[tuple[str, FieldValue]] = [
            *self._handle_fields(handle),
            ("x hidden size", size_of(x, 1)),
            ("x dtype", x.dtype if isinstance(x, torch.Tensor) else None),
            ("topk_weights given", int(topk_weights is not None)),
        ]
        self._agree(fn, error, fields)
        _wait_for(previous_event)
        buf, n = handle.buffer, handle.num_recv
        combined = buf.combine(x[:n], handle.handle, bias=bias)
        weights = None
        if topk_weights is not None:
            k = handle.num_topk
            assert k is not None  # checked above, on every rank
            rows = torch.zeros((n, buf.hidden), dtype=torch.float32, device=x.device)
            rows[:, :k] = topk_weights[:n].float()
            weights = buf.combine(rows, handle.handle)[:, :k].contiguous()
        return combined, weights, _event(async_finish)
