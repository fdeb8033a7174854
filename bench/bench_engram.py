"""Engram hash benchmark: 1,048,576 tokens, N=3, K=8, L=2 on CPU tensors.

Compares the numpy reference, the vectorised torch ``cpu`` backend and the
compiled TileLang C kernel against memcpy measured in the same run. Every round
times, in turn, ``Tensor.copy_`` into a preallocated buffer and each backend
(into a preallocated output and into a fresh one); figures are medians over the
rounds, so load from other processes hits every contender alike.

Bytes the hash must move: ``ids read + row ids written``. The roof is that
traffic at the copy's bandwidth counted as read + write (STREAM convention):
``roof = moved / (2 * copy_bytes / copy_time)``, i.e. the time of a copy of
``moved / 2`` bytes. ``copy_all_bytes_ms`` is the time of ``copy_`` of ``moved``
bytes (twice the traffic), for reference. Writes ``bench/results/engram_hash.json``.

Run: ``python bench/bench_engram.py [--tokens N] [--rounds R]``.
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
from epkit.engram import EngramConfig, engram_hash, hash_params


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reference-rounds", type=int, default=5, help="rounds that also time the slow backends")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "engram_hash.json"))
    args = ap.parse_args()

    cfg = EngramConfig(vocab_size=129280)  # demo defaults: N=3, K=8, layers (1, 15)
    mult, vocab, off = hash_params(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.tokens, cfg.max_ngram_size), generator=g, dtype=torch.int32)
    shape = (cfg.num_layers, args.tokens, cfg.num_heads)
    moved = ids.numel() * 4 + cfg.num_layers * args.tokens * cfg.num_heads * 4

    src = torch.ones(moved, dtype=torch.uint8)
    dst = torch.empty_like(src)
    half_src, half_dst = src[: moved // 2], dst[: moved // 2]
    copies = {"copy_half": lambda: half_dst.copy_(half_src), "copy_all": lambda: dst.copy_(src)}

    want = engram_hash(ids, mult, vocab, off, backend="reference")
    backends = ["reference", "cpu"] + (["tilelang"] if backend_info("tilelang").available_on("cpu") else [])
    fast = {"tilelang"}
    outs = {}
    for backend in backends:
        outs[backend] = torch.empty(shape, dtype=torch.int32)
        got = engram_hash(ids, mult, vocab, off, outs[backend], backend=backend)
        if not torch.equal(got, want):
            raise AssertionError(f"{backend} differs from the reference on the benchmark input")
    for fn in copies.values():
        fn()

    times: dict[str, list[float]] = {name: [] for name in copies}
    for backend in backends:
        times[f"{backend}/preallocated"] = []
        times[f"{backend}/fresh"] = []
    for rnd in range(args.rounds):
        for name, fn in copies.items():
            times[name].append(_seconds(fn))
        for backend in backends:
            if backend not in fast and rnd >= args.reference_rounds:
                continue
            out = outs[backend]
            times[f"{backend}/preallocated"].append(
                _seconds(lambda b=backend, o=out: engram_hash(ids, mult, vocab, off, o, backend=b))
            )
            times[f"{backend}/fresh"].append(_seconds(lambda b=backend: engram_hash(ids, mult, vocab, off, backend=b)))
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    roof = med["copy_half"]
    ref = med["reference/preallocated"]
    results = {}
    for backend in backends:
        pre, fresh = med[f"{backend}/preallocated"], med[f"{backend}/fresh"]
        results[backend] = {
            "preallocated_out_ms": pre,
            "fresh_out_ms": fresh,
            "fraction_of_copy_roof": roof / pre,
            "speedup_vs_reference": ref / pre,
            "rounds": len(times[f"{backend}/preallocated"]),
        }

    report = {
        "shape": {"tokens": args.tokens, "N": cfg.max_ngram_size, "K": cfg.n_head_per_ngram, "L": cfg.num_layers},
        "bytes_moved": moved,
        "roof_ms": roof,
        "copy_all_bytes_ms": med["copy_all"],
        "copy_GBps_read_plus_write": moved / (roof * 1e-3) / 1e9,
        "backends": results,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
        },
        "note": "medians of interleaved rounds; roof = moved bytes at the preallocated copy_ bandwidth "
        "(read + write counted); speedup and roof fraction use the preallocated-output times",
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
