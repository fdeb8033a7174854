"""The ``shm`` transport: CPU ranks on one host, over shared memory that has no name (``csrc/shm_transport.cpp``).

Each rank creates an anonymous ``memfd`` segment (signal words, then data) and the descriptors are
passed between the ranks over a Unix-domain socket (``SCM_RIGHTS``), through rank 0: rank 0 listens on
an abstract socket (no file; a random name), every other rank connects, sends its descriptor and
receives everyone's. Each side checks the other's process id (``SO_PEERCRED``) against the pids the
ranks published in the rendezvous, so no other process, of the same user or not, is handed a
descriptor, and rank 0 drops any other process's connection before reading from it (an idle stranger
cannot hold the listener until the ranks' deadline); once mapped, the descriptors are closed. Processes of
the same user (and root) can still reach a rank's descriptors through ``/proc/<pid>/fd`` while it holds
them, as they can its memory: the transport keeps out other users, not the ranks' own. Nothing is ever
created in /dev/shm, so a rank killed at any point leaves nothing behind: the memory goes when the last
mapping does.

``peer_view(r)`` is a direct view of rank r's data; puts are plain copies into it; signal words are
atomics in ``epkit._C`` and waits are timed (the GIL released while they spin).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import mmap
import os
import secrets
import socket
import struct
import time

import torch

from epkit.collectives.deadline import deadline_after
from epkit.collectives.transports.base import Transport, layout

__all__ = ["ShmTransport", "confirm_hosts", "host_view", "share_descriptors", "wait_word"]

_MAX_FDS = 200  # descriptors per message (the kernel's SCM_MAX_FD is 253)


def host_view(addr: int, nbytes: int, owner=None) -> torch.Tensor:
    """``[nbytes]`` uint8 tensor over mapped host memory; the tensor (and every view of it) keeps ``owner`` alive."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    arr = (ctypes.c_uint8 * nbytes).from_address(addr)
    arr._epkit_owner = owner  # torch.frombuffer holds the array, the array holds the mapping
    return torch.frombuffer(arr, dtype=torch.uint8)


def wait_word(seg, off: int, cmp: str, value: int, deadline: float, abort_off: int | None = None) -> tuple[int, int]:
    """One timed wait in ``epkit._C`` (GIL released) until word ``off`` of segment ``seg`` satisfies ``cmp value``,
    watching the word at ``abort_off`` (None: none): ``(0, value)`` when it did, ``(1, abort word)`` when the
    abort word turned nonzero first, ``(2, last value)`` at ``deadline`` (``time.monotonic()``)."""
    left = max(0.0, deadline - time.monotonic())
    if abort_off is not None:
        return seg.wait_until_or_abort(off, cmp, value, abort_off, left)
    try:
        return 0, seg.wait_until(off, cmp, value, left)
    except TimeoutError:
        return 2, seg.load(off)


