"""DeepEP's handles for ``epkit.compat.deep_ep``: the tuples DeepEP's calls return, each element with DeepEP's
meaning on epkit's layout, carrying the EPBuffer state a later call needs (and checks: which buffer, which
dispatch).

Normal mode, ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
is_token_in_rank, send_head)``, int32 unless said (``W`` ranks, ``T`` this rank's tokens, ``R`` rows received):

- ``rank_prefix_matrix [W, W]``: ``[i][j]`` = rows rank ``j`` receives from ranks ``0..i`` (so rank ``j``'s rows
  from source ``i`` end at ``[i][j]`` in its ``recv_x``: rows come ordered by source rank, then token);
- the channel split: a rank's tokens are cut into ``C = config.num_sms // 2`` channels of ``ceil(T / C)``
  consecutive tokens (the last ones shorter or empty), as DeepEP's kernels cut them; epkit moves them in one
  piece, so the channels only describe where rows are. ``channel_prefix_matrix [W, C]``: ``[r][c]`` = this
  rank's tokens sent to rank ``r`` from channels ``0..c``; ``recv_channel_prefix_matrix [W, C]``: ``[s][c]`` =
  the row of ``recv_x`` where source ``s``'s channel ``c`` starts;
- ``recv_src_idx [R]``: each received row's token index on its source rank;
- ``is_token_in_rank [T, W]`` bool: the dispatch's;
- ``send_head [T, W]``: the row of rank ``r``'s ``recv_x`` that token ``t`` became, -1 where it was not sent
  (DeepEP's is a slot of a channel's ring buffer; epkit has no ring).

V2's ``EPHandle`` (``ElasticBuffer.dispatch``) is an object with V2's attributes (its docstring).

Low-latency mode, ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``:
``src_info [L, N * W]`` int32, each received slot's token index on its source (slots past the expert's count:
unspecified); ``layout_range [L, W]`` int64, ``(begin << 32) | count`` of the slots expert ``e`` holds from source
``s`` (epkit's slots, like DeepEP's, come ordered by source rank, then token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from epkit.collectives.ep.handles import DispatchHandle
    from epkit.collectives.ep.ll_layout import LowLatencyHandle as EPLowLatencyHandle
    from epkit.collectives.ep_buffer import EPBuffer

__all__ = [
    "EPHandle",
    "LowLatencyHandle",
    "NormalHandle",
    "channel_bounds",
    "in_rank_of",
    "low_latency_handle",
    "normal_handle",
    "per_channel",
    "sent_rows",
]


class NormalHandle(tuple):  # type: ignore[type-arg]  # DeepEP's six (ten) tensors; attributes below
    """DeepEP's normal-mode handle (the six tensors of the module docstring; internode, the ten of
    ``deep_ep_internode``), with the EPBuffer that dispatched, its handle, the rows received and the top-k (``None``
    for a dispatch without top-k)."""

    buffer: EPBuffer
    handle: DispatchHandle
    num_recv: int
    num_topk: int | None

    def __new__(
        cls, tensors: tuple[torch.Tensor, ...], buffer: EPBuffer, handle: DispatchHandle, num_topk: int | None
    ) -> NormalHandle:
        self = super().__new__(cls, tensors)
        self.buffer, self.handle, self.num_topk = buffer, handle, num_topk
        self.num_recv = int(tensors[3].numel() if len(tensors) == 6 else tensors[7].shape[0])  # recv_src_idx / _meta
        return self

    def __reduce__(self) -> Any:
        raise TypeError("a deep_ep handle holds its buffer's state: it cannot be pickled or copied to another process")


class LowLatencyHandle(tuple):  # type: ignore[type-arg]  # DeepEP's five values; attributes below
    """DeepEP's low-latency handle ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts)``, with the EPBuffer that dispatched, its handle, and the zero-copy combine tensor once asked
    for (``staging``)."""

    buffer: EPBuffer
    handle: EPLowLatencyHandle
    staging: dict[str, torch.Tensor]

    def __new__(
        cls, values: tuple[torch.Tensor, torch.Tensor, int, int, int], buffer: EPBuffer, handle: EPLowLatencyHandle
    ) -> LowLatencyHandle:
        self = super().__new__(cls, values)
        self.buffer, self.handle, self.staging = buffer, handle, {}
        return self

    num_max_dispatch_tokens_per_rank = property(lambda self: self[2])
    hidden = property(lambda self: self[3])
    num_experts = property(lambda self: self[4])

    def __reduce__(self) -> Any:
        raise TypeError("a deep_ep handle holds its buffer's state: it cannot be pickled or copied to another process")


class EPHandle:
    """V2's dispatch handle: reuse it for a cached dispatch, give it to ``combine``. Attributes (V2's), with ``R``
    rows received, ``X`` expanded rows, ``L`` local experts, ``K`` top-k, ``N`` = ``num_max_tokens_per_rank``:

    - ``psum_num_recv_tokens_per_scaleup_rank [W]`` int32: inclusive prefix of the rows received from each rank (a
      token once per rank); ``[-1]`` is R;
    - ``psum_num_recv_tokens_per_expert [L]`` int32: inclusive prefix of the aligned per-expert counts; with
      ``do_expand``, expert i's aligned start plus its unaligned count (DeepGEMM's psum layout);
    - ``num_recv_tokens_per_expert_list``: the aligned counts (empty without ``do_cpu_sync``);
    - ``num_unaligned_recv_tokens_per_expert [L]`` int32;
    - ``recv_src_metadata [R, K + 2]`` int32: the source token's global index ``src_rank * N + token``; the source
      rank times K plus the first top-k slot naming an expert of this rank; with ``do_expand`` the expanded row of
      each top-k slot (-1: not this rank's expert; -1 throughout without ``do_expand``);
    - ``dst_buffer_slot_idx [T, W]`` int32: the row of rank r's receive that this rank's token t became (-1: not
      sent);
    - ``topk_idx`` (the dispatch's, cloned with ``do_handle_copy``), ``num_recv_tokens``, ``num_expanded_tokens``,
      ``do_expand``, ``num_experts``, ``expert_alignment``, ``num_max_tokens_per_rank``, ``num_sms``;
      ``token_metadata_at_forward`` and ``channel_linked_list`` are None (no hybrid mode).

    It also holds the EPBuffer that dispatched and that buffer's handle (``buffer``, ``handle``): a later call
    checks, on every rank, that all ranks pass handles of the same dispatch of this ElasticBuffer.
    """

    def __init__(
        self,
        do_expand: bool,
        num_experts: int,
        expert_alignment: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        topk_idx: torch.Tensor,
        num_recv_tokens: int,
        num_expanded_tokens: int,
        num_recv_tokens_per_expert_list: list[int],
        psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
        psum_num_recv_tokens_per_expert: torch.Tensor,
        num_unaligned_recv_tokens_per_expert: torch.Tensor,
        recv_src_metadata: torch.Tensor,
        dst_buffer_slot_idx: torch.Tensor,
        token_metadata_at_forward: torch.Tensor | None,
        channel_linked_list: torch.Tensor | None,
    ) -> None:
        self.do_expand, self.num_experts, self.expert_alignment = do_expand, num_experts, expert_alignment
        self.num_max_tokens_per_rank, self.num_sms, self.topk_idx = num_max_tokens_per_rank, num_sms, topk_idx
        self.num_recv_tokens, self.num_expanded_tokens = num_recv_tokens, num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata, self.dst_buffer_slot_idx = recv_src_metadata, dst_buffer_slot_idx
        self.token_metadata_at_forward, self.channel_linked_list = token_metadata_at_forward, channel_linked_list
        # epkit's: the EPBuffer that dispatched and its handle (set by ElasticBuffer.dispatch)
        self.buffer: EPBuffer | None = None
        self.handle: DispatchHandle | None = None
        self.send_tokens: list[torch.Tensor] = []  # per rank, this rank's tokens sent there (ascending)
        self.worst_case = False  # the dispatch gave worst-case shapes (do_cpu_sync=False): its cached ones do too


def in_rank_of(topk_idx: torch.Tensor, num_experts: int, w: int) -> torch.Tensor:
    """``is_token_in_rank [T, W]`` bool of ``topk_idx`` by tensor ops (no host read); ids outside
    ``[0, num_experts)`` go nowhere."""
    ids = topk_idx.long()
    owner = torch.where((ids >= 0) & (ids < num_experts), ids // (num_experts // w), -1)
    return (owner.unsqueeze(-1) == torch.arange(w, device=ids.device)).any(1)


def channel_bounds(num_tokens: int, num_channels: int) -> torch.Tensor:
    """``[C + 1]`` int64: channel ``c`` holds tokens ``[b[c], b[c + 1])`` (``ceil(T / C)`` each, clipped to ``T``)."""
    per = -(-num_tokens // num_channels)
    return (torch.arange(num_channels + 1) * per).clamp(max=num_tokens)


def per_channel(in_rank: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``[W, C]`` int64 tokens of each channel that go to each rank (``in_rank [T, W]`` bool)."""
    before = torch.nn.functional.pad(in_rank.long().cumsum(0), (0, 0, 1, 0))  # [T + 1, W]: tokens before t
    return (before[bounds[1:]] - before[bounds[:-1]]).T


def sent_rows(routes: torch.Tensor, rank_prefix: torch.Tensor, s: int) -> torch.Tensor:
    """``[T_s, W]`` int64: the row of rank ``r``'s ``recv_x`` that source ``s``'s token ``t`` became, -1 where it
    was not sent (``routes [T_s, W]`` bool: ``s``'s ``is_token_in_rank``; ``rank_prefix [W, W]``: rows rank ``j``
    receives from ranks ``0..i``; rows come ordered by source rank, then token)."""
    first = rank_prefix[s] - routes.long().sum(0)  # where s's rows start in each destination's recv_x
    return torch.where(routes, first.view(1, -1) + routes.long().cumsum(0) - 1, -1)


def normal_handle(
    in_rank_all: torch.Tensor,
    tokens: list[int] | torch.Tensor,
    me: int,
    num_channels: int,
    in_rank: torch.Tensor,
    num_rows: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """DeepEP's six handle tensors (module docstring) from every rank's routing: ``in_rank_all [W, T_max, W]``
    bool (rank ``s``'s ``is_token_in_rank`` in its first ``tokens[s]`` rows, False past them), this rank ``me``'s
    ``is_token_in_rank`` as the caller passed it (returned as it is), on its device.

    By tensor ops on ``in_rank_all``'s device. ``num_rows``: the rows of a worst-case dispatch's ``recv_x``
    (``num_worst_tokens``): ``recv_src_idx`` has that many entries, -1 past the rows received (DeepEP leaves them
    unspecified), and nothing is read back to the host; None: exactly the rows received (one count read)."""
    w, t_max = in_rank_all.shape[:2]
    dev = in_rank_all.device
    tok = torch.as_tensor(tokens, device=dev).long()  # [W]
    hits = (in_rank_all & (torch.arange(t_max, device=dev) < tok.view(-1, 1)).unsqueeze(-1)).long()
    counts = hits.sum(1)  # [W src, W dst]
    rank_prefix = counts.cumsum(0)
    start = rank_prefix[:, me] - counts[:, me]  # first row of each source's block in my recv_x
    # the channels (channel_bounds for every source at once): [W, C + 1] token bounds, [W src, C, W dst] tokens
    per = (tok + num_channels - 1) // num_channels
    bounds = torch.minimum(torch.arange(num_channels + 1, device=dev) * per.view(-1, 1), tok.view(-1, 1))
    before = torch.nn.functional.pad(hits.cumsum(1), (0, 0, 1, 0))  # [W, T_max + 1, W]: tokens before t
    edges = before.gather(1, bounds.unsqueeze(-1).expand(w, num_channels + 1, w))
    chan = edges[:, 1:] - edges[:, :-1]
    channel_prefix = chan[me].T.cumsum(1)  # [W dst, C]
    from_each = chan[:, :, me]  # [W src, C]: what each source's channels send me
    recv_channel = start.view(-1, 1) + from_each.cumsum(1) - from_each
    # each row I receive: its source token, placed at its row (rows past num_rows, and misses, to one spare entry)
    to_me = hits[:, :, me]
    n = int(counts[:, me].sum()) if num_rows is None else num_rows
    at = start.view(-1, 1) + to_me.cumsum(1) - 1
    at = torch.where((to_me > 0) & (at < n), at, n)
    recv_src = torch.full((n + 1,), -1, dtype=torch.long, device=dev)
    recv_src.scatter_(0, at.reshape(-1), torch.arange(t_max, device=dev).expand(w, t_max).reshape(-1))
    send_head = sent_rows(in_rank_all[me, : in_rank.shape[0]], rank_prefix, me)
    dev = in_rank.device
    i32 = torch.int32
    return (
        rank_prefix.to(dev, i32),
        channel_prefix.to(dev, i32),
        recv_channel.to(dev, i32),
        recv_src[:n].to(dev, i32),
        in_rank,
        send_head.to(dev, i32),
    )


def low_latency_handle(
    topk_all: torch.Tensor, me: int, num_local: int, n_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src_info [L, N * W] int32, layout_range [L, W] int64)`` (module docstring) from every rank's ``topk_idx``
    (``topk_all [W, N, K]``, rows past a rank's tokens -1), on ``topk_all``'s device, by tensor ops only (no host
    read: the low-latency calls stay stream-ordered on CUDA)."""
    w, n, _ = topk_all.shape
    ids = topk_all.long()
    experts = me * num_local + torch.arange(num_local, device=ids.device)
    hit = (ids.unsqueeze(-1) == experts).any(2)  # [W src, N tokens, L]: token t of src goes to my expert e
    count = hit.sum(1)  # [W, L]
    begin = count.cumsum(0) - count  # slots of sources before s
    layout_range = ((begin << 32) | count).T.contiguous()  # [L, W]
    # slot of (src, token) in expert e: begin[s, e] + tokens of s before t that hit e
    slot = begin.unsqueeze(1) + hit.long().cumsum(1) - 1  # [W, N, L]
    token = torch.arange(n, dtype=torch.int32, device=ids.device).view(1, n, 1).expand(w, n, num_local)
    cols = n_max * w
    at = torch.arange(num_local, device=ids.device).view(1, 1, num_local) * cols + slot
    at = torch.where(hit, at, num_local * cols)  # pairs that miss go to one spare word (a scatter, no host read)
    src_info = torch.zeros(num_local * cols + 1, dtype=torch.int32, device=ids.device)
    src_info.scatter_(0, at.reshape(-1), token.reshape(-1))
    return src_info[:-1].view(num_local, cols), layout_range
