"""The ``nvshmem`` transport: CUDA ranks, one process per GPU (``csrc/cuda/nvshmem_transport.cu``).

One collective symmetric allocation per buffer, laid out as :mod:`~epkit.collectives.transports.base`
says; the job and the memory provider are :mod:`~epkit.collectives.transports.nvshmem_job`'s.
``peer_view(r)`` views rank r's GPU memory where NVLink reaches it (``nvshmem_ptr``), None elsewhere:
writes to such a peer go through staging and :meth:`NvshmemTransport.put_signal`.

Signals (``signal_op``) and timed waits (``signal_wait_all``, one deadline over a strided run of
words) are kernels of ``epkit._C_cuda`` launched on the current CUDA stream, so they order with the
caller's kernels. The host reads a wait's 2-word result after the stream reaches it, with its own
deadline as a second line of defence against a stuck stream; a deferred wait writes it into pinned
host memory instead, judged later (:class:`~epkit.collectives._details.deferred.DeferredChecks`).
"""

from __future__ import annotations

import time

import torch

from epkit.collectives.deadline import deadline_after
from epkit.collectives.transports import nvshmem_job
from epkit.collectives.transports.base import MASK64, Transport, layout

__all__ = ["NvshmemTransport"]

_SIGNAL_OPS = ("set", "add")


