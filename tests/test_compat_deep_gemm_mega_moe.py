"""epkit.compat.deep_gemm's Mega MoE interface (``get_symm_buffer_for_mega_moe``, ``transform_weights_for_mega_moe``,
``fp8_fp4_mega_moe``, ``bf16_mega_moe``) and the GEMM features its composed path needs (``recipe=(1, 1, 32)`` with the
psum layout, ``compiled_dims=''``), against float64 references written here: the layer on 2 CPU ranks, every rank's
tokens and weights gathered, each token's experts computed independently in float64."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import epkit.compat.deep_gemm as deep_gemm
from epkit.testing.multiprocess import run_ranks

HIDDEN, INTER, EXPERTS, TOPK, N_MAX = 256, 128, 8, 4, 48
_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _fp4_values(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """float64 ``[..., N, K]`` of packed FP4 ``[..., N, K/2]`` (even element in the low nibble) with float32 1x32
    scales ``[..., N, K/32]``."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    return _E2M1[codes] * sf.double().repeat_interleave(32, dim=-1)


def _fp8_values(x: torch.Tensor, packed_sf: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, K]`` of e4m3 ``x`` with packed UE8M0 int32 1x32 scales ``[M, K/128]`` (byte j: group 4c + j)."""
    exps = packed_sf.contiguous().view(torch.uint8).double()
    return x.double() * torch.pow(2.0, exps - 127).repeat_interleave(32, dim=-1)


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """float64 SwiGLU expert: ``w1 [2I, H]`` gate rows then up rows, ``w2 [H, I]``."""
    gate, up = (x @ w1.T).chunk(2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    return (gate * torch.sigmoid(gate) * up) @ w2.T


# Single process: the weight layout and the GEMM features


def test_weight_layout_is_deepgemms_and_the_layer_reads_it_back():
    from epkit.compat._details.deep_gemm_mega_layout import plain_weights

    g, n, k = 2, 256, 64
    w = torch.randn(g, n, k).bfloat16()
    sf = torch.randint(0, 255, (g, n, k // 128 + 1), dtype=torch.int32)
    packed = torch.randint(-128, 127, (g, n, k // 2), dtype=torch.int8)
    (l1, l1_sf), (l2, l2_sf) = deep_gemm.transform_weights_for_mega_moe((packed, sf), (packed, sf))
    bf16_l1, bf16_l2 = deep_gemm.transform_weights_for_mega_moe(w, w)
    for r in range(n):  # gate rows 0..7, up rows 0..7, gate rows 8..15, ...
        run, within = divmod(r, 16)
        src = run * 8 + within if within < 8 else n // 2 + run * 8 + within - 8
        assert torch.equal(bf16_l1[:, r], w[:, src]) and torch.equal(l1[:, r], packed[:, src]), r
        block, rest = divmod(r, 128)  # the scales: row 32 j + i of a 128-row block at 4 i + j
        i, j = divmod(rest, 4)
        assert torch.equal(l2_sf[:, r], sf[:, block * 128 + j * 32 + i]), r
    assert torch.equal(bf16_l2, w)
    (p1, p1_sf), (p2, p2_sf) = plain_weights("f", (l1, l1_sf), (l2, l2_sf), fp4=True)
    assert torch.equal(p1, packed) and torch.equal(p1_sf, sf) and torch.equal(p2, packed) and torch.equal(p2_sf, sf)
    with pytest.raises(ValueError, match="transform_weights_for_mega_moe: l1_weights' N = 12"):
        deep_gemm.transform_weights_for_mega_moe(w[:, :12], w)


@pytest.mark.parametrize("psum", [False, True])
def test_m_grouped_fp8_fp4_with_1x32_activation_scales(psum):
    g, n, k = 3, 64, 256
    torch.manual_seed(1)
    rows = torch.full((384,), -1, dtype=torch.int32)
    rows[:70], rows[128:300] = 0, 2  # group 1 empty, padding rows between
    ends = torch.tensor([70, 70, 300], dtype=torch.int32)  # psum: each group from the previous end aligned to 128
    x, x_sf = deep_gemm.per_token_cast_to_fp8(
        torch.randn(384, k), use_ue8m0=True, gran_k=32, use_packed_ue8m0=True
    )  # fmt: skip
    w = torch.empty((g, n, k // 2), dtype=torch.int8)
    w_sf = torch.empty((g, n, k // 32), dtype=torch.float32)
    for grp in range(g):
        w[grp], w_sf[grp] = deep_gemm.per_token_cast_to_fp4(torch.randn(n, k), use_ue8m0=True, gran_k=32)
    d = torch.full((384, n), float("nan"), dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous(
        (x, x_sf), (w, w_sf), d, ends if psum else rows, use_psum_layout=psum, recipe=(1, 1, 32)
    )
    a, b = _fp8_values(x, x_sf), _fp4_values(w, w_sf)
    for grp, sel in ((0, slice(0, 70)), (2, slice(128, 300))):
        assert calc_diff(d[sel], a[sel] @ b[grp].T) < 1e-5, f"{grp=} {psum=}"
    assert torch.equal(d[70:128], torch.zeros(58, n, dtype=torch.bfloat16)) and not d[300:].float().abs().sum()
    with pytest.raises(ValueError, match="m_grouped_fp8_fp4_gemm_nt_contiguous: a's 1x32 scales"):
        deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous((x, x_sf[:, :1]), (w, w_sf), d, rows, recipe=(1, 1, 32))


def test_bf16_psum_with_no_compiled_dims():
    a, b = torch.randn(256, 64).bfloat16(), torch.randn(2, 32, 64).bfloat16()
    d = torch.empty(256, 32, dtype=torch.bfloat16)
    ends = torch.tensor([100, 200], dtype=torch.int32)
    deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, ends, compiled_dims="", use_psum_layout=True)
    assert calc_diff(d[:100], a[:100].double() @ b[0].double().T) < 1e-5
    assert calc_diff(d[128:200], a[128:200].double() @ b[1].double().T) < 1e-5


# Two CPU ranks: the layer


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, t)
    return out


def _rank_inputs(rank: int, fp8: bool, local: int):
    g = torch.Generator().manual_seed(100 + rank)
    t = (37, 5)[rank]
    x = torch.randn(t, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(t)])
    ids[0, 2] = -1  # a slot naming no expert
    weights = torch.rand(t, TOPK, generator=g)
    weights[ids < 0] = 0
    w1 = torch.randn(local, 2 * INTER, HIDDEN, generator=g).bfloat16()
    w2 = torch.randn(local, HIDDEN, INTER, generator=g).bfloat16() * 0.1
    return x, ids, weights, w1, w2


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.empty((w.shape[0], w.shape[1], w.shape[2] // 2), dtype=torch.int8)
    sf = torch.empty((w.shape[0], w.shape[1], w.shape[2] // 32), dtype=torch.float32)
    for grp in range(w.shape[0]):
        packed[grp], sf[grp] = deep_gemm.per_token_cast_to_fp4(w[grp], use_ue8m0=True, gran_k=32)
    return packed, sf


def _layer_case(rank: int, world: int, mma: str) -> None:
    fp8, local, clamp = mma == "fp8xfp4", EXPERTS // world, 1.5
    buf = deep_gemm.get_symm_buffer_for_mega_moe(dist.group.WORLD, EXPERTS, N_MAX, TOPK, HIDDEN, INTER, mma_type=mma)
    x, ids, weights, w1, w2 = _rank_inputs(rank, fp8, local)
    if fp8:
        xq = deep_gemm.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
        buf.x[: len(x)].copy_(xq[0])
        buf.x_sf[: len(x)].copy_(xq[1])
        l1, l2 = _fp4(w1), _fp4(w2)
        x_ref, w1_ref, w2_ref = _fp8_values(*xq), _fp4_values(*l1), _fp4_values(*l2)
    else:
        buf.x[: len(x)].copy_(x)
        l1, l2 = w1, w2
        x_ref, w1_ref, w2_ref = x.double(), w1.double(), w2.double()
    buf.topk_idx[: len(x)].copy_(ids)
    buf.topk_weights[: len(x)].copy_(weights)
    t1, t2 = deep_gemm.transform_weights_for_mega_moe(l1, l2)
    stats = torch.arange(local, dtype=torch.int32)
    y = torch.empty((len(x), HIDDEN), dtype=torch.bfloat16)
    layer = deep_gemm.fp8_fp4_mega_moe if fp8 else deep_gemm.bf16_mega_moe
    layer(y=y, l1_weights=t1, l2_weights=t2, sym_buffer=buf, cumulative_local_expert_recv_stats=stats,
          activation_clamp=clamp, fast_math=True)  # fmt: skip

    every_w1, every_w2, every_ids = _gathered(w1_ref), _gathered(w2_ref), _gathered(ids)
    ref = torch.zeros(len(x), HIDDEN, dtype=torch.float64)
    for t in range(len(x)):
        for j, e in enumerate(ids[t].tolist()):
            if e >= 0:
                owner, le = divmod(e, local)
                ref[t] += weights[t, j].double() * _mlp(x_ref[t], every_w1[owner][le], every_w2[owner][le], clamp)
    diff = calc_diff(y, ref)
    assert diff < (2e-3 if fp8 else 1e-4), f"{mma=} {rank=} {diff=}"
    mine = torch.cat(every_ids).flatten()
    counts = torch.bincount(mine[(mine >= rank * local) & (mine < (rank + 1) * local)] - rank * local, minlength=local)
    assert torch.equal(stats, torch.arange(local, dtype=torch.int32) + counts.int()), f"{mma=} {stats=} {counts=}"

    # the same call again gives the same bits (deterministic); a bad call on one rank fails on both
    y2 = torch.empty_like(y)
    layer(y=y2, l1_weights=t1, l2_weights=t2, sym_buffer=buf, activation_clamp=clamp)
    assert torch.equal(y, y2), mma
    bad = y[:, :128] if rank == 1 else y
    with pytest.raises(ValueError, match=f"{layer.__name__} rejected on every rank .*rank 1.*y must be a bfloat16"):
        layer(y=bad, l1_weights=t1, l2_weights=t2, sym_buffer=buf)
    dist.barrier()
    buf.destroy()
    assert buf.x is None


def _run(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    for mma in ("bf16xbf16", "fp8xfp4"):
        _layer_case(rank, world, mma)
    return "ok"


def test_mega_moe_layers_on_two_cpu_ranks():
    assert run_ranks(_run, 2, timeout=120) == ["ok", "ok"]
