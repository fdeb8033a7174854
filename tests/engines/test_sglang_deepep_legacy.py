"""SGLang's legacy DeepEP token dispatcher (``sglang.srt.layers.moe.token_dispatcher.deepep.DeepEPDispatcher``,
SGLang 0.5.23, on ``deep_ep.Buffer``), its installed module unmodified, with ``deep_ep`` bound to
``epkit.compat.deep_ep``, on 2 and 4 CPU ranks, against the plain-torch all-to-all of ``moe_reference``.

Each rank builds the dispatcher as SGLang's ``create_moe_dispatcher`` does (``permute_fusion=True``,
``async_finish=True``, ``return_recv_hook=True``; its buffer from SGLang's own ``DeepEPBuffer``), routes its
tokens through it, plays SGLang's DeepGEMM runner in plain torch (the stand-in experts of ``moe_reference``:
normal mode, the local routes of each received token weighted and summed as its ``ep_gather`` does, the
per-expert counts checked as aligned to 128; low-latency mode, each expert's rows, ``masked_m`` checked against
every rank's routing, the combine weighing), combines, and compares with the reference bit for bit.
Modes (SGLang's ``--deepep-mode``): ``normal``, ``low_latency`` and ``auto`` (its forwards alternate extend and
decode, so one buffer serves both modes, switching back and forth); each with the dispatch output dtype (the
dispatcher's ``set_quant_config``, as a quantization method sets it) ``bf16`` and then ``fp8`` (normal mode:
SGLang's per-128 FP8 cast before the dispatch, the rows travel as ``(e4m3, scales)``; low-latency: DeepEP's (the
shim's) cast in the dispatch), two forwards each. With the data of ``moe_reference`` (integers in [-2, 2]) the FP8
cast is exact, so FP8 results equal the bf16 reference bit for bit too. Also a rank with no tokens (auto mode:
both paths); a perturbed combine must fail, in normal and in low-latency mode.

Engine-side patches (applied in each rank's process, none in SGLang's or epkit's files):

- ``deep_ep`` is ``epkit.compat.deep_ep`` (``engine_harness.bind_deep_ep``).
- ``torchvision`` is an empty stand-in (``engine_harness.stand_in_torchvision``): ``sglang.srt.configs`` imports it
  and the index's torchvision cannot load beside CPU torch.
- SGLang's published config is ``get_context().override_server_args()`` (its own test hook) and the forward's
  extend flag is ``set_is_extend_in_batch``: what its scheduler sets before a forward.
- ``deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM`` is True, as on an SM90 GPU with DeepGEMM (``DEEPGEMM_SCALE_UE8M0``
  and ``DEEPGEMM_BLACKWELL`` stay False: Hopper's float32 row-major scales): the normal mode's combine has no
  other runner on NVIDIA (``combine_a`` raises ``NotImplementedError`` otherwise: "triton runner ... temporarily
  disabled"), and it makes the normal dispatch ask for ``expert_alignment=128`` and cast to FP8 first.
- ``token_dispatcher.deepep.sglang_per_token_group_quant_fp8`` (that cast) is ``engine_harness.quantize_fp8_groups``:
  on CPU SGLang's helper launches its CUDA/Triton kernel; the stand-in is the same per-128-column cast in torch
  (scale ``amax / 448``) into the layout SGLang asks for (here row-major float32).
- ``torch.cuda.get_device_properties("cuda")`` answers an H100's ``multi_processor_count`` (132):
  ``DeepEPBuffer.get_deepep_buffer`` reads it, only to warn when DeepEP gets fewer than half the SMs.

Not covered: two-batch overlap (``MaybeTboDeepEPDispatcher`` with TBO on) and single-batch overlap's combine
arguments (``set_overlap_args``: CUDA streams and signals), NVFP4 / MXFP dispatch, UE8M0 scales (Blackwell).
"""

from __future__ import annotations

import os
import types

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
from moe_reference import assert_same, expert_scale, local_expert_counts, reference_moe, routing

from epkit.testing.multiprocess import RankError, run_ranks

require("sglang")

HIDDEN, TOPK, EXPERTS_PER_RANK, MAX_TOKENS = 256, 4, 4, 32


def _device_properties(get):
    def properties(device=None):
        if device == "cuda" and not torch.cuda.is_available():
            return types.SimpleNamespace(multi_processor_count=132)
        return get(device)

    return properties


