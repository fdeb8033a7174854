"""Moved to :mod:`epkit.kernels.tilelang.engram`; kept for one release (with a DeprecationWarning)."""

from epkit.utils import moved_module

moved_module(__name__, "epkit.kernels.tilelang.engram")
