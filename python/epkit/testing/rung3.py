"""Rung 3's command line: ``python -m epkit.testing.rung3 compile | sweep | warm``.

- ``compile RECORDS.json``: every entry (``epkit.testing.launches``) compiled for sm_90 under the Triton this
  Python finds (``PYTHONPATH`` may put another version first), one JSON summary; ``--whole PATH`` also keeps
  the compiles themselves, PTX and SASS included (``launches.save_compiled``);
- ``sweep RECORDS.json --tritons 3.6.0,3.7.1,3.9.0``: ``compile`` under each version, each in its own process
  (a version other than this environment's installed once with ``pip install --target``), this environment's
  own first; fails on any failed compile or spill. ``scripts/test.sh`` runs it before pytest with ``--keep``,
  and pytest's rung-3 tests load the compiles it kept of their Triton (:func:`whole_path`) instead of compiling
  them again;
- ``record RECORDS.json``: every launch recorded (``epkit.testing.launch_shapes.record_all``);
- ``warm``: the launches at the GPU run's sizes compiled into Triton's cache, timed (``bench/gpu_run.sh``'s warm
  step: the checks' first launches then load binaries instead of compiling, and the compile seconds are
  reported apart from the measurements).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from epkit.testing.launches import compile_all, load, save_compiled

__all__ = ["main", "sweep", "whole_path"]


def _install(version: str, into: str) -> str:
    """``into/triton-<version>``, with that Triton installed there (``pip install --target``) if it is not yet."""
    where = os.path.join(into, f"triton-{version}")
    if not os.path.isdir(os.path.join(where, "triton")):
        print(f"installing triton=={version} into {where} (once)", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
               "--target", where, f"triton=={version}"]  # fmt: skip
        subprocess.run(cmd, check=True, timeout=1800)
    return where


def whole_path(keep: str, version: str) -> str:
    """Where ``sweep`` keeps the compiles of one Triton version whole in its ``keep`` folder."""
    return os.path.join(keep, f"triton-{version}.whole.json.gz")


def sweep(records: str, versions: list[str], into: str, jobs: int, keep: str | None = None) -> list[dict]:
    """Compile ``records`` under each Triton of ``versions`` (installed under ``into``, but for this environment's
    own), each in a process that finds that Triton first; returns each run's summary (``compile``'s JSON, with
    the version it ran under), which ``keep``, a folder, also holds as ``triton-<version>.json``, beside the
    compiles themselves (:func:`whole_path`). This environment's own version runs first, so that its compiles
    (the ones pytest loads) are kept even when installing another version fails."""
    import triton

    out = []
    for version in sorted(versions, key=lambda v: v != triton.__version__):
        env = dict(os.environ)
        if version != triton.__version__:  # this environment's own Triton needs no side install
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [_install(version, into), env.get("PYTHONPATH")]))
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            path = os.path.join(keep, f"triton-{version}.json") if keep else f.name
            cmd = [sys.executable, "-m", "epkit.testing.rung3", "compile", records, "--jobs", str(jobs),
                   "--out", path, *(["--whole", whole_path(keep, version)] if keep else [])]  # fmt: skip
            subprocess.run(cmd, env=env, timeout=3600)
            with open(path) as g:
                text = g.read()
        doc = json.loads(text) if text else {"triton": version, "failed": -1, "results": []}
        if doc["triton"] != version:
            raise RuntimeError(f"asked for Triton {version}, the compile ran under {doc['triton']}")
        out.append(doc)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m epkit.testing.rung3",
        description="Compile recorded kernel launches for sm_90 as Triton's JIT would (no GPU needed).",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile every entry of a records file under this Python's Triton")
    c.add_argument("records")
    c.add_argument("--jobs", type=int, default=1)
    c.add_argument("--out", help="write the JSON summary here instead of stdout")
    c.add_argument("--whole", help="also keep the compiles themselves here (gzip'd JSON, PTX and SASS included)")
    w = sub.add_parser("sweep", help="compile a records file under other Triton versions, one process each")
    w.add_argument("records")
    w.add_argument("--tritons", required=True, help="comma-separated versions, e.g. 3.6.0,3.7.1")
    w.add_argument("--into", default=".venv/tritons", help="where each version is installed (once)")
    w.add_argument("--jobs", type=int, default=2)
    w.add_argument("--keep", help="a folder for each summary and its compiles (triton-<version>.json, .whole.json.gz)")
    r = sub.add_parser("record", help="record every launch (launch_shapes.record_all) into a records file")
    r.add_argument("out")
    m = sub.add_parser("warm", help="compile the launches at the GPU run's sizes into Triton's cache, timed")
    m.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    m.add_argument("--out", help="write the JSON summary here as well")
    args = parser.parse_args(argv)
    if args.cmd == "warm":
        return _warm(args.jobs, args.out)
    if args.cmd == "record":
        return _record(args.out)
    if not os.path.exists(args.records):
        print(f"no records at {args.records}: make them with the record command", file=sys.stderr)
        return 2
    if args.cmd == "sweep":
        bad = 0
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
        for doc in sweep(args.records, args.tritons.split(","), args.into, args.jobs, args.keep):
            print(f"triton {doc['triton']}: {doc.get('entries', 0)} launches, {doc.get('compiled', 0)} compiles in "
                  f"{doc.get('seconds', 0)} s: {doc['failed']} failed, {doc.get('spilled', 0)} spilled")  # fmt: skip
            for r in doc["results"]:
                if r["error"] or r["spills"]:
                    print(f"  {r['kernel']} at {r['where'][:2]}: {_why(r)}")
                elif r.get("spilled_bytes"):
                    print(f"  note: {r['kernel']} at {r['where'][:1]}: {r['spilled_bytes']} B of registers parked on "
                          f"the stack ({r['registers']} registers), within the allowance")  # fmt: skip
            bad += doc["failed"] != 0 or doc.get("spilled", 0) != 0
        return 1 if bad else 0
    doc = _compiled(load(args.records), args.jobs, args.whole)
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0 if doc["failed"] == 0 else 1


def _compiled(entries: list[dict], jobs: int, whole: str | None = None) -> dict:
    """:func:`compile_all` of ``entries``, timed and counted (the JSON ``compile`` and ``warm`` write); ``whole``,
    a path, also gets the compiles themselves (:func:`epkit.testing.launches.save_compiled`)."""
    import triton

    start = time.perf_counter()
    kept: dict = {}
    results = compile_all(entries, jobs, kept if whole else None)
    seconds = round(time.perf_counter() - start, 1)
    if whole:
        save_compiled(kept, whole)
    return {
        "triton": triton.__version__,
        "seconds": seconds,
        "entries": sum(r["entries"] for r in results),
        "compiled": len(results),
        "failed": sum(r["error"] is not None for r in results),
        "spilled": sum(bool(r["spills"]) for r in results),
        "results": results,
    }


def _warm(jobs: int, out: str | None) -> int:
    """Compile every launcher's launch at the GPU run's sizes (``launch_shapes.record_target_shapes``) for
    sm_90 through Triton's JIT, which stores each binary in Triton's cache: a GPU run's first launches at
    these specializations then load it instead of compiling. Prints the seconds (the compile time a GPU run
    reports apart from its measurements) and one line per failure."""
    from epkit.testing.launch_shapes import record_target_shapes

    start = time.perf_counter()
    entries = record_target_shapes()
    recorded = time.perf_counter() - start
    doc = _compiled(entries, jobs)
    doc["record_seconds"] = round(recorded, 1)
    print(f"warm: triton {doc['triton']}: {doc['compiled']} kernels compiled in {doc['seconds']} s ({jobs} jobs; "
          f"{doc['record_seconds']} s recording): {doc['failed']} failed, {doc['spilled']} spilled")  # fmt: skip
    for r in doc["results"]:
        if r["error"] or r["spills"]:
            print(f"  {r['kernel']} at {r['where'][:2]}: {_why(r)}")
    if out:
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if doc["failed"] == 0 else 1


def _record(out: str) -> int:
    """Every launch rung 3 compiles (:func:`epkit.testing.launch_shapes.record_all`: the rank runs on 1, 2, 4 and
    8 CPU ranks, the ops, the target shapes) into ``out``, with a count per kernel."""
    from epkit.testing.launch_shapes import record_all
    from epkit.testing.launches import save

    start = time.perf_counter()
    entries = record_all()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save(entries, out)
    kernels: dict[str, int] = {}
    for e in entries:
        kernels[e["kernel"].split(":")[1]] = kernels.get(e["kernel"].split(":")[1], 0) + 1
    print(f"record: {len(entries)} launches of {len(kernels)} kernels in {time.perf_counter() - start:.1f} s -> {out}")
    print("  " + ", ".join(f"{k} {n}" for k, n in sorted(kernels.items())))
    return 0


def _why(result: dict) -> str:
    """What is wrong with one compile summary: its error, or the bytes it spilled."""
    return result["error"] or f"{result['spilled_bytes']} B spilled"


if __name__ == "__main__":
    sys.exit(main())
