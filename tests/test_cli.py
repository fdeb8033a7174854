"""The epkit command line, run as a user would run it."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import epkit
from epkit.backends import registered_ops
from epkit.cli import EXIT_BROKEN_PIPE, build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _epkit(*args, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "epkit", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_info_reports_backends_and_no_gpu():
    res = _epkit("info")
    assert res.returncode == 0, res.stderr
    assert "backends:" in res.stdout and "gather_rows" in res.stdout
    assert "drop-in epkit.compat.deep_gemm" in res.stdout and "not yet provided by epkit" in res.stdout
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
    dg = info["compat"]["deep_gemm"]  # the drop-in's coverage: provided, not yet, out of scope
    assert {"fp8_gemm_nt", "m_grouped_fp8_gemm_nt_masked", "set_num_sms", "bf16_gemm_tn", "einsum"} <= set(
        dg["provided"]
    )
    assert {"fp8_fp4_mega_moe", "get_symm_buffer_for_mega_moe", "init_dist"} <= set(dg["provided"])
    assert any("torch fallback" in path for path in dg["paths"].values())  # where the GEMMs compute
    assert {"fp8_mqa_logits", "tf32_hc_prenorm_gemm"} <= set(dg["out_of_scope"])
    assert not set(dg["provided"]) & set(dg["not_yet_provided"]) and "sm_100" in dg["install_for_the_rest"]


def test_selfcheck_runs_every_cpu_backend_in_aligned_columns():
    res = _epkit("selfcheck")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gather_rows" in res.stdout and "0 failed" in res.stdout
    rows = [line for line in res.stdout.splitlines() if line.startswith("  ")]
    for backend in ("reference", "cpu", "tilelang", "triton"):
        assert any(re.fullmatch(rf"  gather_rows +{backend} +ok \(.*\)", r) for r in rows), res.stdout
    # the backend and status columns start at the same offset on every row, long op names included
    longest = max(registered_ops(), key=len)
    assert any(r.split()[0] == longest for r in rows)
    starts = {re.match(r"  \S+ +", r).end() for r in rows}
    assert len(starts) == 1, rows
    assert len({r.index(" ok (") for r in rows if " ok (" in r}) == 1, rows


def test_version():
    res = _epkit("--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"epkit {epkit.__version__}"


@pytest.mark.parametrize(
    "args",
    [
        ("info", "--json"),
        ("selfcheck", "--backend", "reference", "--json"),
        ("plan", "--dp", "8", "--json"),
        ("bench", "--quick", "--only", "experts", "--json"),  # a few seconds; tests/test_bench.py has the rest
        ("run", "--dry-run", "--preset", "v4.1-flash", "--ranks", "64", "--json"),  # the model runs in test_run.py
    ],
)
def test_every_subcommand_prints_one_json_document(args, capsys):
    commands = next(a.choices for a in build_parser()._actions if isinstance(a.choices, dict))
    assert set(commands) == {"info", "selfcheck", "plan", "bench", "run"}, "a new subcommand needs its --json case here"
    assert main(list(args)) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)  # the whole of stdout is the document
    if args[0] == "selfcheck":
        assert doc["failed"] == 0 and doc["passed"] == len(doc["checks"]) > 0
        assert {c["backend"] for c in doc["checks"]} == {"reference"}
        assert {"op", "backend", "status", "seconds", "detail"} <= set(doc["checks"][0])
    if args[0] == "run":
        assert doc["layout"]["world"] == 64 and doc["ledger"], doc


def test_help_shows_examples(capsys):
    for argv in ([], ["info"], ["selfcheck"], ["plan"], ["bench"], ["bench", "compare"], ["bench", "plot"], ["run"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert "examples:" in out and "epkit " in out.split("examples:")[1], argv


def test_closed_pipe_ends_quietly():
    """``epkit plan --json | head -1``: the reader goes away before the writer is done."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "epkit", "plan", "--dp", "8", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    proc.stdout.close()  # before the interpreter has even imported epkit: its first write finds no reader
    try:
        err = proc.stderr.read().decode()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_BROKEN_PIPE, err
    assert err == "", err


@pytest.mark.parametrize("module,args", [("epkit", ["--version"]), ("epkit", ["run", "--help"])])
def test_no_runpy_warning(module, args):
    res = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr


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


# torch uninstalled, as far as this interpreter can tell: the site-packages that hold it (and numpy) leave
# sys.path; epkit itself is still found (its editable install's finder, or the source tree).
_NO_TORCH = """
import io, sys, sysconfig, contextlib
site = sysconfig.get_paths()["purelib"]
sys.path[:] = [p for p in sys.path if not p.startswith(site)]
try:
    import torch
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("torch still imports: the test's emulation is broken")
import epkit
from epkit.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0, e.code
print("version:", out.getvalue().strip())
for argv in (["info"], ["selfcheck"], ["plan", "--dp", "8"], ["bench", "--quick"], ["run", "--ranks", "2"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(argv)
    print("status", argv[0], status, repr(err.getvalue()))
try:
    epkit.EPBuffer
except ModuleNotFoundError as e:
    print("attribute:", e)
"""


def test_without_torch_the_version_prints_and_every_command_says_what_to_install():
    res = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stdout.splitlines()
    assert f"version: epkit {epkit.__version__}" in lines
    statuses = [line for line in lines if line.startswith("status ")]
    assert len(statuses) == 5, lines
    for line in statuses:
        _, command, status, err = line.split(" ", 3)
        assert status == "1", line
        message = ast.literal_eval(err)  # the repr printed above
        assert message.count("\n") == 1 and message.endswith("\n"), line  # one line
        assert f"epkit {command}: error: epkit needs torch" in message, line
        assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in message, line
    assert any(line.startswith("attribute: epkit.EPBuffer: epkit needs torch") for line in lines), lines
