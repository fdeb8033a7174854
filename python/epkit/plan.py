"""``epkit plan``: a deployment calculator for DP attention + Wide-EP.

For a model (a preset or a Hugging Face style ``config.json``) and a layout
(dp/ep/cp/enp), a weight format (default: the model's own, :attr:`ModelConfig.weight_format`),
tokens per rank (default :data:`DEFAULT_TOKENS_PER_RANK`) and link figures, it reports
expert accounting, expert bytes, per-rank memory, dispatch/combine bytes, an
alpha-beta estimate of a TP all-reduce against the EP all-to-all, and the
collective ledger of one decode step.

Formulas (all per rank unless stated):

* bytes per expert ``= 3 * hidden * moe_intermediate * bytes_per_weight`` (gate, up, down);
* expert bytes read per MoE layer per decode step: upper bound ``local * bytes_per_expert``;
  expected under uniform routing over the physical slots
  ``local * (1 - (1 - topk/physical) ** (tokens_per_rank * ep)) * bytes_per_expert``;
* dispatch ``= tokens * topk * hidden`` bytes (FP8 payload), combine ``= tokens * topk * hidden * 2`` (BF16)
  per MoE layer: the upper bound where every (token, expert) pair crosses ranks;
* ring all-reduce ``T = 2(p-1) alpha + 2(p-1)/p * S / beta`` over ``S = tokens * hidden * 2`` bytes;
  direct all-to-all (every peer written at once, as DeepEP does) ``T = alpha + S / beta``.

Attention and dense parameter counts are estimates from the config's MLA
fields (documented in :func:`attention_params`; plain multi-head attention
where the config has no ``kv_lora_rank``); expert numbers are exact.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from epkit._details.plan_text import format_plan
from epkit.topology import resolve_sizes

__all__ = [
    "BYTES_PER_WEIGHT",
    "DEFAULT_TOKENS_PER_RANK",
    "PRESETS",
    "ModelConfig",
    "format_plan",
    "load_model",
    "plan",
]

BYTES_PER_WEIGHT = {"fp4": 0.5, "fp8": 1.0, "bf16": 2.0}
#: Decode tokens per rank per step where the caller names none (``epkit plan --tokens-per-rank``).
DEFAULT_TOKENS_PER_RANK = 128


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a DeepSeek-style MoE config that the calculator needs.

    ``weight_format``: the format the model's expert weights ship in (``fp4``, ``fp8``, ``bf16``; None where a
    config.json's ``quantization_config`` names none of them), the plan's default. ``kv_lora_rank`` 0: plain
    multi-head attention (a key and a value per head, no latent).
    """

    name: str
    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    num_hidden_layers: int
    num_moe_layers: int
    n_shared_experts: int = 1
    intermediate_size: int = 0  # dense-layer MLP width (layers that are not MoE)
    num_attention_heads: int = 128
    head_dim: int = 128  # q/k head dim (nope + rope)
    v_head_dim: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    o_groups: int = 0
    o_lora_rank: int = 0
    vocab_size: int = 129280
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_head_dim: int = 0
    weight_format: str | None = "bf16"


PRESETS = {
    # From the DeepInfer topology write-up (000_*.txt): V4.1-Flash.
    "v4.1-flash": ModelConfig(
        name="v4.1-flash",
        hidden_size=5120,
        moe_intermediate_size=2304,
        n_routed_experts=384,
        num_experts_per_tok=6,
        num_hidden_layers=40,
        num_moe_layers=40,
        n_shared_experts=1,
        num_attention_heads=64,
        head_dim=512,
        v_head_dim=512,
        q_lora_rank=1280,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        o_groups=8,
        o_lora_rank=1024,
        engram_layer_ids=(1, 14),
        engram_num_embeddings=(384006168, 384016682),
        engram_head_dim=256,
        weight_format="fp4",  # the write-up's expert sizes are FP4 (17.7 MB per expert)
    ),
    # DeepSeek-V3 public config.json values.
    "deepseek-v3": ModelConfig(
        name="deepseek-v3",
        hidden_size=7168,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        num_experts_per_tok=8,
        num_hidden_layers=61,
        num_moe_layers=58,
        n_shared_experts=1,
        intermediate_size=18432,
        num_attention_heads=128,
        head_dim=192,
        v_head_dim=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        weight_format="fp8",  # the public checkpoint: e4m3 weights, 128x128 block scales
    ),
}

_HF_REQUIRED = ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "num_hidden_layers")


