"""Tune the Triton grouped GEMM's tile configs on a GPU; writes a table that ``load_tuned_configs`` installs.

For each kind (fp8, fp8_fp4, bf16), layout and shape it times every candidate config (the persistent
TMA kernel's BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, and the tile-grid kernel's previous
default as a same-run comparison), checks each result against the
float32 reference of the dequantized inputs (``calc_diff``; a config that fails is
recorded and never chosen), and keeps the fastest per (kind, N, K, rows bucket).
Shapes default to DeepGEMM's published ones (contiguous 4 x 8192 rows with
(N, K) = (4096, 7168) and (7168, 2048); masked 1 x 1024, 2 x 512, 4 x 256).

Use the result:
    from epkit.kernels.triton.grouped_gemm_configs import load_tuned_configs
    load_tuned_configs("build/bench/grouped_gemm_tuned.json")   # or the copy kept in bench/results/<kind>/

(``epkit.kernels.triton.grouped_gemm`` re-exports it).

Run on a GPU: ``python bench/tune_grouped_gemm.py [--kinds fp8 bf16] [--budget-s 300]``.
``--device cpu --quick`` runs the same loop on tiny shapes through the Triton
interpreter (a dry run of the script; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch

from epkit.grouped_gemm import build_m_indices, grouped_gemm_reference, make_inputs
from epkit.kernels.triton import grouped_gemm as tg
from epkit.kernels.triton.grouped_gemm_configs import m_bucket
from epkit.testing import calc_diff

THRESH = {"fp8": 1e-3, "fp8_fp4": 1e-2, "bf16": 1e-5}
# (layout, groups, rows per group, N, K)
SHAPES = [
    ("contiguous", 4, 8192, 4096, 7168),
    ("contiguous", 4, 8192, 7168, 2048),
    ("masked", 1, 1024, 4096, 7168),
    ("masked", 2, 512, 4096, 7168),
    ("masked", 4, 256, 4096, 7168),
]
QUICK_SHAPES = [("contiguous", 2, 96, 256, 256), ("masked", 2, 40, 256, 256)]


def candidates(kind: str, device: str) -> list[dict]:
    """Configs to try: the persistent kernel's (BLOCK_M divides 128; FP8 also takes BLOCK_N = 256 on
    BLOCK_M = 64, whose accumulator and dot result fit 8 warps' registers) and, on CUDA, the tile-grid
    kernel's previous default for comparison (scaled kinds need BLOCK_K = 128 and BLOCK_N dividing 128)."""
    bk = 64 if kind == "bf16" else 128
    if device != "cuda":
        return [
            dict(kernel="persistent", BLOCK_M=m, BLOCK_N=64, BLOCK_K=bk, GROUP_M=2, num_warps=4, num_stages=1)
            for m in (32, 64)
        ]
    out = []
    tiles = [(128, 128, 8), (64, 128, 4)] + ([(64, 256, 8)] if kind == "fp8" else [(128, 64, 8)])
    decodes = ("plain", "prmt") if kind == "fp8_fp4" else (None,)  # FP4: per element or PTX tables
    for (bm, bn, warps), stages, group_m, decode in itertools.product(tiles, (3, 4, 5, 6), (8, 16), decodes):
        if (bm + bn) * bk * stages * (2 if kind == "bf16" else 1) > 200 * 1024:  # over sm_90's shared memory
            continue
        cfg = dict(kernel="persistent", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_warps=warps,
                   num_stages=stages)  # fmt: skip
        cfg = cfg if decode is None else dict(cfg, FP4_DECODE=decode)
        out.append(cfg)
        if warps == 4 and (bm + bn) * bk * stages * (2 if kind == "bf16" else 1) <= 100 * 1024:
            out.append(dict(cfg, CTAS_PER_SM=2))  # two one-warpgroup programs per SM take turns
    out.append(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, num_warps=8, num_stages=3))  # the tile-grid kernel
    return out


