"""``epkit run``: the reference model as a command (verdict, step times, per-op breakdown, measured ledger)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from epkit.model.args import ModelArgs
from epkit.model.run import build_parser, check_ledger, cp_prefill_gathers, main, run_rank
from epkit.testing.markers import requires_cuda
from epkit.testing.multiprocess import run_ranks

OPS = {"attention", "gate", "logical_to_physical", "dispatch", "experts", "combine", "engram_fetch", "lockstep"}


def _run(tmp_path, *argv):
    path = tmp_path / "run.json"
    status = main([*argv, "--json", str(path)])
    return status, json.loads(path.read_text())


def test_two_ranks_agree_with_the_oracle_and_the_ledger_with_the_claim(tmp_path, capsys):
    status, rep = _run(tmp_path, "--ranks", "2", "--steps", "2", "--idle", "1", "--weights", "fp4")
    out = capsys.readouterr().out
    assert status == 0 and rep["verdict"]["ok"] and rep["verdict"]["tokens"] == 2 * 3, rep["verdict"]
    assert rep["weights"] == "fp4"
    assert rep["ledger_ok"] and {r["kind"] for r in rep["ledger"]} >= {"exchange:ll_dispatch", "dist.all_reduce"}
    assert rep["phases"]["decode"]["steps"] == 2 and rep["phases"]["prefill"]["steps"] == 1
    assert set(rep["decode_ops_s"]) >= OPS, rep["decode_ops_s"]
    assert 0 < rep["dispatch_combine_share"] < 1
    assert "verdict:" in out and "PASS" in out and "DIFFERS" not in out


def test_cp_prefill_and_tbo_decode_give_the_cp1_bits():
    # one replica per expert: the replica a token gets depends on its rank (own rank first), and a replica on
    # another rank gives other bits (see the report); with one, a CP rank's tokens get the cp=1 bits exactly
    one = ["--steps", "2", "--redundant-experts", "0"]
    base = run_ranks(run_rank, 2, build_parser().parse_args(one), timeout=120)
    a = build_parser().parse_args([*one, "--cp", "2", "--tbo"])
    res = run_ranks(run_rank, 2, a, timeout=120)
    # the engine's prompts are base rank 0's; CP rank 0 reports them (rank 1 decoded the odd ones)
    assert res[0]["prompts"] == base[0]["prompts"] and res[1]["prompts"] == []
    assert res[0]["prefill_logits"] == base[0]["prefill_logits"] and res[0]["tokens"] == base[0]["tokens"]
    for sid, rows in base[0]["logits"].items():  # prefill and every decode step, bit for bit
        assert res[sid % 2]["logits"][sid] == rows, sid
    args = ModelArgs()
    first = next(i for i, s in enumerate(res[0]["steps"]) if s["prefill"])
    assert cp_prefill_gathers(res[0]["ledger"][first], args) == {"count": 5, "claim": 5, "ok": True}
    decode = next(i for i, s in enumerate(res[0]["steps"]) if not s["prefill"])
    rows = {r["kind"]: r for r in check_ledger(res[0]["ledger"][decode], 2, 1, micro_batches=2, dp=1)}
    assert rows["exchange:ll_dispatch"]["count"] == 2 * 2 and all(r["ok"] for r in rows.values()), rows
    assert all(s["ops"]["overlapped_comm"] > 0 for s in res[0]["steps"] if not s["prefill"])


def test_four_ranks_cp2_bf16_with_an_idle_engine(tmp_path):
    status, rep = _run(tmp_path, "--ranks", "4", "--cp", "2", "--weights", "bf16", "--steps", "1", "--requests",
                       "1", "--idle", "1", "--enp", "2")  # fmt: skip
    assert status == 0 and rep["verdict"]["ok"] and rep["verdict"]["tokens"] == 2, rep["verdict"]
    assert rep["dp"] == 2 and rep["ledger_ok"], rep["ledger"]


def test_tbo_is_bit_identical_on_one_rank():
    a = build_parser().parse_args(["--steps", "2", "--requests", "3"])
    plain = run_ranks(run_rank, 1, a, timeout=120)[0]
    a.tbo = True
    tbo = run_ranks(run_rank, 1, a, timeout=120)[0]
    assert tbo["tokens"] == plain["tokens"] and tbo["logits"] == plain["logits"]
    assert all(s["ops"]["overlapped_comm"] > 0 for s in tbo["steps"] if not s["prefill"])


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
        (["--ranks", "2", "--idle", "5"], "--idle 5 is not an engine"),
        (["--ranks", "2", "--preset", "v4.1-flash"], "use it with --dry-run"),
        (["--ranks", "2", "--cp", "3"], "--cp 3 does not divide the 2 ranks"),
        (["--ranks", "4", "--cp", "2", "--dp", "4"], "--dp 4 does not match the 4 ranks with --cp 2"),
        (["--ranks", "4", "--enp", "3"], "--enp 3 does not divide the 4 ranks"),
        (["--ranks", "2", "--prompt", "1,2,999"], "token id 999 is outside the vocabulary"),
        (["--ranks", "2", "--prompt", "1,x"], "is not comma-separated token ids"),
        (["--ranks", "2", "--cp", "2", "--prompt-len", "513"], "prefill capacity (512 tokens at --cp 2)"),
    ],
)
def test_bad_options_are_one_clear_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_nvshmem_without_a_gpu_is_one_clear_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the message of a machine with no GPU, anywhere
    assert main(["--ranks", "2", "--transport", "nvshmem"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--transport nvshmem needs CUDA GPUs" in err[0], err


def test_a_bad_prompt_reaching_the_ranks_is_one_line_on_every_rank(capfd):
    # past the launcher's own checks (run_rank called directly): generate rejects it on every rank, no hang
    a = build_parser().parse_args(["--prompt", "1,2", "--prompt", "3,256"])
    res = run_ranks(run_rank, 2, a, timeout=60)
    assert all("rank 1: prompt 0 holds a token id outside [0, 256)" in r["error"] for r in res), res
    err = capfd.readouterr().err
    assert all(err.count(f"epkit run: error: rank {r}: generate rejected") == 1 for r in (0, 1)), err


def test_an_unknown_transport_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--transport", "carrier-pigeon"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_dry_run_prints_the_deployment_ledger_without_weights(capsys):
    assert main(["--dry-run", "--preset", "v4.1-flash", "--ranks", "64", "--json"]) == 0  # text: the table alone
    out = capsys.readouterr().out
    assert '"dp_wide_ep"' in out and '"moe_all_to_all": 80' in out and '"dp_liveness": 1' in out


def test_under_torchrun_every_process_is_a_rank():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "epkit", "run", "--steps", "1", "--requests", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("verdict:") == 1 and "PASS" in res.stdout, res.stdout


@requires_cuda
def test_gpu_epkit_run_over_nvshmem(capsys):
    # rung 4: the command itself on one GPU rank (rows on the GPU over nvshmem), verdict and ledger as on CPU
    assert main(["--ranks", "1", "--transport", "nvshmem", "--steps", "2", "--timeout", "240"]) == 0
    assert "transport nvshmem" in capsys.readouterr().out


# --- issue 37: what a newcomer met -----------------------------------------------------------------------------


class _Launched(Exception):
    """Raised by the launcher stub: the command got as far as starting ranks."""


def _no_launch(monkeypatch) -> list:
    """Replace the rank launcher by a stub that records the world size and stops the command there."""
    import epkit.cpu_ranks as mp_module

    seen = []

    def launch(fn, world, *args, **kwargs):
        seen.append(world)
        raise _Launched(world)

    monkeypatch.setattr(mp_module, "run_ranks", launch)
    return seen


def test_more_ranks_than_the_machine_can_start_is_one_line_before_anything_launches(capsys, monkeypatch):
    launched = _no_launch(monkeypatch)
    assert main(["--ranks", "1000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert launched == [] and len(err) == 1, err
    assert "--ranks 1000" in err[0] and "--force" in err[0] and "core" in err[0] and "memory" in err[0], err
    assert "launching" not in err[0] and "Traceback" not in err[0]


def test_force_launches_past_the_machine_limit(capsys, monkeypatch):
    import epkit.model.run as run_module

    launched = _no_launch(monkeypatch)
    monkeypatch.setattr(run_module, "rank_limit", lambda: (1, "1 (as this test says)"))
    assert main(["--ranks", "2"]) == 2 and launched == []
    assert "--ranks 2 is more than" in capsys.readouterr().err
    with pytest.raises(_Launched):
        main(["--ranks", "2", "--force"])
    assert launched == [2]


def test_dry_run_honours_the_preset_and_the_weights(capsys):
    assert main(["--dry-run", "--preset", "tiny", "--weights", "bf16", "--ranks", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    args = ModelArgs()
    assert doc["model"] == "tiny" and doc["layout"]["weight_format"] == "bf16", doc["layout"]
    assert doc["experts"]["logical"] == args.n_routed_experts and doc["experts"]["topk"] == args.n_activated_experts
    assert doc["expert_bytes"]["per_expert"] == 3 * args.dim * args.moe_inter_dim * 2
    assert doc["ledger"]["dp_wide_ep"]["moe_all_to_all"] == 2 * args.n_moe_layers
    # the deployment-scale preset in its own format unless --weights says otherwise
    assert main(["--dry-run", "--preset", "v4.1-flash", "--ranks", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["weight_format"] == "fp4"
    assert main(["--dry-run", "--preset", "v4.1-flash", "--ranks", "64", "--weights", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["weight_format"] == "fp8"


def test_dry_run_text_is_the_table_without_raw_json(capsys):
    assert main(["--dry-run", "--preset", "v4.1-flash", "--ranks", "64"]) == 0
    out = capsys.readouterr().out
    assert "{" not in out and '"ledger"' not in out, out
    assert "bytes per expert (fp4)" in out and "collectives per decode step" in out and "DP+Wide-EP 81" in out


def test_dry_run_of_more_ranks_than_the_tiny_model_has_experts_is_one_line(capsys):
    assert main(["--dry-run", "--preset", "tiny", "--ranks", "32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "larger than the 16 routed experts of tiny" in err[0], err


def _counting_forwards(rank, world_size, a):
    """run_rank, with every forward of the model counted (the timed ones and any before the clock starts)."""
    from epkit.model.model import DPEPModel

    calls = []
    original = DPEPModel.forward

    def forward(self, batch):
        calls.append(batch.num_tokens)
        return original(self, batch)

    DPEPModel.forward = forward
    res = run_rank(rank, world_size, a)
    return len(calls), res


def test_the_warm_up_runs_before_the_timed_steps():
    a = build_parser().parse_args(["--steps", "2", "--requests", "1"])
    calls, res = run_ranks(_counting_forwards, 1, a, timeout=120)[0]
    # the first calls (kernel set-up, first touch of the buffers) ran off the clock: more forwards than timed steps
    assert calls > len(res["steps"]), (calls, res["steps"])
    assert res["warm_up"]["steps"] == calls - len(res["steps"]) >= 2  # a prefill and a decode step
    assert [s["prefill"] for s in res["steps"]] == [True, False, False]  # the timed ones are the request's


def test_zero_requests_or_every_engine_idle_is_bad_usage(capsys, monkeypatch):
    launched = _no_launch(monkeypatch)
    assert main(["--ranks", "2", "--requests", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--requests must be >= 1, got 0" in err[0], err
    assert main(["--ranks", "2", "--idle", "0", "--idle", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--idle leaves no engine with a request" in err[0], err
    assert main(["--ranks", "2", "--timeout", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--timeout must be > 0, got 0" in err[0], err
    assert launched == []


def test_a_timeout_is_printed_as_given(capsys):
    # the ranks cannot import epkit and build the model in half a second
    assert main(["--ranks", "1", "--timeout", "0.5"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "launching" not in line]
    assert len(err) == 1 and "within 0.5 s" in err[0] and "(--timeout 0.5)" in err[0], err


_NO_RESOLVER = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>
/* getnameinfo as on a host whose resolver cannot be reached: a name lookup fails with EAI_AGAIN */
int getnameinfo(const struct sockaddr *sa, socklen_t salen, char *host, socklen_t hostlen, char *serv,
                socklen_t servlen, int flags) {
    int (*real)(const struct sockaddr *, socklen_t, char *, socklen_t, char *, socklen_t, int) =
        dlsym(RTLD_NEXT, "getnameinfo");
    if (host && hostlen && !(flags & NI_NUMERICHOST)) return EAI_AGAIN;
    return real(sa, salen, host, hostlen, serv, servlen, flags);
}
"""


