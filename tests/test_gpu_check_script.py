"""bench/gpu_check.py (rung 4's one prepared script) runs end to end as a CPU dry run and writes a sound JSON.

The GPU figures only exist where a GPU run happens; this catches errors in the script's control flow
(section runner, timing helpers, the CPU stand-ins of every check) on machines without one.
"""

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")
SECTIONS = (
    "env",
    "gather_rows",
    "logical_to_physical",
    "prepare_cp_mirror",
    "engram_hash",
    "grouped_gemm",
    "nvshmem",
    "bench",
)
# Sections that need a CUDA device for everything they do; on CPU they must say so, not crash.
CUDA_ONLY = {"nvshmem"}


def _run(args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "dry.json"
    proc = _run(["--device", "cpu", "--quick", "--out", str(out)])
    assert out.exists(), f"no JSON written; rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    with open(out) as f:
        return proc, json.load(f)


def test_dry_run_every_section_present_with_a_status(dry_run):
    proc, report = dry_run
    sections = report["sections"]
    assert list(sections) == list(SECTIONS), list(sections)
    for name, sec in sections.items():
        assert isinstance(sec.get("status"), str) and sec["status"], (name, sec)
        assert "elapsed_s" in sec and sec["elapsed_s"] >= 0, (name, sec)
    assert report["meta"]["device"] == "cpu" and report["meta"]["quick"] is True
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert report["meta"]["all_ok"] is True


def test_dry_run_no_section_crashed(dry_run):
    _, report = dry_run
    for name, sec in report["sections"].items():
        if name in CUDA_ONLY:
            assert sec["status"] == "skipped: no CUDA", (name, sec)
            continue
        assert sec["status"] == "ok", f"{name}: {sec['status']}: {sec.get('error')}\n{sec.get('traceback', '')}"
        assert "traceback" not in sec, (name, sec["traceback"])


def test_dry_run_checks_ran_and_passed(dry_run):
    _, report = dry_run
    for name in ("gather_rows", "logical_to_physical", "prepare_cp_mirror", "engram_hash", "grouped_gemm"):
        sec = report["sections"][name]
        checks = sec.get("checks", [])
        assert len(checks) >= 5, (name, checks)
        assert sec["checks_failed"] == 0 and sec["checks_passed"] == len(checks), [c for c in checks if not c["ok"]]
        # Every CPU backend that the op offers either ran its checks or says why it could not.
        for backend, state in sec.get("backends", {}).items():
            assert state == "ok" or state.startswith("unavailable: "), (name, backend, state)
    assert report["sections"]["gather_rows"]["backends"]["cpu"] == "ok"


def test_dry_run_records_measurements_against_peers(dry_run):
    _, report = dry_run
    bw = report["sections"]["gather_rows"]["bandwidth"]
    for key in ("torch.index_select", "roof_clone", "roof_copy_", "cpu"):
        assert bw[key]["median_ms"] > 0 and bw[key]["GBps"] > 0, (key, bw[key])
    assert bw["cpu"]["fraction_of_clone_roof"] > 0
    perf = report["sections"]["grouped_gemm"]["perf"]
    assert len(perf) == 5, list(perf)  # 2 contiguous + 3 masked shapes
    for name, entry in perf.items():
        assert entry["epkit_fp8"]["TFLOPs"] > 0 and entry["torch_matmul_bf16_roof"]["TFLOPs"] > 0, name
        assert entry["calc_diff"] <= 1e-3, (name, entry["calc_diff"])
    env = report["sections"]["env"]
    assert env["packages"]["torch"] and env["gpu"] is None


def test_dry_run_bench_section_is_epkit_bench_with_its_report(dry_run):
    """The ``bench`` section runs ``epkit bench``'s in-process families and writes the harness's own report."""
    from epkit.bench.compare import compare_docs, load_doc

    _, report = dry_run
    sec = report["sections"]["bench"]
    assert sec["size"] == "tiny" and set(sec["families"]) == {
        "gather",
        "cp_mirror",
        "engram",
        "experts",
        "grouped_gemm",
    }
    assert all(f["status"] == "ok" for f in sec["families"].values()), sec["families"]
    assert sec["checks_failed"] == 0 and sec["checks_passed"] >= 5, sec.get("checks")
    assert {r["family"] for r in sec["rows"]} == set(sec["families"])
    for row in sec["rows"]:  # every row names its roof or peer and the ratio to it
        assert row["peers"] or row["roof"], row["key"]
        assert all(p["median"] > 0 and p["name"] for p in row["peers"]), row["key"]
    assert sec["table"].count("\n") == len(sec["rows"]) + 2
    doc_path, md_path = sec["files"]
    assert doc_path.endswith("dry.bench.json") and md_path.endswith("dry.bench.md")
    doc = load_doc(doc_path)  # what `epkit bench compare` reads
    assert doc["machine"]["kind"].startswith(f"cpu-{os.cpu_count()}core") and doc["ok"] is True  # "-amx" on AMX
    assert compare_docs(doc, doc)["regressions"] == 0
    assert "| op | shape | backend |" in open_text(md_path)


def test_cli_rejects_unknown_sections_and_missing_cuda(tmp_path):
    proc = _run(["--device", "cpu", "--sections", "env,bogus", "--out", str(tmp_path / "x.json")], timeout=120)
    assert proc.returncode == 2 and "bogus" in proc.stderr, proc.stderr
    import torch

    if not torch.cuda.is_available():
        proc = _run(["--device", "cuda", "--out", str(tmp_path / "y.json")], timeout=120)
        assert proc.returncode == 2 and "no CUDA device" in proc.stderr, proc.stderr
        assert not (tmp_path / "y.json").exists()


def test_sections_run_in_the_order_given():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_for_args", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.parse_args(["--sections", "env,nvshmem,gather_rows,nvshmem"]).sections == [
        "env",
        "nvshmem",
        "gather_rows",
    ]
    args = mod.parse_args([])
    assert args.sections == list(mod.SECTIONS) and args.budgets == mod.BUDGETS
    # A fixed budget for one section; the others share what is left in their default proportions.
    args = mod.parse_args(["--budget", "300", "--section-budget", "nvshmem=90"])
    assert args.budgets["nvshmem"] == 90
    others = {n: b for n, b in args.budgets.items() if n != "nvshmem"}
    assert abs(sum(others.values()) - 210) < 1e-9
    assert abs(others["grouped_gemm"] / others["env"] - mod.BUDGETS["grouped_gemm"] / mod.BUDGETS["env"]) < 1e-9
    # --budget is split over the sections that run; a fixed budget for a section not run takes nothing.
    args = mod.parse_args(["--sections", "env", "--budget", "50", "--section-budget", "nvshmem=60"])
    assert args.budgets == {"env": 50}
    args = mod.parse_args(
        ["--sections", "nvshmem,gather_rows,env", "--budget", "100", "--section-budget", "nvshmem=30"]
    )
    assert args.budgets["nvshmem"] == 30 and abs(args.budgets["gather_rows"] - 70 * 70 / 85) < 1e-9, args.budgets
    for bad in (
        ["--section-budget", "nvshmem"],
        ["--section-budget", "bogus=5"],
        ["--budget", "50", "--section-budget", "nvshmem=60"],
    ):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)


