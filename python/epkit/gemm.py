"""Moved to :mod:`epkit.grouped_gemm`; this path keeps working for one release (with a DeprecationWarning)."""

from epkit.utils import moved_module

moved_module(__name__, "epkit.grouped_gemm")
