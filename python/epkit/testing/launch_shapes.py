"""The launches rung 3 compiles (``epkit.testing.launches``): recorded from real calls, never written by hand.

- :func:`record_rank_runs`: EPBuffer on the device kernels (their source under the Triton interpreter) on
  ``W`` = 1, 2, 4, 8 CPU ranks over shm: normal dispatch (FP8 rows with scales, bf16 rows; expanded or not;
  with and without weights; a full batch, an empty one, uneven ones), a cached dispatch, combines (bf16 and
  float32 rows, no bias, one, two), low-latency pairs (FP8 and bf16, first and later calls), ``fused_moe``.
  Every rank records what its host launchers make for CUDA (their CUDA twins, ``epkit.kernels.triton.launch``).
- :func:`record_ops`: every other Triton op of the project on CPU tensors with ``backend="triton"``: row
  gathers (bf16 and float32 rows, int32 and int64 ids, one row), CP mirror indices, Engram hashing, logical to
  physical ids, row copies by address, the grouped GEMMs (FP8, FP8 x FP4, bf16; contiguous, psum, masked).
- :func:`record_target_shapes`: no kernel runs, the launchers are called as for CUDA at the sizes the GPU
  run measures (DeepSeek-V3: hidden 7168, 256 experts, top-8; 4096 tokens a rank in normal mode, 128 in low
  latency; ``W`` = 8, and ``W`` = 1 whose one-rank tiles are the widest; ``W`` = 8 on 24 CTAs, a budget that
  leaves most SMs to compute) and the GEMMs at an expert MLP's.

:func:`record_all` returns the three merged (one entry per specialization class).
"""

from __future__ import annotations

import os

import torch

from epkit.testing.launches import merge, recording

__all__ = ["record_all", "record_ops", "record_rank_runs", "record_target_shapes"]

_HIDDEN, _EXPERTS, _TOPK, _N_MAX, _LL_MAX = 256, 16, 4, 64, 16


def _routing(rank: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed * 97 + rank)
    idx = torch.randint(-1, _EXPERTS, (tokens, _TOPK), generator=g)
    x = torch.randn(tokens, _HIDDEN, generator=g).bfloat16()
    w = torch.rand(tokens, _TOPK, generator=g)
    return x, idx, w


