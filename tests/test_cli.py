"""The epkit command line, run as a user would run it."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _epkit(*args, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "epkit", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_info_reports_backends_and_no_gpu():
    res = _epkit("info")
    assert res.returncode == 0, res.stderr
    assert "backends:" in res.stdout and "gather_rows" in res.stdout
    if not torch.cuda.is_available():
        assert "no GPU visible" in res.stdout
        assert "not on cuda: no CUDA device" in res.stdout


def test_info_json():
    res = _epkit("info", "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["ops"]["gather_rows"]["auto_cpu"] == "cpu"
    assert "cpu" in info["backends"]["reference"]["devices"]
    assert info["c_extension"] == "ok"


def test_selfcheck_runs_every_cpu_backend():
    res = _epkit("selfcheck")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gather_rows" in res.stdout and "0 failed" in res.stdout
    for backend in ("reference", "cpu", "tilelang", "triton"):
        assert f"gather_rows          {backend:<10} ok" in res.stdout, res.stdout


def test_bad_usage_exits_2_without_traceback():
    res = _epkit("no-such-command")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    res = _epkit("selfcheck", "--backend", "nope")
    assert res.returncode != 0
    assert "Traceback" not in res.stderr


# Optional frameworks: a meta-path blocker makes `import triton` / `import tilelang` fail
# exactly as if the packages had been uninstalled.
_BLOCK = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
        return None
sys.meta_path.insert(0, Block())
"""


@pytest.mark.parametrize("blocked", [("triton",), ("tilelang",), ("triton", "tilelang")])
def test_missing_framework_leaves_cpu_working(blocked):
    code = (
        _BLOCK.format(blocked=set(blocked))
        + f"""
import torch, epkit
from epkit.backends import BackendUnavailableError
x = torch.arange(12.).view(4, 3)
i = torch.tensor([3, -1, 0], dtype=torch.int32)
assert torch.equal(epkit.gather_rows(x, i), epkit.gather_rows(x, i, backend="reference"))
for b in {blocked!r}:
    try:
        epkit.gather_rows(x, i, backend=b)
    except BackendUnavailableError as e:
        assert "not installed" in str(e) and "pip install" in str(e), str(e)
        print("clear error:", e)
    else:
        raise SystemExit(f"{{b}} should be unavailable")
from epkit.cli import main
assert main(["info"]) == 0
assert main(["selfcheck"]) == 0
"""
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("clear error:") == len(blocked)
    assert "is not installed" in res.stdout
