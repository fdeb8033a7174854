"""The n-gram token ids of ``epkit.engram.hash_tokens`` (column ``k`` = the compressed token at ``t - k`` in its
sequence, else the pad id) and the checks of its arguments: static ones (types, shapes) for the public
function, value ones (boundaries, id ranges; read on the host) for the op that builds the ids.
"""

from __future__ import annotations

import torch

__all__ = ["check_cu_seqlens_static", "check_cu_seqlens", "check_compression", "check_prefix", "ngram_token_ids"]


def check_cu_seqlens_static(cu_seqlens) -> None:
    """``cu_seqlens`` is a 1-D int32/int64 tensor with at least one entry."""
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.numel() < 1
        or cu_seqlens.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [B+1], got {cu_seqlens!r}")


def check_cu_seqlens(cu_seqlens, num_tokens: int, device) -> torch.Tensor:
    """``cu_seqlens`` as int64 on ``device`` once it is a valid ``[B+1]`` boundary list of ``num_tokens`` tokens
    (reads it on the host)."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != num_tokens or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seqlens = {cu_seqlens.tolist()[:16]}... must start at 0, never decrease and end at T = {num_tokens}"
        )
    return cu


def check_compression(lookup_table, vocab_size: int, pad_id: int) -> int:
    """The raw vocabulary size, after the static checks of ``lookup_table`` (None: ids are used as they are)."""
    if lookup_table is None:
        if pad_id >= vocab_size:
            raise ValueError(f"pad_id = {pad_id} is outside [0, vocab_size = {vocab_size})")
        return vocab_size
    if not isinstance(lookup_table, torch.Tensor) or lookup_table.dim() != 1 or lookup_table.dtype != torch.int32:
        raise ValueError(f"lookup_table must be a 1-D int32 tensor, got {getattr(lookup_table, 'dtype', None)}")
    raw_vocab = lookup_table.numel()
    if raw_vocab < vocab_size or raw_vocab <= pad_id:
        raise ValueError(
            f"lookup_table has length {raw_vocab}; expected the raw vocabulary size, at least vocab_size = "
            f"{vocab_size} and above pad_id = {pad_id}"
        )
    return raw_vocab


def check_prefix(prefix_tokens, n: int) -> None:
    """Static checks of ``prefix_tokens``: None, or at most ``n - 1`` int32 ids."""
    if prefix_tokens is None:
        return
    if not isinstance(prefix_tokens, torch.Tensor) or prefix_tokens.dim() != 1 or prefix_tokens.dtype != torch.int32:
        raise ValueError(f"prefix_tokens must be a 1-D int32 tensor, got {getattr(prefix_tokens, 'dtype', None)}")
    if prefix_tokens.numel() > n - 1:
        raise ValueError(f"prefix_tokens has {prefix_tokens.numel()} tokens; at most max_ngram_size - 1 = {n - 1}")


def ngram_token_ids(token_ids, cu, n, pad, lookup_table, prefix_tokens) -> torch.Tensor:
    """``[T, N]`` int32: column k = compressed token at t-k in t's sequence, else the pad id."""
    device, num_tokens = token_ids.device, token_ids.numel()
    ids = token_ids.long()
    if lookup_table is not None:
        ids = lookup_table.long()[ids]
    head = torch.full((n - 1,), pad, dtype=torch.int64, device=device)
    if prefix_tokens is not None and prefix_tokens.numel():
        pre = prefix_tokens.long()
        if lookup_table is not None:
            pre = lookup_table.long()[pre]
        head[n - 1 - pre.numel() :] = pre
    ext = torch.cat([head, ids])  # ext[t + n - 1] = token t
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    if prefix_tokens is not None:
        starts = torch.where(starts == 0, torch.full_like(starts, -(n - 1)), starts)
    t = torch.arange(num_tokens, device=device)
    k = torch.arange(n, device=device)
    src = t[:, None] - k[None, :]
    vals = ext[src + (n - 1)] if num_tokens else torch.empty((0, n), dtype=torch.int64, device=device)
    vals = torch.where(src >= starts[:, None], vals, torch.full_like(vals, pad))
    return vals.to(torch.int32).contiguous()
