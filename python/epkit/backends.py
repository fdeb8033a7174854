"""Backend selection for every public op.

Each op registers an :class:`OpSpec` naming the backends that implement it and
the devices each one runs on. ``select(op, device, backend)`` resolves
``backend="auto"`` to the best available implementation for the tensors'
device, and turns an unavailable explicit choice into a
:class:`BackendUnavailableError` that says what is missing and how to get it.

Backends
--------
``reference``  plain torch, readable; the specification. Any device.
``cpu``        the fastest CPU path (vectorised torch or the C++ extension).
``tilelang``   TileLang kernels: the C target on CPU tensors, CUDA on GPU tensors.
``triton``     Triton kernels on CUDA tensors; on CPU tensors the Triton
               interpreter runs the same kernel source (slow; for verification).

Nothing here imports triton or tilelang: availability is probed with
``importlib.util.find_spec`` and the frameworks load on first use.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

_log = logging.getLogger(__name__)

__all__ = [
    "ALL_BACKENDS_CPU",
    "ALL_BACKENDS_CUDA",
    "BACKENDS",
    "BackendUnavailableError",
    "BackendInfo",
    "OpSpec",
    "register_op",
    "registered_ops",
    "backend_info",
    "select",
]

BACKENDS = ("reference", "cpu", "tilelang", "triton")
#: Backend preferences of an op that has every backend: CPU tensors (fastest CPU path first), CUDA tensors.
ALL_BACKENDS_CPU = ("cpu", "tilelang", "reference", "triton")
ALL_BACKENDS_CUDA = ("triton", "tilelang", "reference")

_INSTALL_HINT = {
    "triton": "pip install 'epkit[kernels]' (Triton 3.6 or newer; a CUDA torch brings the one it needs)",
    "tilelang": "pip install 'epkit[tilelang]' (tilelang==0.1.15)",
    "cpu": "reinstall epkit so that its C++ extension builds: pip install -e . (needs a C++17 compiler)",
}


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here; the message says why and how to fix it."""


@dataclass(frozen=True)
class BackendInfo:
    """What one backend can run on this machine.

    ``devices`` holds the device types (``"cpu"``, ``"cuda"``) it can run on now;
    ``missing`` explains, per device type it cannot run on, what is missing.
    """

    name: str
    devices: tuple[str, ...]
    missing: dict[str, str] = field(default_factory=dict)

    def available_on(self, device_type: str) -> bool:
        return device_type in self.devices


@functools.cache
def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def cuda_available() -> bool:
    return torch.cuda.is_available()


@functools.cache
def _c_compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


@functools.cache
def c_extension_error() -> str | None:
    """None when ``epkit._C`` imports, else the reason it does not."""
    try:
        from epkit import _C  # noqa: F401
    except ImportError as exc:
        _log.warning("epkit._C failed to import (%s): ops whose cpu path uses it fall back to torch", exc)
        return f"epkit._C failed to import ({exc})"
    return None


