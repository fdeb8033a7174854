"""Triton kernels. Each module holds one op family's kernels and a launcher.

FP fusion (mul+add -> fma) is off by default here, so arithmetic kernels round
like their CPU references; set TRITON_DEFAULT_FP_FUSION=1 to opt back in.
"""

import os


def environment_defaults() -> None:
    """FP fusion off unless the environment says otherwise. Runs at import, and again in a rank that
    :func:`epkit.cpu_ranks.run_ranks` forks from a server that had imported this module, under the rank's
    environment."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")


environment_defaults()
