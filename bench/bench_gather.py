"""CPU benchmark of ``epkit.gather_rows`` against same-run peers; writes bench/results/gather_rows.json.

Shape: 65536 rows x 2048 bf16 (256 MiB), gathered by a random permutation (int32 index), into a
preallocated output. Contenders, timed in the same run and interleaved round by round (so that a
noisy neighbour slows all of them alike), median over rounds:

- ``epkit.gather_rows`` with ``backend="cpu"`` (torch.index_select on integer word views) and
  ``backend="tilelang"`` (the compiled TileLang C kernel, rows split over threads);
- ``torch.index_select(x, 0, index, out=...)``, the peer;
- the memcpy roof: ``Tensor.copy_`` of the same bytes into a preallocated buffer (a gather reads and
  writes exactly as many bytes as that copy, plus the 256 KiB index).

Every epkit backend is first checked bit for bit against ``torch.index_select`` on the benchmark input.

Run: ``python bench/bench_gather.py [--rows 65536] [--hidden 2048] [--rounds 15] [--threads N] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from epkit.backends import backend_info
from epkit.gather import gather_rows


def _round_robin(fns: dict, rounds: int) -> dict:
    """Per contender: every round's seconds (one call each per round, in a fixed order)."""
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gather_rows.json"))
    args = ap.parse_args()
    if args.rows < 1 or args.hidden < 1 or args.rounds < 1:
        ap.error(f"--rows, --hidden and --rounds must be >= 1, got {args.rows}, {args.hidden}, {args.rounds}")

    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.hidden, generator=g).to(torch.bfloat16)
    index = torch.randperm(args.rows, generator=g).to(torch.int32)
    want = torch.index_select(x, 0, index)
    nbytes = x.numel() * x.element_size()
    moved = 2 * nbytes + index.numel() * index.element_size()

    backends = ["cpu"] + (["tilelang"] if backend_info("tilelang").available_on("cpu") else [])
    outs = {b: torch.empty_like(x) for b in backends}
    for b in backends:  # first call compiles (tilelang); then a bitwise check on the benchmark input
        gather_rows(x, index, outs[b], backend=b, check_index=False)
        if not torch.equal(outs[b].view(torch.int16), want.view(torch.int16)):
            raise SystemExit(f"gather_rows[{b}] differs from torch.index_select on the benchmark input")

    sel_out = torch.empty_like(x)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    fns = {f"epkit[{b}]": (lambda b=b: gather_rows(x, index, outs[b], backend=b, check_index=False)) for b in backends}
    fns["torch.index_select"] = lambda: torch.index_select(x, 0, index, out=sel_out)
    fns["memcpy_roof"] = lambda: dst.copy_(src)
    for fn in fns.values():  # warm-up: page in every buffer
        fn()
    samples = _round_robin(fns, args.rounds)

    med = {name: statistics.median(s) for name, s in samples.items()}
    bytes_of = {name: (2 * nbytes if name == "memcpy_roof" else moved) for name in fns}
    results = {
        name: {
            "median_ms": med[name] * 1e3,
            "min_ms": min(samples[name]) * 1e3,
            "GBps": bytes_of[name] / med[name] / 1e9,
            "samples_ms": [round(s * 1e3, 3) for s in samples[name]],
        }
        for name in fns
    }
    for b in backends:
        r = results[f"epkit[{b}]"]
        r["speedup_vs_index_select"] = med["torch.index_select"] / med[f"epkit[{b}]"]
        r["fraction_of_memcpy_roof"] = r["GBps"] / results["memcpy_roof"]["GBps"]
    results["torch.index_select"]["fraction_of_memcpy_roof"] = (
        results["torch.index_select"]["GBps"] / results["memcpy_roof"]["GBps"]
    )

    report = {
        "op": "gather_rows",
        "shape": {"rows": args.rows, "hidden": args.hidden, "dtype": "bfloat16", "index": "random permutation, int32"},
        "bytes_moved_per_gather": moved,
        "rounds": args.rounds,
        "timing": "median over rounds; each round calls every contender once, in a fixed order",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "results": results,
        "note": "shared, noisy machine: the ratios are the result, absolute times are not",
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)

    print(f"gather_rows: {args.rows} x {args.hidden} bf16, random permutation, median of {args.rounds} rounds")
    for name, r in results.items():
        extra = ""
        if "speedup_vs_index_select" in r:
            extra = f"  {r['speedup_vs_index_select']:5.2f}x index_select"
        if "fraction_of_memcpy_roof" in r:
            extra += f"  {r['fraction_of_memcpy_roof']:6.1%} of memcpy roof"
        print(f"{name:>20}: {r['median_ms']:8.2f} ms  {r['GBps']:6.2f} GB/s{extra}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
