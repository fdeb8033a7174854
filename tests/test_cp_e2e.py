"""End-to-end CP proof: zigzag shards + all-gathered keys + ks/ke equal single-process causal attention."""

import pytest
import torch

from epkit.collectives.cp_group import CPGroup
from epkit.cp_mirror import from_mirror, prepare_cp_mirror, to_mirror
from epkit.testing.multiprocess import run_ranks
from epkit.topology import ParallelGroups

D = 16


def _batch():
    """Several sequences with cached prefixes (q_len, prefix), including lengths below 2*cp."""
    lens = [(37, 5), (3, 0), (64, 17), (1, 9), (20, 0), (11, 30)]
    g = torch.Generator().manual_seed(11)
    seqs = []
    for q_len, prefix in lens:
        k_len = prefix + q_len
        seqs.append(
            {
                "q": torch.randn(q_len, D, generator=g, dtype=torch.float64),
                "k": torch.randn(k_len, D, generator=g, dtype=torch.float64),  # prefix keys are the KV cache
                "v": torch.randn(k_len, D, generator=g, dtype=torch.float64),
                "prefix": prefix,
            }
        )
    cu_q = torch.tensor(
        [0] + [sum(s["q"].shape[0] for s in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32
    )
    cu_k = torch.tensor(
        [0] + [sum(s["k"].shape[0] for s in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32
    )
    return seqs, cu_q, cu_k


def _compress(k, c):
    """Mean-pool every c consecutive keys of one sequence: floor(len/c) compressed keys."""
    n = k.shape[0] // c
    return k[: n * c].reshape(n, c, k.shape[1]).mean(dim=1)


def _attend(q, k, v):
    if k.shape[0] == 0:
        return torch.zeros_like(q)
    w = torch.softmax(q @ k.T / D**0.5, dim=-1)
    return w @ v


def _single_process(seqs, c):
    """Causal attention over the full batch, one query at a time, straight from the definition."""
    out = []
    for s in seqs:
        kc, vc = (_compress(s["k"], c), _compress(s["v"], c)) if c > 1 else (s["k"], s["v"])
        for i in range(s["q"].shape[0]):
            visible = (s["prefix"] + i + 1) // c
            out.append(_attend(s["q"][i : i + 1], kc[:visible], vc[:visible]))
    return torch.cat(out)


def _cp_rank_forward(rank, world_size, c):
    pg = ParallelGroups.create(dp_size=1, cp_size=world_size, device="cpu")
    cp = CPGroup.from_parallel_groups(pg, timeout=30)
    seqs, cu_q, cu_k = _batch()
    mirror = prepare_cp_mirror(cu_q, cu_k, world_size, cp.rank, compress_ratios=(c,))
    q_all = torch.cat([s["q"] for s in seqs])
    new_k = torch.cat([s["k"][s["prefix"] :] for s in seqs])  # keys of this step's tokens
    new_v = torch.cat([s["v"][s["prefix"] :] for s in seqs])
    # Entry: this rank's queries and new keys in mirror order (the only data a CP rank starts with).
    local_q = to_mirror(q_all, mirror)
    wait_k = cp.all_gather(to_mirror(new_k, mirror))  # start the gathers, overlap, wait when needed
    wait_v = cp.all_gather(to_mirror(new_v, mirror))
    k_full, v_full = from_mirror(wait_k(), mirror), from_mirror(wait_v(), mirror)
    # Packed key buffer of ratio c: per sequence, cached prefix then gathered new keys, then pooled.
    kbuf, vbuf = [], []
    for b, s in enumerate(seqs):
        lo, hi = int(cu_q[b]), int(cu_q[b + 1])
        k_seq = torch.cat([s["k"][: s["prefix"]], k_full[lo:hi]])
        v_seq = torch.cat([s["v"][: s["prefix"]], v_full[lo:hi]])
        kbuf.append(_compress(k_seq, c) if c > 1 else k_seq)
        vbuf.append(_compress(v_seq, c) if c > 1 else v_seq)
    kbuf, vbuf = torch.cat(kbuf), torch.cat(vbuf)
    ks, ke = mirror.ks[c].tolist(), mirror.ke[c].tolist()
    out = torch.cat(
        [_attend(local_q[j : j + 1], kbuf[ks[j] : ke[j]], vbuf[ks[j] : ke[j]]) for j in range(mirror.cp_mirror_len)]
    )
    # Exit: gather every rank's outputs and restore the original token order.
    return from_mirror(cp.all_gather(out)(), mirror)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("ratio", [1, 4])
def test_cp_attention_equals_single_process(world_size, ratio):
    seqs, _, _ = _batch()
    want = _single_process(seqs, ratio)
    results = run_ranks(_cp_rank_forward, world_size, ratio, timeout=90)
    for rank, got in enumerate(results):
        err = (got - want).abs().max().item()
        assert err <= 1e-10, f"{world_size=} {ratio=} {rank=}: max error {err:.2e}"
