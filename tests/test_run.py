"""``epkit run``: the reference model as a command (verdict, step times, per-op breakdown, measured ledger)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from epkit.model.run import build_parser, check_ledger, main, run_rank
from epkit.testing.multiprocess import run_ranks

OPS = {"attention", "gate", "logical_to_physical", "dispatch", "experts", "combine", "engram_fetch", "lockstep"}


def _run(tmp_path, *argv):
    path = tmp_path / "run.json"
    status = main([*argv, "--json", str(path)])
    return status, json.loads(path.read_text())


def test_two_ranks_agree_with_the_oracle_and_the_ledger_with_the_claim(tmp_path, capsys):
    status, rep = _run(tmp_path, "--ranks", "2", "--steps", "2", "--idle", "1")
    out = capsys.readouterr().out
    assert status == 0 and rep["verdict"]["ok"] and rep["verdict"]["tokens"] == 2 * 3, rep["verdict"]
    assert rep["ledger_ok"] and {r["kind"] for r in rep["ledger"]} >= {"exchange:ll_dispatch", "dist.all_reduce"}
    assert rep["phases"]["decode"]["steps"] == 2 and rep["phases"]["prefill"]["steps"] == 1
    assert set(rep["decode_ops_s"]) >= OPS, rep["decode_ops_s"]
    assert 0 < rep["dispatch_combine_share"] < 1
    assert "verdict:" in out and "PASS" in out and "DIFFERS" not in out


def test_fp4_experts_run_and_agree(tmp_path):
    status, rep = _run(tmp_path, "--ranks", "2", "--steps", "1", "--weights", "fp4", "--requests", "1")
    assert status == 0 and rep["verdict"]["ok"] and rep["weights"] == "fp4", rep["verdict"]


def _with_a_layer_all_reduce(rank, world_size, a):
    """run_rank with attention made to all-reduce its output, as a TP layout would (the ledger must see it)."""
    import epkit.model.model as model_module

    original = model_module.attention

    def attention_with_all_reduce(*args, **kwargs):
        out = original(*args, **kwargs)
        dist.all_reduce(out.contiguous())
        return out

    model_module.attention = attention_with_all_reduce
    return run_rank(rank, world_size, a)


def test_the_ledger_flags_a_layer_that_adds_an_all_reduce():
    a = build_parser().parse_args(["--steps", "1", "--requests", "1"])
    res = run_ranks(_with_a_layer_all_reduce, 2, a, timeout=120)
    decode = next(i for i, s in enumerate(res[0]["steps"]) if not s["prefill"])
    rows = {r["kind"]: r for r in check_ledger(res[0]["ledger"][decode], n_moe=2, n_engram=1)}
    assert rows["dist.all_reduce"]["count"] == 1 + 3 and not rows["dist.all_reduce"]["ok"], rows  # 3 layers
    assert rows["exchange:ll_dispatch"]["ok"] and rows["exchange:ll_combine"]["ok"]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--ranks", "2", "--dp", "3"], "--dp 3 does not match the 2 ranks"),
        (["--ranks", "2", "--ep", "4"], "--ep 4 does not match the 2 ranks"),
        (["--ranks", "2", "--prompt-len", "1000"], "exceeds the model's prefill capacity"),
        (["--ranks", "2", "--idle", "5"], "--idle 5 is not a rank"),
        (["--ranks", "2", "--preset", "v4.1-flash"], "use it with --dry-run"),
    ],
)
def test_bad_options_are_one_clear_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_an_unknown_transport_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--transport", "carrier-pigeon"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_dry_run_prints_the_deployment_ledger_without_weights(capsys):
    assert main(["--dry-run", "--preset", "v4.1-flash", "--ranks", "64"]) == 0
    out = capsys.readouterr().out
    assert '"dp_wide_ep"' in out and '"moe_all_to_all": 80' in out and '"dp_liveness": 1' in out


def test_under_torchrun_every_process_is_a_rank():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "epkit.run", "--steps", "1", "--requests", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("verdict:") == 1 and "PASS" in res.stdout, res.stdout
