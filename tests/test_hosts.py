"""Host detection and emulated hosts: the probe, the ``auto`` transport across hosts, EPBuffer across hosts."""

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import torch
import torch.distributed as dist

from epkit.collectives import transports
from epkit.collectives.bootstrap import Rendezvous
from epkit.collectives.ep_buffer import EPBuffer
from epkit.collectives.ep_reference import (
    reference_combine,
    reference_dispatch,
    reference_low_latency_combine,
    reference_low_latency_dispatch,
)
from epkit.collectives.symm_buffer import SymmBuffer
from epkit.collectives.transports.shm import confirm_hosts
from epkit.testing import assert_bitwise_equal
from epkit.testing.hosts import SUBNET, requires_namespaces, run_hosts, set_link
from epkit.testing.multiprocess import RankError, run_ranks

HIDDEN, EXPERTS, TOPK = 256, 16, 4
HIERARCHY = "hierarchical(shm+torch)"  # EPBuffer.transport across hosts under auto


def _hellos(group=None):
    got = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, transports.hello(False), group=group)
    return got


def _probe(rank, world_size):
    """What every view of "one host" says on this rank: the keys, the confirmed groups, auto's choice."""
    hellos = _hellos()
    return {
        "nodenames": sorted({h["hostname"] for h in hellos}),  # the old check: one name means one host
        "groups": transports.host_groups(hellos),
        "confirmed": transports.host_groups(hellos, Rendezvous(dist.group.WORLD, 20, "probe test")),
        "choose": transports.choose(hellos, "gloo", Rendezvous(dist.group.WORLD, 20, "choose test")),
        "one_host": transports.all_on_one_host(dist.group.WORLD),
        # The segment decides, not the keys: every rank put in one candidate group, only true hosts stay together.
        "forced": confirm_hosts(Rendezvous(dist.group.WORLD, 20, "forced"), hellos, [list(range(world_size))]),
        "auto": _auto_transport(dist.group.WORLD),
    }


def _auto_transport(group):
    buf = SymmBuffer(group, 4096, timeout=20)
    name = buf.transport
    buf.close()
    return name


