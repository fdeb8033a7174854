"""DeepEP's ``num_worst_tokens`` through ``epkit.compat.deep_ep.Buffer`` (issue 40: "``num_worst_tokens`` with no
host read on CUDA"): the shim's worst-case dispatch is EPBuffer's worst-case call, its routing and handle tensor
ops, so on the device kernels (their source under the Triton interpreter, CPU ranks over shm) the layout, the
dispatch, its combine and a cached dispatch along its handle read nothing back to the host.

Each worst-case result is checked against the plain dispatch of the same routing on the same Buffer (the plain one
is checked against DeepEP's meaning in ``test_compat_deep_ep_handles.py``): the rows, ids and weights bit for bit,
then the padding (zero rows, ids -1, weights 0); the handle's tensors equal, ``recv_src_idx`` -1 past the rows
received; the combine, with NaN in every padding row of ``x``, equal to the plain combine.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import epkit.compat.deep_ep as deep_ep
from epkit.testing.cuda_graph import captured, pretended_nccl_capture
from epkit.testing.host_sync import HostSyncDetector
from epkit.testing.markers import requires_cuda
from epkit.testing.multiprocess import run_ranks

HIDDEN, TOPK, WORST = 128, 2, 24


def _inputs(rank: int, num_experts: int):
    t = (7, 3)[rank % 2]  # unequal token counts
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(t, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(t)])
    ids[torch.rand(ids.shape, generator=g) < 0.2] = -1
    return x, ids, torch.rand(t, TOPK, generator=g)


def _padded(got: torch.Tensor, want: torch.Tensor, fill: float) -> None:
    r = want.shape[0]
    assert got.shape == (WORST, *want.shape[1:]), (got.shape, want.shape)
    assert torch.equal(got[:r], want)
    assert bool((got[r:] == fill).all())


def _warm(rank: int, world: int, ids: torch.Tensor | None = None):
    """A Buffer whose first worst-case dispatch (agreed on the host) made its EPBuffer: ``(buffer, x, ids, args,
    first)``, ``args`` the dispatch's positional arguments (``ids``: this rank's routing, ``_inputs``'s by
    default)."""
    num_experts = 2 * world
    x, own, weights = _inputs(rank, num_experts)
    ids = own if ids is None else ids
    buffer = deep_ep.Buffer(dist.group.WORLD, 1 << 20, 0)
    layout = buffer.get_dispatch_layout(ids, num_experts)
    args = (x, None, layout[0], None, layout[3], layout[2], ids, weights)
    return buffer, x, ids, args, buffer.dispatch(*args, num_worst_tokens=WORST)


def _case(rank: int, world: int, kernels: str) -> list[str]:
    os.environ["EPKIT_EP_KERNELS"] = kernels
    buffer = deep_ep.Buffer(dist.group.WORLD, 1 << 20, 0, explicitly_destroy=True)
    reads = [line for with_topk in (True, False) for line in _worst_vs_plain(buffer, rank, world, with_topk)]
    buffer.destroy()
    return reads


def _worst_vs_plain(buffer, rank: int, world: int, with_topk: bool) -> list[str]:
    """The worst-case dispatch, combine and cached dispatch against the plain ones; the host reads they made."""
    num_experts = 2 * world
    x, ids, weights = _inputs(rank, num_experts)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, num_experts)
    config = deep_ep.Config(8)  # 4 channels
    kw = {"topk_idx": ids, "topk_weights": weights} if with_topk else {}

    def dispatch(n: int):
        return buffer.dispatch(x, None, per_rank, None, in_rank, per_expert, config=config, num_worst_tokens=n, **kw)

    plain = dispatch(0)
    r = plain[0].shape[0]
    plain_combined = buffer.combine(plain[0] * 2, plain[4], topk_weights=plain[2])
    plain_cached = buffer.dispatch(x, plain[4])[0]
    dispatch(WORST)  # warm-up: the first worst-case call of a buffer fills its caches
    with HostSyncDetector() as reads:
        layout = buffer.get_dispatch_layout(ids, num_experts)
        recv_x, recv_ids, recv_w, counts, handle, _ = dispatch(WORST)
        y = recv_x * 2
        y[r:] = float("nan")  # padding rows are never read
        combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w)
        cached = buffer.dispatch(x, handle)[0]
    assert counts == []  # DeepEP: no counts without a CPU sync
    for got, want in zip(layout[:4], (per_rank, None, per_expert, in_rank)):
        assert got is want is None or torch.equal(got, want)
    _padded(recv_x, plain[0], 0)
    _padded(cached, plain_cached, 0)
    if with_topk:
        _padded(recv_ids, plain[1], -1)
        _padded(recv_w, plain[2], 0)
    else:
        assert recv_ids is None and recv_w is None
    for i in (0, 1, 2, 4, 5):  # rank_prefix, channel_prefix, recv_channel_prefix, is_token_in_rank, send_head
        assert torch.equal(handle[i], plain[4][i]), i
    _padded(handle[3], plain[4][3], -1)  # recv_src_idx
    assert torch.equal(combined, plain_combined[0])
    if with_topk:
        assert torch.equal(combined_w, plain_combined[1])
    # the control: the plain dispatch reads the received count back
    with HostSyncDetector() as plain_reads:
        dispatch(0)
    assert plain_reads.events, "the detector sees the plain dispatch's reads"
    return reads.events


@pytest.mark.parametrize("kernels", ["host", "device"])
def test_worst_case_dispatch_is_the_plain_one_padded_and_reads_nothing_back_on_the_device_kernels(kernels):
    """With top-k and without (routed by ``is_token_in_rank``), one Buffer."""
    got = run_ranks(_case, 2, kernels, timeout=240)
    if kernels == "device":
        assert got == [[], []], got


def _overflow(rank: int, world: int) -> str:
    """Rank 0 sends 7 tokens to every rank: a worst case of 4 rows overflows there; on the device kernels the verdict
    is a recorded failure, raised at the rank's next call (on CPU ranks within the call: its kernels have run)."""
    os.environ["EPKIT_EP_KERNELS"] = "device"
    tokens = _inputs(rank, 2 * world)[0].shape[0]
    ids = torch.arange(tokens).view(-1, 1).repeat(1, TOPK) % 2 * 2  # each token to each rank (experts 0 and 2)
    buffer, _, _, args, _ = _warm(rank, world, ids)
    texts = []
    for _ in range(2):  # the bad call, then the call that learns of it
        try:
            buffer.dispatch(*args, num_worst_tokens=4)
        except (ValueError, RuntimeError) as exc:
            texts.append(f"{type(exc).__name__}: {exc}")
            break
    return texts[0] if texts else "no error"


