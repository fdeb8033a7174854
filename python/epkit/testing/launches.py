"""Rung 3 as launched: record the kernel launches epkit's host launchers really make, then compile each one for
sm_90 through Triton's own launch specialization, under any Triton version, with no GPU.

A kernel compiled from hand-written argument types is not the kernel a launch runs: Triton's JIT types a Python
int by its value (1 becomes a constant, a value that fits 32 bits an ``i32``, a multiple of 16 carries a
divisibility hint) and a tensor by its dtype and alignment. So:

- :class:`Recorder` observes ``epkit.kernels.triton.launch`` while real calls run (rung 2: CPU ranks, the
  interpreter) and keeps every launch the host launchers made *for CUDA* (their CUDA twins), with the argument
  values as passed, one entry per specialization class (:func:`specialization_class`, finer than any Triton
  version's). Entries are plain JSON (:func:`save` / :func:`load`), so that another Triton can compile them.
- :func:`compile_entry` rebuilds the arguments (tensors of the recorded dtype and alignment, tensor
  descriptors, the ints themselves) and calls the kernel's own ``warmup`` under a stand-in driver that answers
  ``GPUTarget("cuda", 90, 32)``: Triton binds, specializes, compiles to a cubin, and the result carries
  registers, local memory (spills) and shared memory from ``cuobjdump``.
- :func:`compile_all` compiles every distinct specialization of a list of entries; ``epkit.testing.rung3`` is
  the command line over it (one Triton, several versions, the GPU run's cache warm-up). :func:`save_compiled`
  keeps its compiles whole (PTX and SASS text included) by :func:`triton_key`, and :func:`load_compiled` gives
  them back, so that one compile serves both the sweep and the tests that read its text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = [
    "PARKED_BYTES",
    "CompiledLaunch",
    "Recorder",
    "compile_entry",
    "compile_all",
    "load",
    "load_compiled",
    "merge",
    "recording",
    "save",
    "save_compiled",
    "sm90_driver",
    "specialization_class",
    "triton_key",
    "unique",
]

#: Bump when the entry format changes.
FORMAT = 1

#: Bytes per thread of registers a compiled program may store to its stack and still not count as spilling:
#: under Triton 3.6 and 3.7 (and at one launch under 3.9), ptxas parks one to four long-lived registers of some
#: small-shape EP programs there (one ``STL`` and one ``LDL`` each, at 32-128 registers in use); the rung reports
#: every one (``rung3 sweep``) and fails on any local memory (tiles or arrays) and on anything larger.
PARKED_BYTES = 16


# recording


def _kernel_id(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return f"{fn.__module__}:{fn.__name__}"


def _encode(value):
    """A launch argument as JSON: ints, floats, bools, None and strings as they are; a tensor by its dtype and
    its address modulo 16; a host tensor descriptor by its base's, its shape, strides, block shape and padding."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "mod16": value.data_ptr() % 16}
    if type(value).__name__ == "TensorDescriptor":
        return {
            "tensordesc": str(value.base.dtype).removeprefix("torch."),
            "mod16": value.base.data_ptr() % 16,
            "shape": [int(s) for s in value.shape],
            "strides": [int(s) for s in value.strides],
            "block_shape": [int(s) for s in value.block_shape],
            "padding": getattr(value, "padding", "zero"),
        }
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot record a launch argument of type {type(value).__name__}")


def specialization_class(value) -> tuple:
    """What of a recorded argument any Triton version can specialize on: a tensor's dtype and alignment; an int's
    range (i32 / i64 / u64), whether it is 1, whether it is a multiple of 16, whether it is 0; any other value
    itself. Two launches whose every argument falls in the same class compile to the same kernel."""
    if isinstance(value, dict):
        return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in value.items()))
    if isinstance(value, bool) or not isinstance(value, int):
        return ("value", value)
    width = "i32" if -(2**31) <= value < 2**31 else "u64" if value >= 2**63 else "i64"
    return ("int", width, value == 1, value % 16 == 0, value == 0)


