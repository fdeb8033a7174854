"""fused_moe equals dispatch -> expert_mlp -> combine bit for bit, with no staging copy on shm."""

import pytest
import torch
import torch.distributed as dist

from epkit.collectives.ep_buffer import EPBuffer
from epkit.collectives.fused_moe import fused_moe
from epkit.moe import expert_mlp
from epkit.quant import per_block_cast_to_fp8
from epkit.testing import assert_bitwise_equal
from epkit.testing.multiprocess import run_ranks
from epkit.testing.nvshmem_emulator import resolve_transport

HIDDEN, INTER, EXPERTS, TOPK = 256, 128, 8, 2


def _weights(rank, world_size, fmt):
    g = torch.Generator().manual_seed(1234)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    local = EXPERTS // world_size
    w13, w2 = w13[rank * local : (rank + 1) * local], w2[rank * local : (rank + 1) * local]
    if fmt == "bf16":
        return w13.bfloat16(), w2.bfloat16()
    return per_block_cast_to_fp8(w13), per_block_cast_to_fp8(w2)


def _fused_vs_composed(rank, world_size, fmt, num_tokens, transport="shm", portable=False):
    transport = resolve_transport(transport)
    buf = EPBuffer(  # portable: the device formulations of the row moves and sums
        dist.group.WORLD, HIDDEN, EXPERTS, 64, TOPK, transport=transport, timeout=30, portable=portable
    )
    g = torch.Generator().manual_seed(rank)
    t = num_tokens[rank]
    idx = (
        torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(t)])
        if t
        else torch.empty((0, TOPK), dtype=torch.int64)
    )
    if t:
        idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    x = torch.randn(t, HIDDEN, generator=g).bfloat16()
    wts = torch.rand(t, TOPK, generator=g)
    shared = torch.randn(t, HIDDEN, generator=g).bfloat16()
    w13, w2 = _weights(rank, world_size, fmt)
    recv_x, _, _, _, handle = buf.dispatch(x, idx, wts, expand=True, expert_alignment=128)
    y = expert_mlp(recv_x, "contiguous", w13, w2, m_indices=EPBuffer.m_indices(handle))
    composed = buf.combine(y, handle, bias=shared)
    fused = fused_moe(x, idx, wts, w13, w2, buf, bias=shared, expert_alignment=128)
    assert_bitwise_equal(fused, composed, f"{rank=} {fmt=}")
    again = fused_moe(x, idx, wts, w13, w2, buf, bias=shared, expert_alignment=128)  # buffer reuse
    assert_bitwise_equal(again, fused, f"{rank=} {fmt=} second call")
    return True


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_fused_equals_composed(fmt):
    assert run_ranks(_fused_vs_composed, 4, fmt, [17, 0, 40, 64], timeout=120) == [True] * 4


@pytest.mark.parametrize("portable", [False, True])
def test_fused_equals_composed_over_nvshmem_views(portable):
    # nvshmem within one domain (emulated): the peers' buffers read through nvshmem_ptr views; with
    # portable the rows move through the Triton copy kernel and sum in torch ops, as on a GPU.
    assert run_ranks(_fused_vs_composed, 2, "bf16", [9, 30], "nvemu", portable, timeout=120) == [True] * 2


def _outside_the_domain(rank, world_size, transport):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 8, TOPK, transport=resolve_transport(transport), timeout=10)
    w13, w2 = _weights(rank, world_size, "bf16")
    with pytest.raises(ValueError, match="directly addressable"):
        fused_moe(
            torch.zeros(2, HIDDEN).bfloat16(),
            torch.zeros(2, TOPK, dtype=torch.int64),
            torch.ones(2, TOPK),
            w13,
            w2,
            buf,
        )
    return True


@pytest.mark.parametrize("transport", ["torch", "nvemu-nop2p"])
def test_fused_needs_the_domain(transport):
    assert run_ranks(_outside_the_domain, 2, transport, timeout=40) == [True, True]


def _bad_input(rank, world_size):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 8, TOPK, timeout=10)
    w13, w2 = _weights(rank, world_size, "bf16")
    idx = torch.zeros(2, TOPK, dtype=torch.int64)
    if rank == 1:
        idx[0, 0] = -5
    with pytest.raises(ValueError, match=r"rank 1: topk_idx\[0, 0\] = -5"):
        fused_moe(torch.zeros(2, HIDDEN).bfloat16(), idx, torch.ones(2, TOPK), w13, w2, buf)
    # a bias dtype the fused reduction does not take is refused before anything moves, on every rank
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 8, TOPK, timeout=10)
    bias = torch.zeros(2, HIDDEN, dtype=torch.float16 if rank == 0 else torch.bfloat16)
    with pytest.raises(ValueError, match=r"rank 0: bias must be bfloat16 or float32"):
        fused_moe(torch.zeros(2, HIDDEN).bfloat16(), idx.clamp(min=0), torch.ones(2, TOPK), w13, w2, buf, bias=bias)
    # what the expert MLP would refuse only after the rows moved is refused before, on every rank, and the
    # buffer goes on: an alignment the contiguous GEMM cannot take, weights for another number of experts
    g = torch.Generator().manual_seed(rank)
    x, good = torch.randn(4, HIDDEN, generator=g).bfloat16(), torch.randint(0, EXPERTS, (4, TOPK), generator=g)
    wts = torch.rand(4, TOPK, generator=g)
    with pytest.raises(ValueError, match=r"rank 1: expert_alignment must be a multiple of 128"):
        fused_moe(x, good, wts, w13, w2, buf, expert_alignment=4 if rank == 1 else 128)
    with pytest.raises(ValueError, match=r"rank 0: w13 and w2 must hold this rank's 4 local experts"):
        fused_moe(x, good, wts, *((w13[:3], w2[:3]) if rank == 0 else (w13, w2)), buf)
    recv_x, _, _, _, handle = buf.dispatch(x, good, wts, expand=True, expert_alignment=128)
    composed = buf.combine(expert_mlp(recv_x, "contiguous", w13, w2, m_indices=EPBuffer.m_indices(handle)), handle)
    assert_bitwise_equal(fused_moe(x, good, wts, w13, w2, buf), composed, f"{rank=} after the refused calls")
    return True


def test_fused_bad_input_everywhere():
    assert run_ranks(_bad_input, 2, timeout=40) == [True, True]
