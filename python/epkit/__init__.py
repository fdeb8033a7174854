"""epkit: kernels and collectives for DP attention + wide expert parallelism.

The op table (every op takes ``backend="auto"``; see ``epkit.backends``):

Layout and gathers
    gather_rows          out[i] = x[index[i]], zero rows at -1

Context parallelism
    prepare_cp_mirror    zigzag CP indices: mirror index, reverse index, ks/ke per compression ratio
    to_mirror / from_mirror                          rows into / out of the mirror layout
    collectives.cp_group.CPGroup                     async CP all-gather, driver broadcasts

Engram
    engram_hash          n-gram hash -> table rows (public demo ABI): XOR of id*multiplier, mod prime, + offset
    engram.hash_tokens / engram.hash_params / engram_layer.EngramLayer

Quantization, grouped GEMM, expert MLP (DeepGEMM-compatible semantics)
    quant                per_token_group_cast_to_fp8, per_block_cast_to_fp8, cast_to_mxfp4, cast_to_nvfp4
    m_grouped_{fp8,fp8_fp4,bf16}_gemm_nt_{contiguous,masked}
    get_mk_alignment_for_contiguous_layout, build_m_indices
    expert_mlp           gate/up GEMM -> SwiGLU -> FP8 -> down GEMM, contiguous or masked layout

Collectives (symmetric memory, dispatch/combine; transports shm / torch, and nvshmem for SymmBuffer on GPUs)
    SymmBuffer           one buffer per rank, peer views, 64-bit signals, barriers, exchanges
    EPBuffer             DeepEP-style get_dispatch_layout / dispatch / combine / low_latency_*
    fused_moe            MegaMoE-style dispatch -> expert MLP -> combine in one call (shm domain, no staging)
    ShardedEngramTable   ENP-sharded Engram rows with prefetched fetch() -> hook()
    PeerFailedError      (a TimeoutError) a peer gave up on the buffer and said so: raised without waiting

Reference model (the ops assembled into the DP attention + Wide-EP forward)
    model.DPEPModel / model.generate / model.forward_reference   (``epkit run``)

Topology and experts (control plane)
    topology.rank_groups / topology.ParallelGroups   DP/CP/EP/ENP groups
    resolve_num_extra_experts, ExpertPlacement       logical / extra / physical / local experts
    logical_to_physical  logical expert ids -> physical replica ids (own rank first, else round-robin)
    eplb.rebalance_experts                           EPLB placement from per-expert load
    lockstep             has_unfinished, PrefillVote, LockstepDriver, placeholder_batch
    plan.plan            deployment calculator (also ``epkit plan``)

Custom ops and drop-in interfaces
    ops                  the ops above as torch.ops.epkit.* (torch.compile and CUDA graphs hold them)
    compat.deep_ep / compat.deep_gemm / compat.eplb   DeepEP's, DeepGEMM's, DeepSeek EPLB's interfaces (import them)

``epkit info`` lists what this machine can run. ``EPKIT_LOG=info|debug`` prints what epkit decides on
stderr (``epkit.log``; silent by default).
"""

__version__ = "0.1.0"

from epkit._details.requirements import torch_missing, torch_needed

if torch_missing():
    # torch is a peer dependency: without it only ``__version__`` and the command line's --version and --help
    # load; any other name says what to install.
    __all__ = ["__version__"]

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ModuleNotFoundError(f"epkit.{name}: {torch_needed()}", name="torch")

else:
    from epkit import backends, eplb, grouped_gemm, lockstep, log, ops, quant, topology
    from epkit.backends import BackendUnavailableError, registered_ops
    from epkit.collectives.engram_table import ShardedEngramTable
    from epkit.collectives.ep_buffer import EPBuffer
    from epkit.collectives.fused_moe import fused_moe
    from epkit.collectives.symm_buffer import PeerFailedError, SymmBuffer
    from epkit.cp_mirror import CPMirror, from_mirror, prepare_cp_mirror, to_mirror
    from epkit.engram import EngramConfig, engram_hash, hash_params, hash_tokens
    from epkit.engram_layer import EngramLayer
    from epkit.experts import ExpertPlacement, logical_to_physical, resolve_num_extra_experts
    from epkit.gather import gather_rows
    from epkit.grouped_gemm import build_m_indices, get_mk_alignment_for_contiguous_layout
    from epkit.moe import expert_mlp

    # The six grouped GEMMs (m_grouped_{fp8,fp8_fp4,bf16}_gemm_nt_{contiguous,masked}) are bound from
    # epkit.grouped_gemm.GROUPED_OPS, the one list of their names (it also makes that module's __all__ and op
    # table), rather than named in an import list here (a second copy of that list) or star-imported (which
    # would also bring that module's other exports, grouped_gemm_reference, make_inputs and GROUPED_OPS, to the
    # top level). Every other name stays a static import.
    globals().update((op, getattr(grouped_gemm, op)) for op, _, _ in grouped_gemm.GROUPED_OPS)

    def __getattr__(name: str):
        # the reference model loads on first use (``epkit.model``): it is most of ``import epkit``'s time (~0.2 s),
        # which every rank process of a user's (or epkit's) tests would pay
        if name == "model":
            import importlib

            return importlib.import_module("epkit.model")
        raise AttributeError(f"module 'epkit' has no attribute {name!r}")

    __all__ = [
        "__version__",
        "backends",
        "log",
        "ops",
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
        # quantization, grouped GEMM, expert MLP
        "quant",
        *(op for op, _, _ in grouped_gemm.GROUPED_OPS),
        "get_mk_alignment_for_contiguous_layout",
        "build_m_indices",
        "expert_mlp",
        # collectives
        "SymmBuffer",
        "PeerFailedError",
        "EPBuffer",
        "fused_moe",
        "ShardedEngramTable",
        # topology and experts
        "topology",
        "lockstep",
        "model",
        "eplb",
        "ExpertPlacement",
        "logical_to_physical",
        "resolve_num_extra_experts",
    ]
