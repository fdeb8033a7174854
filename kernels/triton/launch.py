"""Launch Triton kernels: compiled on CUDA tensors, under the interpreter on CPU tensors, all through :func:`launch`.

``triton.jit`` decides between compiling and interpreting when a module is imported (``TRITON_INTERPRET``).
epkit kernels are always plain JIT functions; :func:`launch` runs one compiled for CUDA tensors and its
interpreter twin for CPU tensors, so the same kernel source runs on both without touching the environment.

Every Triton launch of the project goes through :func:`launch`, which tells its observers (:func:`observe`)
what it launches. That is how rung 3 of the verification ladder compiles each kernel *as launched*: while an
observer is registered, every host launcher marked :func:`launcher` first runs once as its CUDA twin, deciding
everything as it would for CUDA tensors (:func:`target` answers ``"cuda"``; programs per SM, block sizes, the
hardware timer) from the very values the CPU call got, and its launches are reported without running. The
CPU call then runs as usual. The observer keeps the argument values the host driver really passes; Triton's
own launch specialization (an int equal to 1 a constant, one that fits 32 bits an ``i32``, multiples of 16 a
divisibility hint) is applied to them later, under each Triton version (``epkit.testing.launches``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["Launch", "as_cuda", "interpreted", "launch", "launcher", "observe", "target", "twin_active"]


@functools.cache
def interpreted(kernel):
    """The interpreter twin of a ``@triton.jit`` kernel (cached per kernel)."""
    from triton.runtime.interpreter import InterpretedFunction

    fn = getattr(kernel, "fn", kernel)
    return InterpretedFunction(fn)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as its host launcher made it: the JIT kernel, the grid, the positional arguments and
    the keywords (constexprs and launch options) exactly as passed, and the device type it was made for."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict = field(default_factory=dict)
    target: str = "cuda"

    @property
    def name(self) -> str:
        fn = getattr(self.kernel, "fn", self.kernel)
        return fn.__name__


_OBSERVERS: list[Callable[[Launch], None]] = []
_LOCAL = threading.local()


def twin_active() -> bool:
    """True while a host launcher runs as its CUDA twin (its launches are reported, not run)."""
    return getattr(_LOCAL, "twin", False)


def target(device: torch.device) -> str:
    """The device type a launch is made for: ``"cuda"`` for CUDA tensors and inside a CUDA twin, else the
    tensors' own. Host launchers decide everything that differs between a GPU and the interpreter from this."""
    return "cuda" if twin_active() else device.type


@contextlib.contextmanager
def observe(fn: Callable[[Launch], None]) -> Iterator[None]:
    """Call ``fn`` with every :class:`Launch` made while the block runs (CUDA twins included: their
    ``target`` is ``"cuda"``)."""
    _OBSERVERS.append(fn)
    try:
        yield
    finally:
        _OBSERVERS.remove(fn)


@contextlib.contextmanager
def as_cuda() -> Iterator[None]:
    """Host launchers called in the block decide as for CUDA tensors (:func:`target`) and their launches are
    reported to the observers, not run: how a launch at sizes no CPU run reaches is made for compiling."""
    _LOCAL.twin = True
    try:
        yield
    finally:
        _LOCAL.twin = False


def launcher(fn):
    """Mark a host launcher (a function whose launches go through :func:`launch`): while an observer is
    registered, it first runs as its CUDA twin with the same arguments (nothing runs; its launches are
    reported as made for CUDA), then as itself. A launcher that returns a callable (a prepared launch) has
    that callable run inside the twin too. Without observers it costs one list check."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if _OBSERVERS and not twin_active():
            with as_cuda():
                prepared = fn(*args, **kwargs)
                if callable(prepared):
                    prepared()
        return fn(*args, **kwargs)

    return wrapped


def launch(kernel, grid, device: torch.device, *args, interpret=None, **kwargs) -> None:
    """Launch the ``@triton.jit`` ``kernel`` on ``grid``: compiled on CUDA (on ``device``'s current stream),
    interpreted on the CPU (``interpret``: the twin to run, default :func:`interpreted`); reported to the
    observers first. Inside a CUDA twin (:func:`launcher`) it is only reported."""
    if _OBSERVERS:
        made = Launch(kernel, tuple(grid), args, dict(kwargs), target(device))
        for observer in list(_OBSERVERS):
            observer(made)
    if twin_active():
        return
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[tuple(grid)](*args, **kwargs)
        return
    if device.type != "cpu":
        raise ValueError(f"Triton kernels run on cuda or cpu (interpreter) tensors, not {device.type}")
    (interpret or interpreted)(kernel)[tuple(grid)](*args, **kwargs)
