"""epkit's ops as torch.library custom ops (``epkit.ops``): every registered op passes ``torch.library.opcheck``,
traces under ``FakeTensorMode``, and its public function compiles with ``torch.compile(fullgraph=True)``, with
no graph break, to the eager result; the checks that read tensor values run in compiled code too, and under
CUDA stream capture are replaced by the documented device-side clamps (rung 4: capture and replay on a GPU).

The compiled runs use the ``aot_eager`` backend (Dynamo, the fake implementations, functionalization and
AOTAutograd: what a custom op must support; one Inductor run checks that Inductor takes the ops too), on
small shapes, to keep the file within its CI budget on a 2-core machine.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import epkit
from epkit import engram, grouped_gemm, moe, quant
from epkit.ops import CUSTOM_OPS
from epkit.testing.markers import requires_cuda

G = torch.Generator().manual_seed(20)


def _gemm_case(kind: str, masked: bool):
    """(public call, its tensor inputs, the op's arguments) of one grouped GEMM on small shapes."""
    op = f"m_grouped_{kind}_gemm_nt_{'masked' if masked else 'contiguous'}"
    a, b, _, _ = grouped_gemm.make_inputs(kind, 2, 16 if masked else 256, 128, 128, masked, seed=3)
    pair = kind != "bf16"
    a_t = list(a) if pair else [a]
    b_t = list(b) if pair else [b]
    if masked:
        layout = torch.tensor([16, 5], dtype=torch.int32)
        d = torch.zeros(2, 16, 128, dtype=torch.bfloat16)
    else:
        layout = grouped_gemm.build_m_indices([100, 120])
        d = torch.zeros(256, 128, dtype=torch.bfloat16)
    fn = getattr(epkit, op)

    def call(*t):
        aa = (t[0], t[1]) if pair else t[0]
        bb = (t[2], t[3]) if pair else t[1]
        dd, lay = t[-2], t[-1]
        out = dd.clone()
        if masked:
            fn(aa, bb, out, lay, 16)
        else:
            fn(aa, bb, out, lay)
        return out

    sfa, sfb = (a[1], b[1]) if pair else (None, None)
    a0, b0 = (a[0], b[0]) if pair else (a, b)
    op_args = (a0, sfa, b0, sfb, d.clone(), layout, False, 16 if masked else 0, "auto")
    return call, (*a_t, *b_t, d, layout), op_args


def _mlp_case(layout: str):
    w13 = quant.per_block_cast_to_fp8(torch.randn(2, 256, 128, generator=G) / 11)
    w2 = quant.per_block_cast_to_fp8(torch.randn(2, 128, 128, generator=G) / 11)
    if layout == "masked":
        x, lay = torch.randn(2, 8, 128, generator=G), torch.tensor([8, 3], dtype=torch.int32)
    else:
        x, lay = torch.randn(256, 128, generator=G), grouped_gemm.build_m_indices([60, 90])

    def call(x, a, sa, b, sb, lay):
        kw = dict(masked_m=lay, expected_m=8) if layout == "masked" else dict(m_indices=lay)
        return moe.expert_mlp(x, layout, (a, sa), (b, sb), **kw)

    m_idx, masked_m, exp = (None, lay, 8) if layout == "masked" else (lay, None, None)
    op_args = (x, None, *w13, *w2, layout, m_idx, masked_m, exp, None, "auto")
    return call, (x, *w13, *w2, lay), op_args


@functools.cache
def _placement_on(placement, device: str):
    return placement.to(device)


def _on(placement, device: torch.device):
    """The placement on the ids' device (a CUDA graph cannot capture the host-to-device copy of a CPU one)."""
    return placement if device.type in ("cpu", "meta") else _placement_on(placement, str(device))


def _cases():
    """name -> (public call, its tensor inputs, the op's own arguments): one case per registered op."""
    x = torch.randn(40, 6, generator=G)
    idx = torch.randint(-1, 40, (33,), generator=G, dtype=torch.int32)
    placement = epkit.ExpertPlacement.default(12, ep_size=4, min_num_extra_experts=1)
    topk = torch.randint(-1, 12, (9, 3), generator=G, dtype=torch.int32)
    w = torch.randn(3, 40, 64, generator=G)
    cu_q, cu_k = torch.tensor([0, 5, 7], dtype=torch.int32), torch.tensor([0, 8, 10], dtype=torch.int32)
    cfg = engram.selfcheck_config()
    mult, vocab, off = engram.hash_params(cfg)
    ids = torch.randint(0, cfg.vocab_size, (21, cfg.max_ngram_size), generator=G, dtype=torch.int32)
    tokens, cu_t = torch.randint(0, cfg.vocab_size, (13,), generator=G, dtype=torch.int32), torch.tensor([0, 6, 13])
    out_hash = torch.empty(mult.shape[0], 21, vocab.shape[1] * vocab.shape[2], dtype=torch.int32)

    def mirror(cu_q, cu_k):
        m = epkit.prepare_cp_mirror(cu_q, cu_k, 2, 1, (1, 4))
        return m.mirror_cp_index, m.mirror_cp_reverse_index, m.ks[4], m.ke[1], m.cu_seqlens_q_half, m.seqlens_k_half

    cases = {
        "gather_rows": (lambda x, i: epkit.gather_rows(x, i) * 2, (x, idx), (x, idx, "auto", True)),
        "gather_rows_out": (
            lambda x, i: epkit.gather_rows(x, i, out=x.new_empty(33, 6)),
            (x, idx),
            (x, idx, torch.empty(33, 6), "auto", True),
        ),
        "logical_to_physical": (
            lambda t, p, c: epkit.logical_to_physical(t, _on(placement, t.device), 2, token_offset=1),
            (topk, placement.phy2log, placement.logcnt),
            (topk, placement.log2phy, placement.logcnt, placement.num_local, 2, 1, "auto", True),
        ),
        "per_token_group_cast_to_fp8": (
            lambda w: quant.per_token_group_cast_to_fp8(w, ue8m0=True),
            (w,),
            (w, 128, True),
        ),
        "per_block_cast_to_fp8": (lambda w: quant.per_block_cast_to_fp8(w), (w,), (w, 128, 128, False)),
        "cast_to_mxfp4": (lambda w: quant.cast_to_mxfp4(w, ties="down"), (w,), (w, "down", 1e-4)),
        "cast_to_nvfp4": (lambda w: quant.cast_to_nvfp4(w), (w,), (w,)),
        "prepare_cp_mirror": (mirror, (cu_q, cu_k), (cu_q, cu_k, 2, 1, [1, 4], "auto")),
        "engram_hash": (
            lambda i, m, v, o: epkit.engram_hash(i, m, v, o),
            (ids, mult, vocab, off),
            (ids, mult, vocab, off, "auto"),
        ),
        "engram_hash_out": (
            lambda i, m, v, o: epkit.engram_hash(i, m, v, o, out=i.new_empty(out_hash.shape)),
            (ids, mult, vocab, off),
            (ids, mult, vocab, off, out_hash, "auto"),
        ),
        "engram_ngram_ids": (
            lambda t, c: epkit.hash_tokens(t, c, cfg),
            (tokens, cu_t),
            (tokens, cu_t, cfg.max_ngram_size, cfg.pad_id, cfg.vocab_size, None, None),
        ),
        "expert_mlp": _mlp_case("contiguous"),
    }
    for op, kind, masked in grouped_gemm.GROUPED_OPS:
        cases[op] = _gemm_case(kind, masked)
    return cases


CASES = _cases()


def _leaves(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _assert_same(got, want):
    for g, w in zip(_leaves(got), _leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), (g, w)


MULTI_RANK = {"fused_moe"}  # a collective: tested on two ranks below


def test_every_registered_op_has_a_case_and_is_reachable():
    assert set(CASES) | MULTI_RANK == set(CUSTOM_OPS)
    for name in CUSTOM_OPS:
        assert getattr(torch.ops.epkit, name).default._schema.name == f"epkit::{name}"
    # the schemas declare what the ops write, and nothing else
    written = {
        n: [a.name for a in op._opoverload._schema.arguments if a.alias_info and a.alias_info.is_write]
        for n, op in CUSTOM_OPS.items()
    }
    assert {n: w for n, w in written.items() if w} == {
        "gather_rows_out": ["out"],
        "engram_hash_out": ["out"],
        **{op: ["d"] for op, _, _ in grouped_gemm.GROUPED_OPS},
    }


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name):
    op, args = CUSTOM_OPS[name], CASES[name][2]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not any(t.dtype in FP8 for t in tensors):
        torch.library.opcheck(op, args)
        return
    # opcheck's schema test compares values with ops float8 lacks: check what it checks by bytes instead
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, test_utils=checks)
    written = {a.name for a in op._opoverload._schema.arguments if a.alias_info and a.alias_info.is_write}
    names = [a.name for a in op._opoverload._schema.arguments]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = op(*args)
    for n, a, b in zip(names, args, before):
        if isinstance(a, torch.Tensor):
            same = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            assert same != (n in written) or (n in written and a.numel() == 0), f"{name}: {n}"
    for o in _leaves(out) if out is not None else []:
        assert all(o.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in tensors), name


