"""``epkit.compat.deep_ep`` replays the DeepEP call sequences of vLLM (its DeepEP high-throughput and low-latency
all2all managers and prepare/finalize classes) and SGLang (its DeepEP dispatcher, normal and low-latency,
async events and receive hooks) on 2 and 4 CPU ranks, with their argument names, order and unpacking, and is
checked against epkit's textbook exchange (``epkit.collectives.ep_reference``) bit for bit. DeepEP's
interface facts (signatures, layouts, refusals) are checked too.
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib

import pytest
import torch
import torch.distributed as dist

import epkit.compat.deep_ep as deep_ep
from epkit.collectives.ep_reference import (
    reference_combine,
    reference_dispatch,
    reference_low_latency_combine,
    reference_low_latency_dispatch,
)
from epkit.compat._details.deep_ep_config import epbuffer_bytes
from epkit.quant import cast_groups_to_fp8, per_token_group_cast_to_fp8
from epkit.testing.multiprocess import run_ranks

HIDDEN, TOPK, MAX_TOKENS = 512, 4, 16


def _routing(rank: int, world: int, num_experts: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(100 * seed + rank)
    scores = torch.rand(tokens, num_experts, generator=g)
    topk_weights, topk_idx = scores.softmax(-1).topk(TOPK)
    topk_idx[torch.rand(tokens, TOPK, generator=g) < 0.1] = -1  # some slots choose no expert
    x = (torch.randn(tokens, HIDDEN, generator=g) * (1 + rank)).bfloat16()
    return x, topk_idx.to(deep_ep.topk_idx_t), topk_weights


def _expert(rows: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A stand-in expert MLP: each received row times sum_k w_k * (1 + local expert id), in float32 -> bf16."""
    scale = torch.where(local_ids >= 0, weights.float() * (1 + local_ids.float()), 0).sum(-1, keepdim=True)
    return (rows.float() * scale).bfloat16()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    )
    assert torch.equal(_bytes(a), _bytes(b)), what


def _vllm_high_throughput(rank: int, world: int, num_experts: int, fp8: bool) -> None:
    # DeepEPHTAll2AllManager._make_all2all_kwargs + DeepEPHTPrepareAndFinalize._do_dispatch / finalize
    buffer = deep_ep.Buffer(
        group=dist.group.WORLD, num_nvl_bytes=1 << 24, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1
    )
    tokens, rank_topk_ids, rank_topk_weights = _routing(rank, world, num_experts, 3 + 4 * rank, seed=1)
    token_data = per_token_group_cast_to_fp8(tokens) if fp8 else tokens
    (num_tokens_per_rank, num_tokens_per_rdma_rank, expert_num_tokens, is_token_in_rank, event) = (
        buffer.get_dispatch_layout(
            topk_idx=rank_topk_ids,
            num_experts=num_experts,
            previous_event=None,
            async_finish=False,
            allocate_on_comm_stream=False,
        )
    )
    (token_data, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list, handle, event) = (
        buffer.dispatch(
            x=token_data,
            handle=None,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=expert_num_tokens,
            topk_idx=rank_topk_ids,
            topk_weights=rank_topk_weights,
            expert_alignment=1,
            config=deep_ep.Buffer.get_dispatch_config(world),
            previous_event=None,
            async_finish=False,
            allocate_on_comm_stream=False,
        )
    )
    x_in = per_token_group_cast_to_fp8(tokens) if fp8 else (tokens, None)
    ref = reference_dispatch(x_in[0], rank_topk_ids, rank_topk_weights, num_experts, x_scales=x_in[1])
    expert_x, expert_x_scale = token_data if fp8 else (token_data, None)
    _same(expert_x, ref["recv_x"], "recv_x")
    if fp8:
        _same(expert_x_scale, ref["recv_scales"], "recv_x scales")
    _same(expert_topk_ids, ref["recv_topk_idx"], "recv_topk_idx")
    _same(expert_topk_weights, torch.where(ref["recv_topk_idx"] >= 0, ref["recv_topk_weights"], 0), "recv weights")
    assert expert_num_tokens_per_expert_list == ref["num_recv_tokens_per_expert"]
    rows = expert_x.float() * (expert_x_scale.repeat_interleave(128, -1) if fp8 else 1)
    fused_expert_output = _expert(rows, expert_topk_ids, expert_topk_weights)
    combined_x, _, event = buffer.combine(
        x=fused_expert_output,
        handle=handle,
        topk_weights=None,
        config=deep_ep.Buffer.get_combine_config(world),
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    )
    _same(combined_x, reference_combine(fused_expert_output, ref, tokens.shape[0]), "combined_x")


