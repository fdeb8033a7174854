"""Reference dispatch/combine: the textbook two-step exchange in plain torch over all_to_all_single.

This is the specification EPBuffer is tested against, bit for bit. Step 1
exchanges counts, step 2 the rows (each token once per destination rank, in
token order); combine sends rows back and sums them at the source.

Fixed arithmetic order (EPBuffer reproduces it exactly):
* normal combine: ``out[t] = sum over destination ranks r ascending of y_r[t]`` in float32, then
  biases in order, then cast to ``y.dtype``;
* expanded combine: on the expert rank, ``partial[j] = sum over k ascending of w[j, k] * y[row(j, k)]``
  in float32 (only slots whose expert is local), cast to ``y.dtype`` and sent back; the source
  sums the partials as in normal combine;
* ranks on several hosts (``hosts``: the ranks of each host, as
  :func:`epkit.collectives.transports.host_groups` gives them): the sum is two-level, the order a
  hierarchical exchange sums in (the host's ranks first, then one partial per host crosses hosts). For
  each host H that the token went to, ``host_partial[t] = cast(sum over H's ranks r ascending of
  rows_r[t] in float32)`` to ``y.dtype`` (``rows_r``: ``y_r``, or the expert rank's partial above);
  then ``out[t] = cast(sum over those hosts in list order of host_partial[t] in float32 + biases)``.
  Every transport sums so on a group that spans several hosts (EPBuffer.hosts); one host is the
  one-level order above exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["reference_dispatch", "reference_combine", "reference_layout"]


def reference_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int):
    """(num_tokens_per_rank [W], num_tokens_per_expert [E], is_token_in_rank [T, W] bool); -1 entries skipped."""
    local = num_experts // world_size
    valid = topk_idx >= 0
    rank_of = torch.where(valid, topk_idx // local, torch.full_like(topk_idx, -1))
    in_rank = torch.zeros(topk_idx.shape[0], world_size, dtype=torch.bool)
    for k in range(topk_idx.shape[1]):
        ok = rank_of[:, k] >= 0
        in_rank[ok.nonzero().flatten(), rank_of[ok, k]] = True
    per_rank = in_rank.sum(0).to(torch.int32)
    per_expert = torch.bincount(topk_idx[valid].long(), minlength=num_experts).to(torch.int32)
    return per_rank, per_expert, in_rank


def _a2a(send_rows: list[torch.Tensor], recv_counts: list[int], like: torch.Tensor, group) -> list[torch.Tensor]:
    """all_to_all_single of row blocks; returns one block per source rank."""
    send = torch.cat(send_rows) if send_rows else like.new_empty((0, *like.shape[1:]))
    recv = like.new_empty((sum(recv_counts), *like.shape[1:]))
    dist.all_to_all_single(
        recv,
        send.contiguous(),
        output_split_sizes=recv_counts,
        input_split_sizes=[r.shape[0] for r in send_rows],
        group=group,
    )
    return list(torch.split(recv, recv_counts))


def reference_dispatch(
    x,
    topk_idx,
    topk_weights,
    num_experts: int,
    group=None,
    expand: bool = False,
    expert_alignment: int = 1,
    x_scales: torch.Tensor | None = None,
):
    """The textbook dispatch. Returns a dict with every output EPBuffer.dispatch returns (and the combine state)."""
    w, me = dist.get_world_size(group), dist.get_rank(group)
    local = num_experts // w
    per_rank, _, in_rank = reference_layout(topk_idx, num_experts, w)
    tokens = [in_rank[:, r].nonzero().flatten() for r in range(w)]
    send_counts = torch.tensor([t.numel() for t in tokens], dtype=torch.int64)
    recv_counts = torch.empty(w, dtype=torch.int64)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    rc = recv_counts.tolist()

    def ship(rows_of):
        return torch.cat(_a2a([rows_of(r, t) for r, t in enumerate(tokens)], rc, rows_of(0, tokens[0]), group))

    def local_ids(r, t):
        ids = topk_idx[t].long()
        on_r = (ids >= 0) & (ids // local == r)
        return torch.where(on_r, ids - r * local, torch.full_like(ids, -1))

    xb = x.view(torch.uint8) if x.dtype != torch.uint8 else x
    recv_x = ship(lambda r, t: xb[t]).view(x.dtype).view(-1, *x.shape[1:])
    recv_scales = ship(lambda r, t: x_scales[t]) if x_scales is not None else None
    recv_idx = ship(local_ids)
    recv_w = ship(lambda r, t: topk_weights[t].float())
    out = {
        "recv_x": recv_x,
        "recv_scales": recv_scales,
        "recv_topk_idx": recv_idx.to(topk_idx.dtype),
        "recv_topk_weights": recv_w,
        "tokens": tokens,
        "recv_counts": rc,
        "num_local": local,
        "rank": me,
    }
    counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=local)
    a = expert_alignment
    out["num_recv_tokens_per_expert"] = [int(-(-c // a) * a) for c in counts.tolist()]
    if expand:
        rows, m_indices, slot = [], [], {}
        for e in range(local):
            for j in range(recv_idx.shape[0]):
                for k in range(recv_idx.shape[1]):
                    if int(recv_idx[j, k]) == e:
                        slot[(j, k)] = len(rows)
                        rows.append(j)
                        m_indices.append(e)
            while len(rows) % a:
                rows.append(-1)
                m_indices.append(-1)
        zero = torch.zeros_like(recv_x[:1]) if recv_x.shape[0] else recv_x.new_zeros((1, *recv_x.shape[1:]))
        out["expanded_x"] = (
            torch.cat([recv_x[j : j + 1] if j >= 0 else zero for j in rows])
            if rows
            else recv_x.new_empty((0, *recv_x.shape[1:]))
        )
        out["m_indices"] = torch.tensor(m_indices, dtype=torch.int32)
        out["slot"] = slot
    return out


def reference_combine(
    y, state: dict, num_tokens: int, group=None, topk_weights=None, bias=None, expand=False, hosts=None
):
    """The textbook combine for a :func:`reference_dispatch` state; returns ``[num_tokens, hidden]``.

    ``hosts``: list of lists of ranks (each host's, ascending; None: one host), which picks the summation
    order (see the module docstring)."""
    w = dist.get_world_size(group)
    rc = state["recv_counts"]
    if expand:
        recv_idx = state["recv_topk_idx"]
        weights = state["recv_topk_weights"] if topk_weights is None else topk_weights.float()
        partial = torch.zeros((recv_idx.shape[0], y.shape[1]), dtype=torch.float32)
        for j in range(recv_idx.shape[0]):
            for k in range(recv_idx.shape[1]):
                if int(recv_idx[j, k]) >= 0:
                    partial[j] += weights[j, k] * y[state["slot"][(j, k)]].float()
        rows = partial.to(y.dtype)
    else:
        rows = y
    back = _a2a(list(torch.split(rows, rc)), [t.numel() for t in state["tokens"]], rows, group)
    acc = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32)
    if hosts is None or len(hosts) <= 1:
        for r in range(w):
            acc[state["tokens"][r]] += back[r].float()
    else:
        for ranks in hosts:  # hosts in list order; inside a host, its ranks ascending
            part = torch.zeros_like(acc)
            touched = torch.zeros(num_tokens, dtype=torch.bool)
            for r in ranks:
                part[state["tokens"][r]] += back[r].float()
                touched[state["tokens"][r]] = True
            acc[touched] += part[touched].to(y.dtype).float()
    for b in [] if bias is None else (bias if isinstance(bias, (tuple, list)) else [bias]):
        acc += b.float()
    return acc.to(y.dtype)


def reference_low_latency_dispatch(
    x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int, group=None, use_fp8: bool = True
):
    """Textbook low-latency dispatch: every (token, expert) pair is sent to the expert's rank.

    Returns per-expert received rows (source rank, then token order) and the state for combine.
    """
    w = dist.get_world_size(group)
    local = num_experts // w
    n = num_max_dispatch_tokens_per_rank
    pairs = [(t, k) for t in range(topk_idx.shape[0]) for k in range(topk_idx.shape[1]) if int(topk_idx[t, k]) >= 0]
    if use_fp8:
        from epkit.quant import per_token_group_cast_to_fp8

        xq, xs = per_token_group_cast_to_fp8(x, 128)
        payload = torch.cat([xq.view(torch.uint8), xs.view(torch.uint8).view(x.shape[0], 4 * xs.shape[1])], dim=1)
    else:
        payload = x.view(torch.uint8).view(x.shape[0], 2 * x.shape[1])
    by_dst = [[p for p in pairs if int(topk_idx[p]) // local == r] for r in range(w)]
    send_counts = torch.tensor([len(b) for b in by_dst], dtype=torch.int64)
    recv_counts = torch.empty(w, dtype=torch.int64)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    rc = recv_counts.tolist()
    rows = _a2a([payload[[t for t, _ in b]] if b else payload[:0] for b in by_dst], rc, payload, group)
    experts = _a2a(
        [torch.tensor([int(topk_idx[p]) % local for p in b], dtype=torch.int64) for b in by_dst],
        rc,
        torch.zeros(1, dtype=torch.int64),
        group,
    )
    per_expert = [[] for _ in range(local)]
    where = []  # for each received pair (src, i): (expert, position)
    for src in range(w):
        for i in range(rc[src]):
            e = int(experts[src][i])
            where.append((src, i, e, len(per_expert[e])))
            per_expert[e].append(rows[src][i])
    hb = x.shape[1] if use_fp8 else 2 * x.shape[1]
    recv = []
    for e in range(local):
        block = torch.stack(per_expert[e]) if per_expert[e] else payload.new_zeros((0, payload.shape[1]))
        recv.append(block)
    counts = [len(p) for p in per_expert]
    out = {"counts": counts, "by_dst": by_dst, "rc": rc, "where": where, "n": n}
    if use_fp8:
        out["recv_x"] = [b[:, :hb].contiguous().view(torch.float8_e4m3fn) for b in recv]
        out["recv_scales"] = [b[:, hb:].contiguous().view(torch.float32) for b in recv]
    else:
        out["recv_x"] = [b.contiguous().view(torch.bfloat16) for b in recv]
    return out


def reference_low_latency_combine(y_per_expert: list[torch.Tensor], topk_idx, topk_weights, state, group=None):
    """Textbook low-latency combine: each pair's row goes back; the source sums over k ascending in float32."""
    w = dist.get_world_size(group)
    by_src = [[] for _ in range(w)]
    for src, _i, e, pos in state["where"]:
        by_src[src].append(y_per_expert[e][pos])
    h = y_per_expert[0].shape[1] if y_per_expert else 0
    empty = torch.zeros((0, h), dtype=torch.bfloat16)
    back = _a2a([torch.stack(b) if b else empty for b in by_src], [len(b) for b in state["by_dst"]], empty, group)
    row_of = {}
    for d in range(w):
        for i, p in enumerate(state["by_dst"][d]):
            row_of[p] = back[d][i]
    out = torch.zeros((topk_idx.shape[0], h), dtype=torch.float32)
    for k in range(topk_idx.shape[1]):
        for t in range(topk_idx.shape[0]):
            if (t, k) in row_of:
                out[t] += topk_weights[t, k].float() * row_of[(t, k)].float()
    return out.to(torch.bfloat16)
