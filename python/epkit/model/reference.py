"""The reference model's specification: :func:`forward_reference`, the same model in one process,
float64, a plain per-expert loop over every DP rank's sequences, with the parallel model's
quantisation points (bf16 MoE input, FP8 weights and activations) simulated, and the Engram tables
whole."""

from __future__ import annotations

import torch

from epkit.engram import hash_tokens
from epkit.model.args import ModelArgs, dequantize_experts, engram_config, engram_layer, init_weights, quantize_experts
from epkit.model.layers import Batch, attention, check_batch, rms_norm, route, swiglu_mlp
from epkit.quant import dequant_per_token_group_fp8, per_token_group_cast_to_fp8

__all__ = ["forward_reference"]


def _fake_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """Activations through the grouped GEMM's FP8 format (per token, per 128), back to x's dtype."""
    q, s = per_token_group_cast_to_fp8(x.float())
    return dequant_per_token_group_fp8(q, s).to(x.dtype)


def _moe_reference(args: ModelArgs, w: dict, experts: dict, p: str, x: torch.Tensor, idx=None) -> torch.Tensor:
    idx, weights = route(args, x, w[p + "gate"], w[p + "gate_bias"], idx)
    xe = x.to(torch.bfloat16).to(x.dtype)
    if args.expert_format != "bf16":  # FP8 and FP4 experts both take FP8 activations
        xe = _fake_fp8_rows(xe)
    w13, w2 = experts[p + "experts_w13"], experts[p + "experts_w2"]
    out = torch.zeros_like(x)
    for e in range(args.n_routed_experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if not tok.numel():
            continue
        gate, up = (xe[tok] @ w13[e].T).chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        act = _fake_fp8_rows(act) if args.expert_format != "bf16" else _bf16(act)  # expert_mlp's intermediate
        y = _bf16(act @ w2[e].T)  # expert_mlp's output rows are bf16
        out[tok] += weights[tok, slot].to(x.dtype)[:, None] * y  # a token picks an expert at most once
    if args.n_shared_experts:
        out = out + _bf16(swiglu_mlp(x, w[p + "shared_w13"], w[p + "shared_w2"]))
    return _bf16(out)  # combine returns bf16


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


@torch.no_grad()
def forward_reference(
    args: ModelArgs,
    sequences: list[list[int]],
    weights: dict | None = None,
    dtype: torch.dtype = torch.float64,
    routing: list | None = None,
) -> list[torch.Tensor]:
    """The specification: every sequence (all DP ranks') through the model in one process.

    Plain torch in ``dtype`` (default float64), a per-expert loop, no parallelism, the Engram
    tables whole (rows from ``table[hash_tokens(...)]``), each sequence in one pass. The expert
    weights are the parallel model's (FP8 block-quantized, or bf16), and the activations take the
    same quantisation points: the MoE input, each expert's output rows, the shared expert's output
    and the MoE layer's output through bf16 and, for FP8 experts, the expert inputs and the SwiGLU
    output through per-token FP8. Sums stay in ``dtype`` (the parallel model rounds partial sums
    and accumulates in float32: the two differ by rounding only).

    ``routing`` (optional, one entry per sequence: a list over MoE layers of ``[len(seq), K]``
    logical expert ids, e.g. gathered from :attr:`DPEPModel.last_routing`) replays the parallel
    model's gate choices. Top-k is discontinuous: where two experts' scores nearly tie, rounding
    alone can pick the other one, and replaying the choice keeps such a token comparable.

    Returns
    -------
    list of Tensor [len(seq), vocab_size] in ``dtype``: the logits at every position.
    """
    weights = init_weights(args) if weights is None else weights
    w, experts = {}, {}
    engram = {i: engram_layer(args, weights, i, dtype) for i in args.engram_layer_ids}
    for name, t in weights.items():
        if ".experts_" in name:
            experts[name] = dequantize_experts(quantize_experts(t, args.expert_format), args.expert_format).to(dtype)
        else:
            w[name] = t.to(dtype)
    if routing is not None and len(routing) != len(sequences):
        raise ValueError(f"routing must have one entry per sequence ({len(sequences)}), got {len(routing)}")
    outs = []
    for si, seq in enumerate(sequences):
        batch = Batch.prefill([seq], [None])
        check_batch(args, batch)
        x = w["embed"][batch.token_ids]
        if engram:
            rows = hash_tokens(batch.token_ids.to(torch.int32), batch.cu_seqlens, engram_config(args)).long()
        for i in range(args.n_layers):
            p = f"layers.{i}."
            if i in engram:
                table = w[p + "engram_table"]
                li = args.engram_layer_ids.index(i)
                x = x + engram[i](x, embeddings=table[rows[li]], cu_seqlens=batch.cu_seqlens)
            x = x + attention(args, w, p, rms_norm(x, w[p + "attn_norm"], args.norm_eps), batch, None, i)
            h = rms_norm(x, w[p + "ffn_norm"], args.norm_eps)
            x = x + (
                swiglu_mlp(h, w[p + "w13"], w[p + "w2"])
                if i < args.n_dense_layers
                else _moe_reference(
                    args, w, experts, p, h, None if routing is None else routing[si][i - args.n_dense_layers]
                )
            )
        outs.append(rms_norm(x, w["norm"], args.norm_eps) @ w["head"].T)
    return outs
