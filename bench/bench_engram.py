"""Engram hash benchmark: 1,048,576 tokens, N=3, K=8, L=2 on CPU tensors.

Compares the numpy reference, the vectorised torch ``cpu`` backend and the
compiled TileLang C kernel, and measures the memcpy bandwidth in the same run:
``torch.clone`` of a 512 MiB buffer (allocates, as a fresh hash output does) and
``Tensor.copy_`` into a preallocated buffer. The bytes-moved roof is
``ids read + row ids written`` over that bandwidth. Writes
``bench/results/engram_hash.json``.

Run: ``python bench/bench_engram.py [--tokens N] [--reps R]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from epkit.backends import backend_info
from epkit.engram import EngramConfig, engram_hash, hash_params


def _time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _memcpy_bandwidth(nbytes: int, reps: int) -> tuple[float, float]:
    """Bytes/s (read + write) of torch.clone and of copy_ into a preallocated buffer."""
    buf = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(buf)
    clone_bw = 2 * nbytes / _time(buf.clone, reps)
    copy_bw = 2 * nbytes / _time(lambda: dst.copy_(buf), reps)
    return clone_bw, copy_bw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "engram_hash.json"))
    args = ap.parse_args()

    cfg = EngramConfig(vocab_size=129280)  # demo defaults: N=3, K=8, layers (1, 15)
    mult, vocab, off = hash_params(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.tokens, cfg.max_ngram_size), generator=g, dtype=torch.int32)
    shape = (cfg.num_layers, args.tokens, cfg.num_heads)
    moved = ids.numel() * 4 + cfg.num_layers * args.tokens * cfg.num_heads * 4

    clone_bw, copy_bw = _memcpy_bandwidth(512 << 20, args.reps)

    want = engram_hash(ids, mult, vocab, off, backend="reference")
    results: dict[str, dict] = {}
    backends = ["reference", "cpu"] + (["tilelang"] if backend_info("tilelang").available_on("cpu") else [])
    for backend in backends:
        out = torch.empty(shape, dtype=torch.int32)
        got = engram_hash(ids, mult, vocab, off, out, backend=backend)
        if not torch.equal(got, want):
            raise AssertionError(f"{backend} differs from the reference on the benchmark input")
        reps = 2 if backend == "reference" else args.reps
        fresh = _time(lambda b=backend: engram_hash(ids, mult, vocab, off, backend=b), reps)
        pre = _time(lambda b=backend, o=out: engram_hash(ids, mult, vocab, off, o, backend=b), reps)
        results[backend] = {"fresh_out_ms": fresh * 1e3, "preallocated_out_ms": pre * 1e3}
    ref = results["reference"]["fresh_out_ms"]
    for r in results.values():
        r["speedup_vs_reference"] = ref / r["fresh_out_ms"]
        r["fraction_of_clone_roof"] = (moved / clone_bw * 1e3) / r["fresh_out_ms"]
        r["fraction_of_copy_roof_preallocated"] = (moved / copy_bw * 1e3) / r["preallocated_out_ms"]

    report = {
        "shape": {"tokens": args.tokens, "N": cfg.max_ngram_size, "K": cfg.n_head_per_ngram, "L": cfg.num_layers},
        "bytes_moved": moved,
        "memcpy_GBps": {"torch_clone": clone_bw / 1e9, "copy_into_preallocated": copy_bw / 1e9},
        "roof_ms": {"clone": moved / clone_bw * 1e3, "copy_preallocated": moved / copy_bw * 1e3},
        "backends": results,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "note": "best of reps; fresh_out allocates the output (page faults), as torch.clone does",
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
