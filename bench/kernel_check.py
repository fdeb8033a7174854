"""Check one op family's backend against its reference, then time it next to a simple torch peer.

Run: ``python bench/kernel_check.py FAMILY --backend triton|tilelang|cpu|reference [--device auto|cpu|cuda]``

1. **check**: the op's self-check (``epkit.registered_ops()[op].selfcheck``) on small inputs on the
   device, against the reference bit for bit. The grouped GEMMs' self-checks take CPU inputs (with
   ``triton`` that is Triton's interpreter), every one of the six ops; on CUDA the timed GEMM is also
   compared with the reference backend on the device (``calc_diff``).
2. **time**: latency per call (``epkit.utils.time_per_call``) and GB/s (TFLOP/s for the GEMM) at the
   shape below, next to a peer timed in the same run:

- ``gather``: ``gather_rows``, 65536 x 2048 bf16 rows by a random permutation, into a preallocated
  output; peer ``torch.index_select(out=)``.
- ``cp_mirror``: ``prepare_cp_mirror``, 64 sequences / 131072 tokens with cached prefixes, cp 8,
  rank 3, ratios (1, 4, 128); peer the ``cpu`` backend on the host.
- ``engram``: ``engram_hash``, 1,048,576 tokens, N=3, K=8, 2 layers; peer the same hash in plain
  torch int64 ops (``epkit.bench.engram.engram_hash_torch``), on the device.
- ``experts``: ``logical_to_physical``, 16384 x 6 ids, 384 experts at EP64, rank 5; peer
  ``logical_to_physical_cpu`` (vectorised torch) on the device.
- ``grouped_gemm``: ``m_grouped_fp8_gemm_nt_contiguous``, 4 groups x 4096 rows, N=4096, K=7168 on
  CUDA (8 x 512 rows, N=K=1024 on CPU); peer a dense ``torch.matmul`` of the same FLOPs (bf16 on
  CUDA, float32 on CPU).

When the backend under test is ``cpu``, the peer of cp_mirror and experts is the reference. cp_mirror's
GB/s counts the int32 metadata written; the others count bytes read plus written. With ``triton``
on CPU tensors the kernels run in Triton's interpreter: the shapes shrink and the latency printed
is interpreter time, which says nothing about kernel speed.

``--device auto`` (default) is ``cuda`` when torch sees a GPU and the op has the backend there, else
``cpu``. Exit status 0 after both steps, 1 when a backend differs from the reference, 2 when the
backend cannot run here. Prints only (``epkit bench`` writes the JSON, the table and the plots).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from epkit import registered_ops
from epkit.backends import BackendUnavailableError, select
from epkit.bench.engram import engram_hash_torch
from epkit.utils import time_per_call

#: The op each family registers (for the grouped GEMMs: the one timed; all six are checked).
OPS = {
    "gather": "gather_rows",
    "cp_mirror": "prepare_cp_mirror",
    "engram": "engram_hash",
    "experts": "logical_to_physical",
    "grouped_gemm": "m_grouped_fp8_gemm_nt_contiguous",
}


@dataclass(frozen=True)
class Contender:
    label: str
    call: Callable[[], object]
    device: str
    reps: int = 10


@dataclass(frozen=True)
class Case:
    """What step 2 times: contenders (the op first), the shape and the work per call in ``unit``."""

    shape: str
    unit: str
    work: float  # bytes or FLOP per call
    contenders: list[Contender]
    unit_size: float = 1e9  # work per second that makes one ``unit``


def _reps(backend: str) -> int:
    """Timed calls per contender: the Python references take seconds at the benchmark shapes."""
    return 2 if backend == "reference" else 10


def gather_case(backend: str, device: str, small: bool) -> Case:
    from epkit.gather import gather_rows

    rows, hidden = (2048, 256) if small else (65536, 2048)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16).to(device)
    idx = torch.randperm(rows, generator=g).to(torch.int32).to(device)
    out, peer_out = torch.empty_like(x), torch.empty_like(x)
    return Case(
        f"{rows} x {hidden} bf16 rows, a random permutation",
        "GB/s",
        2 * x.numel() * x.element_size(),
        [
            Contender(
                f"gather_rows[{backend}]",
                lambda: gather_rows(x, idx, out, backend=backend, check_index=False),
                device,
                _reps(backend),
            ),
            Contender("torch.index_select", lambda: torch.index_select(x, 0, idx, out=peer_out), device),
        ],
    )


def cp_mirror_case(backend: str, device: str, small: bool) -> Case:
    from epkit.cp_mirror import prepare_cp_mirror, random_batch

    num_seqs, total_q, max_prefix, cp_size, ratios = (8, 4096, 256, 8, (1, 4, 128))
    if not small:
        num_seqs, total_q, max_prefix = 64, 131072, 4096
    cu_q, cu_k = random_batch(num_seqs, total_q, max_prefix, seed=0)
    dev_q, dev_k = cu_q.to(device), cu_k.to(device)
    mirror_len = prepare_cp_mirror(cu_q, cu_k, cp_size, 3, ratios, backend="cpu").cp_mirror_len
    written = 4 * (mirror_len * (1 + 2 * len(ratios)) + total_q + 7 * num_seqs + 2)
    peer = "reference" if backend == "cpu" else "cpu"
    return Case(
        f"{num_seqs} seqs / {total_q} tokens, cp {cp_size}, rank 3, ratios {ratios}",
        "GB/s written",
        written,
        [
            Contender(
                f"prepare_cp_mirror[{backend}]",
                lambda: prepare_cp_mirror(dev_q, dev_k, cp_size, 3, ratios, backend=backend),
                device,
                _reps(backend),
            ),
            Contender(
                f"prepare_cp_mirror[{peer}]",
                lambda: prepare_cp_mirror(cu_q, cu_k, cp_size, 3, ratios, backend=peer),
                "cpu",
                _reps(peer),
            ),
        ],
    )


def engram_case(backend: str, device: str, small: bool) -> Case:
    from epkit.engram import EngramConfig, engram_hash, hash_params

    num_tokens = 4096 if small else 1 << 20
    cfg = EngramConfig(vocab_size=129280)  # the demo's defaults: N=3, K=8, layers (1, 15)
    mult, vocab, off = (t.to(device) for t in hash_params(cfg))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (num_tokens, cfg.max_ngram_size), generator=g, dtype=torch.int32)
    ids = ids.to(device)
    out = torch.empty((cfg.num_layers, num_tokens, cfg.num_heads), dtype=torch.int32, device=device)
    return Case(
        f"{num_tokens} tokens, N={cfg.max_ngram_size} K={cfg.n_head_per_ngram} L={cfg.num_layers}",
        "GB/s",
        ids.numel() * 4 + out.numel() * 4,
        [
            Contender(
                f"engram_hash[{backend}]",
                lambda: engram_hash(ids, mult, vocab, off, out, backend=backend),
                device,
                _reps(backend),
            ),
            Contender("torch int64 %", lambda: engram_hash_torch(ids, mult, vocab, off), device),
        ],
    )


def experts_case(backend: str, device: str, small: bool) -> Case:
    from epkit.experts import ExpertPlacement, logical_to_physical, logical_to_physical_cpu

    num_tokens, top_k = (1024 if small else 16384), 6
    placement = ExpertPlacement.default(384, 64, 1).to(device)
    g = torch.Generator().manual_seed(0)
    topk = torch.randint(0, 384, (num_tokens, top_k), generator=g, dtype=torch.int32).to(device)
    if backend == "cpu":
        peer = Contender(
            "logical_to_physical[reference]",
            lambda: logical_to_physical(topk, placement, 5, backend="reference"),
            device,
            _reps("reference"),
        )
    else:
        peer = Contender("logical_to_physical_cpu", lambda: logical_to_physical_cpu(topk, placement, 5, 0), device)
    return Case(
        f"{num_tokens} x {top_k} ids, 384 experts, EP64, rank 5",
        "GB/s",
        2 * topk.numel() * 4,
        [
            Contender(
                f"logical_to_physical[{backend}]",
                lambda: logical_to_physical(topk, placement, 5, backend=backend, check_index=False),
                device,
                _reps(backend),
            ),
            peer,
        ],
    )


def grouped_gemm_case(backend: str, device: str, small: bool) -> Case:
    from epkit.grouped_gemm import build_m_indices, m_grouped_fp8_gemm_nt_contiguous, make_inputs
    from epkit.testing import calc_diff

    groups, rows, n, k = (2, 128, 128, 256) if small else (8, 512, 1024, 1024)
    if device == "cuda":
        groups, rows, n, k = 4, 4096, 4096, 7168
    (a, sfa), (b, sfb), af, bf = make_inputs("fp8", groups, groups * rows, n, k, masked=False, seed=0)
    a, sfa, b, sfb = (t.to(device) for t in (a, sfa, b, sfb))
    m_indices = build_m_indices([rows] * groups, device=device)
    d = torch.empty(groups * rows, n, dtype=torch.bfloat16, device=device)
    run = lambda be, out: m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), out, m_indices, backend=be)  # noqa: E731
    if device == "cuda":
        diff = calc_diff(run(backend, d), run("reference", torch.empty_like(d)))
        if diff > 1e-4:
            raise AssertionError(f"m_grouped_fp8_gemm_nt_contiguous[{backend}] on cuda: calc_diff {diff:.2e}")
        print(f"m_grouped_fp8_gemm_nt_contiguous[{backend}] at the timed shape: calc_diff {diff:.1e} on cuda")
    dense = torch.bfloat16 if device == "cuda" else torch.float32
    x, w = af.to(device, dense), bf[0].to(device, dense).T.contiguous()
    peer_out = torch.empty(x.shape[0], n, dtype=dense, device=device)
    return Case(
        f"{groups} groups x {rows} rows, N={n} K={k}, FP8 weights, bf16 out",
        "TFLOP/s",
        2 * groups * rows * n * k,
        [
            Contender(f"m_grouped_fp8_gemm_nt_contiguous[{backend}]", lambda: run(backend, d), device, _reps(backend)),
            Contender(
                f"torch.matmul {str(dense).removeprefix('torch.')}", lambda: torch.matmul(x, w, out=peer_out), device
            ),
        ],
        unit_size=1e12,
    )


CASES = {
    "gather": gather_case,
    "cp_mirror": cp_mirror_case,
    "engram": engram_case,
    "experts": experts_case,
    "grouped_gemm": grouped_gemm_case,
}


def _pick_device(op: str, backend: str, device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() and backend in registered_ops()[op].cuda else "cpu"


def check(family: str, backend: str, device: str) -> None:
    """Step 1: the op's self-check with ``backend`` (on ``device``; CPU inputs for the grouped GEMMs)."""
    ops = registered_ops()
    if family == "grouped_gemm":
        for op in (name for name in ops if name.startswith("m_grouped_")):
            ops[op].selfcheck(backend)
            print(f"{op}[{backend}] matches the reference (CPU inputs)")
        return
    ops[OPS[family]].selfcheck(backend, device)
    print(f"{OPS[family]}[{backend}] matches the reference on {device}")


