"""epkit's one logger, ``logging.getLogger("epkit")``: silent unless asked.

Every epkit module logs through a child of it (``logging.getLogger(__name__)``: ``epkit.backends``, ...), so
one setting covers them all. By default the logger holds only a :class:`logging.NullHandler`: nothing is
printed, and an application that configures :mod:`logging` itself receives epkit's records through the root
logger as from any library. ``EPKIT_LOG`` turns printing on at import time:

``EPKIT_LOG=warning``  one line on stderr per problem epkit works around (``epkit._C`` failing to import:
                       the CPU paths that use it fall back to torch)
``EPKIT_LOG=info``     also each op whose backend ``EPKIT_BACKEND`` forces (once per op and device type)
``EPKIT_LOG=debug``    also every backend resolution (op, device type, asked, chosen)
``error`` and ``off`` (the default) are accepted too; the value is not case-sensitive.

:func:`configure` does the same from code (``epkit.log.configure("debug")``).
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LEVELS", "LOGGER_NAME", "configure", "configure_from_env", "logger"]

LOGGER_NAME = "epkit"
#: The values ``EPKIT_LOG`` and :func:`configure` accept, and the level each one prints from.
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": None,
}

logger = logging.getLogger(LOGGER_NAME)


class _EpkitStderrHandler(logging.StreamHandler):
    """The handler :func:`configure` installs (one at a time): ``epkit <level> <module>: message`` on stderr."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("epkit %(levelname)s %(name)s: %(message)s"))


def configure(level: str | None) -> None:
    """Print epkit's records from ``level`` on (a key of :data:`LEVELS`) to stderr; ``"off"`` or None stops.

    Replaces what an earlier call installed, so calling it twice never doubles the lines.
    """
    name = "off" if level is None else str(level).strip().lower()
    if name not in LEVELS:
        raise ValueError(f"log level must be one of {sorted(LEVELS)}, got {level!r}")
    for h in [h for h in logger.handlers if isinstance(h, _EpkitStderrHandler)]:
        logger.removeHandler(h)
    if LEVELS[name] is None:
        logger.setLevel(logging.NOTSET)
        return
    logger.setLevel(LEVELS[name])
    logger.addHandler(_EpkitStderrHandler())


def configure_from_env() -> None:
    """Apply ``EPKIT_LOG`` (unset or empty: ``off``). Runs when ``epkit`` is imported, and again in a rank that
    :func:`epkit.cpu_ranks.run_ranks` forks from a server that had imported epkit, under the rank's environment.

    An unknown value is not fatal to the import: epkit prints warnings and errors and says which values work.
    """
    raw = os.environ.get("EPKIT_LOG", "").strip()
    if not raw:
        configure("off")
        return
    try:
        configure(raw)
    except ValueError:
        configure("warning")
        logger.warning("EPKIT_LOG=%s is not one of %s; printing warnings and errors only", raw, ", ".join(LEVELS))


if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
    logger.addHandler(logging.NullHandler())
configure_from_env()