def _routing(rank, n, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    perms = [torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(n)]
    idx = torch.stack(perms) if n else torch.empty((0, TOPK), dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
    return torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16), idx, torch.rand(n, TOPK, generator=g)


def _normal(group, expand, fp8, seed, hosts=None, transport="auto"):
    """Normal dispatch + combine over EPBuffer(transport) on ``group``, bit for bit against ep_reference (whose
    combine sums per host first where ``hosts``, each host's ranks, are several)."""
    buf = EPBuffer(group, HIDDEN, EXPERTS, num_max_tokens_per_rank=32, num_topk=TOPK, timeout=20, transport=transport)
    r = dist.get_rank(group)
    x, idx, w = _routing(r, [5, 32, 0, 17][r % 4], seed)
    scales = None
    if fp8:
        from epkit.quant import per_token_group_cast_to_fp8

        x, scales = per_token_group_cast_to_fp8(x.float(), 128)
    recv, recv_idx, recv_w, counts, handle = buf.dispatch(
        (x, scales) if fp8 else x, idx, w, expand=expand, expert_alignment=4 if expand else 1
    )
    ref = reference_dispatch(
        x, idx, w, EXPERTS, group, expand=expand, expert_alignment=4 if expand else 1, x_scales=scales
    )
    ctx = f"rank {r} {buf.transport} {expand=} {fp8=}"
    assert_bitwise_equal(recv[0] if fp8 else recv, ref["expanded_x" if expand else "recv_x"], ctx)
    assert_bitwise_equal(recv_idx, ref["recv_topk_idx"], ctx)
    assert_bitwise_equal(recv_w, ref["recv_topk_weights"], ctx)
    assert counts == ref["num_recv_tokens_per_expert"], ctx
    rows = ref["expanded_x" if expand else "recv_x"].float()
    y = (rows * 0.5 + 1).to(torch.bfloat16)
    want = reference_combine(y, ref, x.shape[0], group, expand=expand, hosts=hosts)
    assert_bitwise_equal(buf.combine(y, handle), want, ctx + " combine")
    name = buf.transport
    buf.close()
    return name


def check_low_latency(buf, group, use_fp8, seed):
    """Low-latency dispatch + combine on ``buf`` (an EPBuffer over ``group``), bit for bit against ep_reference
    (also used by tests/test_ep_hier.py)."""
    n_max, r, w = 8, dist.get_rank(group), dist.get_world_size(group)
    x, idx, wts = _routing(r, [8, 3, 0, 6][r % 4], seed)
    recv_x, recv_count, handle, _ = buf.low_latency_dispatch(x, idx, n_max, use_fp8=use_fp8)
    ref = reference_low_latency_dispatch(x, idx, n_max, EXPERTS, group, use_fp8=use_fp8)
    assert recv_count.tolist() == ref["counts"]
    y = torch.zeros((EXPERTS // w, n_max * w, HIDDEN), dtype=torch.bfloat16)
    y_ref = []
    for e, c in enumerate(ref["counts"]):
        got = recv_x[0][e, :c] if use_fp8 else recv_x[e, :c]
        assert_bitwise_equal(got, ref["recv_x"][e], f"rank {r} expert {e} low latency {use_fp8=}")
        y[e, :c] = (got.float() * 2 - 1).to(torch.bfloat16)
        y_ref.append(y[e, :c].clone())
    out = buf.low_latency_combine(y, idx, wts, handle)
    assert_bitwise_equal(out, reference_low_latency_combine(y_ref, idx, wts, ref, group), f"rank {r} ll combine")


def _low_latency(group, use_fp8, seed):
    """Low-latency dispatch + combine over EPBuffer(auto) on ``group``, bit for bit against ep_reference."""
    buf = EPBuffer(group, HIDDEN, EXPERTS, num_max_tokens_per_rank=8, num_topk=TOPK, timeout=20)
    check_low_latency(buf, group, use_fp8, seed)
    name = buf.transport
    buf.close()
    return name


def _exchanges(rank, world_size, ranks_per_host):
    """Probe, then dispatch/combine on the whole job and on each host's own group; what /dev/shm holds after."""
    out = _probe(rank, world_size)
    hosts = [list(range(h, h + ranks_per_host)) for h in range(0, world_size, ranks_per_host)]
    mine = [dist.new_group(g) for g in hosts][rank // ranks_per_host]  # every rank makes every group
    groups = [(dist.group.WORLD, hosts)] + ([(mine, None)] if ranks_per_host > 1 else [])
    out["ep"] = [
        [
            _normal(g, False, False, 1, h),
            _normal(g, True, True, 2, h),
            _low_latency(g, True, 3),
            _low_latency(g, False, 4),
        ]
        for g, h in groups
    ]
    out["flat"] = [_normal(dist.group.WORLD, e, e, 5, hosts, "torch") for e in (False, True)]  # auto's peer
    out["host_auto"] = _auto_transport(mine) if ranks_per_host > 1 else None
    out["dev_shm"] = os.listdir("/dev/shm")
    out["shm_dev"] = os.stat("/dev/shm").st_dev
    return out


def _links() -> set[str]:
    got = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True, timeout=10).stdout
    return {line.split(":")[1].strip() for line in got.splitlines()}


def _processes_in(netns: list[int]) -> list[int]:
    """Pids of live processes whose network namespace is one of ``netns``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino in netns:
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_one_host_probe_says_one_host():
    res = run_ranks(_probe, 2, timeout=60)
    for r in res:
        assert r["groups"] == r["confirmed"] == r["forced"] == [[0, 1]]
        assert r["choose"] == r["auto"] == "shm" and r["one_host"] is True


@requires_namespaces
@pytest.mark.parametrize("ranks_per_host", [1, 2])
def test_two_hosts_with_one_name(ranks_per_host):
    before = _links()
    info = {}
    res = run_hosts(_exchanges, 2, ranks_per_host, ranks_per_host, hostnames=["node", "node"], timeout=120, info=info)
    hosts = [list(range(h, h + ranks_per_host)) for h in (0, ranks_per_host)]
    for r in res:
        assert r["nodenames"] == ["node"]  # negative control: the host name alone says "one host"
        assert r["groups"] == r["confirmed"] == hosts  # the probe says two
        assert r["forced"] == [hosts[0], *([q] for q in hosts[1])]  # host 1's ranks cannot attach host 0's segment
        assert r["choose"] == r["auto"] == "torch" and r["one_host"] is False
        assert r["ep"][0] == [HIERARCHY] * 4  # across hosts: the hierarchy, bit for bit (checked on the ranks)
        assert r["flat"] == ["torch"] * 2  # and the flat transport, in the same two-level order
        if ranks_per_host > 1:
            assert r["ep"][1] == ["shm"] * 4 and r["host_auto"] == "shm"  # within a host: shm
        assert r["dev_shm"] == []
    assert res[0]["shm_dev"] != res[-1]["shm_dev"]  # each host its own /dev/shm
    assert _processes_in(info["netns"]) == []  # every namespace (with its links and /dev/shm) is gone
    assert _links() == before  # nothing was added to this machine's network


def _killed(rank, world_size):
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, num_max_tokens_per_rank=8, num_topk=TOPK, timeout=4)
    x, idx, w = _routing(rank, 8, 5)
    buf.dispatch(x, idx, w)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        buf.dispatch(x, idx, w)
    except TimeoutError as exc:
        return str(exc)
    return "no error"


def _raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 on its own host gives up")
    return rank


@requires_namespaces
def test_killed_and_failing_ranks_leave_nothing_behind():
    before = _links()
    info = {}
    res = run_hosts(_killed, 2, 1, may_die=(1,), timeout=60, info=info)
    assert res[1] is None and "rank 1" in res[0], res
    assert _processes_in(info["netns"]) == [] and _links() == before
    with pytest.raises(RankError, match="rank 1 on its own host gives up"):
        run_hosts(_raises, 2, 1, timeout=60, info=info)
    assert _processes_in(info["netns"]) == [] and _links() == before


FAULT_TIMEOUT = 3.0  # the buffer's timeout in the fault tests (s)


def _other_host_silent(buf, rank, x, idx, w, fault):
    """Dispatch on ``buf`` while ``fault`` strikes the other host: (the TimeoutError's text, seconds it took)."""
    t0 = time.monotonic()
    try:
        buf.dispatch(x, idx, w)
    except TimeoutError as exc:
        return str(exc), time.monotonic() - t0
    return f"rank {rank}: no error ({fault})", time.monotonic() - t0


def _host_fault(rank, world_size, fault, flag):
    """2 hosts x 2 ranks: one dispatch + combine on the job, then host 1 goes silent mid-dispatch (``fault``:
    ``kill``: its ranks SIGKILLed; ``link``: its eth0 taken down by the test once the file ``flag`` exists); the
    ranks that are left report their TimeoutError, and host 0's build a new EPBuffer on a new group of their own
    and run one dispatch + combine against ep_reference. Returns what each rank saw."""
    buf = EPBuffer(dist.group.WORLD, HIDDEN, EXPERTS, num_max_tokens_per_rank=16, num_topk=TOPK,
                   timeout=FAULT_TIMEOUT)  # fmt: skip
    x, idx, w = _routing(rank, 16, 7)
    recv, _, _, _, handle = buf.dispatch(x, idx, w)
    buf.combine(recv, handle)
    out = {"transport": buf.transport}
    dist.barrier()  # every rank is past the first exchange; the job's gloo group is not used again
    if rank >= 2:  # host 1
        if fault == "kill":
            time.sleep(0.2)  # host 0's ranks are in their dispatch by now, waiting for this host's messages
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 2:
            open(flag, "w").close()  # host 0's ranks are in their dispatch by the time the link goes down
        deadline = time.monotonic() + 10
        while not _link_is_down() and time.monotonic() < deadline:
            time.sleep(0.01)
    out["error"], out["seconds"] = _other_host_silent(buf, rank, x, idx, w, fault)
    t0 = time.monotonic()
    buf.close()  # on host 1 the job's store is out of reach (the link): the close must not wait for it
    out["close_seconds"] = time.monotonic() - t0
    if rank < 2:  # host 0 holds the job's store: its ranks meet again there, in a group of their own
        group = dist.new_group([0, 1], use_local_synchronization=True)
        out["rebuilt"] = _normal(group, False, False, 8)
    out["dev_shm"] = os.listdir("/dev/shm")
    return out


def _link_is_down() -> bool:
    """This host's eth0 is down (``ip`` in this process's namespace: ``/sys`` shows the machine's)."""
    got = subprocess.run(["ip", "-o", "link", "show", "dev", "eth0"], capture_output=True, text=True, timeout=10)
    return "state DOWN" in got.stdout


@requires_namespaces
@pytest.mark.parametrize("fault", ["kill", "link"])
def test_a_host_that_goes_silent_is_named_and_the_other_host_goes_on(fault, tmp_path):
    """Host 1 goes silent mid-dispatch (its ranks SIGKILLed, or its link taken down from outside it): every rank
    still alive raises TimeoutError naming ranks of the other host only, within the buffer's timeout (+ 2 s),
    and closes its buffer in less than that timeout (host 1's: cut off from the job's store); host 0's ranks
    then make a new group and EPBuffer of their own and match ep_reference; no host's /dev/shm keeps anything."""
    info, flag, done = {}, str(tmp_path / "host 1 is ready"), threading.Event()

    def pull_the_cable():  # from outside the host, as a switch port going down
        while not os.path.exists(flag) and not done.wait(0.01):
            pass
        if not done.is_set():
            set_link(False, info["host_pids"][1])

    cable = threading.Thread(target=pull_the_cable, daemon=True)
    cable.start()
    try:
        res = run_hosts(_host_fault, 2, 2, fault, flag, may_die=(2, 3) if fault == "kill" else (), timeout=120,
                        info=info)  # fmt: skip
    finally:
        done.set()
        cable.join(10)
    alive = (0, 1) if fault == "kill" else (0, 1, 2, 3)
    assert fault == "link" or res[2] is res[3] is None
    assert len({res[r]["transport"] for r in alive}) == 1, res
    for r in alive:
        other = {2, 3} if r < 2 else {0, 1}
        named = {int(n) for n in re.findall(r"\brank (\d+)", res[r]["error"])} - {r}
        assert named and named <= other, (r, res[r]["error"])
        assert res[r]["seconds"] < FAULT_TIMEOUT + 2.0, (r, res[r]["seconds"])
        assert res[r]["close_seconds"] < FAULT_TIMEOUT, (r, res[r]["close_seconds"])  # no wait on the store
        assert res[r]["dev_shm"] == [], res[r]
    assert [res[r]["rebuilt"] for r in (0, 1)] == ["shm", "shm"]  # one host: shm, bit for bit (on the ranks)
    assert info["dev_shm"] == {0: [], 1: []}  # after every rank of each host ended, killed ones included


def _epkit_run(rank, world_size, path):
    """One rank of ``epkit run`` as torchrun starts it (its environment; torch.distributed already joined here):
    the exit status, and rank 0's JSON report."""
    from epkit.model.run import main

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=SUBNET + "1", LOCAL_RANK=str(rank % 2))
    status = main(["--steps", "1", "--requests", "1", "--json", path])
    if rank != 0:
        return status, None
    with open(path) as f:
        return status, json.load(f)


@requires_namespaces
def test_epkit_run_on_two_hosts_equals_its_oracle(tmp_path):
    """The reference model (DP 4 = EP 4, transport auto) on 2 hosts x 2 ranks: every rank's greedy tokens are
    the float64 oracle's, and one decode step's collectives are the claim's."""
    res = run_hosts(_epkit_run, 2, 2, str(tmp_path / "run.json"), timeout=120)
    assert [status for status, _ in res] == [0] * 4, res
    rep = res[0][1]
    assert rep["ranks"] == rep["dp"] == 4 and rep["transport"] != "shm", rep
    assert rep["verdict"]["ok"] and rep["verdict"]["tokens"] == 4 * 2, rep["verdict"]
    assert rep["ledger_ok"], rep["ledger"]


@requires_namespaces
def test_set_link_refuses_a_namespace_that_is_not_an_emulated_hosts():
    with pytest.raises(RuntimeError, match="not an emulated host's"):
        set_link(True)  # this process: the machine's namespace (or at least not one with an eth0 in SUBNET)
    with pytest.raises(RuntimeError, match="not an emulated host's"):
        set_link(True, os.getpid())
