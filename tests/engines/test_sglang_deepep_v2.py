"""SGLang's DeepEP V2 token dispatcher (``sglang.srt.layers.moe.token_dispatcher.deepep_v2.DeepEPv2Dispatcher``,
SGLang 0.5.23, on ``deep_ep.ElasticBuffer``), its installed module unmodified, with ``deep_ep`` bound to
``epkit.compat.deep_ep``, on 2 and 4 CPU ranks, against the plain-torch all-to-all of ``moe_reference``.

Each rank routes its tokens through the dispatcher, plays SGLang's DeepGEMM runner in plain torch (the stand-in
experts of ``moe_reference``, on the layout the dispatcher returned: expanded rows weighted before combine as
``post_permute_deep_gemm_to_deepep_v2`` does, or per-token sums of the local routes with the weights handed to
combine), combines, and compares with the reference bit for bit. Modes: decode (masked, expanded,
``do_cpu_sync=False``), prefill expanded (the default without UE8M0 scales) and prefill not expanded
(``SGLANG_DEEPEP_V2_ENABLE_PREFILL_EXPAND=0``); each with ``use_fp8_dispatch`` False and then True (SGLang's
per-128 FP8 cast before the dispatch, rows and float32 scales on the wire: row-major in the expanded modes,
column-major TMA-aligned in the unexpanded prefill, as SGLang asks for on Hopper; the change rebuilds SGLang's
process-wide buffer), two forwards each. With the data of ``moe_reference`` (integers in [-2, 2]) the FP8 cast is
exact, so FP8 results equal the bf16 reference bit for bit too. A rank with no tokens; a perturbed combine must
fail.

Engine-side patches (applied in each rank's process, none in SGLang's or epkit's files):

- ``deep_ep`` is ``epkit.compat.deep_ep`` (``engine_harness.bind_deep_ep``).
- ``torchvision`` is an empty stand-in (``engine_harness.stand_in_torchvision``): ``sglang.srt.configs`` imports it
  and the index's torchvision cannot load beside CPU torch.
- SGLang's published config is ``get_context().override_server_args()`` (its own test hook) and the forward's
  extend flag is ``set_is_extend_in_batch``: what its scheduler sets before a forward.
- ``token_dispatcher.deepep_v2.sglang_per_token_group_quant_fp8`` (the FP8 cast before the dispatch) is
  ``engine_harness.quantize_fp8_groups``: on CPU SGLang's helper launches its CUDA/Triton kernel; the stand-in is
  the same per-128-column cast in torch (scale ``amax / 448``), into the scale layout SGLang asks for (row-major,
  or column-major TMA-aligned). UE8M0 scales (Blackwell) are not covered.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from engine_harness import (
    bind_deep_ep,
    dequantize_fp8_groups,
    perturb_combine,
    require,
    sglang_group_quant,
    stand_in_torchvision,
)
from moe_reference import assert_same, expert_scale, reference_moe, routing

from epkit.testing.multiprocess import RankError, run_ranks

require("sglang")

HIDDEN, TOPK, EXPERTS_PER_RANK, MAX_TOKENS = 256, 4, 4, 64


def _expert_stage(out, num_local: int, rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SGLang's runner in plain torch: the combine input ``(hidden_states, topk_weights)`` for a dispatch output."""
    rows = out.hidden_states.float()
    if out.hidden_states_scale is not None:  # FP8 dispatch: what the FP8 GEMM reads
        rows = dequantize_fp8_groups(out.hidden_states, out.hidden_states_scale)
    if out.is_expanded:
        # expert j's rows are [align(psum[j - 1]), psum[j]) (DeepGEMM's psum layout); padding rows are zero
        psum = out.psum_num_recv_tokens_per_expert.long()
        expert = torch.full((rows.shape[0],), -1, dtype=torch.long)
        start = 0
        for j in range(num_local):
            expert[start : int(psum[j])] = j
            start = -(-int(psum[j]) // out.expert_alignment) * out.expert_alignment
        scale = torch.where(expert >= 0, expert_scale(expert + rank * num_local), 0.0)
        rows = torch.where((expert >= 0).unsqueeze(1), rows, 0.0)  # padding rows: whatever bytes they hold
        return (rows * (scale * out.topk_weights.float()).unsqueeze(1)).to(torch.bfloat16), None
    local = out.topk_ids
    scale = torch.where(local >= 0, expert_scale(local + rank * num_local) * out.topk_weights.float(), 0.0)
    return (rows * scale.sum(1, keepdim=True)).to(torch.bfloat16), out.topk_weights


def _run(rank: int, world: int, mode: str, empty_rank: int | None, perturb: bool, dtypes=("bf16", "fp8")) -> str:
    stand_in_torchvision()
    bind_deep_ep()
    os.environ["SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(MAX_TOKENS)
    if mode == "prefill-unexpanded":
        os.environ["SGLANG_DEEPEP_V2_ENABLE_PREFILL_EXPAND"] = "0"
    import sglang.srt.layers.moe.token_dispatcher.deepep_v2 as deepep_v2
    from sglang.srt.layers.dp_attention import set_is_extend_in_batch
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.runtime_context import get_context

    deepep_v2.sglang_per_token_group_quant_fp8 = sglang_group_quant
    if perturb:
        perturb_combine()

    get_context().override_server_args().install()
    set_is_extend_in_batch(mode != "decode")
    num_experts = EXPERTS_PER_RANK * world
    for dtype in dtypes:  # a new use_fp8_dispatch: SGLang rebuilds its process-wide ElasticBuffer
        dispatcher = deepep_v2.DeepEPv2Dispatcher(
            group=dist.group.WORLD,
            router_topk=TOPK,
            num_experts=num_experts,
            num_local_experts=EXPERTS_PER_RANK,
            hidden_size=HIDDEN,
            params_dtype=torch.bfloat16,
            use_fp8_dispatch=dtype == "fp8",
        )
        for step in range(2):  # a second forward reuses the buffer
            tokens = 0 if rank == empty_rank else 5 + 7 * rank + step
            x, ids, weights = routing(rank, tokens, HIDDEN, num_experts, TOPK, seed=step)
            out = dispatcher.dispatch(x, StandardTopKOutput(weights, ids, torch.empty(tokens, num_experts)))
            assert (out.hidden_states_scale is not None) == (dtype == "fp8"), dtype
            hidden, combine_weights = _expert_stage(out, EXPERTS_PER_RANK, rank)
            got = dispatcher.combine(deepep_v2.DeepEPv2CombineInput(hidden, combine_weights))
            assert_same(got, reference_moe(x, ids, weights, num_experts), f"rank {rank} {mode} {dtype} step {step}")
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["decode", "prefill-expanded", "prefill-unexpanded"])
def test_matches_torch(world, mode):
    assert run_ranks(_run, world, mode, None, False, timeout=240) == ["ok"] * world


@pytest.mark.parametrize("mode", ["decode", "prefill-expanded", "prefill-unexpanded"])
def test_a_rank_with_no_tokens(mode):
    assert run_ranks(_run, 2, mode, 1, False, timeout=240) == ["ok"] * 2


@pytest.mark.parametrize("mode", ["decode", "prefill-unexpanded"])
def test_a_perturbed_combine_fails(mode):
    """Negative control: the shim's combine output scaled by 1.01 (a bf16 ulp is 2^-8 relative, so 1.001 would
    mostly round away) makes the comparison fail."""
    with pytest.raises(RankError, match="differs from the torch reference"):
        run_ranks(_run, 2, mode, None, True, ("bf16",), timeout=240)
