"""``EngramLayer``: the gated Engram layer (hashed n-gram embedding lookup and fusion) of DeepSeek's Engram demo.

The hashing it relies on (``EngramConfig``, ``hash_params``, ``hash_tokens``, the ``engram_hash`` op)
lives in :mod:`epkit.engram`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from epkit._details.engram_params import check_ids, hash_params_np
from epkit.engram import EngramConfig

__all__ = ["EngramLayer"]


class EngramLayer(nn.Module):
    """One Engram layer: multi-head n-gram embedding lookup and the demo's gated fusion (one branch).

    With ``e [T, (N-1)*n_embed]`` the concatenated head rows of each token and ``h [T, D]``
    the hidden states::

        key   = RMSNorm_k(W_k e + b_k)            query = RMSNorm_q(h)
        s     = <key, query> / sqrt(D)
        gate  = sigmoid(sign(s) * sqrt(max(|s|, 1e-6)))
        value = gate * (W_v e + b_v)
        out   = value + SiLU(CausalDepthwiseConv1d(RMSNorm_c(value)))   (kernel 4, dilation N)

    The causal convolution runs within each sequence of a packed batch (``cu_seqlens``).
    The caller adds ``out`` to the residual stream. RMSNorm epsilons follow the demo:
    ``torch.finfo(dtype).eps`` for key/query, ``conv_norm_eps`` for the convolution.

    Parameters
    ----------
    config : EngramConfig
    layer_id : int
        One of ``config.layer_ids``; selects the layer's hash tables.
    hidden_size : int
        ``D``.
    kernel_size : int
        Convolution taps. Default 4.
    conv_norm_eps : float
        Default 1e-5.
    with_table : bool
        Allocate the full embedding table (``embedding``, ``[rows, head_dim]``). Pass False when
        rows come from elsewhere (a sharded table) as ``embeddings`` to :meth:`forward`.
    """

    def __init__(
        self,
        config: EngramConfig,
        layer_id: int,
        hidden_size: int,
        kernel_size: int = 4,
        conv_norm_eps: float = 1e-5,
        with_table: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if layer_id not in config.layer_ids:
            raise ValueError(f"layer_id = {layer_id} is not one of config.layer_ids = {config.layer_ids}")
        if hidden_size < 1 or kernel_size < 1:
            raise ValueError(f"hidden_size = {hidden_size} and kernel_size = {kernel_size} must be >= 1")
        kw = {"device": device, "dtype": dtype}
        self.config, self.layer_id, self.hidden_size = config, layer_id, hidden_size
        self.kernel_size, self.dilation, self.conv_norm_eps = kernel_size, config.max_ngram_size, conv_norm_eps
        li = config.layer_ids.index(layer_id)
        _, vocab, off = hash_params_np(config)
        self.num_rows = int(off[li, -1]) + int(vocab[li].reshape(-1)[-1])
        self.embedding = nn.Embedding(self.num_rows, config.head_dim, **kw) if with_table else None
        width = config.num_heads * config.head_dim
        self.key_proj = nn.Linear(width, hidden_size, **kw)
        self.value_proj = nn.Linear(width, hidden_size, **kw)
        self.key_norm = nn.RMSNorm(hidden_size, **kw)
        self.query_norm = nn.RMSNorm(hidden_size, **kw)
        self.conv_norm = nn.RMSNorm(hidden_size, eps=conv_norm_eps, **kw)
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=False, **kw)

    def lookup(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the full table: ``hash_ids [T, H] int32`` -> ``[T, H, head_dim]``."""
        if self.embedding is None:
            raise ValueError("this EngramLayer has no table (with_table=False); pass embeddings to forward")
        if hash_ids.dim() != 2 or hash_ids.shape[1] != self.config.num_heads:
            raise ValueError(f"hash_ids must be [T, {self.config.num_heads}], got {tuple(hash_ids.shape)}")
        check_ids("hash_ids", hash_ids, self.num_rows, "the layer's table rows")
        return self.embedding(hash_ids.long())

    def _causal_conv(self, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        num_tokens = v.shape[0]
        t = torch.arange(num_tokens, device=v.device)
        if cu_seqlens is None:
            starts = torch.zeros_like(t)
        else:
            # checked and expanded where cu_seqlens lives: a CPU cu_seqlens costs a GPU caller no sync
            cu = cu_seqlens.to(torch.int64)
            if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != num_tokens or bool((cu[1:] < cu[:-1]).any()):
                raise ValueError(f"cu_seqlens = {cu_seqlens.tolist()[:16]} must go from 0 to T = {num_tokens}")
            starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=num_tokens).to(v.device)
        w = self.conv.weight[:, 0, :]  # [D, kernel]
        y = torch.zeros_like(v)
        for i in range(self.kernel_size):
            shift = (self.kernel_size - 1 - i) * self.dilation
            src = t - shift
            ok = (src >= starts)[:, None]
            y = y + torch.where(ok, v[src.clamp(min=0)], torch.zeros_like(v)) * w[:, i]
        return y

    def forward(
        self,
        hidden_states: torch.Tensor,
        hash_ids: torch.Tensor | None = None,
        *,
        embeddings: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Engram output for packed hidden states.

        Parameters
        ----------
        hidden_states : Tensor [T, D]
        hash_ids : Tensor [T, (N-1)*K], int32, optional
            This layer's rows (``hash_tokens(...)[layer index]``); looked up in ``embedding``.
        embeddings : Tensor [T, (N-1)*K, head_dim], optional
            Rows fetched elsewhere (e.g. a sharded table); exactly one of ``hash_ids`` / ``embeddings``.
        cu_seqlens : Tensor [B+1], optional
            Sequence boundaries for the causal convolution; default: one sequence.

        Returns
        -------
        Tensor [T, D]
        """
        if (hash_ids is None) == (embeddings is None):
            raise ValueError("pass exactly one of hash_ids and embeddings")
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [T, {self.hidden_size}], got {tuple(hidden_states.shape)}")
        num_tokens = hidden_states.shape[0]
        if embeddings is None:
            embeddings = self.lookup(hash_ids)
        want = (num_tokens, self.config.num_heads, self.config.head_dim)
        if tuple(embeddings.shape) != want:
            raise ValueError(f"embeddings must be {want}, got {tuple(embeddings.shape)}")
        e = embeddings.reshape(num_tokens, -1).to(hidden_states.dtype)
        key = self.key_norm(self.key_proj(e))
        query = self.query_norm(hidden_states)
        s = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden_size)
        gate = torch.sigmoid(s.sign() * s.abs().clamp_min(1e-6).sqrt())
        value = gate * self.value_proj(e)
        conv = F.silu(self._causal_conv(self.conv_norm(value), cu_seqlens))
        return value + conv
