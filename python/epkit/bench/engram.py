"""``epkit bench`` family ``engram``: :func:`epkit.engram_hash` (the demo config: N=3, K=8, 2 layers) into a
preallocated output at growing token counts: each backend against the same hash in plain torch int64 ops
(:func:`engram_hash_torch`, on the device), the reference (numpy, CPU) and the roof, a ``copy_`` of the bytes
the hash reads (ids) and writes (row ids)."""

from __future__ import annotations

import statistics

import torch

from epkit.bench.core import BenchCtx, Case, Family, Ref, copy_roof, timed_backends
from epkit.engram import EngramConfig, engram_hash, engram_hash_reference, hash_params

__all__ = ["FAMILY", "engram_hash_torch"]


def engram_hash_torch(ids: torch.Tensor, mult: torch.Tensor, vocab: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """``engram_hash`` in plain torch int64 ops on any device (``%`` on int64 is floor-mod, as numpy's).

    ``ids`` [T, N] int32, ``mult`` [L, N] int64, ``vocab`` [L, N-1, K] int32, ``off`` [L, (N-1)*K] int32, as
    :func:`epkit.hash_params` gives them; returns [L, T, (N-1)*K] int32 row ids (the reference's bits).
    """
    x = ids.long()
    vocab64 = vocab.long()
    mix = x[:, 0] * mult[:, :1]  # [L, T]
    cols = []
    for k in range(1, vocab.shape[1] + 1):
        mix = mix ^ (x[:, k] * mult[:, k : k + 1])
        cols.append(mix[:, :, None] % vocab64[:, None, k - 1, :])  # [L, T, K]
    return (torch.cat(cols, dim=2) + off[:, None, :]).to(torch.int32)


def _cases(ctx: BenchCtx) -> list[Case]:
    sweep = ctx.pick((4096,), (16384, 262144), (65536, 262144, 1 << 20))
    return [Case(f"engram_hash {n} tokens", lambda c, n=n: _run(c, n)) for n in sweep]


def _run(ctx: BenchCtx, tokens: int) -> None:
    cfg = EngramConfig(vocab_size=129280)  # the demo config: N=3, K=8, layers (1, 15)
    params = hash_params(cfg)
    g = torch.Generator().manual_seed(0)
    ids_cpu = torch.randint(0, cfg.vocab_size, (tokens, cfg.max_ngram_size), generator=g, dtype=torch.int32)
    want = engram_hash_reference(ids_cpu, *params)
    ids = ids_cpu.to(ctx.device)
    mult, vocab, off = (p.to(ctx.device) for p in params)
    fns = {}
    backends = timed_backends("engram_hash", ctx.device)
    for b in backends:
        out = torch.empty(want.shape, dtype=torch.int32, device=ctx.device)
        engram_hash(ids, mult, vocab, off, out, backend=b)
        if ctx.check(f"engram_hash[{b}] {tokens} tokens equals the reference", torch.equal(out.cpu(), want)):
            fns[b] = lambda b=b, out=out: engram_hash(ids, mult, vocab, off, out, backend=b)
    ctx.check(
        f"engram_hash_torch {tokens} tokens equals the reference",
        torch.equal(engram_hash_torch(ids, mult, vocab, off).cpu(), want),
    )
    fns["torch"] = lambda: engram_hash_torch(ids, mult, vocab, off)
    if not ctx.cuda:
        fns["reference"] = lambda: engram_hash_reference(ids_cpu, *params)
    moved = ids.numel() * 4 + want.numel() * 4
    roof_name, fns["roof"] = copy_roof(moved, ctx.device)
    t = ctx.measure(fns)
    peers = [Ref("plain torch int64 ops", t["torch"])]
    if "reference" in t:
        peers.append(Ref("reference (numpy)", t["reference"]))
    for b in backends:
        if b in t:
            rate = f"{tokens / (statistics.median(t[b]) * 1e3):.3g} Mtok/s"
            roof = Ref(roof_name, t["roof"])
            kw = {
                "work": moved,
                "unit": "GB/s",
                "roof": roof,
                "peers": peers,
                "note": rate,
                "sweep": {"tokens": tokens},
            }
            ctx.row("engram_hash", f"{tokens} tok N3 K8 L2", b, t[b], **kw)


FAMILY = Family("engram", "engram_hash: n-gram hash to table rows", _cases)
