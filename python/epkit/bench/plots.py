"""``epkit bench --plot DIR``: PNG charts of a report, drawn with matplotlib (the Agg backend: no display).

- ``dispatch_combine.png``: dispatch + combine bandwidth vs tokens per rank, each transport against the
  minimal exchange and the copy roof;
- ``grouped_gemm.png``: grouped FP8 GEMM TFLOP/s vs rows per expert against the dense matmul roof and peers;
- ``cp_mirror_engram.png``: ``prepare_cp_mirror`` and ``engram_hash`` time vs tokens, with peers and roofs;
- ``gather.png``, ``experts.png``, ``engram_table.png``, ``ep_hosts.png``, ``model.png``: each shape's
  throughput as grouped bars, one bar per backend, peer and roof (these families run one or two shapes, too
  few for a line; the y axis is logarithmic where the bars span more than 50x, as a Python-loop peer does).

A chart whose family did not run is not drawn, and ``write_plots`` says so (``gaps``): every family of the
report has a chart or a line saying why none applies. Every bar and line comes from the rows of the one report.
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


#: The families drawn as grouped bars of throughput per shape.
BAR_FAMILIES = ("gather", "experts", "engram_table", "ep_hosts", "model")


def _bars(ax, rows: list[dict], title: str) -> None:
    """Grouped bars: one group per shape (in the rows' order), one bar per backend, peer and roof in it."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    vals: dict[str, dict[str, float]] = {}
    for r in rows:
        vals.setdefault(r["backend"], {})[r["shape"]] = r["throughput"]
        for p in r["peers"]:
            vals.setdefault(f"peer: {p['name']}", {})[r["shape"]] = p["throughput"]
        if r["roof"]:
            vals.setdefault(f"roof: {_stable(r['roof']['name'])}", {})[r["shape"]] = r["roof"]["throughput"]
    rank = {"peer": 1, "roof": 2}
    vals = dict(sorted(vals.items(), key=lambda kv: rank.get(kv[0].split(":", 1)[0], 0)))  # backends, peers, roof
    width = 0.8 / max(1, len(vals))
    for i, (label, by_shape) in enumerate(vals.items()):
        xs = [j + (i - (len(vals) - 1) / 2) * width for j, sh in enumerate(shapes) if sh in by_shape]
        hatch = "//" if label.startswith("roof") else (".." if label.startswith("peer") else None)
        ax.bar(xs, [by_shape[sh] for sh in shapes if sh in by_shape], width, label=label, hatch=hatch)
    ax.set_xticks(range(len(shapes)), shapes, fontsize=7, rotation=10 if len(shapes) > 2 else 0)
    flat = [v for d in vals.values() for v in d.values() if v > 0]
    if flat and max(flat) > 50 * min(flat):
        ax.set_yscale("log")
    ax.set(ylabel=rows[0]["unit"], title=title)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _throughput(r: dict, part: dict | None) -> float:
    return (part or r)["throughput"]


def _time(r: dict, part: dict | None) -> float:
    return (part or r)["median_ms"]


def write_plots(doc: dict, outdir: str, gaps: list[str] | None = None) -> list[str]:
    """Draw the charts of ``doc`` whose families ran into ``outdir``; returns the files written.

    ``gaps``: where given, gets a line for each family of the report that has no chart, saying why (it did
    not run, or ran no row a chart draws): ``"no chart for ep_hosts: skipped: ..."``."""
    plt = pyplot()
    os.makedirs(outdir, exist_ok=True)
    kind, rows = doc["machine"]["kind"], doc["rows"]
    written: list[str] = []
    drawn: set[str] = set()

    def save(fig, name: str) -> None:
        path = os.path.join(outdir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        drawn.update(r["family"] for r in rows if r["family"] in charted)

    charted: set[str] = set()

    ep = [r for r in rows if r["family"] == "ep_buffer" and r["op"] == "dispatch+combine"]
    if ep:
        charted = {"ep_buffer"}
        fig, ax = plt.subplots(figsize=(8, 5))
        title = f"dispatch+combine bandwidth vs tokens per rank ({kind})\nGB/s of rows read + written per rank"
        _draw(ax, _lines(ep, "tokens_per_rank", _throughput), "tokens per rank", "GB/s", title)
        save(fig, "dispatch_combine.png")
    gg = [r for r in rows if r["family"] == "grouped_gemm" and r["sweep"].get("kind") == "fp8"]
    if gg:
        charted = {"grouped_gemm"}
        fig, ax = plt.subplots(figsize=(8, 5))
        groups, nk = gg[0]["shape"].split("x", 1)[0], gg[0]["shape"].split("rows ", 1)[1]
        title = f"grouped FP8 GEMM TFLOP/s vs rows per expert ({kind})\n{groups} experts, {nk}, bf16 out"
        _draw(ax, _lines(gg, "rows_per_expert", _throughput), "rows per expert", "TFLOP/s", title)
        save(fig, "grouped_gemm.png")
    cp = [r for r in rows if r["family"] == "cp_mirror"]
    en = [r for r in rows if r["family"] == "engram"]
    if cp or en:
        charted = {"cp_mirror", "engram"}
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for ax, part, what in ((axes[0], cp, "prepare_cp_mirror"), (axes[1], en, "engram_hash")):
            if part:
                _draw(
                    ax, _lines(part, "tokens", _time), "tokens", "ms per call", f"{what} time vs tokens ({kind})", True
                )
            else:
                ax.set_title(f"{what}: not in this run")
        save(fig, "cp_mirror_engram.png")
    titles = {n: f.get("title") for n, f in doc.get("families", {}).items()}
    for fam in BAR_FAMILIES:
        part = [r for r in rows if r["family"] == fam]
        if part:
            charted = {fam}
            fig, ax = plt.subplots(figsize=(max(8, 2.5 * len({r["shape"] for r in part})), 5))
            _bars(ax, part, f"{titles.get(fam) or fam} ({kind})\n{part[0]['unit']} of each backend, peer and roof")
            save(fig, f"{fam}.png")
    if gaps is not None:
        for name, fam in doc.get("families", {}).items():
            if name not in drawn:
                why = fam["status"] if fam["status"] != "ok" else "it ran no row a chart draws"
                gaps.append(f"no chart for {name}: {why}")
    return written
