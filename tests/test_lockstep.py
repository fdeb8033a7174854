"""DP lockstep on real CPU ranks: same step count, no deadlock, no starved prefill."""

import pytest
import torch
import torch.distributed as dist

from epkit.lockstep import LockstepDriver, PrefillVote, has_unfinished, placeholder_batch
from epkit.testing import how_it_ends
from epkit.testing.multiprocess import run_ranks


def test_vote_schedule_without_communication():
    v = PrefillVote(None, prefill_attempt_interval=2, prefill_any_attempt_interval=5)
    plans = [v.decide(any_pending=True, all_pending=False) for _ in range(10)]
    # decode steps 1..: ALL votes on even counts (fail: not everyone pending), ANY on the 5th -> prefill.
    assert [p.vote for p in plans[:5]] == [None, "all", None, "all", "any"]
    assert [p.is_prefill for p in plans[:5]] == [False, False, False, False, True]
    # The counter restarted after the prefill, so the pattern repeats.
    assert [p.vote for p in plans[5:]] == [None, "all", None, "all", "any"]
    assert plans[9].is_prefill and v.decode_steps == 0
    v2 = PrefillVote(None, 2, 5)
    assert v2.decide(True, True).is_prefill is False  # step 1: no vote due
    assert v2.decide(True, True).is_prefill is True  # step 2: ALL vote passes
    assert v2.decide(True, False, any_running_decode=False).vote == "any"  # nobody decoding: vote now
    with pytest.raises(ValueError, match="prefill_any_attempt_interval must be a positive integer"):
        PrefillVote(None, 1, 0)


def test_placeholder_batch():
    b = placeholder_batch(is_prompt=True, num_tokens=3, token_id=7)
    assert b.token_ids.tolist() == [7, 7, 7] and b.positions.tolist() == [0, 1, 2]
    assert b.cu_seqlens.tolist() == [0, 3] and b.is_placeholder and b.is_prompt
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        placeholder_batch(False, 0)


def test_single_rank_needs_no_group():
    assert has_unfinished(True) is True and has_unfinished(False) is False


class _Engine:
    """A toy DP engine: requests = (arrival_step, prefill_done -> decode_len)."""

    def __init__(self, requests):
        self.waiting = sorted(requests)  # (arrival_step, decode_len)
        self.running = []  # remaining decode steps
        self.finished = 0
        self.prefill_steps = []

    def arrived(self, step):
        return [r for r in self.waiting if r[0] <= step]

    def has_unfinished(self):
        return bool(self.waiting or self.running)


def _engine_loop(rank, world_size, requests, attempt, any_attempt):
    eng = _Engine(requests[rank])
    driver = LockstepDriver(None, attempt, any_attempt)
    step = 0
    kinds = []
    while True:
        plan = driver.next_step(
            has_unfinished=eng.has_unfinished(),
            has_pending_prefill=bool(eng.arrived(step)),
            has_running_decode=bool(eng.running),
        )
        if plan is None:
            break
        if plan.is_prefill:
            ready = eng.arrived(step)
            if ready:
                for r in ready:
                    eng.waiting.remove(r)
                    eng.running.append(r[1])
                    eng.prefill_steps.append((r[0], step))
                batch_tokens = len(ready)
            else:
                batch_tokens = placeholder_batch(is_prompt=True).token_ids.numel()
        else:
            eng.running = [n - 1 for n in eng.running]
            eng.finished += sum(1 for n in eng.running if n == 0)
            eng.running = [n for n in eng.running if n > 0]
            batch_tokens = len(eng.running) or placeholder_batch(is_prompt=False).token_ids.numel()
        # The EP collective every rank must enter each step; it also proves the ranks agree on the step kind.
        t = torch.tensor([float(batch_tokens), float(plan.is_prefill), float(step)])
        got = [torch.zeros(3) for _ in range(world_size)]
        dist.all_gather(got, t)
        assert len({(g[1].item(), g[2].item()) for g in got}) == 1, f"ranks out of step at {step}: {got}"
        kinds.append("P" if plan.is_prefill else "D")
        step += 1
    return {"steps": step, "finished": eng.finished, "prefill_steps": eng.prefill_steps, "kinds": "".join(kinds)}


