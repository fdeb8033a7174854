"""Context-parallel communication: async all-gather and driver broadcasts over the CP group.

``CPGroup.all_gather(x)`` starts the gather and returns a callable; calling it
waits and returns the gathered tensor ``[cp_size * n, *]`` (rank-major), so
callers overlap compute with the exchange ("start now, wait when needed").

``cp_broadcast_object`` sends a picklable object from the CP driver rank (group
rank 0) over the CPU group; ``cp_broadcast_tensor_dict`` sends a dict whose
structure (keys, plain values, tensor dtypes and shapes) goes over the CPU group
and whose tensors go over the device group.

Backed by torch.distributed async collectives; every wait has a timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["CPGroup", "cp_broadcast_object", "cp_broadcast_tensor_dict"]


class CPGroup:
    """The CP group of this rank: a device group for tensors and a CPU (gloo) group for structure.

    Parameters
    ----------
    group : ProcessGroup
        Device group (NCCL on GPU; gloo on CPU).
    cpu_group : ProcessGroup, optional
        CPU/gloo twin for Python objects (default: ``group``).
    timeout : float
        Seconds a wait may take before ``TimeoutError``.
    """

    def __init__(self, group, cpu_group=None, timeout: float = 60.0):
        self.group = group
        self.cpu_group = cpu_group if cpu_group is not None else group
        self.timeout = timeout
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.driver = dist.get_global_rank(group, 0) if self.size > 1 else dist.get_rank()

    @classmethod
    def from_parallel_groups(cls, pg, timeout: float = 60.0) -> CPGroup:
        """The CP group of an :class:`epkit.topology.ParallelGroups`."""
        return cls(pg.cp_group, pg.cpu_cp_group, timeout)

    def all_gather(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start gathering ``x [n, *]`` from every CP rank; the returned callable waits and gives ``[cp*n, *]``.

        Every rank must pass the same shape and dtype (the mirror layout makes
        ``n = cp_mirror_len`` equal on all ranks).
        """
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        if self.size == 1:
            out.copy_(x)
            return lambda: out
        work = dist.all_gather_into_tensor(out, x, group=self.group, async_op=True)
        timeout = self.timeout
        done = [False]

        def wait() -> torch.Tensor:
            if not done[0]:
                if not work.wait(timeout=timedelta(seconds=timeout)):
                    raise TimeoutError(f"CP all-gather did not finish within {timeout} s")
                done[0] = True
            return out

        return wait


def cp_broadcast_object(obj, cp: CPGroup):
    """Broadcast a picklable ``obj`` from the CP driver (group rank 0) over the CPU group; returns it on every rank."""
    if cp.size == 1:
        return obj
    box = [obj if cp.rank == 0 else None]
    dist.broadcast_object_list(box, src=cp.driver, group=cp.cpu_group)
    return box[0]


def cp_broadcast_tensor_dict(tensors: dict | None, cp: CPGroup, device: torch.device | str | None = None) -> dict:
    """Broadcast a dict from the CP driver: structure over the CPU group, tensors over the device group.

    On the driver, ``tensors`` maps str keys to tensors or plain picklable values;
    other ranks pass None (or anything) and receive an equal dict, tensors
    allocated on ``device`` (default: the driver's tensor device type on CPU ranks,
    the current CUDA device on GPU ranks).
    """
    if cp.size == 1:
        return dict(tensors or {})
    if cp.rank == 0:
        if not isinstance(tensors, dict) or not all(isinstance(k, str) for k in tensors):
            raise ValueError("cp_broadcast_tensor_dict: the driver must pass a dict with str keys")
        meta = [
            (k, ("tensor", v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else ("value", v))
            for k, v in tensors.items()
        ]
    else:
        meta = None
    meta = cp_broadcast_object(meta, cp)
    out = {}
    for key, spec in meta:
        if spec[0] == "value":
            out[key] = spec[1]
            continue
        _, dtype, shape = spec
        if cp.rank == 0:
            t = tensors[key].contiguous()
        else:
            dev = device if device is not None else ("cuda" if dist.get_backend(cp.group) == "nccl" else "cpu")
            t = torch.empty(shape, dtype=dtype, device=dev)
        work = dist.broadcast(t, src=cp.driver, group=cp.group, async_op=True)
        if not work.wait(timeout=timedelta(seconds=cp.timeout)):
            raise TimeoutError(f"CP tensor broadcast of {key!r} did not finish within {cp.timeout} s")
        out[key] = t
    return out