def _time(fn, device: str, iters: int) -> float:
    """Median seconds per call."""
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def tune_shape(kind, layout, g, rows, n, k, device, iters, log) -> list[dict]:
    """Every candidate on one shape: [{config, seconds, tflops, calc_diff, ok}]."""
    masked = layout == "masked"
    m_indices = None if masked else build_m_indices([rows] * g)  # groups padded to the 128-row alignment
    a, b, _, _ = make_inputs(kind, g, rows if masked else m_indices.numel(), n, k, masked=masked, seed=0)
    a_q, sfa = (a, None) if kind == "bf16" else a
    b_q, sfb = (b, None) if kind == "bf16" else b
    if masked:
        layout = {"masked_m": torch.full((g,), rows, dtype=torch.int32)}
        ref = torch.zeros(g, rows, n)
    else:
        layout = {"m_indices": m_indices}
        ref = torch.zeros(m_indices.numel(), n)
    grouped_gemm_reference(kind, a_q, sfa, b_q, sfb, ref, **layout)  # on the CPU copies

    def to(t):
        return None if t is None else t.to(device)

    a_q, sfa, b_q, sfb = to(a_q), to(sfa), to(b_q), to(sfb)
    masked_m, m_indices = to(layout.get("masked_m")), to(layout.get("m_indices"))
    d = torch.empty(*ref.shape, dtype=torch.bfloat16, device=device)
    flops = 2.0 * g * rows * n * k
    results = []
    for cfg in candidates(kind, device):
        if masked:

            def run(cfg=cfg):
                tg.grouped_gemm_masked(kind, a_q, sfa, b_q, sfb, d, masked_m, rows, config=cfg)
        else:

            def run(cfg=cfg):
                tg.grouped_gemm_contiguous(kind, a_q, sfa, b_q, sfb, d, m_indices, config=cfg)

        try:
            d.zero_()
            run()
            diff = calc_diff(d.float().cpu(), ref)
            ok = diff <= THRESH[kind]
            secs = _time(run, device, iters) if ok else float("nan")
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is recorded, not fatal
            results.append({"config": cfg, "error": f"{type(exc).__name__}: {exc}"[:300], "ok": False})
            log(f"  {cfg}: {type(exc).__name__}")
            continue
        results.append(
            {
                "config": cfg,
                "seconds": secs,
                "tflops": flops / secs / 1e12 if ok else 0.0,
                "calc_diff": diff,
                "ok": bool(ok),
            }
        )
        log(f"  {cfg}: " + (f"{flops / secs / 1e12:.1f} TFLOP/s" if ok else f"WRONG calc_diff={diff:.2e}"))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["fp8", "fp8_fp4", "bf16"], choices=["fp8", "fp8_fp4", "bf16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (the CPU dry run)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=600.0, help="stop starting new shapes after this long")
    ap.add_argument(
        "--out",  # build/, not the committed bench/results/: a tuning run is kept only when copied there on purpose
        default=os.path.join(os.path.dirname(__file__), os.pardir, "build", "bench", "grouped_gemm_tuned.json"),
    )
    args = ap.parse_args()
    if args.device == "cpu" and not args.quick:
        ap.error("on CPU only --quick makes sense (the interpreter runs tiny shapes; its timings are not tuning data)")
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    iters = args.iters or (1 if args.device == "cpu" else 10)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    t_start = time.monotonic()
    table = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter dry run)",
        "quick": args.quick,
        "runs": [],
        "best": [],
        "skipped": [],
    }

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(table, f, indent=2)

    for kind in args.kinds:
        for layout, g, rows, n, k in shapes:
            if time.monotonic() - t_start > args.budget_s:
                table["skipped"].append(dict(kind=kind, layout=layout, g=g, rows=rows, n=n, k=k))
                continue
            print(f"{kind} {layout} G={g} rows={rows} N={n} K={k}", flush=True)
            res = tune_shape(kind, layout, g, rows, n, k, args.device, iters, lambda s: print(s, flush=True))
            table["runs"].append(dict(kind=kind, layout=layout, g=g, rows=rows, n=n, k=k, results=res))
            good = [r for r in res if r["ok"]]
            if good:
                best = max(good, key=lambda r: r["tflops"])
                bucket = m_bucket(rows)
                entry = dict(kind=kind, n=n, k=k, bucket=bucket, config=best["config"], tflops=best["tflops"])
                # One entry per key: the contiguous and masked shapes of a key may both land in it; keep the faster.
                same = [e for e in table["best"] if (e["kind"], e["n"], e["k"], e["bucket"]) == (kind, n, k, bucket)]
                if not same or same[0]["tflops"] < entry["tflops"]:
                    table["best"] = [e for e in table["best"] if e not in same] + [entry]
            save()
    save()
    print(f"wrote {args.out}: {len(table['best'])} tuned entries, {len(table['skipped'])} shapes skipped (budget)")


if __name__ == "__main__":
    main()
