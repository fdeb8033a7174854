"""The multi-rank harness: real processes, results back, tracebacks out, no hangs."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from epkit.testing.multiprocess import RankError, ranks, run_ranks


def _all_reduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return (dist.get_rank(), dist.get_world_size(), t.item())


@pytest.mark.parametrize("world_size", [1, 4])
def test_results_by_rank(world_size):
    out = run_ranks(_all_reduce, world_size)
    total = world_size * (world_size + 1) / 2
    assert out == [(r, world_size, total) for r in range(world_size)]


def _one_raises(rank, world_size):
    if rank == 2:
        raise ValueError("bad routing on rank two")
    dist.barrier()  # the other ranks would wait forever for rank 2
    return rank


def test_failing_rank_traceback_is_reraised():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_one_raises, 4, timeout=25)
    err = info.value
    assert err.rank == 2 and err.exc_type == "ValueError"
    assert "bad routing on rank two" in str(err)
    assert "_one_raises" in err.remote_traceback  # the remote frame is in the traceback
    assert time.monotonic() - t0 < 25


def _one_hangs(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def test_hanging_rank_times_out_and_is_killed():
    t0 = time.monotonic()
    # The deadline covers process start-up too (ranks fork from a server that has imported torch: well under a
    # second each, seconds on a loaded 2-core machine), so 6 s leaves the two others room to finish.
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 3 did not finish within 6 s"):
        run_ranks(_one_hangs, 3, timeout=6, init_dist=False)
    assert time.monotonic() - t0 < 6 + 10


def _killed(rank, world_size):
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_killed_rank_is_reported():
    with pytest.raises(RankError, match="ProcessDied|exited with code"):
        run_ranks(_killed, 2, timeout=20, init_dist=False)


@ranks(2)
def test_decorator_runs_on_two_ranks(rank, world_size):
    assert dist.get_world_size() == world_size == 2
    t = torch.tensor([rank])
    dist.broadcast(t, src=1)
    assert t.item() == 1


@ranks(2, timeout=20)
def _decorated_failure(rank, world_size):
    assert rank == 0, f"rank {rank} disagrees"


def test_decorated_failure_surfaces():
    with pytest.raises(RankError, match="rank 1 disagrees"):
        _decorated_failure()


def _large_results(rank, world_size):
    return bytes([rank]) * (8 << 20)  # far more than a pipe buffer


def test_large_results_arrive_whole():
    out = run_ranks(_large_results, 2, init_dist=False, timeout=60)
    assert [len(o) for o in out] == [8 << 20] * 2 and out[1][-1] == 1


def _dies_while_sending(rank, world_size):
    import threading

    if rank == 1:
        # Killed by a timer while its (large) result is being written to the parent.
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        return b"x" * (1 << 30)  # long enough that the timer always fires before the send completes
    return "ok"


def test_rank_killed_mid_result_is_reported_not_hung():
    t0 = time.monotonic()
    with pytest.raises(RankError, match="ProcessDied") as info:
        run_ranks(_dies_while_sending, 2, init_dist=False, timeout=60)
    assert info.value.rank == 1 and time.monotonic() - t0 < 30


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("this result cannot be pickled")


def _unpicklable_result(rank, world_size):
    return _Unpicklable()


def test_unpicklable_result_is_an_error_not_a_hang():
    with pytest.raises(RankError, match="cannot be pickled") as info:
        run_ranks(_unpicklable_result, 1, init_dist=False, timeout=30)
    assert info.value.exc_type == "TypeError" and "could not send rank 0's result" in str(info.value)


def _environment_seen(rank, world_size):
    import epkit.log

    handlers = [type(h).__name__ for h in epkit.log.logger.handlers]
    return epkit.log.logger.level, handlers, os.environ.get("TRITON_DEFAULT_FP_FUSION")


@pytest.mark.parametrize("level", ["debug", None])
def test_a_rank_applies_the_callers_environment_to_what_the_server_preloaded(monkeypatch, level):
    """The fork server imported epkit under the environment it started with; a rank redoes what that import did
    with the environment under the caller's as it is at the call (epkit.cpu_ranks._ENVIRONMENT_HOOKS)."""
    import logging

    run_ranks(_environment_seen, 1)  # the server is up, epkit imported there, whatever this test sets next
    if level is None:
        monkeypatch.delenv("EPKIT_LOG", raising=False)
    else:
        monkeypatch.setenv("EPKIT_LOG", level)
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    [(got_level, handlers, fusion)] = run_ranks(_environment_seen, 1)
    assert fusion == "0"  # epkit.kernels.triton's default, set again in the rank
    if level is None:
        assert (got_level, "_EpkitStderrHandler" in handlers) == (logging.NOTSET, False)
    else:
        assert (got_level, handlers.count("_EpkitStderrHandler")) == (logging.DEBUG, 1)


_IMPORT_READS = r"""
import json, os, sys, torch, torch._dynamo, pytest
read = set()
get = type(os.environ).__getitem__
def spy(self, key):
    read.add(key)
    return get(self, key)
type(os.environ).__getitem__ = spy
import epkit.cpu_ranks as cpu_ranks
for name in cpu_ranks._PRELOAD + ["epkit.compat.deep_ep", "epkit.testing"]:
    __import__(name)
at_import, read = read, set()
for name, hook in cpu_ranks._ENVIRONMENT_HOOKS.items():
    if name in sys.modules:
        getattr(sys.modules[name], hook)()
print(json.dumps([sorted(at_import), sorted(read)]))
"""


def test_every_environment_variable_read_by_the_preloaded_imports_is_read_again_in_each_rank():
    """Each variable the preloaded imports read, a hook of epkit.cpu_ranks._ENVIRONMENT_HOOKS reads again (a rank
    runs them under the caller's environment), but the launch timeout, which only a launching process reads."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("EPKIT_LOG", "TRITON_DEFAULT_FP_FUSION")}
    out = subprocess.run([sys.executable, "-c", _IMPORT_READS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    at_import, by_hooks = map(set, json.loads(out.stdout.strip().splitlines()[-1]))
    assert {"EPKIT_LOG", "TRITON_DEFAULT_FP_FUSION"} <= by_hooks, by_hooks  # the spy sees them
    assert at_import - by_hooks <= {"EPKIT_TEST_RANK_TIMEOUT"}, at_import - by_hooks
