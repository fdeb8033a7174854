"""Rung 3 as launched: every Triton kernel the project launches on CUDA, compiled for sm_90 from the argument
values its host launcher really passes, through Triton's own launch specialization (``epkit.testing.launches``).

The launches are recorded, never written by hand (``epkit.testing.launch_shapes``): the EP kernels on CPU ranks
(their source under the interpreter, every rank's host launcher also deciding as for CUDA), every other Triton
op on CPU tensors, and every launcher at the GPU run's sizes. ``scripts/test.sh`` records everything once before
pytest (1, 2, 4 and 8 ranks: ``python -m epkit.testing.rung3 record``) and names the file in
``EPKIT_LAUNCH_RECORDS``; run alone, this module records the rank runs on 1 and 2 ranks, the ops and the target
shapes itself. It checks the compiles of the target shapes and the small kernels under this environment's Triton:
under ``scripts/test.sh``, those its sweep made before pytest (every record under each Triton version users have,
``python -m epkit.testing.rung3 sweep``, kept in the folder ``EPKIT_LAUNCH_COMPILED`` names); run alone, compiled
here.
"""

import multiprocessing
import os
import pathlib
import re
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest
from test_ep_kernels import KERNELS as EP  # the EP kernels (the launch counter's names)

from epkit.testing import launches, rung3
from epkit.testing.launch_shapes import record_ops, record_rank_runs, record_target_shapes
from epkit.testing.markers import requires_triton

pytestmark = requires_triton

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Every Triton kernel the project launches.
KERNELS = EP | {
    "_persistent_kernel",
    "_grouped_gemm_kernel",
    "_gather_rows_kernel",
    "_prepare_cp_mirror_kernel",
    "_engram_hash_kernel",
    "_logical_to_physical_kernel",
    "_copy_rows_kernel",
}

#: The kernels whose recorded small-shape launches only the sweep compiles (pytest compiles their target shapes).
BIG = EP | {"_persistent_kernel", "_grouped_gemm_kernel"}


def _name(entry_or_result) -> str:
    return (entry_or_result["kernel"] if isinstance(entry_or_result, dict) else entry_or_result.kernel).split(":")[1]


@pytest.fixture(scope="module")
def records():
    """The records ``scripts/test.sh`` made for the sweep this run (``EPKIT_LAUNCH_RECORDS``), else the rank runs
    on 1 and 2 ranks, the ops and the target shapes, recorded here."""
    path = os.environ.get("EPKIT_LAUNCH_RECORDS")
    if path:
        return launches.load(path)
    return launches.merge(record_rank_runs((1, 2)), record_ops(), record_target_shapes())


def _kept(folder: str, keys: list[str]) -> list:
    """The compiles the sweep kept in ``folder`` under this environment's Triton, one per key of ``keys``; fails
    the tests that use them unless every one is there (the records or a kernel changed since, or the sweep did
    not run), and :func:`launches.load_compiled` raises on compiles of another Triton."""
    import triton

    path = rung3.whole_path(folder, triton.__version__)
    if not os.path.exists(path):
        pytest.fail(f"EPKIT_LAUNCH_COMPILED={folder}: no compiles kept under Triton {triton.__version__} ({path})")
    by_key = launches.load_compiled(path)
    missing = [k for k in keys if k not in by_key]
    if missing:
        pytest.fail(f"{path}: {len(missing)} of {len(keys)} specializations not kept (records or kernels changed "
                    f"since the sweep?), e.g. {missing[0]}")  # fmt: skip
    return [by_key[k] for k in keys]


@pytest.fixture(scope="module")
def compiled(records):
    """The launches at the target shapes and those of the small kernels (gathers, hashes, index maps), one compile
    per distinct Triton specialization, each with its group's entries. ``scripts/test.sh`` compiles every recorded
    launch before pytest under each Triton version users have (``python -m epkit.testing.rung3 sweep``, which
    fails the run on any failure or spill) and keeps the compiles whole (PTX and SASS included) in the folder it
    names in ``EPKIT_LAUNCH_COMPILED``: these are then this Triton's, looked up by specialization (:func:`_kept`),
    not compiled twice. Run alone, compiled here (two worker processes)."""
    groups = [(k, g) for k, g in launches.unique(records).items()
              if _name(g[0]) not in BIG or any(w.startswith("target") for e in g for w in e["where"])]  # fmt: skip
    if os.environ.get("EPKIT_LAUNCH_COMPILED"):
        results = _kept(os.environ["EPKIT_LAUNCH_COMPILED"], [k for k, _ in groups])
    else:
        with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(launches.compile_entry, [g[0] for _, g in groups]))
    for res, (_, group) in zip(results, groups):
        res.where = [w for e in group for w in e["where"]]
        res.entry = group[0]
    return results


