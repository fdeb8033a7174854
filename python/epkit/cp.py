"""Moved to :mod:`epkit.cp_mirror`; this path keeps working for one release (with a DeprecationWarning)."""

from epkit.utils import moved_module

moved_module(__name__, "epkit.cp_mirror")