def _load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_children", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_section(name: str):
    """A module of bench/gpu_sections/ (loading gpu_check.py puts bench/ on sys.path, as running it does)."""
    import importlib

    _load_script()
    return importlib.import_module(f"gpu_sections.{name}")


def test_child_results_survive_a_child_that_dies(tmp_path, capfd, monkeypatch):
    """NVSHMEM ends its process on failure: what a child saved before that reaches the report."""
    mod = _load_section("nvshmem")
    child = tmp_path / "child.py"
    child.write_text(
        "import json, os, sys\n"
        "mode = sys.argv[1]\n"
        "if mode == 'file':\n"
        "    json.dump({'checks': [{'name': 'first', 'ok': True}]}, open(sys.argv[-1], 'w'))\n"
        "    print('progress line', flush=True)\n"
        "    sys.stderr.write('nvshmem: fatal\\n'); sys.stderr.flush()\n"
        "    os._exit(7)\n"
        "print('log line'); print(json.dumps({'signal': 8}), flush=True)\n"
        "os._exit(0 if mode == 'line' else 5)\n"
    )
    monkeypatch.setattr(mod, "SCRIPT", str(child))
    died = mod.run_child(["file"], 60, json_file=True)
    assert died["exit"] == 7 and "nvshmem: fatal" in died["detail"], died
    assert died["result"] == {"checks": [{"name": "first", "ok": True}]}
    assert "progress line" in capfd.readouterr().out  # a JSON-file child's progress shows as it runs
    ok = mod.run_child(["line"], 60)
    assert ok == {"exit": 0, "detail": "", "result": {"signal": 8}}, ok
    assert "(child) log line" in capfd.readouterr().out
    crashed_after = mod.run_child(["other"], 60)  # the JSON line is kept even if the exit crashes
    assert crashed_after["exit"] == 5 and crashed_after["result"] == {"signal": 8}, crashed_after


