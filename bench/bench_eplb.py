"""EPLB and logical->physical mapping: quality and speed against peers measured in the same run.

Run: ``python bench/bench_eplb.py``. Prints

* busiest-GPU / mean load for sequential placement vs ``rebalance_experts`` on Zipf-like
  loads at real model sizes (the quality peer is sequential placement);
* ``rebalance_experts`` wall time at those sizes (a control-plane cost, paid once per rebalance);
* ``logical_to_physical`` vectorised CPU path vs the Python reference (speed-up ratio), and, on a
  GPU when one is present, ``bench/kernel_check.py experts --backend triton`` (check, then the
  kernel's latency next to the vectorised torch path).
"""

from __future__ import annotations

import random
import time

import torch

from epkit.eplb import gpu_load, imbalance, rebalance_experts
from epkit.experts import ExpertPlacement, logical_to_physical


def _zipf_loads(num_layers: int, num_logical: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_layers):
        row = [1 / (i + 1) ** 0.8 for i in range(num_logical)]
        rng.shuffle(row)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def _time(fn, reps: int = 3) -> float:
    """Median seconds per call (shared CPUs are noisy)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bench_rebalance() -> None:
    configs = [
        # name, layers, logical, replicas, groups, nodes, gpus
        ("doc example (004)", 1, 64, 72, 1, 1, 8),
        ("DeepSeek-V3 prefill EP32", 58, 256, 288, 8, 4, 32),
        ("DeepSeek-V3 decode EP144", 58, 256, 288, 8, 18, 144),
        ("V4.1-Flash EP64", 40, 384, 448, 8, 1, 64),
    ]
    for name, layers, logical, replicas, groups, nodes, gpus in configs:
        w = _zipf_loads(layers, logical, 0)
        seq = torch.arange(logical).repeat(layers, 1)
        seq_phy = torch.cat([seq, seq[:, : replicas - logical]], dim=1)  # default layout: slot p holds p % logical
        before = max(imbalance(r) for r in gpu_load(w, seq_phy, gpus))
        t0 = time.perf_counter()
        phy2log, _, _ = rebalance_experts(w, replicas, groups, nodes, gpus)
        dt = time.perf_counter() - t0
        after = max(imbalance(r) for r in gpu_load(w, phy2log, gpus))
        print(
            f"{name:>26}: worst-layer busiest/mean {before:5.2f}x default -> {after:5.3f}x EPLB; "
            f"rebalance {dt * 1e3:8.1f} ms for {layers} layers"
        )


def bench_logical_to_physical() -> None:
    placement = ExpertPlacement.default(384, 64, 1)
    g = torch.Generator().manual_seed(0)
    topk = torch.randint(0, 384, (4096, 6), generator=g, dtype=torch.int32)
    t_cpu = _time(lambda: logical_to_physical(topk, placement, 5, backend="cpu", check_index=False), reps=20)
    t_ref = _time(lambda: logical_to_physical(topk, placement, 5, backend="reference"), reps=3)
    print(
        f"logical_to_physical 4096x6, 384 experts EP64: cpu {t_cpu * 1e6:8.1f} us, "
        f"reference {t_ref * 1e6:10.1f} us, speed-up {t_ref / t_cpu:6.1f}x"
    )
    if torch.cuda.is_available():
        from kernel_check import run  # bench/ is on sys.path when this file runs as a script

        run("experts", "triton", "cuda")


if __name__ == "__main__":
    bench_rebalance()
    bench_logical_to_physical()
