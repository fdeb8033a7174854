"""gpu_check section ``prepare_cp_mirror``: ``epkit.cp_mirror.prepare_cp_mirror`` against its reference on
every backend (empty sequences, random batches, every rank of several cp sizes), then its latency at
``epkit bench``'s largest cp_mirror shape, with the CPU backend on host tensors as the same-run peer."""

from __future__ import annotations

import statistics
import time

import torch

from gpu_sections.common import Ctx, backends_for, record_check, run_backends

__all__ = ["sec_prepare_cp_mirror"]

#: The compression ratios every call uses (``epkit bench``'s cp_mirror family's).
RATIOS = (1, 4, 128)


def sec_prepare_cp_mirror(ctx: Ctx, res: dict):
    from epkit.cp_mirror import mirrors_equal, prepare_cp_mirror, prepare_cp_mirror_reference, random_batch

    dev = ctx.device
    fixed = (
        torch.tensor([0, 5, 5, 6, 40, 43], dtype=torch.int32),
        torch.tensor([0, 9, 12, 13, 60, 63], dtype=torch.int32),
    )
    cases = [
        ("6 seqs incl. empty", *fixed, (1, 2, 4, 8), None),
        ("9 seqs / 700", *random_batch(9, 700, 100, 1), (4,), None),
    ]
    big_seqs, big_q = (64, 131072) if not ctx.quick else (16, 16384)
    big = random_batch(big_seqs, big_q, 4096, seed=0)
    cases.append((f"{big_seqs} seqs / {big_q}", *big, (8,), (0, 3, 7)))

    def correctness(backend: str) -> None:
        for label, cu_q, cu_k, cp_sizes, ranks in cases:
            if backend == "triton" and not ctx.cuda and cu_q[-1] > 1000:
                continue  # the interpreter is for small inputs
            if backend == "triton" and ctx.dry:
                cp_sizes = cp_sizes[:2]
            for cp in cp_sizes:
                for rank in ranks if ranks is not None else range(cp):
                    ctx.check(f"correctness[{backend}] {label} cp={cp} rank={rank}")
                    want = prepare_cp_mirror_reference(cu_q, cu_k, cp, rank, RATIOS)
                    got = prepare_cp_mirror(cu_q.to(dev), cu_k.to(dev), cp, rank, RATIOS, backend=backend)
                    diff = mirrors_equal(got, want)
                    record_check(res, f"{backend}: {label} cp={cp} rank={rank}", diff is None, diff or "")

    run_backends(ctx, res, backends_for(ctx, ("triton", "tilelang"), ("cpu", "tilelang", "triton")), correctness)
    timed = backends_for(ctx, ("triton", "tilelang"), ("cpu", "tilelang"))
    lat = _latency(ctx, res, big, {"num_seqs": big_seqs, "total_q": big_q}, timed)
    res["summary"] = ", ".join(f"{b} {lat[b]['wall']['median_ms']:.3f} ms/call" for b in timed if b in lat)
    return None


def _latency(ctx: Ctx, res: dict, big: tuple, size: dict, timed: tuple[str, ...]) -> dict:
    """Latency at ``epkit bench``'s largest cp_mirror shape (``big`` = ``(cu_q, cu_k)`` of ``size``: 64 seqs,
    131072 tokens, max prefix 4096; cp 8, rank 3) for each backend in ``timed`` that passed; ``res["latency"]``,
    also returned."""
    from epkit.cp_mirror import prepare_cp_mirror

    cu_q, cu_k = big[0].to(ctx.device), big[1].to(ctx.device)
    lat = res["latency"] = {"shape": {**size, "cp_size": 8, "cp_rank": 3, "ratios": list(RATIOS)}}
    for backend in timed:
        if res["backends"].get(backend) != "ok":
            continue
        ctx.check(f"latency[{backend}]")
        fn = lambda b=backend: prepare_cp_mirror(cu_q, cu_k, 8, 3, RATIOS, backend=b)  # noqa: E731
        lat[backend] = {"wall": ctx.time_wall(fn, calls=5), "events_one_call": ctx.time_op(fn, iters=10)}
        ctx.log(f"{backend}: {lat[backend]['wall']['median_ms']:.3f} ms/call wall")
    if ctx.cuda:  # the CPU backend on host tensors, same run, as the peer
        ctx.check("latency[cpu peer]")
        cq, ck = big
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            prepare_cp_mirror(cq, ck, 8, 3, RATIOS, backend="cpu")
            samples.append((time.perf_counter() - t0) * 1e3)
        lat["cpu_backend_on_host"] = {"wall": {"median_ms": statistics.median(samples[1:]), "n_rounds": 4}}
    return lat
