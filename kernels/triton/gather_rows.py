"""Moved to :mod:`epkit.kernels.triton.gather`; kept for one release (with a DeprecationWarning)."""

from epkit.utils import moved_module

moved_module(__name__, "epkit.kernels.triton.gather")
