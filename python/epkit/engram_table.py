"""Moved to :mod:`epkit.collectives.engram_table`; kept for one release (with a DeprecationWarning)."""

from epkit.utils import moved_module

moved_module(__name__, "epkit.collectives.engram_table")
