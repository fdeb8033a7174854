"""The README as a newcomer reads it: its Python blocks run as written, its commands do what it says.

Each fenced block is handled by its language: ``python`` blocks are executed (a block that says it is run by
``torchrun`` is run on as many ranks as its torchrun line asks, with the environment torchrun gives them, under
``epkit.testing.run_ranks``); every ``bash`` line must match one of the rules in ``_COMMANDS``, which says how
it is checked here; blocks without a language are text (the layout tree). A new block or command line that no
rule covers fails ``test_every_block_is_covered``.
"""

import contextlib
import io
import os
import pathlib
import re
import subprocess
import sys
from datetime import timedelta

import pytest

from epkit.testing.multiprocess import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def _readme() -> str:
    with open(README) as f:
        return f.read()


def _blocks() -> list[tuple[str, str, int]]:
    """``(language, text, first line number)`` of every fenced block of the README."""
    text = _readme()
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M):
        out.append((m.group(1), m.group(2), text[: m.start()].count("\n") + 1))
    return out


def _python_blocks() -> tuple[str, str]:
    blocks = [code for lang, code, _ in _blocks() if lang == "python"]
    single = [c for c in blocks if "torchrun" not in c]
    multi = [c for c in blocks if "torchrun" in c]
    assert len(single) == 1 and len(multi) == 1, "expected one single-process and one torchrun block"
    return single[0], multi[0]


def _shell_lines(code: str) -> list[str]:
    return [line.split("#")[0].strip() for line in code.splitlines() if line.split("#")[0].strip()]


# How each command line of a bash block is checked here (pattern -> what the test does).
_COMMANDS = {
    r"bash scripts/(run|test)\.sh": "the script exists and parses (bash -n); CI runs test.sh itself (.ci/run)",
    r"\.venv/bin/(epkit|torchrun --nproc-per-node \d+ -m epkit) run( --[\w-]+( \S+)?)*": "parsed by epkit run's "
    "parser (test_model_commands_parse_as_written); the runs themselves are tests/test_run.py (1-4 ranks, cp, tbo; "
    "under torchrun: test_under_torchrun_every_process_is_a_rank)",
    r"python -m venv \.venv && \. \.venv/bin/activate": "GPU machine set-up: not run here",
    r"pip install .*": "GPU machine set-up: pins and extras checked against pyproject.toml",
    r"epkit info": "tests/test_cli.py runs it",
    r"python -m pytest -q": "the suite itself",
    r"python bench/gpu_check\.py": "needs a GPU (tests/test_gpu_check_script.py covers its CPU dry run)",
}


def _rule(line: str) -> str | None:
    return next((pat for pat in _COMMANDS if re.fullmatch(pat, line)), None)


def test_every_block_is_covered():
    langs = [lang for lang, _, _ in _blocks()]
    assert set(langs) <= {"python", "bash", ""}, langs
    _python_blocks()
    for lang, code, line in _blocks():
        if lang == "bash":
            for cmd in _shell_lines(code):
                assert _rule(cmd), f"README.md:{line}: no rule in tests/test_readme.py checks {cmd!r}"


