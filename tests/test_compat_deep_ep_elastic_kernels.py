"""DeepEP V2's ``ElasticBuffer`` on EPBuffer's device kernels (issue 40: "``do_cpu_sync=False`` (worst-case outputs,
no host read, capturable on CUDA)", "``num_sms`` honoured on the device path"): the kernels' source under the Triton
interpreter, CPU ranks over shm.

Each call's results are checked against the same call on the host-driven path (``EPKIT_EP_KERNELS=host``), whose
V2 semantics ``test_compat_deep_ep_elastic.py`` checks against references written from every rank's inputs: the
rows, ids, weights, every handle tensor, the combine in V2's order with two biases, the routed-back weights and a
cached dispatch with new weights, bit for bit, with and without ``do_expand`` and ``do_cpu_sync``, and without
``allow_multiple_reduction`` (each (token, k) row back alone, added k ascending). Without
``do_cpu_sync`` the dispatch, its combine and the cached dispatch read nothing back to the host; the calls'
``num_sms`` are their launches' programs. The summation
order underneath (``EPBuffer.combine(order=)``) is checked on values whose float32 sum depends on it.
"""

from __future__ import annotations

import io
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist

import epkit.compat.deep_ep as deep_ep
from epkit.kernels.triton.launch import observe
from epkit.testing.cuda_graph import pretended_nccl_capture
from epkit.testing.host_sync import HostSyncDetector
from epkit.testing.markers import requires_cuda
from epkit.testing.multiprocess import run_ranks

HIDDEN, TOPK, N_MAX = 128, 3, 8


def _grid(grids: dict, made) -> None:
    grids.setdefault(made.kernel.__name__, set()).add(made.grid)


def _calls(rank: int, world: int, kernels: str) -> bytes:
    """Every V2 call's results on ``kernels`` (torch-saved: tensors leave the rank as bytes), with and without
    ``do_cpu_sync`` and ``do_expand`` (and an expanded one without ``allow_multiple_reduction``), and the host reads
    of each (after one warm-up call per buffer: the first makes the EPBuffer)."""
    os.environ["EPKIT_EP_KERNELS"] = kernels
    num_experts = 2 * world
    g = torch.Generator().manual_seed(rank)
    t = (5, 8, 0)[rank % 3]  # a rank with no tokens
    x = torch.randn(t, HIDDEN, generator=g).bfloat16()
    rows = [torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(t)]
    ids = torch.stack(rows) if rows else torch.empty(0, TOPK, dtype=torch.int64)
    if t:
        ids[0, 1] = -1
    w = torch.rand(t, TOPK, generator=g)
    bias = (torch.randn(t, HIDDEN, generator=g).bfloat16(), torch.randn(t, HIDDEN, generator=g).bfloat16())
    out, buffers = [], {}
    # (allow_multiple_reduction, do_cpu_sync, do_expand); without multiple reduction only an expanded combine differs
    for many, sync, expand in ((1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1), (0, 0, 1), (0, 1, 1)):
        if many not in buffers:  # and a warm-up call: the first makes the EPBuffer
            buffers[many] = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=N_MAX, hidden=HIDDEN,
                                                  allow_multiple_reduction=many, explicitly_destroy=True)  # fmt: skip
            buffers[many].dispatch(x, ids, w, num_experts=num_experts, do_cpu_sync=False)
        buffer = buffers[many]
        kw = {"num_experts": num_experts, "do_cpu_sync": sync, "do_expand": expand, "expert_alignment": 4}
        grids: dict[str, set] = {}  # the programs of each kernel's launches (as made for CUDA)
        with HostSyncDetector() as reads, observe(partial(_grid, grids)):
            recv_x, recv_idx, recv_w, h, _ = buffer.dispatch(x, ids, w, num_sms=5, **kw)
            y = (recv_x.float() + (2.0**24, 1.0, -(2.0**24))[rank]).bfloat16()  # the sum's order shows in its bits
            combined, combined_w, _ = buffer.combine(y, h, topk_weights=recv_w, bias=bias, num_sms=3)
            cached = buffer.dispatch(x * 2, handle=h, topk_weights=w * 2, do_expand=expand)
        out.append({
            "on_kernels": h.buffer.uses_device_kernels, "sync": sync, "reads": reads.events, "grids": grids,
            "recv_x": recv_x, "recv_idx": recv_idx, "recv_w": recv_w, "combined": combined, "combined_w": combined_w,
            "meta": h.recv_src_metadata,
            "psum_rank": h.psum_num_recv_tokens_per_scaleup_rank, "psum_expert": h.psum_num_recv_tokens_per_expert,
            "unaligned": h.num_unaligned_recv_tokens_per_expert, "slots": h.dst_buffer_slot_idx,
            "cached_x": cached[0], "cached_w": cached[2],
            "sizes": (h.num_recv_tokens, h.num_expanded_tokens, h.num_recv_tokens_per_expert_list),
        })  # fmt: skip
    for buffer in buffers.values():
        buffer.destroy()
    f = io.BytesIO()
    torch.save(out, f)
    return f.getvalue()


