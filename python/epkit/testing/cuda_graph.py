"""CUDA graph capture for rung-4 tests: a step run once eagerly (it compiles and allocates what a capture cannot),
then captured, so that a test replays it on new inputs and compares with the eager result."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["captured"]


def captured(step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``(graph, outputs)``: ``step()`` run once eagerly, then captured in a CUDA graph whose replays refill
    ``outputs`` (the tensors the captured call returned) from the inputs it read."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
