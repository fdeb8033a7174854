"""gpu_check section ``logical_to_physical``: ``epkit.experts.logical_to_physical`` bit for bit against its
reference on every backend (12 experts over EP6 and 384 over EP64, several ranks and token offsets), then its
latency at the bench sizes against the vectorised torch path on the same device."""

from __future__ import annotations

import torch

from gpu_sections.common import Ctx, backends_for, bits_equal, record_check, run_backends

__all__ = ["sec_logical_to_physical"]


def sec_logical_to_physical(ctx: Ctx, res: dict):
    from epkit.experts import logical_to_physical, logical_to_physical_reference

    dev = ctx.device
    cases = _cases(ctx)

    def correctness(backend: str) -> None:
        for label, placement, topk, ranks, offsets in cases:
            pd, td = placement.to(dev), topk.to(dev)
            for rank in ranks:
                for off in offsets:
                    ctx.check(f"correctness[{backend}] {label} rank {rank}")
                    want = logical_to_physical_reference(topk, placement, rank, off)
                    got = logical_to_physical(td, pd, rank, token_offset=off, backend=backend)
                    ok, detail = bits_equal(got, want)
                    record_check(res, f"{backend}: {label} ep_rank={rank} token_offset={off}", ok, detail)

    run_backends(ctx, res, backends_for(ctx, ("triton",), ("cpu", "triton")), correctness)
    backend = "triton" if ctx.cuda else "cpu"
    lat = res["latency"] = {}
    if res["backends"].get(backend) == "ok":
        _latency(ctx, res, backend, lat)
    if lat:
        e = lat["16384x6"] if "16384x6" in lat else next(iter(lat.values()))
        res["summary"] = (
            f"{backend} {e[backend]['wall']['median_ms'] * 1e3:.1f} us/call wall, "
            f"{e['speedup_wall_vs_torch']:.1f}x vectorised torch"
        )
    return None


def _cases(ctx: Ctx) -> list[tuple]:
    """``(label, placement, topk ids incl. -1, ranks, token offsets)``: random replicated placements on the CPU."""
    from epkit.experts import ExpertPlacement

    g = torch.Generator().manual_seed(3)
    phy2log = torch.cat([torch.arange(12), torch.randint(0, 12, (6,), generator=g)])
    small = ExpertPlacement.from_phy2log(phy2log[torch.randperm(18, generator=g)], num_logical=12, ep_size=6)
    big_phy = torch.cat([torch.arange(384), torch.randint(0, 384, (64,), generator=g)])
    big = ExpertPlacement.from_phy2log(big_phy[torch.randperm(448, generator=g)], num_logical=384, ep_size=64)
    tokens = 512 if ctx.dry else 4096
    return [
        ("12 experts EP6", small, torch.randint(-1, 12, (41, 4), generator=g, dtype=torch.int32), range(6), (0, 7)),
        (
            f"384 experts EP64 {tokens}x6",
            big,
            torch.randint(-1, 384, (tokens, 6), generator=g, dtype=torch.int64),
            (0, 5, 63),
            (0, 12345),
        ),
    ]


def _latency(ctx: Ctx, res: dict, backend: str, lat: dict) -> None:
    """Latency at the bench sizes (bench_eplb.py: 4096 x 6; experts._bench_main: 16384 x 6), 384 experts EP64,
    into ``lat``: events around one call and host-inclusive wall time, against the vectorised torch path."""
    from epkit.experts import ExpertPlacement, logical_to_physical, logical_to_physical_cpu

    dev = ctx.device
    placement = ExpertPlacement.default(384, 64, 1).to(dev)
    it, calls = (5, 3) if ctx.dry else (30, 20)
    for n in (4096,) if ctx.dry else (4096, 16384):
        ctx.check(f"latency {n}x6")
        topk = torch.randint(0, 384, (n, 6), dtype=torch.int32, device=dev)
        fn = lambda t=topk: logical_to_physical(t, placement, 5, backend=backend, check_index=False)  # noqa: E731
        peer = lambda t=topk: logical_to_physical_cpu(t, placement, 5, 0)  # noqa: E731
        ok = torch.equal(fn(), peer())
        record_check(res, f"{backend}: {n}x6 equals the vectorised torch path on {dev.type}", ok)
        lat[f"{n}x6"] = {
            backend: {"events_one_call": ctx.time_op(fn, iters=it), "wall": ctx.time_wall(fn, calls=calls)},
            "torch_vectorised_same_device": {
                "events_one_call": ctx.time_op(peer, iters=it),
                "wall": ctx.time_wall(peer, calls=calls),
            },
        }
        e = lat[f"{n}x6"]
        e["speedup_wall_vs_torch"] = (
            e["torch_vectorised_same_device"]["wall"]["median_ms"] / e[backend]["wall"]["median_ms"]
        )
        ctx.log(f"{n}x6: {e[backend]['wall']['median_ms'] * 1e3:.1f} us/call wall ({backend})")
