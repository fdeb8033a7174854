"""``epkit bench`` family ``cp_mirror``: :func:`epkit.prepare_cp_mirror` (zigzag CP index metadata) on 64 packed
sequences with cached prefixes, cp 8, rank 3, ratios (1, 4, 128), at growing token counts: each backend
against the Python reference (on a GPU also the ``cpu`` backend on host tensors) and the roof, a ``copy_``
of the metadata the call writes. Throughput counts query tokens."""

from __future__ import annotations

import dataclasses

import torch

from epkit.bench.core import BenchCtx, Case, Family, Ref, copy_roof, timed_backends
from epkit.cp_mirror import mirrors_equal, prepare_cp_mirror, prepare_cp_mirror_reference, random_batch

__all__ = ["FAMILY", "RATIOS"]

#: The compression ratios every call uses, and the CP group size and rank timed.
RATIOS, CP_SIZE, CP_RANK = (1, 4, 128), 8, 3


def _cases(ctx: BenchCtx) -> list[Case]:
    seqs = ctx.pick(16, 64, 64)
    sweep = ctx.pick((4096,), (16384, 131072), (16384, 65536, 131072))
    return [Case(f"prepare_cp_mirror {seqs} seqs / {q} tokens", lambda c, q=q: _run(c, seqs, q)) for q in sweep]


def _metadata_bytes(m) -> int:
    """Bytes of every tensor a CPMirror holds (the per-ratio ks / ke included)."""
    total = 0
    for f in dataclasses.fields(m):
        v = getattr(m, f.name)
        for t in v.values() if isinstance(v, dict) else (v,):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _run(ctx: BenchCtx, seqs: int, total_q: int) -> None:
    cu_q, cu_k = random_batch(seqs, total_q, 4096, seed=0)
    want = prepare_cp_mirror_reference(cu_q, cu_k, CP_SIZE, CP_RANK, RATIOS)
    dq, dk = cu_q.to(ctx.device), cu_k.to(ctx.device)
    fns = {}
    backends = timed_backends("prepare_cp_mirror", ctx.device)
    for b in backends:
        diff = mirrors_equal(prepare_cp_mirror(dq, dk, CP_SIZE, CP_RANK, RATIOS, backend=b), want)
        if ctx.check(f"prepare_cp_mirror[{b}] {total_q} tokens equals the reference", diff is None, diff or ""):
            fns[b] = lambda b=b: prepare_cp_mirror(dq, dk, CP_SIZE, CP_RANK, RATIOS, backend=b)
    fns["reference"] = lambda: prepare_cp_mirror_reference(cu_q, cu_k, CP_SIZE, CP_RANK, RATIOS)
    if ctx.cuda:
        fns["cpu on host"] = lambda: prepare_cp_mirror(cu_q, cu_k, CP_SIZE, CP_RANK, RATIOS, backend="cpu")
    # the call writes the metadata and reads the sequence lengths: that traffic, at the copy's rate
    roof_name, fns["roof"] = copy_roof(_metadata_bytes(want) + 2 * 4 * (seqs + 1), ctx.device)
    t = ctx.measure(fns)
    peers = [Ref("reference (Python)", t["reference"])]
    if "cpu on host" in t:
        peers.append(Ref("cpu backend, host tensors", t["cpu on host"]))
    shape = f"{seqs} seqs {total_q} tok cp{CP_SIZE}"
    roof = Ref(roof_name, t["roof"])
    kw = {"work": total_q, "unit": "Mtok/s", "roof": roof, "peers": peers, "sweep": {"tokens": total_q}}
    ctx.rows_of(t, backends, "prepare_cp_mirror", shape, **kw)


FAMILY = Family("cp_mirror", "prepare_cp_mirror: CP zigzag index metadata", _cases)
