"""TileLang kernels: one factory per kernel, parameterised by dialect ("cpu" or "cuda").

The CPU dialect compiles with the C target and runs on CPU tensors; the CUDA
dialect runs on GPU tensors and is lowered for sm_90 in CI without a GPU.
"""

import os


def environment_defaults() -> None:
    """TileLang's compile messages off unless the environment says otherwise. Runs at import, and again in a rank that
    :func:`epkit.cpu_ranks.run_ranks` forks from a server that had imported this module, under the rank's
    environment."""
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")


environment_defaults()