@dataclass
class Recorder:
    """An observer of ``epkit.kernels.triton.launch`` that keeps the launches made for CUDA, one entry per
    (kernel, grid rank, keywords, specialization class of every argument); ``label`` says where the current
    launches come from (kept with each entry, up to a few per entry)."""

    label: str = ""
    entries: dict = field(default_factory=dict)

    def __call__(self, made) -> None:
        if made.target != "cuda":
            return
        args = [_encode(a) for a in made.args]
        kwargs = {k: _encode(v) for k, v in made.kwargs.items()}
        kid = _kernel_id(made.kernel)
        key = json.dumps(
            [kid, len(made.grid), sorted(kwargs.items()), [specialization_class(a) for a in args]], default=str
        )
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = {
                "kernel": kid,
                "grid": list(made.grid),
                "args": args,
                "kwargs": kwargs,
                "where": [self.label],
                "count": 1,
            }
        else:
            entry["count"] += 1
            if self.label not in entry["where"] and len(entry["where"]) < 4:
                entry["where"].append(self.label)

    def records(self) -> list[dict]:
        return list(self.entries.values())


@contextlib.contextmanager
def recording(label: str = "") -> Iterator[Recorder]:
    """Record every launch made for CUDA while the block runs (host launchers run their CUDA twin first)."""
    from epkit.kernels.triton.launch import observe

    rec = Recorder(label)
    with observe(rec):
        yield rec


def merge(*lists: list[dict]) -> list[dict]:
    """Entries of several recordings (ranks, runs) with one entry per specialization class."""
    rec = Recorder()
    for entries in lists:
        for e in entries:
            key = json.dumps(
                [
                    e["kernel"],
                    len(e["grid"]),
                    sorted(e["kwargs"].items()),
                    [specialization_class(a) for a in e["args"]],
                ],
                default=str,
            )
            if key in rec.entries:
                old = rec.entries[key]
                old["count"] += e["count"]
                old["where"] = (old["where"] + [w for w in e["where"] if w not in old["where"]])[:4]
            else:
                rec.entries[key] = dict(e)
    return rec.records()


def save(entries: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "entries": entries}, f)


def load(path: str) -> list[dict]:
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: launch records of format {doc.get('format')}, this reader takes {FORMAT}")
    return doc["entries"]


# compiling


class _SM90Driver:
    """The driver Triton's JIT asks while a launch is compiled here: an sm_90 target, device 0, stream 0."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


@contextlib.contextmanager
def sm90_driver() -> Iterator[None]:
    """Triton's active driver answers an sm_90 GPU for the block (no GPU needed to compile)."""
    from triton.runtime.driver import driver

    previous = driver._active
    driver.set_active(_SM90Driver())
    try:
        yield
    finally:
        driver._active = previous


def _decode(value, keep: list):
    import torch

    if not isinstance(value, dict):
        return value
    dtype = getattr(torch, value.get("tensor") or value["tensordesc"])
    raw = torch.empty(64, dtype=torch.uint8)  # the CPU allocator aligns to 64 bytes
    keep.append(raw)
    size = torch.empty((), dtype=dtype).element_size()
    base = raw[value["mod16"] : value["mod16"] + size * 2].view(dtype)
    if "tensor" in value:
        return base
    from triton.tools.tensor_descriptor import TensorDescriptor

    desc = TensorDescriptor(base, list(value["shape"]), list(value["strides"]), list(value["block_shape"]))
    if value.get("padding", "zero") != "zero":
        desc.padding = value["padding"]
    return desc


