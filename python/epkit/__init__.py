"""epkit: kernels and collectives for DP attention + wide expert parallelism.

The op table (every op takes ``backend="auto"``; see ``epkit.backends``):

Layout and gathers
    gather_rows          out[i] = x[index[i]], zero rows at -1

Everything else (topology, experts, CP, Engram, GEMM, dispatch/combine) lands
family by family; ``epkit info`` lists what this machine can run.
"""

from epkit import backends
from epkit.backends import BackendUnavailableError, registered_ops
from epkit.gather import gather_rows

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "backends",
    "BackendUnavailableError",
    "registered_ops",
    # layout and gathers
    "gather_rows",
]
