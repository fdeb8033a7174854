"""The two-level (per-host) combine order and the rows of a hierarchy's rail messages.

Across hosts, every transport sums a token's expert outputs in the order a hierarchical exchange can
keep (:mod:`epkit.collectives.ep_reference`): the rows from one host's ranks first, in float32 in
ascending rank order, cast to the output dtype (the host partial), then the host partials in host
order in float32, plus the biases, cast. :func:`sum_by_host` is that sum for rows gathered per rank
(the flat transports); the hierarchical buffer (``ep/normal_hier.py``) forms the host partials on the
forwarding rank and the last sum at the source. With one host it is the one-level order exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from epkit.collectives.ep.rows import align_up, by_address, copy_rows_by_address, sum_by_source, sum_indexed_rows

__all__ = [
    "HIERARCHICAL",
    "PARTS",
    "field_offsets",
    "gather_split_rows",
    "last_sum_layout",
    "rail_order",
    "sum_by_host",
    "token_order",
]

#: The transport name an EPBuffer takes for ranks on several hosts (``EPBuffer.transport`` then names the
#: parts: ``"hierarchical(shm+torch)"``, ``"hierarchical(nvshmem+nvshmem)"``).
HIERARCHICAL = "hierarchical"
#: The buffers of a hierarchy, by where its rows live: ``(flat, intra, rail)`` transports. CPU ranks: shared
#: memory inside a host, torch between hosts and for the flat buffer (the agreements and the low-latency mode);
#: CUDA ranks: nvshmem for all three (peer views inside an NVLink domain, puts with signal between domains).
PARTS = {"cpu": ("torch", "shm", "torch"), "cuda": ("nvshmem", "nvshmem", "nvshmem")}


def sum_by_host(
    out: torch.Tensor,
    sources: list[torch.Tensor],
    send_tokens: list[torch.Tensor],
    biases: Sequence[torch.Tensor],
    hosts: list[list[int]] | None,
    empty: Callable[[torch.Tensor], torch.Tensor] = torch.empty_like,
    portable: bool = False,
) -> torch.Tensor:
    """Combine's source side in the two-level order: :func:`~epkit.collectives.ep.rows.sum_by_source`
    (same arguments) when ``hosts`` is None or one host, else, per host, the one-level sum over its ranks cast to
    ``out.dtype`` (the host partial), then the partials of the hosts each token went to, in host order, in
    float32, plus the biases, cast. ``out [T, H]`` is written and returned.

    ``sources[r] [len(send_tokens[r]), H]``: what rank r sent back for the tokens this rank sent it
    (``send_tokens[r]``, int64); ``hosts``: ``EPBuffer.hosts`` (lists of ranks, ascending); ``empty(out)``
    makes each host partial's tensor (like ``out``; an EPBuffer passes its pool's); ``portable``: as
    :func:`~epkit.collectives.ep.rows.sum_indexed_rows`'s.
    """
    if hosts is None or len(hosts) <= 1:
        return sum_by_source(out, sources, send_tokens, biases, portable)
    t_num, n = out.shape[0], len(hosts)
    partials, hit = [], torch.zeros((t_num, n), dtype=torch.bool)
    for h, ranks in enumerate(hosts):
        mine = [sources[r] for r in ranks], [send_tokens[r] for r in ranks]
        partials.append(sum_by_source(empty(out), *mine, portable=portable))
        for r in ranks:
            hit[send_tokens[r], h] = True
    src = torch.where(hit, torch.arange(n, dtype=torch.int64), -1)
    row = torch.arange(t_num, dtype=torch.int64).unsqueeze(1).expand(t_num, n)
    return sum_indexed_rows(out, partials, src, row, None, biases, portable=portable)


def last_sum_layout(
    in_host: torch.Tensor,
    host: int,
    per_host: int,
    own: tuple[torch.Tensor, torch.Tensor] | None,
    host_tokens: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The terms of a hierarchical combine's last sum at the source, for ``sum_indexed_rows`` with groups: per token,
    in host order, one term per other host (its partial, as received: source ``k`` for the k-th other host, row =
    the token's place in the message sent there) and a group of ``per_host`` terms for this host (the rows its
    ranks sent back, sources after the other hosts', summed and cast as that host's partial would be).

    ``in_host [T, N]`` bool: which hosts each token went to; ``own``: ``(src_of, row_of)`` ``[rows, per_host]`` of
    this host's rail rows (its own tokens that stay here, in token order; src -1: that rank got none), or None when
    none stay; ``host_tokens[h]``: the tokens sent to host h, in their message's order. Returns ``(src_of, row_of,
    groups)``: ``[T, N - 1 + per_host]`` int64 each, and the group sizes.
    """
    t_num, n = in_host.shape
    src_cols, row_cols = [], []
    for h in range(n):
        if h != host:
            k = h - (h > host)  # its place among the other hosts
            rr = torch.zeros(t_num, dtype=torch.int64)
            rr[host_tokens[h]] = torch.arange(host_tokens[h].numel())
            src_cols.append(torch.where(in_host[:, h], k, -1).unsqueeze(1))
            row_cols.append(rr.unsqueeze(1))
        elif own is not None:
            rr = (in_host[:, h].long().cumsum(0) - 1).clamp(min=0)
            src_of, row_of = own[0][rr], own[1][rr]
            src_cols.append(torch.where(in_host[:, h : h + 1] & (src_of >= 0), src_of + n - 1, -1))
            row_cols.append(row_of)
        else:
            src_cols.append(torch.full((t_num, per_host), -1, dtype=torch.int64))
            row_cols.append(torch.zeros((t_num, per_host), dtype=torch.int64))
    groups = [per_host if h == host else 1 for h in range(n)]
    return torch.cat(src_cols, 1), torch.cat(row_cols, 1), groups


