"""epkit's one logger: silent by default, ``EPKIT_LOG=info|debug`` prints on stderr; and ``py.typed`` ships."""

import importlib.resources
import logging
import os
import subprocess
import sys

import pytest
import torch

from epkit import log
from epkit.backends import select

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two calls with EPKIT_BACKEND forcing the backend: one "forced" record (info), one resolution per call (debug).
_CALLS = """
import torch, epkit
x, i = torch.arange(6.0).view(3, 2), torch.tensor([2, -1], dtype=torch.int32)
epkit.gather_rows(x, i)
epkit.gather_rows(x, i)
print("done")
"""


def _run(level: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EPKIT_LOG"}
    env["EPKIT_BACKEND"] = "reference"
    if level is not None:
        env["EPKIT_LOG"] = level
    return subprocess.run(
        [sys.executable, "-c", _CALLS], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


def test_silent_by_default():
    res = _run(None)
    assert res.returncode == 0 and res.stdout.strip() == "done", res.stderr
    assert res.stderr == "", res.stderr


def test_info_prints_the_forced_backend_once():
    res = _run("info")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines == ["epkit INFO epkit.backends: EPKIT_BACKEND=reference forces gather_rows on cpu tensors to the "
                     "reference backend"], lines  # fmt: skip


def test_debug_adds_every_backend_resolution():
    res = _run("DEBUG")
    assert res.returncode == 0, res.stderr
    debug = [line for line in res.stderr.splitlines() if line.startswith("epkit DEBUG")]
    assert debug == ["epkit DEBUG epkit.backends: gather_rows on cpu tensors: backend auto -> reference"] * 2, debug
    assert res.stdout.strip() == "done"  # nothing on stdout


@pytest.fixture
def restore_logger():
    before = (log.logger.level, list(log.logger.handlers))
    yield
    log.logger.setLevel(before[0])
    log.logger.handlers[:] = before[1]


def test_configure_replaces_its_handler_and_off_silences(restore_logger):
    stderr_handlers = lambda: [h for h in log.logger.handlers if isinstance(h, logging.StreamHandler)]  # noqa: E731
    assert any(isinstance(h, logging.NullHandler) for h in log.logger.handlers)
    log.configure("debug")
    log.configure("info")
    assert len(stderr_handlers()) == 1 and log.logger.level == logging.INFO
    log.configure("off")
    assert stderr_handlers() == [] and log.logger.level == logging.NOTSET
    with pytest.raises(ValueError, match="log level must be one of"):
        log.configure("loud")


def test_unknown_env_value_warns_and_names_the_variable(monkeypatch, restore_logger, capsys):
    monkeypatch.setenv("EPKIT_LOG", "loud")
    log.configure_from_env()
    assert log.logger.level == logging.WARNING
    err = capsys.readouterr().err
    assert "EPKIT_LOG=loud is not one of" in err, err


def test_records_reach_an_application_that_configures_logging(caplog, monkeypatch, restore_logger):
    monkeypatch.delenv("EPKIT_BACKEND", raising=False)
    with caplog.at_level(logging.DEBUG, logger="epkit"):
        select("gather_rows", torch.device("cpu"))
    assert [r.name for r in caplog.records] == ["epkit.backends"]
    assert "gather_rows on cpu tensors: backend auto -> cpu" in caplog.text


def test_py_typed_ships():
    assert importlib.resources.files("epkit").joinpath("py.typed").is_file()
