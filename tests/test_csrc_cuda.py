"""csrc/cuda: the NVSHMEM transport extension, compiled for sm_90 (rung 3) and run on a GPU (rung 4)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from epkit.testing.ladder import cuda_tool
from epkit.testing.markers import requires_cuda, requires_nvcc
from epkit.testing.multiprocess import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nvshmem_installed() -> bool:
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return any(os.path.exists(os.path.join(r, "nvshmem", "include", "nvshmem.h")) for r in roots)


def _ext_path():
    spec = importlib.util.find_spec("epkit._C_cuda")
    return spec.origin if spec else None


@requires_nvcc
def test_cuda_extension_built_when_toolchain_present():
    if not _nvshmem_installed():
        pytest.skip("no nvidia-nvshmem wheel installed: the CUDA build is off (pip install 'epkit[cuda13]')")
    if os.environ.get("EPKIT_CUDA", "auto") in ("0", "off"):
        pytest.skip("EPKIT_CUDA=0 turned the CUDA build off")
    path = _ext_path()
    assert path, "nvcc and nvshmem are present, so setup.py must have built epkit._C_cuda"
    tool = cuda_tool("cuobjdump")
    assert tool, "cuobjdump (bundled with triton) is needed to inspect the extension"
    elf = subprocess.run([tool, "-lelf", path], capture_output=True, text=True, timeout=120).stdout
    assert "sm_90" in elf, elf
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, timeout=300).stdout
    kernels = ("put_signal_kernel", "put_chunks_kernel", "signal_after_kernel", "signal_wait_kernel",
               "signal_op_kernel", "signal_wait_all_kernel")  # fmt: skip
    for kernel in kernels:
        assert kernel in sass, f"{kernel} missing from the extension's SASS"
    # put_signal to an addressable peer: many blocks copying 16 bytes per load and store
    start = sass.index("put_chunks_kernel")
    body = sass[start : sass.find("Function :", start)]
    assert "LDG.E.128" in body and "STG.E.128" in body, body[:2000]
    # signal_op fences (system scope) before its signal, so earlier writes of the stream land first.
    start = sass.index("signal_op_kernel")
    body = sass[start : sass.find("Function :", start)]
    assert "MEMBAR.SC.SYS" in body or "MEMBAR.SYS" in body, body[:2000]
    # The device-linked NVSHMEM put-with-signal is in the kernel, not a host fallback.
    assert "nvshmem" in sass.lower()
    # ... and put_signal_kernel itself calls NVSHMEM's device-side transfer for a PE it cannot store to (another
    # node, or a GPU without a P2P path: the hierarchy's rail between NVLink domains): its relocations name it.
    relocs = subprocess.run([tool, "-elf", path], capture_output=True, text=True, timeout=300).stdout
    sections = relocs.split(".section ")
    own = [sec for sec in sections if sec.startswith(".rela.text.") and "put_signal_kernel" in sec.split("\n", 1)[0]]
    assert own, "no relocation section of put_signal_kernel"
    assert "nvshmemi_transfer_put_signal" in own[0], own[0][:2000]


@requires_nvcc
def test_cuda_extension_imports_without_a_gpu():
    if _ext_path() is None:
        pytest.skip("epkit._C_cuda was not built here (no nvcc + nvidia-nvshmem wheel)")
    import epkit._C_cuda as cc

    assert cc.unique_id_size() > 0
    assert cc.initialized() is False and cc.finalized() is False
    with pytest.raises(RuntimeError, match="call init\\(\\) first"):
        cc.malloc(16)
    with pytest.raises(RuntimeError, match="signal_op: call init\\(\\) first"):
        cc.signal_op(4096, 1, "set", 0, 0)
    with pytest.raises(RuntimeError, match="signal_wait_all: call init\\(\\) first"):
        cc.signal_wait_all(4096, 1, 2, ">=", 1, 1.0, 8192, 0)
    with pytest.raises(ValueError, match="unique id has 3 bytes"):
        cc.init(b"abc", 0, 1)


def test_setup_cuda_switch_is_respected():
    """EPKIT_CUDA=1 without a toolchain is a clear error; EPKIT_CUDA=0 always skips."""
    env = dict(os.environ, EPKIT_CUDA="0")
    probe = (
        "import runpy, sys, os; sys.argv=['setup.py','--version'];"
        "g=runpy.run_path('setup.py', run_name='probe'); print(g['_cuda_wanted']())"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "(False, 'EPKIT_CUDA=0')" in res.stdout
    # A PATH without nvcc: EPKIT_CUDA=1 must fail loudly, auto must quietly skip.
    env["PATH"] = os.path.dirname(sys.executable)
    for flag, want in (("1", "EPKIT_CUDA=1 but no nvcc"), ("auto", "(False, 'auto: no nvcc")):
        env["EPKIT_CUDA"] = flag
        res = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
        )
        assert want in res.stdout + res.stderr, (flag, res.stdout, res.stderr)


def _single_pe_put_signal(rank, world_size):
    import epkit._C_cuda as cc

    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
    torch.cuda.set_device(0)
    cc.init(cc.get_unique_id(), 0, 1)  # makes the device's context current itself; no other CUDA call before
    try:
        nbytes = 1 << 20
        buf = cc.malloc(nbytes + 64)
        src = torch.arange(nbytes // 4, dtype=torch.int32, device="cuda")
        result = torch.zeros(2, dtype=torch.int64, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        cc.put_signal(buf, src.data_ptr(), nbytes, buf + nbytes, 7, "set", 0, stream)
        cc.signal_wait(buf + nbytes, ">=", 7, 5.0, result.data_ptr(), stream)
        torch.cuda.synchronize()
        assert result.tolist() == [7, 0]
        assert cc.peer_ptr(buf, 0) == buf
        cc.free(buf)
    finally:
        cc.finalize()
    return True


@requires_cuda
def test_nvshmem_single_pe_put_signal():
    if _ext_path() is None:
        pytest.skip("epkit._C_cuda was not built here (no nvcc + nvidia-nvshmem wheel)")
    # In a child process: NVSHMEM ends its process on most failures, which must not take pytest with it.
    assert run_ranks(_single_pe_put_signal, 1, timeout=180) == [True]