def _weight_format(cfg: dict) -> str | None:
    """The expert weight format of a config.json: its ``quantization_config`` (``quant_method``, ``quant_algo``,
    ``fmt``) naming FP4 (``mxfp4``, ``nvfp4``) or FP8 (``fp8``, ``e4m3``); without one, the checkpoint's
    unquantized bf16; None for a quantization the plan does not model (the caller must name a format)."""
    q = cfg.get("quantization_config")
    if not q:
        return "bf16"
    if not isinstance(q, dict):
        return None
    words = " ".join(str(q.get(k, "")) for k in ("quant_method", "quant_algo", "fmt")).lower()
    if "fp4" in words:
        return "fp4"
    if "fp8" in words or "e4m3" in words:
        return "fp8"
    return None


def _from_hf(cfg: dict, name: str) -> ModelConfig:
    if not isinstance(cfg, dict):
        raise ValueError(f"config {name}: expected a JSON object, got {type(cfg).__name__}")
    missing = [k for k in _HF_REQUIRED if k not in cfg]
    if missing:
        raise ValueError(
            f"config {name}: missing required field(s) {missing}; expected a DeepSeek-style "
            f"MoE config.json with {list(_HF_REQUIRED)}"
        )
    for k in _HF_REQUIRED:
        if not isinstance(cfg[k], int) or cfg[k] < 1:
            raise ValueError(f"config {name}: {k} must be a positive integer, got {cfg[k]!r}")
    layers = cfg["num_hidden_layers"]
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    freq = int(cfg.get("moe_layer_freq", 1)) or 1
    moe_layers = len([i for i in range(first_dense, layers) if i % freq == 0])
    qk_nope = cfg.get("qk_nope_head_dim")
    rope = int(cfg.get("qk_rope_head_dim", 64))
    head_dim = int(cfg.get("head_dim") or ((qk_nope + rope) if qk_nope else 128))
    return ModelConfig(
        name=name,
        hidden_size=cfg["hidden_size"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        n_routed_experts=cfg["n_routed_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"],
        num_hidden_layers=layers,
        num_moe_layers=moe_layers,
        n_shared_experts=int(cfg.get("n_shared_experts", 0)),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        num_attention_heads=int(cfg.get("num_attention_heads", 128)),
        head_dim=head_dim,
        v_head_dim=int(cfg.get("v_head_dim", head_dim)),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
        qk_rope_head_dim=rope,
        o_groups=int(cfg.get("o_groups", 0)),
        o_lora_rank=int(cfg.get("o_lora_rank", 0)),
        vocab_size=int(cfg.get("vocab_size", 129280)),
        engram_layer_ids=tuple(cfg.get("engram_layer_ids", ())),
        engram_num_embeddings=tuple(cfg.get("engram_num_embeddings", ())),
        engram_head_dim=int(cfg.get("engram_head_dim", 0)),
        weight_format=_weight_format(cfg),
    )


def load_model(model: str) -> ModelConfig:
    """A preset name (``v4.1-flash``, ``deepseek-v3``) or a path to a Hugging Face style config.json."""
    if model in PRESETS:
        return PRESETS[model]
    if model.endswith(".json"):
        try:
            with open(model) as f:
                cfg = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"config file {model!r} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"config file {model!r} is not valid JSON: {exc}") from None
        return _from_hf(cfg, model)
    raise ValueError(f"unknown model {model!r}: expected one of {sorted(PRESETS)} or a path to a config.json")


def attention_params(m: ModelConfig) -> int:
    """Estimated attention parameters of one layer (MLA-style projections).

    ``q: hidden*q_lora + q_lora*heads*head_dim`` (or ``hidden*heads*head_dim`` without q_lora);
    ``kv: hidden*(kv_lora + rope) + kv_lora*heads*(head_dim - rope + v_head_dim)``;
    ``out: heads*v_head_dim*hidden``, or with output groups
    ``o_groups*o_lora*heads*v_head_dim/o_groups... = heads*v_head_dim*o_lora + o_groups*o_lora*hidden``.
    Without ``kv_lora_rank`` (plain multi-head attention): ``kv: hidden*heads*(head_dim + v_head_dim)``.
    """
    h, heads = m.hidden_size, m.num_attention_heads
    q = h * m.q_lora_rank + m.q_lora_rank * heads * m.head_dim if m.q_lora_rank else h * heads * m.head_dim
    if m.kv_lora_rank:
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * heads * (
            m.head_dim - m.qk_rope_head_dim + m.v_head_dim
        )
    else:
        kv = h * heads * (m.head_dim + m.v_head_dim)
    if m.o_groups and m.o_lora_rank:
        out = heads * m.v_head_dim * m.o_lora_rank + m.o_groups * m.o_lora_rank * h
    else:
        out = heads * m.v_head_dim * h
    return q + kv + out


def _allreduce_us(p: int, nbytes: float, alpha_us: float, gbps: float) -> float:
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * alpha_us + 2 * (p - 1) / p * nbytes / (gbps * 1e9) * 1e6


def _alltoall_us(p: int, nbytes: float, alpha_us: float, gbps: float) -> float:
    if p <= 1:
        return 0.0
    return alpha_us + nbytes / (gbps * 1e9) * 1e6


@dataclass
class Plan:
    model: str
    layout: dict
    experts: dict
    expert_bytes: dict
    memory: dict
    communication: dict
    ledger: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def plan(
    model: str | ModelConfig,
    dp: int,
    ep: int | None = None,
    cp: int = 1,
    enp: int | None = None,
    weight_format: str | None = None,
    tokens_per_rank: int = DEFAULT_TOKENS_PER_RANK,
    min_num_extra_experts: int = 1,
    link_gbps: float = 450.0,
    alpha_us: float = 10.0,
    tp: int | None = None,
    kv_bytes_per_element: float = 1.0,
) -> Plan:
    """Compute a deployment plan (see the module docstring for every formula).

    Parameters
    ----------
    model : str or ModelConfig
        A preset name, a config.json path, or a ModelConfig.
    dp, ep, cp, enp : int
        Parallel sizes (ep defaults to the world size, enp to dp*cp).
    weight_format : {"fp4", "fp8", "bf16"}, optional
        Expert weight format (default: the model's own, ``ModelConfig.weight_format``: fp4 for v4.1-flash, fp8
        for deepseek-v3, a config.json's ``quantization_config``).
    tokens_per_rank : int
        Decode tokens per rank per step (default :data:`DEFAULT_TOKENS_PER_RANK`, 128).
    min_num_extra_experts : int
        Lower bound on redundant experts (padded up to make physical divisible by ep).
    link_gbps, alpha_us : float
        Link bandwidth (GB/s) and per-message latency (us) of the alpha-beta model.
    tp : int, optional
        Tensor-parallel degree for the TP comparison (default: 8, one node, capped at the world size).
    kv_bytes_per_element : float
        KV cache element size (default 1: FP8 KV).
    """
    m = load_model(model) if isinstance(model, str) else model
    if weight_format is None:
        weight_format = m.weight_format
        if weight_format is None:
            raise ValueError(
                f"{m.name}: its quantization_config names none of {sorted(BYTES_PER_WEIGHT)}; give the expert "
                "weight format (--weight-format)"
            )
    _check_plan_args(weight_format, tokens_per_rank, link_gbps, tp, alpha_us)
    sizes = resolve_sizes(dp, cp, ep, enp)
    experts, expert_bytes = _experts(m, sizes["ep"], weight_format, tokens_per_rank, min_num_extra_experts)
    return Plan(
        model=m.name,
        layout={
            **sizes,
            "weight_format": weight_format,
            "tokens_per_rank": tokens_per_rank,
            "link_gbps": link_gbps,
            "alpha_us": alpha_us,
        },
        experts=experts,
        expert_bytes=expert_bytes,
        memory=_memory(m, sizes, expert_bytes["per_rank_per_layer"], kv_bytes_per_element),
        communication=_communication(m, sizes, tokens_per_rank, tp, link_gbps, alpha_us),
        ledger=_ledger(m),
    )


def _check_plan_args(weight_format: str, tokens_per_rank, link_gbps, tp, alpha_us) -> None:
    """ValueError for an unknown weight format or a non-positive size, bandwidth, TP degree or latency."""
    if weight_format not in BYTES_PER_WEIGHT:
        raise ValueError(f"weight_format must be one of {sorted(BYTES_PER_WEIGHT)}, got {weight_format!r}")
    for name, v in (("tokens_per_rank", tokens_per_rank), ("link_gbps", link_gbps)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if alpha_us < 0:
        raise ValueError(f"alpha_us must be >= 0, got {alpha_us!r}")


def _experts(m: ModelConfig, ep_size: int, weight_format: str, tokens_per_rank: int, min_extra: int):
    """The plan's ``experts`` (accounting) and ``expert_bytes`` (bytes held and read per layer) sections."""
    from epkit.experts import resolve_num_extra_experts

    if ep_size > m.n_routed_experts:
        raise ValueError(
            f"ep_size {ep_size} is larger than the {m.n_routed_experts} routed experts of {m.name}: "
            f"some ranks would hold only redundant copies"
        )
    extra = resolve_num_extra_experts(m.n_routed_experts, ep_size, min_extra)
    physical = m.n_routed_experts + extra
    local = physical // ep_size
    per_expert = 3 * m.hidden_size * m.moe_intermediate_size * BYTES_PER_WEIGHT[weight_format]
    p_active = 1 - (1 - m.num_experts_per_tok / physical) ** (tokens_per_rank * ep_size)
    upper = local * per_expert
    experts = {
        "logical": m.n_routed_experts,
        "extra": extra,
        "physical": physical,
        "local": local,
        "shared": m.n_shared_experts,
        "topk": m.num_experts_per_tok,
    }
    expert_bytes = {
        "per_expert": per_expert,
        "per_rank_per_layer": upper,
        "read_per_layer_step_upper": upper,
        "read_per_layer_step_expected": local * p_active * per_expert,
        "p_expert_active_uniform": p_active,
    }
    return experts, expert_bytes


def _memory(m: ModelConfig, sizes: dict, experts_per_layer: float, kv_bytes_per_element: float) -> dict:
    """The plan's ``memory`` section: replicated weights (estimate), experts, Engram rows, KV per token."""
    attn = attention_params(m) * m.num_hidden_layers
    dense_layers = m.num_hidden_layers - m.num_moe_layers
    dense_mlp = 3 * m.hidden_size * m.intermediate_size * dense_layers
    shared = 3 * m.hidden_size * m.moe_intermediate_size * m.n_shared_experts * m.num_moe_layers
    embed = 2 * m.vocab_size * m.hidden_size
    replicated_bytes = (attn + dense_mlp + shared + embed) * 1.0  # FP8 weights for the replicated part
    experts_rank_bytes = experts_per_layer * m.num_moe_layers
    # MLA caches the latent and the rope key; plain multi-head attention each head's key and value
    mha = m.num_attention_heads * (m.head_dim + m.v_head_dim)
    kv_per_layer = m.kv_lora_rank + m.qk_rope_head_dim if m.kv_lora_rank else mha
    engram_rows = sum(m.engram_num_embeddings)
    engram_rank_bytes = 0.0
    if engram_rows:
        align = math.lcm(256, sizes["enp"])
        padded = -(-engram_rows // align) * align
        engram_rank_bytes = padded // sizes["enp"] * m.engram_head_dim * 2.0  # bf16 rows
    return {
        "replicated_params_estimate": attn + dense_mlp + shared + embed,
        "replicated_bytes_fp8_estimate": replicated_bytes,
        "experts_bytes": experts_rank_bytes,
        "kv_bytes_per_token": kv_per_layer * m.num_hidden_layers * kv_bytes_per_element,
        "engram_bytes": engram_rank_bytes,
        "total_weights_bytes": replicated_bytes + experts_rank_bytes + engram_rank_bytes,
    }


def _communication(m: ModelConfig, sizes: dict, tokens_per_rank: int, tp, link_gbps: float, alpha_us: float) -> dict:
    """The plan's ``communication`` section: dispatch/combine bytes and the alpha-beta TP vs EP comparison."""
    ep_size = sizes["ep"]
    dispatch = tokens_per_rank * m.num_experts_per_tok * m.hidden_size * 1
    dispatch_scales = tokens_per_rank * m.num_experts_per_tok * (m.hidden_size // 128) * 4
    combine = tokens_per_rank * m.num_experts_per_tok * m.hidden_size * 2
    tp_size = tp or min(8, sizes["world"])
    ar_bytes = tokens_per_rank * m.hidden_size * 2
    tp_ar_us = _allreduce_us(tp_size, ar_bytes, alpha_us, link_gbps)
    a2a_us = _alltoall_us(ep_size, dispatch, alpha_us, link_gbps) + _alltoall_us(ep_size, combine, alpha_us, link_gbps)
    return {
        "dispatch_bytes_per_layer": dispatch,
        "dispatch_scale_bytes_per_layer": dispatch_scales,
        "combine_bytes_per_layer": combine,
        "dispatch_combine_bytes_per_layer": dispatch + combine,
        "dispatch_combine_us_per_layer": (dispatch + combine) / (link_gbps * 1e9) * 1e6,
        "ep_all_to_all_us_per_layer_alpha_beta": a2a_us,
        "tp_all_reduce_us_alpha_beta": tp_ar_us,
        "tp_size_compared": tp_size,
        "tp_all_reduce_us_per_step": tp_ar_us * 2 * m.num_hidden_layers,
        "ep_all_to_all_us_per_step": a2a_us * m.num_moe_layers,
    }


def _ledger(m: ModelConfig) -> dict:
    """Collectives of one decode step under TP+EP and under DP attention + Wide-EP."""
    L, M = m.num_hidden_layers, m.num_moe_layers
    return {
        "tp_ep": {
            "attention_all_reduce": L,
            "mlp_all_reduce": L,
            "moe_all_to_all": 2 * M,
            "dp_liveness": 0,
            "total": 2 * L + 2 * M,
        },
        "dp_wide_ep": {
            "attention_all_reduce": 0,
            "mlp_all_reduce": 0,
            "moe_all_to_all": 2 * M,
            "dp_liveness": 1,
            "total": 2 * M + 1,
        },
    }
