"""epkit's tensor ops as ``torch.library`` custom ops (``torch.ops.epkit.<name>``), so that ``torch.compile`` and
CUDA graphs can hold them.

Each op family registers its ops next to its implementation with :func:`custom_op` (``gather.py``:
``gather_rows``, ``gather_rows_out``; ``experts.py``: ``logical_to_physical``; ``quant.py``: the four
quantizers; ``grouped_gemm.py``: one op per entry of ``GROUPED_OPS``; ``moe.py``: ``expert_mlp``;
``cp_mirror.py``: ``prepare_cp_mirror``; ``engram.py``: ``engram_hash``, ``engram_ngram_ids``), and its public
function calls the op. :data:`CUSTOM_OPS` lists them all (``tests/test_custom_ops.py`` checks each one).

How the ops stay compile- and capture-safe:

- **Schemas** say what an op writes (``Tensor(a!) d`` for the GEMMs' output, ``out`` of ``gather_rows_out``);
  no op returns a view of an input, so the public functions that return ``out``/``d`` (as DeepGEMM's do)
  return it themselves after calling the op.
- **Fake implementations** give the output shapes from the input shapes alone (``prepare_cp_mirror``, whose
  sizes depend on the ``cu_seqlens`` values, asks for data-dependent sizes), so meta tensors,
  ``FakeTensorMode`` and ``torch.compile(fullgraph=True)`` trace every op without running it.
- **Checks**: the public functions check types, dtypes, shapes and devices (static facts, traced by the
  compiler at no cost); the checks that read tensor values on the host (index ranges, finiteness, the
  grouped-GEMM layouts, Engram's primes) run inside the op's implementation, which the compiler does not
  trace (so they are no graph break and raise the same ``ValueError`` in compiled code) and which
  :func:`host_checks` turns off during CUDA stream capture (a host read cannot be captured). What
  replaces them there is in each op's docstring: an index op maps out-of-range ids to its padding value on
  the device (``gather_rows``: a zero row; ``logical_to_physical``: ``-1``), the GEMMs' kernels clamp what
  they read, a quantizer lets NaN/Inf through. ``EPKIT_GEMM_CHECKS=1`` (the debugging aid of
  ``epkit.grouped_gemm``) runs the GEMMs' checks on CUDA tensors too, outside capture.

The collectives keep state (buffers, handles, messages in flight), which a graph cannot hold; the one whose
call is a function of tensors, ``fused_moe``, registers ``torch.ops.epkit.fused_moe`` itself
(``collectives/fused_moe.py``), with the buffer named by a string, as engines register their MoE layers by
name. EPBuffer's dispatch/combine pairs and their low-latency twins hand back handles and stay outside compiled
regions, as DeepEP's do.

A Python dispatch mode sees a custom op as one call; :func:`trace_into` makes a mode type see the aten ops
inside epkit's ops instead, as it did before they were custom ops. ``epkit.testing.host_sync.HostSyncDetector``
(which looks for host reads among those aten ops) registers itself so when it is imported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "NAMESPACE",
    "CUSTOM_OPS",
    "custom_op",
    "trace_into",
    "capturing",
    "refuse_capture",
    "host_checks",
]

#: The ``torch.library`` namespace of every epkit op: ``torch.ops.epkit.<name>``.
NAMESPACE = "epkit"

#: Every registered op by name (``torch.library.CustomOpDef``), in registration order.
CUSTOM_OPS: dict[str, torch.library.CustomOpDef] = {}
_IMPLS: dict[str, Callable] = {}  # the Python implementation of each op
_TRACED_MODES: list[type] = []  # dispatch mode types that see inside the ops (trace_into)


def custom_op(name: str, fake: Callable, mutates_args: tuple[str, ...] = ()):
    """Decorator: register the decorated implementation as ``torch.ops.epkit.<name>``, with ``fake`` as its fake
    (meta) implementation. The schema is inferred from the implementation's annotations; ``mutates_args``
    names the arguments it writes. Returns the op (call it like the function)."""

    def register(fn: Callable) -> torch.library.CustomOpDef:
        if name in CUSTOM_OPS:
            raise ValueError(f"torch.ops.{NAMESPACE}.{name} is registered twice")
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=mutates_args)
        op.register_fake(fake)
        CUSTOM_OPS[name], _IMPLS[name] = op, fn
        for mode_type in _TRACED_MODES:
            op.register_torch_dispatch(mode_type, _inside(fn))
        return op

    return register


def _inside(fn: Callable) -> Callable:
    def rule(mode, func, types, args, kwargs):
        # The mode is off while it handles an op: pushed back (by the base class alone, so that a subclass's
        # own __enter__/__exit__ work, such as patching Tensor methods, is not done twice), it sees the
        # implementation's aten ops.
        TorchDispatchMode.__enter__(mode)
        try:
            return fn(*args, **kwargs)
        finally:
            TorchDispatchMode.__exit__(mode, None, None, None)

    return rule


def trace_into(mode_type: type) -> None:
    """Let dispatch modes of ``mode_type`` see the aten ops inside every epkit op (registered and future ones)
    rather than one call per op."""
    if mode_type not in _TRACED_MODES:
        _TRACED_MODES.append(mode_type)
        for name, op in CUSTOM_OPS.items():
            op.register_torch_dispatch(mode_type, _inside(_IMPLS[name]))


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refuse_capture(what: str, device: torch.device) -> None:
    """RuntimeError when a normal-mode EP call (``what``) on ``device`` is made while the current CUDA stream
    captures a graph: it reads the received counts on the host to size its outputs, which a graph cannot
    replay. Raised before anything is sent, on every capturing rank."""
    if torch.device(device).type == "cuda" and capturing():
        raise RuntimeError(
            f"{what} cannot run under CUDA graph capture: its output sizes come from a host read of the received "
            f"counts. Capture low_latency_dispatch / low_latency_combine (fixed shapes, no host synchronisation), or "
            f"a dispatch with num_worst_tokens (and its combine) on a buffer on the device kernels, instead, or run "
            f"{what} outside the graph"
        )


def host_checks(device: torch.device | str | None = None) -> bool:
    """Whether an op may read tensor values on the host to check them: always, except while a CUDA stream is
    capturing (``device`` of type ``cpu`` never captures)."""
    if device is not None and torch.device(device).type == "cpu":
        return True
    return not capturing()
