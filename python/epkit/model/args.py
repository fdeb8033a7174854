"""The reference model's sizes and weights: :class:`ModelArgs`, :func:`init_weights`, and what the
parallel model and the reference both build from them (the Engram layers, the quantized experts)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from epkit.engram import EngramConfig
from epkit.engram_layer import EngramLayer
from epkit.plan import ModelConfig
from epkit.quant import cast_to_mxfp4, dequant_mxfp4, dequant_per_block_fp8, per_block_cast_to_fp8

__all__ = [
    "EXPERT_FORMATS",
    "ModelArgs",
    "dequantize_experts",
    "engram_config",
    "engram_layer",
    "init_weights",
    "quantize_experts",
]

#: Expert weight formats the model runs (``ModelArgs.expert_format``).
EXPERT_FORMATS = ("fp8", "fp4", "bf16")


@dataclass(frozen=True)
class ModelArgs:
    """Sizes of the model (small defaults: a CPU test runs it in seconds).

    ``dim`` and ``moe_inter_dim`` are multiples of 128 (the FP8 groups); ``n_routed_experts`` is
    divisible by ``n_expert_groups``, of which the gate keeps the best ``n_limited_groups``.
    ``expert_format``: ``"fp8"`` (e4m3 weights, 128x128 block scales, FP8 dispatch), ``"fp4"`` (MXFP4
    weights: e2m1 codes with an e8m0 scale per 32, through the FP8 x FP4 grouped GEMM, FP8 dispatch) or
    ``"bf16"``.
    """

    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 3
    n_dense_layers: int = 1
    n_heads: int = 4
    head_dim: int = 32
    inter_dim: int = 512
    moe_inter_dim: int = 128
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    n_activated_experts: int = 4
    n_expert_groups: int = 4
    n_limited_groups: int = 2
    score_func: str = "sigmoid"
    route_scale: float = 2.5
    expert_format: str = "fp8"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = (1,)
    engram_max_ngram: int = 3
    engram_heads_per_ngram: int = 2
    engram_embed_per_ngram: int = 64
    engram_table_size: int = 1009
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "inter_dim", "moe_inter_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not 0 <= self.n_dense_layers < self.n_layers:
            raise ValueError(f"n_dense_layers must be in [0, n_layers={self.n_layers}), got {self.n_dense_layers}")
        if self.dim % 128 or self.moe_inter_dim % 128:
            raise ValueError(f"dim ({self.dim}) and moe_inter_dim ({self.moe_inter_dim}) must be multiples of 128")
        if self.n_expert_groups < 1 or self.n_routed_experts % self.n_expert_groups:
            raise ValueError(
                f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_expert_groups "
                f"({self.n_expert_groups})"
            )
        per_group = self.n_routed_experts // self.n_expert_groups
        if not 1 <= self.n_limited_groups <= self.n_expert_groups:
            raise ValueError(f"n_limited_groups must be in [1, {self.n_expert_groups}], got {self.n_limited_groups}")
        if not 1 <= self.n_activated_experts <= self.n_limited_groups * per_group:
            raise ValueError(
                f"n_activated_experts ({self.n_activated_experts}) must be in [1, {self.n_limited_groups * per_group}]"
                f" (the experts of n_limited_groups={self.n_limited_groups} groups)"
            )
        if self.n_expert_groups > 1 and per_group < 2:
            raise ValueError("group-limited routing scores a group by its best two experts: >= 2 per group")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"score_func must be 'sigmoid' or 'softmax', got {self.score_func!r}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {self.expert_format!r}")
        ids = tuple(self.engram_layer_ids)
        if len(set(ids)) != len(ids) or any(not 0 <= i < self.n_layers for i in ids):
            raise ValueError(f"engram_layer_ids must be distinct layers in [0, {self.n_layers}), got {ids}")
        object.__setattr__(self, "engram_layer_ids", tuple(sorted(ids)))
        if ids:
            engram_config(self)  # EngramConfig checks the Engram sizes

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    def model_config(self, name: str = "tiny") -> ModelConfig:
        """This model as :func:`epkit.plan.plan` takes it: the :class:`epkit.plan.ModelConfig` view of these
        sizes (plain multi-head attention: no query or key-value latent, no separate rope dims; the dense
        layers' MLP width; each Engram layer's table rows), named ``name`` (``tiny``: what ``epkit run
        --dry-run --preset tiny`` plans). The plan's config is derived from the args, never written apart."""
        rows, head_dim = [], 0
        for i in self.engram_layer_ids:
            layer = EngramLayer(engram_config(self), i, self.dim, with_table=False, device="meta")
            rows.append(layer.num_rows)
            head_dim = layer.config.head_dim
        return ModelConfig(
            name=name, hidden_size=self.dim, moe_intermediate_size=self.moe_inter_dim,
            n_routed_experts=self.n_routed_experts, num_experts_per_tok=self.n_activated_experts,
            num_hidden_layers=self.n_layers, num_moe_layers=self.n_moe_layers, n_shared_experts=self.n_shared_experts,
            intermediate_size=self.inter_dim, num_attention_heads=self.n_heads, head_dim=self.head_dim,
            v_head_dim=self.head_dim, q_lora_rank=0, kv_lora_rank=0, qk_rope_head_dim=0, vocab_size=self.vocab_size,
            engram_layer_ids=self.engram_layer_ids, engram_num_embeddings=tuple(rows), engram_head_dim=head_dim,
            weight_format=self.expert_format,
        )  # fmt: skip


