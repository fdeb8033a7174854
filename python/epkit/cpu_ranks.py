"""Run a function on N real processes joined by torch.distributed (gloo on 127.0.0.1, a file store).

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes; rank r
calls ``fn(rank, world_size, *args)`` after ``init_process_group("gloo")``
and sends back its return value. The processes are forked from a
multiprocessing fork server that has imported torch, its compiler front end
and epkit (once per parent process; see ``_PRELOAD``), not spawned: a
spawned rank spends about 3 s importing them, most of a small test's time. A rank still starts as a fresh interpreter
would for everything else: it gets the parent's environment, working
directory, stdout and stderr as they are at the call, redoes what epkit's
import did with the environment under that one (``_ENVIRONMENT_HOOKS``), and
imports ``fn``'s module after taking it. Where the platform has no fork
server, ranks are spawned. The ranks meet through a ``FileStore`` in a new
temporary file: no port, so no port races, and no socket, so no name lookup
(c10d names the peer of every TCPStore connection by a reverse lookup, which on
a host without a reachable resolver fails and prints "[c10d] The hostname of
the client socket cannot be retrieved" once per connection). The parent waits
with one deadline for all ranks, re-raises the first failing rank's exception
with its traceback, and kills every rank when the deadline passes, so a test
can never hang.

``fn`` and its arguments must be picklable (define ``fn`` at module level).

The launcher of ``epkit run`` and ``epkit bench``; tests reach it through :mod:`epkit.testing`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import multiprocessing.reduction as mp_reduction
import os
import pickle
import sys
import tempfile
import time
import traceback
from datetime import timedelta

__all__ = ["RankError", "run_ranks", "preload", "start_context", "stop_fork_server", "CallersStdio", "DEFAULT_TIMEOUT"]

#: Seconds a whole multi-rank run may take before every rank is killed.
DEFAULT_TIMEOUT = float(os.environ.get("EPKIT_TEST_RANK_TIMEOUT", "30"))


class RankError(RuntimeError):
    """A rank raised; the message holds the rank and its traceback."""

    def __init__(self, rank: int, exc_type: str, tb: str):
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = tb
        super().__init__(f"rank {rank} raised {exc_type}:\n{tb}")


#: What the fork server imports before forking ranks: torch, and torch._dynamo, which the first call of any custom
#: op imports (with sympy and triton: ~1.7 s of CPU per rank, a third of the EP tests' time before it was
#: preloaded), and epkit (~0.25 s of CPU per rank after those). Triton reads its settings (TRITON_INTERPRET, the
#: cache directory) when they are used, not at import; torch's compiler settings read at import (TORCHDYNAMO_*,
#: TORCHINDUCTOR_*) are the parent's as they were when the server started. What epkit's import does with the
#: environment is done again in each rank under the caller's environment (:data:`_ENVIRONMENT_HOOKS`).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "epkit"]

#: The modules whose import reads the environment, each with its function that does so: a rank runs those of the
#: modules the server preloaded once it has taken the caller's environment. A module added here reads the
#: environment at import only through that function (tests/test_multiprocess.py checks that they are all here).
_ENVIRONMENT_HOOKS = {
    "epkit.log": "configure_from_env",
    "epkit.kernels.triton": "environment_defaults",
    "epkit.kernels.tilelang": "environment_defaults",
}


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too before it forks ranks, instead of every rank importing them
    (e.g. a test suite's ``pytest``, which the test modules the ranks unpickle import). The server reads the list
    when it starts (a process's first launch). Only modules whose import reads no environment variable (or does
    it through :data:`_ENVIRONMENT_HOOKS`): the server's environment is the parent's at its start, not at each
    launch."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def start_context():
    """The multiprocessing context that starts ranks: a fork server with torch imported where the platform has
    one (Linux, macOS), else spawn. Also used by :mod:`epkit.emulated_hosts`."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # only read when the server starts (the first call of a process)
    return ctx


def stop_fork_server() -> None:
    """Stop the fork server this process started (if any) and wait until it has exited, so that nothing of the
    process outlives it (an emulated host's namespaces empty when its last process ends). A server that is not
    stopped ends by itself once this process exits. Uses CPython's ForkServer._stop where it exists."""
    from multiprocessing import forkserver

    stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
    if stop is not None:
        stop()


class CallersStdio:
    """The caller's stdout and stderr as they are when a process starts, for a process the fork server forks
    (whose own are the server's, as they were when it started: under pytest, some earlier test's capture).
    Pass one in a Process's arguments (it is pickled while the process starts, which duplicates the two file
    descriptors for the child) and call :meth:`take` first thing in the child."""

    def __init__(self):
        self.fds: tuple = ()

    def __reduce__(self):
        fds = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:  # closed in the caller: the child keeps its own
                fds.append(None)
                continue
            fds.append(mp_reduction.DupFd(fd))
        return (_rebuild_stdio, (tuple(fds),))

    def take(self) -> None:
        """Make the caller's stdout and stderr this process's file descriptors 1 and 2."""
        for target, dup in zip((1, 2), self.fds):
            if dup is not None:
                fd = dup.detach()
                if fd != target:
                    os.dup2(fd, target)
                    os.close(fd)


def _rebuild_stdio(fds: tuple) -> CallersStdio:
    got = CallersStdio()
    got.fds = fds
    return got


