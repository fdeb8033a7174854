"""EPBuffer across emulated hosts: the hierarchy (shm inside a host, torch between) and the flat torch transport,
bit for bit against ep_reference's two-level order; the bytes that cross hosts; the two-level order itself."""

import re

import pytest
import torch
import torch.distributed as dist
from test_hosts import check_low_latency

from epkit.collectives.ep.hier_rows import gather_split_rows, rail_order, sum_by_host, token_order
from epkit.collectives.ep_buffer import EPBuffer
from epkit.collectives.ep_reference import (
    reference_combine,
    reference_dispatch,
)
from epkit.quant import per_token_group_cast_to_fp8
from epkit.testing import assert_bitwise_equal
from epkit.testing.hosts import requires_namespaces, run_hosts
from epkit.testing.multiprocess import run_ranks
from epkit.testing.nvshmem_emulator import resolve_transport

HIDDEN, EXPERTS, TOPK, CAP = 256, 16, 4, 32
SIZES = [5, 32, 0, 17]  # tokens per rank (by rank % 4)


def _routing(rank, n, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    perms = [torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(n)]
    idx = torch.stack(perms) if n else torch.empty((0, TOPK), dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
    return torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16), idx, torch.rand(n, TOPK, generator=g)


def _expect_rejected(call, args, needle, ctx):
    try:
        call(*args)
    except ValueError as exc:
        assert needle in str(exc), (ctx, str(exc))
        return
    raise AssertionError(f"{ctx}: no ValueError")


def _normal(buf, hosts, expand, fp8, seed):
    """One dispatch (plus a cached one) and combine with a bias, against the reference; returns the handle."""
    r = dist.get_rank()
    x, idx, w = _routing(r, SIZES[r % 4], seed)
    scales = None
    if fp8:
        x, scales = per_token_group_cast_to_fp8(x.float(), 128)
    a = 4 if expand else 1
    recv, recv_idx, recv_w, counts, handle = buf.dispatch((x, scales) if fp8 else x, idx, w, a, expand)
    ref = reference_dispatch(x, idx, w, EXPERTS, None, expand=expand, expert_alignment=a, x_scales=scales)
    ctx = f"rank {r} {buf.transport} {expand=} {fp8=}"
    key = "expanded_x" if expand else "recv_x"
    assert_bitwise_equal(recv[0] if fp8 else recv, ref[key], ctx)
    assert_bitwise_equal(recv_idx, ref["recv_topk_idx"], ctx)
    assert_bitwise_equal(recv_w, ref["recv_topk_weights"], ctx)
    assert counts == ref["num_recv_tokens_per_expert"], ctx
    if expand:
        assert_bitwise_equal(EPBuffer.m_indices(handle), ref["m_indices"], ctx)
    if fp8 and not expand:
        assert_bitwise_equal(recv[1], ref["recv_scales"], ctx)
    # Cached: other rows along the same routing.
    x2 = (x.float() * -2).to(x.dtype) if not fp8 else x
    again = buf.dispatch((x2, scales) if fp8 else x2, handle=handle)
    ref2 = reference_dispatch(x2, idx, w, EXPERTS, None, expand=expand, expert_alignment=a, x_scales=scales)
    assert_bitwise_equal(again[0][0] if fp8 else again[0], ref2[key], ctx + " cached")
    y = (ref[key].float() * (0.5 + 0.125 * r) + 1).to(torch.bfloat16)  # each rank its own rows: the order shows
    bias = torch.randn(x.shape[0], HIDDEN, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
    want = reference_combine(y, ref, x.shape[0], None, bias=bias, expand=expand, hosts=hosts)
    assert_bitwise_equal(buf.combine(y, handle, bias=bias), want, ctx + " combine")
    return handle, y


def _predicted_bytes(hosts, idx, num_rows_bytes):
    """This rank's share of what one plain bf16 dispatch + combine sends across hosts with per-host dedup: per
    token and remote host it touches, the row, 8 bytes per expert slot of metadata (global id, weight) and the
    row back (its host partial, sent by the rail peer: only the job's total is this rank's); per remote rank
    the layout (4 + world_size words + 192 bytes of error text) and handle agreements (3 words + 192) with a
    24-byte header each; per remote rail peer the dispatch message's header (32 bytes: in two parts) and the combine
    message's (24), up to 15 bytes of padding for each of the dispatch message's 4 field blocks, and its order mask
    (a bit per token, at most)."""
    me, w, L = dist.get_rank(), dist.get_world_size(), EXPERTS // dist.get_world_size()
    host_of = {r: h for h, g in enumerate(hosts) for r in g}
    touched = torch.zeros(idx.shape[0], len(hosts), dtype=torch.bool)
    for t in range(idx.shape[0]):
        for e in idx[t].tolist():
            if e >= 0:
                touched[t, host_of[e // L]] = True
    touched[:, host_of[me]] = False
    remote_rows = int(touched.sum())
    remote_ranks = sum(1 for r in range(w) if host_of[r] != host_of[me])
    rows = remote_rows * (2 * num_rows_bytes + 8 * TOPK)
    agreements = 24 + 8 * (4 + w) + 192 + 24 + 24 + 192
    mask = -(-idx.shape[0] // 8)
    return rows, rows + remote_ranks * agreements + (len(hosts) - 1) * (32 + 24 + 4 * 15 + mask)


def _hier_checks(rank, world_size, ranks_per_host, names=("auto", "torch"), emulated=None, portable=False):
    """The checks of one rank, for each transport in ``names``; ``emulated``: a test transport of
    ``resolve_transport`` to install first (NVLink domains of the NVSHMEM emulator as the hosts); ``portable``:
    row moves and sums through the torch formulations CUDA rows take (``EPBuffer(portable=True)``)."""
    if emulated is not None:
        resolve_transport(emulated)
    hosts = [list(range(h, h + ranks_per_host)) for h in range(0, world_size, ranks_per_host)]
    out = {}
    for name in names:
        buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, CAP, TOPK, transport=name, timeout=20, portable=portable)
        out[name] = {"transport": buf.transport, "hosts": buf.hosts}
        x, idx, w = _routing(rank, SIZES[rank % 4], 1)
        before = buf.bytes_across_hosts()
        _, _, _, _, handle = buf.dispatch(x, idx, w)
        # A rail message in two parts whose order had to be sent (rail_order's mask), on some rank of the job.
        out[name]["split"] = handle.hier is not None and any(t is not None for t in handle.hier.tok_order)
        ref = reference_dispatch(x, idx, w, EXPERTS)
        buf.combine(ref["recv_x"].clone(), handle)
        out[name]["bytes"] = buf.bytes_across_hosts() - before
        out[name]["predicted"] = _predicted_bytes(hosts, idx, 2 * HIDDEN)
        h1, y1 = _normal(buf, hosts, False, False, 2)
        _normal(buf, hosts, True, True, 3)
        h2, y2 = _normal(buf, hosts, False, True, 5)
        # A stale handle on rank 0, a bad call on the last rank: the same ValueError on every rank, then a good call.
        stale = (y1, h1) if rank == 0 else (y2, h2)
        _expect_rejected(buf.combine, stale, "do not come from one dispatch", name)
        bad = x[:, : HIDDEN // 2] if rank == world_size - 1 else x
        _expect_rejected(buf.dispatch, (bad, idx, w), f"rank {world_size - 1}:", name)
        _normal(buf, hosts, False, False, 6)
        check_low_latency(buf, None, True, 7)
        check_low_latency(buf, None, False, 8)
        buf.close()
    return out


def _check_hosts(ranks_per_host):
    res = run_hosts(_hier_checks, 2, ranks_per_host, ranks_per_host, timeout=240)
    hosts = [list(range(h, h + ranks_per_host)) for h in (0, ranks_per_host)]
    for got in res:
        assert got["auto"]["transport"] == "hierarchical(shm+torch)" and got["torch"]["transport"] == "torch"
        assert got["auto"]["hosts"] == got["torch"]["hosts"] == hosts
    # The job's totals: a rank sends the rows of its own tokens, and the host partials of its rail peers' tokens.
    total = {name: sum(got[name]["bytes"] for got in res) for name in ("auto", "torch")}
    rows, limit = (sum(got["auto"]["predicted"][i] for got in res) for i in (0, 1))
    assert rows <= total["auto"] <= limit, (total, rows, limit)  # per-host dedup (and the rows did cross)
    if ranks_per_host > 1:  # a token for two ranks of the other host crosses once, not twice
        assert total["auto"] < total["torch"], total
        assert any(got["auto"]["split"] for got in res)  # the x rows straight into a result, out of token order
    else:
        assert total["auto"] <= total["torch"], total
    return res


@requires_namespaces
def test_two_hosts_of_two_ranks():
    _check_hosts(2)


@requires_namespaces
def test_two_hosts_of_one_rank():
    _check_hosts(1)


def _cached_other_dtype(rank, world_size):
    """A cached dispatch where rank 0 passes float32 rows and the others bf16 (the handle agreement compares the
    handles and the rows' formats before any row moves)."""
    buf = EPBuffer(dist.group.WORLD, 1024, EXPERTS, 64, TOPK, transport="auto", timeout=10)
    _, idx, w = _routing(rank, 64, 1)
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    handle = buf.dispatch(x, idx, w)[4]
    try:
        buf.dispatch(x.float() if rank == 0 else x, handle=handle)
    except Exception as exc:  # noqa: BLE001 -- the kind and text are the result
        return type(exc).__name__, str(exc)
    return "no error", ""


@requires_namespaces
def test_cached_dispatch_with_other_rows_fails_cleanly():
    # Rows of another dtype on one rank: the same ValueError on every rank, in the handle agreement, before any row
    # moves (it used to be found only by the rail peers reading a message that was not the exchange's, the other
    # ranks timing out; before that, gloo ended a process on a message longer than the receive it had posted)
    res = run_hosts(_cached_other_dtype, 2, 2, timeout=120)
    assert len({text for _, text in res}) == 1, res
    kind, text = res[0]
    assert kind == "ValueError" and "the rows (x) differ in format across ranks (rank 0: torch.float32" in text, res


def _three_hosts_routing(rank, L, seed, mode):
    """Tokens of one rank of 3 hosts x 2 ranks (top-3 of 6 * L experts, a quarter of the slots -1). ``edge``: every
    token rank 0 sends host 1 is for rank 2, its rail peer there (the message's x rows all in its first part, k ==
    n), none it sends host 2 is for rank 4 (k == 0 < n); every token of rank 3 is for rank 1, its rail peer on host
    0 (k == n)."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    n = 0 if mode == "zero" else [30, 7, 0, 40, 1, 12][rank]
    idx = torch.stack([torch.randperm(6 * L, generator=g)[:3] for _ in range(n)]) if n else torch.empty((0, 3))
    idx = idx.long()
    idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
    if mode == "edge" and rank in (0, 3):
        idx[:] = -1
    for i in range(n if mode == "edge" and rank == 0 else 0):
        if i % 3 == 0:  # ranks 2 and 3 (host 1)
            idx[i, 0], idx[i, 1] = 2 * L + i % L, 3 * L
        elif i % 3 == 1:  # rank 5 only (host 2)
            idx[i, 0] = 5 * L + 1
        else:  # rank 2 (host 1) and rank 1 (this host)
            idx[i, 0], idx[i, 2] = 2 * L, L
    if mode == "edge" and rank == 3:
        idx[:, 1] = L + 2
    return torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16), idx, torch.rand(n, 3, generator=g)


def _three_hosts(rank, world_size, slots):
    import os

    os.environ["EPKIT_RESULT_SLOTS"] = str(slots)
    hosts, L = [[0, 1], [2, 3], [4, 5]], 4
    buf = EPBuffer(dist.group.WORLD, HIDDEN, 6 * L, 40, 3, transport="auto", timeout=20)
    assert buf.transport == "hierarchical(shm+torch)", buf.transport
    split = {}
    for mode in ("edge", "rand", "zero"):
        for expand, fp8 in ((False, False), (True, False), (False, True), (True, True)):
            x, idx, w = _three_hosts_routing(rank, L, 7 + expand + 2 * fp8, mode)
            scales = per_token_group_cast_to_fp8(x.float(), 128)[1] if fp8 else None
            x = per_token_group_cast_to_fp8(x.float(), 128)[0] if fp8 else x
            a, key, ctx = (4 if expand else 1), ("expanded_x" if expand else "recv_x"), f"rank {rank} {mode} {fp8=}"
            recv, ri, rw, _, handle = buf.dispatch((x, scales) if fp8 else x, idx, w, a, expand)
            ref = reference_dispatch(x, idx, w, 6 * L, None, expand=expand, expert_alignment=a, x_scales=scales)
            for got, want in (
                (recv[0] if fp8 else recv, ref[key]),
                (ri, ref["recv_topk_idx"]),
                (rw, ref["recv_topk_weights"]),
            ):
                assert_bitwise_equal(got, want, ctx)
            if fp8 and not expand:
                assert_bitwise_equal(recv[1], ref["recv_scales"], ctx)
            x2 = x if fp8 else (x.float() * -2).to(x.dtype)
            again = buf.dispatch((x2, scales) if fp8 else x2, handle=handle)
            ref2 = reference_dispatch(x2, idx, w, 6 * L, None, expand=expand, expert_alignment=a, x_scales=scales)
            assert_bitwise_equal(again[0][0] if fp8 else again[0], ref2[key], ctx + " cached")
            y = (ref[key].float() * (0.5 + 0.125 * rank) + 1).to(torch.bfloat16)
            want = reference_combine(y, ref, x.shape[0], None, expand=expand, hosts=hosts)
            assert_bitwise_equal(buf.combine(y, handle), want, ctx + " combine")
            split[mode] = [t is not None for t in handle.hier.tok_order], handle.hier.rail_counts
    buf.close()
    return split


@requires_namespaces
@pytest.mark.parametrize("slots", [2, 0])
def test_three_hosts_edge_messages(slots):
    # 3 hosts x 2 ranks, with result slots and without: rail messages wholly in their first part (k == n), with
    # none in it (k == 0 < n), split with a mask, empty, and ranks with no tokens; FP8, expand, cached, combine,
    # bit for bit against the reference in the three-host order.
    res = run_hosts(_three_hosts, 3, 2, slots, timeout=240)
    edge = [r["edge"] for r in res]  # per rank: (whether each rail peer's message had a mask, its rows)
    assert edge[2][1][0] == 20 and not edge[2][0][0]  # rank 0's 20 tokens for host 1, all rank 2's: k == n
    assert edge[4][1][0] == 10 and not edge[4][0][0]  # rank 0's 10 for host 2, none rank 4's: k == 0 < n
    assert edge[1][1][1] == 40 and not edge[1][0][1]  # rank 3's 40, all rank 1's: k == n
    assert any(any(r["rand"][0]) for r in res)  # and some message split with a mask


def _hier_slots(rank, world_size, count):
    """Hierarchical dispatch results in the receiver's intra result slots while one is free (``count`` of them:
    ``EPKIT_RESULT_SLOTS``); held results keep theirs, later ones go through the intra regions; the same rows."""
    import os

    os.environ["EPKIT_RESULT_SLOTS"] = str(count)
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, CAP, TOPK, transport="hierarchical", timeout=20)
    made = buf._normal.hy.result_slots is not None
    local = buf._normal.hy.intra.local
    lo, hi = local.data_ptr(), local.data_ptr() + local.numel()

    def call(seed, fp8=False):  # (the received rows, and scales; the reference's; whether they are in a slot)
        x, idx, w = _routing(rank, CAP, seed)
        scales = per_token_group_cast_to_fp8(x.float(), 128)[1] if fp8 else None
        if fp8:
            x = per_token_group_cast_to_fp8(x.float(), 128)[0]
        recv = buf.dispatch((x, scales) if fp8 else x, idx, w)[0]
        ref = reference_dispatch(x, idx, w, EXPERTS, None, x_scales=scales)
        got, want = (recv if fp8 else (recv,)), (ref["recv_x"], ref["recv_scales"])[: 2 if fp8 else 1]
        return got, want, lo <= got[0].data_ptr() < hi

    def same(got, want):
        return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))

    held = [call(seed, fp8=seed == 1) for seed in range(4)]  # two slots: the 3rd and 4th results take none
    where = [in_slot for _, _, in_slot in held]
    checks = [same(*c[:2]) for c in held]
    del held[:2]  # their slots are free again
    for seed in (4, 5):  # each takes a free slot; rank 0 keeps both results, the others let them go at once
        got = call(seed)
        where.append(got[2])
        checks.append(same(*got[:2]))
        if rank == 0:
            held.append(got)
        del got
    last = call(6)  # rank 0 names no slot (both held), its host peer does: one exchange with both kinds of receiver
    where.append(last[2])
    checks += [same(*c[:2]) for c in held] + [same(*last[:2])]  # held results untouched by the later calls
    buf.close()
    checks += [same(*c[:2]) for c in held] + [same(*last[:2])]  # and still readable past the buffer's close
    return made, where, checks


@requires_namespaces
@pytest.mark.parametrize("count", [2, 0])
def test_hierarchy_forwards_rows_into_free_result_slots(count):
    for rank, (made, where, same) in enumerate(run_hosts(_hier_slots, 2, 2, count, timeout=120)):
        assert made == (count > 0) and all(same), (made, same)
        # The last call: rank 0 (two results held in slots) names none, its host peer does; every result correct.
        want = [True, True, False, False, True, True, rank != 0] if count else [False] * 7
        assert where == want, (rank, where)


@pytest.mark.parametrize("portable", [False, True])
def test_nvshmem_hierarchy_across_nvlink_domains(portable):
    # CUDA ranks in two NVLink domains of two GPUs (the NVSHMEM emulator: peer views inside a domain, puts with
    # signal between): nvshmem inside a domain and between, each token once per destination domain, bit for bit
    # the reference's two-level order; the flat nvshmem buffer sums in that order too and puts more bytes across.
    # portable: with the row moves and sums CUDA rows take.
    names = ("hierarchical", "nvshmem")
    res = run_ranks(_hier_checks, 4, 2, names, "nvemu-dom2", portable, timeout=300)
    for got in res:
        assert got["hierarchical"]["transport"] == "hierarchical(nvshmem+nvshmem)", got
        assert got["nvshmem"]["transport"] == "nvshmem", got
        assert got["hierarchical"]["hosts"] == got["nvshmem"]["hosts"] == [[0, 1], [2, 3]], got
    total = {name: sum(got[name]["bytes"] for got in res) for name in names}
    rows, limit = (sum(got["hierarchical"]["predicted"][i] for got in res) for i in (0, 1))
    assert rows <= total["hierarchical"] <= limit, (total, rows, limit)
    assert total["hierarchical"] < total["nvshmem"], total


def _orders(rank, world_size):
    """reference_combine's order, and sum_by_host against it (the flat transports' source-side sum)."""
    x, idx, w = _routing(rank, 32, 11)
    ref = reference_dispatch(x, idx, w, EXPERTS)
    y = (ref["recv_x"].float() * (1.37 + 0.1 * rank) - 0.21).to(torch.bfloat16)  # each rank its own rows
    outs = {str(h): reference_combine(y, ref, x.shape[0], hosts=h) for h in (None, [[0, 1, 2, 3]], [[0, 1], [2, 3]])}
    # The rows each rank sends back, then sum_by_host on them: the source side of a flat combine.
    sizes = [t.numel() for t in ref["tokens"]]
    recv = torch.empty((sum(sizes), HIDDEN), dtype=y.dtype)
    dist.all_to_all_single(recv, y, output_split_sizes=sizes, input_split_sizes=ref["recv_counts"])
    back = list(torch.split(recv, sizes))
    for hosts in (None, [[0, 1], [2, 3]]):
        got = sum_by_host(torch.empty_like(x), back, ref["tokens"], [], hosts)
        assert_bitwise_equal(got, outs[str(hosts)], f"rank {rank} sum_by_host {hosts}")
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, 32, TOPK, timeout=20)
    hosts, transport = buf.hosts, buf.transport
    buf.close()
    one, two = outs["None"], outs[str([[0, 1], [2, 3]])]
    return torch.equal(one, outs[str([[0, 1, 2, 3]])]), bool((one != two).any()), hosts, transport


def test_reference_order_across_hosts_differs_and_one_host_is_todays():
    res = run_ranks(_orders, 4, timeout=90)
    for same_one_host, _, hosts, transport in res:
        assert same_one_host and hosts == [[0, 1, 2, 3]] and transport == "shm"
    assert any(differs for _, differs, _, _ in res)  # the two-level order is a different order: the test can fail


def _killed_in_nvshmem_hierarchy(rank, world_size):
    import os
    import signal
    import time

    resolve_transport("nvemu-dom2")
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, CAP, TOPK, transport="hierarchical", timeout=3)
    x, idx, w = _routing(rank, 16, 9)
    idx[:, 0] = (rank * 7 + 5) % EXPERTS  # every rank sends to both domains
    buf.dispatch(x, idx, w)  # one good round
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # dies before the second dispatch
    t0 = time.monotonic()
    try:
        buf.dispatch(x, idx, w)
    except (TimeoutError, RuntimeError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error", "", 0.0


def test_nvshmem_hierarchy_names_a_dead_rank_within_the_timeout():
    res = run_ranks(_killed_in_nvshmem_hierarchy, 4, timeout=90, may_die=(3,))
    assert res[3] is None
    for rank in (0, 1, 2):
        kind, msg, waited = res[rank]
        # Its own timeout, or a survivor's notice (PeerFailedError, a RuntimeError) passed on.
        assert kind in ("TimeoutError", "PeerFailedError"), res[rank]
        assert re.search(r"rank 3 sent no .* (within 3 s|within its timeout)", msg), res[rank]
        assert waited < 6, res[rank]


@pytest.mark.parametrize("portable", [False, True])
def test_rail_order_and_split_rows(portable):
    # A rail message's order (the rail peer's tokens first) undone by its mask, and rows read across the two parts
    # (the first received elsewhere), against plain indexing.
    g = torch.Generator().manual_seed(3)
    for n in (0, 1, 8, 37, 200):
        to_host = torch.rand(n, generator=g) < 0.8
        to_peer = to_host & (torch.rand(n, generator=g) < 0.5)
        order, mask = rail_order(to_host, to_peer, True)
        tokens = to_host.nonzero().flatten()
        k = int(to_peer.sum())
        assert torch.equal(order[:k], to_peer.nonzero().flatten()) and mask.numel() == -(-tokens.numel() // 8)
        assert torch.equal(order[token_order(mask, tokens.numel())], tokens)
        assert torch.equal(rail_order(to_host, to_peer, False)[0], tokens)
        full = torch.randint(0, 256, (tokens.numel(), 24), dtype=torch.uint8, generator=g)
        sel = torch.randperm(tokens.numel(), generator=g)[: tokens.numel() // 2]
        out = torch.zeros((sel.numel(), 24), dtype=torch.uint8)
        gather_split_rows(full[:k].clone(), full[k:].clone(), sel, out, portable)
        assert torch.equal(out, full[sel])
