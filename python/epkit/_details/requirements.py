"""Whether torch is importable here, and the one line that says how to get it when it is not.

epkit installs without torch (torch is a peer dependency: an engine brings its own build), so the package and
its command line must load without it: ``epkit --version`` and ``--help`` work, everything else says this.
The supported range is read from the installed distribution's metadata (the ``cpu`` extra's torch
requirement in ``pyproject.toml``), so it is written in one place.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

__all__ = ["torch_missing", "torch_needed"]

#: Where a CPU-only torch comes from (the public index's Linux wheels are CUDA builds).
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def torch_missing() -> bool:
    """True when ``import torch`` cannot find torch (checked without importing it)."""
    return importlib.util.find_spec("torch") is None


def _torch_range() -> str:
    try:
        requires = importlib.metadata.requires("epkit") or []
    except importlib.metadata.PackageNotFoundError:
        return ""
    for req in requires:
        name, _, rest = req.partition(";")
        if name.strip().startswith("torch") and "cpu" in rest:
            return name.strip()[len("torch") :].strip()
    return ""


def torch_needed() -> str:
    """One line: torch is needed, which versions, and the two ways to get it."""
    spec = _torch_range()
    which = f"torch{spec}" if spec else "torch"
    return (
        f"epkit needs {which}, and torch is not installed here: install epkit beside your engine's torch, or "
        f"`pip install torch` (CUDA) / `pip install torch --index-url {CPU_TORCH_INDEX}` (CPU only)"
    )
