"""CPU grouped FP8 GEMM against same-run peers; writes bench/results/grouped_gemm.json.

Shape (issue 6): G = 8 experts, 512 rows per expert, N = K = 1024, FP8 (e4m3) activations
with 1x128 scales and FP8 weights with 128x128 block scales, bf16 output.

Peers, measured in the same run, interleaved (each round runs every candidate once, in a
seeded random order; the figures are medians over rounds):
- dense torch.matmul at equal FLOPs ([G*512, K] x [K, N]) on already-dequantized operands,
  in bfloat16 (the fair peer: the cpu backend multiplies bf16 x bf16 on CPUs with fast bf16)
  and in float32;
- the textbook per-expert loop (004_*.txt): boolean row selection per expert, float32
  dequantization of that expert's weights and rows inside the loop, one matmul per expert.
Also reported: the same grouped GEMM with MXFP4 weights (fp8_fp4), and the cpu backend's
unfused path (what runs on CPUs without AMX: full dequantization, then torch matmuls), for
information.

Honesty note: the grouped GEMM dequantizes the FP8 weights (and activations) on every call
(the op takes quantized weights and caches no dequantized data; on CPUs with AMX the fused
kernel dequantizes panel by panel into cache-resident tiles), so that cost is inside its
time; the dense peers get dequantized operands for free.
Absolute times are noise on a shared machine (the load average is recorded); the ratios of
same-run medians are the result.

Run: python bench/bench_grouped_gemm.py [--rounds 9] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from epkit._details.grouped_gemm_cpu import amx_disabled, amx_kernel, compute_dtype, dequant_extension
from epkit.grouped_gemm import build_m_indices, m_grouped_fp8_fp4_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_contiguous
from epkit.quant import (
    cast_to_mxfp4,
    dequant_per_block_fp8,
    dequant_per_token_group_fp8,
    per_block_cast_to_fp8,
    per_token_group_cast_to_fp8,
)
from epkit.testing import calc_diff


def textbook_loop(a, sfa, b, sfb, m_indices, d):
    """Per-expert loop with dequantization inside it (the textbook approach)."""
    for e in range(b.shape[0]):
        sel = m_indices == e
        w = dequant_per_block_fp8(b[e], sfb[e])
        x = dequant_per_token_group_fp8(a[sel], sfa[sel])
        d[sel] = (x @ w.T).to(d.dtype)
    d[m_indices < 0] = 0
    return d


def interleaved(fns: dict, rounds: int) -> dict:
    """Median seconds per candidate; every round runs each candidate once, in a fresh random order.

    A random order (seeded) rather than a rotation: a rotation keeps each candidate behind the same
    predecessor every round, and a predecessor that churns memory (the textbook loop allocates and
    frees large temporaries) would tax the same candidate every time.
    """
    for fn in fns.values():  # warm-up (primitive caches, scratch buffers)
        fn()
    names = list(fns)
    samples = {name: [] for name in names}
    gen = torch.Generator().manual_seed(1234)
    for _ in range(rounds):
        for name in [names[i] for i in torch.randperm(len(names), generator=gen).tolist()]:
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in samples.items()}, samples


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "grouped_gemm.json"))
    return ap.parse_args(argv)


def make_candidates(g: int, rows: int, n: int, k: int) -> tuple[dict, dict]:
    """The candidates (name -> callable of no arguments) and the tensors they read and write.

    The second dict holds the unquantized ``x [M, K]`` and ``w [G, N, K]``, ``m_indices`` and the
    outputs ``d`` (fp8), ``d4`` (fp8_fp4), ``d_loop`` (textbook loop), ``d_unfused`` (no AMX), for the
    accuracy figures.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(g * rows, k, generator=gen)
    w = torch.randn(g, n, k, generator=gen) / k**0.5
    a, sfa = per_token_group_cast_to_fp8(x)
    b, sfb = per_block_cast_to_fp8(w)
    b4, sfb4 = cast_to_mxfp4(w)
    m_indices = build_m_indices([rows] * g)
    m = m_indices.numel()
    t = dict(x=x, w=w, m_indices=m_indices)
    for name in ("d", "d4", "d_loop", "d_unfused"):
        t[name] = torch.empty(m, n, dtype=torch.bfloat16)

    def unfused(fn):
        """The cpu backend without its AMX kernel (dequantize everything, then torch matmuls)."""
        with amx_disabled():
            return fn()

    dense_a32 = dequant_per_token_group_fp8(a, sfa)
    dense_b32 = dequant_per_block_fp8(b[0], sfb[0]).T.contiguous()
    dense_a16, dense_b16 = dense_a32.bfloat16(), dense_b32.bfloat16()
    candidates = {
        "grouped_cpu": lambda: m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), t["d"], m_indices, backend="cpu"),
        "grouped_cpu_fp8_fp4": lambda: m_grouped_fp8_fp4_gemm_nt_contiguous(
            (a, sfa), (b4, sfb4), t["d4"], m_indices, backend="cpu"
        ),
        "grouped_cpu_unfused": lambda: unfused(
            lambda: m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), t["d_unfused"], m_indices, backend="cpu")
        ),
        "dense_matmul_bf16": lambda: torch.matmul(dense_a16, dense_b16),
        "dense_matmul_fp32": lambda: torch.matmul(dense_a32, dense_b32),
        "textbook_loop": lambda: textbook_loop(a, sfa, b, sfb, m_indices, t["d_loop"]),
    }
    return candidates, t