def _values(entries, kernel: str, arg: str) -> set:
    """Every recorded value of argument ``arg`` of ``kernel`` (positional or keyword)."""
    import importlib

    out = set()
    for e in entries:
        if _name(e) != kernel:
            continue
        module, name = e["kernel"].split(":")
        names = getattr(importlib.import_module(module), name).arg_names
        if arg in e["kwargs"]:
            out.add(e["kwargs"][arg])
        elif names.index(arg) < len(e["args"]):
            out.add(e["args"][names.index(arg)])
    return out


def test_the_records_hold_every_kernel_and_the_cases_that_specialize(records):
    """Every Triton kernel, and for the EP kernels: W = 1, 2 (run) and 8 (the target shapes), ranks 0 and 1, a
    first and a later exchange (epochs 1 and 2 in the handles), empty and full batches, rows with and without
    FP8 scales."""
    assert {_name(e) for e in records} == KERNELS
    for kernel in ("_ll_dispatch_send", "_dispatch_send", "_notify", "_combine_send", "_ll_combine_send"):
        assert {1, 2, 8} <= _values(records, kernel, "W"), kernel
        assert {0, 1} <= _values(records, kernel, "me"), kernel
    assert {1, 2} <= _values(records, "_ll_combine_send", "ident1"), "first and later low-latency pairs"
    assert {1, 2} <= _values(records, "_agree", "ident1"), "first and later combines"
    assert {0, 16} <= _values(records, "_ll_dispatch_send", "T") and {0, 64} <= _values(records, "_dispatch_send", "T")
    assert {0} < _values(records, "_dispatch_recv", "SB") and {0} < _values(records, "_ll_dispatch_recv", "SB")
    assert {True, False} == _values(records, "_dispatch_recv", "EXPAND")
    assert any(w.startswith("target") for e in records for w in e["where"])


def test_every_target_launch_compiles_for_sm90_without_spills(compiled):
    failed = [f"{r.kernel} at {r.where[:2]}: {r.error}" for r in compiled if r.error]
    assert not failed, "\n".join(failed)
    spilled = [f"{r.kernel} at {r.where[:2]}: {r.spilled_bytes} B" for r in compiled if r.spills]
    assert not spilled, spilled
    for r in compiled:
        assert ".target sm_90" in r.ptx and r.registers is not None and r.registers <= 255, (r.kernel, r.where[:2])


def test_a_spill_is_local_memory_or_more_than_a_few_parked_registers():
    """What the sweep fails on: any local memory; registers stored to the stack beyond ``PARKED_BYTES``; a stack
    frame nothing is stored to (a call's return) is no spill."""
    sass = "/*0bf0*/  STL [R1], R11 ;\n/*2660*/  LDL.LU R18, [R1] ;"
    parked = launches.CompiledLaunch("k:k", [], sass=sass, local_bytes=0, stack_bytes=8)
    assert not parked.spills and parked.parked == 8
    big = launches.CompiledLaunch("k:k", [], sass=sass, local_bytes=0, stack_bytes=launches.PARKED_BYTES + 4)
    assert big.spills and big.spilled_bytes == launches.PARKED_BYTES + 4
    assert launches.CompiledLaunch("k:k", [], sass="", local_bytes=4, stack_bytes=0).spills
    frame = launches.CompiledLaunch("k:k", [], sass="CALL.REL.NOINC 0x90 ;", local_bytes=0, stack_bytes=8)
    assert not frame.spills and frame.spilled_bytes == 0


