"""The reference model: DP attention + Wide-EP forward on CPU ranks against the one-process float64 model."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from epkit.model import Batch, DPEPModel, ModelArgs, forward_reference, generate, init_weights
from epkit.plan import ModelConfig
from epkit.testing import assert_bitwise_equal, calc_diff
from epkit.testing.markers import requires_cuda
from epkit.testing.multiprocess import run_ranks

# calc_diff of the logits against forward_reference replaying the model's expert choices. FP8 experts:
# a bf16 rounding upstream (which the reference takes elsewhere) moves an activation across an e4m3 step
# now and then, ~6% of that element; measured 2.0e-5..1.2e-4 at 4 ranks (about 1.5% relative L2; the
# threshold allows 2.8%). bf16 experts: 2.0e-6..5.4e-6 measured at 2 ranks, 1.3e-6..6.7e-6 over
# 6 decode steps. MXFP4 experts (the reference multiplies by the dequantized weights): 1.7e-5..1.3e-4
# measured at 2 ranks, the FP8 activations' rounding dominating as with FP8 experts.
THRESH = {"fp8": 4e-4, "fp4": 4e-4, "bf16": 2e-5}
# Greedy tokens: the reference's logit of the chosen token is within this of its best (the largest
# logit error measured is 0.04 with FP8 experts; near-ties closer than that may go either way).
TOKEN_TOL = 0.15

PROMPTS = {0: [[1, 2, 3, 4, 5], list(range(10, 27)), [7] * 9], 1: [list(range(30, 60))], 2: [], 3: [[5, 6]]}


def _groups(world_size):
    from epkit.topology import ParallelGroups

    return ParallelGroups.create(dp_size=world_size, device="cpu")


def _per_sequence(routing, cu):
    """The gate's choices of one forward ([T, K] per MoE layer), split into its sequences."""
    return [[r[cu[s] : cu[s + 1]] for r in routing] for s in range(len(cu) - 1)]


def _prefill_decode(rank, world_size, fmt, transport):
    """Prefill every prompt (normal, then the textbook exchange and fused, which must give the same
    bits), then one decode step (low-latency, then normal and the textbook exchange)."""
    args = ModelArgs(expert_format=fmt)
    from epkit.testing.nvshmem_emulator import resolve_transport

    m = DPEPModel(args, _groups(world_size), transport=resolve_transport(transport), prefill_moe="normal")
    m.record_routing = True
    prompts = PROMPTS[rank]
    ids = list(range(len(prompts)))
    step = Batch.prefill(prompts, ids) if prompts else Batch.placeholder(True)
    logits = m.forward(step)
    cu = step.cu_seqlens.tolist()
    out = {
        "prompts": prompts,
        "prefill": logits if prompts else None,
        "route_prefill": _per_sequence(m.last_routing, cu),
    }
    saved = {k: v.copy() for k, v in m.cache.items()}
    modes = ["reference", "fused"] if m.buffer.is_within_domain() else ["reference"]
    for mode in modes:  # the textbook exchange and the fused op give what EPBuffer gave, bit for bit
        m.prefill_moe = mode
        assert_bitwise_equal(m.forward(step), logits, f"{rank=} {mode} vs normal prefill")
    m.cache = saved
    nxt = logits.argmax(-1).tolist() if prompts else []
    dec = Batch.decode(nxt, [len(p) for p in prompts], ids) if prompts else Batch.placeholder(False)
    saved = {k: v.copy() for k, v in m.cache.items()}
    out["next"], out["decode"] = nxt, m.forward(dec)
    out["route_decode"] = _per_sequence(m.last_routing, dec.cu_seqlens.tolist())
    m.cache, m.decode_moe = {k: v.copy() for k, v in saved.items()}, "normal"
    out["decode_normal"] = m.forward(dec)
    out["route_decode_normal"] = _per_sequence(m.last_routing, dec.cu_seqlens.tolist())
    m.cache, m.decode_moe = {k: v.copy() for k, v in saved.items()}, "reference"
    assert_bitwise_equal(m.forward(dec), out["decode_normal"], f"{rank=} reference vs normal decode")
    m.close()
    return out


