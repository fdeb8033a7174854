"""The C++ build says what it is doing: ``setup.py`` prints ``epkit build: [k/n] compiling csrc/x.cpp`` as each
source starts (scripts/setup.sh shows these lines; the real compile takes about a minute on 2 cores).

Run with a stand-in compiler that writes empty objects, so the test takes a second and leaves the source tree
and the installed extension alone (everything is built under tmp_path).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_FAKE_CC = """#!/bin/sh
# writes an empty file where -o says, compiles nothing
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
[ -n "$out" ] && mkdir -p "$(dirname "$out")" && : > "$out"
exit 0
"""


def test_the_cpp_build_says_which_source_it_compiles(tmp_path):
    cc = tmp_path / "cc"
    cc.write_text(_FAKE_CC)
    cc.chmod(0o755)
    env = dict(os.environ, EPKIT_CUDA="0", CC=str(cc), CXX=str(cc))
    env.update(LDSHARED=f"{cc} -shared", LDCXXSHARED=f"{cc} -shared")
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(tmp_path / "t")]
    cmd += ["--build-lib", str(tmp_path / "lib")]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    sources = sorted(p.name for p in (ROOT / "csrc").glob("*.cpp"))
    lines = re.findall(r"^epkit build: \[(\d+)/(\d+)\] compiling csrc/(\S+\.cpp)$", res.stderr, re.M)
    assert sorted(name for _, _, name in lines) == sources, res.stderr
    assert sorted(int(k) for k, _, _ in lines) == list(range(1, len(sources) + 1)), res.stderr
    assert {int(n) for _, n, _ in lines} == {len(sources)}, res.stderr
