"""CUDA graph capture for tests: for rung 4 a step run once eagerly (it compiles and allocates what a capture cannot),
then captured, so that a test replays it on new inputs and compares with the eager result; on CPU ranks a
``epkit.compat.deep_ep`` buffer's calls as they run on an NCCL group under capture (:func:`pretended_nccl_capture`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["captured", "pretended_nccl_capture"]


def captured(step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``(graph, outputs)``: ``step()`` run once eagerly, then captured in a CUDA graph whose replays refill
    ``outputs`` (the tensors the captured call returned) from the inputs it read."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@contextlib.contextmanager
def pretended_nccl_capture(buffer: Any) -> Iterator[list[str]]:
    """In the block, ``buffer`` (an ``epkit.compat.deep_ep`` ``Buffer`` or ``ElasticBuffer``) believes its group is an
    NCCL group and the current stream captures a CUDA graph (over gloo on CPU ranks: how its stream-ordered calls
    are tested without a GPU); yields the names of the host agreements its calls made meanwhile (none for a
    stream-ordered call)."""
    from epkit.compat._details import deep_ep_session

    session = buffer._session
    agreed: list[str] = []
    real_agree, real_capturing = session.agree, deep_ep_session.capturing
    session.agreement.nccl = True  # what an NCCL group's session says
    session.agree = lambda fn, *a, **k: agreed.append(fn) or real_agree(fn, *a, **k)
    deep_ep_session.capturing = lambda: True  # as under torch.cuda.graph
    try:
        yield agreed
    finally:
        session.agreement.nccl, session.agree, deep_ep_session.capturing = False, real_agree, real_capturing
