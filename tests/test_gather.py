import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import epkit
from epkit.backends import BackendUnavailableError, select
from epkit.gather import gather_rows_reference
from epkit.testing import assert_bitwise_equal, tilelang_compile_cuda
from epkit.testing.markers import requires_cuda, requires_nvcc, requires_tilelang, requires_triton

CPU_BACKENDS = [
    "reference",
    "cpu",
    pytest.param("tilelang", marks=requires_tilelang),
    pytest.param("triton", marks=requires_triton),
]
#: ``(dtype, n, m, width)``: the cases that differ for a byte-row copy (row bytes by the widest word that divides
#: them, booleans, -1 entries, no source rows, no index, many rows), not their product: ``x [n, width]``, ``m``
#: indices.
CASES = [
    (torch.float32, 37, 53, 5),  # 20-byte rows: 4-byte words; -1 entries
    (torch.bfloat16, 37, 53, 5),  # 10-byte rows: 2-byte words only
    (torch.int8, 37, 53, 5),  # 5-byte rows: bytes only
    (torch.bool, 37, 53, 5),  # booleans (no byte view of their own)
    (torch.float16, 1, 4, 1),  # one source row of one element
    (torch.int8, 0, 3, 7),  # no source rows: every index -1
    (torch.int64, 64, 0, 16),  # no index: an empty result of 128-byte rows
    (torch.float8_e4m3fn, 300, 129, 96),  # 96-byte rows (16-byte vectors), many rows
    (torch.bfloat16, 300, 129, 96),  # 192-byte rows
]
CASE_IDS = [f"{str(d)[6:]}-{n}x{w}-m{m}" for d, n, m, w in CASES]


def _rand(shape, dtype, g):
    raw = torch.randint(
        0,
        256,
        (*shape[:-1], shape[-1] * torch.empty((), dtype=dtype).element_size()),
        generator=g,
        dtype=torch.uint8,
    )
    if dtype == torch.bool:
        return (raw % 2).bool()
    return raw.view(dtype)  # arbitrary bit patterns, NaN payloads and -0.0 included


def _expected(x, index):
    """Independent of every backend: boolean mask + advanced indexing on byte views."""
    xb = x if x.dtype == torch.bool else x.view(torch.uint8)
    out = torch.zeros((index.numel(), *xb.shape[1:]), dtype=xb.dtype)
    ok = index >= 0
    out[ok] = xb[index[ok].long()]
    return out if x.dtype == torch.bool else out.view(x.dtype)


