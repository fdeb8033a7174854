"""Find host reads of device data in code run on CPU tensors: the operations that would make a CUDA
caller wait for the GPU.

On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` catches a synchronizing call directly. On a
machine without one, :class:`HostSyncDetector` catches what causes them, as the code runs on CPU
tensors standing in for device tensors:

- ops whose result the host must read: ``item()``/``int()``/``bool()`` of a tensor
  (``aten._local_scalar_dense``), ``torch.equal``, ``is_nonzero``;
- ops whose output shape depends on the data (on CUDA they read a count back): ``nonzero``,
  ``argwhere``, ``masked_select``, ``unique*``, ``bincount``, ``repeat_interleave`` without
  ``output_size``, indexing with a boolean mask;
- copies between devices (``_to_copy``/``copy_`` with a CPU side and a non-CPU side);
- ``Tensor.tolist()`` and ``Tensor.numpy()``, which dispatch no op on CPU, patched for the duration.

Tensors that stand for host memory (pinned status words read after an event) are exempt when the library
marked them so (:func:`epkit._details.host_memory.mark_host_memory`). Frames of the Triton interpreter are
exempt: it emulates a device kernel, which on a GPU reads its inputs on the device.
"""

from __future__ import annotations

import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from epkit._details.host_memory import is_host_memory
from epkit.ops import trace_into

__all__ = ["DeviceOpCounter", "HostSyncDetector"]

_READBACK = {
    "_local_scalar_dense",
    "equal",
    "is_nonzero",
    "nonzero",
    "argwhere",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "bincount",
}


def _in_triton_interpreter() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("triton.runtime.interpreter"):
            return True
        frame = frame.f_back
    return False


def _where() -> str:
    for fs in reversed(traceback.extract_stack()[:-3]):
        if "host_sync.py" not in fs.filename and "/torch/" not in fs.filename:
            return f"{fs.filename}:{fs.lineno} ({fs.line})"
    return "?"


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


class HostSyncDetector(TorchDispatchMode):
    """Record (or refuse) host reads of tensor data inside the ``with`` block.

    Parameters
    ----------
    strict : bool
        Raise ``AssertionError`` at the first offending call instead of only recording it.

    Attributes
    ----------
    events : list of str
        One line per offending call: what it was and where (file:line of the caller).
    """

    def __init__(self, strict: bool = False):
        super().__init__()
        self.strict = strict
        self.events: list[str] = []
        self._saved = {}

    def _report(self, what: str) -> None:
        if _in_triton_interpreter():
            return
        line = f"{what} at {_where()}"
        self.events.append(line)
        if self.strict:
            raise AssertionError(f"host read of device data: {line}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _READBACK and not any(is_host_memory(t) for t in _tensors(args)):
            self._report(f"aten.{name}")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) > 1:
            self._report("aten.repeat_interleave without output_size")
        elif name in ("index", "index_put", "index_put_") and len(args) > 1:
            if any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1])):
                self._report(f"aten.{name} with a boolean mask")
        elif name in ("_to_copy", "copy_"):
            devices = {t.device.type for t in _tensors(args)}
            if "device" in kwargs and kwargs["device"] is not None:
                devices.add(torch.device(kwargs["device"]).type)
            if "cpu" in devices and len(devices) > 1:
                self._report(f"aten.{name} between {sorted(devices)}")
        return func(*args, **kwargs)

    def __enter__(self):
        detector = self
        for meth in ("tolist", "numpy"):
            original = getattr(torch.Tensor, meth)
            self._saved[meth] = original

            def patched(t, *a, _original=original, _meth=meth, **k):
                if not is_host_memory(t):
                    detector._report(f"Tensor.{_meth}()")
                return _original(t, *a, **k)

            setattr(torch.Tensor, meth, patched)
        return super().__enter__()

    def __exit__(self, *exc):
        for meth, original in self._saved.items():
            setattr(torch.Tensor, meth, original)
        self._saved = {}
        return super().__exit__(*exc)


#: Ops that launch nothing on a GPU: allocations, views and metadata.
_NO_KERNEL = {
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "view",
    "_unsafe_view",
    "_reshape_alias",
    "as_strided",
    "alias",
    "detach",
    "t",
    "transpose",
    "permute",
    "select",
    "slice",
    "expand",
    "unsqueeze",
    "squeeze",
    "unbind",
    "split",
    "split_with_sizes",
    "narrow",
    "lift_fresh",
    "is_pinned",
    "_local_scalar_dense",
}


trace_into(HostSyncDetector)  # it looks for host reads among the aten ops inside epkit's custom ops


class DeviceOpCounter(TorchDispatchMode):
    """Count the torch ops inside the ``with`` block that would each launch a device kernel (everything but
    allocations, views and metadata, and ops on tensors marked as host memory), outside the
    Triton interpreter (whose own bookkeeping runs the emulated kernel). Together with a count of the Triton
    launches, the device work a call queues, on CPU tensors.

    Attributes
    ----------
    ops : list of str
        One name per counted op, in order.
    """

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        host = any(is_host_memory(t) for t in _tensors(args))
        if name not in _NO_KERNEL and not host and not _in_triton_interpreter():
            self.ops.append(name)
        return func(*args, **(kwargs or {}))
