"""Dispatch + combine on CPU ranks: each transport against the torch reference exchange and a memcpy roof.

Normal mode: 4096 tokens per rank, hidden 2048 bf16, 64 experts, top-4, on 2 and
4 ranks. For each transport the time of one dispatch + combine is compared with
(a) the textbook exchange over torch.distributed (epkit.collectives.ep_reference)
and (b) the bytes this rank must move (rows sent + received, both phases) over
that time, against the same run's memcpy bandwidth: a preallocated ``copy_`` of
exactly those bytes, bandwidth = bytes copied / time (``fraction_of_memcpy_roof``
= memcpy time of the moved bytes / transport time; 1.0 would mean moving every
byte cost one memcpy of it). Also reported, for continuity with earlier runs,
``fraction_of_memcpy_roof_rw``: the same against a roof that counts both the read
and the write of each copied byte (half the above: a protocol that copies each
moved byte once at memcpy speed scores 0.5 there). Low-latency mode: 128 tokens
per rank, latency per dispatch+combine.

Run: ``python bench/bench_ep_buffer.py [--ranks 2 4] [--rounds 5]``; writes
bench/results/dispatch_combine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from epkit.collectives.ep_buffer import EPBuffer
from epkit.collectives.ep_reference import reference_combine, reference_dispatch
from epkit.testing.multiprocess import run_ranks

TOKENS, HIDDEN, EXPERTS, TOPK, LL_TOKENS = 4096, 2048, 64, 4, 128


def _inputs(rank, tokens):
    g = torch.Generator().manual_seed(rank)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens)])
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    w = torch.rand(tokens, TOPK, generator=g)
    return x, idx, w


def _median_time(fn, rounds):
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_transport(transport, x, idx, w, rounds):
    """(normal-mode seconds, low-latency seconds, bytes this rank moves) for one transport."""
    buf = EPBuffer(
        dist.group.WORLD,
        HIDDEN,
        EXPERTS,
        TOKENS,
        TOPK,
        transport=transport,
        num_max_dispatch_tokens_per_rank=LL_TOKENS,
        timeout=120,
    )

    def step():
        recv_x, _, _, _, handle = buf.dispatch(x, idx, w)
        return buf.combine(recv_x, handle), handle

    _, handle = step()
    sent = sum(t.numel() for t in handle.send_tokens)
    received = sum(handle.recv_counts)
    moved = 2 * (sent + received) * HIDDEN * 2  # rows out and in, dispatch and combine
    normal = _median_time(step, rounds)
    xl, il, wl = x[:LL_TOKENS], idx[:LL_TOKENS], w[:LL_TOKENS]

    def ll_step():
        recv, _, h, _ = buf.low_latency_dispatch(xl, il, LL_TOKENS, use_fp8=False)
        return buf.low_latency_combine(recv, il, wl, h)

    low_latency = _median_time(ll_step, rounds)
    buf.buffer.close()
    return normal, low_latency, moved


def _bench_rank(rank, world_size, rounds):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    x, idx, w = _inputs(rank, TOKENS)
    out = {}
    for transport in ("shm", "torch"):
        out[transport], out[f"{transport}_low_latency"], moved = _time_transport(transport, x, idx, w, rounds)

    def ref_step():
        state = reference_dispatch(x, idx, w, EXPERTS)
        return reference_combine(state["recv_x"], state, TOKENS)

    out["torch_reference"] = _median_time(ref_step, rounds)
    src = torch.empty(moved, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_t = _median_time(lambda: dst.copy_(src), rounds)
    out["memcpy_gbs"] = moved / copy_t / 1e9  # bytes copied per second
    out["bytes_moved"] = moved
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "dispatch_combine.json"))
    args = ap.parse_args()
    results = {
        "shape": {
            "tokens_per_rank": TOKENS,
            "hidden": HIDDEN,
            "dtype": "bfloat16",
            "experts": EXPERTS,
            "topk": TOPK,
            "low_latency_tokens": LL_TOKENS,
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "timing": "median over rounds; per rank, then the slowest rank",
        "roof": "memcpy of the moved bytes in the same run; memcpy_gbs = bytes copied / s (the _rw fraction "
        "counts read + write, i.e. against 2 x memcpy_gbs)",
        "runs": {},
    }
    for n in args.ranks:
        per_rank = run_ranks(_bench_rank, n, args.rounds, timeout=900)
        t = {k: max(r[k] for r in per_rank) for k in per_rank[0] if k not in ("memcpy_gbs", "bytes_moved")}
        moved = max(r["bytes_moved"] for r in per_rank)
        memcpy = statistics.median(r["memcpy_gbs"] for r in per_rank)
        run = {"ms": {k: v * 1e3 for k, v in t.items()}, "memcpy_gbs": memcpy, "bytes_moved_per_rank": moved}
        for transport in ("shm", "torch"):
            gbs = moved / t[transport] / 1e9
            run[transport] = {
                "speedup_vs_torch_reference": t["torch_reference"] / t[transport],
                "gbs": gbs,
                "fraction_of_memcpy_roof": gbs / memcpy,
                "fraction_of_memcpy_roof_rw": gbs / (2 * memcpy),
                "low_latency_us": t[f"{transport}_low_latency"] * 1e6,
            }
        results["runs"][str(n)] = run
        print(f"{n} ranks: torch reference {t['torch_reference'] * 1e3:.1f} ms; memcpy {memcpy:.1f} GB/s")
        for transport in ("shm", "torch"):
            r = run[transport]
            print(
                f"  {transport:>5}: {t[transport] * 1e3:8.1f} ms  {r['speedup_vs_torch_reference']:5.1f}x reference  "
                f"{r['gbs']:6.2f} GB/s = {r['fraction_of_memcpy_roof'] * 100:5.1f}% of memcpy  "
                f"low-latency {r['low_latency_us']:8.0f} us"
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