def _peer_cred(sock: socket.socket) -> tuple[int, int]:
    """The connected peer's process and user id (``SO_PEERCRED``: as the kernel saw them at connect time)."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _peer_pid(sock: socket.socket) -> int:
    return _peer_cred(sock)[0]


def _turned_away(strangers: list[str]) -> str:
    if not strangers:
        return ""
    return (f"; {len(strangers)} connection{'s' * (len(strangers) > 1)} from processes that are not ranks of this "
            f"buffer {'were' if len(strangers) > 1 else 'was'} turned away ({', '.join(strangers[:4])})")  # fmt: skip


def _recv(sock: socket.socket, deadline: float, what: str, maxfds: int) -> tuple[bytes, list[int]]:
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    fds = array.array("i")
    msg, anc, _, _ = sock.recvmsg(4096, socket.CMSG_LEN(maxfds * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    if not msg and not fds:
        raise ConnectionError(f"{what}: the peer closed the connection")
    return msg, list(fds)


def _serve(server: socket.socket, my_fd: int, pids: list[int], deadline: float, names) -> list[int]:
    """Rank 0: collect every rank's descriptor (checking who sends it), then send everyone the whole list.
    ``names(positions)`` names ranks in messages (by their global ranks)."""
    w = len(pids)
    fds: list[int] = [my_fd] + [-1] * (w - 1)
    conns: dict[int, socket.socket] = {}
    strangers: list[str] = []
    try:
        while len(conns) < w - 1:
            server.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                missing = [r for r in range(1, w) if r not in conns]
                raise TimeoutError(
                    f"{names(missing)} did not connect to {names([0])}{_turned_away(strangers)}"
                ) from None
            try:
                pid, uid = _peer_cred(conn)
            except OSError:
                pid, uid = -1, -1
            if pid not in pids[1:]:  # not a rank: dropped before reading anything, so it cannot hold the listener
                strangers.append(f"pid {pid}, uid {uid}")
                conn.close()
                continue
            r, got = -1, []
            try:
                msg, got = _recv(conn, deadline, "segment exchange", 1)
                r = int(msg.decode()) if msg.isdigit() else -1
                ok = 0 < r < w and r not in conns and len(got) == 1 and _peer_pid(conn) == pids[r]
            except (OSError, ValueError, ConnectionError):
                ok = False
            if not ok:  # not a rank of this buffer (or a rank claiming another's place): nothing for it
                for fd in got:
                    os.close(fd)
                conn.close()
                continue
            conns[r], fds[r] = conn, got[0]
        for conn in conns.values():
            for i in range(0, w, _MAX_FDS):
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds[i : i + _MAX_FDS]))]
                conn.sendmsg([b"ok"], rights)
        return fds
    except BaseException as exc:
        for conn in conns.values():  # tell the ranks that did come why the buffer cannot be made
            with contextlib.suppress(OSError):
                conn.sendall(f"error: {exc}".encode()[:4000])
        for fd in fds[1:]:
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        for conn in conns.values():
            conn.close()


def _join(address: bytes, my_fd: int, rank: int, pids: list[int], deadline: float, leader: str) -> list[int]:
    """Any rank but 0: send this rank's descriptor to rank 0 and receive every rank's. ``leader`` names rank 0 in
    messages (its global rank)."""
    w = len(pids)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        while True:
            try:
                sock.connect(address)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{leader} is not listening") from None
                time.sleep(0.005)
        if _peer_pid(sock) != pids[0]:
            raise ConnectionError(f"the process listening for the segments is not {leader}")
        sock.sendmsg([str(rank).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [my_fd]))])
        while len(fds) < w:
            msg, got = _recv(sock, deadline, "segment exchange", _MAX_FDS)
            fds += got
            if msg.startswith(b"error"):
                raise TimeoutError(f"{leader} gave up: {msg[7:].decode(errors='replace')}")
        return fds
    except (OSError, ConnectionError) as exc:  # OSError includes a timeout: rank 0 died, or stopped
        for fd in fds:
            os.close(fd)
        if isinstance(exc, TimeoutError) and str(exc).startswith(leader):
            raise
        raise TimeoutError(f"{leader} went away or stopped while sharing the segments ({exc})") from None
    finally:
        sock.close()


def _listen() -> tuple[socket.socket, bytes]:
    """Rank 0: a listening abstract Unix socket with a random name (no file; gone when closed)."""
    name = b"\0epkit-shm-" + secrets.token_hex(16).encode()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(name)
    server.listen(128)
    return server, name


def share_descriptors(rv, pids: list[int], my_fd: int, timeout: float) -> list[int]:
    """Every rank's segment descriptor, in rank order, passed over an abstract Unix socket through rank 0.

    Collective over the rendezvous ``rv``; ``pids`` are the ranks' process ids (checked with SO_PEERCRED on
    both ends). Raises TimeoutError naming the ranks that did not come (on rank 0, and in rank 0's words
    on every rank that did). The caller owns (and closes) every descriptor returned.
    """
    deadline = deadline_after(timeout)
    server, name = _listen() if rv.rank == 0 else (None, b"")
    try:
        names = rv.gather("shm", name.hex())
        if rv.rank == 0:
            return _serve(server, my_fd, pids, deadline, rv.names)
        return _join(bytes.fromhex(names[0]), my_fd, rv.rank, pids, deadline, rv.names([0]))
    except (TimeoutError, ConnectionError, OSError) as exc:
        raise TimeoutError(f"{rv.names([rv.rank])}: the shm segments could not be shared: {exc}") from None
    finally:
        if server is not None:
            server.close()


def _hand_out(server: socket.socket, fd: int, members: list[int], pids: list[int], deadline: float) -> None:
    """A host's leader: give segment ``fd`` to each of ``members`` that connected (checked by SO_PEERCRED; a
    connection from any other process is dropped before anything is read from it)."""
    left = set(members)
    while left:
        server.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            conn, _ = server.accept()
        except OSError:  # a member gone: its attach fails when the server closes
            return
        with conn, contextlib.suppress(OSError, ValueError, ConnectionError):
            pid = _peer_pid(conn)
            member = next((r for r in left if pids[r] == pid), None)
            if member is None:  # not a member still to serve: dropped before anything is read
                continue
            left.discard(member)  # served or not, this member has had its turn
            msg, _ = _recv(conn, deadline, "host probe", 1)
            if msg.isdigit() and int(msg.decode()) == member:
                conn.sendmsg([b"ok"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def _attach(sock: socket.socket, nonce: bytes, leader_pid: int, deadline: float) -> bool:
    """A member: receive the leader's segment, map it and find the leader's random ``nonce`` in it."""
    try:
        if _peer_pid(sock) != leader_pid:
            return False
        _, fds = _recv(sock, deadline, "host probe", 1)
    except (OSError, ConnectionError):
        return False
    try:
        if not fds:
            return False
        with mmap.mmap(fds[0], len(nonce), prot=mmap.PROT_READ) as seen:
            return bytes(seen[: len(nonce)]) == nonce
    except (OSError, ValueError):
        return False
    finally:
        for f in fds:
            os.close(f)


def confirm_hosts(rv, hellos: list[dict], groups: list[list[int]]) -> list[list[int]]:
    """Confirm candidate hosts (lists of ranks, first rank lowest) by sharing memory the way this transport does.

    Collective over the rendezvous ``rv`` (once per rendezvous; ``hellos`` give the ranks' pids). In each group
    of several ranks the first creates an anonymous segment holding a random number and listens on an abstract
    Unix socket; the others connect (an abstract socket of another network namespace is not found: the connect
    fails at once), receive the descriptor, map it and look for the number. A rank that cannot is a host of its
    own. Returns the confirmed groups, ordered by first rank; every rank gets the same.
    """
    if all(len(g) == 1 for g in groups):
        return groups
    deadline = deadline_after(rv.timeout)
    mine = next(g for g in groups if rv.rank in g)
    lead, pids = mine[0], [h["pid"] for h in hellos]
    server, fd, sock, ok = None, -1, None, True
    try:
        offer = None
        if rv.rank == lead and len(mine) > 1:
            server, name = _listen()
            nonce = secrets.token_bytes(16)
            fd = os.memfd_create("epkit-host-probe", os.MFD_CLOEXEC)
            os.write(fd, nonce)
            offer = [name.hex(), nonce.hex()]
        offers = rv.gather("probe/offer", offer)
        if rv.rank != lead:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(bytes.fromhex(offers[lead][0]))
                sock.sendall(str(rv.rank).encode())
            except OSError:
                ok = False
        came = rv.gather("probe/connect", ok)
        if server is not None:
            _hand_out(server, fd, [r for r in mine[1:] if came[r]], pids, deadline)
            server.close()
        if rv.rank != lead and ok:
            ok = _attach(sock, bytes.fromhex(offers[lead][1]), pids[lead], deadline)
        verdict = rv.gather("probe/attach", ok)
    finally:
        for closable in (server, sock):
            if closable is not None:
                closable.close()
        if fd >= 0:
            os.close(fd)
    out = []
    for g in groups:
        out += [[r for r in g if verdict[r]]] + [[r] for r in g if not verdict[r]]
    return sorted(g for g in out if g)


class ShmTransport(Transport):
    """One rank's segments: its own (created) and every peer's (attached). See the module docstring."""

    name = "shm"
    direct = True

    def __init__(self, rv, hello: list[dict], num_bytes: int, num_signals: int):
        super().__init__(rv, hello, num_bytes, num_signals)
        from epkit import _C

        w = self.world_size
        _, self.data_offset, seg_bytes = layout(w, num_signals, num_bytes)
        hosts = {h["host"] for h in hello}
        if len(hosts) != 1:
            raise ValueError(f"the shm transport needs every rank on one host; the ranks are on {sorted(hosts)}")
        self.check_memory(hello, w * seg_bytes, f"{w} segments of {seg_bytes} bytes (one per rank) on this host")
        fd = os.memfd_create(f"epkit-shm-{rv.buffer_id:x}-{self.rank}", os.MFD_CLOEXEC)
        fds: list[int] = []
        try:
            os.ftruncate(fd, seg_bytes)  # zero-filled: the signal words start at 0
            fds = share_descriptors(rv, [h["pid"] for h in hello], fd, rv.timeout)
            #: Every rank's mapped segment (signal words first, data at ``data_offset``).
            self.segments = [
                _C.ShmSegment.from_fd(f, seg_bytes, f"shm segment of rank {r} (buffer {rv.buffer_id:x})")
                for r, f in enumerate(fds)
            ]
        finally:  # the mappings keep the memory; no descriptor (and so no /proc/<pid>/fd entry) outlives them
            for f in {fd, *fds}:
                os.close(f)
        self._views = [host_view(s.addr + self.data_offset, num_bytes, s) for s in self.segments]
        self.local = self._views[self.rank]

    def peer_view(self, rank: int) -> torch.Tensor:
        return self._views[rank]

    def within_domain(self) -> bool:
        return True

    def word_address(self, off: int) -> int:
        return self.segments[self.rank].addr + off

    def store(self, dst: int, off: int, value: int, op: str = "set", guarded: bool = False, urgent: bool = False):
        seg = self.segments[dst]
        if op == "set":
            seg.store(off, value)
        elif op == "add":
            seg.fetch_add(off, value)
        else:
            raise ValueError(f"op must be 'set' or 'add', got {op!r}")

    def load(self, off: int) -> int:
        return self.segments[self.rank].load(off)

    def wait(
        self, off: int, count: int, cmp: str, value: int, timeout: float, abort_words: int = 0
    ) -> tuple[int, int | None]:
        seg = self.segments[self.rank]
        deadline = deadline_after(timeout)
        seen = 0
        for i in range(count):
            o = off + 8 * i
            status, seen = wait_word(seg, o, cmp, value, deadline, o + 8 * abort_words if abort_words else None)
            if status:
                return seen, i
        return seen, None

    def is_open(self) -> bool:
        return bool(self.segments)

    def close(self, collective: bool) -> None:
        # A segment is unmapped when its last reference goes; views hold one, so a view kept past
        # close() never points at an unmapped page.
        self.segments, self._views, self._staging = [], [], {}
        self.local = torch.empty(0, dtype=torch.uint8)
