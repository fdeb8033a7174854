"""``epkit bench compare OLD.json NEW.json``: every figure of two runs on one machine kind that moved by more than
a threshold, as a table, and whether any of them is a regression.

The figures judged are each row's same-run ratios, which a noisy machine leaves far steadier than its times:
``x vs peer`` (first peer) and ``% of roof``, both higher-is-better. A figure **regressed** when it fell by
more than the threshold *and* the two runs' interquartile ranges of its per-round values do not overlap (the
new upper quartile under the old lower one), so a shift inside the noise of either run is shown as such but
fails nothing. Median times are shown when they moved; with ``absolute=True`` they are judged too (slower by
more than the threshold with the new minimum above the old maximum): for a quiet, dedicated machine.

Between two runs on a machine shared with other jobs, the same code's ratios can move by tens of percent
outside either run's noise (fresh buffers, the neighbours' load coming and going; ``bench/README.md`` has the
figures): there, use a threshold of 0.3; the default 10% is for a quiet machine.
"""

from __future__ import annotations

import json

from epkit.bench.report import fmt_ms

__all__ = ["compare_docs", "format_moves", "load_doc"]


def load_doc(path: str) -> dict:
    """An ``epkit bench --json`` document (ValueError naming the file otherwise)."""
    from epkit.bench.runner import SCHEMA

    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read an epkit bench report: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not an epkit bench report (schema {SCHEMA!r})")
    return doc


def _ratio_figures(row: dict) -> dict:
    """``{figure: (median, q25, q75)}`` of a row's judged ratios."""
    out = {}
    if row.get("peers"):
        p = row["peers"][0]
        out[f"x vs {p['name']}"] = (p["median"], p["q25"], p["q75"])
    if row.get("roof"):
        r = row["roof"]
        out["% of roof"] = (r["median"], r["q25"], r["q75"])
    return out


def _judge_ratio(old: tuple, new: tuple, threshold: float) -> str | None:
    change = new[0] / old[0] - 1 if old[0] else 0.0
    if abs(change) <= threshold:
        return None
    if change < 0:
        return "REGRESSION" if new[2] < old[1] else "slower (within noise)"
    return "improved" if new[1] > old[2] else "faster (within noise)"


def compare_docs(old: dict, new: dict, threshold: float = 0.10, absolute: bool = False) -> dict:
    """The moves between two reports of one machine kind (ValueError otherwise).

    Returns ``{"moves": [...], "regressions": n, "only_old": [keys], "only_new": [keys], "failed_checks": [...]}``;
    each move: ``key``, ``figure``, ``old``, ``new``, ``change`` (relative), ``verdict``.
    """
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    k_old, k_new = old["machine"]["kind"], new["machine"]["kind"]
    if k_old != k_new:
        raise ValueError(f"the runs are of different machine kinds ({k_old} vs {k_new}): compare runs of one kind")
    rows_old = {r["key"]: r for r in old["rows"]}
    rows_new = {r["key"]: r for r in new["rows"]}
    moves = []
    for key in (k for k in rows_new if k in rows_old):
        ro, rn = rows_old[key], rows_new[key]
        fo, fn = _ratio_figures(ro), _ratio_figures(rn)
        for fig in (f for f in fn if f in fo):
            verdict = _judge_ratio(fo[fig], fn[fig], threshold)
            if verdict:
                moves.append({"key": key, "figure": fig, "old": fo[fig][0], "new": fn[fig][0], "verdict": verdict})
        change = rn["median_ms"] / ro["median_ms"] - 1
        if abs(change) > threshold:
            verdict = "slower" if change > 0 else "faster"
            if absolute and change > 0 and rn["min_ms"] > ro["max_ms"]:
                verdict = "REGRESSION"
            moves.append(
                {
                    "key": key,
                    "figure": "median time",
                    "old": ro["median_ms"],
                    "new": rn["median_ms"],
                    "verdict": verdict,
                }
            )
    for m in moves:
        m["change"] = m["new"] / m["old"] - 1 if m["old"] else 0.0
    notes = []
    for what, field in (("CPU models", "cpu_model"), ("torch threads", "torch_threads")):
        a, b = old["machine"].get(field), new["machine"].get(field)
        if a != b:
            notes.append(f"{what} differ: {a} vs {b}")
    return {
        "threshold": threshold,
        "kind": k_new,
        "note": "; ".join(notes) or None,
        "moves": moves,
        "regressions": sum(m["verdict"] == "REGRESSION" for m in moves),
        "only_old": sorted(set(rows_old) - set(rows_new)),
        "only_new": sorted(set(rows_new) - set(rows_old)),
        "failed_checks": [f"{c['family']}: {c['name']}" for c in new.get("checks", []) if not c["ok"]],
    }


def _value(figure: str, v: float) -> str:
    if figure == "median time":
        return fmt_ms(v)
    return f"{100 * v:.1f}%" if figure == "% of roof" else f"{v:.2f}x"


def format_moves(result: dict) -> str:
    """The moves as a Markdown table, then the rows in one run only, failed checks and the verdict line."""
    lines = [f"figures that moved by more than {result['threshold']:.0%} ({result['kind']}):", ""]
    if result.get("note"):
        lines[1:1] = [f"note: {result['note']}"]
    if result["moves"]:
        lines += ["| row | figure | old | new | change | verdict |", "|---|---|---|---|---|---|"]
        for m in result["moves"]:
            old, new = _value(m["figure"], m["old"]), _value(m["figure"], m["new"])
            lines.append(f"| {m['key']} | {m['figure']} | {old} | {new} | {m['change']:+.0%} | {m['verdict']} |")
    else:
        lines.append("(none)")
    for what, keys in (("only in OLD", result["only_old"]), ("only in NEW", result["only_new"])):
        lines += [f"{what}: {k}" for k in keys]
    lines += [f"check failed in NEW: {c}" for c in result["failed_checks"]]
    n = result["regressions"] + len(result["failed_checks"])
    lines.append("")
    lines.append(
        f"{result['regressions']} regressions"
        + (f", {len(result['failed_checks'])} failed checks" if result["failed_checks"] else "")
        + ("" if n else ": ok")
    )
    return "\n".join(lines) + "\n"