def _load(blob: bytes) -> list[dict]:
    return torch.load(io.BytesIO(blob))


def test_v2_on_the_device_kernels_is_the_host_path_bit_for_bit():
    host = [_load(b) for b in run_ranks(_calls, 3, "host", timeout=120)]
    kern = [_load(b) for b in run_ranks(_calls, 3, "device", timeout=300)]
    for rank in range(3):
        assert len(host[rank]) == len(kern[rank]) == 6
        for a, d in zip(host[rank], kern[rank]):
            assert not a["on_kernels"] and d["on_kernels"]
            for key in a:
                if key in ("on_kernels", "reads", "grids"):
                    continue
                va, vd = a[key], d[key]
                if isinstance(va, torch.Tensor):
                    assert isinstance(vd, torch.Tensor) and va.shape == vd.shape and torch.equal(va, vd), (rank, key)
                else:
                    assert va == vd, (rank, key, va, vd)
            # num_sms honoured: the dispatch's (5, kept by its cached dispatch) and the combine's (3) programs
            want = {"_layout": 5, "_notify": 1, "_dispatch_send": 5, "_dispatch_recv": 5, "_agree": 1}  # each once
            want.update(_combine_send=3, _combine_reduce=3)
            assert d["grids"] == {k: {(n,)} for k, n in want.items()}, (rank, d["grids"])
            if not d["sync"]:  # the worst-case call, its combine and cached dispatch: nothing read back
                assert d["reads"] == [], (rank, d["reads"])
            elif rank < 2:  # the control: the detector sees a plain dispatch's count read
                assert d["reads"], rank


def _ordered(rank: int, world: int) -> list[float]:
    """Rank 0 returns 2**24 for every row, rank 1 -2**24; one bias of 1 per token: the float32 sum depends on the
    order (bias first, then ranks 0, 1: 0; ranks 1, 0: 1), which alternates by token."""
    from epkit.collectives.ep_buffer import EPBuffer

    os.environ["EPKIT_EP_KERNELS"] = "device"
    buf = EPBuffer(dist.group.WORLD, HIDDEN, 2 * world, N_MAX, 2, transport="shm", timeout=60)
    t = 4
    ids = torch.tensor([[0, 2]] * t)  # every token to both ranks
    recv, _, _, _, h = buf.dispatch(torch.zeros(t, HIDDEN, dtype=torch.bfloat16), ids)
    y = torch.full(recv.shape, 2.0**24 * (1 - 2 * rank), dtype=torch.bfloat16)
    bias = torch.ones(t, HIDDEN, dtype=torch.bfloat16)
    order = torch.tensor([[0, 1], [1, 0]] * (t // 2), dtype=torch.int32)
    got = buf.combine(y, h, bias=bias, order=order)
    plain = buf.combine(y, h, bias=bias)  # ranks ascending, then the bias: (2**24 - 2**24) + 1
    buf.close()
    return got[:, 0].float().tolist() + plain[:, 0].float().tolist()


def test_a_combine_in_a_given_order_sums_in_that_order():
    for got in run_ranks(_ordered, 2, timeout=240):
        assert got == [0.0, 1.0, 0.0, 1.0] + [1.0] * 4, got


def _warm(rank: int, world: int, kernels: str = "device"):
    """An ElasticBuffer whose first ``do_cpu_sync=False`` dispatch (agreed on the host) made its EPBuffer:
    ``(buffer, x, ids, weights, kw, first)``, ``kw`` the dispatch's keywords."""
    os.environ["EPKIT_EP_KERNELS"] = kernels
    num_experts = 2 * world
    g = torch.Generator().manual_seed(7 + rank)
    t = (5, 3)[rank % 2]
    x = torch.randn(t, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(t)])
    w = torch.rand(t, TOPK, generator=g)
    buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=N_MAX, hidden=HIDDEN)
    kw = {"num_experts": num_experts, "do_cpu_sync": False, "do_expand": True, "expert_alignment": 4}
    return buffer, x, ids, w, kw, buffer.dispatch(x, ids, w, **kw)


