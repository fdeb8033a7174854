"""CPU ranks for tests: :func:`run_ranks` (the library's launcher, :mod:`epkit.cpu_ranks`) and the :func:`ranks`
decorator that runs a test body on N ranks."""

from __future__ import annotations

from epkit.cpu_ranks import DEFAULT_TIMEOUT, RankError, preload, run_ranks

__all__ = ["DEFAULT_TIMEOUT", "RankError", "ranks", "run_ranks"]

# the test modules a rank unpickles import pytest: once in the fork server, not ~0.08 s in every rank of a launch
preload("pytest", "epkit.compat.deep_ep", "epkit.testing")


def ranks(world_size: int, timeout: float | None = None):
    """Decorator: the test body ``fn(rank, world_size)`` runs on ``world_size`` ranks.

    The decorated function must live at module level (it is pickled by name).
    The wrapper takes no arguments; any rank's exception fails it (``RankError``).
    """

    def deco(fn):
        def wrapper():
            run_ranks(_Unwrapped(fn.__module__, fn.__qualname__), world_size, timeout=timeout)

        # Copy the identity but not __wrapped__: pytest must see a test that takes no fixtures.
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(wrapper, attr, getattr(fn, attr))
        wrapper.__wrapped_rank_fn__ = fn
        return wrapper

    return deco


class _Unwrapped:
    """Picklable handle to the original function behind a ``@ranks`` wrapper."""

    def __init__(self, module: str, qualname: str):
        self.module, self.qualname = module, qualname

    def __call__(self, rank, world_size, *args, **kwargs):
        import importlib

        obj = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj.__wrapped_rank_fn__(rank, world_size, *args, **kwargs)