def test_kept_compiles_are_the_compiles_and_serve_only_their_own_triton_and_specializations(
    records, compiled, tmp_path
):
    """What ``compiled`` loads under ``scripts/test.sh``: ``rung3 compile --whole`` (the sweep's) keeps each compile
    whole, here the small kernels' equal to the fixture's in every field but where and the seconds; a
    specialization not kept, no compiles of this Triton, or compiles of another Triton fail instead of checking
    nothing."""
    import dataclasses
    import gzip
    import json

    import triton

    small = [e for e in records if _name(e) in ("_copy_rows_kernel", "_engram_hash_kernel")]
    launches.save(small, str(tmp_path / "records.json"))
    path = rung3.whole_path(str(tmp_path), triton.__version__)
    argv = ["compile", str(tmp_path / "records.json"), "--out", str(tmp_path / "summary.json"), "--whole", path]
    assert rung3.main(argv) == 0
    keys = list(launches.unique(small))
    fixture = {launches.triton_key(r.entry): r for r in compiled}
    for key, kept in zip(keys, _kept(str(tmp_path), keys)):
        got, want = dataclasses.asdict(kept), dataclasses.asdict(fixture[key])
        assert kept.ptx and kept.sass and {**got, "where": 0, "seconds": 0} == {**want, "where": 0, "seconds": 0}
    with pytest.raises(pytest.fail.Exception, match="not kept"):
        _kept(str(tmp_path), [*keys, "a specialization the sweep never saw"])
    with pytest.raises(pytest.fail.Exception, match="no compiles kept"):
        _kept(str(tmp_path / "elsewhere"), keys)
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    with gzip.open(path, "wt") as f:
        json.dump(dict(doc, triton="0.0"), f)
    with pytest.raises(ValueError, match="under Triton 0.0"):
        _kept(str(tmp_path), keys)


# What the EP kernels must compile to (at the target shapes: hidden 7168, 256 experts, top-8).
_ROWS = {"_ll_dispatch_send", "_ll_dispatch_recv", "_ll_combine_send", "_ll_combine_recv", "_dispatch_send",
         "_dispatch_recv", "_combine_send", "_combine_reduce"}  # fmt: skip
_WAITS = {"_ll_dispatch_recv", "_ll_combine_recv", "_notify", "_dispatch_recv", "_agree", "_combine_reduce"}
_SIGNALS = {"_ll_dispatch_send", "_ll_combine_send", "_notify", "_dispatch_send", "_agree", "_combine_send"}


def _ptx_ops(ptx: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"\b((?:ld|st|red|atom)\.global[\w.]*)", ptx)}


def _moves_16_bytes(op: str, kind: str) -> bool:
    """``ld``/``st`` of one 16-byte vector: Triton 3.9 writes ``v4.b32``, 3.7 also ``v2.b64``."""
    m = re.fullmatch(rf"{kind}\.global(?:\.\w+)*?\.v(\d+)\.[bfsu](\d+)", op)
    return m is not None and int(m.group(1)) * int(m.group(2)) == 128


def test_ep_kernels_move_rows_in_16_byte_vectors_and_wait_on_uniform_values(compiled):
    """16-byte row moves; acquire waits bounded by ``%globaltimer``; release signals; no fused multiply-add (it
    would round differently from the CPU path); and no volatile load anywhere: every value a wait or the
    liveness check branches on is read once and broadcast (scalar atomics, the reduced timer), so that no two
    threads of a program can leave a loop holding a ``bar.sync`` at different iterations."""
    target = [r for r in compiled if _name(r) in EP]
    assert {_name(r) for r in target} == EP
    for r in [r for r in compiled if _name(r) in EP]:
        name, ops = _name(r), _ptx_ops(r.ptx)
        assert "ld.volatile" not in r.ptx, f"{name}: a per-thread volatile read"
        unguarded = [line for line in r.ptx.splitlines() if re.search(r"\b(ld|atom)\.global\.sys\.", line)
                     and not line.strip().startswith("@%p")]  # fmt: skip
        assert not unguarded, f"{name}: system-scope reads made by every thread: {unguarded[:3]}"
        assert "fma.rn.f32" not in r.ptx, f"{name}: a fused multiply-add changes the rounding"
        if name in _WAITS:
            assert re.search(r"(atom|ld)\.global\.sys\.acquire", r.ptx) and "%globaltimer" in r.ptx, name
        if name in _SIGNALS:
            assert "red.global.sys.release.add" in r.ptx or "atom.global.sys.release.add" in r.ptx, name
        if name in _ROWS and r in target:
            assert any(_moves_16_bytes(o, "ld") for o in ops) and any(_moves_16_bytes(o, "st") for o in ops), (
                name,
                sorted(ops),
            )
    assert any("div.rn.f32" in r.ptx for r in target if _name(r) == "_ll_dispatch_send")  # the IEEE quantizer


