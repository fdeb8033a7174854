"""DeepEP's internode mode for ``epkit.compat.deep_ep``: what a legacy ``Buffer`` over more than one NVLink domain
says about its RDMA ranks, and its ten-tensor handle, on epkit's layout.

DeepEP fixes its domain at ``NUM_MAX_NVL_PEERS = 8`` ranks: a group of ``W > 8`` ranks is ``D = W / 8`` RDMA
ranks of 8 consecutive ranks each (rank ``r`` is local rank ``r % 8`` of RDMA rank ``r // 8``), and its normal
mode is then the internode one: ``get_dispatch_layout`` counts tokens per RDMA rank, ``dispatch`` takes those
counts, and handles have ten tensors. The interface follows that rule whatever epkit's transport (the rows move on
the path the EPBuffer chose: the hierarchical one where its hosts are several, else a flat one), so an engine's
internode code runs as on DeepEP.

The handle, ``(is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix,
recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head)``, int32 unless said, with this rank
local rank ``l`` of RDMA rank ``h``, ``T`` its tokens, ``R`` rows received, channels as in the intranode handle
(``deep_ep_handles``: ``C = num_sms // 2`` runs of consecutive tokens), "prefix" inclusive:

- ``is_token_in_rank [T, W]`` bool: the dispatch's;
- ``rdma_channel_prefix_matrix [D, C]``: this rank's tokens sent to any rank of RDMA rank ``d``, channels ``0..c``;
- ``gbl_channel_prefix_matrix [W, C]``: this rank's tokens sent to rank ``r``, channels ``0..c``;
- the RDMA receive: the tokens this rank would take over RDMA in DeepEP, those of local rank ``l`` of each RDMA
  rank ``d`` (itself for ``d = h``) bound for any rank of ``h``, ordered by ``d``, then token.
  ``recv_rdma_channel_prefix_matrix [D, C]``: those of ``d``, its channels ``0..c``;
  ``recv_rdma_rank_prefix_sum [D]``: those of RDMA ranks ``0..d``;
- ``recv_gbl_channel_prefix_matrix [W, C]``: the row of ``recv_x`` where source ``s``'s channel ``c`` starts;
- ``recv_gbl_rank_prefix_sum [W]``: the rows received from ranks ``0..s`` (rows come ordered by source rank,
  then token: source ``s``'s end at ``[s]``);
- ``recv_src_meta [R, 8]`` uint8: per row received, DeepEP's ``SourceMeta``: int32 source RDMA rank, int32 bits
  of the local ranks of ``h`` the token went to (bit ``p``: local rank ``p``), in this machine's byte order;
- ``send_rdma_head [T, D]``: token ``t``'s place among this rank's tokens sent to RDMA rank ``d``, -1 if none;
- ``send_nvl_head [N, 8]``: for the ``N = recv_rdma_rank_prefix_sum[-1]`` tokens of the RDMA receive, the row of
  local rank ``p``'s ``recv_x`` each became, -1 where it did not go there (DeepEP's are slots of ring buffers;
  epkit has none, so the rows themselves).
"""

from __future__ import annotations

import torch

from epkit.compat._details.deep_ep_handles import channel_bounds, normal_handle, per_channel, sent_rows

__all__ = ["NVL_PEERS", "check_internode_call", "internode_handle", "rdma_ranks", "tokens_per_rdma_rank"]

#: DeepEP's ``NUM_MAX_NVL_PEERS``: the ranks of one NVLink domain (an RDMA rank).
NVL_PEERS = 8


def rdma_ranks(group_size: int) -> int:
    """DeepEP's RDMA ranks of a group: 1 for 8 ranks or fewer (the intranode mode), else ``group_size / 8``
    (ValueError where 8 does not divide it: DeepEP's internode mode has whole domains only)."""
    if group_size <= NVL_PEERS:
        return 1
    if group_size % NVL_PEERS:
        raise ValueError(
            f"DeepEP's internode mode needs a multiple of {NVL_PEERS} ranks (whole NVLink domains); the group has "
            f"{group_size}"
        )
    return group_size // NVL_PEERS


