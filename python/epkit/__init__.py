"""epkit: kernels and collectives for DP attention + wide expert parallelism.

The op table (every op takes ``backend="auto"``; see ``epkit.backends``):

Layout and gathers
    gather_rows          out[i] = x[index[i]], zero rows at -1

Context parallelism
    prepare_cp_mirror    zigzag CP indices: mirror index, reverse index, ks/ke per compression ratio
    to_mirror / from_mirror                          rows into / out of the mirror layout
    collectives.cp.CPGroup                           async CP all-gather, driver broadcasts

Engram
    engram_hash          n-gram hash -> table rows (public demo ABI): XOR of id*multiplier, mod prime, + offset
    engram.hash_tokens / engram.hash_params / engram.EngramLayer

Topology and experts (control plane)
    topology.rank_groups / topology.ParallelGroups   DP/CP/EP/ENP groups
    resolve_num_extra_experts, ExpertPlacement       logical / extra / physical / local experts
    logical_to_physical  logical expert ids -> physical replica ids (own rank first, else round-robin)
    eplb.rebalance_experts                           EPLB placement from per-expert load
    lockstep             has_unfinished, PrefillVote, LockstepDriver, placeholder_batch
    plan.plan            deployment calculator (also ``epkit plan``)

Everything else (topology, experts, CP, Engram, GEMM, dispatch/combine) lands
family by family; ``epkit info`` lists what this machine can run.
"""

from epkit import backends, eplb, lockstep, topology
from epkit.backends import BackendUnavailableError, registered_ops
from epkit.cp import CPMirror, from_mirror, prepare_cp_mirror, to_mirror
from epkit.engram import EngramConfig, EngramLayer, engram_hash, hash_params, hash_tokens
from epkit.experts import ExpertPlacement, logical_to_physical, resolve_num_extra_experts
from epkit.gather import gather_rows

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "backends",
    "BackendUnavailableError",
    "registered_ops",
    # layout and gathers
    "gather_rows",
    # context parallelism
    "CPMirror",
    "prepare_cp_mirror",
    "to_mirror",
    "from_mirror",
    # engram
    "EngramConfig",
    "EngramLayer",
    "engram_hash",
    "hash_params",
    "hash_tokens",
    # topology and experts
    "topology",
    "lockstep",
    "eplb",
    "ExpertPlacement",
    "logical_to_physical",
    "resolve_num_extra_experts",
]
