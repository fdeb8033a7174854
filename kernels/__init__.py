"""Kernel sources of epkit: ``epkit.kernels.triton`` and ``epkit.kernels.tilelang``.

Modules here import their framework at import time; public ops import them
lazily, only once the backend has been selected, so ``import epkit`` needs
neither framework.
"""
