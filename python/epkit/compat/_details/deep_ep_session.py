"""What every call of one ``epkit.compat.deep_ep`` buffer shares: its group, its agreement, the EPBuffers it made
and the receive hooks still pending. The parts of a Buffer (``deep_ep_normal``, ``deep_ep_low_latency``) and of an
ElasticBuffer (``deep_ep_elastic_dispatch``, ``deep_ep_elastic_combine``) each hold their buffer's one session;
nothing else of theirs is shared.

DeepEP sizes a buffer in bytes and takes any shape; an EPBuffer has a hidden size, top-k and token capacities. So
the session makes one EPBuffer per ``(hidden, num_experts, num_topk)`` at the first call that needs it (after that
call's agreement: every rank makes the same one) and a larger one when a call needs more room, growing by powers
of two. DeepEP lets two low-latency results wait for their receive hooks at once (two-batch overlap); an EPBuffer
takes one exchange at a time, so every call first runs the hooks still pending (:meth:`Session.settle`, the same
calls in the same order on every rank); a hook called later finds its data there.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from epkit.collectives.bootstrap import SubGroup
from epkit.collectives.deadline import within
from epkit.collectives.ep_buffer import EPBuffer
from epkit.compat._details.deep_ep_agreement import SHRINK_KINDS, CallAgreement, FieldValue
from epkit.compat._details.deep_ep_config import EventHandle, EventOverlap
from epkit.ops import capturing

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["UNCAPTURABLE", "Hook", "Session", "calls", "new_v2_event", "refuse_capture_here"]

#: What a receive hook is: called once (again: nothing), it fills its call's tensors.
Hook = Callable[[], None]

_F = TypeVar("_F", bound=Callable[..., Any])

#: ``(part, call)``: the calls that always meet on the host through this interface (an agreement of host values, a
#: routing gather and sizes read back), so that a CUDA graph cannot capture them. The legacy Buffer's and V2's
#: ``dispatch`` / ``combine`` decide per call (a worst-case one on an NCCL group is stream-ordered:
#: ``deep_ep_normal``, ``deep_ep_elastic_dispatch``).
UNCAPTURABLE = frozenset({("_normal", "internode_dispatch"), ("_normal", "internode_combine")})


def refuse_capture_here(fn: str) -> None:
    """A RuntimeError, before anything runs, when call ``fn`` that meets on the host is made while the current CUDA
    stream captures a graph (every capturing rank raises it), instead of a CUDA error from inside the call."""
    if capturing():
        raise RuntimeError(
            f"{fn} of epkit.compat.deep_ep cannot run under CUDA graph capture here: it meets the other ranks on the "
            "host (its agreement, the routing gather for the handle). Capture low_latency_dispatch / "
            "low_latency_combine, on an NCCL group (after an eager call) a legacy dispatch with num_worst_tokens "
            "or an ElasticBuffer dispatch with do_cpu_sync=False on the device kernels and their combines, or "
            f"epkit's EPBuffer.dispatch(num_worst_tokens=...) and its combine on the device kernels; or run {fn} "
            "outside the graph"
        )


def calls(part: str, method: _F) -> _F:
    """A buffer method that hands the call to its ``part`` (its normal-mode, low-latency, dispatch or combine
    calls): ``method``'s signature and docstring, one definition. The whole call (its agreement, a first EPBuffer's
    construction, the routing gather, the rows' exchange) waits at most the session's timeout, end to end
    (:func:`~epkit.collectives.deadline.within`; not shrink mode's low-latency calls, see below); a receive hook
    called later has the timeout again. A call of :data:`UNCAPTURABLE` is refused under CUDA graph capture
    (:func:`refuse_capture_here`)."""

    @functools.wraps(method)
    def call(self: object, *args: Any, **kwargs: Any) -> Any:
        if (part, method.__name__) in UNCAPTURABLE:
            refuse_capture_here(method.__name__)
        calls_of = getattr(self, part)
        session: Session = calls_of.s
        # shrink mode's low-latency calls wait a silent rank out to mask it (their meetings' outcome, not a failure):
        # the survivors' waits after that keep their own timeouts; every other call has one deadline
        masking = session.agreement.shrink is not None and method.__name__ in SHRINK_KINDS
        with contextlib.nullcontext() if masking else within(session.timeout):
            return getattr(calls_of, method.__name__)(*args, **kwargs)

    return call  # type: ignore[return-value]  # the same signature, by functools.wraps


def new_v2_event() -> EventOverlap:
    """V2's returned event: recorded on the current stream, always (with ``async_with_compute_stream`` the caller
    waits on it; without, the work is already ordered before the caller's next one)."""
    return EventOverlap(EventHandle())


class Session:
    """The shared state of one deep_ep buffer (module docstring). ``timeout``: seconds any wait of a call may take,
    in the agreement and in the EPBuffers made after it is set."""

    def __init__(self, group: ProcessGroup, timeout: float) -> None:
        self.group, self.rank, self.group_size = group, dist.get_rank(group), dist.get_world_size(group)
        self.timeout = timeout
        self.agreement = CallAgreement(group)
        self.current: dict[tuple[int, ...], EPBuffer] = {}  # (hidden, num_experts, num_topk[, -1: shrink's]) -> buffer
        self.made: list[EPBuffer] = []  # every buffer made, in order (outstanding handles keep using theirs)
        self.destroyed = False
        self.broken: str | None = None  # why an agreement failed: the buffer is then unusable
        self.pending: list[Hook] = []  # receive hooks not yet called
        self.members: dict[int, tuple[int, ...]] = {}  # shrink mode: each low-latency buffer's ranks (positions)

    @property
    def nccl(self) -> bool:
        """Whether the group is an NCCL group (its low-latency calls then make no host agreement)."""
        return self.agreement.nccl

    def agree(self, fn: str, error: str | None, fields: list[tuple[str, FieldValue]], tokens: int = 0) -> int:
        """The call's agreement (``CallAgreement``): the largest token count of any rank, or the same ValueError on
        every rank (a rank's rejection, or ``fields`` that differ across ranks)."""
        if self.destroyed:
            raise RuntimeError("destroy() was called on this buffer; make a new one")
        if self.broken is not None:
            raise RuntimeError(f"an earlier call's agreement on this buffer failed ({self.broken}); make a new one")
        try:
            return self.agreement(fn, error, fields, self.timeout, tokens)
        except (TimeoutError, RuntimeError) as exc:
            # the group's all-gather may still be pending: a later call would pair with it, out of step
            self.broken = f"{type(exc).__name__}: {exc}"
            raise

    def gather(self, mine: torch.Tensor, fn: str, fill: int = 0) -> torch.Tensor:
        """Every rank's ``mine`` after an agreement made its shape the same everywhere (``CallAgreement.gather``;
        in shrink mode the masked ranks' rows are ``fill``)."""
        return self.agreement.gather(mine, fn, self.timeout, fill)

    def routes(
        self, fn: str, in_rank: torch.Tensor, per_expert: torch.Tensor, tokens_max: int
    ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """Every rank's routing, for DeepEP's handles and a dispatch without top-k (one small all-gather after the
        call's agreement, which made ``tokens_max`` and the experts the same on every rank): ``(is_token_in_rank
        [W, tokens_max, W] bool, tokens per rank, num_tokens_per_expert [W, E] int64)``, on the CPU."""
        got = self._gather_routes(fn, in_rank, per_expert, tokens_max).cpu()
        in_rank_all = got[:, 1 : 1 + tokens_max * self.group_size].reshape(-1, tokens_max, self.group_size).bool()
        return in_rank_all, got[:, 0].tolist(), got[:, 1 + tokens_max * self.group_size :].long()

    def device_routes(self, fn: str, in_rank: torch.Tensor, tokens_max: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`routes` without the counts and without a host read (a worst-case dispatch's): ``(is_token_in_rank
        [W, tokens_max, W] bool, tokens per rank [W] int64)`` where the gather left them (the GPU on an NCCL group;
        there stream-ordered)."""
        none = torch.zeros(0, dtype=torch.int32, device=in_rank.device)
        got = self._gather_routes(fn, in_rank, none, tokens_max, in_rank.device)
        in_rank_all = got[:, 1:].reshape(-1, tokens_max, self.group_size).bool()
        return in_rank_all, got[:, 0].long()

    def _gather_routes(
        self, fn: str, in_rank: torch.Tensor, per_expert: torch.Tensor, tokens_max: int,
        nccl_device: torch.device | str = "cuda",
    ) -> torch.Tensor:  # fmt: skip
        """``[W, 1 + tokens_max * W + E]`` int32: each rank's token count, ``is_token_in_rank`` (zero past its
        tokens) and ``num_tokens_per_expert``; gathered on ``nccl_device`` on an NCCL group, else on the CPU."""
        w, t = self.group_size, in_rank.shape[0]
        dev = nccl_device if self.nccl else "cpu"
        mine = torch.zeros(1 + tokens_max * w + per_expert.numel(), dtype=torch.int32, device=dev)
        mine[0] = t
        mine[1 : 1 + t * w] = in_rank.reshape(-1).to(dev, torch.int32)
        mine[1 + tokens_max * w :] = per_expert.reshape(-1).to(dev, torch.int32)
        return self.gather(mine, fn)

    def epbuffer(
        self, hidden: int, num_experts: int, num_topk: int, device: torch.device, tokens: int, ll_tokens: int = 0,
        summable: bool = False,
    ) -> EPBuffer:  # fmt: skip
        """The EPBuffer for these shapes, made (collectively: every rank gets here with the same arguments, after
        the call's agreement) when there is none yet or the current one is too small. ``summable``: one whose combine
        can sum in a caller's order: the device kernels where the planner picks them (``EPBuffer.combine(order=)``),
        else a flat host-driven path (``EPBuffer.combine_unsummed``), the ``torch`` transport where the planner would
        build a hierarchy (several hosts)."""
        if self.destroyed:
            raise RuntimeError("destroy() was called on this buffer; make a new one")
        key = (hidden, num_experts, num_topk)
        buf = self.current.get(key)
        roomy = buf is not None and buf.num_max_tokens_per_rank >= tokens
        if buf is not None and roomy and buf.num_max_dispatch_tokens_per_rank >= ll_tokens:
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
        # the same plan on every rank: all of them make this one
        if summable and buf.paths[0] != "FlatNormalPath" and not buf.uses_device_kernels:
            buf.close()
            buf = EPBuffer(
                self.group, hidden, num_experts, cap, num_topk, "torch", num_max_dispatch_tokens_per_rank=ll,
                timeout=self.timeout, kernels="host",
            )  # fmt: skip
        self.current[key] = buf
        self.made.append(buf)
        return buf

    def reject_worst_dispatch(self, buf: EPBuffer, error: str, tokens: int, num_worst_tokens: int) -> NoReturn:
        """A stream-ordered worst-case dispatch this rank rejects (no host agreement): its part of the routing gather
        (``tokens`` rows, the others' size) with no tokens, then ``buf``'s worst-case call with none, which carries
        ``error`` to every rank as its own rejection (there the same ValueError; on CUDA at the rank's next call),
        then the ValueError here."""
        no_route = torch.zeros((0, self.group_size), dtype=torch.bool, device=buf.device)
        self.device_routes("dispatch", no_route, tokens)
        none = torch.zeros((0, buf.hidden), dtype=torch.bfloat16, device=buf.device)
        idx = torch.full((0, buf.num_topk), -1, dtype=torch.int64, device=buf.device)
        buf.dispatch(none, idx, num_worst_tokens=num_worst_tokens, reject=error)
        raise ValueError(error)  # (the EPBuffer raised every rank's verdict first)

    def shrink_buffer(self, hidden: int, num_experts: int, num_topk: int, n_max: int) -> EPBuffer:
        """Shrink mode (``deep_ep_shrink``): the low-latency EPBuffer for these shapes over the ranks not masked now,
        masked as the ranks are (:meth:`apply_mask`). The current one while it holds every unmasked rank and none it
        left out has come back, else one made (after the call's agreement: by every unmasked rank) over the
        unmasked ranks alone, a SubGroup where some are masked, its experts those ranks' (``sub_experts``)."""
        shrink = self.agreement.shrink
        assert shrink is not None  # shrink mode
        live, key = shrink.unmasked(), (hidden, num_experts, num_topk, -1)  # apart from the normal mode's
        buf = self.current.get(key)
        if buf is not None:
            members = self.members[id(buf)]
            fits = all(r in members and members.index(r) not in buf.masked_ranks for r in live)
            if fits and buf.num_max_dispatch_tokens_per_rank >= n_max:
                self.apply_mask(buf)
                return buf
        if num_experts % self.group_size:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group size ({self.group_size})")
        cap = 1 << (max(n_max, 1) - 1).bit_length()
        group = self.group if len(live) == self.group_size else SubGroup(self.group, live, "deep_ep-shrink")
        experts = num_experts // self.group_size * len(live)
        buf = EPBuffer(group, hidden, experts, cap, num_topk, "auto", num_max_dispatch_tokens_per_rank=cap,
                       timeout=self.timeout)  # fmt: skip
        self.current[key], self.members[id(buf)] = buf, live
        self.made.append(buf)
        return buf

    def apply_mask(self, buf: EPBuffer) -> None:
        """Leave the ranks masked now out of ``buf``'s next low-latency exchange (shrink mode)."""
        shrink, members = self.agreement.shrink, self.members[id(buf)]
        assert shrink is not None  # shrink mode
        buf.mask_ranks([i for i, r in enumerate(members) if r in shrink.masked])

    def index_of(self, handle: object) -> int | None:
        """Which of this session's EPBuffers ``handle`` (a deep_ep handle) comes from; None for a handle of another
        buffer, or not a handle at all."""
        buffer = getattr(handle, "buffer", None)
        return next((i for i, b in enumerate(self.made) if b is buffer), None)

    def handle_fields(self, handle: object) -> list[tuple[str, FieldValue]]:
        """What every rank's handle must share in an agreement: which EPBuffer, which dispatch of it (None where the
        handle is not this session's: that rank's own check rejects the call)."""
        index = self.index_of(handle)
        epoch = getattr(getattr(handle, "handle", None), "epoch", None) if index is not None else None
        return [("handle's buffer", index), ("handle's dispatch", epoch)]

    def settle(self) -> None:
        """Run the receive hooks not yet called (they fill their own tensors, so their results stay valid)."""
        pending, self.pending = self.pending, []
        for receive in pending:
            receive()

    def deferred(self, run: Hook, return_recv_hook: bool) -> Hook | None:
        """``run`` as a hook that runs once; run now without ``return_recv_hook`` (and None returned)."""
        state = {"done": False}

        def receive() -> None:
            if not state["done"]:
                state["done"] = True
                run()

        if not return_recv_hook:
            receive()
            return None
        self.pending.append(receive)
        return receive

    def destroy(self) -> None:
        """Release every EPBuffer (collective); the session refuses every later call."""
        self.settle()
        for buf in self.made:
            buf.close()
        self.made, self.current, self.destroyed = [], {}, True