@functools.cache
def _compiled(name):
    return torch.compile(CASES[name][0], fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_fullgraph_to_the_eager_result_without_graph_breaks(name):
    call, inputs, _ = CASES[name]
    want = call(*inputs)
    _assert_same(_compiled(name)(*inputs), want)
    explained = torch._dynamo.explain(call)(*inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("name", list(CASES))
def test_fake_and_meta_tensors_give_the_eager_shapes(name):
    call, inputs, _ = CASES[name]
    want = _leaves(call(*inputs))
    with FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True, allow_non_fake_inputs=True) as mode:
        fake = _leaves(call(*(mode.from_tensor(t) for t in inputs)))
    runs = [fake]
    if name != "prepare_cp_mirror":  # its sizes depend on the values: only a shape environment can say so
        runs.append(_leaves(call(*(t.to("meta") for t in inputs))))
    for got in runs:
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.dim() == w.dim()
            static = [s for s in g.shape if isinstance(s, int)]
            assert static == list(w.shape) or (name == "prepare_cp_mirror" and len(static) < g.dim())


def test_functions_built_on_the_ops_compile_too():
    # to_mirror / from_mirror gather by a CPMirror's indices: the CPMirror is an input the compiler guards on
    mirror = epkit.prepare_cp_mirror(torch.tensor([0, 5, 7]), torch.tensor([0, 8, 10]), 2, 1, (1, 4))
    for fn, x in (
        (lambda x: epkit.to_mirror(x, mirror) * 2, torch.randn(7, 3, generator=G)),
        (lambda g: epkit.from_mirror(g, mirror) + 1, torch.randn(2 * mirror.cp_mirror_len, 3, generator=G)),
    ):
        _assert_same(torch.compile(fn, fullgraph=True, backend="aot_eager")(x), fn(x))
        assert torch._dynamo.explain(fn)(x).graph_break_count == 0


def test_import_epkit_does_not_load_the_compiler():
    # registering the ops must not import torch._dynamo (1.5 s at every `import epkit`, in every spawned rank)
    import subprocess
    import sys

    code = "import sys, epkit; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr[-2000:]


def test_value_checks_still_raise_in_compiled_code():
    x = torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"index\[1\] = 7 is outside \[-1, 5\)"):
        _compiled("gather_rows")(x, torch.tensor([0, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="NaN/Inf"):
        _compiled("per_block_cast_to_fp8")(torch.full((3, 40, 64), float("nan")))


def test_under_capture_bad_ids_become_padding_and_no_value_check_runs(monkeypatch):
    # what runs in place of the host checks during CUDA stream capture, run on CPU tensors
    from epkit import experts, gather

    def no_host_read(*args, check_values=True, **kwargs):
        assert not check_values, "a value check ran during capture"

    def refuse(*args):
        raise AssertionError("a value check ran during capture")

    for mod in (gather, experts):
        monkeypatch.setattr(mod, "host_checks", lambda device: False)
    monkeypatch.setattr(gather, "_check_index_values", refuse)
    monkeypatch.setattr(experts, "check_topk_idx", no_host_read)
    got = epkit.gather_rows(torch.ones(4, 2), torch.tensor([1, 9, -5, -1]), backend="cpu")
    assert torch.equal(got, torch.tensor([[1.0, 1.0], [0, 0], [0, 0], [0, 0]]))
    placement = epkit.ExpertPlacement.default(4, 2)
    got = epkit.logical_to_physical(torch.tensor([[0, 17], [-3, 1]]), placement, 0, backend="cpu")
    assert torch.equal(got, torch.tensor([[0, -1], [-1, 1]], dtype=torch.int32))
    # and with the checks on (the default outside capture), the same calls raise
    monkeypatch.undo()
    with pytest.raises(ValueError, match="outside"):
        epkit.gather_rows(torch.ones(4, 2), torch.tensor([1, 9, -5, -1]))


def test_inductor_compiles_a_chain_of_ops():
    call, inputs, _ = CASES["expert_mlp"]
    idx = torch.arange(255, -1, -1, dtype=torch.int32)

    def chain(x, *rest):
        return epkit.gather_rows(call(x, *rest), idx).float().sum(-1)

    want = chain(*inputs)
    got = torch.compile(chain, fullgraph=True)(*inputs)  # the default backend: Inductor
    assert torch.equal(got, want)


def _fused_moe_compiled(rank: int, world: int) -> bool:
    import torch.distributed as dist

    from epkit.collectives.ep_buffer import EPBuffer
    from epkit.collectives.fused_moe import buffer_name

    buf = EPBuffer(dist.group.WORLD, 256, 4, num_max_tokens_per_rank=16, num_topk=2, transport="shm")
    g = torch.Generator().manual_seed(rank)
    x, w = torch.randn(7 + rank, 256, generator=g).bfloat16(), torch.rand(7 + rank, 2, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7 + rank)])
    gen = torch.Generator().manual_seed(9)
    w13 = quant.per_block_cast_to_fp8(torch.randn(4, 256, 256, generator=gen)[2 * rank : 2 * rank + 2] / 16)
    w2 = quant.per_block_cast_to_fp8(torch.randn(4, 256, 128, generator=gen)[2 * rank : 2 * rank + 2] / 11)
    name = buffer_name(buf)

    def layer(x, idx, w, a, sa, b, sb):
        return torch.ops.epkit.fused_moe(x, idx, w, a, sa, b, sb, name, [], None, 128, "auto")

    want = epkit.fused_moe(x, idx, w, w13, w2, buf)
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, idx, w, *w13, *w2)
    _assert_same(got, want)
    assert torch._dynamo.explain(layer)(x, idx, w, *w13, *w2).graph_break_count == 0
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")  # fp8 weights: no schema
    torch.library.opcheck(
        CUSTOM_OPS["fused_moe"], (x, idx, w, *w13, *w2, name, [], None, 128, "auto"), test_utils=checks
    )
    buf.close()
    return True


def test_fused_moe_op_compiles_on_two_ranks():
    from epkit.testing.multiprocess import run_ranks

    assert run_ranks(_fused_moe_compiled, 2, timeout=240) == [True, True]


# Rung 4: CUDA-graph capture and replay of every GPU op (prepare_cp_mirror and engram_ngram_ids plan on the host:
# they synchronize and their sizes depend on the data, so they are not captured).

CAPTURED = [n for n in CASES if n not in ("prepare_cp_mirror", "engram_ngram_ids")]


@requires_cuda
@pytest.mark.parametrize("name", CAPTURED)
def test_gpu_cuda_graph_capture_and_replay(name):
    call, inputs, _ = CASES[name]
    dev = [t.cuda() for t in inputs]
    want = call(*dev)  # eager on the GPU; also warms up (Triton compiles outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = call(*dev)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(got, want)
    for t in dev:  # new values in the same buffers: the replay follows them
        if t.is_floating_point() and t.dtype not in (torch.float8_e4m3fn,):
            t.mul_(0.5)
    want2 = call(*dev)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(got, want2)
