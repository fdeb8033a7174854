"""DeepEP's ``Config`` and ``EventOverlap`` / ``EventHandle`` for ``epkit.compat.deep_ep``, and the byte counts its
size hints return.

``Config`` takes DeepEP's constructor (names, order, defaults, the same checks, raised as ``ValueError``
naming the parameter). epkit's dispatch has no chunked ring of NVLink/RDMA channels, so the chunk sizes tune
nothing here; a Config is still checked where a call takes one, and its size hints are the bytes epkit's
buffer takes for DeepEP's in-flight window of ``num_sms // 2 * num_max_nvl_chunked_recv_tokens`` tokens per
rank.

Events: epkit's calls are done (on the host, or queued on the caller's current stream) when they return, so
an ``EventHandle`` records a CUDA event on the current stream (nothing on a machine without CUDA) and
``current_stream_wait`` makes the current stream wait for it: with ``async_finish=True`` the results are
ready once that is done, as DeepEP promises.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

from epkit.collectives.ep_buffer import region_sizes

__all__ = [
    "Config", "EventHandle", "EventOverlap", "HINT_TOPK", "SIZE_ALIGN", "check_config", "check_events",
    "epbuffer_bytes", "events", "new_event", "wait_for",
]  # fmt: skip

#: V2's size hints round every byte count up to this (2 MiB).
SIZE_ALIGN = 2 << 20
#: The top-k the size hints assume (DeepEP's hints take no top-k; DeepSeek-V3 routes each token to 8 experts).
HINT_TOPK = 8


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"Config: {name} must be a positive int, got {value!r}")
    return value


class Config:
    """DeepEP's performance configuration of the normal mode (checked; see the module docstring)."""

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ):
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 0:
            raise ValueError(f"Config: num_sms must be an int >= 0, got {num_sms!r}")
        nvl_send = _positive("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens)
        nvl_recv = _positive("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens)
        rdma_send = _positive("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens)
        rdma_recv = _positive("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)
        if nvl_send >= nvl_recv:
            raise ValueError(
                f"Config: num_max_nvl_chunked_send_tokens ({nvl_send}) must be below "
                f"num_max_nvl_chunked_recv_tokens ({nvl_recv})"
            )
        rdma_recv = -(-rdma_recv // rdma_send) * rdma_send  # DeepEP rounds it up to a multiple of the send chunk
        if rdma_send > rdma_recv // 2:
            raise ValueError(
                f"Config: num_max_rdma_chunked_send_tokens ({rdma_send}) must be at most half of "
                f"num_max_rdma_chunked_recv_tokens ({rdma_recv}, rounded up to a multiple of it)"
            )
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens = nvl_send, nvl_recv
        self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens = rdma_send, rdma_recv

    def _window(self) -> int:
        return max(1, self.num_sms // 2) * self.num_max_nvl_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of epkit's buffer on each rank for normal dispatches of up to this config's in-flight window of
        tokens per rank, rows of ``hidden_bytes`` (bf16: ``hidden = hidden_bytes // 2``) over ``num_ranks``."""
        hidden = max(1, hidden_bytes // 2)
        return epbuffer_bytes(hidden, num_ranks, num_ranks, self._window(), HINT_TOPK, 1)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: epkit has one buffer for both modes, which :meth:`get_nvl_buffer_size_hint` counts."""
        if hidden_bytes <= 0 or num_ranks <= 0:
            raise ValueError(f"hidden_bytes and num_ranks must be positive, got {hidden_bytes}, {num_ranks}")
        return 0

    def __repr__(self) -> str:
        return (
            f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
            f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
            f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
            f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})"
        )


def epbuffer_bytes(hidden: int, num_experts: int, num_ranks: int, tokens: int, num_topk: int, ll_tokens: int) -> int:
    """Bytes an :class:`~epkit.collectives.ep_buffer.EPBuffer` allocates on each rank (``num_ranks`` regions) for
    these capacities (:func:`~epkit.collectives.ep_buffer.region_sizes`; the CUDA device kernels' own area and
    the ``shm`` transport's result slots, ``EPBuffer.result_slots``, are not counted)."""
    for name, v in (("hidden", hidden), ("num_experts", num_experts), ("num_ranks", num_ranks), ("tokens", tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_ranks ({num_ranks})")
    return region_sizes(hidden, num_topk, num_experts // num_ranks, tokens, ll_tokens).region_bytes * num_ranks


class EventHandle:
    """A CUDA event recorded on the current stream at construction (None where CUDA is not initialized: the work
    it would mark is already done)."""

    def __init__(self) -> None:
        self.event: torch.cuda.Event | None = None
        # torch leaves is_initialized and Event's __init__ unannotated
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the recorded event."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's event wrapper: ``event`` (an :class:`EventHandle` or None), ``extra_tensors`` (kept alive with it),
    ``current_stream_wait`` / ``wait``, a hook run after the wait (``register_hook_after_wait``), and ``with``
    (the wait on leaving the block; ``with event(release_handle=True)`` drops the event after it)."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple[torch.Tensor, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_on_exit = False
        self.hook_after_wait: Callable[[], Any] | None = None  # a caller's: its result is theirs

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        """The current stream waits for the event (which must exist: a call made with ``async_finish=True``), then
        the registered hook runs; returns the hook's result (None without one). ``release_handle`` drops the
        event afterwards."""
        if self.event is None:
            raise RuntimeError(
                "EventOverlap.current_stream_wait: there is no event (the call that returned it did not have "
                "async_finish=True)"
            )
        self.event.current_stream_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        result = hook() if hook is not None else None
        if release_handle:
            self.event = None
        return result

    def wait(self) -> Any:
        """:meth:`current_stream_wait`, returning the hook's result."""
        return self.current_stream_wait()

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Run ``hook_after_wait`` once, right after the next :meth:`current_stream_wait`."""
        if self.hook_after_wait is not None:
            raise RuntimeError("EventOverlap: a hook is already registered")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc_val: BaseException | None, exc_tb: TracebackType | None
    ) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_on_exit)
        self._release_on_exit = False


def check_events(
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


def wait_for(previous_event: EventOverlap | None) -> None:
    """Make the current stream wait for ``previous_event`` (checked by :func:`check_events`)."""
    if previous_event is not None and previous_event.event is not None:
        previous_event.event.current_stream_wait()


def events(fn: str, previous_event: EventOverlap | None, async_finish: object, allocate_on_comm_stream: object) -> None:
    """Check the stream arguments and wait for ``previous_event`` (the local calls: no agreement)."""
    check_events(fn, previous_event, async_finish, allocate_on_comm_stream)
    wait_for(previous_event)


def new_event(async_finish: bool, extra: tuple[torch.Tensor, ...] | None = None) -> EventOverlap:
    """A call's event: recorded on the current stream with ``async_finish`` (keeping ``extra`` alive), else empty."""
    return EventOverlap(EventHandle() if async_finish else None, extra if async_finish else None)


def check_config(fn: str, config: object) -> None:
    """``config`` is a deep_ep Config or None (ValueError)."""
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"{fn}: config must be a deep_ep Config (epkit.compat.deep_ep.Config) or None, got {config!r}")
