"""The CPU stand-in for ``epkit._C_cuda``: same interface as the CUDA source, same contract.

The transport tests that run over the emulator (test_symm_buffer, test_ep_buffer, test_ll_stream_ordered)
mean something only if the emulator keeps the real extension's interface and semantics; these tests pin
both. The interface is read from ``csrc/cuda/nvshmem_transport.cu`` itself, so it holds on machines where
the extension is not built.
"""

import ctypes
import inspect
import re
from pathlib import Path

import pytest
import torch

from epkit.testing import nvshmem_emulator as emu
from epkit.testing.multiprocess import run_ranks

CU = Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "nvshmem_transport.cu"
MASK64 = (1 << 64) - 1


def _bindings() -> dict[str, list[tuple[str, str | None]]]:
    """``name -> [(param, default or None)]`` of every ``m.def`` in the CUDA source (``py::arg`` names, else the
    lambda's parameter names)."""
    src = CU.read_text()
    out = {}
    for m in re.finditer(r'm\.def\(\s*"(\w+)",\s*\[\]\(([^)]*)\)', src):
        params = [p.strip() for p in m.group(2).split(",") if p.strip()]
        names = [re.findall(r"\w+", p)[-1] for p in params]
        body_end = src.find("m.def(", m.end())
        block = src[m.end() : body_end if body_end > 0 else len(src)]
        named = re.findall(r'py::arg\("(\w+)"\)', block)  # the names Python sees, where the binding gives them
        assert not named or len(named) == len(names), (m.group(1), named, names)
        defaults = dict(re.findall(r'py::arg\("(\w+)"\)\s*=\s*(\w+)', block))
        out[m.group(1)] = [(n, defaults.get(n)) for n in (named or names)]
    return out


def test_emulator_has_every_binding_with_the_same_parameters():
    bindings = _bindings()
    assert len(bindings) == CU.read_text().count("m.def("), "a binding the parser did not read"
    assert {"init", "malloc", "peer_ptr", "put_signal", "signal_op", "signal_wait_all"} <= set(bindings), bindings
    for name, params in bindings.items():
        fn = getattr(emu, name, None)
        assert callable(fn), f"the emulator lacks {name}()"
        sig = inspect.signature(fn).parameters
        assert [p for p, _ in params] == list(sig), (name, params, list(sig))
        for p, default in params:
            want = inspect.Parameter.empty if default is None else {"true": True, "false": False}.get(default)
            want = int(default) if want is None and default is not None else want
            assert sig[p].default == want, (name, p, default, sig[p].default)