def ratios(t: dict) -> dict:
    """Speed ratios of one repeat's median seconds (> 1: the grouped GEMM is faster)."""
    return {
        "grouped_vs_dense_bf16": t["dense_matmul_bf16"] / t["grouped_cpu"],
        "grouped_vs_dense_fp32": t["dense_matmul_fp32"] / t["grouped_cpu"],
        "grouped_speedup_vs_textbook_loop": t["textbook_loop"] / t["grouped_cpu"],
        "grouped_fp8_fp4_vs_dense_bf16": t["dense_matmul_bf16"] / t["grouped_cpu_fp8_fp4"],
        "grouped_unfused_vs_dense_bf16": t["dense_matmul_bf16"] / t["grouped_cpu_unfused"],
    }


def summarize(args, repeats: list[dict], tensors: dict, loadavg: tuple) -> dict:
    """The JSON result: shape, machine, cpu backend, every repeat, the ratios over repeats and the accuracy."""
    x, w, m_indices, d = tensors["x"], tensors["w"], tensors["m_indices"], tensors["d"]
    m = m_indices.numel()
    flops = 2.0 * m * args.n * args.k
    ref = torch.einsum("mk,mnk->mn", x, w[m_indices.long()])
    names = repeats[0]["ratios"]
    return {
        "shape": dict(groups=args.groups, rows_per_group=args.rows, n=args.n, k=args.k, m=m),
        "machine": dict(
            cpu=platform.processor() or platform.machine(),
            torch_threads=torch.get_num_threads(),
            cpus=os.cpu_count(),
            loadavg_1_5_15_before=[round(v, 2) for v in loadavg[0]],
            loadavg_1_5_15_after=[round(v, 2) for v in loadavg[1]],
        ),
        "cpu_backend": dict(
            fused_amx_kernel=amx_kernel() is not None,
            fused_cpp_dequant=dequant_extension() is not None,
            compute_dtype=str(compute_dtype(d)),
        ),
        "rounds": args.rounds,
        "repeats_count": args.repeats,
        "repeats": repeats,
        "ratios_median_over_repeats": {name: statistics.median(r["ratios"][name] for r in repeats) for name in names},
        "ratios_min_over_repeats": {name: min(r["ratios"][name] for r in repeats) for name in names},
        "gflops_last_repeat": {name: flops / s / 1e9 for name, s in repeats[-1]["seconds_median"].items()},
        "targets": {"vs_dense (bf16 peer)": 0.60, "vs_textbook_loop": 5.0},
        "accuracy_calc_diff_vs_unquantized_fp32": calc_diff(d.float(), ref),
        "accuracy_fp8_fp4_calc_diff_vs_unquantized_fp32": calc_diff(tensors["d4"].float(), ref),
        "textbook_matches_grouped_calc_diff": calc_diff(d.float(), tensors["d_loop"].float()),
        "unfused_matches_fused_calc_diff": calc_diff(d.float(), tensors["d_unfused"].float()),
        "note": "grouped ops dequantize weights and activations every call; dense peers run on pre-dequantized "
        "operands; per repeat, medians of interleaved rounds in random order; targets judged on the median "
        "over repeats, the minimum shows the spread",
    }


def main() -> None:
    args = parse_args()
    candidates, tensors = make_candidates(args.groups, args.rows, args.n, args.k)
    load_before = os.getloadavg()
    # Several independent repeats of the whole interleaved measurement: on a shared machine one
    # repeat can land in a slow phase for some candidates; the spread says how much that matters.
    repeats = []
    for rep in range(args.repeats):
        t, _ = interleaved(candidates, args.rounds)
        repeats.append({"seconds_median": t, "ratios": ratios(t), "loadavg_1": round(os.getloadavg()[0], 2)})
        print(f"repeat {rep}: " + ", ".join(f"{k} {v:.3f}" for k, v in repeats[-1]["ratios"].items()), flush=True)
    result = summarize(args, repeats, tensors, (load_before, os.getloadavg()))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
