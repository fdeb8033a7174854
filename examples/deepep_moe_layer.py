"""An engine-style MoE layer written against DeepEP's and DeepGEMM's interfaces, switched to epkit by its import
lines: prefill through DeepEP's normal mode and DeepGEMM's contiguous GEMMs, decode through DeepEP's
low-latency mode and DeepGEMM's masked GEMMs, as vLLM and SGLang call them. Each rank checks its tokens'
outputs against a float32 computation of the same experts.

    python examples/deepep_moe_layer.py --world 2          # CPU ranks, spawned here (epkit.cpu_ranks.run_ranks)
    torchrun --nproc-per-node 2 examples/deepep_moe_layer.py

With DeepEP and DeepGEMM installed, on GPUs: swap the two import lines below and run under torchrun.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import epkit.compat.deep_ep as deep_ep  # the switch: `import deep_ep` runs the same layer on DeepEP
import epkit.compat.deep_gemm as deep_gemm  # and `import deep_gemm` on DeepGEMM
from epkit.quant import per_block_cast_to_fp8, per_token_group_cast_to_fp8

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 256, 128, 8, 2
PREFILL_TOKENS, DECODE_TOKENS, MAX_DISPATCH = 40, 6, 16


def weights(device):
    """Every expert's FP8 weights, the same on every rank (one seed); each rank keeps its local experts."""
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    return tuple(t.to(device) for t in (*per_block_cast_to_fp8(w13), *per_block_cast_to_fp8(w2)))