def open_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_child_context_saves_its_results_at_every_step(tmp_path):
    mod = _load_section("nvshmem_child")
    path = str(tmp_path / "partial.json")
    res: dict = {}
    ctx = mod.ChildCtx(path, res, quick=True)
    ctx.begin("nvshmem", 60.0)
    res["nbytes"] = 64
    ctx.check("put_signal")
    assert json.loads(open_text(path)) == {"nbytes": 64}
    res["checks"] = [{"name": "a", "ok": False}]
    ctx.begin("nvshmem", -1.0)  # budget spent: the step still saves, then stops the section
    with pytest.raises(_load_section("common").BudgetExceeded):
        ctx.check("bandwidth")
    assert json.loads(open_text(path))["checks"] == [{"name": "a", "ok": False}]


def test_sigterm_writes_the_report_with_the_section_in_progress(tmp_path):
    """An outer `timeout` (gpu_run.sh's) ends the run like Ctrl-C: the JSON says which section it stopped."""
    import signal

    out = tmp_path / "term.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--sections", "env,prepare_cp_mirror", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # wait until the second section is under way
            if "prepare_cp_mirror: start" in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.stdout.close()
    report = json.loads(out.read_text())
    assert report["meta"]["exit"] == "interrupted (signal 15)", report["meta"]
    assert report["sections"]["env"]["status"] == "ok"
    assert report["sections"]["prepare_cp_mirror"]["status"] == "interrupted", report["sections"]


def _mega_moe_on_cpu(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    mod = _load_section("nvshmem_mega")
    common = _load_section("common")
    ctx = common.Ctx(torch.device("cpu"), True, time.perf_counter())
    ctx.begin("nvshmem", 600.0)
    res: dict = {}
    mod.mega_moe_check(ctx, res, dist.new_group(backend="gloo"), dist.group.WORLD)
    return res


def test_mega_moe_section_runs_its_checks_on_cpu_rows():
    """The nvshmem section's Mega MoE check, both groups on CPU rows here (on the GPU one is NCCL's): every
    check it records passes, and it records the ones the GPU run relies on."""
    from epkit.testing.multiprocess import run_ranks

    (res,) = run_ranks(_mega_moe_on_cpu, 1, timeout=300)
    names = [c["name"] for c in res["checks"]]
    assert len(names) == 7, names
    assert all(c["ok"] for c in res["checks"]), res["checks"]
    assert res["mega_moe"]["bf16xbf16_diff_vs_float64"] < 1e-4