def engram_config(args: ModelArgs) -> EngramConfig:
    """The :class:`epkit.EngramConfig` of the model's Engram layers (hashes of the raw token ids)."""
    return EngramConfig(
        vocab_size=args.vocab_size,
        max_ngram_size=args.engram_max_ngram,
        n_head_per_ngram=args.engram_heads_per_ngram,
        n_embed_per_ngram=args.engram_embed_per_ngram,
        layer_ids=args.engram_layer_ids,
        pad_id=min(2, args.vocab_size - 1),
        seed=args.seed,
        ngram_vocab_sizes=(args.engram_table_size,) * (args.engram_max_ngram - 1),
    )


def engram_layer(args: ModelArgs, w: dict, i: int, dtype: torch.dtype, device=None) -> EngramLayer:
    """Layer ``i``'s EngramLayer (no table: rows come from the sharded table) with the weights of ``w``."""
    device = torch.device("cpu") if device is None else torch.device(device)
    layer = torch.nn.utils.skip_init(
        EngramLayer, engram_config(args), i, args.dim, with_table=False, device=device, dtype=dtype
    )
    p = f"layers.{i}.engram."
    layer.load_state_dict({n: w[p + n].to(device=device, dtype=dtype) for n, _ in layer.named_parameters()})
    return layer


def init_weights(args: ModelArgs) -> dict[str, torch.Tensor]:
    """Every parameter, float32 on the CPU, from ``args.seed`` (equal on every rank, as in the textbook).

    Keys: ``embed [V, D]``, ``norm [D]``, ``head [V, D]``, and per layer ``i`` under ``layers.{i}.``:
    ``attn_norm``, ``ffn_norm [D]``, ``wq``, ``wk``, ``wv [H*hd, D]``, ``wo [D, H*hd]``; an Engram
    layer's ``engram.<parameter>`` (:class:`epkit.EngramLayer`'s) and ``engram_table [rows, head_dim]``
    (bf16 values); a dense layer
    ``w13 [2*inter, D]`` (gate rows first), ``w2 [D, inter]``; a MoE layer ``gate [E, D]``,
    ``gate_bias [E]``, ``shared_w13 [2*Is, D]``, ``shared_w2 [D, Is]`` (``Is = n_shared * moe_inter``),
    ``experts_w13 [E, 2*I, D]``, ``experts_w2 [E, D, I]``.
    """
    g = torch.Generator().manual_seed(args.seed)
    d, hd = args.dim, args.n_heads * args.head_dim

    def lin(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    def norm():
        return 1 + 0.1 * torch.randn(d, generator=g)

    w = {"embed": torch.randn(args.vocab_size, d, generator=g), "norm": norm(), "head": lin(args.vocab_size, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        w[p + "attn_norm"], w[p + "ffn_norm"] = norm(), norm()
        if i in args.engram_layer_ids:
            shape = EngramLayer(engram_config(args), i, d, with_table=False, device="meta")
            for name, t in shape.named_parameters():
                if name.endswith("norm.weight"):
                    v = 1 + 0.1 * torch.randn(t.shape, generator=g)
                elif name.endswith(".bias"):
                    v = 0.02 * torch.randn(t.shape, generator=g)
                elif name == "conv.weight":
                    v = 0.3 * torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
                else:
                    v = torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
                w[p + "engram." + name] = v
            # the table's rows are bf16 values (the table is stored in bf16)
            rows = torch.randn(shape.num_rows, shape.config.head_dim, generator=g)
            w[p + "engram_table"] = rows.to(torch.bfloat16).float()
        w[p + "wq"], w[p + "wk"], w[p + "wv"], w[p + "wo"] = lin(hd, d), lin(hd, d), lin(hd, d), lin(d, hd)
        if i < args.n_dense_layers:
            w[p + "w13"], w[p + "w2"] = lin(2 * args.inter_dim, d), lin(d, args.inter_dim)
            continue
        e, inter, shared = args.n_routed_experts, args.moe_inter_dim, args.n_shared_experts * args.moe_inter_dim
        w[p + "gate"], w[p + "gate_bias"] = lin(e, d), 0.1 * torch.randn(e, generator=g)
        if shared:
            w[p + "shared_w13"], w[p + "shared_w2"] = lin(2 * shared, d), lin(d, shared)
        w[p + "experts_w13"], w[p + "experts_w2"] = lin(e, 2 * inter, d), lin(e, d, inter)
    return w


def quantize_experts(w: torch.Tensor, fmt: str):
    """Expert weights as the grouped GEMM takes them: ``(e4m3, 128x128 block scales)`` for ``"fp8"``,
    ``(packed e2m1 codes, e8m0 scales per 32 along K)`` for ``"fp4"``, else bf16."""
    if fmt == "fp8":
        return per_block_cast_to_fp8(w)
    if fmt == "fp4":
        return cast_to_mxfp4(w)
    return w.to(torch.bfloat16)


def dequantize_experts(q, fmt: str) -> torch.Tensor:
    """The float32 values of :func:`quantize_experts`' output (what the reference multiplies by)."""
    if fmt == "fp8":
        return dequant_per_block_fp8(*q)
    if fmt == "fp4":
        return dequant_mxfp4(*q)
    return q.float()