def backend_info(name: str) -> BackendInfo:
    """Probe one backend (cheap: no framework is imported)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS} or 'auto'")
    gpu = cuda_available()
    no_gpu = "no CUDA device visible to torch (torch.cuda.is_available() is False)"
    devices: list[str] = []
    missing: dict[str, str] = {}
    if name == "reference":
        devices = ["cpu"] + (["cuda"] if gpu else [])
        if not gpu:
            missing["cuda"] = no_gpu
    elif name == "cpu":
        devices = ["cpu"]
        missing["cuda"] = "the cpu backend runs on CPU tensors only"
    elif name == "triton":
        if not _has_module("triton"):
            missing["cpu"] = missing["cuda"] = f"triton is not installed; {_INSTALL_HINT['triton']}"
        else:
            devices.append("cpu")  # the interpreter
            if gpu:
                devices.append("cuda")
            else:
                missing["cuda"] = no_gpu
    elif name == "tilelang":
        if not _has_module("tilelang"):
            missing["cpu"] = missing["cuda"] = f"tilelang is not installed; {_INSTALL_HINT['tilelang']}"
        else:
            if _c_compiler():
                devices.append("cpu")
            else:
                missing["cpu"] = "no C compiler (cc/gcc/clang) on PATH for TileLang's C target"
            if gpu:
                devices.append("cuda")
            else:
                missing["cuda"] = no_gpu
    return BackendInfo(name, tuple(devices), missing)


@dataclass(frozen=True)
class OpSpec:
    """Which backends implement an op, in order of preference per device type.

    ``cpu`` and ``cuda`` list backends best-first; ``auto`` takes the first
    available one. Every backend named in either list is accepted explicitly.
    """

    name: str
    cpu: tuple[str, ...]
    cuda: tuple[str, ...]
    doc: str = ""
    #: ``selfcheck(backend, device="cpu")`` runs the op on small inputs on ``device`` and raises if it
    #: disagrees with the reference (used by ``epkit selfcheck`` and ``bench/kernel_check.py``).
    selfcheck: Callable[[str], None] | None = None

    @property
    def backends(self) -> tuple[str, ...]:
        seen = dict.fromkeys(self.cpu + self.cuda)
        return tuple(seen)


_OPS: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    for b in spec.backends:
        if b not in BACKENDS:
            raise ValueError(f"op {spec.name!r} names unknown backend {b!r}")
    _OPS[spec.name] = spec
    return spec


def registered_ops() -> dict[str, OpSpec]:
    """The op table: every public op and the backends it has."""
    return dict(_OPS)


def select(op: str, device: torch.device | str, backend: str = "auto") -> str:
    """Resolve the backend that runs ``op`` on tensors of ``device``.

    ``backend="auto"`` takes the first available backend of the op's preference list for the device, unless
    ``EPKIT_BACKEND`` names one: then that one, checked like an explicit choice (errors name the variable).

    Raises
    ------
    ValueError
        ``backend`` (or ``EPKIT_BACKEND``) is not a known name, or the op does not implement it.
    BackendUnavailableError
        ``backend`` is implemented but cannot run here (message says why).
    """
    spec = _OPS[op]
    dtype = torch.device(device).type
    order = spec.cuda if dtype == "cuda" else spec.cpu
    if backend != "auto":
        return _logged(op, dtype, backend, _explicit(spec, dtype, order, backend))
    env = os.environ.get("EPKIT_BACKEND", "").strip()
    if env and env != "auto":
        try:
            chosen = _explicit(spec, dtype, order, env)
        except (ValueError, BackendUnavailableError) as exc:
            raise type(exc)(
                f"EPKIT_BACKEND={env}: {exc}. EPKIT_BACKEND forces a backend wherever backend='auto' is passed; "
                "unset it (or set it to auto) to let each op choose"
            ) from None
        if (op, dtype) not in _FORCED_LOGGED:
            _FORCED_LOGGED.add((op, dtype))
            _log.info("EPKIT_BACKEND=%s forces %s on %s tensors to the %s backend", env, op, dtype, chosen)
        return _logged(op, dtype, "auto", chosen)
    if dtype == "cpu" and order and order[0] == "cpu":  # the cpu backend always runs on CPU tensors: no probe
        return _logged(op, dtype, "auto", "cpu")
    reasons = []
    for cand in order:
        info = backend_info(cand)
        if info.available_on(dtype):
            return _logged(op, dtype, "auto", cand)
        reasons.append(f"{cand}: {info.missing.get(dtype, 'unavailable')}")
    raise BackendUnavailableError(f"no backend of {op} can run on {dtype} tensors here: " + "; ".join(reasons))


_FORCED_LOGGED: set[tuple[str, str]] = set()


def _logged(op: str, dtype: str, asked: str, chosen: str) -> str:
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("%s on %s tensors: backend %s -> %s", op, dtype, asked, chosen)
    return chosen


def _explicit(spec: OpSpec, dtype: str, order: tuple[str, ...], backend: str) -> str:
    """``backend`` itself when ``spec`` has it and it runs on ``dtype`` tensors here; raises otherwise."""
    op = spec.name
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} for {op}; expected 'auto' or one of {BACKENDS}")
    if backend not in spec.backends:
        raise ValueError(f"{op} has no {backend!r} backend; it has {spec.backends}")
    if backend not in order:
        raise BackendUnavailableError(
            f"{op}'s {backend} backend does not run on {dtype} tensors; on {dtype} it has {order}"
        )
    info = backend_info(backend)
    if not info.available_on(dtype):
        raise BackendUnavailableError(
            f"{op}: backend {backend!r} cannot run on {dtype} tensors here: {info.missing.get(dtype, 'unavailable')}"
        )
    return backend
