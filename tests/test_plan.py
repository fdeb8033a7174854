"""epkit plan reproduces the source documents' figures."""

import json
import os
import subprocess
import sys

import pytest

from epkit.plan import load_model, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_v41_flash_ep64():
    p = plan("v4.1-flash", dp=64, ep=64, weight_format="fp4")
    assert (p.experts["logical"], p.experts["extra"], p.experts["physical"], p.experts["local"]) == (384, 64, 448, 7)
    assert p.expert_bytes["per_expert"] == 3 * 5120 * 2304 / 2  # gate, up, down in FP4
    assert round(p.expert_bytes["per_expert"] / 1e6, 1) == 17.7
    assert round(p.expert_bytes["per_rank_per_layer"] / 1e6) == 124


def test_v41_flash_ep8():
    p = plan("v4.1-flash", dp=8, ep=8)
    assert (p.experts["extra"], p.experts["local"]) == (8, 49)
    assert round(p.expert_bytes["per_rank_per_layer"] / 1e6) == 867
    ratio = p.expert_bytes["per_rank_per_layer"] / plan("v4.1-flash", dp=64).expert_bytes["per_rank_per_layer"]
    assert ratio == pytest.approx(7.0)  # "两者相差约 7 倍"


def test_deepseek_v3_dispatch_combine():
    nv = plan("deepseek-v3", dp=32, tokens_per_rank=128, link_gbps=450)
    ib = plan("deepseek-v3", dp=32, tokens_per_rank=128, link_gbps=50)
    c = nv.communication
    assert c["dispatch_bytes_per_layer"] == 128 * 8 * 7168
    assert c["combine_bytes_per_layer"] == 128 * 8 * 7168 * 2
    assert round(c["dispatch_combine_bytes_per_layer"] / 1e6) == 22
    assert round(c["dispatch_combine_us_per_layer"]) == 49
    assert round(ib.communication["dispatch_combine_us_per_layer"]) == 440


def test_ledger_and_expected_reads():
    p = plan("deepseek-v3", dp=32)
    assert p.ledger["dp_wide_ep"] == {
        "attention_all_reduce": 0,
        "mlp_all_reduce": 0,
        "moe_all_to_all": 116,
        "dp_liveness": 1,
        "total": 117,
    }
    assert p.ledger["tp_ep"]["total"] == 2 * 61 + 2 * 58
    small = plan("deepseek-v3", dp=32, tokens_per_rank=1)
    # 32 tokens x top-8 over 288 slots: each local expert is active with probability 1-(1-8/288)^32.
    assert small.expert_bytes["p_expert_active_uniform"] == pytest.approx(1 - (1 - 8 / 288) ** 32)
    assert small.expert_bytes["read_per_layer_step_expected"] < small.expert_bytes["read_per_layer_step_upper"]


def test_hf_config(tmp_path):
    cfg = {
        "hidden_size": 7168,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "n_shared_experts": 1,
        "intermediate_size": 18432,
        "num_attention_heads": 128,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "vocab_size": 129280,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = load_model(str(path))
    assert m.num_moe_layers == 58 and m.head_dim == 192
    a, b = plan(str(path), dp=16).to_dict(), plan("deepseek-v3", dp=16).to_dict()
    a.pop("model"), b.pop("model")
    assert a == b  # the preset is the public config


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(model="nope", dp=8), "unknown model 'nope'"),
        (dict(model="v4.1-flash", dp=64, ep=48), "not divisible by ep_size 48"),
        (dict(model="v4.1-flash", dp=0), "dp_size must be a positive integer"),
        (dict(model="deepseek-v3", dp=512), "ep_size 512 is larger than the 256 routed experts"),
        (dict(model="v4.1-flash", dp=8, weight_format="int3"), "weight_format must be one of"),
        (dict(model="v4.1-flash", dp=8, tokens_per_rank=0), "tokens_per_rank must be > 0"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(**kwargs)


def test_bad_config_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_model(str(bad))
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"hidden_size": 10}))
    with pytest.raises(ValueError, match="missing required field"):
        load_model(str(partial))
    neg = tmp_path / "neg.json"
    neg.write_text(
        json.dumps(
            {
                "hidden_size": 10,
                "moe_intermediate_size": -1,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "num_hidden_layers": 2,
            }
        )
    )
    with pytest.raises(ValueError, match="moe_intermediate_size must be a positive integer"):
        load_model(str(neg))
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "missing.json"))


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "epkit", "plan", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_cli_table_and_json():
    res = _cli("--model", "v4.1-flash", "--dp", "64", "--ep", "64")
    assert res.returncode == 0, res.stderr
    assert "physical 448; local 7 per rank" in res.stdout and "17.7 MB" in res.stdout
    res = _cli("--model", "deepseek-v3", "--dp", "32", "--json")
    data = json.loads(res.stdout)
    assert data["communication"]["dispatch_combine_bytes_per_layer"] == 128 * 8 * 7168 * 3


def test_cli_bad_input_no_traceback():
    res = _cli("--dp", "64", "--ep", "48")
    assert res.returncode == 2
    assert "not divisible by ep_size 48" in res.stderr and "Traceback" not in res.stderr


# --- issue 37: the plan's defaults are the named model's ----------------------------------------------------------


def test_the_weight_format_defaults_to_the_models_own(tmp_path):
    v3 = plan("deepseek-v3", dp=32)  # DeepSeek-V3 ships FP8 expert weights (128x128 blocks)
    assert v3.layout["weight_format"] == "fp8" and v3.expert_bytes["per_expert"] == 3 * 7168 * 2048 * 1
    assert plan("v4.1-flash", dp=64).layout["weight_format"] == "fp4"  # V4.1-Flash: FP4 experts
    assert plan("deepseek-v3", dp=32, weight_format="fp4").expert_bytes["per_expert"] == 3 * 7168 * 2048 / 2
    base = {"hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 16, "num_experts_per_tok": 2,
            "num_hidden_layers": 2}  # fmt: skip
    for quant, fmt in [
        ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "fp8"),
        ({"quant_method": "mxfp4"}, "fp4"),
        (None, "bf16"),  # no quantization_config: the weights are the checkpoint's dtype
    ]:
        path = tmp_path / f"{fmt}.json"
        path.write_text(json.dumps({**base, **({"quantization_config": quant} if quant else {})}))
        assert load_model(str(path)).weight_format == fmt
        assert plan(str(path), dp=2).layout["weight_format"] == fmt


def test_cli_plan_defaults_are_the_models_and_in_help():
    res = _cli("--model", "deepseek-v3", "--dp", "32")
    assert res.returncode == 0, res.stderr
    assert "bytes per expert (fp8)" in res.stdout, res.stdout
    res = _cli("--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())  # argparse wraps the help lines
    assert "default 128" in text and "fp8 for deepseek-v3" in text and "fp4 for v4.1-flash" in text, text
