"""``epkit bench``: the harness, its rows (each against a roof or peer), the table, the JSON, the plots, the
command line, and ``epkit bench compare`` flagging a deliberately slowed kernel but not a second run of the
same code. The families run at their ``tiny`` sizes (the figures mean nothing there; the control flow and the
correctness checks of every case do)."""

import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import epkit.bench.gather as bench_gather
from epkit.bench import FAMILIES
from epkit.bench.compare import compare_docs, format_moves
from epkit.bench.core import ONE_THREAD_WORDS, BenchCtx, Ref, copy_roof, make_row
from epkit.bench.plots import BAR_FAMILIES, write_plots
from epkit.bench.report import COLUMNS, markdown_report, markdown_table, threads_line
from epkit.bench.runner import SCHEMA, run_bench
from epkit.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_doc():
    """Every family at its tiny size on the CPU (the multi-rank ones spawn 2 ranks: ~20 s on 2 cores)."""
    return run_bench(FAMILIES, "cpu", "tiny", progress=False)


def test_every_family_runs_and_checks_its_inputs(tiny_doc):
    assert tiny_doc["schema"] == SCHEMA and tiny_doc["ok"] is True, tiny_doc["families"]
    assert list(tiny_doc["families"]) == list(FAMILIES)
    assert {f["status"] for f in tiny_doc["families"].values()} == {"ok"}
    assert {r["family"] for r in tiny_doc["rows"]} == set(FAMILIES)
    checked = {c["family"] for c in tiny_doc["checks"]}
    assert checked == set(FAMILIES) and all(c["ok"] for c in tiny_doc["checks"]), tiny_doc["checks"]
    m = tiny_doc["machine"]
    with open("/proc/cpuinfo") as f:  # a CPU with AMX tiles is a kind of its own (its GEMMs are another's)
        amx = "amx_tile" in f.read().split()
    assert m["kind"] == f"cpu-{os.cpu_count()}core" + ("-amx" if amx else "")
    assert m["cores"] == os.cpu_count() and m["cpu_model"]
    assert len(m["loadavg_before"]) == 3 and len(m["loadavg_after"]) == 3
    assert m["versions"]["torch"] and {"triton", "tilelang", "numpy"} <= set(m["versions"]) and "git" in m


def test_every_row_names_its_roof_or_peer_and_the_ratio(tiny_doc):
    keys = [r["key"] for r in tiny_doc["rows"]]
    assert len(keys) == len(set(keys))
    for r in tiny_doc["rows"]:
        assert r["roof"] or r["peers"], r["key"]
        assert r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["throughput"] > 0
        for ref in [*r["peers"], *([r["roof"]] if r["roof"] else [])]:
            assert ref["name"] and ref["median"] > 0 and ref["q25"] <= ref["median"] <= ref["q75"], (r["key"], ref)
    by_op = {r["op"]: r for r in tiny_doc["rows"]}
    # the dispatch/combine peer is the minimal textbook exchange, not collectives/ep_reference.py
    assert by_op["dispatch+combine"]["peers"][0]["name"].startswith("minimal all_to_all_single")
    assert by_op["gather_rows"]["peers"][0]["name"] == "torch.index_select"
    assert by_op["decode step"]["peers"][0]["name"].startswith("one-process model")
    assert "dispatch+combine" in by_op["decode step"]["note"]
    assert by_op["m_grouped_fp8_gemm_nt_contiguous"]["roof"]["name"].startswith("dense torch.matmul")


