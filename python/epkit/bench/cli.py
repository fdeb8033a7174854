"""``epkit bench`` and ``epkit bench compare`` (registered by :func:`epkit.cli.build_parser`).

``epkit bench`` runs the families (all, or ``--only``), shows a progress bar on stderr, then prints the
machine line and the Markdown table on stdout; ``--json`` alone prints the JSON document instead (stdout
holds nothing else), ``--json PATH``, ``--markdown PATH`` and ``--plot DIR`` write files (a family without a
chart is named on stderr, with why). Nothing else is written. ``--threads auto`` (the default) measures with one
torch thread per rank on a machine whose load average exceeds half its cores, else with torch's default; the line
above the table says which and why, and a legend under it says what the columns mean. Exit status: 0, or 1
when a correctness check of a benchmark input failed or a family errored.

``epkit bench compare OLD NEW`` prints the figures that moved (``epkit.bench.compare``); exit status 1 on a
regression (or a failed check in NEW), 2 when the runs are of different machine kinds or unreadable.
``epkit bench plot RUN.json DIR`` draws ``--plot``'s charts from a saved run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from epkit.bench import FAMILIES

__all__ = ["add_bench_parser", "cmd_bench"]

EXAMPLES = """examples:
  epkit bench --quick                              every family, small shapes (< 3 minutes on 2 cores)
  epkit bench --only gather grouped_gemm --json run.json --markdown run.md --plot plots/
  epkit bench --device cuda --quick                the GPU figures (a CUDA device is required)
  epkit bench --quick --threads 1                  one torch thread per rank (auto: when the load average > cores/2)
  epkit bench --json | python -m json.tool         the JSON document on stdout
  epkit bench compare old.json new.json            figures that moved by > 10%; exit 1 on a regression
  epkit bench compare old.json new.json --threshold 0.2 --json
  epkit bench plot run.json plots/                 the charts of a saved run
"""


def _threads(text: str) -> int | str:
    """``--threads``: ``auto`` or a number (its range is checked by ``run_bench``)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


def add_bench_parser(sub, formatter) -> None:
    """Add ``bench`` (and its ``compare``) to ``epkit``'s subcommands."""
    desc = "benchmarks against same-run peers and roofs: a table, JSON, plots; compare two runs"
    p = sub.add_parser("bench", help=desc, description=desc, epilog=EXAMPLES, formatter_class=formatter)
    p.add_argument("--quick", action="store_true", help="smaller shapes and fewer rounds")
    p.add_argument("--only", nargs="+", choices=FAMILIES, metavar="FAMILY", help=f"only these: {', '.join(FAMILIES)}")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the ops run (default cpu)")
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write the JSON document to PATH; alone: on stdout instead of the table",
    )
    p.add_argument("--markdown", metavar="PATH", help="write the report (machine line and table) as Markdown")
    p.add_argument("--plot", metavar="DIR", help="write PNG charts into DIR (needs matplotlib)")
    p.add_argument(
        "--threads",
        type=_threads,
        default="auto",
        metavar="N|auto",
        help="torch CPU threads for the in-process families and, at most, each spawned rank; auto (the default): "
        "1 when the load average exceeds half the cores (other jobs share the machine), else torch's default",
    )
    p.set_defaults(func=cmd_bench, action=None)
    acts = p.add_subparsers(dest="action", metavar="{compare,plot}")
    c = acts.add_parser(
        "compare",
        help="figures of two runs that moved by more than a threshold",
        description="Figures of two runs of one machine kind that moved by more than a threshold "
        "(same-run ratios judged; exit 1 on a regression).",
        epilog="examples:\n  epkit bench compare old.json new.json\n  epkit bench compare a.json b.json --absolute\n",
        formatter_class=formatter,
    )
    c.add_argument("old", metavar="OLD.json")
    c.add_argument("new", metavar="NEW.json")
    c.add_argument("--threshold", type=float, default=0.10, help="relative move that counts (default 0.10)")
    c.add_argument("--absolute", action="store_true", help="also judge median times (a quiet, dedicated machine)")
    c.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the table")
    pl = acts.add_parser(
        "plot",
        help="the charts of a saved run (e.g. one from a GPU machine without matplotlib)",
        description="Draw --plot's PNG charts from a saved epkit bench JSON document.",
        epilog="examples:\n  epkit bench plot bench/results/h200/bench.json bench/results/h200\n",
        formatter_class=formatter,
    )
    pl.add_argument("run", metavar="RUN.json")
    pl.add_argument("dir", metavar="DIR")


def _compare(args) -> int:
    from epkit.bench.compare import compare_docs, format_moves, load_doc

    result = compare_docs(load_doc(args.old), load_doc(args.new), args.threshold, args.absolute)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_moves(result))
    return 1 if result["regressions"] or result["failed_checks"] else 0


def _plot(args) -> int:
    from epkit.bench.compare import load_doc
    from epkit.bench.plots import write_plots

    gaps: list[str] = []
    for path in write_plots(load_doc(args.run), args.dir, gaps):
        print(f"epkit bench: wrote {path}", file=sys.stderr)
    for line in gaps:
        print(f"epkit bench: {line}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    if args.action == "compare":
        return _compare(args)
    if args.action == "plot":
        return _plot(args)
    from epkit.bench.report import LEGEND, markdown_report, markdown_table, summary_line, threads_line, write_json
    from epkit.bench.runner import run_bench

    if args.plot:
        from epkit.bench.plots import pyplot, write_plots

        pyplot()  # before the run: a missing matplotlib is said at once, not after minutes
    doc = run_bench(args.only or FAMILIES, args.device, "quick" if args.quick else "full", threads=args.threads)
    plots, gaps = [], []
    if args.plot:
        plots = write_plots(doc, args.plot, gaps)
        doc["plots"] = [os.path.basename(p) for p in plots]
    if args.json and args.json != "-":
        write_json(doc, args.json)
    if args.markdown:
        base = os.path.dirname(os.path.abspath(args.markdown))
        links = [os.path.relpath(os.path.abspath(p), base) for p in plots]
        with open(args.markdown, "w") as f:
            f.write(markdown_report(doc) + "".join(f"\n![{os.path.basename(p)}]({p})\n" for p in links))
    if args.json == "-":
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(summary_line(doc) + "\n" + threads_line(doc) + "\n\n" + markdown_table(doc["rows"]))
        for name, fam in doc["families"].items():
            if fam["status"] != "ok":
                sys.stdout.write(f"{name}: {fam['status']}" + (f" ({fam['error']})" if fam.get("error") else "") + "\n")
        for c in doc["checks"]:
            if not c["ok"]:
                sys.stdout.write(f"CHECK FAILED: {c['family']}: {c['name']} {c['detail']}\n")
        sys.stdout.write("\n" + LEGEND)
    for path in [*plots, *(p for p in (args.json, args.markdown) if p and p != "-")]:
        print(f"epkit bench: wrote {path}", file=sys.stderr)
    for line in gaps:
        print(f"epkit bench: {line}", file=sys.stderr)
    return 0 if doc["ok"] else 1
