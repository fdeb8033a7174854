"""gpu_check section ``bench``: ``epkit bench --device cuda`` inside gpu_check's budgeted, watchdogged run.

The in-process families of ``epkit.bench`` (gather, cp_mirror, engram, experts, grouped_gemm: those that spawn
no CPU ranks) on the section's device at quick sizes (``tiny`` in the CPU dry run), each case started only
while the section's budget lasts (a family cut short says so in its status and the summary; the section
stays ``ok``). ``res`` gets the harness's rows (each with its peers and roof), its
correctness checks as this section's checks, each family's status and the Markdown table; the harness's own
report goes next to gpu_check's JSON as ``<stem>.bench.json`` and ``<stem>.bench.md`` (what
``epkit bench compare`` reads and ``bench/results/<machine kind>/`` keeps), with its charts in
``<stem>.bench_plots/`` where matplotlib is installed (else ``res["plots"]`` says why; ``epkit bench``'s
``write_plots`` can draw them from the JSON on any machine).
"""

from __future__ import annotations

import importlib
import os
import time

from gpu_sections.common import Ctx, record_check

__all__ = ["sec_bench"]

#: Seconds kept back from the section's budget: a case started just before it would overrun it.
MARGIN_S = 5.0


def _plots(doc: dict, outdir: str) -> list[str] | str:
    """``epkit bench --plot``'s charts of the run into ``outdir`` (the files), or why there are none."""
    from epkit.bench.plots import write_plots

    try:
        return write_plots(doc, outdir)
    except RuntimeError as exc:  # no matplotlib in the GPU machine's Python: the JSON can be plotted elsewhere
        return f"not drawn: {exc}"


def sec_bench(ctx: Ctx, res: dict):
    from epkit.bench import FAMILIES
    from epkit.bench.core import BenchCtx
    from epkit.bench.report import markdown_report, markdown_table, write_json
    from epkit.bench.runner import finish_doc, run_families, start_doc

    names = [n for n in FAMILIES if importlib.import_module(f"epkit.bench.{n}").FAMILY.ranks == 0]
    names.sort(key=lambda n: n != "grouped_gemm")  # the GEMMs' figures first, should the budget run short
    size = "tiny" if ctx.dry else "quick"
    t0 = time.perf_counter()
    doc = start_doc(ctx.device, names, size)
    bctx = BenchCtx(ctx.device, size)
    ctx.log(f"epkit bench families {', '.join(names)} at {size} sizes")
    families = run_families(names, bctx, deadline=ctx.deadline - MARGIN_S)
    finish_doc(doc, bctx, families, time.perf_counter() - t0)
    for c in bctx.checks:
        record_check(res, f"{c['family']}: {c['name']}", c["ok"], c["detail"])
    res.update(size=size, families=families, rows=bctx.rows, table=markdown_table(bctx.rows))
    if ctx.out_path:
        stem = os.path.splitext(ctx.out_path)[0]
        write_json(doc, f"{stem}.bench.json")
        with open(f"{stem}.bench.md", "w") as f:
            f.write(markdown_report(doc))
        res["files"] = [f"{stem}.bench.json", f"{stem}.bench.md"]
        res["plots"] = _plots(doc, f"{stem}.bench_plots")
    errors = {n: f["error"] for n, f in families.items() if f.get("error")}
    if errors:
        raise RuntimeError(f"epkit bench families failed: {errors}")
    # A family cut short by the budget is recorded, not failed: the section exists to give the run's figures in
    # whatever time the checks before it left (gpu_run.sh gives it ~15 s of its 300), and its rows so far stand.
    cut = {n: f["status"] for n, f in families.items() if f["status"].startswith("budget")}
    res["summary"] = f"{len(bctx.rows)} rows from {len(families)} families ({size} sizes)" + (
        f"; budget spent: {cut}" if cut else ""
    )
    return None