def _child(job, env, stdio, rank, world_size, store_path, results, init_timeout, init_dist):
    # The fork server's environment and stdio are the parent's as they were when the server started: take
    # today's first, then import what the job needs (fn's module, epkit) under them.
    stdio.take()
    os.environ.clear()
    os.environ.update(env)
    for name, hook in _ENVIRONMENT_HOOKS.items():
        module = sys.modules.get(name)
        if module is not None:
            getattr(module, hook)()
    import torch
    import torch.distributed as dist

    try:
        fn, args, kwargs = pickle.loads(job)
    except BaseException as exc:  # noqa: BLE001 -- reported as the rank's error
        results.send(("err", rank, (type(exc).__name__, traceback.format_exc())))
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        if init_dist:
            store = dist.FileStore(store_path, -1)  # -1: the parent removes the file
            store.set_timeout(timedelta(seconds=init_timeout))
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=init_timeout)
            )
            # every rank's mesh is whole before any rank goes on: a rank that finished its side of the mesh and
            # then left at once (a job that needs no peer) closed pairs a slower rank was still connecting
            # ("Gloo connectFullMesh failed ... Connection closed by peer")
            dist.barrier()
        msg = ("ok", rank, fn(rank, world_size, *args, **kwargs))
    except BaseException as exc:  # report everything, including SystemExit and KeyboardInterrupt
        msg = ("err", rank, (type(exc).__name__, traceback.format_exc()))
    try:
        try:
            results.send(msg)  # pickled here, so a result that cannot be sent is reported as an error
        except Exception as exc:
            why = f"could not send rank {rank}'s result:\n" + traceback.format_exc()
            results.send(("err", rank, (type(exc).__name__, why)))
    finally:
        if init_dist and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _kill(procs) -> None:
    procs = [p for p in procs if p.pid is not None]  # a failed start (e.g. unpicklable fn) leaves some unstarted
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2)


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float | None = None,
    init_dist: bool = True,
    may_die: tuple[int, ...] = (),
    **kwargs,
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes (see the module docstring).

    Parameters
    ----------
    fn : module-level callable
    world_size : int, >= 1
    timeout : float, optional
        Seconds for the whole run (default ``DEFAULT_TIMEOUT``, 30 s; env
        ``EPKIT_TEST_RANK_TIMEOUT``). On expiry every rank is killed and
        ``TimeoutError`` names the ranks that had not finished.
    init_dist : bool
        Initialise torch.distributed (gloo) in each rank (default True).
    may_die : tuple of int
        Ranks allowed to die without reporting (fault tests); their result is None.

    Returns
    -------
    list
        Each rank's return value, by rank.

    Raises
    ------
    RankError
        The first rank that raised, with its remote traceback.
    TimeoutError
        Some rank did not finish in time.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    job = pickle.dumps((fn, args, kwargs))  # here, so an unpicklable fn or argument fails in the caller
    ctx = start_context()
    store_path = _store_file() if init_dist else ""
    # One pipe per rank, whose write end only that rank holds: a rank that dies, even in the middle
    # of sending a large result, reads as end-of-file instead of leaving a shared queue half-written.
    readers, writers, procs = {}, [], []
    for r in range(world_size):
        rd, wr = ctx.Pipe(duplex=False)
        readers[r] = rd
        writers.append(wr)
        procs.append(
            ctx.Process(
                target=_child,
                args=(job, dict(os.environ), CallersStdio(), r, world_size, store_path, wr, timeout, init_dist),
                daemon=True,
                name=f"epkit-rank{r}",
            )
        )
    try:
        for p in procs:
            p.start()
        for wr in writers:
            wr.close()
        return _collect(readers, procs, timeout, may_die)
    finally:
        _kill(procs)
        for conn in [*readers.values(), *writers]:  # writers too: a failed start leaves them open
            conn.close()
        if store_path:
            with contextlib.suppress(OSError):
                os.unlink(store_path)


def _store_file() -> str:
    """A new empty file for the ranks' FileStore (every rank has it open until it ends; the caller removes it)."""
    fd, path = tempfile.mkstemp(prefix="epkit-ranks-", suffix=".store")
    os.close(fd)
    return path


def _collect(readers: dict, procs: list, timeout: float, may_die: tuple[int, ...]) -> list:
    """Every rank's result, by rank, read from its pipe within ``timeout`` seconds of now.

    Raises RankError for the first rank that reports an exception or dies without reporting (unless it is
    in ``may_die``: its result is None), TimeoutError when the deadline passes first.
    """
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    out: dict[int, object] = {}
    while len(out) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            pending = sorted(set(range(world_size)) - set(out))
            raise TimeoutError(f"ranks {pending} of {world_size} did not finish within {timeout:g} s; killed all ranks")
        waiting = {readers[r]: r for r in range(world_size) if r not in out}
        for conn in mp_connection.wait(list(waiting), timeout=min(left, 0.5)):
            r = waiting[conn]
            try:
                kind, rank, payload = conn.recv()
            except (EOFError, OSError):  # exited (or was killed) without a complete report
                procs[r].join(1.0)
                if r in may_die:
                    out[r] = None
                    continue
                raise RankError(
                    r, "ProcessDied", f"process exited with code {procs[r].exitcode} without reporting"
                ) from None
            except Exception as exc:  # the report arrived but cannot be unpickled here
                raise RankError(r, type(exc).__name__, f"its result could not be unpickled: {exc}") from exc
            if kind == "err":
                raise RankError(rank, payload[0], payload[1])
            out[rank] = payload
    return [out[r] for r in range(world_size)]
