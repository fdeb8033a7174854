"""``epkit bench --plot DIR``: PNG charts of a report, drawn with matplotlib (the Agg backend: no display).

- ``dispatch_combine.png``: dispatch + combine bandwidth vs tokens per rank, each transport against the
  minimal exchange and the copy roof;
- ``grouped_gemm.png``: grouped FP8 GEMM TFLOP/s vs rows per expert against the dense matmul roof and peers;
- ``cp_mirror_engram.png``: ``prepare_cp_mirror`` and ``engram_hash`` time vs tokens, with peers and roofs.

A chart whose family did not run is not drawn. Every line comes from the rows of the one report.
"""

from __future__ import annotations

import os
import re

__all__ = ["pyplot", "write_plots"]


def pyplot():
    """matplotlib's pyplot on the Agg backend (RuntimeError saying how to install matplotlib when it is missing)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib; epkit's dev extra pins it)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _lines(rows: list[dict], xkey: str, value) -> dict[str, dict[float, float]]:
    """``{label: {x: y}}``: each backend's rows, and each peer and roof once per x (``value(row, part)``:
    the y of a row's own figure, ``part`` None, or of one of its peers / its roof)."""
    out: dict[str, dict[float, float]] = {}
    for r in rows:
        x = r["sweep"].get(xkey)
        if x is None:
            continue
        out.setdefault(r["backend"], {})[x] = value(r, None)
        for p in r["peers"]:
            out.setdefault(f"peer: {p['name']}", {})[x] = value(r, p)
        if r["roof"]:
            out.setdefault(f"roof: {_stable(r['roof']['name'])}", {})[x] = value(r, r["roof"])
    return out


def _stable(name: str) -> str:
    """A roof's name without its sizes and thread count, which change along a sweep (one line per roof)."""
    return re.sub(r"\s*\(.*?\)|\s*[\d.]+ [KMG]iB|, 1 thread", "", name)


def _draw(ax, lines: dict, xlabel: str, ylabel: str, title: str, logy: bool = False) -> None:
    for label, pts in lines.items():
        xs = sorted(pts)
        style = "--" if label.startswith("roof") else (":" if label.startswith("peer") else "-")
        ax.plot(xs, [pts[x] for x in xs], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _throughput(r: dict, part: dict | None) -> float:
    return (part or r)["throughput"]


def _time(r: dict, part: dict | None) -> float:
    return (part or r)["median_ms"]


def write_plots(doc: dict, outdir: str) -> list[str]:
    """Draw the charts of ``doc`` whose families ran into ``outdir``; returns the files written."""
    plt = pyplot()
    os.makedirs(outdir, exist_ok=True)
    kind, rows = doc["machine"]["kind"], doc["rows"]
    written = []

    def save(fig, name: str) -> None:
        path = os.path.join(outdir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    ep = [r for r in rows if r["family"] == "ep_buffer" and r["op"] == "dispatch+combine"]
    if ep:
        fig, ax = plt.subplots(figsize=(8, 5))
        title = f"dispatch+combine bandwidth vs tokens per rank ({kind})\nGB/s of rows read + written per rank"
        _draw(ax, _lines(ep, "tokens_per_rank", _throughput), "tokens per rank", "GB/s", title)
        save(fig, "dispatch_combine.png")
    gg = [r for r in rows if r["family"] == "grouped_gemm" and r["sweep"].get("kind") == "fp8"]
    if gg:
        fig, ax = plt.subplots(figsize=(8, 5))
        groups, nk = gg[0]["shape"].split("x", 1)[0], gg[0]["shape"].split("rows ", 1)[1]
        title = f"grouped FP8 GEMM TFLOP/s vs rows per expert ({kind})\n{groups} experts, {nk}, bf16 out"
        _draw(ax, _lines(gg, "rows_per_expert", _throughput), "rows per expert", "TFLOP/s", title)
        save(fig, "grouped_gemm.png")
    cp = [r for r in rows if r["family"] == "cp_mirror"]
    en = [r for r in rows if r["family"] == "engram"]
    if cp or en:
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for ax, part, what in ((axes[0], cp, "prepare_cp_mirror"), (axes[1], en, "engram_hash")):
            if part:
                _draw(
                    ax, _lines(part, "tokens", _time), "tokens", "ms per call", f"{what} time vs tokens ({kind})", True
                )
            else:
                ax.set_title(f"{what}: not in this run")
        save(fig, "cp_mirror_engram.png")
    return written
