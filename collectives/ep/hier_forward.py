"""The intra-host half of a hierarchical dispatch (``ep/normal_hier``): each rail message's rows forwarded to the
ranks of this host that hold one of their experts, and what this rank gets placed in the flat order.

It runs in steps, so that this host's own tokens move while the other hosts' rail messages are still arriving
(``Exchange.receive``'s ``meanwhile``): every count is known before any row arrives (the layout agreement's for a
dispatch, the handle's for a cached one), so each destination's region layout and each source's place in it are
fixed when the intra exchange opens.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from epkit.collectives.ep.handles import HierRoute
from epkit.collectives.ep.hier_rows import field_offsets, gather_split_rows

if TYPE_CHECKING:
    from epkit.collectives.ep.normal_hier import HierNormalPath

__all__ = ["Forward", "Place", "rows_for"]

#: A dispatch's placement per rank of this host: its result slot (-1: none) and the rows each source sends it.
Place = list[tuple[int, torch.Tensor]]


def rows_for(hit: torch.Tensor, order: torch.Tensor | None, lp: int) -> torch.Tensor:
    """The rows of a rail message for rank ``lp`` of this host, in token order (``hit [rows, P]`` bool; ``order``:
    the message's rows in token order, None: the message is in token order)."""
    if order is None:
        return hit[:, lp].nonzero().flatten()
    return order[hit.index_select(0, order)[:, lp].nonzero().flatten()]


class Forward:
    """One dispatch's forwarding inside the host: made (the ``intra`` exchange opened, each destination's layout),
    :meth:`source` once per rail peer (its rows to every rank of this host, this rank included), :meth:`finish`.

    ``path``: the hierarchical path (its ``hy``, ``cfg`` and ``ctx``); ``widths``:
    bytes per row of each field (x, scales if any, then global ids and weights when ``with_meta``); ``state``: the
    dispatch's routing (``hit``, ``tok_order``; ``hit`` complete already for a cached dispatch); ``place``: per rank
    of this host, its result slot (-1: none) and the rows each source sends it (None: no slots; the counts then come
    from ``state.hit``). A receiver with a slot gets the x and scale rows written straight into it, in the flat
    order; the other fields (and every field without a slot) travel through the region and are copied out.
    """

    def __init__(
        self,
        path: HierNormalPath,
        widths: list[int],
        state: HierRoute,
        recv_counts: list[int],
        with_meta: bool,
        place: Place | None,
    ) -> None:
        hy = self.hy = path.hy
        self.cfg, self.ctx, self.widths, self.state, self.place = path.cfg, path.ctx, widths, state, place
        self.id_f = len(widths) - 2 if with_meta else -1
        self.n_rows = len(widths) - (2 if with_meta else 0)  # the x (and scale) fields: a slot takes these
        P = hy.per_host
        if place is not None:
            self.counts = [[int(place[lp][1][s]) for s in hy.rail_ranks] for lp in range(P)]
        else:
            self.counts = [
                [rows_for(h, o, lp).numel() for h, o in zip(state.hits(), state.tok_order)] for lp in range(P)
            ]
        self.slots = [place[lp][0] if place is not None else -1 for lp in range(P)]
        self.ex = hy.intra.exchange(hy.intra_region, tag="dispatch intra")
        # Per other rank of this host: the fields through its region, their offsets, region, bytes.
        self.dest: dict[int, tuple[list[int], list[int], torch.Tensor | None, int]] = {}
        for lp in range(P):
            in_region = list(range(self.n_rows if self.slots[lp] >= 0 else 0, len(widths)))
            m = sum(self.counts[lp])
            offs, end = field_offsets(m, [widths[f] for f in in_region])
            region = self.ex.send_region(lp) if m and lp != hy.local else None
            self.dest[lp] = (in_region, offs, region, end if m else 0)
        self.starts = list(accumulate(recv_counts, initial=0))
        self.recv_counts = recv_counts
        total, slot = self.starts[-1], self.slots[hy.local]
        # With a slot: its x (and scale) rows first, then the fields that came through the regions.
        self.outs: list[torch.Tensor] = []
        if slot >= 0:
            assert hy.result_slots is not None  # the slot is one of them
            sb = widths[1] if self.n_rows == 2 else 0
            self.outs = [o for o in hy.result_slots.results(slot, total, widths[0], sb) if o is not None]
        self.outs += [self.ctx.host_empty((total, widths[f]), torch.uint8) for f in self.dest[hy.local][0]]

    def source(self, H: int, fields: list[torch.Tensor], rows: torch.Tensor | None, head: torch.Tensor | None) -> None:
        """Rail peer ``H``'s rows to every rank of this host holding one of their experts. ``fields``: the message's
        field views (``rows`` None) or, for this host, the sender's own fields and the row of each of its tokens;
        ``head``: the x rows received straight into this rank's result (the x field then lacks them)."""
        hy, w = self.hy, self.widths
        source = hy.rail_ranks[H]
        hit, order = self.state.hit[H], self.state.tok_order[H]
        assert hit is not None  # found before the rows are forwarded
        for lp in range(hy.per_host):
            dst = hy.hosts[hy.host][lp]
            sel = rows_for(hit, order, lp)
            k = sel.numel()
            if k != self.counts[lp][H] or (lp == hy.local and head is not None and k != head.shape[0]):
                name = self.cfg.rank_name
                raise RuntimeError(
                    f"{name(self.cfg.rank)}: forwards {k} rows of {name(source)} to {name(dst)}, the layout said "
                    f"{self.counts[lp][H]}" + (f" and {head.shape[0]} came straight" if head is not None else "")
                )
            if not k:
                continue
            if lp == hy.local:  # this rank's own: into its result (the x rows of head are there with a slot)
                for f, dst_t in enumerate(self.outs):
                    at = dst_t[self.starts[source] : self.starts[source + 1]]
                    if f == 0 and head is not None:
                        if self.slots[lp] < 0:
                            at.copy_(head)
                    else:
                        self._gather_field(fields[f], rows, sel, at, dst if f == self.id_f else None)
                continue
            in_region, offs, region, _ = self.dest[lp]
            row = sum(self.counts[lp][:H])  # where this source's rows start in dst's region
            first = 0  # ... and in its result
            if self.slots[lp] >= 0:
                assert self.place is not None  # the slots come from it
                first = int(self.place[lp][1][:source].sum())
            for f, wd in enumerate(w):
                if f < self.n_rows and self.slots[lp] >= 0:
                    assert hy.result_slots is not None  # the slot is one of them
                    view = hy.result_slots.area(lp, self.slots[lp], f, first, k, wd)
                else:
                    assert region is not None  # rows for another rank: its region was opened
                    o = offs[in_region.index(f)]
                    view = region[o + row * wd : o + (row + k) * wd].view(k, wd)
                if f == 0 and head is not None:  # the x rows this rank received straight into its result
                    gather_split_rows(head, fields[0], sel, view, self.cfg.portable)
                else:
                    self._gather_field(fields[f], rows, sel, view, dst if f == self.id_f else None)

    def finish(self) -> list[torch.Tensor]:
        """Once every source is forwarded: what the other forwarders sent this rank, placed in the flat order;
        returns one ``[R, width]`` uint8 tensor per field."""
        hy, w, ex = self.hy, self.widths, self.ex
        for lp in range(hy.per_host):
            ex.commit(lp, 0 if lp == hy.local else self.dest[lp][3])
        in_region = self.dest[hy.local][0]
        blocks = [[g[lf] for g in hy.hosts] for lf in range(hy.per_host)]  # forwarder lf's sources, by host
        sizes = [0 if lf == hy.local else sum(self.recv_counts[s] for s in b) for lf, b in enumerate(blocks)]
        views = ex.receive([field_offsets(m, [w[f] for f in in_region])[1] if m else 0 for m in sizes])
        for lf, (v, b, m) in enumerate(zip(views, blocks, sizes)):
            offs, _ = field_offsets(m, [w[f] for f in in_region])
            row = 0
            for s in b if lf != hy.local else ():
                n, at = self.recv_counts[s], self.starts[s]
                for f, o in zip(in_region, offs):
                    self.outs[f][at : at + n].copy_(v[o + row * w[f] : o + (row + n) * w[f]].view(n, w[f]))
                row += n
        ex.release()
        return self.outs

    def _gather_field(
        self, field: torch.Tensor, rows: torch.Tensor | None, sel: torch.Tensor, out: torch.Tensor, to_rank: int | None
    ) -> None:
        """Rows ``sel`` of one field (``rows``: None, or the field's row of each message row) into ``out``
        (``[k, width]`` uint8); ``to_rank``: the global ids field becomes that rank's local ids (-1 elsewhere);
        None: the bytes as they are."""
        if rows is not None:
            sel = rows.index_select(0, sel)
        sel = sel.to(field.device)
        if to_rank is None:
            torch.index_select(field, 0, sel, out=out)
            return
        K, L = self.cfg.num_topk, self.cfg.num_local_experts
        ids = field.view(torch.int32).view(-1, K).index_select(0, sel).long()
        loc = torch.where((ids >= 0) & (ids // L == to_rank), ids - to_rank * L, -1)
        out.view(torch.int32).view(-1, K).copy_(loc)
