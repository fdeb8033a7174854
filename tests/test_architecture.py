"""The architecture rules (ARCHITECTURE.md) as tests: the public API imports, transports are
one interface, kernel files are leaves, leading-underscore names stay in their file, files and functions are
short (or say why), library code repeats no block of six lines, and EPBuffer is a facade over its paths."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Source folder -> the package it installs as (setup.py's package_dir).
PACKAGES = {"python/epkit": "epkit", "kernels": "epkit.kernels", "collectives": "epkit.collectives"}
LIBRARY = tuple(PACKAGES)
COMPILED = ("epkit._C", "epkit._C_cuda")

# Every module's public names as first written down at f8953e6 (``__all__`` where the module had one, else its
# top-level functions and classes without a leading underscore), less the old paths that were kept a while
# (epkit has made no release: a moved module is simply moved). They import, from these paths, with no
# DeprecationWarning; a name that leaves is taken out here in the same change, saying so in its message.
PUBLIC_API = {
    "epkit": [
        "BackendUnavailableError",
        "CPMirror",
        "EPBuffer",
        "EngramConfig",
        "EngramLayer",
        "ExpertPlacement",
        "PeerFailedError",
        "ShardedEngramTable",
        "SymmBuffer",
        "__version__",
        "backends",
        "build_m_indices",
        "engram_hash",
        "eplb",
        "expert_mlp",
        "from_mirror",
        "fused_moe",
        "gather_rows",
        "get_mk_alignment_for_contiguous_layout",
        "hash_params",
        "hash_tokens",
        "lockstep",
        "logical_to_physical",
        "m_grouped_bf16_gemm_nt_contiguous",
        "m_grouped_bf16_gemm_nt_masked",
        "m_grouped_fp8_fp4_gemm_nt_contiguous",
        "m_grouped_fp8_fp4_gemm_nt_masked",
        "m_grouped_fp8_gemm_nt_contiguous",
        "m_grouped_fp8_gemm_nt_masked",
        "model",
        "prepare_cp_mirror",
        "quant",
        "registered_ops",
        "resolve_num_extra_experts",
        "to_mirror",
        "topology",
    ],
    "epkit.backends": [
        "BACKENDS",
        "BackendInfo",
        "BackendUnavailableError",
        "OpSpec",
        "backend_info",
        "register_op",
        "registered_ops",
        "select",
    ],
    "epkit.cli": ["build_parser", "cmd_info", "cmd_plan", "cmd_selfcheck", "collect_info", "main"],
    "epkit.collectives": [],
    "epkit.collectives.cp_group": ["CPGroup", "cp_broadcast_object", "cp_broadcast_tensor_dict"],
    "epkit.collectives.ep_buffer": ["DispatchHandle", "EPBuffer", "LowLatencyHandle"],
    "epkit.collectives.ep_reference": ["reference_combine", "reference_dispatch", "reference_layout"],
    "epkit.collectives.fused_moe": ["fused_moe"],
    "epkit.collectives.symm_buffer": ["PeerFailedError", "SymmBuffer", "TRANSPORTS"],
    "epkit.engram": [
        "DEMO_NGRAM_VOCAB_SIZE",
        "EngramConfig",
        "engram_hash",
        "engram_hash_reference",
        "hash_params",
        "hash_tokens",
    ],
    "epkit.engram_layer": ["EngramLayer"],
    "epkit.eplb": [
        "ExpertLoadCounter",
        "balanced_packing",
        "gpu_load",
        "imbalance",
        "rebalance_experts",
        "replicate_experts",
    ],
    "epkit.experts": [
        "ExpertPlacement",
        "logical_to_physical",
        "logical_to_physical_reference",
        "resolve_num_extra_experts",
    ],
    "epkit.gather": ["gather_rows", "gather_rows_reference"],
    "epkit.kernels": [],
    "epkit.kernels.tilelang": [],
    "epkit.kernels.tilelang.cp_mirror": ["prepare_cp_mirror_func", "prepare_cp_mirror_launch"],
    "epkit.kernels.triton": [],
    "epkit.kernels.triton.copy_rows": ["copy_rows_by_address", "word_bytes_for"],
    "epkit.kernels.triton.cp_mirror": ["prepare_cp_mirror_launch"],
    "epkit.kernels.triton.grouped_gemm": [
        "contiguous_launcher",
        "get_config",
        "grouped_gemm_contiguous",
        "grouped_gemm_masked",
        "load_tuned_configs",
        "m_bucket",
        "masked_launcher",
        "set_config_override",
        "tile_schedule",
    ],
    "epkit.lockstep": [
        "LockstepDriver",
        "PlaceholderBatch",
        "PrefillVote",
        "StepPlan",
        "has_unfinished",
        "placeholder_batch",
    ],
    "epkit.model": ["Batch", "DPEPModel", "ModelArgs", "forward_reference", "generate", "init_weights"],
    "epkit.moe": ["expert_mlp", "expert_mlp_reference", "fuse_gate_up", "pack_moe_weight", "unpack_moe_weight"],
    "epkit.plan": ["BYTES_PER_WEIGHT", "ModelConfig", "PRESETS", "format_plan", "load_model", "plan"],
    "epkit.quant": [
        "FP4_E2M1_MAX",
        "FP8_E4M3_MAX",
        "cast_to_mxfp4",
        "cast_to_nvfp4",
        "ceil_to_ue8m0",
        "dequant_mxfp4",
        "dequant_nvfp4",
        "dequant_per_block_fp8",
        "dequant_per_token_group_fp8",
        "e2m1_to_float",
        "per_block_cast_to_fp8",
        "per_token_group_cast_to_fp8",
    ],
    "epkit.testing": [
        "CompiledKernel",
        "RankError",
        "assert_bitwise_equal",
        "assert_diff",
        "calc_diff",
        "nvcc_compile",
        "run_ranks",
        "run_triton_interpreted",
        "tilelang_build_c",
        "tilelang_compile_cuda",
    ],
    "epkit.testing.cuda_graph": ["captured", "pretended_nccl_capture"],
    "epkit.testing.host_sync": ["HostSyncDetector"],
    "epkit.testing.ladder": [
        "CompiledKernel",
        "nvcc_compile",
        "run_triton_interpreted",
        "tilelang_build_c",
        "tilelang_compile_cuda",
    ],
    "epkit.testing.markers": ["requires_cuda"],
    "epkit.testing.multiprocess": ["DEFAULT_TIMEOUT", "RankError", "ranks", "run_ranks"],
    "epkit.testing.nvshmem_emulator": ["EMULATED", "calls", "install", "installed", "resolve_transport", "uninstall"],
    "epkit.testing.torch_symm_emulator": ["EMULATED", "calls", "install", "uninstall"],
    "epkit.topology": ["GROUP_KINDS", "ParallelGroups", "rank_groups", "resolve_sizes"],
}


def _module_name(path: pathlib.Path) -> str:
    for root, pkg in PACKAGES.items():
        base = ROOT / root
        if base in path.parents:
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            return ".".join([pkg, *parts])
    return "bench." + ".".join(path.relative_to(ROOT / "bench").with_suffix("").parts)


def _sources(*roots: str) -> list[pathlib.Path]:
    return sorted(p for r in roots for p in (ROOT / r).rglob("*.py") if ".venv" not in p.parts)


def _imports(path: pathlib.Path):
    """``(line, module, [names])`` of every absolute import in ``path`` (names empty for ``import m``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []


def test_public_api_imports_without_deprecation():
    code = f"""
import importlib, json, warnings
out = {{}}
for mod, names in {PUBLIC_API!r}.items():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m = importlib.import_module(mod)
    out[mod] = {{
        "missing": [n for n in names if not hasattr(m, n)],
        "warned": [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning) and "epkit" in
                   str(w.message)],
    }}
print(json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    assert {m: r["missing"] for m, r in out.items() if r["missing"]} == {}
    assert {m: r["warned"] for m, r in out.items() if r["warned"]} == {}


def test_symm_buffer_asks_capabilities_not_transport_names():
    for name in ("symm_buffer.py", "exchange.py", "peer_failure.py"):
        text = (ROOT / "collectives" / name).read_text()
        assert text.count("transport ==") == 0, name
        assert not re.search(r"\.name\s*[!=]=|\btransport\s+in\s", text), name


def test_kernel_files_are_leaves():
    bad = []
    for path in _sources("kernels"):
        for line, mod, _ in _imports(path):
            if mod.split(".")[0] == "epkit" and not mod.startswith("epkit.kernels") and mod != "epkit.utils":
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert bad == []


def test_no_library_module_imports_the_test_helpers():
    """Dependencies point down: ``epkit.testing`` imports the library, never the other way (at any depth, in a
    function body too); the rank launchers ``epkit run`` and ``epkit bench`` need are library modules."""
    bad = []
    testing = ROOT / "python/epkit/testing"
    for path in _sources(*LIBRARY):
        if testing in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):  # from epkit.testing(.x) import y, from epkit import testing
                base = ("." * node.level) + (node.module or "")
                mods = [base] + [f"{base}.{a.name}" if node.module else f"{base}{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for mod in mods:
                parts = mod.lstrip(".").split(".")
                absolute = parts[:2] == ["epkit", "testing"]
                relative = mod.startswith(".") and "testing" in parts  # a relative path through a testing package
                if absolute or relative:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {mod}")
    assert bad == []


def test_leading_underscore_names_stay_in_their_file():
    bad = []
    for path in _sources(*LIBRARY, "bench"):
        me = _module_name(path)
        for line, mod, names in _imports(path):
            if mod.split(".")[0] != "epkit" or mod in COMPILED:
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            private = [c for c in mod.split(".")[1:] if c.startswith("_") and c != "_details"]
            if private:
                bad.append(f"{where} imports the private module {mod}")
            same_details = "_details" in mod.split(".") and mod.rsplit(".", 1)[0] == me.rsplit(".", 1)[0]
            for n in names:
                dunder = n.startswith("__") and n.endswith("__")  # __version__: public by convention
                if n.startswith("_") and not dunder and f"{mod}.{n}" not in COMPILED and not same_details:
                    bad.append(f"{where} imports {n} from {mod}")
    assert bad == []


def test_library_files_and_functions_are_short():
    """A file holds one concept (split by concept, never by line count): one over 600 lines says why in its module
    docstring (naming the "600 lines"); a function over 80 lines says why in its own."""
    long_files, long_functions = [], []
    for path in _sources(*LIBRARY):
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if len(text.splitlines()) > 600 and "600 lines" not in doc:
            long_files.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80 and "80 lines" not in (ast.get_docstring(node) or ""):
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert long_files == [] and long_functions == []


def _code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of the lines a repeated block is made of: whitespace folded; blank lines,
    comments, imports and lines of punctuation alone left out (as the duplicates scan of the tree does)."""
    out, in_import = [], False
    for i, raw in enumerate(path.read_text().splitlines(), 1):
        line = " ".join(raw.split())
        if in_import:  # the names of a parenthesized import, one per line
            in_import = not line.startswith(")")
            continue
        if re.match(r"(from \S+ )?import ", line):
            in_import = line.endswith("(")
            continue
        if not line or line.startswith("#") or not re.search(r"\w", line):
            continue
        out.append((i, line))
    return out


def test_library_repeats_no_block_of_six_lines():
    seen: dict[tuple[str, ...], str] = {}
    repeats = []
    for path in _sources(*LIBRARY):
        lines = _code_lines(path)
        for k in range(len(lines) - 5):
            block = tuple(t for _, t in lines[k : k + 6])
            where = f"{path.relative_to(ROOT)}:{lines[k][0]}"
            first = seen.setdefault(block, where)
            if first != where:
                repeats.append(f"{where} repeats {first}")
    assert repeats == []


def test_ep_buffer_is_a_facade_over_paths_chosen_once():
    """EPBuffer has no base classes; the EP code chooses its path once (the planner), keeps no state in
    ``self.__dict__`` caches and no test switch in a library module."""
    from epkit.collectives.ep_buffer import EPBuffer

    assert EPBuffer.__mro__ == (EPBuffer, object)
    banned = re.compile(r"Mixin|__dict__\[|PORTABLE|\b_hier is\b|\b_dev is\b")
    bad = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in _sources("collectives")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if banned.search(line)
    ]
    assert bad == []


@pytest.mark.parametrize("name", ["ARCHITECTURE.md", "python/epkit/py.typed"])
def test_layout_files_exist(name):
    assert (ROOT / name).is_file()