def test_single_process_block_runs_as_written(tmp_path):
    single, _ = _python_blocks()
    res = subprocess.run([sys.executable, "-c", single], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert res.returncode == 0, res.stderr


def _as_torchrun_rank(rank, world_size, code, port):
    """One rank of ``torchrun --nproc-per-node world_size``: its environment, then the script as __main__."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # as under torchrun, whose agent hosts the store: every rank joins it as a client
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md (moe_layer.py)", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def test_torchrun_block_runs_on_the_ranks_its_torchrun_line_asks_for():
    import torch.distributed as dist

    _, multi = _python_blocks()
    found = re.search(r"torchrun --nproc-per-node (\d+) (\S+\.py)", multi)
    assert found and multi.startswith(f"# {found.group(2)}"), (
        "the block must start with its file name and torchrun line"
    )
    world = int(found.group(1))
    # the store torchrun's agent would host, on a port the OS picks
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=120), wait_for_workers=False)
    outs = run_ranks(_as_torchrun_rank, world, multi, store.port, init_dist=False, timeout=120)
    for rank, out in enumerate(outs):
        assert out.strip() == f"rank {rank}: out (64, 512) torch.bfloat16", out


def test_bash_scripts_parse_and_ci_runs_the_test_command():
    for script in ("scripts/run.sh", "scripts/test.sh", "scripts/setup.sh"):
        res = subprocess.run(["bash", "-n", script], capture_output=True, text=True, cwd=ROOT, timeout=30)
        assert res.returncode == 0, res.stderr
    with open(os.path.join(ROOT, ".ci/run")) as f:
        commands = [line for line in f.read().splitlines() if line.strip() and not line.startswith(("#", "set "))]
    assert commands[-1] == "bash scripts/test.sh", commands


def test_model_commands_parse_as_written():
    # every `epkit run ...` line of the README is accepted by the command's parser
    import shlex

    from epkit.model.run import build_parser

    lines = [c for lang, code, _ in _blocks() if lang == "bash" for c in _shell_lines(code)]
    runs = [c for c in lines if re.search(r"epkit run ", c)]
    assert len(runs) >= 3, runs
    for line in runs:
        words = shlex.split(line.split("#")[0])
        start = words.index("run") + 1
        try:
            a = build_parser().parse_args(words[start:])
        except SystemExit:
            pytest.fail(f"README's {line!r} does not parse")
        assert a.ranks is not None, line  # every example says how many ranks


def test_gpu_setup_lines_match_pyproject():
    try:
        import tomllib
    except ImportError:  # Python 3.10: the TOML reader pip vendors
        from pip._vendor import tomli as tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    extras = set(meta["project"]["optional-dependencies"])
    pins = set(meta["build-system"]["requires"])
    installs = [code for lang, code, _ in _blocks() if lang == "bash" and "pip install" in code]
    assert len(installs) == 2, installs  # the Install section's, and the GPU machine's from a clone
    for line in (line for code in installs for line in _shell_lines(code)):
        for group in re.findall(r"(?:\.|epkit)\[([\w,]+)\]", line):
            assert set(group.split(",")) <= extras, line
        for pin in re.findall(r"\b[\w-]+==[\d.]+", line):
            assert pin in pins, f"{pin} in the README is not pyproject.toml's build requirement"
    assert os.path.exists(os.path.join(ROOT, "bench/gpu_check.py"))


def test_plan_example_prints_what_the_readme_lists(capsys):
    from epkit.cli import main

    assert "bash scripts/run.sh plan --model v4.1-flash --dp 64 --ep 64" in _readme()
    assert main(["plan", "--model", "v4.1-flash", "--dp", "64", "--ep", "64"]) == 0
    out = capsys.readouterr().out.lower()
    for what in ("expert", "memory", "dispatch", "combine"):
        assert what in out, what


def test_kernel_check_prints_what_the_readme_says():
    cmd = "python bench/kernel_check.py gather --backend triton"
    assert f"`{cmd}`" in _readme()
    res = subprocess.run([sys.executable, *cmd.split()[1:]], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    # the README: the self-check against the reference, then latency and GB/s next to a torch peer,
    # the Triton interpreter's time labelled as such on CPU
    assert "matches the reference" in out, out
    assert re.search(r"gather_rows\[triton\]:\s+[\d.]+ ms\s+[\d.]+ GB/s", out), out
    assert "torch.index_select" in out, out
    assert "Triton interpreter time" in out, out


# A clone folder named `epkit` in the working directory, as when Python starts in the clone's parent.
_SHADOW = """
import importlib, sys
editable = [f for f in sys.meta_path if getattr(f, "__module__", "").startswith("__editable___epkit_")]
assert editable, "this test needs epkit's editable install (scripts/setup.sh, or pip install -e .)"
def fresh():
    for name in [m for m in sys.modules if m == "epkit" or m.startswith("epkit.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    import epkit
    return hasattr(epkit, "gather_rows")
sys.meta_path[:] = [f for f in sys.meta_path if f not in editable] + editable  # as setuptools installs it
print("without the .pth:", fresh())
exec(open(sys.argv[1]).read())  # the line scripts/epkit-finder-first.pth gives site.py
print("with the .pth:", fresh())
"""


def test_clone_parent_directory_does_not_shadow_the_install(tmp_path):
    (tmp_path / "epkit" / "python").mkdir(parents=True)  # the clone's folder, seen from its parent
    pth = os.path.join(ROOT, "scripts", "epkit-finder-first.pth")
    res = subprocess.run(
        [sys.executable, "-c", _SHADOW, pth], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["without the .pth: False", "with the .pth: True"], res.stdout
    stamp = pathlib.Path(ROOT, ".venv", ".epkit-install-stamp")
    made_by_setup_sh = sys.prefix == os.path.join(ROOT, ".venv") and stamp.exists()
    if made_by_setup_sh and "deps=" in stamp.read_text():  # this scripts/setup.sh (its stamp format) made it
        res = subprocess.run(
            [sys.executable, "-c", "import epkit; print(epkit.gather_rows.__name__)"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        fix = "bash scripts/setup.sh installs scripts/epkit-finder-first.pth into .venv"
        assert res.returncode == 0 and res.stdout.strip() == "gather_rows", f"{fix}; {res.stderr}"