def _joined(prefill_routes, decode_routes):
    return [torch.cat((a, b)) for a, b in zip(prefill_routes, decode_routes)]


def _check_against_reference(results, fmt):
    args = ModelArgs(expert_format=fmt)
    seqs, got, route_ll, route_n = [], [], [], []
    for r in results:
        for i, p in enumerate(r["prompts"]):
            seqs.append(p + [r["next"][i]])
            got.append((r["prefill"][i], r["decode"][i], r["decode_normal"][i]))
            route_ll.append(_joined(r["route_prefill"][i], r["route_decode"][i]))
            route_n.append(_joined(r["route_prefill"][i], r["route_decode_normal"][i]))
    # the reference replays the model's expert choices (a near-tie in the gate must not decide the check)
    ref = forward_reference(args, seqs, routing=route_ll)
    ref_n = forward_reference(args, seqs, routing=route_n)
    # a negative control: the routed experts' output 10% off (route_scale 2.5 -> 2.25)
    wrong = forward_reference(ModelArgs(expert_format=fmt, route_scale=2.25), seqs, routing=route_ll)
    diffs = []
    for s, (pre, dec, dec_n), want, want_n, bad in zip(seqs, got, ref, ref_n, wrong):
        ctx = f"{fmt=} len={len(s)}"
        diffs += [calc_diff(pre.double(), want[-2]), calc_diff(dec.double(), want[-1])]
        diffs.append(calc_diff(dec_n.double(), want_n[-1]))
        assert diffs[-3] < THRESH[fmt], ctx + " prefill"
        assert diffs[-2] < THRESH[fmt], ctx + " low-latency decode"
        assert diffs[-1] < THRESH[fmt], ctx + " normal decode"
        assert calc_diff(pre.double(), bad[-2]) > 2 * THRESH[fmt], ctx + " the check must catch a 10% error"
        assert calc_diff(dec.double(), bad[-1]) > 2 * THRESH[fmt], ctx + " the decode check too"
    print(f"{fmt}: calc_diff {min(diffs):.2e}..{max(diffs):.2e}")


DECODE_PROMPTS = {0: [[1, 2, 3, 4, 5], list(range(30, 50))], 1: [list(range(10, 27))]}
DECODE_STEPS = 6


def _decode_steps(rank, world_size):
    """Prefill, then DECODE_STEPS low-latency decode steps; every step's logits and expert choices."""
    m = DPEPModel(ModelArgs(expert_format="bf16"), _groups(world_size))
    m.record_routing = True
    prompts = DECODE_PROMPTS[rank]
    ids = list(range(len(prompts)))
    step = Batch.prefill(prompts, ids)
    logits = [m.forward(step)]
    routes = [_per_sequence(m.last_routing, step.cu_seqlens.tolist())]
    fed = []
    for j in range(DECODE_STEPS):
        fed.append(logits[-1].argmax(-1).tolist())
        step = Batch.decode(fed[-1], [len(p) + j for p in prompts], ids)
        logits.append(m.forward(step))
        routes.append(_per_sequence(m.last_routing, step.cu_seqlens.tolist()))
    m.close()
    return prompts, fed, logits, routes


def test_decode_steps_match_reference():
    # every step of a multi-step decode (KV cache, Engram n-gram context and convolution window) against
    # the full-sequence reference; range(30, 50) has a near-tie in the gate (group margin 6.6e-4) that
    # gave 5.8e-2 before the reference replayed the model's choices
    res = run_ranks(_decode_steps, 2, timeout=120)
    args = ModelArgs(expert_format="bf16")
    seqs, routing, got = [], [], []
    for prompts, fed, logits, routes in res:
        for i, p in enumerate(prompts):
            seqs.append(p + [f[i] for f in fed])
            per_step = [r[i] for r in routes]
            routing.append([torch.cat([st[layer] for st in per_step]) for layer in range(args.n_moe_layers)])
            got.append([lg[i] for lg in logits])
    ref = forward_reference(args, seqs, routing=routing)
    diffs = []
    for s, g, want in zip(seqs, got, ref):
        n = len(s) - DECODE_STEPS  # the prompt's length
        for j, lg in enumerate(g):
            diffs.append(calc_diff(lg.double(), want[n - 1 + j]))
            assert diffs[-1] < THRESH["bf16"], f"len {n}, step {j}"
    print(f"decode steps: calc_diff {min(diffs):.2e}..{max(diffs):.2e}")