def test_a_worst_case_that_overflows_on_the_device_kernels_is_the_same_error_on_every_rank():
    texts = run_ranks(_overflow, 2, timeout=240)
    assert texts[0].startswith("ValueError") and "num_worst_tokens" in texts[0], texts
    assert texts[0] == texts[1], texts


def _stream_ordered(rank: int, world: int) -> list[str]:
    """A worst-case dispatch, its combine and a cached dispatch on an NCCL group (the group's kind as the session
    sees it, over gloo here), after an eager one: no host agreement, accepted under a (pretended) capture, no host
    read on the device kernels, and the eager call's results."""
    os.environ["EPKIT_EP_KERNELS"] = "device"
    buffer, x, _, args, eager = _warm(rank, world)
    eager_combined = buffer.combine(eager[0] * 2, eager[4], topk_weights=eager[2])
    eager_cached = buffer.dispatch(x, eager[4])[0]
    with pretended_nccl_capture(buffer) as agreed:
        with HostSyncDetector() as reads:
            got = buffer.dispatch(*args, num_worst_tokens=WORST)
            combined = buffer.combine(got[0] * 2, got[4], topk_weights=got[2])
            cached = buffer.dispatch(x, got[4])[0]
        with pytest.raises(RuntimeError, match="dispatch of epkit.compat.deep_ep cannot run under CUDA graph"):
            buffer.dispatch(*args)  # a plain dispatch meets on the host: refused before anything runs
    assert agreed == [], agreed
    assert all(torch.equal(a, b) for a, b in zip(got[:3], eager[:3])) and got[3] == []
    assert all(torch.equal(a, b) for a, b in zip(got[4], eager[4]))
    assert torch.equal(combined[0], eager_combined[0]) and torch.equal(combined[1], eager_combined[1])
    assert torch.equal(cached, eager_cached)
    return reads.events


def test_on_an_nccl_group_a_worst_case_dispatch_is_stream_ordered_and_may_be_captured():
    assert run_ranks(_stream_ordered, 2, timeout=240) == [[], []]


