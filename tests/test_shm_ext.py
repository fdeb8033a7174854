"""epkit._C: shared-memory segments, 64-bit signal words and timed waits."""

import os
import secrets
import stat
import time

import pytest
import torch

from epkit import _C
from epkit.testing.multiprocess import run_ranks


def _name():
    return f"/epkit-test-{secrets.token_hex(8)}"


def test_segment_is_private_and_unlinks():
    name = _name()
    seg = _C.ShmSegment(name, 4096, True)
    try:
        mode = stat.S_IMODE(os.stat(f"/dev/shm{name}").st_mode)
        assert mode == 0o600, oct(mode)
        assert _C.shm_exists(name)
        with pytest.raises(OSError):
            _C.ShmSegment(name, 4096, True)  # O_EXCL: never reuse a live name
        peer = _C.ShmSegment(name, 4096, False)
        seg.store(8, 123)
        assert peer.load(8) == 123
        assert seg.unlink() is True
        assert not _C.shm_exists(name)
        assert seg.unlink() is False  # idempotent
        peer.store(16, 7)  # mappings outlive the name
        assert seg.load(16) == 7
        peer.close()
    finally:
        seg.unlink()
        seg.close()
    assert not os.path.exists(f"/dev/shm{name}")


def test_atomics_and_bounds():
    seg = _C.ShmSegment(_name(), 64, True)
    seg.unlink()
    assert seg.load(0) == 0
    assert seg.fetch_add(0, 5) == 0
    assert seg.fetch_add(0, 2**64 - 1) == 5  # wraps like uint64
    assert seg.load(0) == 4
    assert seg.compare_exchange(0, 4, 9) == (True, 4)
    assert seg.compare_exchange(0, 4, 11) == (False, 9)
    seg.store(56, 2**64 - 1)
    assert seg.load(56) == 2**64 - 1
    with pytest.raises(IndexError, match="outside shm segment"):
        seg.load(64)
    with pytest.raises(ValueError, match="not 8-byte aligned"):
        seg.store(4, 1)
    with pytest.raises(ValueError, match="unknown comparison"):
        seg.wait_until(0, "~", 1, 0.1)
    src = torch.arange(8, dtype=torch.int64)
    seg.write(0, src.data_ptr(), 64)
    dst = torch.zeros(8, dtype=torch.int64)
    seg.read(0, dst.data_ptr(), 64)
    assert torch.equal(src, dst)
    with pytest.raises(IndexError):
        seg.write(8, src.data_ptr(), 64)
    seg.close()
    with pytest.raises(RuntimeError, match="closed"):
        seg.load(0)


def test_wait_until_times_out_promptly():
    seg = _C.ShmSegment(_name(), 8, True)
    seg.unlink()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"last seen 0"):
        seg.wait_until(0, ">=", 1, 0.2)
    assert time.monotonic() - t0 < 5, "a timed wait must end near its timeout"
    seg.store(0, 3)
    assert seg.wait_until(0, ">=", 1, 0.0) == 3
    assert seg.wait_until(0, "==", 3, 1.0) == 3


def _ping_pong(rank, world_size, name, rounds):
    seg = _C.ShmSegment(name, 64, False)
    other = 1 - rank
    for i in range(rounds):
        if rank == 0:
            seg.store(0, i + 1)  # ping
            seg.wait_until(8, "==", i + 1, 10.0)  # wait for pong
        else:
            seg.wait_until(0, "==", i + 1, 10.0)
            seg.store(8, i + 1)
    seg.fetch_add(16, 1 + other)
    seg.close()
    return rounds


def test_cross_process_signals():
    name = _name()
    seg = _C.ShmSegment(name, 64, True)
    try:
        assert run_ranks(_ping_pong, 2, name, 200, init_dist=False, timeout=60) == [200, 200]
        assert seg.load(16) == 3  # both ranks added once
        assert seg.load(0) == seg.load(8) == 200
    finally:
        seg.unlink()
        seg.close()


def test_row_copies_by_address():
    from epkit import _C

    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (300, 96), dtype=torch.uint8, generator=gen)
    # gather: out[i] = src[rows[i]], a zero row where the address is 0
    rows = torch.randint(0, 300, (500,), generator=gen)
    addrs = src.data_ptr() + rows * 96
    addrs[7] = 0
    out = torch.full((500, 96), 9, dtype=torch.uint8)
    _C.gather_rows_by_address(out.data_ptr(), addrs.data_ptr(), 500, 96, 2)
    want = src[rows]
    want[7] = 0
    assert torch.equal(out, want)
    # a large gather of whole-line rows (streaming stores, the prefetch cursor over zero rows too)
    big = torch.randint(-(2**31), 2**31 - 1, (4096, 128), dtype=torch.int32, generator=gen)
    rows = torch.randint(0, 4096, (20000,), generator=gen)
    addrs = big.data_ptr() + rows * 512
    addrs[::97] = 0
    want = big[rows]
    want[::97] = 0
    for threads in (1, 2):
        out = torch.full((20000, 128), 3, dtype=torch.int32)
        _C.gather_rows_by_address(out.data_ptr(), addrs.data_ptr(), 20000, 512, threads)
        assert torch.equal(out, want), threads
    # scatter + gather: dst[d[i]] = src[s[i]] (distinct destinations), rows not listed stay untouched
    dst = torch.full((400, 96), 5, dtype=torch.uint8)
    d_rows = torch.randperm(400, generator=gen)[:250]
    s_rows = torch.randint(0, 300, (250,), generator=gen)
    d_addrs = (dst.data_ptr() + d_rows * 96).contiguous()
    s_addrs = (src.data_ptr() + s_rows * 96).contiguous()
    _C.copy_rows_by_address(d_addrs.data_ptr(), s_addrs.data_ptr(), 250, 96, 2)
    want = torch.full((400, 96), 5, dtype=torch.uint8)
    want[d_rows] = src[s_rows]
    assert torch.equal(dst, want)
    # a zero address on either side skips the row (fixed-shape row lists mark their unused slots so)
    before = dst.clone()
    d_addr = torch.tensor([dst[7].data_ptr(), 0, dst[9].data_ptr()])
    s_addr = torch.tensor([src[1].data_ptr(), src[2].data_ptr(), 0])
    _C.copy_rows_by_address(d_addr.data_ptr(), s_addr.data_ptr(), 3, 96, 1)
    before[7] = src[1]
    assert torch.equal(dst, before)


def test_wait_until_or_abort_reports_which_ended_it():
    seg = _C.ShmSegment(_name(), 64, True)
    try:
        seg.store(0, 5)
        assert seg.wait_until_or_abort(0, ">=", 5, 8, 1.0) == (0, 5)  # the word holds
        assert seg.wait_until_or_abort(0, ">=", 6, 8, 0.02) == (2, 5)  # timeout: the last value seen
        seg.store(8, (1 << 63) | 7)
        assert seg.wait_until_or_abort(0, ">=", 6, 8, 30.0) == (1, (1 << 63) | 7)  # the abort word, at once
        assert seg.wait_until_or_abort(0, ">=", 5, 8, 30.0) == (0, 5)  # a word that holds wins over it
        with pytest.raises(IndexError):
            seg.wait_until_or_abort(0, ">=", 5, 64, 1.0)  # the abort word must lie in the segment
    finally:
        seg.unlink()
