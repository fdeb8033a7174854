"""What a user's ``pip install`` gets: each torch epkit is tested beside, with ``epkit[kernels,cuda13]``, resolves
against the public index alone (no local wheels, no pip or uv configuration), to the Triton and NVSHMEM wheel that
``[tool.epkit]`` in pyproject.toml records for it, and to epkit's own version (``epkit.__version__``, held by a
constraint); ``epkit[cpu,kernels]`` resolves on its own.

Resolution only, for this interpreter (``uv pip compile --python``): nothing is installed. uv reads only each
wheel's metadata; ``pip install --dry-run``, which resolves to the same pins, downloads every wheel where the index
serves no separate metadata files (~3 GB per torch: a minute of this suite's time, measured here). The four
resolutions run side by side. Skipped, saying so, only when the index cannot be reached from here or uv (the
``dev`` extra) is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: the TOML reader pip vendors
    from pip._vendor import tomli as tomllib
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import epkit

ROOT = Path(__file__).resolve().parent.parent
INDEX = "https://pypi.org/simple"
TESTED = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["epkit"]["tested"]


def _clean_env(home: Path) -> dict[str, str]:
    """No configuration (no PIP_* or UV_* variable: no local wheels; ``--no-config`` on the command line), only what
    reaching the index needs: the PATH, a certificate bundle and proxies if this machine has them."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    cert = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    if cert:
        env["SSL_CERT_FILE"] = cert
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def _index_unreachable() -> str | None:
    import ssl

    cert = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    context = ssl.create_default_context(cafile=cert) if cert else ssl.create_default_context()
    try:
        with urllib.request.urlopen(f"{INDEX}/triton/", timeout=20, context=context) as res:
            res.read(1)
    except OSError as exc:
        return f"the public index {INDEX} cannot be reached from here ({exc}); resolution not checked"
    return None


def _resolve(home: Path, name: str, reqs: list[str]) -> dict[str, str]:
    """{distribution: version} a resolution of ``reqs`` (and epkit at ``epkit.__version__``) for this interpreter
    pins, from the public index alone; ``{"error": ...}`` when there is none."""
    job = home / name
    job.mkdir()
    (job / "requirements.in").write_text("\n".join(reqs) + "\n")
    (job / "constraints.txt").write_text(f"epkit=={epkit.__version__}\n")  # the local project's metadata version
    cmd = [sys.executable, "-m", "uv", "pip", "compile", "--no-config", "--quiet", "--no-header", "--no-annotate"]
    cmd += ["--python", sys.executable, "--index-url", INDEX, "--cache-dir", str(home / "cache")]
    cmd += ["--constraint", "constraints.txt", "requirements.in"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_clean_env(home), cwd=job)
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-12:])
        return {"error": f"{' '.join(reqs)}: uv exited {res.returncode}\n{tail}"}
    pins = [line.split("==") for line in res.stdout.splitlines() if "==" in line and not line.startswith("#")]
    return {dist.strip().lower(): version.split(";")[0].strip() for dist, version in pins}


def test_each_tested_torch_resolves_with_epkit_from_the_public_index(tmp_path):
    if importlib.util.find_spec("uv") is None:
        pytest.skip("uv is not installed (epkit's dev extra: pip install -e '.[dev]'); resolution not checked")
    why = _index_unreachable()
    if why:
        pytest.skip(why)
    jobs = {f"torch-{t['torch']}": [f"torch=={t['torch']}", f"{ROOT}[kernels,cuda13]"] for t in TESTED}
    jobs["cpu-kernels"] = [f"{ROOT}[cpu,kernels]"]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(_resolve, tmp_path, name, reqs) for name, reqs in jobs.items()}
        got = {name: f.result() for name, f in futures.items()}
    errors = [r["error"] for r in got.values() if "error" in r]
    assert not errors, "\n\n".join(errors)
    for tested in TESTED:
        resolved = got[f"torch-{tested['torch']}"]
        want = {"torch": tested["torch"], "triton": tested["triton"], "nvidia-nvshmem-cu13": tested["nvshmem-cu13"]}
        assert {name: resolved.get(name) for name in want} == want, resolved
    assert {"torch", "triton"} <= set(got["cpu-kernels"]), got["cpu-kernels"]


def test_the_version_is_written_once():
    """``epkit.__version__`` is the one place: pyproject.toml takes it from there (``dynamic``), setup.py names none."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "epkit.__version__"}
    assert "version=" not in (ROOT / "setup.py").read_text().replace(" ", "")
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]


def test_one_tested_torch_is_the_one_ci_runs_beside():
    (ci,) = [t for t in TESTED if t.get("ci")]
    import torch

    triton = pytest.importorskip("triton", reason="Triton is not installed (the kernels extra): nothing to compare")

    assert torch.__version__.split("+")[0] == ci["torch"], torch.__version__
    assert triton.__version__ == ci["triton"], triton.__version__
