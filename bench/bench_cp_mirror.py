"""Benchmark ``prepare_cp_mirror``: the Python reference against the CPU backends in the same run.

Shape (issue 4): 64 sequences / 131072 query tokens with cached prefixes, cp_size 8,
compression ratios (1, 4, 128). Every rank is timed (one call per rank per round) and
the median round is reported per call. Targets: the ``cpu`` backend >= 20x faster than
the reference and < 2 ms per call on this machine.

Run: ``python bench/bench_cp_mirror.py [--rounds N] [--out PATH]``; writes a JSON
(default ``bench/results/cp_mirror.json``) and prints a table.
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
from epkit.cp_mirror import mirrors_equal, prepare_cp_mirror, prepare_cp_mirror_reference, random_batch

NUM_SEQS, TOTAL_Q, MAX_PREFIX, CP_SIZE, RATIOS = 64, 131072, 4096, 8, (1, 4, 128)


def _median_ms_per_call(fn, rounds: int) -> tuple[float, list[float]]:
    """Median over rounds of the mean time of one call (each round calls every rank once)."""
    for r in range(CP_SIZE):  # warm-up: compiles and caches
        fn(r)
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for r in range(CP_SIZE):
            fn(r)
        samples.append((time.perf_counter() - t0) / CP_SIZE * 1e3)
    return statistics.median(samples), samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds for the fast backends")
    parser.add_argument("--reference-rounds", type=int, default=5, help="timed rounds for the Python reference")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cp_mirror.json"))
    args = parser.parse_args()

    cu_q, cu_k = random_batch(NUM_SEQS, TOTAL_Q, MAX_PREFIX, seed=0)
    backends = ["cpu"] + (["tilelang"] if backend_info("tilelang").available_on("cpu") else [])

    # Every timed backend must agree with the reference bit for bit on this very shape.
    refs = [prepare_cp_mirror_reference(cu_q, cu_k, CP_SIZE, r, RATIOS) for r in range(CP_SIZE)]
    for b in backends:
        for r in range(CP_SIZE):
            diff = mirrors_equal(prepare_cp_mirror(cu_q, cu_k, CP_SIZE, r, RATIOS, backend=b), refs[r])
            if diff is not None:
                raise SystemExit(f"{b} differs from the reference on rank {r}: {diff}")

    results = {}
    ref_ms, ref_samples = _median_ms_per_call(
        lambda r: prepare_cp_mirror_reference(cu_q, cu_k, CP_SIZE, r, RATIOS), args.reference_rounds
    )
    results["reference"] = {"ms_per_call": ref_ms, "samples_ms": ref_samples}
    for b in backends:
        ms, samples = _median_ms_per_call(
            lambda r, b=b: prepare_cp_mirror(cu_q, cu_k, CP_SIZE, r, RATIOS, backend=b), args.rounds
        )
        results[b] = {"ms_per_call": ms, "samples_ms": samples, "speedup_vs_reference": ref_ms / ms}

    cpu = results["cpu"]
    report = {
        "op": "prepare_cp_mirror",
        "shape": {
            "num_seqs": NUM_SEQS,
            "total_q": TOTAL_Q,
            "total_k": int(cu_k[-1]),
            "max_prefix": MAX_PREFIX,
            "cp_size": CP_SIZE,
            "compress_ratios": list(RATIOS),
            "cp_mirror_len": refs[0].cp_mirror_len,
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "timing": "median over rounds of (time to prepare all 8 ranks) / 8",
        "results": results,
        "targets": {
            "cpu_speedup_vs_reference_min": 20.0,
            "cpu_ms_per_call_max": 2.0,
            "cpu_speedup_ok": cpu["speedup_vs_reference"] >= 20.0,
            "cpu_latency_ok": cpu["ms_per_call"] < 2.0,
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)

    print(f"prepare_cp_mirror: {NUM_SEQS} seqs, {TOTAL_Q} tokens, cp {CP_SIZE}, ratios {RATIOS}")
    for name, res in results.items():
        speed = f"{res['speedup_vs_reference']:8.1f}x" if "speedup_vs_reference" in res else "       1x"
        print(f"{name:>10}: {res['ms_per_call']:9.3f} ms/call  {speed} vs reference")
    t = report["targets"]
    print(
        f"targets: cpu >= 20x reference: {'PASS' if t['cpu_speedup_ok'] else 'FAIL'}; "
        f"cpu < 2 ms: {'PASS' if t['cpu_latency_ok'] else 'FAIL'}  (wrote {args.out})"
    )


if __name__ == "__main__":
    main()
