"""The ``epkit`` command line.

``epkit info``       versions, devices, which backends and transports run here and why others do not, and which
                     of DeepGEMM's names the drop-in ``epkit.compat.deep_gemm`` provides
``epkit selfcheck``  runs every op on every backend this machine has against its reference
``epkit plan``       deployment calculator: experts per rank, bytes, memory, communication, collective ledger
``epkit bench``      benchmarks against same-run peers and roofs (table, JSON, plots); ``bench compare`` two runs
``epkit run``        the reference model on CPU ranks: verdict, step latency, per-op breakdown, collective ledger
                     (its options: ``epkit run --help``; ``python -m epkit run`` under torchrun)

Every subcommand takes ``--json`` (one JSON document on stdout, nothing else there); ``epkit --version``
prints the version. Exit status is 0 on success, 1 when a check fails, 2 on bad usage; errors are one line
on stderr, never a traceback. torch is a peer dependency: without it ``epkit --version`` and the ``--help`` of
``epkit`` and its commands work (not ``epkit run --help``: its parser lives with the model), and every command
ends with status 1 and one line saying which torch to install and how. A reader that closes the pipe early
(``epkit plan --json | head -1``) ends the command quietly with status 141, as a shell reports a writer stopped
by SIGPIPE.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import textwrap
import time
import traceback

from epkit import __version__
from epkit._details.requirements import torch_missing, torch_needed
from epkit.bench.cli import add_bench_parser

#: Exit status after the reader closed stdout: 128 + SIGPIPE, what a shell reports for a writer killed by it.
EXIT_BROKEN_PIPE = 141

EXAMPLES = """examples:
  epkit info                          what this machine runs (backends, transports, each op's auto choice)
  epkit info --json | python -m json.tool
  epkit selfcheck                     every op on every CPU backend here, against its reference
  epkit selfcheck --backend triton --json
  epkit plan --model v4.1-flash --dp 64 --ep 64
  epkit plan --model path/to/config.json --dp 8 --weight-format fp8 --json
  epkit bench --quick                 every op family against its peer and roof, as one table
  epkit run --ranks 2 --steps 3       the reference model on 2 CPU ranks, where a decode step's time goes
"""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvshmem_transport_info(wheel_root: str | None) -> dict:
    """Readiness of the nvshmem transport (SymmBuffer and EPBuffer on CUDA ranks)."""
    from epkit.collectives.transports.nvshmem_job import missing_reason

    why = missing_reason()
    if why is None:
        return {"ready": True, "why": "epkit._C_cuda (NVSHMEM) and a CUDA device (SymmBuffer, EPBuffer)"}
    if wheel_root is None:
        why += "; no nvidia-nvshmem wheel (pip install 'epkit[cuda13]')"
    return {"ready": False, "why": why}


def _nvshmem_root() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for base in list(spec.submodule_search_locations or []) if spec else []:
        for sub in ("nvshmem", "cu13/nvshmem", "cu12/nvshmem"):
            root = os.path.join(base, sub)
            if os.path.exists(os.path.join(root, "include", "nvshmem.h")):
                return root
    return None


def collect_info() -> dict:
    """Everything ``epkit info`` reports, as a JSON-able dict."""
    import torch

    from epkit import backends

    gpu = torch.cuda.is_available()
    devices = {"cpu": {"threads": torch.get_num_threads(), "cores": os.cpu_count()}}
    if gpu:
        devices["cuda"] = [
            {
                "index": i,
                "name": torch.cuda.get_device_name(i),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
            }
            for i in range(torch.cuda.device_count())
        ]
    bk = {}
    for name in backends.BACKENDS:
        info = backends.backend_info(name)
        bk[name] = {"devices": list(info.devices), "missing": info.missing}
    c_err = backends.c_extension_error()
    if c_err:
        bk["cpu"]["note"] = f"ops whose cpu path uses the C++ extension fall back to torch: {c_err}"
    import torch.distributed as dist

    from epkit.compat._details.deep_gemm_coverage import coverage as deep_gemm_coverage

    nvshmem = _nvshmem_root()
    transports = {
        "shm": {
            "ready": c_err is None and os.access("/dev/shm", os.W_OK),
            "why": c_err
            or ("/dev/shm is not writable" if not os.access("/dev/shm", os.W_OK) else "epkit._C and /dev/shm"),
        },
        "torch": {
            "ready": dist.is_available() and dist.is_gloo_available(),
            "why": "torch.distributed with gloo" if dist.is_available() else "torch built without distributed",
        },
        "nvshmem": _nvshmem_transport_info(nvshmem),
    }
    ops = {
        name: {
            "backends": list(spec.backends),
            "auto_cpu": _auto(name, "cpu"),
            "auto_cuda": _auto(name, "cuda") if gpu else None,
        }
        for name, spec in backends.registered_ops().items()
    }
    return {
        "epkit": _version("epkit") or "source tree",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {
            p: _version(p)
            for p in ("torch", "triton", "tilelang", "numpy", "nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13")
        },
        "nvcc": shutil.which("nvcc"),
        "devices": devices,
        "backends": bk,
        "c_extension": "ok" if c_err is None else c_err,
        "transports": transports,
        "ops": ops,
        "compat": {"deep_gemm": deep_gemm_coverage()},
    }


def _auto(op: str, device: str) -> str:
    from epkit import backends

    try:
        return backends.select(op, device, "auto")
    except backends.BackendUnavailableError as exc:
        return f"none ({exc})"


def _print_info(info: dict) -> None:
    w = sys.stdout.write
    w(f"epkit {info['epkit']}  python {info['python']}  {info['platform']}\n")
    w("packages: " + ", ".join(f"{k} {v}" for k, v in info["packages"].items() if v) + "\n")
    missing = [k for k, v in info["packages"].items() if not v]
    if missing:
        w("not installed: " + ", ".join(missing) + "\n")
    cuda = info["devices"].get("cuda")
    w(f"cpu: {info['devices']['cpu']['cores']} cores, torch uses {info['devices']['cpu']['threads']} threads\n")
    if cuda:
        for d in cuda:
            w(f"cuda:{d['index']}: {d['name']} (sm_{d['capability'].replace('.', '')})\n")
    else:
        w("cuda: no GPU visible - GPU backends are off; every op runs on its CPU backends\n")
    w(f"C++ extension epkit._C: {info['c_extension']}\n\nbackends:\n")
    for name, b in info["backends"].items():
        runs = ", ".join(b["devices"]) or "nowhere"
        w(f"  {name:<10} runs on: {runs}\n")
        for dev, why in b["missing"].items():
            w(f"  {'':<10}   not on {dev}: {why}\n")
        if b.get("note"):
            w(f"  {'':<10}   {b['note']}\n")
    w("\ntransports (collectives):\n")
    for name, t in info["transports"].items():
        w(f"  {name:<8} {'ready' if t['ready'] else 'unavailable'}: {t['why']}\n")
    w("\nops (auto backend on this machine):\n")
    width = max((len(n) for n in info["ops"]), default=0)
    for name, o in info["ops"].items():
        w(f"  {name:<{width}} cpu -> {o['auto_cpu']}")
        w(f", cuda -> {o['auto_cuda']}" if o["auto_cuda"] else "")
        w(f"   [backends: {', '.join(o['backends'])}]\n")
    _print_deep_gemm_coverage(info["compat"]["deep_gemm"])


def _print_deep_gemm_coverage(cov: dict) -> None:
    """The drop-in ``epkit.compat.deep_gemm``: DeepGEMM's names it provides, those not yet, those out of scope."""
    wrap = textwrap.TextWrapper(width=118, initial_indent="    ", subsequent_indent="    ")
    w = sys.stdout.write
    w("\ndrop-in epkit.compat.deep_gemm (DeepGEMM's interface):\n")
    for title, names in (
        (f"provided ({len(cov['provided'])})", cov["provided"]),
        (f"not yet provided by epkit ({len(cov['not_yet_provided'])})", cov["not_yet_provided"]),
        (f"out of scope ({len(cov['out_of_scope'])})", cov["out_of_scope"]),
    ):
        w(f"  {title}:\n{wrap.fill(', '.join(names))}\n")
    w("  how the provided GEMMs compute:\n")
    for names, path in cov.get("paths", {}).items():
        w(f"{wrap.fill(f'{names}: {path}')}\n")
    w(f"  for a name not provided: {cov['install_for_the_rest']}\n")


def cmd_info(args) -> int:
    info = collect_info()
    if args.json:
        _dump(info)
    else:
        _print_info(info)
    return 0


def _run_selfchecks(backend: str | None = None, verbose: bool = False, report=None) -> list[dict]:
    """Every registered op's self-check on each CPU backend (only ``backend`` when given).

    Returns one dict per (op, backend): ``op``, ``backend``, ``status`` (``ok``, ``failed``, ``skipped``),
    ``seconds`` and ``detail`` (why it failed or was skipped). ``report(row)`` is called as each one ends.
    """
    from epkit import backends

    rows = []
    for name, spec in backends.registered_ops().items():
        if spec.selfcheck is None:
            continue
        for b in spec.cpu:
            if backend and b != backend:
                continue
            row = {"op": name, "backend": b, "status": "ok", "seconds": 0.0, "detail": None}
            info = backends.backend_info(b)
            t0 = time.perf_counter()
            if not info.available_on("cpu"):
                row.update(status="skipped", detail=info.missing.get("cpu"))
            else:
                try:
                    spec.selfcheck(b)
                except Exception as exc:  # report every failure, keep checking the rest
                    row.update(status="failed", detail=f"{type(exc).__name__}: {exc}")
                    if verbose:
                        traceback.print_exc()
            row["seconds"] = round(time.perf_counter() - t0, 4)
            rows.append(row)
            if report is not None:
                report(row)
    return rows


def cmd_selfcheck(args) -> int:
    from epkit import backends

    if args.backend and args.backend not in backends.BACKENDS:
        raise ValueError(f"unknown backend {args.backend!r}; expected one of {', '.join(backends.BACKENDS)}")
    width = max((len(n) for n in backends.registered_ops()), default=0)

    def line(row: dict) -> None:
        what = {
            "ok": f"ok ({row['seconds']:.2f} s, matches the reference)",
            "failed": f"FAILED: {row['detail']}",
            "skipped": f"skipped: {row['detail']}",
        }[row["status"]]
        print(f"  {row['op']:<{width}} {row['backend']:<10} {what}", flush=True)

    rows = _run_selfchecks(args.backend, args.verbose, report=None if args.json else line)
    counts = {k: sum(r["status"] == k for r in rows) for k in ("ok", "failed", "skipped")}
    if args.json:
        _dump({"passed": counts["ok"], "failed": counts["failed"], "skipped": counts["skipped"], "checks": rows})
    else:
        print(f"selfcheck: {counts['ok']} passed, {counts['failed']} failed")
    if counts["ok"] == 0 and counts["failed"] == 0:
        print("selfcheck: nothing ran (no backend available?)", file=sys.stderr)
        return 1
    return 1 if counts["failed"] else 0


def _dump(obj) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def cmd_plan(args) -> int:
    from epkit.plan import format_plan, plan

    p = plan(
        args.model,
        dp=args.dp,
        ep=args.ep,
        cp=args.cp,
        enp=args.enp,
        weight_format=args.weight_format,
        tokens_per_rank=args.tokens_per_rank,
        min_num_extra_experts=args.min_extra,
        link_gbps=args.link_gbps,
        alpha_us=args.alpha_us,
        tp=args.tp,
    )
    if args.json:
        _dump(p.to_dict())
    else:
        print(format_plan(p))
    return 0


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="epkit", description=__doc__.replace("``", ""), epilog=EXAMPLES, formatter_class=raw
    )
    p.add_argument("--version", action="version", version=f"epkit {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, func, help: str, examples: str):
        sp = sub.add_parser(name, help=help, description=help, epilog=f"examples:\n{examples}", formatter_class=raw)
        sp.add_argument("--json", action="store_true", help="one JSON document on stdout instead of text")
        sp.set_defaults(func=func)
        return sp

    command("info", cmd_info, "what this machine can run", "  epkit info\n  epkit info --json\n")
    ps = command(
        "selfcheck",
        cmd_selfcheck,
        "run every op on every available CPU backend against its reference",
        "  epkit selfcheck\n  epkit selfcheck --backend tilelang\n  epkit selfcheck --json\n",
    )
    ps.add_argument("--backend", help="only this backend (reference, cpu, tilelang, triton)")
    ps.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failures")
    pp = command(
        "plan",
        cmd_plan,
        "deployment calculator for DP attention + Wide-EP",
        "  epkit plan --model v4.1-flash --dp 64 --ep 64\n  epkit plan --dp 8 --cp 2 --weight-format fp8 --json\n",
    )
    pp.add_argument("--model", default="v4.1-flash", help="preset (v4.1-flash, deepseek-v3) or config.json path")
    pp.add_argument("--dp", type=int, required=True, help="data-parallel size (engines)")
    pp.add_argument("--ep", type=int, help="expert-parallel size (default: world size)")
    pp.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    pp.add_argument("--enp", type=int, help="Engram-parallel size (default dp*cp)")
    pp.add_argument("--weight-format", choices=["fp4", "fp8", "bf16"],
                    help="expert weights (default: the model's own: fp4 for v4.1-flash, fp8 for deepseek-v3; a "
                    "config.json's quantization_config, bf16 without one)")  # fmt: skip
    pp.add_argument("--tokens-per-rank", type=int, default=128,
                    help="decode tokens per rank per step (default 128)")  # fmt: skip
    pp.add_argument("--min-extra", type=int, default=1, help="minimum redundant experts (default 1)")
    pp.add_argument("--link-gbps", type=float, default=450.0, help="link bandwidth, GB/s (default 450: NVLink)")
    pp.add_argument("--alpha-us", type=float, default=10.0, help="per-message latency, us (default 10)")
    pp.add_argument("--tp", type=int, help="TP degree for the comparison (default 8)")
    add_bench_parser(sub, raw)  # its --json takes an optional PATH: alone, the document goes to stdout
    # listed for --help; main() hands everything after "run" to epkit.model.run, which has its own parser
    sub.add_parser("run", help="the reference model on CPU ranks (epkit run --help)", add_help=False)
    return p


def _cmd_run(argv: list[str]) -> int:
    from epkit.model.run import end_process
    from epkit.model.run import main as run_main

    return end_process(run_main(argv, prog="epkit run"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        args = argparse.Namespace(command="run", func=lambda _: _cmd_run(argv[1:]))
    else:
        args = build_parser().parse_args(argv)  # --version and --help end here, torch or not
    if torch_missing():
        print(f"epkit {args.command}: error: {torch_needed()}", file=sys.stderr)
        return 1
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at interpreter exit
        return status
    except BrokenPipeError:
        # The reader is gone: point stdout at /dev/null so the flush at exit cannot fail again, and stop quietly.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"epkit {args.command}: error: {exc}", file=sys.stderr)
        return 2
