"""The engine tests' routing data and their plain-torch MoE reference: an all-to-all over ``torch.distributed``.

Every value is chosen so that the engines' results are exact in bf16: activations are integers in [-2, 2], router
weights 0.25 or 0.5 and each expert multiplies by 1 or 2 (:func:`expert_scale`). A token's output is then a
multiple of 0.25 below 8 in magnitude, and so is every partial sum on the way, whatever the order, the rank
split or the float32/bf16 rounding of an engine's combine: a correct run equals the reference bit for bit, and
any perturbation of the exchange (a row, a weight, a scale of the output) shows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def expert_scale(global_expert: torch.Tensor) -> torch.Tensor:
    """The stand-in expert: expert ``e`` multiplies its rows by ``1 + e % 2``."""
    return 1.0 + (global_expert % 2).float()


def routing(rank: int, num_tokens: int, hidden: int, num_experts: int, topk: int, seed: int = 0):
    """One rank's tokens ``(num_tokens, hidden)`` bf16, distinct top-k expert ids (int64) and float32 weights."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randint(-2, 3, (num_tokens, hidden), generator=g).to(torch.bfloat16)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(-1)[:, :topk].to(torch.int64)
    weights = (torch.randint(1, 3, (num_tokens, topk), generator=g) * 0.25).to(torch.float32)
    return x, ids, weights


def local_expert_counts(
    rank: int, tokens_per_rank: list[int], hidden: int, num_experts: int, topk: int, seed: int = 0
) -> torch.Tensor:
    """How many routes every rank's :func:`routing` (``tokens_per_rank[r]`` tokens on rank ``r``) sends to each of
    ``rank``'s experts: the per-expert counts a low-latency dispatch must report on ``rank``."""
    per_rank = num_experts // len(tokens_per_rank)
    ids = [routing(r, n, hidden, num_experts, topk, seed)[1].reshape(-1) for r, n in enumerate(tokens_per_rank)]
    return torch.bincount(torch.cat(ids), minlength=num_experts)[rank * per_rank : (rank + 1) * per_rank]


def reference_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``y[t] = sum_k w[t, k] * expert_scale(ids[t, k]) * x[t]``, the experts applied on their owner ranks.

    Each (token, k) row goes to the rank owning its expert with ``dist.all_to_all_single``, the owner applies the
    expert and the weight, the rows come back the same way, and the source sums them in float32 (bf16 at the end).
    """
    world = dist.get_world_size()
    per_rank = num_experts // world
    tokens, topk = ids.shape
    flat_ids = ids.reshape(-1)
    owner = flat_ids // per_rank
    order = owner.argsort(stable=True)
    send_rows = x.float().repeat_interleave(topk, 0)[order]
    send_meta = torch.stack([flat_ids[order].float(), weights.reshape(-1)[order]], 1)
    send_counts = torch.bincount(owner, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    split_out, split_in = recv_counts.tolist(), send_counts.tolist()
    recv_rows = x.new_empty((sum(split_out), x.shape[1]), dtype=torch.float32)
    recv_meta = send_meta.new_empty((sum(split_out), 2))
    dist.all_to_all_single(recv_rows, send_rows, split_out, split_in)
    dist.all_to_all_single(recv_meta, send_meta, split_out, split_in)
    done = recv_rows * (recv_meta[:, 1] * expert_scale(recv_meta[:, 0].long())).unsqueeze(1)
    back = torch.empty_like(send_rows)
    dist.all_to_all_single(back, done, split_in, split_out)
    per_route = torch.empty_like(back)
    per_route[order] = back
    return per_route.reshape(tokens, topk, x.shape[1]).sum(1).to(torch.bfloat16)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit equality (module docstring: the data make every correct result exact), naming the first difference."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.dtype} {tuple(got.shape)} vs " + (
        f"{want.dtype} {tuple(want.shape)}"
    )
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].tolist()
        raise AssertionError(
            f"{what} differs from the torch reference at {bad}: {got[tuple(bad)]} vs {want[tuple(bad)]}"
        )