def _rank_body(rank: int, world: int, brief: bool) -> list[dict]:
    """One rank's calls on the device kernels (see the module docstring), ``brief``: the first dispatch and
    combine and two low-latency pairs only; returns its records."""
    import torch.distributed as dist

    from epkit.collectives.ep_buffer import EPBuffer
    from epkit.quant import per_token_group_cast_to_fp8

    os.environ["EPKIT_EP_KERNELS"] = "device"
    tokens = [_N_MAX, 0, 9, 40][rank % 4] if world > 1 else _N_MAX  # rank 0 a full batch, rank 1 an empty one
    with recording(f"W={world} rank={rank}") as rec:
        buf = EPBuffer(dist.group.WORLD, _HIDDEN, _EXPERTS, _N_MAX, _TOPK, transport="shm", timeout=60)
        x, idx, w = _routing(rank, tokens, 1)
        calls = [(True, False, True), (False, True, True), (True, True, False)][: 1 if brief else 3]
        for call, (fp8, expand, weights) in enumerate(calls):
            rec.label = f"W={world} rank={rank} dispatch#{call + 1} {fp8=} {expand=}"
            inp = per_token_group_cast_to_fp8(x.float(), 128) if fp8 else x
            recv, _, _, _, handle = buf.dispatch(inp, idx, w if weights else None, expand=expand, expert_alignment=4)
            rows = (recv[0] if fp8 else recv).shape[0]
            rec.label = f"W={world} rank={rank} combine#{call + 1}"
            y = torch.ones(rows, _HIDDEN, dtype=torch.float32 if call == 2 else torch.bfloat16)
            buf.combine(y, handle, bias=[None, (x,), (x.float(), x)][call])
        if not brief:  # a per-token rank order (DeepEP V2's combine), the biases first
            rec.label = f"W={world} rank={rank} combine in an order"
            order = torch.arange(world - 1, -1, -1, dtype=torch.int32).repeat(x.shape[0], 1)
            buf.combine(y, handle, bias=(x, x), order=order)
        rec.label = f"W={world} rank={rank} cached dispatch"
        buf.dispatch(inp, handle=handle)
        for call, fp8 in enumerate([True, True, False][: 2 if brief else 3]):
            rec.label = f"W={world} rank={rank} low-latency pair#{call + 1} {fp8=}"
            n = min(tokens, _LL_MAX)
            recv_x, _, ll_handle, _ = buf.low_latency_dispatch(x[:n], idx[:n], _LL_MAX, use_fp8=fp8)
            y = torch.ones((_EXPERTS // world, world * _LL_MAX, _HIDDEN), dtype=torch.bfloat16)
            buf.low_latency_combine(y, idx[:n], w[:n], ll_handle)
        buf.close()
    return rec.records()


def record_rank_runs(worlds=(1, 2, 4, 8), brief_from: int = 8, timeout: float = 600) -> list[dict]:
    """The EP kernels' launches on ``worlds`` CPU ranks (one run per world size; see the module docstring);
    from ``brief_from`` ranks on, the brief set of calls (eight interpreted ranks share a CI machine's cores)."""
    from epkit.testing.multiprocess import run_ranks

    out = []
    for world in worlds:
        out.extend(run_ranks(_rank_body, world, world >= brief_from, timeout=timeout))
    return merge(*out)


def _fused(rank: int, world: int) -> list[dict]:
    import torch.distributed as dist

    from epkit.collectives.ep_buffer import EPBuffer
    from epkit.collectives.fused_moe import fused_moe
    from epkit.quant import per_block_cast_to_fp8

    os.environ["EPKIT_EP_KERNELS"] = "device"
    with recording(f"fused_moe W={world} rank={rank}") as rec:
        buf = EPBuffer(dist.group.WORLD, _HIDDEN, _EXPERTS, _N_MAX, _TOPK, transport="shm", timeout=60)
        g = torch.Generator().manual_seed(3)
        local, inter = _EXPERTS // world, 128
        w13 = per_block_cast_to_fp8(torch.randn(local, 2 * inter, _HIDDEN, generator=g) / _HIDDEN**0.5)
        w2 = per_block_cast_to_fp8(torch.randn(local, _HIDDEN, inter, generator=g) / inter**0.5)
        x, idx, w = _routing(rank, [17, 0][rank % 2], 2)
        fused_moe(x, idx, w, w13, w2, buf, backend="triton")
        buf.close()
    return rec.records()


def record_ops() -> list[dict]:
    """Every non-EP Triton op on CPU tensors with ``backend="triton"`` (see the module docstring), and
    ``fused_moe`` on 2 ranks."""
    from epkit import engram, experts, gather, grouped_gemm
    from epkit.cp_mirror import prepare_cp_mirror
    from epkit.kernels.triton.copy_rows import copy_rows_by_address
    from epkit.testing.multiprocess import run_ranks

    with recording("ops") as rec:
        g = torch.Generator().manual_seed(0)
        for dtype, rows in ((torch.bfloat16, 37), (torch.float32, 1)):
            x = torch.randn(50, 2048, generator=g).to(dtype)
            for index_dtype in (torch.int32, torch.int64):
                gather.gather_rows(x, torch.randint(-1, 50, (rows,), generator=g).to(index_dtype), backend="triton")
        cu_q, cu_k = torch.tensor([0, 1000, 4000], dtype=torch.int32), torch.tensor([0, 1500, 4500], dtype=torch.int32)
        prepare_cp_mirror(cu_q, cu_k, 8, 3, (1, 4, 128), backend="triton")
        ids = torch.randint(0, 1000, (300, 3), generator=g, dtype=torch.int32)
        mult = torch.randint(0, 2**40, (2, 3), generator=g, dtype=torch.int64) * 2 + 1
        vocab = torch.tensor([2147483647, 2147483629, 1000003, 999983, 646403, 65537, 257, 13], dtype=torch.int32)
        engram.engram_hash(ids, mult, vocab.reshape(2, 2, 2), torch.zeros((2, 4), dtype=torch.int32), backend="triton")
        placement = experts.ExpertPlacement.default(64, ep_size=8, min_num_extra_experts=1)
        for idx_dtype in (torch.int32, torch.int64):
            topk = torch.randint(-1, 64, (100, 8), generator=g).to(idx_dtype)
            experts.logical_to_physical(topk, placement, 3, backend="triton")
        src = torch.randn(8, 64, generator=g)
        dst = torch.empty_like(src)
        addrs = torch.arange(8, dtype=torch.int64) * 256
        guard = torch.zeros(1, dtype=torch.int64)
        copy_rows_by_address(dst.data_ptr() + addrs, src.data_ptr() + addrs, 256, 8, guard)
        for kind in ("fp8", "fp8_fp4", "bf16"):
            n, k = 128, 256
            counts = [37, 0, 5]
            m_idx = grouped_gemm.build_m_indices(counts, 128 if kind != "bf16" else None)
            a, b, _, _ = grouped_gemm.make_inputs(kind, 3, m_idx.numel(), n, k, masked=False, seed=1)
            d = torch.empty(m_idx.numel(), n, dtype=torch.bfloat16)
            getattr(grouped_gemm, f"m_grouped_{kind}_gemm_nt_contiguous")(a, b, d, m_idx, backend="triton")
            ends, start = [], 0
            for c in counts:  # psum layout: a group starts where the previous one ended, rounded up to 128
                ends.append(start + c)
                start = -(-(start + c) // 128) * 128
            ends = torch.tensor(ends, dtype=torch.int32)
            getattr(grouped_gemm, f"m_grouped_{kind}_gemm_nt_contiguous")(
                a, b, torch.empty_like(d), ends, use_psum_layout=True, backend="triton"
            )
            a, b, _, _ = grouped_gemm.make_inputs(kind, 3, 40, n, k, masked=True, seed=2)
            masked_m = torch.tensor([40, 0, 17], dtype=torch.int32)
            d = torch.empty(3, 40, n, dtype=torch.float32)
            getattr(grouped_gemm, f"m_grouped_{kind}_gemm_nt_masked")(a, b, d, masked_m, 20, backend="triton")
    return merge(rec.records(), *run_ranks(_fused, 2, timeout=600))


def record_target_shapes() -> list[dict]:
    """The launchers called as for CUDA at the GPU run's sizes (see the module docstring); nothing runs."""
    from epkit.kernels.triton.launch import as_cuda

    with recording("target shapes") as rec, as_cuda():
        # 24 CTAs: about what DeepEP's intranode kernels take
        for world, rank, ctas in ((8, 1, 128), (1, 0, 128), (8, 0, 24)):
            rec.label = f"target W={world} rank={rank}" + (f" ctas={ctas}" if ctas != 128 else "")
            _ep_target(world, rank, ctas)
        rec.label = "target grouped GEMM"
        _gemm_target()
    return rec.records()


def _ep_target(world: int, rank: int, ctas: int, hidden: int = 7168, num_experts: int = 256, topk: int = 8) -> None:
    """Every EP launcher once at the target sizes, with the addresses laid out as ``DeviceState`` lays them."""
    from epkit.collectives.ep.device_state import device_layout
    from epkit.kernels.triton import ep_low_latency as ll
    from epkit.kernels.triton.ep_layout import STATUS_DETAIL, STATUS_WORDS

    n_ll, n, tokens = 128, 4096, 4096
    lay = device_layout(world, hidden, num_experts, topk, n_ll, n)
    bases = [0x7F00_0000_0000 + r * (1 << 36) for r in range(world)]  # one rank's memory per 64 GiB
    table = {
        k: torch.tensor([b + lay[k] for b in bases]) for k in ("ll_dispatch", "ll_combine", "notify", "agree", "rows")
    }
    local = {k: bases[rank] + lay[k] for k in table}
    status = torch.zeros(STATUS_WORDS + STATUS_DETAIL * world, dtype=torch.int64)
    cuda = torch.device("cpu")  # CPU tensors: their dtypes and alignment are what a launch specializes on
    common = dict(rank=rank, world=world, text=lay["text"], ctrl=bases[rank], notices=bases[rank] + 8 * 4096,
                  ctrl_table=torch.tensor(bases), status=status.data_ptr(), clock=status.data_ptr(),
                  timeout_ns=int(100e9), device=cuda, ctas=ctas)  # fmt: skip
    geo = ll.LLGeometry(
        num_experts=num_experts, num_topk=topk, hidden=hidden, header=lay["header"],
        dispatch_table=table["ll_dispatch"], combine_table=table["ll_combine"], dispatch_local=local["ll_dispatch"],
        combine_local=local["ll_combine"], dispatch_area=lay["ll_dispatch_area"], dispatch_msg=lay["ll_dispatch_msg"],
        combine_area=lay["ll_combine_area"], combine_msg=lay["ll_combine_msg"], **common,
    )  # fmt: skip
    local_experts = num_experts // world
    x = torch.empty(n_ll, hidden, dtype=torch.bfloat16)
    idx = torch.empty(n_ll, topk, dtype=torch.int64)
    route = torch.empty(3, n_ll, topk, dtype=torch.int32)
    text = torch.zeros(lay["text"], dtype=torch.uint8)
    counts = torch.empty(world, local_experts, dtype=torch.int64)
    for fp8 in (True, False):
        ll.ll_dispatch_send(geo, x, idx, route, text, n_ll, fp8, False)
        recv_x = torch.empty(local_experts, world * n_ll, hidden, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        recv_s = torch.empty(local_experts, world * n_ll, hidden // 128) if fp8 else None
        rc, load = torch.empty(local_experts, dtype=torch.int32), torch.empty(local_experts, dtype=torch.int64)
        ll.ll_dispatch_recv(geo, recv_x, recv_s, counts, rc, load, n_ll, fp8)
    y = torch.empty(local_experts, world * n_ll, hidden, dtype=torch.bfloat16)
    ll.ll_combine_send(geo, y, counts, n_ll, (5, 1))
    ll.ll_combine_recv(geo, x, torch.empty(n_ll, topk), route, n_ll, (5, 1))
    _normal_target(common, table, local, lay, (world, n, tokens), (hidden, num_experts, topk), text)


def _normal_target(common: dict, table: dict, local: dict, lay: dict, counts_: tuple, shape: tuple, text) -> None:
    """:func:`_ep_target`'s normal-mode launches (plain and worst-case dispatches, their combines):
    ``counts_`` ``(world, num_max_tokens_per_rank, tokens)``, ``shape`` ``(hidden, num_experts, topk)``."""
    from epkit.kernels.triton import ep_combine as cb
    from epkit.kernels.triton import ep_normal as nm
    from epkit.kernels.triton import ep_normal_recv as nr

    (world, n, tokens), (hidden, num_experts, topk) = counts_, shape
    local_experts = num_experts // world
    ngeo = nm.NormalGeometry(
        num_experts=num_experts, num_topk=topk, cap=world * n, notify_table=table["notify"],
        rows_table=table["rows"], rows_local=local["rows"], notify_area=lay["notify_area"],
        notify_msg=lay["notify_msg"], **common,
    )  # fmt: skip
    cgeo = cb.CombineGeometry(
        num_topk=topk, hidden=hidden, n_max=n, agree_table=table["agree"], rows_table=table["rows"],
        rows_local=local["rows"], agree_area=lay["agree_area"], agree_msg=lay["agree_msg"], **common,
    )  # fmt: skip
    z = ngeo.sizes()
    idx = torch.empty(tokens, topk, dtype=torch.int64)
    counts = torch.empty(z["P_P2"], z["W_P2"] + z["E_P2"] + 1, dtype=torch.int32)
    lay_words = torch.empty(ngeo.layout_words(), dtype=torch.int64)
    summary = torch.zeros(nm.summary_words(world, local_experts), dtype=torch.int64)
    nm.layout(ngeo, idx, counts)
    nm.notify(ngeo, counts, lay_words, text, summary, 0, 1, 128, 1)
    worst = (world * n, -(-(world * n * min(topk, local_experts) + 127 * local_experts) // 128) * 128)  # worst_shape
    nm.notify(ngeo, counts, lay_words, text, summary, 0, 1 + 16 * world * n, 128, 2, worst)
    send_pos = torch.empty(tokens, world, dtype=torch.int32)
    xq = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn)
    scales = torch.empty(tokens, hidden // 128)
    nm.dispatch_send(ngeo, xq, scales, idx, torch.empty(tokens, topk), lay_words, send_pos)
    rows = world * tokens // 2
    for expand in (False, True):
        out = {"x": torch.empty(rows, hidden, dtype=torch.float8_e4m3fn), "s": torch.empty(rows, hidden // 128),
               "idx": torch.empty(rows, topk, dtype=torch.int64), "w": torch.empty(rows, topk)}  # fmt: skip
        if expand:
            out.update(rows=torch.empty(rows, dtype=torch.int64), slot=torch.empty(rows, topk, dtype=torch.int64),
                       m=torch.empty(rows, dtype=torch.int32))  # fmt: skip
        nr.dispatch_recv(ngeo, out, lay_words, rows, 128, hidden, 4 * (hidden // 128))
        nr.dispatch_recv(ngeo, out, lay_words, -1, 128, hidden, 4 * (hidden // 128))  # a worst-case dispatch's
    agreed = torch.zeros(4 * world + 2, dtype=torch.int64)
    cb.agree(cgeo, text, agreed, 0, (5, 1), 1)
    cb.agree(cgeo, text, agreed, 0, (5, 2), 2, 1)  # judged on the device: after a worst-case dispatch
    y = torch.empty(rows, hidden, dtype=torch.bfloat16)
    cb.combine_send(cgeo, y, lay_words, ngeo.tail(), rows)
    cb.combine_send(cgeo, y, lay_words, ngeo.tail(), rows, out["slot"], torch.empty(rows, topk))
    cb.combine_send(cgeo, y, lay_words, ngeo.tail(), -1)  # after a worst-case dispatch
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    cb.combine_reduce(cgeo, out, send_pos, [])
    cb.combine_reduce(cgeo, out, send_pos, [out, out], torch.empty(tokens, world, dtype=torch.int32))  # V2's order


def _gemm_target() -> None:
    """The grouped GEMMs of one expert MLP of DeepSeek-V3 (256 experts over 8 ranks: 32 local experts; gate/up
    N = 4096, K = 7168; down N = 7168, K = 2048) in the contiguous (prefill) and masked (decode) layouts."""
    from epkit.kernels.triton import grouped_gemm as gg
    from epkit.kernels.triton.grouped_gemm_persistent import stand_ins

    groups, rows = 32, 128
    for kind in ("fp8", "fp8_fp4", "bf16"):
        for n, k in ((4096, 7168), (7168, 2048)):
            a, sfa, b, sfb, d = stand_ins(kind, False, groups, rows, n, k)
            m_idx = torch.arange(groups, dtype=torch.int32).repeat_interleave(rows)
            gg.contiguous_launcher(kind, a, sfa, b, sfb, d, m_idx)()
            a, sfa, b, sfb, d = stand_ins(kind, True, groups, rows, n, k)
            gg.masked_launcher(kind, a, sfa, b, sfb, d, torch.full((groups,), rows, dtype=torch.int32), rows)()
    # the psum layout, and the persistent kernel's other configurations (BLOCK_N 256; the e2m1 decode by byte
    # permutes), as a config override or a tuned table would launch them
    a, sfa, b, sfb, d = stand_ins("fp8", False, groups, rows, 4096, 7168)
    ends = torch.arange(1, groups + 1, dtype=torch.int32) * rows
    m_idx = torch.arange(groups, dtype=torch.int32).repeat_interleave(rows)
    gg.contiguous_launcher("fp8", a, sfa, b, sfb, d, ends, use_psum_layout=True)()
    wide = dict(kernel="persistent", BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
    for kind, cfg in (("fp8", wide), ("fp8_fp4", dict(wide, BLOCK_M=128, BLOCK_N=128, FP4_DECODE="prmt"))):
        a, sfa, b, sfb, d = stand_ins(kind, False, groups, rows, 4096, 7168)
        gg.contiguous_launcher(kind, a, sfa, b, sfb, d, m_idx, cfg)()
    # the tile-grid kernel, which a config without "kernel": "persistent" (a tuned table's) launches
    for kind, masked, block_m, out in (("fp8", False, 128, torch.bfloat16), ("fp8", True, 64, torch.float32),
                                       ("fp8_fp4", False, 128, torch.bfloat16)):  # fmt: skip
        cfg = dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, num_warps=8 if block_m == 128 else 4, num_stages=3)
        a, sfa, b, sfb, d = stand_ins(kind, masked, groups, rows, 4096, 7168, out)
        if masked:
            gg.masked_launcher(kind, a, sfa, b, sfb, d, torch.full((groups,), rows, dtype=torch.int32), rows, cfg)()
        else:
            m_idx = torch.arange(groups, dtype=torch.int32).repeat_interleave(rows)
            gg.contiguous_launcher(kind, a, sfa, b, sfb, d, m_idx, cfg)()


def record_all() -> list[dict]:
    """Every launch rung 3 compiles: :func:`record_rank_runs`, :func:`record_ops`, :func:`record_target_shapes`."""
    return merge(record_rank_runs(), record_ops(), record_target_shapes())
