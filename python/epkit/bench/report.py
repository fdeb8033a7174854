"""The report of an ``epkit bench`` run: one Markdown table (a row per contender, each with its roof or peer
and the ratio to it), the facts of the machine and the threads used (and why) above it, a legend of its
columns below it, and the JSON document."""

from __future__ import annotations

import json
import os

__all__ = [
    "COLUMNS",
    "LEGEND",
    "fmt_ms",
    "markdown_report",
    "markdown_table",
    "summary_line",
    "threads_line",
    "write_json",
]

COLUMNS = (
    "op",
    "shape",
    "backend",
    "median (min-max)",
    "throughput",
    "% of roof",
    "roof",
    "x vs peer",
    "peer",
    "notes",
)

#: What the table's columns mean (printed under it); ``make_row`` in ``epkit.bench.core`` computes them.
LEGEND = """legend:
- median (min-max): milliseconds per call, the median over the rounds with the fastest and slowest round
  (each round calls every contender once; a multi-rank row takes each round's slowest rank)
- throughput: the row's work per second at its median (bytes read + written, FLOPs or tokens)
- % of roof: the row's throughput / the roof's at the roof's fastest round, median over the rounds;
  roof: what bounds the op on this machine (a copy_ of the same bytes, a dense matmul of the same FLOPs)
- x vs peer: the peer's time / this row's time in the same round, median over the rounds
  (> 1: epkit faster than the peer, < 1: slower); peer: another implementation of the same task
- notes: the row's further peers, in the same form (2x name: epkit twice as fast), and facts of the case
"""


def fmt_ms(ms: float) -> str:
    """Milliseconds in the unit that keeps three figures (``812 us``, ``12.3 ms``, ``1.52 s``)."""
    if ms >= 1000:
        return f"{ms / 1000:.3g} s"
    if ms >= 1:
        return f"{ms:.3g} ms"
    return f"{ms * 1000:.3g} us"


def _cells(r: dict) -> list[str]:
    roof, peers = r.get("roof"), r.get("peers") or []
    notes = [f"{p['median']:.3g}x {p['name']}" for p in peers[1:]]
    if r.get("note"):
        notes.append(r["note"])
    return [
        r["op"],
        r["shape"],
        r["backend"],
        f"{fmt_ms(r['median_ms'])} ({fmt_ms(r['min_ms'])}-{fmt_ms(r['max_ms'])})",
        f"{r['throughput']:.3g} {r['unit']}",
        f"{100 * roof['median']:.0f}%" if roof else "-",
        roof["name"] if roof else "-",
        f"{peers[0]['median']:.3g}x" if peers else "-",
        peers[0]["name"] if peers else "-",
        "; ".join(notes),
    ]


def markdown_table(rows: list[dict]) -> str:
    """The rows as one GitHub Markdown table (``x vs peer`` > 1: faster than the peer)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |")
    return "\n".join(lines) + "\n"


def summary_line(doc: dict) -> str:
    """Where and what ran, on one line: machine kind, CPU, GPU, load before -> after, commit, seconds."""
    m = doc["machine"]
    git = m.get("git") or {}
    commit = (git.get("commit") or "no git")[:10] + ("+dirty" if git.get("dirty") else "")
    gpu = f", {m['gpu']['name']}" if m.get("gpu") else ""
    load = f"load {_load(m.get('loadavg_before'))} -> {_load(m.get('loadavg_after'))}"
    return (
        f"{m['kind']}: {m['cpu_model']}, {m['cores']} cores ({_threads(m.get('torch_threads'))}){gpu}; "
        f"torch {m['versions'].get('torch')}; "
        f"{load}; {doc['args']['size']} run, {doc.get('elapsed_s', 0):.0f} s; commit {commit}"
    )


def threads_line(doc: dict) -> str:
    """How many torch threads the run used and why (``--threads``, or ``auto``'s load average), on one line;
    a warning on it when several threads ran on a machine whose load average exceeded half its cores."""
    m, choice = doc["machine"], doc["args"].get("threads")
    n = m.get("torch_threads") or 1
    if not choice:  # a document of a run that did not choose (gpu_check's section, an older run)
        line = f"threads: {_threads(n)} in process"
    elif choice["pinned"]:
        n = choice["threads"]
        line = f"threads: {n} per rank ({choice['why']})"
    else:
        n, why = choice["threads"], choice["why"]
        line = f"threads: torch's default, {n} in process, cores // ranks per spawned rank ({why})"
    load, cores = m.get("loadavg_before"), m.get("cores") or 1
    if m.get("device", "cpu") == "cpu" and n > 1 and load and load[0] > cores / 2:
        line += (
            f"; the load average ({load[0]:.2f}) exceeds half the cores: ops split over threads wait on other "
            "jobs, so their ratios are noise (--threads auto or 1)"
        )
    return line


def _threads(n) -> str:
    return f"{n} torch thread" + ("" if n == 1 else "s")


def _load(v) -> str:
    return "/".join(f"{x:.2f}" for x in v) if v else "n/a"


def markdown_report(doc: dict) -> str:
    """Heading, machine line, the table, then what did not run or failed its check."""
    out = [f"# epkit bench: {doc['machine']['kind']}", "", summary_line(doc), "", threads_line(doc), ""]
    out += [markdown_table(doc["rows"]), LEGEND]
    bad = {n: f for n, f in doc["families"].items() if f["status"] != "ok"}
    failed = [c for c in doc["checks"] if not c["ok"]]
    if bad or failed:
        out.append("Not run or failed:\n")
        out += [f"- {n}: {f['status']}" + (f" ({f['error']})" if f.get("error") else "") for n, f in bad.items()]
        out += [f"- check failed: {c['family']}: {c['name']} {c.get('detail', '')}".rstrip() for c in failed]
        out.append("")
    passed = sum(c["ok"] for c in doc["checks"])
    out.append(f"{passed} of {len(doc['checks'])} correctness checks of the benchmark inputs passed.")
    return "\n".join(out) + "\n"


def write_json(doc: dict, path: str) -> None:
    """Write the document (atomically: a reader never sees half of it)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