@pytest.fixture(scope="module")
def shm_fp8():
    return run_ranks(_prefill_decode, 4, "fp8", "shm", timeout=120)


def test_forward_matches_reference_fp8_4_ranks(shm_fp8):
    _check_against_reference(shm_fp8, "fp8")


def test_forward_matches_reference_fp4_2_ranks():
    # MXFP4 experts through the FP8 x FP4 grouped GEMM, against the reference on the dequantized weights
    res = run_ranks(_prefill_decode, 2, "fp4", "shm", timeout=120)
    _check_against_reference(res, "fp4")


def test_forward_matches_reference_bf16_2_ranks():
    res = run_ranks(_prefill_decode, 2, "bf16", "shm", timeout=120)
    _check_against_reference(res, "bf16")


@pytest.mark.parametrize("transport", ["torch", "nvemu"])
def test_transports_give_the_same_bits(shm_fp8, transport):
    # torch (no fused path) and nvshmem (emulated on CPU ranks) give what shm gave, bit for bit
    res = run_ranks(_prefill_decode, 4, "fp8", transport, timeout=120)
    for r, (a, b) in enumerate(zip(shm_fp8, res)):
        for key in ("prefill", "decode", "decode_normal"):
            if a["prompts"]:
                assert_bitwise_equal(b[key], a[key], f"{r=} {key}")


# Ranks 0 and 1 bring more prompts than their 2 decode slots: both wait with prompts pending.
GEN_PROMPTS = {
    0: [[1, 2, 3, 4, 5], list(range(10, 27)), [7] * 9],
    1: [list(range(30, 60)), [3, 1, 4, 1, 5], [9, 2, 6]],
    2: [],
    3: [[5, 6]],
}
GEN_BUDGET = {0: [4, 1, 6], 1: [3, 5, 2], 2: [], 3: [8]}