def _vllm_low_latency(rank: int, world: int, num_experts: int, use_fp8_dispatch: bool) -> None:
    # DeepEPLLAll2AllManager._make_all2all_kwargs + DeepEPLLPrepareAndFinalize.prepare / finalize
    max_num_tokens_per_dp_rank = MAX_TOKENS
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=max_num_tokens_per_dp_rank,
        hidden=HIDDEN,
        num_ranks=world,
        num_experts=num_experts,
    )
    buffer = deep_ep.Buffer(
        group=dist.group.WORLD,
        num_nvl_bytes=1 << 20,
        num_rdma_bytes=num_rdma_bytes,
        low_latency_mode=True,
        num_qps_per_rank=num_experts // world,
        allow_nvlink_for_low_latency_mode=True,
        allow_mnnvl=False,
    )
    a1, topk_ids, topk_weights = _routing(rank, world, num_experts, 2 + 3 * rank, seed=2)
    expert_x, expert_num_tokens, handle, event, hook = buffer.low_latency_dispatch(
        a1, topk_ids, max_num_tokens_per_dp_rank, num_experts, use_fp8=use_fp8_dispatch, async_finish=False,
        return_recv_hook=False,
    )  # fmt: skip
    assert hook is None
    ref = reference_low_latency_dispatch(a1, topk_ids, MAX_TOKENS, num_experts, use_fp8=use_fp8_dispatch)
    assert expert_num_tokens.tolist() == ref["counts"]
    x, scales = expert_x if use_fp8_dispatch else (expert_x, None)
    local, slots = num_experts // world, MAX_TOKENS * world
    assert x.shape == (local, slots, HIDDEN)
    if use_fp8_dispatch:  # DeepEP's layout: [L, N * W, H / 128] float32, column-major in the last two dims
        assert scales.shape == (local, slots, HIDDEN // 128) and scales.stride()[1:] == (1, slots)
    y = torch.zeros(local, slots, HIDDEN, dtype=torch.bfloat16)
    for e in range(local):
        n = ref["counts"][e]
        _same(x[e, :n], ref["recv_x"][e], f"expert {e} rows")
        if use_fp8_dispatch:
            _same(scales[e, :n], ref["recv_scales"][e], f"expert {e} scales")
            rows = x[e, :n].float() * scales[e, :n].repeat_interleave(128, -1)
        else:
            rows = x[e, :n].float()
        y[e, :n] = (rows * (e + 1)).bfloat16()
    output = torch.empty(a1.shape, dtype=torch.bfloat16)
    _, event, hook = buffer.low_latency_combine(
        y, topk_ids, topk_weights, handle, async_finish=False, zero_copy=False, return_recv_hook=False, out=output
    )
    want = reference_low_latency_combine([y[e, : ref["counts"][e]] for e in range(local)], topk_ids, topk_weights, ref)
    _same(output, want, "low-latency combine")
    # the byte count is what the EPBuffer allocated (its symmetric buffer; on CPU no kernel area, and on shm its
    # result slots besides), and the size hint, which assumes a top-k of 8, covers this call's top-k of 4
    made = buffer._session.made[-1]
    slots = made.result_slots.nbytes if made.result_slots is not None else 0
    assert epbuffer_bytes(HIDDEN, num_experts, world, MAX_TOKENS, TOPK, MAX_TOKENS) + slots == made.buffer.local.numel()
    assert made.num_max_tokens_per_rank == made.num_max_dispatch_tokens_per_rank == MAX_TOKENS
    assert num_rdma_bytes >= made.region_bytes * world


def _sglang_normal(rank: int, world: int, num_experts: int) -> None:
    # _DeepEPDispatcherImplNormal: FP8 with column-major scales, async events, expert_alignment 128 (DeepGEMM)
    buffer = deep_ep.Buffer(
        dist.group.WORLD, 1 << 24, 0, low_latency_mode=False, num_qps_per_rank=deep_ep.Buffer.num_sms, allow_mnnvl=True
    )
    hidden_states, topk_ids, topk_weights = _routing(rank, world, num_experts, 6 + rank, seed=3)
    q, s = per_token_group_cast_to_fp8(hidden_states)
    hidden_states = (q, s.t().contiguous().t())  # column-major scales, as sglang_per_token_group_quant_fp8 makes
    previous_event = deep_ep.Buffer.capture()
    (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, previous_event) = (
        buffer.get_dispatch_layout(
            topk_ids,
            num_experts,
            previous_event=previous_event,
            async_finish=True,
            allocate_on_comm_stream=previous_event is not None,
        )
    )
    (recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle, event) = buffer.dispatch(
        hidden_states,
        topk_idx=topk_ids,
        topk_weights=topk_weights,
        num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert,
        previous_event=previous_event,
        async_finish=True,
        allocate_on_comm_stream=(previous_event is not None) and True,
        expert_alignment=128,
        config=None,
    )
    event.current_stream_wait()
    ref = reference_dispatch(q, topk_ids, topk_weights, num_experts, expert_alignment=128, x_scales=s)
    _same(recv_x[0], ref["recv_x"], "recv_x")
    _same(recv_x[1], ref["recv_scales"], "recv_x scales (row-major)")
    assert num_recv_tokens_per_expert == ref["num_recv_tokens_per_expert"]
    assert all(c % 128 == 0 for c in num_recv_tokens_per_expert)
    output = _expert(recv_x[0].float() * recv_x[1].repeat_interleave(128, -1), recv_topk_ids, recv_topk_weights)
    previous_event = deep_ep.Buffer.capture()
    combined_x, _, event = buffer.combine(
        output, handle, async_finish=True, previous_event=previous_event, allocate_on_comm_stream=True, config=None
    )
    event.current_stream_wait()
    _same(combined_x, reference_combine(output, ref, q.shape[0]), "combined_x")
    # the weights reduced too (DeepEP's second return value): each token's original weights, 0 where no expert
    _, combined_w, _ = buffer.combine(output, handle, topk_weights=recv_topk_weights)
    _same(combined_w, torch.where(topk_ids >= 0, topk_weights, 0), "combined topk_weights")
    # a cached dispatch reuses the layout: the same rows
    again, *rest = buffer.dispatch(hidden_states, handle=handle)
    assert rest[:4] == [None, None, None, None]
    _same(again[0], recv_x[0], "cached dispatch")


def _sglang_low_latency(rank: int, world: int, num_experts: int) -> None:
    # _DeepEPDispatcherImplLowLatency with DeepGEMM on Blackwell: round_scale + use_ue8m0, receive hooks; AUTO mode
    # (a normal dispatch first, then clean_low_latency_buffer), two batches in flight (two-batch overlap)
    buffer = deep_ep.Buffer(
        dist.group.WORLD, 1 << 24, 1 << 24, low_latency_mode=True, num_qps_per_rank=8, allow_mnnvl=True
    )
    x, topk_ids, topk_weights = _routing(rank, world, num_experts, 5, seed=4)
    layout = buffer.get_dispatch_layout(topk_ids, num_experts)
    buffer.dispatch(x, None, layout[0], layout[1], layout[3], layout[2], topk_ids, topk_weights)
    buffer.clean_low_latency_buffer(MAX_TOKENS, HIDDEN, num_experts)
    batches = [_routing(rank, world, num_experts, 1 + (rank + b) % 4, seed=5 + b) for b in range(2)]
    states = []
    for hidden_states, ids, _ in batches:
        packed_recv_hidden, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
            hidden_states, ids, MAX_TOKENS, num_experts, use_fp8=True, async_finish=False, return_recv_hook=True,
            round_scale=True, use_ue8m0=True,
        )  # fmt: skip
        states.append((packed_recv_hidden, packed_recv_count, handle, hook))
    local, slots = num_experts // world, MAX_TOKENS * world
    for (hidden_states, ids, weights), (packed, _, handle, hook) in zip(batches, states):
        hook()  # both batches' receive tensors stay valid, as DeepEP's do
        ref = reference_low_latency_dispatch(hidden_states, ids, MAX_TOKENS, num_experts, use_fp8=False)
        q, packed_scales = packed
        assert packed_scales.dtype == torch.int32 and packed_scales.shape == (local, slots, HIDDEN // 512)
        assert packed_scales.stride()[1:] == (1, slots)
        y = torch.zeros(local, slots, HIDDEN, dtype=torch.bfloat16)
        for e in range(local):
            n = ref["counts"][e]
            want_q, want_s = cast_groups_to_fp8(ref["recv_x"][e].float(), 128, ue8m0=True)
            _same(q[e, :n], want_q, f"expert {e} codes")
            exps = ((want_s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.int32)
            _same(packed_scales[e, :n], exps, f"expert {e} packed UE8M0 scales")
            y[e, :n] = (ref["recv_x"][e].float() * (e + 1)).bfloat16()
        combined, event, hook = buffer.low_latency_combine(
            x=y, topk_idx=ids, topk_weights=weights, handle=handle, async_finish=False, return_recv_hook=True
        )
        hook()
        want = reference_low_latency_combine([y[e, : ref["counts"][e]] for e in range(local)], ids, weights, ref)
        _same(combined, want, "low-latency combine")


def _refusals(rank: int, world: int, num_experts: int) -> None:
    buffer = deep_ep.Buffer(dist.group.WORLD, 1 << 20, 0)
    x, topk_ids, topk_weights = _routing(rank, world, num_experts, 4, seed=6)
    with pytest.raises(ValueError, match="low_latency_mode=False"):
        buffer.low_latency_dispatch(x, topk_ids, MAX_TOKENS, num_experts)
    layout = list(buffer.get_dispatch_layout(topk_ids, num_experts))
    if rank == 1:  # one rank's layout disagrees with its topk_idx: every rank raises, before any row moves
        layout[3] = ~layout[3]
    with pytest.raises(ValueError, match=r"rejected on every rank before any row moved: rank 1: "):
        buffer.dispatch(x, None, layout[0], None, layout[3], layout[2], topk_ids, topk_weights)
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank must be None"):
        buffer.dispatch(x, None, layout[0], layout[0], layout[3], layout[2], topk_ids, topk_weights)
    layout = buffer.get_dispatch_layout(topk_ids, num_experts)  # the buffer goes on
    with pytest.raises(
        ValueError, match=r"rejected on every rank before any row moved: rank 0: "
    ):  # a bad x on one rank
        buffer.dispatch(x[0] if rank == 0 else x, None, layout[0], None, layout[3], layout[2], topk_ids, topk_weights)
    recv, *_, handle, _ = buffer.dispatch(x, None, layout[0], None, layout[3], layout[2], topk_ids, topk_weights)
    out = buffer.combine(recv, handle)
    assert len(out) == 3 and out[0].shape == x.shape and out[1] is None  # DeepEP's 3-way unpack: never rows
    # num_worst_tokens: outputs of that many rows (ids -1 and weights 0 past the received ones), no counts
    padded, ids, weights, counts, handle, _ = buffer.dispatch(
        x, None, layout[0], None, layout[3], layout[2], topk_ids, topk_weights, num_worst_tokens=64
    )
    n = recv.shape[0]
    assert padded.shape == (64, HIDDEN) and counts == [] and bool((ids[n:] == -1).all() and (weights[n:] == 0).all())
    _same(padded[:n], recv, "rows under num_worst_tokens")
    _same(buffer.combine(padded, handle)[0], out[0], "combine of the padded rows")
    raw = buffer.get_local_buffer_tensor(torch.bfloat16, torch.Size([4, 8]), offset=16)
    assert raw.shape == (4, 8) and raw.dtype == torch.bfloat16
    ll = deep_ep.Buffer(dist.group.WORLD, 0, 1 << 20, low_latency_mode=True, num_qps_per_rank=2)
    recv_x, count, handle, event, hook = ll.low_latency_dispatch(x, topk_ids, MAX_TOKENS, num_experts, use_fp8=False)
    assert recv_x.shape == (num_experts // world, MAX_TOKENS * world, HIDDEN)  # the 4th argument is num_experts
    # cumulative_local_expert_recv_stats: each call adds its counts (in the receive hook when there is one)
    stats = torch.full((num_experts // world,), 5, dtype=torch.int32)
    _, c1, *_ = ll.low_latency_dispatch(x, topk_ids, MAX_TOKENS, num_experts, stats, use_fp8=False)
    *_, later = ll.low_latency_dispatch(x[:2], topk_ids[:2], MAX_TOKENS, num_experts, stats, return_recv_hook=True)
    later()
    second = reference_low_latency_dispatch(x[:2], topk_ids[:2], MAX_TOKENS, num_experts, use_fp8=False)["counts"]
    assert stats.dtype == torch.int32 and stats.tolist() == [5 + a + b for a, b in zip(c1.tolist(), second)]
    with pytest.raises(ValueError, match=r"cumulative_local_expert_recv_stats must be \[4\] int32"):
        ll.low_latency_dispatch(x, topk_ids, MAX_TOKENS, num_experts, torch.zeros(3, dtype=torch.int32))
    plain = ll.low_latency_combine(recv_x, topk_ids, topk_weights, handle)[0].clone()
    logfmt = ll.low_latency_combine(recv_x, topk_ids, topk_weights, handle, use_logfmt=True)[0]
    assert torch.equal(logfmt, plain)  # accepted, no effect: the rows travel as bf16 either way
    for kwargs, match in (
        (dict(combine_wait_recv_cost_stats=torch.zeros(world, dtype=torch.int64)), "combine_wait_recv_cost_stats"),
        (dict(async_finish=True, return_recv_hook=True), "cannot both be True"),
    ):
        with pytest.raises(ValueError, match=match):
            ll.low_latency_combine(recv_x, topk_ids, topk_weights, handle, **kwargs)
    y = ll.get_next_low_latency_combine_buffer(handle)
    y.copy_(recv_x)
    zero, _, _ = ll.low_latency_combine(torch.empty(0), topk_ids, topk_weights, handle, zero_copy=True)
    assert zero.shape == x.shape
    for kwargs, match in (
        (dict(dispatch_wait_recv_cost_stats=torch.zeros(world, dtype=torch.int64)), "dispatch_wait_recv_cost_stats"),
        (dict(use_ue8m0=True), "needs round_scale=True"),
    ):
        with pytest.raises(ValueError, match=match):
            ll.low_latency_dispatch(x, topk_ids, MAX_TOKENS, num_experts, **kwargs)
    with pytest.raises(RuntimeError, match="explicitly_destroy=True"):
        ll.destroy()
    ll2 = deep_ep.Buffer(dist.group.WORLD, 0, 0, low_latency_mode=True, explicitly_destroy=True)
    ll2.low_latency_dispatch(x, topk_ids, MAX_TOKENS, num_experts, use_fp8=False)
    ll2.destroy()


EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "deepep_moe_layer.py"


def _example():
    """examples/deepep_moe_layer.py as a module (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("deepep_moe_layer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _engines(rank: int, world: int) -> str:
    num_experts = 4 * world
    for fp8 in (False, True):
        _vllm_high_throughput(rank, world, num_experts, fp8)
        _vllm_low_latency(rank, world, num_experts, fp8)
    _sglang_normal(rank, world, num_experts)
    _sglang_low_latency(rank, world, num_experts)
    _refusals(rank, world, num_experts)
    # the example's layer on the same ranks (one spawn fewer than running the script): it checks itself against
    # float32 experts and reports "ok" per step
    return _example().run(rank, world) if world == 2 else "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_engine_call_sequences_match_the_reference(world):
    got = run_ranks(_engines, world, timeout=240)
    if world == 2:
        lines = "\n".join(got).splitlines()
        assert len(lines) == 4 and all(line.endswith(": ok") for line in lines), got
    else:
        assert got == ["ok"] * world


# Interface facts (DeepEP's legacy Buffer: deep_ep/buffers/legacy.py and csrc/legacy/config.hpp)

SIGNATURES = {
    "__init__": "self group num_nvl_bytes=0 num_rdma_bytes=0 low_latency_mode=False num_qps_per_rank=24 "
    "allow_nvlink_for_low_latency_mode=True allow_mnnvl=False explicitly_destroy=False enable_shrink=False comm=None",
    "get_dispatch_layout": "self topk_idx num_experts previous_event=None async_finish=False "
    "allocate_on_comm_stream=False",
    "dispatch": "self x handle=None num_tokens_per_rank=None num_tokens_per_rdma_rank=None is_token_in_rank=None "
    "num_tokens_per_expert=None topk_idx=None topk_weights=None expert_alignment=1 num_worst_tokens=0 config=None "
    "previous_event=None async_finish=False allocate_on_comm_stream=False",
    "combine": "self x handle topk_weights=None bias=None config=None previous_event=None async_finish=False "
    "allocate_on_comm_stream=False",
    "low_latency_dispatch": "self x topk_idx num_max_dispatch_tokens_per_rank num_experts "
    "cumulative_local_expert_recv_stats=None dispatch_wait_recv_cost_stats=None use_fp8=True round_scale=False "
    "use_ue8m0=False async_finish=False return_recv_hook=False",
    "low_latency_combine": "self x topk_idx topk_weights handle use_logfmt=False zero_copy=False async_finish=False "
    "return_recv_hook=False out=None combine_wait_recv_cost_stats=None",
    "clean_low_latency_buffer": "self num_max_dispatch_tokens_per_rank hidden num_experts",
    "get_next_low_latency_combine_buffer": "self handle",
    "low_latency_update_mask_buffer": "self rank_to_mask mask=False",
    "low_latency_query_mask_buffer": "self mask_status",
    "low_latency_clean_mask_buffer": "self",
    "get_low_latency_rdma_size_hint": "num_max_dispatch_tokens_per_rank hidden num_ranks num_experts",
    "get_local_buffer_tensor": "self dtype size=None offset=0 use_rdma_buffer=False",
    "set_num_sms": "new_num_sms",
    "get_dispatch_config": "num_ranks",
    "get_combine_config": "num_ranks",
    "destroy": "self",
    "capture": "",
    "get_comm_stream": "self",
    "is_sm90_compiled": "",
}


def _sig(fn) -> str:
    return " ".join(
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in inspect.signature(fn).parameters.values()
    )


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_buffer_signatures_are_deep_eps(name):
    assert _sig(getattr(deep_ep.Buffer, name)) == SIGNATURES[name]


def test_config_events_and_hints():
    assert _sig(deep_ep.Config) == (
        "num_sms=20 num_max_nvl_chunked_send_tokens=6 num_max_nvl_chunked_recv_tokens=256 "
        "num_max_rdma_chunked_send_tokens=6 num_max_rdma_chunked_recv_tokens=256"
    )
    with pytest.raises(ValueError, match="num_max_nvl_chunked_send_tokens"):
        deep_ep.Config(20, 256, 256)
    cfg = deep_ep.Config(24, 6, 256, 6, 100)
    assert cfg.num_max_rdma_chunked_recv_tokens == 102  # rounded up to a multiple of the send chunk, as DeepEP
    assert (
        cfg.get_nvl_buffer_size_hint(7168 * 2, 8) > 2560 * 7168 * 2 and cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    )
    with pytest.raises(ValueError, match="even"):
        deep_ep.Buffer.set_num_sms(21)
    event = deep_ep.Buffer.capture()
    with event:  # on CPU ranks there is nothing to wait for
        pass
    with pytest.raises(RuntimeError, match="async_finish=True"):
        deep_ep.EventOverlap().current_stream_wait()
    # a hook registered after the wait runs once, its result returned (DeepEP's deterministic-dispatch epilogue)
    event = deep_ep.Buffer.capture()
    calls = []
    event.register_hook_after_wait(lambda: calls.append(1) or "sorted")
    with pytest.raises(RuntimeError, match="already registered"):
        event.register_hook_after_wait(lambda: None)
    assert event.wait() == "sorted" and event.wait() is None and calls == [1]
    with event(release_handle=True):
        pass
    assert event.event is None
    big = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 64, 256)
    assert big >= 128 * 4 * 64 * 7168 * 2  # every local expert's slots for 128 tokens of every rank, in bf16
    assert deep_ep.topk_idx_t is torch.int64


def test_constructor_refusals_name_the_parameter():
    with pytest.raises(ValueError, match="comm"):
        deep_ep.Buffer(None, comm=object())
    with pytest.raises(ValueError, match="enable_shrink"):
        deep_ep.Buffer(object(), enable_shrink="yes")  # a bool (True masks silent ranks: test_compat_deep_ep_shrink)
    with pytest.raises(TypeError):
        deep_ep.Buffer(object(), use_fabric=True)  # not a parameter of DeepEP's legacy Buffer either


def test_the_example_switches_by_its_import_lines():
    # examples/deepep_moe_layer.py: an engine-style MoE layer on DeepEP's and DeepGEMM's interfaces, switched to epkit
    # by its import lines (it runs on 2 CPU ranks in test_engine_call_sequences_match_the_reference)
    switch = [line for line in EXAMPLE.read_text().splitlines() if line.startswith(("import deep", "import epkit."))]
    assert switch == [
        "import epkit.compat.deep_ep as deep_ep  # the switch: `import deep_ep` runs the same layer on DeepEP",
        "import epkit.compat.deep_gemm as deep_gemm  # and `import deep_gemm` on DeepGEMM",
    ]