def _contract(rank, world_size):
    """One PE, in a fresh process (the emulator's state is process-wide, as NVSHMEM's)."""
    seen = {}
    with pytest.raises(RuntimeError, match="malloc: call init\\(\\) first"):
        emu.malloc(64)
    with pytest.raises(ValueError, match="unique id has 3 bytes, expected 128"):
        emu.init(b"abc", 0, 1)
    emu.init(emu.get_unique_id(), 0, 1)
    with pytest.raises(RuntimeError, match="already initialised"):
        emu.init(emu.get_unique_id(), 0, 1)
    assert (emu.my_pe(), emu.n_pes(), emu.initialized()) == (0, 1, True)
    a = emu.malloc(1000)
    b = emu.malloc(64)
    mem = (ctypes.c_uint8 * 1000).from_address(a)
    seen["zeroed"] = bytes(mem) == bytes(1000)
    seen["aligned"] = a % 512 == 0 and b % 512 == 0 and b >= a + 1000
    mem[:4] = [1, 2, 3, 4]
    emu.free(a)
    seen["reused_and_zeroed"] = emu.malloc(512) == a and bytes(mem[:4]) == bytes(4)
    with pytest.raises(RuntimeError, match="emulated heap is full"):
        emu.malloc(1 << 21)  # NVSHMEM_SYMMETRIC_SIZE is 1 MiB in this process
    with pytest.raises(ValueError, match="pe 1 outside \\[0, 1\\)"):
        emu.signal_op(b, 1, "set", 1, 0)
    with pytest.raises(ValueError, match="8-byte aligned"):
        emu.signal_op(b + 4, 1, "set", 0, 0)
    with pytest.raises(ValueError, match="unknown signal op"):
        emu.signal_op(b, 1, "xor", 0, 0)
    with pytest.raises(ValueError, match="not in the symmetric heap"):
        emu.signal_op(b + (1 << 22), 1, "set", 0, 0)
    # put-with-signal to self: the bytes, then the word
    src = torch.arange(16, dtype=torch.uint8)
    emu.put_signal(b + 8, src.data_ptr(), 16, b, 5, "set", 0, 0)
    emu.signal_op(b, 2, "add", 0, 0)
    seen["put"] = bytes((ctypes.c_uint8 * 16).from_address(b + 8)) == bytes(range(16))
    seen["word"] = ctypes.c_uint64.from_address(b).value
    # timed waits: success, timeout with the index, sticky skip
    res = torch.zeros(2, dtype=torch.int64)
    sticky = torch.zeros(1, dtype=torch.int64)
    emu.signal_wait_all(b, 1, 1, ">=", 7, 1.0, res.data_ptr(), 0, sticky.data_ptr())
    seen["ok"] = res.tolist()
    emu.signal_wait_all(b, 2, 3, "==", 7, 0.05, res.data_ptr(), 0, sticky.data_ptr())  # word b+16 is 0x0f0e..
    seen["timeout"] = [res[0].item() & MASK64, res[1].item(), sticky.item()]
    emu.signal_wait_all(b, 1, 1, ">=", 0, 1.0, res.data_ptr(), 0, sticky.data_ptr())
    seen["skipped"] = res[1].item() & MASK64
    emu.signal_wait_all(b, 1, 1, ">=", 0, 1.0, res.data_ptr(), 0, sticky.data_ptr(), 0, False)
    seen["not_skipped"] = res.tolist()  # skip_on_sticky=False: runs despite the sticky word
    emu.signal_wait(b, "==", 8, 0.01, res.data_ptr(), 0)
    seen["single_timeout"] = res.tolist()
    # abort words (3 words on): a notice ends a waiting word at once; a satisfied word ignores its abort word
    c = emu.malloc(128)  # 16 zero words
    sticky.zero_()
    emu.signal_op(c, 7, "set", 0, 0)  # word 0: satisfied
    emu.signal_op(c + 24, 1 << 40, "set", 0, 0)  # word 0's abort word: ignored, the word already holds
    emu.signal_op(c + 32, (1 << 63) | 9, "set", 0, 0)  # word 1's abort word: word 1 (0) is waiting
    emu.signal_wait_all(c, 1, 2, "==", 7, 30.0, res.data_ptr(), 0, sticky.data_ptr(), 3)
    seen["aborted"] = [res[0].item() & MASK64, res[1].item(), sticky.item()]
    emu.signal_wait_all(c, 1, 0, "==", 7, 30.0, res.data_ptr(), 0, 0, 3)
    seen["count0"] = res.tolist()
    seen["peer_self"] = emu.peer_ptr(b, 0) == b
    emu.finalize()
    with pytest.raises(RuntimeError, match="finalized in this process"):
        emu.init(emu.get_unique_id(), 0, 1)
    seen["calls"] = emu.calls()
    return seen


def test_single_pe_contract(monkeypatch):
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1M")
    (seen,) = run_ranks(_contract, 1, timeout=60, init_dist=False)
    assert seen["zeroed"] and seen["aligned"] and seen["reused_and_zeroed"], seen
    assert seen["put"] and seen["word"] == 7, seen
    assert seen["ok"] == [7, 0], seen
    # words b, b+16, b+32 with ==7: the second (index 1) fails first; its value is bytes 8..15 of the put
    assert seen["timeout"] == [int.from_bytes(bytes(range(8, 16)), "little"), 2, 1], seen
    assert seen["skipped"] == MASK64, seen  # the sticky word made the next wait return at once
    assert seen["single_timeout"] == [7, 1], seen
    assert seen["not_skipped"] == [7, 0], seen
    assert seen["aborted"] == [(1 << 63) | 9, 2, 1], seen  # word 1 failed on the notice, sticky set
    assert seen["count0"] == [0, 0], seen
    assert seen["peer_self"], seen
    calls = seen["calls"]
    assert calls["signal_wait_all/timed_out"] == 1 and calls["signal_wait_all/skipped"] == 1, calls
    assert calls["signal_wait_all/aborted"] == 1, calls