@dataclass
class CompiledLaunch:
    """One entry compiled: the kernel's name, whether it compiled (``error`` says why not), and what the cubin
    holds: PTX and SASS text, registers per thread, local memory per thread (spilled registers, arrays), the
    stack frame (the IEEE division's slow path is a call), static plus dynamic shared memory per program, warps
    per program."""

    kernel: str
    where: list
    error: str | None = None
    ptx: str = ""
    sass: str = ""
    registers: int | None = None
    local_bytes: int | None = None
    stack_bytes: int | None = None
    shared_bytes: int | None = None
    num_warps: int | None = None
    seconds: float = 0.0

    @property
    def spilled_bytes(self) -> int:
        """Bytes per thread of local memory (arrays, spilled tiles) plus the stack frame when the SASS stores to
        it (``STL``/``LDL``: registers parked there; a frame only a call's return address uses is not counted)."""
        stored = bool(re.search(r"\b(STL|LDL)\b", self.sass))
        return (self.local_bytes or 0) + ((self.stack_bytes or 0) if stored else 0)

    @property
    def spills(self) -> bool:
        """Any local memory, or more than :data:`PARKED_BYTES` of registers stored to the stack."""
        return bool(self.local_bytes) or self.spilled_bytes > PARKED_BYTES

    @property
    def parked(self) -> int:
        """Bytes of registers stored to the stack when that is within :data:`PARKED_BYTES` (else 0)."""
        return 0 if self.spills else self.spilled_bytes

    def ctas_per_sm(self) -> int | None:
        """Programs that fit on one Hopper SM at once (registers: 64 K per SM, in 256-register units per warp;
        shared memory: 227 KiB per program, 228 KiB per SM with 1 KiB reserved per program; 64 warps, 32 programs)."""
        if self.registers is None or self.num_warps is None:
            return None
        per_warp = -(-max(self.registers, 1) * 32 // 256) * 256
        by_regs = (65536 // per_warp) // self.num_warps
        by_smem = 233472 // (self.shared_bytes + 1024) if self.shared_bytes else 32
        return min(by_regs, by_smem, 64 // self.num_warps, 32)

    def summary(self) -> dict:
        return {
            "kernel": self.kernel,
            "where": self.where,
            "error": self.error,
            "registers": self.registers,
            "local_bytes": self.local_bytes,
            "stack_bytes": self.stack_bytes,
            "shared_bytes": self.shared_bytes,
            "num_warps": self.num_warps,
            "spills": self.spills if self.error is None else None,
            "spilled_bytes": self.spilled_bytes if self.error is None else None,
            "ctas_per_sm": self.ctas_per_sm(),
            "seconds": round(self.seconds, 2),
        }


def _resources(cubin: bytes) -> dict:
    """REG / LOCAL / SHARED of the cubin's one function (``cuobjdump --dump-resource-usage``)."""
    from epkit.testing.ladder import cuda_tool

    tool = cuda_tool("cuobjdump")
    if tool is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, timeout=120)
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out.stdout))
    return {k: int(v) for k, v in found.items()}


