"""The reference model's per-rank building blocks: the step batch and the dense part (norms, SwiGLU,
RoPE, attention with a per-sequence KV cache, DeepSeek-V3's gate, logits).

Shared by :class:`epkit.model.DPEPModel` (float32) and :func:`epkit.model.forward_reference`
(float64). Attention never communicates under DP attention; the gate and RoPE have their own
tests against hand-computed values, since the reference shares this code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from epkit.lockstep import placeholder_batch
from epkit.model.args import ModelArgs
from epkit.utils import ROW_ALIGN

__all__ = [
    "Batch",
    "attend",
    "attention",
    "check_batch",
    "logits",
    "project",
    "rms_norm",
    "rope",
    "route",
    "swiglu_mlp",
]


@dataclass
class Batch:
    """One step's tokens on one DP rank: ``S`` sequences packed back to back.

    ``token_ids [T] int64``, ``positions [T] int64`` (position in its sequence; decode rows continue
    the cached prefix), ``cu_seqlens [S+1] int64``, ``seq_ids`` (``S`` hashable ids keying the KV
    cache; ``None`` = not cached, e.g. a placeholder), ``is_prompt``, ``is_placeholder`` (its
    output is discarded and its tokens are not counted as expert load).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_ids: list
    is_prompt: bool
    is_placeholder: bool = False

    @classmethod
    def prefill(cls, prompts: list[list[int]], seq_ids: list) -> Batch:
        lens = [len(p) for p in prompts]
        return cls(
            token_ids=torch.tensor([t for p in prompts for t in p], dtype=torch.int64),
            positions=torch.cat([torch.arange(n) for n in lens]) if lens else torch.zeros(0, dtype=torch.int64),
            cu_seqlens=torch.tensor([0, *lens], dtype=torch.int64).cumsum(0),
            seq_ids=list(seq_ids),
            is_prompt=True,
        )

    @classmethod
    def decode(cls, tokens: list[int], positions: list[int], seq_ids: list) -> Batch:
        return cls(
            token_ids=torch.tensor(tokens, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            cu_seqlens=torch.arange(len(tokens) + 1, dtype=torch.int64),
            seq_ids=list(seq_ids),
            is_prompt=False,
        )

    @classmethod
    def placeholder(cls, is_prompt: bool) -> Batch:
        """The one-token dummy batch of :func:`epkit.lockstep.placeholder_batch`, not cached."""
        p = placeholder_batch(is_prompt)
        return cls(p.token_ids.long(), p.positions.long(), p.cu_seqlens.long(), [None], is_prompt, True)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())


# The dense part: shared by the parallel model (float32) and the reference (float64). Attention never
# communicates under DP attention, so it is not what the reference checks.


def pad_rows(x: torch.Tensor, align: int = ROW_ALIGN) -> torch.Tensor:
    """``x`` with zero rows appended up to a multiple of ``align`` rows (dimension 0)."""
    pad = -x.shape[0] % align
    return torch.cat((x, x.new_zeros((pad, *x.shape[1:])))) if pad else x


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with each row's bits independent of the other rows (see :data:`epkit.utils.ROW_ALIGN`)."""
    return (pad_rows(x) @ w.T)[: x.shape[0]]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def swiglu_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = linear(x, w13).chunk(2, dim=-1)
    return linear(torch.nn.functional.silu(gate) * up, w2)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on ``x [T, H, hd]`` at integer positions ``pos [T]``."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    ang = (pos.double()[:, None] * freq[None, :]).to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), dim=-1)


def project(args: ModelArgs, w: dict, p: str, x: torch.Tensor, pos: torch.Tensor, name: str) -> torch.Tensor:
    """``x [T, D]`` through ``w[p + name]`` as heads ``[T, H, hd]``; ``wq`` and ``wk`` rotated (RoPE at ``pos``)."""
    out = linear(x, w[p + name]).view(x.shape[0], args.n_heads, args.head_dim)
    return out if name == "wv" else rope(out, pos.to(x.device), args.rope_theta)