def _generate_and_rebalance(rank, world_size):
    args = ModelArgs()
    m = DPEPModel(args, _groups(world_size), min_num_extra_experts=2, max_decode_tokens_per_rank=2)
    first, stats = generate(m, GEN_PROMPTS[rank], GEN_BUDGET[rank], max_steps=100)
    load = m.expert_load()
    # the buffer's own received-token counters (all layers) agree with the routed counts, which leave out
    # the placeholders' tokens (one token, top-k experts, per MoE layer and placeholder step)
    routed = m.routed_load.sum(0).cpu()
    dist.all_reduce(routed)
    received = [torch.zeros(m.placements[0].num_local, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(received, m.buffer.take_expert_load())
    received = torch.cat(received)
    placeholders = torch.tensor([stats["placeholder_steps"]])
    dist.all_reduce(placeholders)
    assert (received >= routed).all(), f"{rank=} {received} {routed}"
    want = int(placeholders) * args.n_activated_experts * args.n_moe_layers
    assert int(received.sum() - routed.sum()) == want, f"{rank=}"
    assert torch.equal(m.expert_load(), load), f"{rank=}: reading the load must not change it"
    default = [p.phy2log.clone() for p in m.placements]
    placements = m.rebalance()
    second, stats2 = generate(m, GEN_PROMPTS[rank], GEN_BUDGET[rank])
    assert m.cache == {}, f"{rank=}: finished sequences must release their state"
    if second == first:  # the same routing again, so the same logical load through the new placements
        assert torch.equal(m.expert_load(), load), f"{rank=}: load after the rebalance"
    m.close()
    return {"first": first, "second": second, "stats": stats, "stats2": stats2, "load": load,
            "default": default, "placements": [(p.phy2log, p.num_local) for p in placements]}  # fmt: skip


def _check_tokens(outputs, args, prompts=GEN_PROMPTS):
    seqs = [(p, o) for r, out in enumerate(outputs) for p, o in zip(prompts[r], out)]
    ref = forward_reference(args, [p + o[:-1] for p, o in seqs])
    for (p, o), lg in zip(seqs, ref):
        lg = lg[len(p) - 1 :]
        best = lg.max(-1).values
        chosen = lg.gather(1, torch.tensor(o)[:, None])[:, 0]
        assert (best - chosen).max() < TOKEN_TOL, f"prompt {p[:4]}...: {o} vs reference {lg.argmax(-1).tolist()}"


def test_generate_in_lockstep_with_eplb():
    world = 4
    res = run_ranks(_generate_and_rebalance, world, timeout=180)
    args = ModelArgs()
    for r, out in enumerate(res):
        assert [len(o) for o in out["first"]] == GEN_BUDGET[r], f"{r=}"
    _check_tokens([out["first"] for out in res], args)
    _check_tokens([out["second"] for out in res], args)
    with pytest.raises(AssertionError):  # the token check sees tokens the model would not choose
        _check_tokens([[[(t + 1) % args.vocab_size for t in o] for o in out["first"]] for out in res], args)
    # lockstep: every rank ran the same steps; the rank with no request ran placeholders only
    for key in ("steps", "prefill_steps"):
        assert len({out["stats"][key] for out in res}) == 1, key
    assert res[2]["stats"]["placeholder_steps"] == res[2]["stats"]["steps"] > 0
    # the load counts every token of the ranks' real batches (not placeholders), top-k times per MoE layer
    tokens = sum(out["stats"]["tokens"] for out in res)
    load = res[0]["load"]
    assert all(torch.equal(out["load"], load) for out in res)
    assert load.sum(1).tolist() == [tokens * args.n_activated_experts] * args.n_moe_layers
    # EPLB moved the experts: a valid placement (16 experts + 2 redundant, padded to 20 slots: 5 per
    # rank), equal on every rank, different from the default one, the hottest expert replicated
    for m in range(args.n_moe_layers):
        phy2log, num_local = res[0]["placements"][m]
        assert num_local == 5 and phy2log.numel() == 20
        assert set(phy2log.tolist()) == set(range(args.n_routed_experts))
        assert all(torch.equal(out["placements"][m][0], phy2log) for out in res)
        assert not torch.equal(phy2log, res[0]["default"][m])
        hottest = int(load[m].argmax())
        assert (phy2log == hottest).sum() >= 2, f"layer {m}: hottest expert {hottest} has one replica"


FULL_PROMPTS = {0: [[1, 2], [3, 4, 5], [6]], 1: [[7, 8, 9], [10], [11, 12]]}


# A small Engram table: rank 1's part of it is padding only (its construction once failed there).
FULL_ARGS = ModelArgs(engram_table_size=11)


def _every_rank_full(rank, world_size):
    m = DPEPModel(FULL_ARGS, _groups(world_size), max_decode_tokens_per_rank=1)
    table = m.engram_tables[1]
    assert rank == 0 or table.row_start >= table.num_rows, "rank 1 should hold padding rows only"
    out, stats = generate(m, FULL_PROMPTS[rank], 3, max_steps=60)
    m.close()
    return out, stats


def test_generate_when_every_rank_is_full():
    # every rank has prompts pending and no free decode slot: it must decode, not vote for prefill
    # steps it cannot use (that held the group in placeholder prefills forever)
    res = run_ranks(_every_rank_full, 2, timeout=120)
    _check_tokens([out for out, _ in res], FULL_ARGS, FULL_PROMPTS)
    assert all(stats["prefill_steps"] == 3 for _, stats in res), [stats for _, stats in res]


def test_gate_against_hand_computed_choices():
    # DeepSeek-V3's gate, computed here without the model's code: sigmoid scores; the correction bias
    # only selects (it lifts expert 4 into the choice); groups of two are scored by the sum of their
    # biased scores and the best two kept; weights are the unbiased scores, normalised, times 2.5.
    import math

    from epkit.model.layers import route

    args = ModelArgs(n_routed_experts=8, n_expert_groups=4, n_limited_groups=2, n_activated_experts=2)
    logits = [2.0, -1.0, 0.5, 0.4, -2.0, 1.5, 0.0, 0.1]
    bias = [0.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0]
    scores = [1 / (1 + math.exp(-v)) for v in logits]
    biased = [a + b for a, b in zip(scores, bias)]
    groups = sorted(range(4), key=lambda g: -(biased[2 * g] + biased[2 * g + 1]))[:2]
    allowed = [e for g in groups for e in (2 * g, 2 * g + 1)]
    want_idx = sorted(allowed, key=lambda e: -biased[e])[:2]
    total = sum(scores[e] for e in want_idx)
    want_w = [scores[e] / total * 2.5 for e in want_idx]
    assert 4 in want_idx and 0 not in want_idx  # the case is the one described: bias and group limits matter
    x = torch.eye(8, dtype=torch.float64)[:1]
    gate = torch.zeros(8, 8, dtype=torch.float64)
    gate[:, 0] = torch.tensor(logits, dtype=torch.float64)
    idx, w = route(args, x, gate, torch.tensor(bias, dtype=torch.float64))
    assert idx[0].tolist() == want_idx
    assert torch.allclose(w[0].double(), torch.tensor(want_w, dtype=torch.float64), rtol=1e-6)


def test_rope_against_complex_rotation():
    # each (x[k], x[k + half]) pair turns by position * theta^(-k / half), written here as a complex product
    from epkit.model.layers import rope

    t, h, hd, theta = 5, 3, 8, 10000.0
    x = torch.randn(t, h, hd, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1, 2, 7, 100])
    half = hd // 2
    freq = torch.tensor([theta ** (-k / half) for k in range(half)], dtype=torch.float64)
    angle = (pos[:, None].double() * freq)[:, None, :]
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angle), angle)
    want = torch.cat((z.real, z.imag), dim=-1)
    assert torch.allclose(rope(x, pos, theta), want, rtol=0, atol=1e-12)