def swiglu(h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(h[..., :INTER].float()) * h[..., INTER:].float()


class MoELayer:
    """Routed experts over DeepEP's buffer (one for both modes, as SGLang's AUTO mode uses it)."""

    def __init__(self, group, device):
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.local = NUM_EXPERTS // self.world
        w13, s13, w2, s2 = weights(device)
        mine = slice(self.rank * self.local, (self.rank + 1) * self.local)
        self.w13, self.w2 = (w13[mine], s13[mine]), (w2[mine], s2[mine])
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_DISPATCH, HIDDEN, self.world, NUM_EXPERTS)
        num_nvl_bytes = deep_ep.Buffer.get_dispatch_config(self.world).get_nvl_buffer_size_hint(2 * HIDDEN, self.world)
        self.buffer = deep_ep.Buffer(
            group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=self.local
        )

    def prefill(self, x, topk_idx, topk_weights):
        """Normal mode: FP8 rows to the experts' ranks, DeepGEMM's contiguous layout, weighted rows back."""
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = (
            self.buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
        )
        align = deep_gemm.get_mk_alignment_for_contiguous_layout()
        (recv_x, recv_scales), recv_idx, recv_weights, counts, handle, _ = self.buffer.dispatch(
            per_token_group_cast_to_fp8(x),
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            expert_alignment=align,
        )
        # permute: one row per (received token, local expert), expert-major, each expert's block aligned
        starts = torch.tensor([0, *counts], device=x.device).cumsum(0)[:-1]
        j, k = (recv_idx >= 0).nonzero(as_tuple=True)
        expert = recv_idx[j, k].long()
        order = torch.argsort(expert, stable=True)
        j, k, expert = j[order], k[order], expert[order]
        first = torch.searchsorted(expert, expert, right=False)
        pos = starts[expert] + torch.arange(expert.numel(), device=x.device) - first
        m = sum(counts)
        m_indices = torch.full((m,), -1, dtype=torch.int32, device=x.device)
        m_indices[pos] = expert.int()
        a = torch.zeros((m, HIDDEN), dtype=recv_x.dtype, device=x.device)
        sa = torch.ones((m, HIDDEN // 128), device=x.device)
        a[pos], sa[pos] = recv_x[j], recv_scales[j]
        h = torch.empty((m, 2 * INTER), dtype=torch.bfloat16, device=x.device)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), self.w13, h, m_indices)
        out = torch.empty((m, HIDDEN), dtype=torch.bfloat16, device=x.device)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(per_token_group_cast_to_fp8(swiglu(h)), self.w2, out, m_indices)
        rows = torch.zeros((recv_x.shape[0], HIDDEN), device=x.device)
        rows.index_add_(0, j, out[pos].float() * recv_weights[j, k, None])
        combined, _, _ = self.buffer.combine(rows.bfloat16(), handle)
        return combined

    def decode(self, x, topk_idx, topk_weights):
        """Low-latency mode: FP8 rows into fixed slots (DeepGEMM's masked layout), weighted sum at the source."""
        (recv_x, recv_scales), recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
            x, topk_idx, MAX_DISPATCH, NUM_EXPERTS, use_fp8=True, return_recv_hook=True
        )
        hook()  # receive (an engine overlaps other work with it)
        expected_m = max(1, (x.shape[0] * self.world * TOP_K + NUM_EXPERTS - 1) // NUM_EXPERTS)
        slots = recv_x.shape[1]
        h = torch.empty((self.local, slots, 2 * INTER), dtype=torch.bfloat16, device=x.device)
        deep_gemm.m_grouped_fp8_gemm_nt_masked((recv_x, recv_scales), self.w13, h, recv_count, expected_m)
        y = torch.empty((self.local, slots, HIDDEN), dtype=torch.bfloat16, device=x.device)
        act = per_token_group_cast_to_fp8(torch.nan_to_num(swiglu(h)))  # rows past recv_count hold whatever was there
        deep_gemm.m_grouped_fp8_gemm_nt_masked(act, self.w2, y, recv_count, expected_m)
        combined, _, _ = self.buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
        return combined


def reference(x, topk_idx, topk_weights, device) -> torch.Tensor:
    """The same experts in float32 on this rank's tokens (dequantized weights, unquantized activations)."""
    w13, s13, w2, s2 = weights(device)
    w13 = w13.float() * s13.repeat_interleave(128, 1).repeat_interleave(128, 2)
    w2 = w2.float() * s2.repeat_interleave(128, 1).repeat_interleave(128, 2)
    out = torch.zeros((x.shape[0], HIDDEN), device=device)
    for t in range(x.shape[0]):
        for e, w in zip(topk_idx[t].tolist(), topk_weights[t].tolist()):
            if e >= 0:
                out[t] += w * (swiglu(x[t].float() @ w13[e].T) @ w2[e].T)
    return out


def calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(1 - 2 * (a * b).sum() / (a * a + b * b).sum())


def route(tokens: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16().to(device)
    weights_, idx = torch.randn(tokens, NUM_EXPERTS, generator=g).softmax(-1).topk(TOP_K)
    return x, idx.to(device), weights_.to(device)


def run(rank: int, world: int) -> str:
    device = (
        torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    )
    layer = MoELayer(dist.group.WORLD, device)
    lines = []
    for name, step, tokens in (
        ("prefill", layer.prefill, PREFILL_TOKENS + 7 * rank),
        ("decode", layer.decode, DECODE_TOKENS),
    ):
        x, idx, w = route(tokens, 10 * rank + len(lines), device)
        diff = calc_diff(step(x, idx, w), reference(x, idx, w, device))
        assert diff < 5e-3, f"rank {rank} {name}: calc_diff {diff:.2e} against the float32 experts"
        lines.append(f"rank {rank} {name}: {tokens} tokens, calc_diff {diff:.1e} against the float32 experts: ok")
    return "\n".join(lines)


def _spawned(rank: int, world: int) -> str:
    return run(rank, world)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="CPU ranks to spawn when not under torchrun")
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        print(run(dist.get_rank(), dist.get_world_size()), flush=True)
        dist.destroy_process_group()
        return
    from epkit.cpu_ranks import run_ranks

    for out in run_ranks(_spawned, args.world, timeout=240):
        print(out, flush=True)


if __name__ == "__main__":
    main()