def _normal_expert_stage(out, rank: int) -> torch.Tensor:
    """SGLang's DeepGEMM runner on a normal dispatch: each received row through its local routes, weighted, summed."""
    rows = out.hidden_states
    values = dequantize_fp8_groups(rows, out.hidden_states_scale) if out.hidden_states_scale is not None else rows
    local = out.topk_ids
    scale = torch.where(local >= 0, expert_scale(local + rank * EXPERTS_PER_RANK) * out.topk_weights.float(), 0.0)
    counts = torch.bincount(local[local >= 0], minlength=EXPERTS_PER_RANK)
    aligned = [-(-int(c) // 128) * 128 for c in counts]  # expert_alignment=128 (DeepGEMM's)
    assert out.num_recv_tokens_per_expert == aligned, (out.num_recv_tokens_per_expert, aligned)
    return (values.float() * scale.sum(1, keepdim=True)).to(torch.bfloat16)


def _low_latency_expert_stage(out, rank: int, counts: torch.Tensor) -> torch.Tensor:
    """SGLang's DeepGEMM masked runner on a low-latency dispatch: expert ``e``'s rows times its scale."""
    rows = out.hidden_states
    values = dequantize_fp8_groups(rows, out.hidden_states_scale) if out.hidden_states_scale is not None else rows
    assert out.masked_m.tolist() == counts.tolist(), (out.masked_m, counts)
    scale = expert_scale(torch.arange(EXPERTS_PER_RANK) + rank * EXPERTS_PER_RANK)
    return (values.float() * scale.view(-1, 1, 1)).to(torch.bfloat16)


def _run(rank: int, world: int, mode: str, empty_rank: int | None, perturb: bool) -> str:
    stand_in_torchvision()
    bind_deep_ep()
    os.environ["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(MAX_TOKENS)
    import sglang.srt.layers.deep_gemm_wrapper as deep_gemm_wrapper
    import sglang.srt.layers.moe.token_dispatcher.deepep as deepep
    from sglang.srt.layers.dp_attention import set_is_extend_in_batch
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe.utils import DeepEPMode
    from sglang.srt.runtime_context import get_context

    deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True
    deepep.sglang_per_token_group_quant_fp8 = sglang_group_quant
    torch.cuda.get_device_properties = _device_properties(torch.cuda.get_device_properties)
    if perturb:
        perturb_combine()

    get_context().override_server_args().install()
    num_experts = EXPERTS_PER_RANK * world
    dispatcher = deepep.DeepEPDispatcher(
        group=dist.group.WORLD,
        router_topk=TOPK,
        permute_fusion=True,
        num_experts=num_experts,
        num_local_experts=EXPERTS_PER_RANK,
        hidden_size=HIDDEN,
        params_dtype=torch.bfloat16,
        deepep_mode=DeepEPMode(mode),
        async_finish=True,
        return_recv_hook=True,
    )
    for dtype in ("bf16", "fp8"):
        dispatcher.set_quant_config({"dispatcher_output_dtype": dtype})
        for step in range(2):  # auto: extend (normal), then decode (low latency), on the same buffer
            extend = mode == "normal" or (mode == "auto" and step == 0)
            set_is_extend_in_batch(extend)
            tokens = [0 if r == empty_rank else 5 + 7 * r + step for r in range(world)]
            x, ids, weights = routing(rank, tokens[rank], HIDDEN, num_experts, TOPK, seed=step)
            out = dispatcher.dispatch(x, StandardTopKOutput(weights, ids, torch.empty(tokens[rank], num_experts)))
            assert (out.hidden_states_scale is not None) == (dtype == "fp8"), type(out).__name__
            if extend:
                combine_input = deepep.DeepEPNormalCombineInput(_normal_expert_stage(out, rank), ids, weights)
            else:
                counts = local_expert_counts(rank, tokens, HIDDEN, num_experts, TOPK, seed=step)
                hidden = _low_latency_expert_stage(out, rank, counts)
                combine_input = deepep.DeepEPLLCombineInput(hidden, ids, weights)
            got = dispatcher.combine(combine_input)
            what = f"rank {rank} {mode} {dtype} {'normal' if extend else 'low-latency'} step {step}"
            assert_same(got, reference_moe(x, ids, weights, num_experts), what)
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["normal", "low_latency", "auto"])
def test_matches_torch(world, mode):
    assert run_ranks(_run, world, mode, None, False, timeout=300) == ["ok"] * world


def test_a_rank_with_no_tokens():
    assert run_ranks(_run, 2, "auto", 1, False, timeout=300) == ["ok"] * 2


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_a_perturbed_combine_fails(mode):
    """Negative control: the shim's combine output scaled by 1.01 (1.001 would mostly round away in bf16)."""
    with pytest.raises(RankError, match="differs from the torch reference"):
        run_ranks(_run, 2, mode, None, True, timeout=300)