def check_internode_call(fn: str, config: object, group_size: int) -> None:
    """DeepEP's asserts of its ``internode_dispatch`` / ``internode_combine`` (ValueError; nothing for the other
    calls): a ``config`` given, and a group of RDMA ranks (more than 8 ranks); and, for every normal-mode call, a
    group of whole domains."""
    domains = rdma_ranks(group_size)
    if not fn.startswith("internode"):
        return
    if config is None:
        raise ValueError(f"{fn}: config must be given (DeepEP asserts it; dispatch and combine pick one)")
    if domains == 1:
        raise ValueError(f"{fn}: the group's {group_size} ranks are one NVLink domain (DeepEP's intranode mode)")


def _by_domain(in_rank: torch.Tensor) -> torch.Tensor:
    """``[T, D]`` bool: token ``t`` goes to some rank of RDMA rank ``d`` (``in_rank [T, W]`` bool)."""
    t, w = in_rank.shape
    peers = min(NVL_PEERS, w)
    return in_rank.view(t, w // peers, peers).any(2)


def tokens_per_rdma_rank(in_rank: torch.Tensor) -> torch.Tensor:
    """``[D]`` int32: this rank's tokens bound for each RDMA rank (any of its ranks), from ``in_rank [T, W]``."""
    return _by_domain(in_rank).sum(0).to(torch.int32)


def internode_handle(
    in_rank_all: torch.Tensor, tokens: list[int], me: int, num_channels: int, in_rank: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """DeepEP's ten internode handle tensors (module docstring) from every rank's routing: ``in_rank_all [W, T_max,
    W]`` bool (rank ``s``'s ``is_token_in_rank`` in its first ``tokens[s]`` rows), this rank ``me``'s
    ``is_token_in_rank`` as the caller passed it (returned as it is), on its device."""
    w = in_rank_all.shape[0]
    d, h, lo = w // NVL_PEERS, me // NVL_PEERS, me % NVL_PEERS
    # the global parts are the intranode handle's: rank_prefix [W, W], channel_prefix, recv_channel_prefix
    rank_prefix, gbl_channel, recv_gbl_channel, *_ = normal_handle(in_rank_all, tokens, me, num_channels, in_rank)
    prefix = rank_prefix.cpu().long()
    mine = [in_rank_all[s, : tokens[s]] for s in range(w)]
    bounds = [channel_bounds(tokens[s], num_channels) for s in range(w)]
    domains = _by_domain(mine[me])
    rdma_channel = per_channel(domains, bounds[me]).cumsum(1)
    # the RDMA receive: local rank lo of each RDMA rank, its tokens bound for my RDMA rank h
    rails = [e * NVL_PEERS + lo for e in range(d)]
    to_me = [_by_domain(mine[s])[:, h] for s in rails]
    recv_rdma_channel = torch.stack([per_channel(t.view(-1, 1), bounds[s])[0] for s, t in zip(rails, to_me)]).cumsum(1)
    recv_rdma_prefix = torch.tensor([int(t.sum()) for t in to_me], dtype=torch.long).cumsum(0)
    local = slice(h * NVL_PEERS, (h + 1) * NVL_PEERS)
    send_nvl = torch.cat([sent_rows(mine[s], prefix, s)[t, local] for s, t in zip(rails, to_me)])
    bits = (1 << torch.arange(NVL_PEERS)).view(1, -1)
    here = [m[m[:, me]] for m in mine]  # source s's tokens I receive, their routing
    meta = torch.cat([torch.stack([torch.full((len(r),), s // NVL_PEERS), (r[:, local].long() * bits).sum(1)], 1)
                      for s, r in enumerate(here)])  # fmt: skip
    send_rdma = torch.where(domains, domains.long().cumsum(0) - 1, -1)
    dev, i32 = in_rank.device, torch.int32
    return (
        in_rank,
        rdma_channel.to(dev, i32),
        gbl_channel,
        recv_rdma_channel.to(dev, i32),
        recv_rdma_prefix.to(dev, i32),
        recv_gbl_channel,
        rank_prefix[:, me].contiguous(),
        meta.to(torch.int32).contiguous().view(torch.uint8).view(-1, 8).to(dev),
        send_rdma.to(dev, i32),
        send_nvl.to(dev, i32),
    )
