"""Ranks on emulated hosts: each host its own network, UTS and mount namespaces on one machine (root only).

``run_hosts(fn, hosts, ranks_per_host, *args)`` runs ``fn(rank, world_size, *args)`` on
``hosts * ranks_per_host`` processes, ranks ``h * ranks_per_host ...`` on host ``h``, as
:func:`epkit.cpu_ranks.run_ranks` does on one host: torch.distributed (gloo) is initialised
first, return values come back by rank, a rank's exception is a :class:`RankError` with its traceback,
and one deadline bounds the whole run. Each host is a process that made its own namespaces:

* network: one interface, ``eth0``, with address ``10.77.0.<h+1>/24``, a veth pair whose other end is a
  port of a bridge in a namespace of its own (the switch), so nothing is added to the machine's network
  and its firewall never sees the traffic; the job's TCP store listens on host 0 (``10.77.0.1``) and gloo
  connects over ``eth0``;
* UTS: its own host name (``hostnames``; the same name on every host is allowed, and is a good test);
* mount: a private ``/dev/shm`` (a tmpfs of its own), so shared memory is not shared across hosts.

The ranks are the host processes' children (born in those namespaces) and die with them; every
namespace, and with it every veth, the bridge and each private ``/dev/shm``, is gone when its last process
is, and the harness kills every process it started before it returns, whatever happened. Needs root,
``unshare``, ``nsenter`` and ``ip``: :func:`namespaces_unavailable` says what is missing
(``epkit.testing.hosts.requires_namespaces`` skips a test with that reason).

For fault tests, :func:`set_link` takes a host's ``eth0`` down (or up) from one of its ranks or from the
caller, and ``info["dev_shm"]`` says what each host's ``/dev/shm`` held once all its ranks had ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing.connection as mp_connection
import os
import pickle
import shutil
import signal
import socket
import subprocess
import time
import traceback
import warnings
from datetime import timedelta

from epkit.cpu_ranks import DEFAULT_TIMEOUT, CallersStdio, RankError, start_context, stop_fork_server

__all__ = ["SUBNET", "namespaces_unavailable", "run_hosts", "set_link"]

#: The emulated hosts' addresses: host h is ``SUBNET + str(h + 1)`` (inside the switch's namespace only).
SUBNET = "10.77.0."
_PORT = 29500  # the store's port on host 0: its network namespace is new, so the port is free
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 0x4000, 1 << 18


@functools.lru_cache(maxsize=1)
def namespaces_unavailable() -> str | None:
    """Why emulated hosts cannot run here (not root, a tool missing, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network, UTS and mount namespaces, veth pairs)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"emulated hosts need {tool!r} on PATH"
    trial = "ip link add ekA type veth peer name ekB && mount -t tmpfs tmpfs /dev/shm && hostname ek"
    try:
        cmd = ["unshare", "-n", "-u", "-m", "--", "sh", "-c", trial]
        subprocess.run(cmd, check=True, capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        return f"namespaces or CAP_NET_ADMIN unavailable here ({exc}; {err.decode(errors='replace').strip()})"
    return None


def set_link(up: bool, host_pid: int | None = None, timeout: float = 10.0) -> None:
    """Take an emulated host's ``eth0`` down (``up=False``: its peers hear nothing more from it, and it from them,
    as when a host's cable is pulled) or bring it back up.

    From one of the host's ranks ``host_pid`` is None (the rank's own network namespace); from the process that
    called :func:`run_hosts` (in a thread, while the run goes on) it is the host's pid (``info["host_pids"][h]``),
    whose namespace ``nsenter`` enters. Refuses (RuntimeError) a namespace that is not an emulated host's: the
    machine's own, or one whose ``eth0`` has no address in :data:`SUBNET`.
    """
    enter = [] if host_pid is None else ["nsenter", "-t", str(int(host_pid)), "-n"]
    ns = f"/proc/{'self' if host_pid is None else int(host_pid)}/ns/net"
    with contextlib.suppress(OSError):  # pid 1's namespace (the machine's) is unreadable only where it is not ours
        if os.stat(ns).st_ino == os.stat("/proc/1/ns/net").st_ino:
            raise RuntimeError(f"set_link: {ns} is the machine's own network namespace, not an emulated host's")
    addr = subprocess.run([*enter, "ip", "-o", "-4", "addr", "show", "dev", "eth0"], capture_output=True, text=True,
                          timeout=timeout).stdout  # fmt: skip
    if f"inet {SUBNET}" not in addr:
        raise RuntimeError(f"set_link: {ns} has no eth0 in {SUBNET}0/24: not an emulated host's namespace")
    cmd = [*enter, "ip", "link", "set", "eth0", "up" if up else "down"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=timeout)


def _libc_call(name: str, *args) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: this process gets SIGKILL when its parent ends: the fork server that forked it, which
    ends when the process that started the server does (or that process, where ranks are spawned)."""
    _libc_call("prctl", 1, signal.SIGKILL, 0, 0, 0)


def _become_host(hostname: str) -> None:
    """Move this process into new network, UTS and mount namespaces with a private /dev/shm."""
    _libc_call("unshare", _CLONE_NEWNET | _CLONE_NEWUTS | _CLONE_NEWNS)
    _libc_call("mount", b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)  # nothing leaks back to the machine
    _libc_call("mount", b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=1777")
    socket.sethostname(hostname)


def _rank_main(payload: bytes, rank: int, world_size: int, timeout: float, out) -> None:
    """One rank, inside its host's namespaces: join the job's store on host 0, run the function, report."""
    import torch
    import torch.distributed as dist

    _die_with_parent()
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    torch.set_num_threads(1)
    try:
        wait = timedelta(seconds=timeout)
        store = dist.TCPStore(SUBNET + "1", _PORT, None, False, timeout=wait, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=wait)
        fn, args, kwargs = pickle.loads(payload)
        report = ("ok", rank, fn(rank, world_size, *args, **kwargs))
    except BaseException as exc:  # everything, SystemExit included, goes back to the caller
        report = ("err", rank, (type(exc).__name__, traceback.format_exc()))
    try:
        out.send_bytes(pickle.dumps(report))
    except Exception as exc:  # a result that cannot be pickled is reported as an error of its rank
        out.send_bytes(pickle.dumps(("err", rank, (type(exc).__name__, traceback.format_exc()))))
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _host_main(index: int, hostname: str, ctrl, ranks, world_size: int, payload: bytes, timeout: float, env, stdio):
    """One emulated host: make its namespaces, take its address, start its ranks and pass their reports on.

    Forked from a fork server (see :func:`~epkit.cpu_ranks.start_context`): it takes the caller's
    environment and stdio first; its ranks come from a fork server of its own, started inside its namespaces."""
    stdio.take()
    os.environ.clear()
    os.environ.update(env)
    try:
        _die_with_parent()
        _become_host(hostname)
        ctrl.send(("ready", os.getpid(), os.stat("/proc/self/ns/net").st_ino))
        if not ctrl.poll(timeout):
            return
        addr = ctrl.recv()
        cmds = f"link set lo up\naddr add {addr}/24 dev eth0\nlink set eth0 up\n"
        subprocess.run(["ip", "-batch", "-"], input=cmds.encode(), check=True, capture_output=True, timeout=timeout)
        store = None
        if index == 0:  # the job's store lives as long as this host, whichever of its ranks ends first
            from torch.distributed import TCPStore

            store = TCPStore(addr, _PORT, None, True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
        _forward(ctrl, ranks, world_size, payload, timeout)
        stop_fork_server()  # the ranks' server: out of the namespaces before this host reports its /dev/shm
        ctrl.send(("dev_shm", sorted(os.listdir("/dev/shm"))))  # every rank of this host has ended by now
        ctrl.poll(timeout)  # the caller says when every host is done (host 0 keeps the store until then)
        del store
    except BaseException as exc:
        with contextlib.suppress(OSError):
            ctrl.send(("err", -1, (type(exc).__name__, f"host {index} ({hostname}):\n" + traceback.format_exc())))


def _forward(ctrl, ranks: list[int], world_size: int, payload: bytes, timeout: float) -> None:
    """Start this host's ranks and send each one's report (or its death) to the caller, until all are in."""
    ctx = start_context()
    procs, pipes = {}, {}
    try:
        for r in ranks:
            rd, wr = ctx.Pipe(duplex=False)
            procs[r] = ctx.Process(target=_rank_main, args=(payload, r, world_size, timeout, wr), daemon=True)
            procs[r].start()
            wr.close()
            pipes[rd] = r
        ctrl.send(("pids", [p.pid for p in procs.values()]))
        deadline = time.monotonic() + timeout
        while pipes and time.monotonic() < deadline:
            for conn in mp_connection.wait([*pipes, ctrl], timeout=max(deadline - time.monotonic(), 0.0)):
                if conn is ctrl:
                    return  # the caller gave up (or went away): the ranks are killed below
                r = pipes.pop(conn)
                try:
                    report = ("rank", conn.recv_bytes())
                except (EOFError, OSError):
                    procs[r].join(1.0)
                    report = ("died", r, procs[r].exitcode)
                ctrl.send(report)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(2.0)


def _wait_ready(ctrls: list, deadline: float) -> list[tuple[int, int]]:
    """(pid, network namespace inode) of each host once it has made its namespaces."""
    got = {}
    while len(got) < len(ctrls):
        left = deadline - time.monotonic()
        waiting = [c for c in ctrls if id(c) not in got]
        ready = mp_connection.wait(waiting, timeout=max(left, 0.0))
        if not ready:
            raise TimeoutError(f"emulated hosts {[ctrls.index(c) for c in waiting]} did not start in time")
        for c in ready:
            try:
                msg = c.recv()
            except (EOFError, OSError):
                raise RuntimeError(f"emulated host {ctrls.index(c)} ended before making its namespaces") from None
            if msg[0] == "err":
                raise RankError(msg[1], msg[2][0], msg[2][1])
            got[id(c)] = (msg[1], msg[2])
    return [got[id(c)] for c in ctrls]


def _start_switch(deadline: float) -> subprocess.Popen:
    """A process in a network namespace of its own (the bridge's); it ends when its stdin closes."""
    mine = os.stat("/proc/self/ns/net").st_ino
    sw = subprocess.Popen(["unshare", "--net", "--", "cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    while True:  # until unshare has run (before that, nsenter would enter this namespace)
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{sw.pid}/ns/net").st_ino != mine and sw.poll() is None:
                return sw
        if sw.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the switch namespace could not be made (unshare exited with {sw.poll()})")
        time.sleep(0.005)


def _wire(switch_pid: int, host_pids: list[int], timeout: float) -> None:
    """The bridge in the switch's namespace and one veth pair per host (``eth0`` on the host's side)."""
    cmds = ["link add br0 type bridge forward_delay 0", "link set br0 up"]
    for h, pid in enumerate(host_pids):
        cmds += [f"link add h{h} type veth peer name eth0 netns {pid}", f"link set h{h} master br0 up"]
    cmd = ["nsenter", "-t", str(switch_pid), "-n", "ip", "-batch", "-"]
    subprocess.run(cmd, input="\n".join(cmds).encode() + b"\n", check=True, capture_output=True, timeout=timeout)


def _collect(ctrls: list, world_size: int, deadline: float, may_die: tuple[int, ...], info: dict) -> list:
    """Every rank's result, by rank, from the hosts' reports; RankError / TimeoutError as run_ranks raises them."""
    out: dict[int, object] = {}
    per_host = world_size // len(ctrls)
    live = list(ctrls)
    while len(out) < world_size:
        left = deadline - time.monotonic()
        if left <= 0 or not live:
            pending = sorted(set(range(world_size)) - set(out))
            raise TimeoutError(f"ranks {pending} of {world_size} on emulated hosts did not finish in time; killed all")
        for conn in mp_connection.wait(live, timeout=min(left, 0.5)):
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # a host process died: its ranks died with it
                live.remove(conn)
                h = ctrls.index(conn)
                for r in set(range(h * per_host, (h + 1) * per_host)) - set(out):
                    if r not in may_die:
                        raise RankError(r, "ProcessDied", f"its emulated host {h} ended before it reported") from None
                    out[r] = None
                continue
            if msg[0] in ("pids", "dev_shm"):
                _note(info, ctrls.index(conn), msg)
                continue
            if msg[0] == "died":
                if msg[1] not in may_die:
                    raise RankError(msg[1], "ProcessDied", f"process exited with code {msg[2]} without reporting")
                out[msg[1]] = None
                continue
            kind, rank, payload = pickle.loads(msg[1]) if msg[0] == "rank" else msg
            if kind == "err":
                raise RankError(rank, payload[0], payload[1])
            out[rank] = payload
    return [out[r] for r in range(world_size)]


def _note(info: dict, host: int, msg: tuple) -> None:
    """A host's message about itself: its ranks' pids, or its /dev/shm once its ranks have ended."""
    if msg[0] == "pids":
        info["rank_pids"] += msg[1]
    else:
        info["dev_shm"][host] = msg[1]


def _await_dev_shm(ctrls: list, info: dict, deadline: float) -> None:
    """Each host's /dev/shm listing, sent once all its ranks have ended (bounded by ``deadline``; a host that
    died first has none)."""
    waiting = [c for h, c in enumerate(ctrls) if h not in info["dev_shm"]]
    while waiting and time.monotonic() < deadline:
        for conn in mp_connection.wait(waiting, timeout=max(deadline - time.monotonic(), 0.0)):
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                waiting.remove(conn)
                continue
            if msg[0] in ("pids", "dev_shm"):
                _note(info, ctrls.index(conn), msg)
            if msg[0] == "dev_shm":
                waiting.remove(conn)


def _in_netns(pid: int, netns: list[int]) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino in netns
    except OSError:  # gone (or a zombie: it holds no namespace any more)
        return False


def _in_run(netns: list[int]) -> list[int]:
    """Pids of the processes in the run's namespaces (the hosts' and the switch's): only the run's own."""
    return [int(pid) for pid in filter(str.isdigit, os.listdir("/proc")) if _in_netns(int(pid), netns)]


def _end(procs: list, info: dict, switch: subprocess.Popen | None) -> None:
    """Kill every process the run started (hosts, their ranks and fork servers, the switch) and wait until none
    is left. A process is only killed while it is in one of the run's namespaces (never one that took a
    recycled pid): the hosts' ranks and fork servers by a scan of /proc for those namespaces."""
    netns = info["netns"]
    for pid in info["rank_pids"]:
        if _in_netns(pid, netns):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
        if p.pid is not None:
            p.join(5.0)
    if switch is not None:
        with contextlib.suppress(OSError):
            switch.stdin.close()
        try:
            switch.wait(5.0)
        except subprocess.TimeoutExpired:
            switch.kill()
            switch.wait(5.0)
    deadline = time.monotonic() + 5.0
    while (left := _in_run(netns)) and time.monotonic() < deadline:
        for pid in left:  # a host's fork server that has not seen its host end yet, or a rank it forked
            if _in_netns(pid, netns):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    if left:  # said, not raised: the run's own result (or error) is what the caller asked for
        warnings.warn(f"run_hosts: processes {left} are still in the run's namespaces 5 s after the kill", stacklevel=3)


def run_hosts(
    fn,
    hosts: int,
    ranks_per_host: int,
    *args,
    timeout: float | None = None,
    hostnames: list[str] | None = None,
    may_die: tuple[int, ...] = (),
    info: dict | None = None,
    **kwargs,
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``hosts`` emulated hosts of ``ranks_per_host`` ranks.

    Parameters
    ----------
    fn : module-level callable (pickled by name)
    hosts, ranks_per_host : int, >= 1
    timeout : float, optional
        Seconds for the whole run, namespaces included (default ``DEFAULT_TIMEOUT``, as ``run_ranks``).
    hostnames : list of str, optional
        Each host's name (default ``host0``, ``host1``, ...); names may repeat.
    may_die : tuple of int
        Ranks allowed to die without reporting; their result is None.
    info : dict, optional
        Filled with what the run made, for checks afterwards: ``host_pids``, ``rank_pids``, ``switch_pid``
        and ``netns`` (the network namespaces' inodes, switch last); ``dev_shm``: host -> the names in its
        private ``/dev/shm`` once every rank of it has ended (killed ones included), for a run that returns.

    Returns the ranks' results by rank. Raises RankError (a rank or a host failed, with its traceback),
    TimeoutError (the deadline passed first; everything is killed), RuntimeError (no namespaces here).
    """
    why = namespaces_unavailable()
    if why is not None:
        raise RuntimeError(why)
    if hosts < 1 or ranks_per_host < 1:
        raise ValueError(f"hosts and ranks_per_host must be >= 1, got {hosts} and {ranks_per_host}")
    names = [f"host{h}" for h in range(hosts)] if hostnames is None else list(hostnames)
    if len(names) != hosts:
        raise ValueError(f"{len(names)} hostnames for {hosts} hosts")
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    deadline, world = time.monotonic() + timeout, hosts * ranks_per_host
    payload, env = pickle.dumps((fn, args, kwargs)), dict(os.environ)
    info = {} if info is None else info
    info.update(host_pids=[], rank_pids=[], switch_pid=None, netns=[], dev_shm={})
    ctx, procs, ctrls, switch = start_context(), [], [], None
    try:
        for h in range(hosts):
            mine, theirs = ctx.Pipe()
            ranks = list(range(h * ranks_per_host, (h + 1) * ranks_per_host))
            job = (h, names[h], theirs, ranks, world, payload, timeout, env, CallersStdio())
            procs.append(ctx.Process(target=_host_main, args=job))
            procs[-1].start()
            theirs.close()
            ctrls.append(mine)
        ready = _wait_ready(ctrls, deadline)
        info["host_pids"], info["netns"] = [p for p, _ in ready], [n for _, n in ready]
        switch = _start_switch(deadline)
        info["switch_pid"] = switch.pid
        info["netns"].append(os.stat(f"/proc/{switch.pid}/ns/net").st_ino)
        _wire(switch.pid, info["host_pids"], max(deadline - time.monotonic(), 1.0))
        for h, c in enumerate(ctrls):
            c.send(f"{SUBNET}{h + 1}")
        results = _collect(ctrls, world, deadline, may_die, info)
        _await_dev_shm(ctrls, info, min(deadline, time.monotonic() + 10.0))
        return results
    finally:
        for c in ctrls:
            with contextlib.suppress(OSError):
                c.send("exit")
            c.close()
        _end(procs, info, switch)