def test_four_ranks_stay_in_lockstep():
    requests = {
        0: [(0, 20), (3, 5)],  # busy
        1: [(0, 2)],  # finishes early
        2: [],  # never gets a request
        3: [(6, 4)],  # arrives late; rank 2 never votes for prefill, so only ANY votes can admit it
    }
    any_interval = 4
    res = run_ranks(_engine_loop, 4, requests, 1, any_interval, timeout=60)
    steps = {r["steps"] for r in res}
    assert len(steps) == 1, f"ranks ran different step counts: {res}"
    kinds = {r["kinds"] for r in res}
    assert len(kinds) == 1
    for rank, r in enumerate(res):
        assert r["finished"] == len(requests[rank]), f"rank {rank} lost requests: {r}"
    arrival, admitted = res[3]["prefill_steps"][0]
    assert admitted - arrival <= any_interval, f"late request waited {admitted - arrival} steps"
    assert res[0]["steps"] >= 20  # the loop ran until the longest request finished, on every rank


def _liveness(rank, world_size):
    return [has_unfinished(rank == 2 and i < 3) for i in range(5)]


def test_has_unfinished_is_a_group_decision():
    res = run_ranks(_liveness, 4, timeout=30)
    assert res == [[True, True, True, False, False]] * 4


def _one_rank_stops(rank, world_size, how):
    """Rank 2 takes part in one lockstep step, then stops (``kill``: SIGKILL; ``freeze``: sleeps past the group's
    2 s timeout); the others' next step must end within the timeout naming global rank 2."""
    import os
    import signal
    import time
    from datetime import timedelta

    group = dist.new_group(list(range(world_size)), backend="gloo", timeout=timedelta(seconds=2))
    has_unfinished(True, group)
    if rank == 2:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(6)
        return None
    return how_it_ends(lambda: has_unfinished(True, group))


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_rank_that_stops_is_named_by_the_others_next_step(how):
    # gloo's own error named nobody ("Timed out waiting 2000ms for recv operation to complete", "Connection
    # closed by peer [127.0.0.1]:port"), and epkit run's groups waited 60 s for it.
    res = run_ranks(_one_rank_stops, 3, how, timeout=60, may_die=(2,))
    for rank in (0, 1):
        msg, seconds = res[rank]
        assert "rank 2 never reached it" in msg and "lockstep step 2 of DP group [0, 1, 2]" in msg, res
        assert seconds < 2 + 1.5, res


class _StuckStore:
    """A job store out of reach (a host cut off from it): every call blocks for a minute."""

    def __getattr__(self, name):
        import time

        return lambda *args, **kwargs: time.sleep(60)


def _stuck_store(rank, world_size):
    import time

    import epkit.lockstep as lockstep

    lockstep._store = lambda: _StuckStore()
    t0 = time.monotonic()
    steps = [has_unfinished(rank == 0) for _ in range(3)]
    took = time.monotonic() - t0
    t0 = time.monotonic()
    behind = lockstep._behind(_StuckStore(), "p/", (0, 1), 1)
    return steps, took, behind, time.monotonic() - t0


def test_a_job_store_out_of_reach_holds_no_step():
    """Issue 39: the step's word and the failure path's reads of it go to the job's store off the caller's thread;
    a store that blocks (a cut link) held every step before."""
    res = run_ranks(_stuck_store, 2, timeout=60)
    for steps, took, behind, read_took in res:
        assert steps == [True, True, True] and took < 2.0, res
        assert behind is None and read_took < 1.5, res  # the failure path says it cannot tell, after a second