def test_other_kernels_compile_to_what_they_are_for(compiled):
    """Loads and stores of global memory everywhere; the Engram hash's floor-mod by float64 quotients (no
    integer division); the grouped GEMMs on Hopper's ``wgmma`` with FP8 operands fed straight in."""
    for r in compiled:
        assert ("ld.global" in r.ptx or "cp.async.bulk" in r.ptx) and "st.global" in r.ptx, _name(r)
        assert "STG" in r.sass, _name(r)
    engram = [r for r in compiled if _name(r) == "_engram_hash_kernel"]
    assert engram and all("cvt.rzi.s64.f64" in r.ptx and "div.s64" not in r.ptx for r in engram)
    assert all("rem.s64" not in r.ptx for r in engram)
    gemms = [r for r in compiled if _name(r) == "_grouped_gemm_kernel" and any("target" in w for w in r.where)]
    assert gemms and all("wgmma.mma_async" in r.ptx for r in gemms)
    assert any("e4m3" in r.ptx for r in gemms)


#: The wgmma operand types of each persistent GEMM kind (FP4 weights decoded to e5m2 in registers).
_WGMMA = {"fp8": ".f32.e4m3.e4m3", "fp8_fp4": ".f32.e4m3.e5m2", "bf16": ".f32.bf16.bf16"}


def test_persistent_gemm_is_tma_into_wgmma_at_every_target_configuration(compiled):
    """The persistent grouped GEMM at the target shapes, in each layout and configuration a launch reaches:
    TMA loads waited on mbarriers, ``wgmma`` of the configuration's N on FP8 (or bf16) operands straight from
    shared memory, shared memory within an sm_90 block, the FP8 promotion ``acc += dot * scale`` one FFMA per
    element, and the FP4 decode by byte permutes where configured."""
    from epkit.kernels.triton.grouped_gemm_configs import SM90_MAX_SHARED
    from epkit.kernels.triton.grouped_gemm_persistent import _KINDS, FP4_DECODES, LAYOUTS

    _KIND_NAMES, _LAYOUT_NAMES = {v: k for k, v in _KINDS.items()}, {v: k for k, v in LAYOUTS.items()}

    seen = set()
    for r in compiled:
        if _name(r) != "_persistent_kernel" or not any("target" in w for w in r.where):
            continue
        kw = r.entry["kwargs"]
        kind, layout = _KIND_NAMES[kw["B_KIND"]], _LAYOUT_NAMES[kw["LAYOUT"]]
        decode = FP4_DECODES[kw["FP4_DECODE"]]
        ctx = f"{kind} {layout} {kw['BLOCK_M']}x{kw['BLOCK_N']} {decode}"
        seen.add((kind, layout, kw["BLOCK_N"], decode))
        assert f"wgmma.mma_async.sync.aligned.m64n{min(kw['BLOCK_N'], 128)}" in r.ptx, ctx
        assert _WGMMA[kind] in r.ptx, ctx
        assert "cp.async.bulk.tensor.2d" in r.ptx and "mbarrier.try_wait" in r.ptx, ctx
        assert "GMMA" in r.sass and 0 < r.shared_bytes <= SM90_MAX_SHARED, (ctx, r.shared_bytes)
        if kind != "bf16":
            assert re.search(r"\bFFMA\b", r.sass) and not re.search(r"\bFADD\b", r.sass), ctx
        if decode == "prmt":
            assert "prmt.b32" in r.ptx and "PRMT" in r.sass, ctx
    layouts = {(k, lay) for k, lay, _, _ in seen}
    assert {(k, lay) for k in _WGMMA for lay in ("contiguous", "masked")} | {("fp8", "psum")} <= layouts, seen
    assert any(n == 256 for _, _, n, _ in seen) and any(d == "prmt" for *_, d in seen), seen


