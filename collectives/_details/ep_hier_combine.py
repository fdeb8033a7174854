"""The combine of a hierarchical EPBuffer (``ep_hier``, whose module docstring gives the protocol): rows back to
their forwarders inside the host, one host partial per (token, host) over the rail, the last sum at the source in
``ep_reference``'s two-level order."""

from __future__ import annotations

from itertools import accumulate

import torch

from epkit.collectives._details.ep_hier_rows import last_sum_layout
from epkit.collectives._details.ep_rows import reduce_indexed

__all__ = ["HierCombineMixin"]


class HierCombineMixin:
    """The combine half of :class:`~epkit.collectives._details.ep_hier.HierarchyMixin` (uses ``self._hier`` and the
    buffer's ``_host_empty``)."""

    def _hier_forwarded_by(self, handle, lf: int) -> torch.Tensor:
        """The received rows (in the flat order) that rank ``lf`` of this host forwarded here: its rail's sources'."""
        starts = list(accumulate(handle.recv_counts, initial=0))
        return torch.cat([torch.arange(starts[g[lf]], starts[g[lf] + 1]) for g in self._hier.hosts])

    def _hier_combine_plan(self, handle, plan: dict) -> None:
        """The combine's routing, from the handle alone (run while the handle agreement is under way): ``order``, per
        rail peer ``(src_of, row_of)`` ``[rows, P]`` into the rows each rank of this host sends back (this rank's own:
        rows of ``y``, unless expanded), and ``last``, the last sum's terms (``last_sum_layout``)."""
        hy, st = self._hier, handle.hier
        remap = None if handle.expand else self._hier_forwarded_by(handle, hy.local)
        base = torch.zeros(hy.per_host, dtype=torch.int64)
        order = []
        for hit, to in zip(st["hit"], st["tok_order"]):  # each rank's rows came back in token order
            at = hit.long().cumsum(0) - 1 if to is None else hit.index_select(0, to).long().cumsum(0) - 1
            if to is not None:
                at = torch.empty_like(at).index_copy_(0, to, at)  # to the message's order
            row_of = (base + at).clamp(min=0)
            if remap is not None and remap.numel():  # this rank's own: rows of y
                row_of[:, hy.local] = remap[row_of[:, hy.local].clamp(max=remap.numel() - 1)]
            order.append((torch.where(hit, torch.arange(hy.per_host), -1), row_of))
            base = base + hit.long().sum(0)
        own = order[hy.host] if st["rail_counts"][hy.host] else None
        plan["order"] = order
        plan["last"] = last_sum_layout(st["in_host"], hy.host, hy.per_host, own, st["host_tokens"])

    def _hier_combine_intra(self, y, handle, weights):
        """Combine's first step: each rank's rows (expanded: its partial per received row, its local experts, k
        ascending, cast) to the rank that forwarded them; returns the open exchange and, per rank of this host,
        the ``[rows, hidden]`` rows it sent back here in this rank's forwarding order (this rank's own: ``y``
        itself, unless expanded)."""
        hy, h = self._hier, self.hidden
        rb = h * y.element_size()
        ex = hy.intra.exchange(hy.intra_region, tag="combine intra")
        y_bytes = y.view(torch.uint8).view(-1, rb)
        own = None
        for step in range(hy.per_host):
            lf = (hy.local + step) % hy.per_host
            rows = self._hier_forwarded_by(handle, lf)
            m = rows.numel()
            if m and handle.expand:
                out = self._host_empty((m, h), y.dtype) if lf == hy.local else ex.send_region(lf)[: m * rb]
                slot = handle.expanded_slot[rows]
                keep = torch.where(slot >= 0, 0, -1)
                reduce_indexed(out.view(y.dtype).view(m, h), [y], keep, slot.clamp(min=0), weights[rows])
                own = out if lf == hy.local else own
            elif m and lf != hy.local:
                torch.index_select(y_bytes, 0, rows.to(y.device), out=ex.send_region(lf)[: m * rb].view(m, rb))
            elif lf == hy.local and not handle.expand:
                own = y
            ex.commit(lf, 0 if lf == hy.local else m * rb)
        hits = handle.hier["hit"]
        sizes = [0 if lp == hy.local else int(sum(hit[:, lp].sum() for hit in hits)) * rb for lp in range(hy.per_host)]
        views = ex.receive(sizes)
        sources = [v.view(y.dtype).view(-1, h) for v in views]
        sources[hy.local] = own if own is not None else y[:0]
        return ex, sources

    def _hier_combine(self, y, handle, weights, biases, plan: dict | None = None) -> torch.Tensor:
        """Rows back to their forwarders, host partials over the rail, the last sum at the source (the module
        docstring's order); ``weights``: the expanded mode's (None otherwise); ``plan``: ``_hier_combine_plan``'s
        (made here when empty)."""
        hy, st, h, N = self._hier, handle.hier, self.hidden, self._hier.num_hosts
        y = y.contiguous()
        rb = h * y.element_size()
        plan = plan if plan else {}
        if not plan:
            self._hier_combine_plan(handle, plan)
        order = plan["order"]
        ex, sources = self._hier_combine_intra(y, handle, weights)
        rail = hy.rail.exchange(hy.rail_region, tag="combine rail")
        for step in range(1, N):  # the host partials of the other hosts' tokens, over the rail
            H = (hy.host + step) % N
            n = st["rail_counts"][H]
            if n:  # this host's rows of each token, ranks ascending, float32, cast
                out = rail.send_region(H)[: n * rb].view(y.dtype).view(n, h)
                reduce_indexed(out, sources, order[H][0], order[H][1])
            rail.commit(H, n * rb)
        rail.commit(hy.host, 0)
        back = rail.receive([t.numel() * rb if hy.host != H else 0 for H, t in enumerate(st["host_tokens"])])
        # The last sum, per token in host order: another host's partial as it came; this host's own rows as a group
        # (its partial cast in the sum, never written out: reduce_indexed's groups).
        rails = [H for H in range(N) if hy.host != H]
        parts = [back[H].view(y.dtype).view(-1, h) for H in rails] + sources
        src_of, row_of, groups = plan["last"]
        out = self._host_empty((handle.num_tokens, h), y.dtype)
        reduce_indexed(out, parts, src_of, row_of, None, biases, groups)
        ex.release()  # the rows the peers sent back were read in place
        rail.release()
        return out