def attend(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """One sequence's queries ``q [n, H, hd]`` over its keys ``ks, vs [K, H, hd]``: query ``j`` sees the first
    ``visible[j]`` keys (causal: its position + 1). The same arithmetic whichever rows of the sequence
    ``q`` holds, so a CP rank's share of the queries gets the single-rank result's values."""
    n = q.shape[0]
    att = torch.einsum("qhd,khd->hqk", pad_rows(q), ks) / math.sqrt(q.shape[-1])
    hidden = torch.arange(ks.shape[0], device=q.device)[None, :] >= pad_rows(visible)[:, None]
    hidden[:, 0] &= torch.arange(hidden.shape[0], device=q.device) < n  # a padding row sees one key: no NaN
    att = att.masked_fill(hidden[None], float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", att, vs)[:n]


def attention(args: ModelArgs, w: dict, p: str, x: torch.Tensor, batch: Batch, cache, layer: int) -> torch.Tensor:
    """Causal attention of every sequence over its own keys (and its cached prefix).

    ``cache``: None, or :attr:`DPEPModel.cache` (``seq_id ->`` a sequence's state) whose entries'
    ``kv[layer]`` this reads and extends.
    """
    pos = batch.positions.to(x.device)
    q, k, v = (project(args, w, p, x, pos, n) for n in ("wq", "wk", "wv"))
    out = torch.empty_like(q)
    cu = batch.cu_seqlens.tolist()
    for s, sid in enumerate(batch.seq_ids):
        lo, hi = cu[s], cu[s + 1]
        ks, vs = k[lo:hi], v[lo:hi]
        if cache is not None and sid is not None:
            entry = cache[sid].kv
            if entry[layer] is not None:
                ks, vs = torch.cat((entry[layer][0], ks)), torch.cat((entry[layer][1], vs))
            entry[layer] = (ks, vs)
        out[lo:hi] = attend(q[lo:hi], ks, vs, pos[lo:hi] + 1)
    return linear(out.reshape(x.shape[0], args.n_heads * args.head_dim), w[p + "wo"])


def route(args: ModelArgs, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, idx=None):
    """DeepSeek-V3's gate: ``(topk_idx [T, K] int64 logical ids, topk_weights [T, K] float32)``.

    ``idx`` given: those experts instead of the gate's choice (the weights still come from the scores).
    """
    t_num, e, groups = x.shape[0], args.n_routed_experts, args.n_expert_groups
    scores = linear(x, gate)
    scores = scores.sigmoid() if args.score_func == "sigmoid" else scores.softmax(-1)
    if idx is not None:
        return _route_weights(args, scores, idx.to(x.device))
    biased = scores + bias
    if groups > 1:
        per_group = biased.view(t_num, groups, e // groups)
        group_score = per_group.topk(2, dim=-1).values.sum(-1)
        keep = group_score.topk(args.n_limited_groups, dim=-1).indices
        drop = torch.ones(t_num, groups, dtype=torch.bool, device=x.device).scatter_(1, keep, False)
        biased = per_group.masked_fill(drop[..., None], float("-inf")).view(t_num, e)
    return _route_weights(args, scores, biased.topk(args.n_activated_experts, dim=-1).indices)


def _route_weights(args: ModelArgs, scores: torch.Tensor, idx: torch.Tensor):
    weights = scores.gather(1, idx)
    if args.score_func == "sigmoid":
        weights = weights / weights.sum(-1, keepdim=True)
    return idx, (weights * args.route_scale).float()


def logits(args: ModelArgs, w: dict, x: torch.Tensor, batch: Batch) -> torch.Tensor:
    last = batch.cu_seqlens[1:].to(x.device) - 1
    return linear(rms_norm(x[last], w["norm"], args.norm_eps), w["head"])


def check_batch(args: ModelArgs, batch: Batch) -> None:
    if not isinstance(batch, Batch):
        raise ValueError(f"batch must be an epkit.model.Batch, got {type(batch).__name__}")
    t_num = batch.num_tokens
    if (
        batch.positions.shape != (t_num,)
        or batch.cu_seqlens.dim() != 1
        or len(batch.seq_ids) + 1 != len(batch.cu_seqlens)
    ):
        raise ValueError("batch: positions [T], cu_seqlens [S+1] and S seq_ids must agree")
    if int(batch.cu_seqlens[0]) != 0 or int(batch.cu_seqlens[-1]) != t_num:
        raise ValueError(f"batch: cu_seqlens must run from 0 to {t_num}")
    if t_num and not 0 <= int(batch.token_ids.min()) <= int(batch.token_ids.max()) < args.vocab_size:
        raise ValueError(f"batch: token ids must be in [0, {args.vocab_size})")
    named = [sid for sid in batch.seq_ids if sid is not None]
    if len(set(named)) != len(named):
        raise ValueError(f"batch: a sequence appears twice in seq_ids {batch.seq_ids}")
