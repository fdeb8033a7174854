"""``python -m epkit.model``: the old name of ``epkit run`` (:func:`epkit.model.run.main`), kept as an alias;
``--world N`` is ``--ranks N``."""

from __future__ import annotations

from epkit.model.run import end_process
from epkit.model.run import main as run_main

__all__ = ["main"]


def main(argv=None) -> int:
    """``epkit run`` under the name ``python -m epkit.model``."""
    return run_main(argv, prog="python -m epkit.model")


if __name__ == "__main__":
    raise SystemExit(end_process(main()))
