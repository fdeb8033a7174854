"""The ``torch`` transport: torch.distributed collectives, for ranks on several hosts (any gloo layout).

``local`` exists but no peer is addressable, so the one-sided primitives are absent (``direct`` is
False); the protocol's exchanges are one ``all_to_all_single`` each and its barriers ``dist.barrier``,
both asynchronous requests waited on with the buffer's timeout.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from epkit.collectives.transports.base import Transport

__all__ = ["TorchTransport"]


class TorchTransport(Transport):
    """Host memory for ``local`` plus timed torch.distributed requests (see the module docstring)."""

    name = "torch"

    def __init__(self, group, rank: int, world_size: int, num_bytes: int, num_signals: int):
        super().__init__(group, rank, world_size, num_bytes, num_signals)
        self.local = torch.zeros(num_bytes, dtype=torch.uint8)
        self._open = True

    def _wait(self, work, what: str, timeout: float) -> None:
        """Wait for a torch.distributed request; gloo reports a timeout (or a dead peer) as RuntimeError."""
        try:
            ok = work.wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise TimeoutError(f"rank {self.rank}: {what} did not complete within {timeout:g} s ({exc})") from None
        if ok is False:
            raise TimeoutError(f"rank {self.rank}: {what} did not complete within {timeout:g} s")

    def barrier(self, timeout: float) -> None:
        self._wait(dist.barrier(group=self.group, async_op=True), "barrier", timeout)

    def all_to_all(self, send: list[torch.Tensor], recv_bytes: list[int], timeout: float, what: str):
        """``send[r]`` (uint8, 1-D) to rank r; returns views of one receive tensor, ``recv_bytes[r]`` from rank r."""
        flat = torch.cat([s.reshape(-1) for s in send]) if send else torch.empty(0, dtype=torch.uint8)
        recv = torch.empty(sum(recv_bytes), dtype=torch.uint8)
        work = dist.all_to_all_single(
            recv,
            flat,
            output_split_sizes=list(recv_bytes),
            input_split_sizes=[s.numel() for s in send],
            group=self.group,
            async_op=True,
        )
        self._wait(work, f"{what} all-to-all", timeout)
        return list(torch.split(recv, list(recv_bytes)))

    def is_open(self) -> bool:
        return self._open

    def close(self, collective: bool) -> None:
        self._open = False
        self.local = torch.empty(0, dtype=torch.uint8)
