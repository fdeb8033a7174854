"""Emulated hosts for tests: :mod:`epkit.emulated_hosts` (the library's, which ``epkit bench`` uses) and
:func:`requires_namespaces`, which skips a test where they cannot run."""

from __future__ import annotations

from epkit.emulated_hosts import SUBNET, namespaces_unavailable, run_hosts, set_link

__all__ = ["SUBNET", "namespaces_unavailable", "requires_namespaces", "run_hosts", "set_link"]


def requires_namespaces(test):
    """Decorator: skip ``test`` where emulated hosts cannot run, saying why (:func:`namespaces_unavailable`)."""
    import pytest

    why = namespaces_unavailable()
    return pytest.mark.skipif(why is not None, reason=f"emulated hosts unavailable: {why}")(test)
