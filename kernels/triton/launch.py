"""Launch Triton kernels on CUDA tensors, or under the interpreter on CPU tensors.

``triton.jit`` decides between compiling and interpreting when a module is
imported (``TRITON_INTERPRET``). epkit kernels are always plain JIT functions;
:func:`for_device` wraps one in the interpreter for CPU tensors, so the same
kernel source runs on both without touching the environment.
"""

from __future__ import annotations

import functools

import torch
import triton


@functools.cache
def interpreted(kernel):
    """The interpreter twin of a ``@triton.jit`` kernel (cached per kernel)."""
    from triton.runtime.interpreter import InterpretedFunction

    fn = getattr(kernel, "fn", kernel)
    return InterpretedFunction(fn)


def for_device(kernel, device: torch.device):
    """``kernel`` itself for CUDA tensors, its interpreter twin for CPU tensors."""
    if device.type == "cuda":
        return kernel
    if device.type == "cpu":
        if isinstance(kernel, triton.runtime.JITFunction):
            return interpreted(kernel)
        return kernel  # already interpreted (TRITON_INTERPRET=1 at import)
    raise ValueError(f"Triton kernels run on cuda or cpu (interpreter) tensors, not {device.type}")