def test_markdown_table_has_one_line_per_row_with_peer_and_ratio(tiny_doc):
    table = markdown_table(tiny_doc["rows"])
    lines = table.splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |" and len(lines) == len(tiny_doc["rows"]) + 2
    for line, row in zip(lines[2:], tiny_doc["rows"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(COLUMNS) and cells[0] == row["op"]
        pct, roof, ratio, peer = cells[5:9]
        assert (pct.endswith("%") and roof != "-") or (ratio.endswith("x") and peer != "-"), line
    report = markdown_report(tiny_doc)
    assert report.startswith(f"# epkit bench: {tiny_doc['machine']['kind']}") and "load " in report


def test_plots_are_images_of_what_their_titles_say(tiny_doc, tmp_path, capsys):
    import matplotlib.image

    gaps = []
    written = write_plots(tiny_doc, str(tmp_path / "a"), gaps)
    names = sorted(os.path.basename(p) for p in written)
    ran = {r["family"] for r in tiny_doc["rows"]}  # every family that ran has a chart
    bars = [f"{f}.png" for f in BAR_FAMILIES if f in ran]
    assert names == sorted(["cp_mirror_engram.png", "dispatch_combine.png", "grouped_gemm.png", *bars])
    assert gaps == [f"no chart for {n}: {f['status']}" for n, f in tiny_doc["families"].items() if n not in ran]
    # `epkit bench plot` draws the same charts from the saved JSON (a GPU machine's run, plotted elsewhere)
    (tmp_path / "run.json").write_text(json.dumps(tiny_doc))
    assert main(["bench", "plot", str(tmp_path / "run.json"), str(tmp_path / "b")]) == 0
    assert sorted(os.listdir(tmp_path / "b")) == names and capsys.readouterr().err.count("wrote") == len(names)
    for path in written:
        img = matplotlib.image.imread(path)
        assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 500, (path, img.shape)
        assert float(img[..., :3].std()) > 0.01, path  # not a blank canvas


def test_make_row_ratios_are_per_round_medians():
    op = [2.0, 2.0, 4.0]
    row = make_row(
        "f",
        "op",
        "s",
        "b",
        op,
        work=1e9,
        unit="GB/s",
        roof=Ref("copy", [3.0, 1.0, 2.0]),
        peers=[Ref("p", [4.0, 6.0, 4.0])],
    )
    assert row["median_ms"] == 2.0 and row["throughput"] == pytest.approx(500.0)
    # the roof's rate is its fastest sample (1 ms): per round 1/2, 1/2 and 1/4 of it
    assert row["roof"]["median"] == pytest.approx(0.5) and row["roof"]["q25"] == pytest.approx(0.375)
    assert row["roof"]["throughput"] == pytest.approx(1000.0) and row["roof"]["median_ms"] == 2.0
    assert [row["peers"][0][k] for k in ("median", "q25", "q75")] == pytest.approx([2.0, 1.5, 2.5])
    half = make_row("f", "op", "s", "b", op, work=1e9, unit="GB/s", roof=Ref("copy", [1.0] * 3, work=2e9))
    assert half["roof"]["median"] == pytest.approx(0.25)  # the roof did twice the work in the same time
    with pytest.raises(ValueError, match="roof or a peer"):
        make_row("f", "op", "s", "b", op, work=1.0, unit="GB/s")


def test_copy_roof_copies_half_the_traffic_it_is_given(monkeypatch):
    """A roof moves the op's bytes (read + write): half of them copied, rounded up to whole 8-byte words; with
    several threads it may be the one-thread slices (and says so), with one thread it is one ``copy_``."""
    cpu = torch.device("cpu")
    assert copy_roof(1 << 20, cpu)[0].startswith("copy_ 512 KiB (r+w 1 MiB)")
    assert copy_roof(2, cpu)[0] == "copy_ 8 B (r+w 16 B)"  # at least one word
    big = 4 * ONE_THREAD_WORDS * 8 * 2  # four one-thread slices
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        name, fn = copy_roof(big, cpu)
        assert name in ("copy_ 1 MiB (r+w 2 MiB)", "copy_ 1 MiB (r+w 2 MiB), 1 thread"), name
        assert threads == 2 or not name.endswith("1 thread"), name
        fn()


def test_compare_flags_a_slowed_kernel_and_passes_the_same_code(monkeypatch, tmp_path, capsys):
    # One thread, and only the backend that runs on torch's threads (TileLang's kernel has threads of its own):
    # on a 2-core machine shared with other jobs, a multi-threaded kernel's ratio to a single-threaded peer swings
    # by 2-4x between runs as the neighbours' load comes and goes (measured with two busy loops beside the test).
    monkeypatch.setattr(bench_gather, "timed_backends", lambda op, device: ["cpu"])
    threads = torch.get_num_threads()
    first = run_bench(["gather"], "cpu", "tiny", progress=False, rounds=9, threads=1)
    second = run_bench(["gather"], "cpu", "tiny", progress=False, rounds=9, threads=1)
    # Two runs of the same code: between runs (fresh buffers, the neighbours' load) a ratio moves by up to ~20%
    # here, outside either run's own noise (two busy loops beside the test); a 30% threshold passes them, while
    # the injected sleep (~-80%) is flagged at the default 10%.
    # On a machine shared with other jobs one pair of runs can still land on either side of a load spike: the
    # same code gets three tries to pass (the slowed kernel below is flagged at the first).
    same = compare_docs(first, second, threshold=0.3)
    for _ in range(2):
        if same["regressions"] == 0:
            break
        second = run_bench(["gather"], "cpu", "tiny", progress=False, rounds=9, threads=1)
        same = compare_docs(first, second, threshold=0.3)
    assert same["regressions"] == 0, format_moves(same)
    real = bench_gather.gather_rows

    def slowed(*args, **kwargs):
        time.sleep(0.01)  # an injected sleep: several times the op's own time at this size
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_gather, "gather_rows", slowed)
    slow = run_bench(["gather"], "cpu", "tiny", progress=False, rounds=9, threads=1)
    assert torch.get_num_threads() == threads and first["machine"]["torch_threads"] == 1  # set for the run only
    paths = {}
    for name, doc in (("first", first), ("second", second), ("slow", slow)):
        paths[name] = str(tmp_path / f"{name}.json")
        with open(paths[name], "w") as f:
            json.dump(doc, f)
    assert main(["bench", "compare", paths["first"], paths["second"], "--threshold", "0.3"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(": ok")
    assert main(["bench", "compare", paths["first"], paths["slow"]]) == 1
    out = capsys.readouterr().out
    assert "| gather|gather_rows|4096x1024 bf16 perm|cpu | x vs torch.index_select |" in out, out
    assert "| REGRESSION |" in out.split("x vs torch.index_select")[1].splitlines()[0], out
    assert main(["bench", "compare", paths["first"], paths["slow"], "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["regressions"] >= 1


def test_compare_refuses_runs_of_other_machine_kinds(tmp_path, capsys):
    doc = {"schema": SCHEMA, "machine": {"kind": "cpu-2core"}, "rows": [], "checks": []}
    other = {**doc, "machine": {"kind": "h200"}}
    for name, d in (("a", doc), ("b", other)):
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "different machine kinds (cpu-2core vs h200)" in err
    (tmp_path / "c.json").write_text("{}")
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "c.json")]) == 2
    assert "not an epkit bench report" in capsys.readouterr().err


def test_bad_threads_is_one_clear_line(capsys):
    assert main(["bench", "--threads", "0", "--only", "gather"]) == 2
    assert capsys.readouterr().err == "epkit bench: error: --threads must be >= 1, got 0\n"


def test_device_cuda_without_cuda_is_one_clear_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--device", "cuda", "--only", "gather"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "epkit bench: error: --device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)\n"
    )


