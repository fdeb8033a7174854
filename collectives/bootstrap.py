"""How the ranks of a group meet to make a new buffer: through the job's key-value store, with a deadline.

Making a buffer with collectives on the user's group has two faults: a rank that never comes makes the
others wait for the *group's* timeout and the error names nobody, and a collective left pending by a
rank that was stopped (SIGSTOP) and resumed can pair with the next buffer's collectives. A
:class:`Rendezvous` avoids both. The ranks publish what they bring under keys of the job's store
(``dist.distributed_c10d._get_default_store()``: the TCPStore every rank of the job already reaches),
each rank waits for the others' keys with the buffer's own deadline, and a missing key names its rank. A rank
that gives up says so under the prefix (with its reason), and the ranks still waiting stop at once with
that reason, instead of each timing out in a later step that the quitter will never come to.
Keys live under a prefix made of the group's global ranks (and, for a :class:`SubGroup`, its name) and this
process's count of buffers made over that group, so the n-th buffer of a group can only ever meet the n-th
buffer of the same group, and a resumed rank's old bootstrap never meets a new one.

A :class:`SubGroup` is a subset of a parent group's ranks that a buffer can be made over without
``dist.new_group`` (which every rank of the world must call, once per rank set): a buffer needs of its group
only the rank, the size, the global ranks and the backend (:func:`group_info`), and its meeting place here.

Every rank draws a random 62-bit number; rank 0's is the buffer's identity (``buffer_id``), written into
the messages of the protocol so that a handle or a message of another buffer is recognised as such.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from epkit.collectives.deadline import deadline_after

__all__ = ["Rendezvous", "SubGroup", "bounded_call", "group_info", "host_identity", "memory_available", "root_of"]

# Buffers made so far in this process, per group (by its SubGroup name and global ranks).
_COUNTS: dict[tuple[str, tuple[int, ...]], int] = {}


def bounded_call(fn, seconds: float) -> tuple[bool, object]:
    """``fn()`` (a call of the job store) in a daemon thread, waited for at most ``seconds``: ``(finished, its
    result)`` (None when it raised or did not finish). A job store out of reach (a host cut off from it) can hold a
    call past any timeout set on the store; the caller goes on, and the thread is left to it."""
    box: list = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception:  # noqa: BLE001 -- a store call that failed is one that told nothing
            box.append(None)

    t = threading.Thread(target=run, daemon=True, name="epkit-store")
    t.start()
    t.join(seconds)
    return bool(box), (box[0] if box else None)


class SubGroup:
    """The ranks ``ranks`` (ascending ranks of ``parent``) as a group of their own, for :class:`Rendezvous` and
    :class:`~epkit.collectives.symm_buffer.SymmBuffer` (gloo: the ``shm`` and ``torch`` transports; ``nvshmem``,
    whose allocation and free are collective over the whole job: every rank of the root group then makes, and
    closes, a buffer of the same size over its own SubGroup at the same time, as the hierarchy's ``intra`` and
    ``rail``; a buffer's timed barrier before the free meets its SubGroup only, so a rank of another SubGroup that
    never closes would hold the free up: an EPBuffer closes its flat buffer, over every rank, first). Made by the
    member ranks only, with no collective. ``name`` keeps buffers over the same ranks made for different
    purposes apart (their keys carry it): every member must make its buffers over one ``(name, ranks)`` in the
    same order, as over a process group.

    Attributes
    ----------
    parent : ProcessGroup or SubGroup
    ranks : tuple of int
        The members, as ranks of ``parent``.
    global_ranks : tuple of int
        The members' ranks in the job (``dist.get_process_group_ranks``'s order).
    rank, world_size : int
        This process's position among the members, and their number.
    backend : str
        The parent's backend.
    name : str
    """

    def __init__(self, parent, ranks, name: str = "sub"):
        p_rank, p_world, p_global, backend = group_info(parent)
        ranks = [int(r) for r in ranks]
        if not ranks or sorted(set(ranks)) != ranks or ranks[0] < 0 or ranks[-1] >= p_world:
            raise ValueError(f"SubGroup ranks must be distinct ascending parent ranks (< {p_world}), got {ranks}")
        if p_rank not in ranks:
            raise ValueError(f"this process (rank {p_rank} of the parent) is not one of the SubGroup's ranks {ranks}")
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"SubGroup name must be a non-empty string without '/', got {name!r}")
        self.parent, self.ranks, self.name, self.backend = parent, tuple(ranks), name, backend
        self.global_ranks = tuple(p_global[r] for r in ranks)
        self.rank, self.world_size = ranks.index(p_rank), len(ranks)

    def __repr__(self) -> str:
        return f"SubGroup({self.name!r}, global ranks {list(self.global_ranks)}, rank {self.rank})"


def root_of(group) -> tuple[object, list[int]]:
    """``(the ProcessGroup a group is cut from, the group's members as ranks of it)``: the group itself and all
    its ranks for a ProcessGroup (None: the world), the root of the parents and the members' ranks there for a
    :class:`SubGroup`."""
    if not isinstance(group, SubGroup):
        return group, list(range(group_info(group)[1]))
    parent, ranks = root_of(group.parent)
    return parent, [ranks[r] for r in group.ranks]


def group_info(group) -> tuple[int, int, tuple[int, ...], str]:
    """``(rank, world_size, global ranks, backend name)`` of a ProcessGroup (None: the world) or a SubGroup."""
    if isinstance(group, SubGroup):
        return group.rank, group.world_size, group.global_ranks, group.backend
    pg = dist.group.WORLD if group is None else group
    ranks = tuple(dist.get_process_group_ranks(pg))
    return dist.get_rank(pg), dist.get_world_size(pg), ranks, str(dist.get_backend(pg))


def host_identity() -> str:
    """What makes two processes share memory the way the ``shm`` transport shares it, as one string: the kernel
    (its boot id; the host name where the boot id cannot be read), the network namespace (the abstract Unix
    socket the segments pass through lives in one), the pid namespace (each end checks the other's pid) and the
    ``/dev/shm`` file system (its device number: a private tmpfs is another host). Not the host name: processes
    given one name in separate namespaces share nothing. Equal strings are a candidate host;
    :func:`epkit.collectives.transports.host_groups` confirms it by attaching a segment."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "name:" + os.uname().nodename
    parts = [boot]
    for what, path in (("net", "/proc/self/ns/net"), ("pid", "/proc/self/ns/pid"), ("shm", "/dev/shm")):
        try:
            st = os.stat(path)
            parts.append(f"{what}:{st.st_dev if what == 'shm' else st.st_ino}")
        except OSError:
            parts.append(f"{what}:?")
    return "/".join(parts)


def memory_available() -> int | None:
    """Bytes of memory this process can still be given: ``MemAvailable`` of /proc/meminfo, or less where a
    cgroup (v2) limit leaves less (containers). None when neither is readable."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f_max, open("/sys/fs/cgroup/memory.current") as f_cur:
            limit = f_max.read().strip()
            if limit != "max":
                found.append(max(int(limit) - int(f_cur.read().strip()), 0))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _job_store():
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        raise RuntimeError("this torch has no torch.distributed.distributed_c10d._get_default_store()")
    return get()


class Rendezvous:
    """The meeting of one buffer's ranks (collective: every rank of ``group`` makes one, in the same order).

    Parameters
    ----------
    group : ProcessGroup or SubGroup
    timeout : float
        Seconds any step may wait for the other ranks.
    what : str
        What is being made (in error messages), e.g. ``"SymmBuffer(shm)"``.

    Attributes
    ----------
    group : ProcessGroup or SubGroup
    prefix : str
        This meeting's key prefix in the job's store (unique to the buffer).
    rank, world_size : int
        Position in ``group``.
    global_ranks : tuple of int
        The members' global ranks, by position: every message names ranks by these (:meth:`names`).
    buffer_id : int
        Set by :meth:`gather` at the first step: rank 0's random draw, the same on every rank.
    """

    def __init__(self, group, timeout: float, what: str):
        self.group = group
        self.rank, self.world_size, ranks, _ = group_info(group)
        name = group.name + ":" if isinstance(group, SubGroup) else ""
        n = _COUNTS[name, ranks] = _COUNTS.get((name, ranks), 0) + 1
        self.prefix = f"epkit/{name}{'-'.join(map(str, ranks))}/{n}/"
        self.timeout, self.what = timeout, what
        self.global_ranks = tuple(ranks)
        self.buffer_id: int | None = None
        self._store = dist.PrefixStore(self.prefix, _job_store())
        self._mine: list[str] = []

    def gather(self, step: str, value, deadline: float | None = None) -> list:
        """Publish ``value`` (JSON-serialisable) under ``step`` and return every rank's, in rank order.

        Raises TimeoutError naming the ranks whose value did not arrive within the timeout (by ``deadline``, a
        ``time.monotonic()`` instant, where the step shares one with others).
        """
        key = f"{step}/{self.rank}"
        payload = {"v": value}
        if self.buffer_id is None:
            payload["id"] = secrets.randbits(62)
        self._store.set(key, json.dumps(payload))
        self._mine.append(key)
        keys = [f"{step}/{r}" for r in range(self.world_size)]
        deadline = deadline_after(self.timeout) if deadline is None else deadline
        pause = 1e-3
        while not self._store.check(keys):
            quit_msg = self.abandoned()
            if quit_msg is not None:  # another rank gave up on this buffer: waiting on can only end in a timeout
                me = self.names([self.rank])
                raise TimeoutError(f"{me}: another rank gave up making this {self.what} ({quit_msg})")
            if time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
                msg = (
                    f"{self.names([self.rank])}: {self.names(missing)} did not come to make this {self.what} within "
                    f"{self.timeout:g} s ({step}); it died, or stopped calling"
                )
                self._give_up(msg)
                raise TimeoutError(msg)
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(2 * pause, 0.02)
        got = [json.loads(v) for v in self._store.multi_get(keys)]
        if self.buffer_id is None:
            self.buffer_id = got[0]["id"]
        return [g["v"] for g in got]

    def names(self, positions: list[int]) -> str:
        """``"rank 3"`` / ``"ranks 3, 5"``: members named by their global ranks (a sub-group's positions are not
        what a job's logs call its ranks)."""
        return f"rank{'s' * (len(positions) > 1)} {', '.join(str(self.global_ranks[r]) for r in positions)}"

    def missing(self, step: str, deadline: float) -> list[int]:
        """Publish this rank's presence under ``step``; the ranks whose presence has not arrived by ``deadline``
        (without raising: for naming the ranks a failed step lost)."""
        keys = [f"{step}/{r}" for r in range(self.world_size)]

        def look() -> list[int]:
            self._store.set(keys[self.rank], "1")
            self._mine.append(keys[self.rank])
            while not self._store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.005)
            return [r for r, k in enumerate(keys) if not self._store.check([k])]

        # off this thread: a store out of reach (a host cut off) must not hold the caller past the deadline
        finished, missing = bounded_call(look, max(deadline - time.monotonic(), 0.0) + 0.5)
        return missing if finished and isinstance(missing, list) else []  # out of reach: nothing known, nobody named

    @contextlib.contextmanager
    def store_deadline(self, deadline: float):
        """Inside the block the job store's own waits (what a torch process group made on :attr:`store` does
        through it) end by ``deadline``, not after the store's timeout (minutes under torchrun); restored after.
        The timeout is the process's store client's: another thread using the job store meanwhile gets it too."""
        store = _job_store()
        before = store.timeout
        store.set_timeout(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        try:
            yield
        finally:
            store.set_timeout(before)

    def _give_up(self, msg: str) -> None:
        """Tell the other ranks that this one stopped making the buffer, and why (best effort)."""
        try:
            self._store.set(f"gave_up/{self.rank}", msg)
            self._store.add("gave_up", 1)
        except Exception:  # noqa: BLE001 -- a store that is gone: the others time out on their own
            pass

    def abandoned(self) -> str | None:
        """The reason of a rank that gave up making this buffer (its error message), or None."""
        try:
            if self._store.add("gave_up", 0) == 0:
                return None
            for r in range(self.world_size):
                if self._store.check([f"gave_up/{r}"]):
                    return self._store.get(f"gave_up/{r}").decode()
        except Exception:  # noqa: BLE001 -- no store, nothing known
            return None
        return None

    @property
    def store(self):
        """The job's store under this buffer's prefix (for what a transport builds on it)."""
        return self._store

    def forget(self, wait: bool = True) -> None:
        """Delete this rank's keys (best effort; call once every rank has read them).

        ``wait=False`` (a buffer broken by a failure) deletes them from a daemon thread and returns at once:
        a store out of reach (this host cut off from the job's) would hold each delete for the store's own
        timeout, minutes, where the buffer's close must not wait."""
        keys, self._mine = self._mine, []
        if wait:
            _delete_keys(self._store, keys)
        elif keys:
            threading.Thread(target=_delete_keys, args=(self._store, keys), daemon=True).start()


def _delete_keys(store, keys: list[str]) -> None:
    for k in keys:
        try:
            store.delete_key(k)
        except Exception:  # noqa: BLE001 -- a store that is gone has nothing left to delete
            break