def field_offsets(n: int | list[int], widths: list[int]) -> tuple[list[int], int]:
    """Byte offsets of the field blocks of an ``n``-row message (``widths``: bytes per row of each field, each
    block aligned to ``FIELD_ALIGN``) and the message's size; ``n`` a list: each field's rows."""
    offs, at = [], 0
    for f, wd in enumerate(widths):
        offs.append(at)
        at = align_up(at + (n[f] if isinstance(n, list) else n) * wd)
    return offs, at


def rail_order(to_host: torch.Tensor, to_peer: torch.Tensor, split: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens of a dispatch's rail message to another host, in the message's order, and its order mask.

    ``to_host``, ``to_peer`` ``[T]`` bool: the tokens for that host, and for the rail peer itself (a subset). With
    ``split``, the peer's own tokens first (their x rows are received straight into its result, where they are
    contiguous), then the host's others, each ascending, and the mask: ``[ceil(n / 8)]`` uint8, bit j (little
    endian within a byte) set when the message's j-th token in token order is one of the first part, so that the
    peer can forward every row in token order (:func:`token_order`). Without: ascending, None.
    """
    tokens = to_host.nonzero().flatten()
    if not split:
        return tokens, None
    bits = to_peer[tokens]
    padded = torch.zeros(-(-bits.numel() // 8) * 8, dtype=torch.uint8)
    padded[: bits.numel()] = bits.to(torch.uint8)
    mask = (padded.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8)
    return torch.cat([tokens[bits], tokens[~bits]]), mask


def token_order(mask: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` int64: the message row of each of an ``n``-row rail message's tokens, in token order (the inverse of
    :func:`rail_order`'s reordering, from its mask)."""
    bits = ((mask.view(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[:n].bool()
    first = bits.long().cumsum(0) - 1
    return torch.where(bits, first, int(bits.sum()) + (~bits).long().cumsum(0) - 1)


def gather_split_rows(
    head: torch.Tensor, rest: torch.Tensor, sel: torch.Tensor, out: torch.Tensor, portable: bool = False
) -> None:
    """``out[i] =`` row ``sel[i]`` of a message field whose first ``len(head)`` rows are ``head`` and whose others
    are ``rest`` (``[rows, width]`` uint8 each, rows contiguous; ``sel`` int64 in any order)."""
    k, wd = head.shape[0], out.shape[1]
    if not sel.numel():
        return
    if by_address(head, rest, out, portable=portable):
        addr = torch.where(sel < k, head.data_ptr() + sel * wd, rest.data_ptr() + (sel - k) * wd)
        dst = out.data_ptr() + torch.arange(sel.numel(), dtype=torch.int64) * wd
        copy_rows_by_address(dst, addr, wd, [head.data_ptr(), rest.data_ptr(), out.data_ptr(), wd])
        return
    in_head = sel < k
    out[in_head] = head[sel[in_head]]
    out[~in_head] = rest[sel[~in_head] - k]