def test_cli_writes_only_what_it_is_asked_for(tmp_path, capsys, monkeypatch):
    """A table on stdout, a progress line per case on stderr, and the files asked for, nothing else."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "epkit", "bench", "--quick", "--only", "cp_mirror", "--json", "r.json", "--markdown"]
    res = subprocess.run([*cmd, "r.md"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(os.listdir(tmp_path)) == ["r.json", "r.md"]
    assert res.stdout.startswith("cpu-") and "| prepare_cp_mirror | 64 seqs 16384 tok cp8 | cpu |" in res.stdout
    assert "1/2" in res.stderr and "2/2" in res.stderr and "wrote r.json" in res.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["args"]["size"] == "quick" and len(doc["rows"]) >= 2
    assert markdown_table(doc["rows"]) in (tmp_path / "r.md").read_text()
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--quick", "--only", "experts", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schema"] == SCHEMA  # `--json` alone: the document is all of stdout
    assert sorted(os.listdir(tmp_path)) == ["r.json", "r.md"]


@pytest.fixture(scope="module")
def loaded_run(tmp_path_factory):
    """``epkit bench --quick --only experts`` (the main job's table, one family) with torch at 2 threads on a
    machine whose 1-minute load average is faked at its core count (over half its cores): stdout and the JSON."""
    path = tmp_path_factory.mktemp("loaded") / "run.json"
    before = torch.get_num_threads()
    cores = os.cpu_count()
    torch.set_num_threads(2)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "getloadavg", lambda: (float(cores), float(cores), 1.0))
            out = io.StringIO()
            mp.setattr(sys, "stdout", out)
            assert main(["bench", "--quick", "--only", "experts", "--json", str(path)]) == 0
    finally:
        torch.set_num_threads(before)
    return out.getvalue(), json.loads(path.read_text())


def test_a_loaded_machine_measures_one_thread_per_rank_and_the_header_says_why(loaded_run):
    out, doc = loaded_run
    cores = os.cpu_count()
    assert doc["machine"]["torch_threads"] == 1 and doc["args"]["threads"]["threads"] == 1, doc["args"]
    header = out.split("\n| op |", 1)[0]
    assert f"threads: 1 per rank (auto: load average {cores:.2f} > {cores / 2:g}, half of {cores} cores" in header


def test_auto_threads_on_an_idle_machine_keep_torchs_default(monkeypatch):
    from epkit.bench.machine import choose_threads

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    idle = choose_threads("auto")
    assert idle["threads"] == torch.get_num_threads() and idle["pinned"] is False
    assert "torch's default" in idle["why"] and "load average 0.00" in idle["why"]
    assert choose_threads(3) == {"requested": 3, "threads": 3, "pinned": True, "why": "--threads 3"}
    monkeypatch.setattr(os, "getloadavg", lambda: (2.0 * os.cpu_count(), 0.0, 0.0))
    assert choose_threads("auto")["threads"] == 1 and choose_threads("auto")["pinned"] is True
    # the spawned ranks: the cores shared out, and no more than the run's pinned threads
    cores = os.cpu_count()
    assert BenchCtx("cpu", "tiny").rank_threads(1) == cores and BenchCtx("cpu", "tiny", threads=1).rank_threads(1) == 1
    # several threads on a loaded machine (forced, or a run that did not choose) are called noise above the table
    machine = {"torch_threads": 2, "cores": cores, "loadavg_before": [cores + 0.5, 0.0, 0.0], "device": "cpu"}
    for threads in (choose_threads(2), None):
        line = threads_line({"machine": machine, "args": {"threads": threads} if threads else {}})
        assert "exceeds half the cores" in line and "(--threads auto or 1)" in line, line


def test_the_text_table_has_a_legend_for_its_ratios(loaded_run):
    out, doc = loaded_run
    table, legend = out.split("\n| op |", 1)[1].split("\n\n", 1)
    assert "legend:" in legend
    assert "x vs peer: the peer's time / this row's time" in legend and "> 1: epkit faster" in legend
    assert "% of roof" in legend and "median (min-max)" in legend
    assert "legend:" in markdown_report(doc)


def _sweep_doc(families: dict) -> dict:
    """A report of synthetic rows shaped as ``gather``'s and ``experts``' are (their sweeps, peers and roofs)."""
    rows = []
    for rows_n in (2048, 65536):
        for dt in ("bf16", "float32"):
            for b in ("cpu", "tilelang"):
                rows.append(
                    make_row(
                        "gather",
                        "gather_rows",
                        f"{rows_n}x2048 {dt} perm",
                        b,
                        [1.0, 1.2, 1.1],
                        work=rows_n * 8e3,
                        unit="GB/s",
                        roof=Ref("copy_ 8 MiB (r+w 16 MiB)", [0.5] * 3),
                        peers=[Ref("torch.index_select", [1.5] * 3), Ref("reference (Python loop)", [90.0] * 3)],
                        sweep={"rows": rows_n, "dtype": dt},
                    )  # fmt: skip
                )
    for n in (4096, 16384):
        rows.append(
            make_row(
                "experts",
                "logical_to_physical",
                f"{n}x6 ids 384e EP64",
                "cpu",
                [0.5, 0.6, 0.55],
                work=n * 48,
                unit="GB/s",
                roof=Ref("copy_ 96 KiB (r+w 192 KiB)", [0.01] * 3),
                peers=[
                    Ref("index_select of first replicas (lower bound)", [0.05] * 3),
                    Ref("reference (Python loop)", [20.0] * 3),
                ],
                sweep={"tokens": n},
            )  # fmt: skip
        )
    return {"schema": SCHEMA, "machine": {"kind": "cpu-2core"}, "rows": rows, "families": families}


def test_plots_draw_gather_and_experts_and_say_which_families_have_none(tmp_path, capsys):
    import matplotlib.image

    fams = {"gather": {"status": "ok"}, "experts": {"status": "ok"}, "ep_hosts": {"status": "skipped: not root"}}
    doc = _sweep_doc(fams)
    written = write_plots(doc, str(tmp_path / "a"))
    assert sorted(os.path.basename(p) for p in written) == ["experts.png", "gather.png"]
    for path in written:
        img = matplotlib.image.imread(path)
        assert img.shape[0] > 300 and float(img[..., :3].std()) > 0.01, path
    (tmp_path / "run.json").write_text(json.dumps(doc))
    assert main(["bench", "plot", str(tmp_path / "run.json"), str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert err.count("wrote") == 2
    assert "epkit bench: no chart for ep_hosts: skipped: not root" in err, err
