"""pytest markers for the rungs that need hardware or optional frameworks."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

_skip_without_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (rung 4 of the verification ladder); this machine has none",
)


def requires_cuda(test):
    """Decorator for a rung-4 test: marked ``gpu`` (``pytest -m gpu`` selects exactly these, as
    ``bench/gpu_run.sh`` does on a GPU machine), and skipped with the reason where torch sees no CUDA device."""
    return pytest.mark.gpu(_skip_without_cuda(test))


requires_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit) on PATH")


def _missing(mod: str) -> bool:
    return importlib.util.find_spec(mod) is None


requires_triton = pytest.mark.skipif(_missing("triton"), reason="needs triton: pip install 'epkit[kernels]'")
requires_tilelang = pytest.mark.skipif(_missing("tilelang"), reason="needs tilelang: pip install 'epkit[tilelang]'")