class NvshmemTransport(Transport):
    """One rank's part of an nvshmem buffer: the symmetric allocation, its views and the device ops.

    Creation is collective over ``group`` (:func:`~epkit.collectives.transports.nvshmem_job.allocate`).

    Attributes
    ----------
    provider : {"torch", "epkit"}
        Where the memory and the job come from (see ``nvshmem_job``).
    note : str
        Why torch's symmetric memory was not used, or "".
    peer_data : list of int
        Address of each rank's data as seen from this GPU; 0 where the peer is not directly addressable.
    pes : list of int
        The NVSHMEM PE of each rank of the group (its rank in the root group: a SubGroup's members are PEs of the
        job over the root).
    bytes_sent : list of int
        Bytes this rank has put to each rank through put-with-signal (the peers out of direct reach, across
        NVLink domains); what moves through peer views is not counted.
    """

    name = "nvshmem"
    direct = True
    stream_ordered = True
    collective_free = True

    def __init__(self, rv, hello: list[dict], num_bytes: int, num_signals: int):
        super().__init__(rv, hello, num_bytes, num_signals)
        from epkit.collectives.bootstrap import group_info, root_of

        rank = self.rank
        num_words, self.data_offset, alloc = layout(self.world_size, num_signals, num_bytes)
        # The allocation is collective over the job, whose PEs are the root group's ranks: a SubGroup's buffer
        # is allocated with every rank of the root (each making its own SubGroup's buffer of this size).
        root, members = root_of(self.group)
        root_rank, root_world = group_info(root)[:2]
        got = nvshmem_job.allocate(root, root_rank, root_world, alloc)
        self.provider, self.note, self.cc = got.provider, got.note, got.cc
        #: The NVSHMEM PE of each rank of the group (puts and signals address PEs).
        self.pes = members
        self.bytes_sent = [0] * self.world_size
        self._torch_memory = got.torch_memory
        dev = got.device
        bases = [got.bases[m] for m in members]
        self.base = bases[rank]
        self.peer_data = [b + self.data_offset if b else 0 for b in bases]
        self.views = [nvshmem_job.device_view(p, num_bytes, dev) if p else None for p in self.peer_data]
        self.local = self.views[rank]
        self.words = nvshmem_job.device_view(self.base, num_words * 8, dev).view(torch.int64)
        self._result = torch.zeros(2, dtype=torch.int64, device=dev)
        # Set by a deferred wait that timed out: the deferred waits queued after it then return at once.
        self._sticky = torch.zeros(1, dtype=torch.int64, device=dev)
        self._event = None if dev.type != "cuda" else torch.cuda.Event()
        self._urgent = None  # the side stream of urgent posts (created on first use)

    def peer_view(self, rank: int) -> torch.Tensor | None:
        return self.views[rank]

    def unreachable(self, rank: int) -> str:
        me, peer = self.rank_name(self.rank), self.rank_name(rank)
        return (
            f"{peer} is not directly addressable from {me} (nvshmem_ptr gave no address: "
            f"no NVLink/P2P path between the GPUs); use exchange()/all_to_all, which put through NVSHMEM"
        )

    def within_domain(self) -> bool:
        return bool(self.peer_data) and all(self.peer_data)

    def word_address(self, off: int) -> int:
        return self.base + off

    @property
    def sticky_word(self) -> torch.Tensor:
        return self._sticky

    def _stream(self) -> int:
        if self.device.type != "cuda":
            return 0  # emulated: the calling thread is the stream
        return torch.cuda.current_stream(self.device).cuda_stream

    def store(self, dst: int, off: int, value: int, op: str = "set", guarded: bool = False, urgent: bool = False):
        """A ``signal_op`` kernel on the current stream after its earlier work (``urgent``: on a high-priority
        stream of its own, not queued behind a stuck stream; ``guarded``: skipped once the sticky word is set,
        so that no signal follows writes that were skipped)."""
        if op not in _SIGNAL_OPS:
            raise ValueError(f"op must be 'set' or 'add', got {op!r}")
        if not isinstance(value, int) or not 0 <= value <= MASK64:
            raise ValueError(f"signal value must be an int in [0, 2**64), got {value!r}")
        stream = self._stream()
        if urgent and self.device.type == "cuda":
            if self._urgent is None:
                self._urgent = torch.cuda.Stream(self.device, priority=-1)
            stream = self._urgent.cuda_stream
        self.cc.signal_op(self.base + off, value, op, self.pes[dst], stream, self._sticky.data_ptr() if guarded else 0)

    def put_signal(self, dst: int, dst_off: int, src: torch.Tensor, nbytes: int, sig_off: int, value: int, guarded):
        """Copy ``nbytes`` of ``src`` to data offset ``dst_off`` on ``dst``, then set its word at ``sig_off``
        (one NVSHMEM put-with-signal: the signal lands after the bytes; ``guarded`` as in :meth:`store`)."""
        if nbytes == 0:
            self.store(dst, sig_off, value, guarded=guarded)
            return
        if (
            src is None
            or src.device != self.device
            or not src.is_contiguous()
            or src.numel() * src.element_size() < nbytes
        ):
            raise ValueError(f"put_signal needs a contiguous tensor of >= {nbytes} bytes on {self.device}")
        self.cc.put_signal(
            self.base + self.data_offset + dst_off,
            src.data_ptr(),
            nbytes,
            self.base + sig_off,
            value,
            "set",
            self.pes[dst],
            self._stream(),
            self._sticky.data_ptr() if guarded else 0,
        )
        self.bytes_sent[dst] += nbytes

    def wait(
        self, off: int, count: int, cmp: str, value: int, timeout: float, abort_words: int = 0
    ) -> tuple[int, int | None]:
        """A timed wait kernel on the current stream; the host then waits for the stream, with a deadline of
        ``timeout + HOST_GRACE_S`` past which the stream counts as stuck (TimeoutError). Inside a
        :func:`~epkit.collectives.deadline.within` block the kernel's timeout is what is left of the block's."""
        timeout = max(deadline_after(timeout) - time.monotonic(), 0.0)
        self._launch_wait(off, count, cmp, value, timeout, self._result.data_ptr(), 0, abort_words, True)
        if self._event is not None:
            self._event.record(torch.cuda.current_stream(self.device))
        grace = nvshmem_job.HOST_GRACE_S
        deadline = time.monotonic() + timeout + grace
        spins = 0
        while self._event is not None and not self._event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.rank_name(self.rank)}: the CUDA stream did not finish a {timeout:g} s signal wait within "
                    f"{timeout + grace:g} s (stuck behind earlier work, or a kernel hung)"
                )
            spins += 1
            if spins > 2000:
                time.sleep(50e-6)
        seen, failed = (v & MASK64 for v in self._result.tolist())
        return seen, (None if failed == 0 else failed - 1)

    def wait_deferred(self, off, count, cmp, value, timeout, checks, judge, what, abort_words=0, skip_on_sticky=True):
        """:meth:`wait` without the host: the wait kernel writes its 2-word result into pinned host memory and
        ``checks`` judges it once the stream has passed it. Returns at once.

        After a failed deferred wait on this buffer the later ones return at once (the sticky word),
        except those with ``skip_on_sticky=False``: waits that guard writes into a peer's memory.
        """
        slot = checks.host_slot(2)  # pinned: with unified addressing the kernel stores into it directly
        sticky = self._sticky.data_ptr()
        self._launch_wait(off, count, cmp, value, timeout, slot.data_ptr(), sticky, abort_words, skip_on_sticky)
        checks.record(slot, judge, timeout, what)

    def _launch_wait(self, off, count, cmp, value, timeout, result: int, sticky: int, abort_words, skip) -> None:
        """Check the arguments, then queue ``signal_wait_all`` over ``count`` words from ``off`` (stride 1)."""
        if not isinstance(value, int) or not 0 <= value <= MASK64:
            raise ValueError(f"signal value must be an int in [0, 2**64), got {value!r}")
        if not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        self.cc.signal_wait_all(
            self.base + off, 1, count, cmp, value, float(timeout), result, self._stream(), sticky, abort_words, skip
        )

    def load(self, off: int) -> int:
        """Current value of this rank's word at ``off`` (read after the stream's earlier work)."""
        return int(self.words[off // 8].item()) & MASK64

    def is_open(self) -> bool:
        return bool(self.views)

    def close(self, collective: bool) -> None:
        """Free the allocation (``collective``: every rank frees in step); a buffer retired by a failure stays
        allocated, since a peer may still write into it (that memory returns when the process exits)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.views, self.words, self._staging = [], None, {}
        self.local = torch.empty(0, dtype=torch.uint8)
        if self._torch_memory is not None:
            # torch never frees a rendezvoused allocation, so a cleanly closed buffer's goes to this process's
            # pool for the next buffer of the size; after a failure a peer may still write into it: dropped.
            memory, self._torch_memory = self._torch_memory, None
            if collective:
                # Every PE's puts and signals into this memory (the last acknowledgements too) have landed
                # before it can be reused: quiet and barrier over the job (torch's job is every rank).
                self.cc.barrier_all()
                from epkit.collectives.transports import nvshmem_torch

                nvshmem_torch.pool_keep(memory)
            return
        if collective and self.cc.initialized():
            self.cc.free(self.base)
