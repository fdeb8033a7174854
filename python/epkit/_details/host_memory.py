"""Tensors that live in host memory by design: status words and check slots that device kernels write (pinned,
so mapped, on CUDA) and the host reads without a device synchronisation.

The library marks them where it makes them and consults the mark itself (a deferred check copies values that are
not host memory into a slot first); ``epkit.testing.host_sync``'s detectors read the same mark, so that reading
such a word on the host is not reported as a host read of device data. The mark belongs to the tensor object
(not to its views) and is dropped with it.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["is_host_memory", "mark_host_memory"]

_MARKED: dict[int, weakref.ref] = {}  # id(tensor) -> a weak reference to it (removed when the tensor goes)


def mark_host_memory(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as host memory by design; returns ``t``."""
    key = id(t)
    _MARKED[key] = weakref.ref(t, lambda _ref, key=key: _MARKED.pop(key, None))
    return t


def is_host_memory(t: object) -> bool:
    """Whether ``t`` is a tensor marked by :func:`mark_host_memory`."""
    ref = _MARKED.get(id(t))
    return ref is not None and ref() is t