def test_args_are_checked():
    with pytest.raises(ValueError, match="multiples of 128"):
        ModelArgs(dim=200)
    with pytest.raises(ValueError, match="n_activated_experts"):
        ModelArgs(n_activated_experts=9, n_expert_groups=4, n_limited_groups=2)
    with pytest.raises(ValueError, match="expert_format"):
        ModelArgs(expert_format="int4")
    w = init_weights(ModelArgs(n_layers=2))
    assert w["layers.1.experts_w13"].shape == (16, 256, 256) and "layers.0.w13" in w
    assert torch.equal(init_weights(ModelArgs(n_layers=2))["embed"], w["embed"])  # same seed, same weights


def test_model_config_is_the_plan_view_of_the_args():
    """Every field of the plan's ModelConfig, from args whose sizes all differ (a field read from the wrong size
    shows). The Engram rows are worked out by hand from engram.py's prime rule: layers 0 then 3, one order
    (n = 2), 4 heads, the search from 500 - 1 upwards: layer 0 takes 503 509 521 523, layer 3 the next four
    primes no head took, 541 547 557 563; head_dim = 80 embed / 4 heads."""
    args = ModelArgs(
        vocab_size=300, dim=384, n_layers=5, n_dense_layers=2, n_heads=6, head_dim=24, inter_dim=640,
        moe_inter_dim=256, n_routed_experts=12, n_shared_experts=2, n_activated_experts=3, n_expert_groups=3,
        n_limited_groups=2, expert_format="fp4", engram_layer_ids=(3, 0), engram_max_ngram=2,
        engram_heads_per_ngram=4, engram_embed_per_ngram=80, engram_table_size=500, seed=7,
    )  # fmt: skip
    cfg = args.model_config()
    assert type(cfg) is ModelConfig
    assert dataclasses.asdict(cfg) == {
        "name": "tiny",
        "hidden_size": 384,
        "moe_intermediate_size": 256,
        "n_routed_experts": 12,
        "num_experts_per_tok": 3,
        "num_hidden_layers": 5,
        "num_moe_layers": 3,
        "n_shared_experts": 2,
        "intermediate_size": 640,
        "num_attention_heads": 6,
        "head_dim": 24,
        "v_head_dim": 24,
        "q_lora_rank": 0,
        "kv_lora_rank": 0,
        "qk_rope_head_dim": 0,
        "o_groups": 0,
        "o_lora_rank": 0,
        "vocab_size": 300,
        "engram_layer_ids": (0, 3),
        "engram_num_embeddings": (503 + 509 + 521 + 523, 541 + 547 + 557 + 563),
        "engram_head_dim": 20,
        "weight_format": "fp4",
    }
    plain = ModelArgs(engram_layer_ids=()).model_config("plain")  # no Engram layer: no tables
    assert plain.name == "plain" and plain.engram_num_embeddings == () and plain.engram_head_dim == 0


