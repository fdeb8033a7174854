"""The table ``epkit plan`` prints for a :class:`epkit.plan.Plan` (:func:`epkit.plan.format_plan`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epkit.plan import Plan

__all__ = ["format_plan"]


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f} MB"


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def format_plan(p: Plan) -> str:
    """The human-readable table ``epkit plan`` prints."""
    lay, ex, eb, mem, com = p.layout, p.experts, p.expert_bytes, p.memory, p.communication
    rows = [
        ("model", p.model),
        (
            "layout",
            f"world {lay['world']} = dp {lay['dp']} x cp {lay['cp']} x replica {lay['replica']}; "
            f"ep {lay['ep']}, enp {lay['enp']}",
        ),
        (
            "experts",
            f"logical {ex['logical']} + extra {ex['extra']} = physical {ex['physical']}; "
            f"local {ex['local']} per rank; top-{ex['topk']}; shared {ex['shared']}",
        ),
        (f"bytes per expert ({lay['weight_format']})", _mb(eb["per_expert"])),
        ("expert bytes per rank per layer", _mb(eb["per_rank_per_layer"])),
        (
            "expert bytes read / layer / step",
            f"upper {_mb(eb['read_per_layer_step_upper'])}, expected "
            f"{_mb(eb['read_per_layer_step_expected'])} (uniform routing)",
        ),
        (
            "per-rank memory",
            f"replicated ~{_gb(mem['replicated_bytes_fp8_estimate'])} (FP8, estimate), experts "
            f"{_gb(mem['experts_bytes'])}, engram {_gb(mem['engram_bytes'])}, "
            f"KV {mem['kv_bytes_per_token'] / 1e3:,.1f} KB/token",
        ),
        (
            "dispatch (FP8) / combine (BF16)",
            f"{_mb(com['dispatch_bytes_per_layer'])} + "
            f"{_mb(com['combine_bytes_per_layer'])} = "
            f"{_mb(com['dispatch_combine_bytes_per_layer'])} per layer "
            f"(+{_mb(com['dispatch_scale_bytes_per_layer'])} FP8 scales)",
        ),
        (
            f"time at {lay['link_gbps']:g} GB/s",
            f"{com['dispatch_combine_us_per_layer']:,.0f} us per layer (bandwidth only)",
        ),
        (
            "alpha-beta per step",
            f"TP{com['tp_size_compared']} all-reduce x2/layer: "
            f"{com['tp_all_reduce_us_per_step']:,.0f} us; EP all-to-all: "
            f"{com['ep_all_to_all_us_per_step']:,.0f} us (alpha {lay['alpha_us']:g} us)",
        ),
        (
            "collectives per decode step",
            f"TP+EP {p.ledger['tp_ep']['total']} "
            f"(2x{p.ledger['tp_ep']['attention_all_reduce']} all-reduce + "
            f"{p.ledger['tp_ep']['moe_all_to_all']} all-to-all); DP+Wide-EP "
            f"{p.ledger['dp_wide_ep']['total']} ({p.ledger['dp_wide_ep']['moe_all_to_all']}"
            f" all-to-all + 1 liveness all-reduce)",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