def _case(n: int, m: int, width: int, dtype: torch.dtype):
    """``x [n, width]`` of arbitrary bits and ``m`` int32 indices in ``[-1, n)`` (all -1 when ``n == 0``)."""
    g = torch.Generator().manual_seed(n * 1000 + m + width)
    x = _rand((n, width), dtype, g)
    if not n:
        return x, torch.full((m,), -1, dtype=torch.int32)
    return x, torch.randint(-1, n, (m,), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype,n,m,width", CASES, ids=CASE_IDS)
def test_gather_bit_exact(backend, dtype, n, m, width):
    x, index = _case(n, m, width, dtype)
    got = epkit.gather_rows(x, index, backend=backend)
    assert_bitwise_equal(got, _expected(x, index), ctx=f"{backend=} {dtype=} {n=} {m=} {width=}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gather_nd_rows_int64_index_and_out(backend):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(11, 3, 4, generator=g).to(torch.bfloat16)
    index = torch.tensor([10, -1, 0, 0, 5, -1], dtype=torch.int64)
    out = torch.full((6, 3, 4), 9.0, dtype=torch.bfloat16)
    res = epkit.gather_rows(x, index, out, backend=backend)
    assert res.data_ptr() == out.data_ptr()
    assert_bitwise_equal(out, gather_rows_reference(x, index), ctx=backend)
    assert torch.equal(out[1], torch.zeros(3, 4, dtype=torch.bfloat16))


@requires_tilelang
@given(n=st.integers(0, 40), m=st.integers(0, 600), width=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_gather_property_tilelang_vs_cpu(n, m, width, seed):
    g = torch.Generator().manual_seed(seed)
    x = _rand((n, width), torch.float16, g)
    index = torch.randint(-1, n, (m,), generator=g, dtype=torch.int32) if n else torch.full((m,), -1, dtype=torch.int32)
    assert_bitwise_equal(
        epkit.gather_rows(x, index, backend="tilelang"),
        epkit.gather_rows(x, index, backend="cpu"),
        ctx=f"{n=} {m=} {width=} {seed=}",
    )


def test_gather_bad_input():
    x = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"index\[1\] = 4 is outside \[-1, 4\)"):
        epkit.gather_rows(x, torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"index\[0\] = -2"):
        epkit.gather_rows(x, torch.tensor([-2], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32 or int64"):
        epkit.gather_rows(x, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="out must be"):
        epkit.gather_rows(x, torch.tensor([0], dtype=torch.int32), out=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="unknown backend"):
        epkit.gather_rows(x, torch.tensor([0], dtype=torch.int32), backend="cuda-magic")


def test_backend_selection():
    assert select("gather_rows", "cpu") == "cpu"
    with pytest.raises(BackendUnavailableError, match="does not run on cuda"):
        select("gather_rows", "cuda", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="no CUDA device"):
            select("gather_rows", "cuda", "triton")


def test_env_backend_override(monkeypatch):
    monkeypatch.setenv("EPKIT_BACKEND", "reference")
    assert select("gather_rows", "cpu") == "reference"


@pytest.fixture(params=["c++", "index_select"])
def cpu_path(request, monkeypatch):
    """The cpu backend's two paths at any size: the C++ gather, or torch.index_select (which it takes for small
    results on one thread, ``epkit.gather.INDEX_SELECT_BYTES``)."""
    import epkit.gather as gather_mod

    if request.param == "c++":
        assert gather_mod._gather_extension() is not None, "epkit._C has no gather_rows: the C++ path is not built"
        monkeypatch.setattr(gather_mod, "INDEX_SELECT_BYTES", 0)
    else:
        monkeypatch.setattr(gather_mod, "_index_select_faster", lambda out: True)
    return request.param


@pytest.mark.parametrize("dtype,n,m,width", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("check_index", [True, False])
def test_gather_cpu_paths_bit_exact(cpu_path, dtype, n, m, width, check_index):
    x, index = _case(n, m, width, dtype)
    got = epkit.gather_rows(x, index, backend="cpu", check_index=check_index)
    assert_bitwise_equal(got, _expected(x, index), ctx=f"{cpu_path=} {dtype=} {n=} {m=} {width=}")
    if n:  # no padding: the index_select path's one-pass case
        full = index.clamp(min=0)
        got = epkit.gather_rows(x, full, backend="cpu", check_index=check_index)
        assert_bitwise_equal(got, _expected(x, full), ctx=f"{cpu_path=} {dtype=} no padding")


@pytest.mark.parametrize("threads", [1, 2])
def test_gather_cpu_large_streaming_and_threaded(threads, monkeypatch):
    # A 9 MiB source (past the C++ gather's cached-source size: read with its prefetch cursor), 8 MiB of output
    # (streaming stores) and, on 2 threads, its thread split (chunks of 256 KiB); tiny tests take none of these.
    import epkit.gather as gather_mod

    monkeypatch.setattr(gather_mod, "INDEX_SELECT_BYTES", 0)
    g = torch.Generator().manual_seed(threads)
    x = _rand((4500, 1024), torch.bfloat16, g)
    index = torch.randint(-1, 4500, (4096,), generator=g, dtype=torch.int64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = epkit.gather_rows(x, index, backend="cpu")
        few = epkit.gather_rows(x, index[:512], backend="cpu")  # 1 MiB out: plain stores, prefetched source
        odd = epkit.gather_rows(x[:, :999], index.to(torch.int32), backend="cpu")  # rows of no whole cache line
    finally:
        torch.set_num_threads(before)
    assert_bitwise_equal(got, _expected(x, index), ctx=f"{threads=}")
    assert_bitwise_equal(few, _expected(x, index[:512]), ctx=f"{threads=} few rows")
    assert_bitwise_equal(odd, _expected(x[:, :999].contiguous(), index), ctx=f"{threads=} odd rows")


@pytest.mark.parametrize("bad", [4, -2])
def test_gather_cpu_unchecked_bad_index_raises(cpu_path, bad):
    x = torch.arange(8.0).view(4, 2)
    with pytest.raises(IndexError, match=rf"index\[1\] = {bad} is outside \[-1, 4\)"):
        epkit.gather_rows(x, torch.tensor([0, bad, 1], dtype=torch.int32), backend="cpu", check_index=False)


def test_gather_cpu_without_the_extension(monkeypatch):
    import epkit.gather as gather_mod

    monkeypatch.setattr(gather_mod, "_gather_extension", lambda: None)  # torch.index_select on integer words
    g = torch.Generator().manual_seed(5)
    x = _rand((37, 5), torch.float16, g)
    index = torch.randint(-1, 37, (53,), generator=g, dtype=torch.int32)
    assert_bitwise_equal(epkit.gather_rows(x, index, backend="cpu"), _expected(x, index), ctx="no epkit._C")


# Rung 3: compiled for sm_90 without a GPU.


@requires_tilelang
@requires_nvcc
@pytest.mark.parametrize("word,width", [("int32", 1024), ("int16", 100)])
def test_gather_tilelang_lowers_and_nvcc_compiles_for_sm90(word, width):
    from epkit.kernels.tilelang.gather import gather_rows_func

    k = tilelang_compile_cuda(gather_rows_func(width, word, "cuda"), "sm_90")
    assert "__global__" in k.source and "gather_rows_kernel" in k.source
    assert k.cubin and len(k.cubin) > 1000
    if k.sass is not None:
        assert "STG" in k.sass


# Rung 4: executed on a GPU.


@requires_cuda
@pytest.mark.parametrize("backend", ["triton", pytest.param("tilelang", marks=requires_tilelang), "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=str)
def test_gather_gpu(backend, dtype):
    g = torch.Generator().manual_seed(3)
    x = _rand((513, 7168), dtype, g)
    index = torch.randint(-1, 513, (1031,), generator=g, dtype=torch.int32)
    got = epkit.gather_rows(x.cuda(), index.cuda(), backend=backend)
    assert_bitwise_equal(got.cpu(), _expected(x, index), ctx=f"{backend=} {dtype=}")


def test_gather_cpu_eager_call_acts_as_the_op():
    # An eager CPU call skips torch.ops dispatch; what the op does for a mutated argument still happens, and a
    # dispatch mode still sees the op itself.
    from torch.utils._python_dispatch import TorchDispatchMode

    x, index = torch.arange(8.0).view(4, 2), torch.tensor([3, -1], dtype=torch.int32)
    out = torch.empty(2, 2)
    before = out._version
    epkit.gather_rows(x, index, out)
    assert out._version > before, "out's version counter must move, as the op's mutation does"

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as mode:
        got = epkit.gather_rows(x, index)
    assert any("epkit.gather_rows" in op for op in mode.ops), mode.ops
    assert torch.equal(got, torch.tensor([[6.0, 7.0], [0.0, 0.0]]))


def _gather_in_child(q, x, index, want):
    # No parallel torch op in a forked child of a process whose torch threads ran (OpenMP does not survive fork):
    # the C++ gather is called on the parent's tensors with 2 threads, and the result compared in numpy.
    import numpy as np

    from epkit import _C

    out = torch.empty_like(x)
    bad = _C.gather_rows(out.data_ptr(), x.data_ptr(), index.data_ptr(), 8, x.shape[0], x.shape[0], 2048, 2)
    q.put(bad == -1 and bool(np.array_equal(out.numpy(), want.numpy())))


def test_gather_cpu_helpers_after_fork(monkeypatch):
    # The parent's 2-thread gather starts OpenMP workers (csrc/parallel.h); GNU OpenMP is not fork-safe, so a child
    # forked after that must take epkit's own pool instead (entering an OpenMP region there waits forever: this test
    # hung with that check removed, as torch's own 2-thread index_select does in such a child). Without OpenMP the
    # pool's helpers sleep between calls, and a forked child has none of them: it must not wait for one either.
    # Whether the child starts helpers of its own is not observed.
    import multiprocessing as mp

    import epkit.gather as gather_mod

    monkeypatch.setattr(gather_mod, "INDEX_SELECT_BYTES", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.arange(4096 * 512, dtype=torch.float32).view(4096, 512)
        index = torch.arange(4095, -1, -1)
        want = x.flip(0).contiguous()
        assert torch.equal(epkit.gather_rows(x, index, backend="cpu"), want)  # the pool has its helper now
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_gather_in_child, args=(q, x, index, want))
        p.start()
        try:
            assert q.get(timeout=60) is True
        finally:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        assert p.exitcode == 0
    finally:
        torch.set_num_threads(before)
