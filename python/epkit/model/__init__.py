"""A thin reference model: a DeepSeek-style MoE decoder run as DP attention + Wide-EP on epkit's ops.

It exists to prove the whole chain end to end, on CPU ranks as on GPUs, not to be fast. One
forward on every DP rank (each rank holds its own sequences; the EP group spans all ranks)::

    tokens -> Engram: hash_tokens -> ShardedEngramTable.fetch (started before layer 0; inside a host it reads
              the owners' shards one-sided, across hosts it is an all_to_all)
           -> embedding -> per layer:
        an Engram layer (``engram_layer_ids``): the fetched rows through EngramLayer, added to the stream
        RMSNorm -> attention over this rank's own sequences (no communication; KV cache per sequence)
        RMSNorm -> dense SwiGLU MLP (the first ``n_dense_layers``), or the MoE layer:
            replicated gate: sigmoid (or softmax) scores + correction bias, group-limited top-k
            -> logical_to_physical (redundant replicas; a replica on the token's own rank first)
            -> prefill "normal": dispatch (FP8, expand) -> expert_mlp (contiguous) -> combine
                                 (+ the shared expert as combine's bias)
               prefill "fused":  fused_moe (MegaMoE-style; bit for bit the "normal" result)
               decode "low_latency": low_latency_dispatch (FP8) -> expert_mlp (masked)
                                 -> low_latency_combine, + the shared expert
    -> RMSNorm -> LM head -> the last token's logits of every sequence.

:func:`generate` is the engine loop around it: :class:`epkit.lockstep.LockstepDriver` (one
all-reduce per step: liveness and the prefill vote), placeholder steps for idle ranks so every
rank enters every dispatch/combine, greedy decoding. :meth:`DPEPModel.rebalance` feeds the tokens
each expert received to :func:`epkit.eplb.rebalance_experts` and moves the experts.

:func:`forward_reference` is the specification: the same model in one process, float64, a plain
per-expert loop over every DP rank's sequences, with the parallel model's quantisation points
(bf16 MoE input, FP8 weights and activations) simulated, and the Engram tables whole.

Context parallelism (the source engine ships it disabled) runs the prefill only: with ``cp_size > 1`` an
engine's prompts are sharded zigzag over its CP ranks (:mod:`~epkit.model.cp_prefill`), and decode continues from the
gathered KV, each sequence on one CP rank. Two-batch overlap (``DPEPModel(tbo=True)``, :mod:`~epkit.model.tbo`)
splits each decode step into two micro-batches whose low-latency dispatch / combine overlap the other's
compute, bit for bit the step without it. Matrix products pad their rows (:func:`~epkit.model.layers.linear`),
so a row's bits do not depend on how many rows share the step.

Run ``epkit run`` for the experiment on CPU ranks (:mod:`~epkit.model.run`).

The package's modules, each importing only those above it: :mod:`~epkit.model.args` (sizes,
weights), :mod:`~epkit.model.layers` (the step batch, the dense building blocks, the gate),
:mod:`~epkit.model.cp_prefill` and :mod:`~epkit.model.tbo` (the CP prefill, the overlapped decode step),
:mod:`~epkit.model.model` (:class:`DPEPModel`), :mod:`~epkit.model.engine` (:func:`generate`),
:mod:`~epkit.model.reference` (:func:`forward_reference`), :mod:`~epkit.model.profile` (step timer, collective
ledger) and :mod:`~epkit.model.run` (the command).
"""

from epkit.model.args import ModelArgs, init_weights
from epkit.model.args import engram_config as engram_config  # reachable as epkit.model.engram_config, not in __all__
from epkit.model.engine import generate
from epkit.model.layers import Batch
from epkit.model.model import DPEPModel
from epkit.model.reference import forward_reference

__all__ = ["ModelArgs", "Batch", "init_weights", "DPEPModel", "generate", "forward_reference"]