def _bound(entry: dict):
    """``(kernel, args, kwargs, keep)`` of an entry: its JIT function and the rebuilt arguments (``keep`` holds
    the memory the stand-in tensors view)."""
    module, name = entry["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), name)
    keep: list = []
    args = [_decode(a, keep) for a in entry["args"]]
    kwargs = {k: _decode(v, keep) for k, v in entry["kwargs"].items()}
    return kernel, args, kwargs, keep


def triton_key(entry: dict) -> str:
    """The key this Triton's JIT caches the entry's compiled kernel under (its own binder's specialization of
    the arguments, and the options), with the hash of the kernel's source and what it calls (``cache_key``):
    entries with one key compile to one kernel, and a compile kept under a key (:func:`save_compiled`) is that
    kernel's only while its source is unchanged."""
    kernel, args, kwargs, _keep = _bound(entry)
    with sm90_driver():
        binder = kernel.device_caches[0][-1]
        _, specialization, options = binder(*args, **kwargs)
    opts = sorted(options.items()) if isinstance(options, dict) else options
    return repr((entry["kernel"], getattr(kernel, "cache_key", None), specialization, opts))


class _Captured:
    text = ""


@contextlib.contextmanager
def _stderr_kept() -> Iterator[_Captured]:
    """What is written to file descriptor 2 in the block (MLIR prints a failed pass's diagnostics there, and some
    Triton versions raise with a generic message), kept in ``.text`` and written through afterwards."""
    got = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield got
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            got.text = f.read().decode(errors="replace")
            sys.stderr.write(got.text)


def compile_entry(entry: dict, sass: bool = True) -> CompiledLaunch:
    """Compile one recorded launch for sm_90 as Triton's JIT would for those argument values (its ``warmup``,
    under :func:`sm90_driver`); never raises for a kernel that does not compile (``error`` holds why)."""
    from epkit.testing.ladder import disassemble

    out = CompiledLaunch(entry["kernel"], entry["where"])
    kernel, args, kwargs, _keep = _bound(entry)
    start = time.perf_counter()
    try:
        with sm90_driver(), _stderr_kept() as diagnostics:
            compiled = kernel.warmup(*args, grid=tuple(entry["grid"]), **kwargs)
    except Exception as exc:  # noqa: BLE001 -- the failure is the result
        said = [line for line in diagnostics.text.splitlines() if "error:" in line][:5]
        out.error = "\n".join([f"{type(exc).__name__}: {str(exc).strip()[-1500:]}", *said])
        out.seconds = time.perf_counter() - start
        return out
    out.seconds = time.perf_counter() - start
    asm = compiled.asm
    out.ptx = asm.get("ptx", "")
    cubin = asm.get("cubin")
    if cubin:
        res = _resources(cubin)
        out.registers = res.get("REG")
        out.local_bytes = res.get("LOCAL")
        out.stack_bytes = res.get("STACK")
        out.shared_bytes = int(compiled.metadata.shared) + res.get("SHARED", 0)
        if sass:
            out.sass = disassemble(cubin) or ""
    out.num_warps = int(compiled.metadata.num_warps)
    return out


def unique(entries: list[dict]) -> dict[str, list[dict]]:
    """The entries grouped by :func:`triton_key` (one compile per group), in first-seen order."""
    groups: dict[str, list[dict]] = {}
    for e in entries:
        groups.setdefault(triton_key(e), []).append(e)
    return groups


def compile_all(entries: list[dict], jobs: int = 1, whole: dict | None = None) -> list[dict]:
    """One :func:`compile_entry` summary per group of :func:`unique` (``jobs`` worker processes when more than
    one), with every entry of the group's ``where`` and ``count``; ``whole``, a dict, also gets each compile
    itself (PTX and SASS included) under the group's :func:`triton_key`."""
    groups = unique(entries)
    firsts = [g[0] for g in groups.values()]
    if jobs <= 1:
        done = [compile_entry(e) for e in firsts]
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs) as pool:
            done = list(pool.map(compile_entry, firsts))
    results = []
    for (key, group), compiled in zip(groups.items(), done):
        if whole is not None:
            whole[key] = compiled
        res = compiled.summary()
        res["where"] = [w for e in group for w in e["where"]][:8]
        res["entries"] = len(group)
        results.append(res)
    return results


def save_compiled(compiled: dict[str, CompiledLaunch], path: str) -> None:
    """Compiles kept whole by :func:`triton_key` (``compile_all``'s ``whole``), with the Triton version that made
    them, as gzip'd JSON: ``scripts/test.sh``'s sweep keeps them before pytest, and ``tests/test_as_launched.py``
    checks those very compiles of this environment's Triton instead of compiling them again."""
    import triton

    doc = {"format": FORMAT, "triton": triton.__version__}
    doc["compiled"] = {key: dataclasses.asdict(c) for key, c in compiled.items()}
    with gzip.open(path, "wt", compresslevel=1) as f:
        json.dump(doc, f)


def load_compiled(path: str) -> dict[str, CompiledLaunch]:
    """The compiles :func:`save_compiled` kept, by key; raises unless this Triton made them (a key alone could
    name the same specialization under another version)."""
    import triton

    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    if doc.get("format") != FORMAT or doc.get("triton") != triton.__version__:
        raise ValueError(
            f"{path}: compiles of format {doc.get('format')} under Triton {doc.get('triton')}; "
            f"this reader takes format {FORMAT} under Triton {triton.__version__}"
        )
    return {key: CompiledLaunch(**fields) for key, fields in doc["compiled"].items()}