def test_warm_compiles_the_gpu_runs_launches(compiled, tmp_path):
    """``python -m epkit.testing.rung3 warm`` (``bench/gpu_run.sh``'s warm step) compiles every target-size
    launch and reports it; here Triton's cache already holds them (the sweep before pytest, or the ``compiled``
    fixture, put them there)."""
    import json

    assert rung3.main(["warm", "--jobs", "2", "--out", str(tmp_path / "compile.json")]) == 0
    doc = json.loads((tmp_path / "compile.json").read_text())
    targets = {r.kernel for r in compiled if any(w.startswith("target") for w in r.where)}
    assert {k.split(":")[1] for k in targets} == BIG
    assert doc["failed"] == 0 and doc["spilled"] == 0 and {r["kernel"] for r in doc["results"]} == targets
    assert all(r["registers"] and r["num_warps"] for r in doc["results"])


# Planted faults: the two that stopped every first GPU launch, put back into copies of the kernels' modules.


def _plant(tmp_path, tag: str, name: str, edits: dict[str, dict[str, str]]):
    """Copies of the modules in ``edits`` (``{module file stem: {old: new}}``) under new names (``tag``) in
    ``tmp_path``, importing each other instead of the originals; returns the copy of ``name``."""
    import importlib

    kernels = ROOT / "kernels" / "triton"
    renamed = {stem: f"planted_{tag}_{stem}" for stem in edits}
    for stem, replacements in edits.items():
        text = (kernels / f"{stem}.py").read_text()
        for old, new in replacements.items():
            assert old in text, (stem, old)
            text = text.replace(old, new)
        for other, new_name in renamed.items():
            text = text.replace(f"epkit.kernels.triton.{other} import", f"{new_name} import")
        (tmp_path / f"{renamed[stem]}.py").write_text(text)
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(renamed[name])
    finally:
        sys.path.remove(str(tmp_path))


def _entry_for(records, kernel: str, **where):
    for e in records:
        if _name(e) == kernel and all(str(v) in " ".join(e["where"]) for v in where.values()):
            return e
    raise AssertionError(f"no recorded {kernel} launch at {where}")


def _with_arg(entry, module, arg: str, value) -> dict:
    names = getattr(module, entry["kernel"].split(":")[1]).arg_names
    args = list(entry["args"])
    args[names.index(arg)] = value
    return dict(entry, kernel=f"{module.__name__}:{entry['kernel'].split(':')[1]}", args=args)


def test_planted_faults_fail_this_rung(records, tmp_path):
    """1. A zero clock address (what a CUDA launch passed before) into an address cast without widening: an i32
    into ``tt.int_to_ptr``, in every waiting kernel. 2. A rank equal to 1 specialized to a constant and
    ``.to()`` on it. Each fails here on the recorded launch and compiles without the plant."""
    entry = _entry_for(records, "_ll_dispatch_recv", label="target W=8")
    raw_cast = {"    return wide(addr).to(tl.pointer_type(DTYPE))": "    return addr.to(tl.pointer_type(DTYPE))"}
    planted = _plant(tmp_path, "cast", "ep_low_latency", {"ep_common": raw_cast, "ep_low_latency": {}})
    zero_clock = launches.compile_entry(_with_arg(entry, planted, "clock_addr", 0), sass=False)
    assert zero_clock.error and "int_to_ptr" in zero_clock.error, zero_clock.error
    assert launches.compile_entry(_with_arg(entry, planted, "clock_addr", 1 << 40), sass=False).error is None
    import epkit.kernels.triton.ep_low_latency as real

    assert launches.compile_entry(_with_arg(entry, real, "clock_addr", 0), sass=False).error is None

    entry = _entry_for(records, "_ll_combine_send", label="target W=8")
    to_on_rank = {
        '@triton.jit(do_not_specialize=["me", "W", "n_max", "ident0", "ident1"])': "@triton.jit",
        "my_off = (e % 2) * area_bytes + wide(me) * msg_bytes\n        if pid == 0:": (
            "my_off = (e % 2) * area_bytes + me.to(tl.int64) * msg_bytes\n        if pid == 0:"
        ),
    }
    planted = _plant(tmp_path, "rank", "ep_low_latency", {"ep_low_latency": to_on_rank})
    rank1 = launches.compile_entry(_with_arg(entry, planted, "me", 1), sass=False)
    assert rank1.error and "has no attribute 'to'" in rank1.error, rank1.error
    assert launches.compile_entry(_with_arg(entry, planted, "me", 2), sass=False).error is None
    assert launches.compile_entry(_with_arg(entry, real, "me", 1), sass=False).error is None