def test_a_run_on_a_host_without_a_resolver_prints_no_hostname_warning(tmp_path):
    # Offline hosts answer no reverse lookup. torch's c10d names the peer of every TCPStore connection with
    # getnameinfo; for the IPv4-mapped ::ffff:127.0.0.1 its clients connect to, /etc/hosts has no entry, the
    # lookup goes to DNS, fails, and each connection printed "[c10d] The hostname of the client socket cannot
    # be retrieved. err=-3". Here a preloaded getnameinfo fails every name lookup as such a host does.
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not sys.platform.startswith("linux"):
        pytest.skip("needs a C compiler on Linux (to build the getnameinfo of a host without a resolver)")
    src, lib = tmp_path / "no_resolver.c", tmp_path / "no_resolver.so"
    src.write_text(_NO_RESOLVER)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl"], check=True, timeout=120)
    env = {**os.environ, "LD_PRELOAD": str(lib)}
    probe = "import socket\ntry:\n    socket.getnameinfo(('127.0.0.1', 1), 0)\nexcept OSError:\n    print('none')"
    check = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert check.stdout.strip() == "none", check.stdout + check.stderr  # the emulation holds
    cmd = [sys.executable, "-m", "epkit", "run", "--ranks", "2", "--steps", "1", "--requests", "1"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0 and "PASS" in res.stdout, res.stdout + res.stderr
    assert "hostname" not in res.stderr and "[c10d]" not in res.stderr, res.stderr