def _stream_ordered(rank: int, world: int) -> list[str]:
    """On an NCCL group (the group's kind as the session sees it, gloo underneath) after an eager call: a
    ``do_cpu_sync=False`` dispatch, its combine and a cached dispatch make no host agreement, are accepted under a
    (pretended) capture, read nothing back, and give the eager calls' results; a ``do_cpu_sync=True`` dispatch is
    refused under the capture before anything runs."""
    buffer, x, ids, w, kw, eager = _warm(rank, world)
    bias = (x, x)
    eager_combined = buffer.combine(eager[0], eager[3], topk_weights=eager[2], bias=bias)
    eager_cached = buffer.dispatch(x, handle=eager[3], topk_weights=w, do_expand=True)
    with pretended_nccl_capture(buffer) as agreed:
        with HostSyncDetector() as reads:
            got = buffer.dispatch(x, ids, w, **kw)
            combined = buffer.combine(got[0], got[3], topk_weights=got[2], bias=bias)
            cached = buffer.dispatch(x, handle=got[3], topk_weights=w, do_expand=True)
        with pytest.raises(RuntimeError, match="dispatch of epkit.compat.deep_ep cannot run under CUDA graph"):
            buffer.dispatch(x, ids, w, **{**kw, "do_cpu_sync": True})  # sized on the host: refused
    assert agreed == [], agreed
    assert torch.equal(got[0], eager[0]) and got[1] is None and torch.equal(got[2], eager[2])
    assert torch.equal(got[3].recv_src_metadata, eager[3].recv_src_metadata)
    assert torch.equal(combined[0], eager_combined[0]) and torch.equal(combined[1], eager_combined[1])
    assert torch.equal(cached[0], eager_cached[0]) and torch.equal(cached[2], eager_cached[2])
    return reads.events


def test_on_an_nccl_group_a_worst_case_v2_dispatch_is_stream_ordered_and_may_be_captured():
    assert run_ranks(_stream_ordered, 2, timeout=240) == [[], []]


def _ordered_bad_calls(rank: int, world: int) -> list[str]:
    """On an NCCL group (told so, gloo underneath) each kind of stream-ordered call rank 1 rejects (each on a fresh
    buffer: a rejected worst-case dispatch retires its EPBuffer): the EPBuffer's own call rejects it on every rank
    (within the call on CPU ranks), with one text."""
    texts = []
    for kind in ("dispatch", "larger N", "combine", "cached dispatch"):
        buffer, x, ids, w, kw, first = _warm(rank, world)
        buffer._session.agreement.nccl = True
        bad = rank == 1
        with pytest.raises(ValueError) as info:
            if kind == "dispatch":
                buffer.dispatch(x, ids, w, **{**kw, "num_qps": 10**6 if bad else 0})
            elif kind == "larger N":
                buffer.dispatch(x, ids, w, **kw, num_max_tokens_per_rank=4 * N_MAX if bad else N_MAX)
            elif kind == "combine":
                buffer.combine(first[0], first[3], bias=(x, x, x) if bad else None)
            else:
                buffer.dispatch(x, handle=first[3], do_expand=not bad, topk_weights=w)
        texts.append(str(info.value))
    return texts


def test_on_an_nccl_group_a_v2_call_one_rank_rejects_is_the_same_error_on_every_rank():
    texts = run_ranks(_ordered_bad_calls, 2, timeout=240)
    assert texts[0] == texts[1], texts
    for text, what in zip(texts[0], ("num_qps", "num_max_tokens_per_rank = 32", "bias", "do_expand")):
        assert "rank 1" in text and what in text, texts


def _gpu_capture(rank: int, world: int) -> bool:
    """Rung 4: on an NCCL group (one GPU), a ``do_cpu_sync=False`` V2 dispatch and its combine (with weights and a
    bias) captured in a CUDA graph after an eager call, replayed on new rows: each time the eager calls' results."""
    from epkit.testing.cuda_graph import captured

    torch.cuda.set_device(0)
    group = dist.new_group([0], backend="nccl")
    num_experts, t = 8, 6
    g = torch.Generator().manual_seed(11)
    x = torch.randn(t, HIDDEN, generator=g).bfloat16().cuda()
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(t)]).cuda()
    w = torch.rand(t, TOPK, generator=g).cuda()
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=N_MAX, hidden=HIDDEN)
    static_x = x.clone()
    kw = {"num_experts": num_experts, "do_cpu_sync": False, "do_expand": True, "expert_alignment": 4}

    def step():
        recv_x, _, recv_w, handle, _ = buffer.dispatch(static_x, ids, w, **kw)
        return recv_x, buffer.combine(recv_x, handle, topk_weights=recv_w, bias=static_x)

    graph, (got_x, (got_c, got_w, _)) = captured(step)  # the eager step makes the EPBuffer (agreed on the host)
    for trial in range(3):
        static_x.copy_((x.float() * (trial + 2)).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        want_x, want = step()
        assert torch.equal(got_x, want_x) and torch.equal(got_c, want[0]) and torch.equal(got_w, want[1]), trial
    return True


@requires_cuda
def test_gpu_a_worst_case_v2_dispatch_replays_from_a_cuda_graph_on_an_nccl_group():
    assert run_ranks(_gpu_capture, 1, timeout=240) == [True]