def time_case(case: Case, interpreted: bool) -> None:
    """Step 2: latency and rate of every contender, in order."""
    print(f"timing {case.shape}:")
    for i, c in enumerate(case.contenders):
        dt = time_per_call(c.call, c.device, reps=c.reps)
        note = "  (Triton interpreter time, not kernel speed)" if interpreted and i == 0 else ""
        rate = case.work / dt / case.unit_size
        print(f"{c.label:>46}: {dt * 1e3:10.3f} ms  {rate:10.4g} {case.unit}  on {c.device}{note}")


def run(family: str, backend: str, device: str = "auto") -> None:
    """Both steps for one family and backend (``device`` as ``--device``); raises as the CLI reports."""
    device = _pick_device(OPS[family], backend, device)
    if device == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError("--device cuda: torch sees no CUDA device")
    select(OPS[family], device, backend)  # raises BackendUnavailableError with the reason
    check(family, backend, device)
    interpreted = device == "cpu" and backend == "triton"
    time_case(CASES[family](backend, device, small=interpreted), interpreted)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family", choices=sorted(OPS))
    ap.add_argument("--backend", required=True, choices=("triton", "tilelang", "cpu", "reference"))
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = ap.parse_args(argv)
    try:
        run(args.family, args.backend, args.device)
    except BackendUnavailableError as exc:
        print(f"kernel_check: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # the op has no such backend
        print(f"kernel_check: {exc}", file=sys.stderr)
        return 2
    except AssertionError as exc:
        print(f"kernel_check: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