def _ordered_bad_call(rank: int, world: int, kind: str) -> str:
    """On an NCCL group (told so, gloo underneath) a stream-ordered call rank 1 rejects: the EPBuffer's own call
    rejects it on every rank (within the call on CPU ranks), with one text."""
    os.environ["EPKIT_EP_KERNELS"] = "device"
    buffer, x, ids, args, first = _warm(rank, world)
    buffer._session.agreement.nccl = True
    bad = rank == 1
    calls = {
        "dispatch": lambda: buffer.dispatch(*args, num_worst_tokens=WORST, config=7 if bad else None),
        "combine": lambda: buffer.combine(first[0], first[4], bias=(x, x, x) if bad else None),
        "cached dispatch": lambda: buffer.dispatch(x, first[4], topk_idx=ids if bad else None),
    }
    with pytest.raises(ValueError) as info:
        calls[kind]()
    return str(info.value)


@pytest.mark.parametrize("kind", ["dispatch", "combine", "cached dispatch"])
def test_on_an_nccl_group_a_call_one_rank_rejects_is_the_same_error_on_every_rank(kind):
    texts = run_ranks(_ordered_bad_call, 2, kind, timeout=240)
    assert texts[0] == texts[1], texts
    assert "rank 1" in texts[0], texts


def _under_capture(rank: int, world: int) -> bool:
    """The shim's normal-mode calls under a (pretended) CUDA graph capture: refused before anything runs, so the
    Buffer goes on in step; the layout (tensor ops) is not refused."""
    from epkit.compat._details import deep_ep_session

    buffer, x, ids, args, first = _warm(rank, world)
    layout = buffer.get_dispatch_layout(ids, 2 * world)
    real = deep_ep_session.capturing
    deep_ep_session.capturing = lambda: True  # what torch.cuda.graph's capture makes ops.capturing() say
    try:
        assert torch.equal(buffer.get_dispatch_layout(ids, 2 * world)[3], layout[3])
        for call in (
            lambda: buffer.dispatch(*args, num_worst_tokens=WORST),
            lambda: buffer.dispatch(x, first[4]),
            lambda: buffer.combine(first[0], first[4]),
        ):
            with pytest.raises(RuntimeError, match="dispatch|combine of epkit.compat.deep_ep cannot run under CUDA"):
                call()
    finally:
        deep_ep_session.capturing = real
    again = buffer.dispatch(*args, num_worst_tokens=WORST)
    return torch.equal(again[0], first[0]) and torch.equal(
        buffer.combine(again[0], again[4])[0], buffer.combine(first[0], first[4])[0]
    )


def test_the_shims_normal_mode_calls_are_refused_under_cuda_graph_capture_before_anything_runs():
    assert run_ranks(_under_capture, 2, timeout=120) == [True, True]


def _gpu_capture(rank: int, world: int) -> bool:
    """Rung 4: on an NCCL group (one GPU), a legacy worst-case dispatch and its combine through the shim captured in
    a CUDA graph (after an eager call) and replayed on new rows give, each time, the eager plain dispatch's rows
    (padded) and its combine's bits."""
    torch.cuda.set_device(0)
    group = dist.new_group([0], backend="nccl")
    num_experts = 8
    x, ids, weights = (t.cuda() for t in _inputs(rank, num_experts))
    buffer = deep_ep.Buffer(group, 1 << 20, 0)
    layout = buffer.get_dispatch_layout(ids, num_experts)
    static_x = x.clone()

    def dispatch(**kw):
        return buffer.dispatch(static_x, None, layout[0], None, layout[3], layout[2], ids, weights, **kw)

    def step():
        got = dispatch(num_worst_tokens=WORST)
        return got, buffer.combine(got[0], got[4])

    graph, (got, out) = captured(step)  # the eager step makes the EPBuffer (agreed on the host)
    for trial in range(3):
        static_x.copy_((x.float() * (trial + 2)).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        plain = dispatch()
        want = buffer.combine(plain[0], plain[4])
        r = plain[0].shape[0]
        assert torch.equal(got[0][:r].cpu(), plain[0].cpu()) and bool((got[0][r:] == 0).all()), trial
        assert torch.equal(out[0].cpu(), want[0].cpu()), trial
    return True


@requires_cuda
def test_gpu_a_worst_case_dispatch_through_the_shim_replays_from_a_cuda_graph_on_an_nccl_group():
    assert run_ranks(_gpu_capture, 1, timeout=240) == [True]