def test_generate_checks_its_input():
    class _Stub:  # one process, no torch.distributed: generate validates before any step
        class buffer:
            num_max_tokens_per_rank = 4

        class groups:
            cpu_dp_group = None

        args = ModelArgs()
        max_decode_tokens_per_rank = 2
        decode_moe = "low_latency"
        cp_size, cp_rank = 1, 0

    with pytest.raises(ValueError, match="rank 0: prompt 0 has 5 tokens"):
        generate(_Stub(), [[1, 2, 3, 4, 5]], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(_Stub(), [[1]], 0)
    with pytest.raises(ValueError, match=r"prompt 1 holds a token id outside \[0, 256\)"):
        generate(_Stub(), [[1], [2, 256]], 1)


def _one_bad_prompt(rank, world_size):
    m = DPEPModel(ModelArgs(), _groups(world_size), timeout=10)
    prompts = [[1, 2], [3, 999]] if rank == 1 else [[4, 5, 6]]
    with pytest.raises(ValueError, match=r"rank 1: prompt 1 holds a token id"):
        generate(m, prompts, 2)
    with pytest.raises(ValueError, match="different prefill vote intervals"):
        generate(m, [[1]], 1, prefill_any_attempt_interval=8 + rank)
    out, _ = generate(m, [[1, 2]], 2)  # nothing was left half done: the model still generates
    m.close()
    return out


def test_generate_rejects_a_bad_prompt_on_every_rank():
    # one rank's bad input is every rank's ValueError at once, not the others' timeout
    res = run_ranks(_one_bad_prompt, 2, timeout=60)
    assert res[0] == res[1] and len(res[0][0]) == 2


def _gpu_model(rank, world_size):
    """One GPU rank over nvshmem: fused and normal prefill equal bit for bit, and both (and the
    low-latency decode) match the float64 reference."""
    torch.cuda.set_device(0)
    args = ModelArgs()
    m = DPEPModel(args, _groups(world_size), transport="nvshmem", prefill_moe="fused")
    assert m.device.type == "cuda"
    prompts = PROMPTS[0]
    step = Batch.prefill(prompts, [0, 1, 2])
    fused = m.forward(step)
    m.prefill_moe = "normal"  # the prompts start afresh
    normal = m.forward(step)
    assert_bitwise_equal(fused.cpu(), normal.cpu(), "fused vs normal prefill on the GPU")
    nxt = normal.argmax(-1).tolist()
    dec = m.forward(Batch.decode(nxt, [len(p) for p in prompts], [0, 1, 2]))
    m.close()
    ref = forward_reference(args, [p + [t] for p, t in zip(prompts, nxt)])
    for i, want in enumerate(ref):
        assert calc_diff(normal[i].double().cpu(), want[-2]) < THRESH["fp8"], f"prefill {i}"
        assert calc_diff(dec[i].double().cpu(), want[-1]) < THRESH["fp8"], f"decode {i}"
    return True


@requires_cuda
def test_gpu_model_over_nvshmem_matches_reference():
    assert run_ranks(_gpu_model, 1, timeout=240) == [True]