def _peer_addresses(rank, world_size, p2p):
    import torch.distributed as dist

    from epkit.collectives.symm_buffer import SymmBuffer

    emu.install(p2p=p2p)
    buf = SymmBuffer(dist.group.WORLD, 1 << 12, transport="nvshmem", num_signals=1, timeout=10)
    got = [buf.impl.peer_data[r] != 0 for r in range(world_size)]
    if p2p:  # a store through peer(r) lands in rank r's local buffer
        for r in range(world_size):
            buf.peer(r)[rank] = 10 + rank
        buf.barrier()
        got.append(buf.local[:world_size].tolist())
    buf.close()
    return got


@pytest.mark.parametrize("p2p", [True, False])
def test_peer_pointers_alias_the_peers_memory_or_are_absent(p2p):
    res = run_ranks(_peer_addresses, 3, p2p, timeout=60)
    for rank, got in enumerate(res):
        if p2p:
            assert got == [True, True, True, [10, 11, 12]], (rank, got)
        else:
            assert got == [r == rank for r in range(3)], (rank, got)


def _attach_contract(rank, world_size):
    """A job another library started (torch's symmetric memory): the module's ops need attach() first."""
    seen = {"status_before": emu.job_status()}
    with pytest.raises(RuntimeError, match="no NVSHMEM job is running in this process to attach to"):
        emu.attach()
    emu._start_job(emu.get_unique_id(), 0, 1)  # the host library's init, as torch runs it
    seen["status_running"], seen["initialized_before"] = emu.job_status(), emu.initialized()
    with pytest.raises(RuntimeError, match="signal_op: call init\\(\\) first"):
        emu.signal_op(4096, 1, "set", 0, 0)
    with pytest.raises(RuntimeError, match="already running"):
        emu.init(emu.get_unique_id(), 0, 1)  # epkit's own bootstrap must not start a second job
    emu.attach()
    emu.attach()  # joining twice is one join
    a = emu.malloc(64)
    emu.signal_op(a, 3, "set", 0, 0)
    seen["word"] = ctypes.c_uint64.from_address(a).value
    emu.finalize()  # gives the reference back; the job stays with its starter
    seen["after"] = (emu.initialized(), emu.job_status())
    seen["attaches"] = emu.calls().get("attach", 0)
    return seen


def test_attach_joins_a_job_started_elsewhere():
    (seen,) = run_ranks(_attach_contract, 1, timeout=60, init_dist=False)
    assert seen == {
        "status_before": 0,
        "status_running": 2,
        "initialized_before": False,
        "word": 3,
        "after": (False, 2),
        "attaches": 1,
    }, seen


def _close_paths(rank, world_size):
    import time

    import torch.distributed as dist

    from epkit.collectives.symm_buffer import SymmBuffer

    emu.install(p2p=True)
    # Every rank closes: a timed barrier, then the collective free.
    with SymmBuffer(dist.group.WORLD, 1 << 12, transport="nvshmem", num_signals=1, timeout=10) as buf:
        buf.barrier()
    frees = emu.calls().get("free", 0)
    # Rank 0 leaves its block by an exception: it must not wait for the others, and they must not wait
    # for it (NVSHMEM's free has no timeout): told by its notice, their close raises naming rank 0 at once,
    # memory kept.
    buf = SymmBuffer(dist.group.WORLD, 1 << 12, transport="nvshmem", num_signals=1, timeout=5)
    t0 = time.monotonic()
    outcome = "closed"
    try:
        with buf:
            if rank == 0:
                raise KeyError("local trouble")
    except KeyError:
        outcome = "raised here"
    except TimeoutError as exc:
        outcome = str(exc)
    return frees, emu.calls().get("free", 0) - frees, outcome, time.monotonic() - t0


def test_close_meets_the_peers_in_a_timed_barrier_before_the_free():
    res = run_ranks(_close_paths, 2, timeout=90)
    assert [r[0] for r in res] == [1, 1], res  # the clean close freed the allocation on both ranks
    (_, freed0, out0, t0), (_, freed1, out1, t1) = res
    assert out0 == "raised here" and t0 < 2, res  # no collective step on the way out
    assert "rank 0" in out1 and t1 < 4, res  # the peer's close failed on rank 0's notice, before its timeout
    assert freed0 == freed1 == 0, res  # neither freed collectively: nobody can hang in nvshmem_free
