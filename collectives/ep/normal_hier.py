"""EPBuffer across hosts: hierarchical normal-mode dispatch and combine (CPU ranks: ``shm`` inside a host,
``torch`` between; CUDA ranks: ``nvshmem`` for both, peer views inside an NVLink domain, puts with signal between
domains; ``ep.hier_rows.PARTS``).

With N hosts (NVLink domains) of P ranks each (``EPBuffer.hosts``; rank l of host h is ``hosts[h][l]``), a rank
has two buffers besides the EPBuffer's own (a flat buffer over the whole group, ``torch`` or ``nvshmem``, which
carries the layout and handle agreements and the low-latency mode):

* ``rail``: over rank l of every host (a :class:`~epkit.collectives.bootstrap.SubGroup` named ``ep-rail``);
* ``intra``: over the ranks of this host (``ep-intra``).

On CUDA the protocol is the host-driven one (the routing read on the host, the rows moved by torch ops and the
transport's puts, as the flat nvshmem buffer's ``kernels="host"`` path); the puts between domains are NVSHMEM
put-with-signal kernels (``csrc/cuda``: device-initiated, through the job's remote transport).

Dispatch: the layout agreement (one flat exchange; a rejected call is the same ValueError on every rank of
every host before any row moves) tells each rank the rows each source sends it and, per source on its rail,
the rows that source sends its host. Rank (h, l) then sends each token once to every other host H holding one
of its experts, to the rail peer (H, l): per row, its bytes, FP8 scales, global expert ids and weights (int32
and float32, ``8 * num_topk`` bytes of metadata per row), each field block 16-byte aligned; its own host's
tokens take no message (it forwards them from its own tensors). (H, l) forwards each row over ``intra`` to
every rank of its host holding one of the token's experts, with local ids (its own rows straight into its
results, through no region); each rank puts the blocks in the flat order (source rank, then source token). On CPU
ranks the x and scale rows go straight into the receiver's result slot (``ep/result_slots``; the layout agreement
names each rank's slot and the rows each source sends each rank), the ids and weights through the region.
There, too (a two-sided rail), a rail message begins with the x rows of the receiver's own tokens (in token
order: where they are contiguous in its result), sent as a part of their own that the receiver's transport
receives straight into its slot (``Exchange.receive``'s ``into``; without a slot, into memory of its own); the rest
of the message holds the host's other tokens, and a mask (a bit per token, ``rail_order``) lets the receiver
forward every row in token order. The messages are staged while the layout agreement is under way (its
``meanwhile``; nothing is sent before the verdict), and while they move each rank forwards its own tokens to the
ranks of its host (``ep/hier_forward``).
A cached dispatch moves the rows and scales only (the routing and the messages' order stay in the handle).

Combine: each rank sends its rows (expanded: its per-rank partial, cast to ``y.dtype``) back to the rank
that forwarded them; the forwarder sums, per rail row, its host's rows in ascending rank order in float32
and casts (the host partial: one row per (token, host) crosses hosts; its own host's stays where it is
summed); the source sums the host partials
in host order in float32, adds the biases, casts (``ep_reference``'s two-level order, see ``ep/hier_rows``).

Bytes across hosts (:meth:`HierNormalPath.bytes_across_hosts`): every ``torch`` message carries a 24-byte
header (32 for one in two parts); per remote rail peer a dispatch message is ``rows * (row bytes + scales + 8 *
num_topk)`` plus at most 15 bytes of padding per field block and, when split, ``ceil(rows / 8)`` bytes of mask, a
combine message ``rows * hidden * y.element_size()``; the
agreements cross hosts too (per remote rank: ``8 * (4 + world_size) + META_MSG`` bytes for the layout, 24 +
``META_MSG`` for a combine's or cached dispatch's handle agreement, plus a header each).
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from epkit.collectives.ep import routing
from epkit.collectives.ep.agreement import Meanwhile, agree_on_handle, agree_rows
from epkit.collectives.ep.config import RegionSizes
from epkit.collectives.ep.context import EPContext
from epkit.collectives.ep.handles import DispatchHandle, DispatchResult, HierRoute
from epkit.collectives.ep.hier_forward import Forward, Place
from epkit.collectives.ep.hier_rows import field_offsets, last_sum_layout, rail_order, token_order
from epkit.collectives.ep.result_slots import ResultSlots, result_slot_count
from epkit.collectives.ep.results import cached_result, finish_dispatch
from epkit.collectives.ep.rows import (
    META_MSG,
    Bias,
    align_up,
    check_formats,
    format_code,
    row_bytes,
    sum_indexed_rows,
)
from epkit.collectives.exchange import Exchange
from epkit.collectives.symm_buffer import SymmBuffer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["HierNormalPath", "Hierarchy", "flat_region"]

#: A received rail message (``_rail_receive``): its field views, the row of each (None: as they are), the x rows
#: received straight into this rank's result (None: none).
_Message = tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]


class RailCall(NamedTuple):
    """A dispatch's placement after its layout agreement: ``matrix`` ([source, destination] rows), ``place`` (per
    rank of this host: its result slot, -1: none, and the rows each source sends it) and ``k_in`` (per host, the x
    rows its rail message begins with, received straight into this rank's result)."""

    matrix: torch.Tensor
    place: Place
    k_in: list[int]


def flat_region(sizes: RegionSizes, hidden: int, num_topk: int, num_local_experts: int, n_ll: int) -> int:
    """Region bytes of a hierarchical buffer's flat ``torch`` buffer: the low-latency messages and the
    agreements only (normal-mode rows travel through ``rail`` and ``intra``)."""
    ll = sizes.low_latency + align_up(4 * (3 + num_local_experts)) + META_MSG
    return align_up(max(ll, n_ll * num_topk * align_up(2 * hidden), 64 + META_MSG), 4096)


class Hierarchy:
    """The ``rail`` and ``intra`` buffers of one rank of a hierarchical EPBuffer (collective over ``group``), over
    the transports ``parts`` names (:data:`~epkit.collectives.ep.hier_rows.PARTS`: shm and torch for
    CPU rows, nvshmem for both on CUDA, where every rank of the group makes both buffers at once)."""

    def __init__(
        self,
        group: ProcessGroup | None,
        hosts: list[list[int]],
        hidden: int,
        num_topk: int,
        n: int,
        timeout: float,
        parts: tuple[str, str, str],
        hint: str = "",
    ) -> None:
        from epkit.collectives.bootstrap import SubGroup, group_info

        rank = group_info(group)[0]
        self.hosts, self.num_hosts, self.per_host = hosts, len(hosts), len(hosts[0])
        self.host_of = {r: h for h, g in enumerate(hosts) for r in g}
        self.host = self.host_of[rank]
        self.local = hosts[self.host].index(rank)
        #: Group ranks of this rank's rail (rank ``local`` of every host), by host.
        self.rail_ranks = [g[self.local] for g in hosts]
        widths = [4 * hidden, 4 * -(-hidden // 128), 4 * num_topk, 4 * num_topk]
        self.rail_region = align_up(max(field_offsets(n, widths)[1], n * 4 * hidden), 4096)
        m = self.num_hosts * n
        self.intra_region = align_up(max(field_offsets(m, widths)[1], m * 4 * hidden), 4096)
        _, intra, rail = parts
        intra_bytes, count = self.per_host * self.intra_region, result_slot_count()
        #: Result slots in the ``intra`` buffer (``shm`` only): forwarders write x and scale rows straight into
        #: the receiver's result (``ep/result_slots``), as the senders of a flat ``shm`` buffer do.
        self.result_slots: ResultSlots | None = None
        if intra == "shm" and count:
            rows = self.num_hosts * self.per_host * n
            self.result_slots = ResultSlots(intra_bytes, count, rows, 4 * hidden, 4 * -(-hidden // 128))
            intra_bytes += self.result_slots.nbytes
            hint += f"; {count} result slots of the intra buffer add {self.result_slots.nbytes} bytes"
        self.intra = SymmBuffer(
            SubGroup(group, hosts[self.host], "ep-intra"),
            intra_bytes,
            transport=intra,
            timeout=timeout,
            memory_hint=hint,
        )
        if self.result_slots is not None:
            self.result_slots.buffer = self.intra
        # The torch transport needs no memory of its own (its messages are staged per exchange); a one-sided one
        # a region per source.
        rail_bytes = 0 if rail == "torch" else self.num_hosts * self.rail_region
        try:
            self.rail = SymmBuffer(
                SubGroup(group, self.rail_ranks, "ep-rail"), rail_bytes, transport=rail, timeout=timeout
            )
        except BaseException:
            self.intra.close()
            raise

    def buffers(self) -> tuple[SymmBuffer, SymmBuffer]:
        return (self.intra, self.rail)

    def close(self) -> None:
        for buf in self.buffers():
            buf.close()


class HierNormalPath:
    """Normal-mode dispatch and combine through a :class:`Hierarchy` (the module docstring's protocol); the
    agreements go over the flat ``ctx.buffer``."""

    #: Whether dispatch and combine run as device kernels.
    on_device = False

    def __init__(self, ctx: EPContext, hy: Hierarchy) -> None:
        self.ctx, self.cfg, self.hy = ctx, ctx.cfg, hy

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None, bias: Bias,
        error: str | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Combine (see ``EPBuffer.combine``): the handle agreement, while it is under way the routing of the
        combine from the handle, then the rows."""
        ctx = self.ctx
        found, biases, weights = routing.check_combine(self.cfg, ctx.device, y, handle, topk_weights, bias, False)
        error = found or error  # ``error``: the caller's verdict on its other arguments (``num_sms``)
        plan: dict[str, Any] = {}  # the combine's routing, made from the handle while the agreement is under way

        def prepare() -> None:
            try:
                self._combine_plan(handle, plan)
            except Exception:  # noqa: BLE001 -- a handle the agreement rejects; a valid one's plan is made again
                plan.clear()

        valid = error is None and handle.hier is not None
        agree_on_handle(ctx, "combine", handle, error, prepare if valid else None, (y.dtype, False) if valid else None)
        with ctx.retire_on_failure("combine"):
            return self._combine(y, handle, weights, biases, plan)

    def bytes_across_hosts(self) -> int:
        """Bytes this rank has sent to ranks on other hosts (NVLink domains): the flat buffer's messages to ranks of
        other hosts and every rail message to another host - headers and payloads on ``torch``, the payloads put
        with a signal on ``nvshmem`` (its peer views stay inside a domain)."""
        host_of = {r: h for h, g in enumerate(self.cfg.hosts) for r in g}
        me = host_of[self.cfg.rank]
        sent: list[int] = getattr(self.ctx.buffer.impl, "bytes_sent", None) or []
        total = sum(b for r, b in enumerate(sent) if host_of[r] != me)
        rail_sent: list[int] = self.hy.rail.impl.bytes_sent  # type: ignore[attr-defined]  # torch, nvshmem: both count
        return total + sum(rail_sent)  # its own slot (a local copy) stays 0

    def dispatch(
        self, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None,
        alignment: int, expand: bool, error: str | None = None,
    ) -> DispatchResult:  # fmt: skip
        """Normal dispatch through the hierarchy (see ``EPBuffer.dispatch``). On a two-sided rail (``torch``) the rail
        messages are staged while the layout agreement is under way; nothing leaves the rank before it, and a
        rejected call drops them."""
        ctx, cfg, hy = self.ctx, self.cfg, self.hy
        w, me = cfg.world_size, cfg.rank
        ctx.dispatches += 1  # on every rank at every call, rejected ones too: the ranks' handles stay comparable
        # ``error``: the caller's verdict on its other arguments (``num_sms``), agreed as this call's own
        error = routing.dispatch_error(cfg, ctx.device, x, scales, topk_idx, topk_weights, alignment, False) or error
        rows: list[torch.Tensor] = []
        state = HierRoute()
        cols: list[torch.Tensor] | None = None
        masks: list[torch.Tensor | None] | None = None
        slots = hy.result_slots
        slot = slots.take() if slots is not None else -1
        rail: Exchange | None = None
        failed: list[Exception] = []  # the staging's failure: raised once every rank has the agreement's verdict
        try:  # until the agreement no row moves: the slot was never written, whatever fails
            rail = None if hy.rail.impl.direct else hy.rail.exchange(hy.rail_region, tag="dispatch rail")
            if error is None:
                topk_idx = topk_idx.cpu()
                weights = torch.zeros(topk_idx.shape) if topk_weights is None else topk_weights.cpu()
                rank_counts, _, in_rank = routing.dispatch_layout(cfg, topk_idx)
                in_host = torch.stack([in_rank[:, g].any(1) for g in hy.hosts], 1)
                tokens = [in_rank[:, r].nonzero().flatten() for r in range(w)]
                state.in_host = in_host
                fmt = format_code(x.dtype, scales is not None)
                per_rank, per_host = rank_counts.tolist(), in_host.sum(0).tolist()
                rows = [torch.tensor([fmt, per_rank[r], per_host[hy.host_of[r]], slot, *per_rank]) for r in range(w)]
                cols = self._cols(x, scales, (topk_idx.to(torch.int32), weights.float()))
                k_out = [
                    per_rank[g[hy.local]] if rail is not None and hy.host != H else 0 for H, g in enumerate(hy.hosts)
                ]
                masks, state.host_tokens = [None] * hy.num_hosts, []
                for H, g in enumerate(hy.hosts):  # a message split before the rail peer's own x rows: rail_order
                    order, masks[H] = rail_order(in_host[:, H], in_rank[:, g[hy.local]], 0 < k_out[H] < per_host[H])
                    state.host_tokens.append(order)

            def stage() -> None:
                try:
                    assert rail is not None and cols is not None  # passed only then
                    self._stage(rail, cols, state, k_out, masks)
                except Exception as exc:  # noqa: BLE001 -- after the verdict, so that every rank learns of it
                    failed.append(exc)

            # Word 1: rows for that rank, word 2: rows for its host (its rail peer's receive), word 3: the sender's
            # result slot (-1: none), then the rows it sends each rank (where a forwarder's rows start in a result).
            got = agree_rows(ctx, error, rows, 4 + w, stage if rail is not None and cols is not None else None)
            check_formats([int(g[0]) for g in got], self.cfg.ranks)  # a bad call failed on every rank above
        except BaseException:
            if slots is not None:
                slots.give_back(slot)
            if rail is not None:
                rail.release()
            raise
        recv_counts = [int(g[1]) for g in got]
        with ctx.retire_on_failure("dispatch"):  # peers may write into the announced slot now: a failure retires
            if failed:
                raise failed[0]
            call = self._route(got, state, rail is not None)
            if call.matrix[:, me].tolist() != recv_counts:
                raise RuntimeError(f"{self.cfg.rank_name(me)}: the layout messages disagree on the rows sent here")
            assert cols is not None  # the call was valid on every rank: its fields were made
            recv_x, recv_s, recv_i, recv_w = self._move(cols, x.dtype, scales, state, recv_counts, call, rail)
        assert recv_i is not None and recv_w is not None  # a dispatch's fields carry the routing
        recv_i, recv_w = recv_i.cpu().to(topk_idx.dtype), recv_w.cpu()  # the routing stays on the host
        recv = (recv_x, recv_s, recv_i, recv_w)
        return finish_dispatch(ctx, recv, tokens, recv_counts, x.shape[0], expand, alignment, state)

    def _route(self, got: list[torch.Tensor], state: HierRoute, split: bool) -> RailCall:
        """After the layout agreement (``got``): the call's ``matrix`` ([source, destination] rows), ``place`` (per
        rank of this host: its result slot, -1: none, and the rows each source sends it) and ``k_in`` (per host, the
        x rows its rail message begins with, received straight into this rank's result: its own; ``split``: the
        rail is two-sided)."""
        hy = self.hy
        state.rail_counts = [int(got[r][2]) for r in hy.rail_ranks]
        state.tok_order = [None] * hy.num_hosts  # per rail peer: its message's rows in token order (None: as sent)
        matrix = torch.stack([g[4:] for g in got])
        place = [(int(got[r][3]), matrix[:, r]) for r in hy.hosts[hy.host]]
        k_in = [int(matrix[r, self.cfg.rank]) if split and hy.host != H else 0 for H, r in enumerate(hy.rail_ranks)]
        return RailCall(matrix, place, k_in)

    def dispatch_cached(
        self, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle, error: str | None = None
    ) -> DispatchResult:
        """A dispatch along an earlier one's routing (``handle``): rows and scales only cross hosts."""
        ctx, cfg = self.ctx, self.cfg
        error = error or routing.cached_dispatch_error(cfg, ctx.device, x, scales, handle)
        fmt = (x.dtype, scales is not None) if not error else None
        agree_on_handle(ctx, "cached dispatch", handle, error, fmt=fmt)  # a handle of another buffer is rejected here
        with ctx.retire_on_failure("cached dispatch"):
            cols = self._cols(x, scales, None)
            assert handle.hier is not None  # the agreement found it this buffer's: a hierarchical dispatch's
            recv_x, recv_s, _, _ = self._move(cols, x.dtype, scales, handle.hier, handle.recv_counts)
        return cached_result(ctx, recv_x, recv_s, handle)

    def _cols(
        self, x: torch.Tensor, scales: torch.Tensor | None, meta: tuple[torch.Tensor, torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """The fields of a rail message, as ``[T, width]`` uint8 views: the rows, their FP8 scales, and for a dispatch
        (``meta``: global ids int32, weights float32 ``[T, K]``) the routing, in the rows' memory."""
        cols = [row_bytes(x)]
        if scales is not None:
            cols.append(row_bytes(scales))
        if meta is not None:
            cols += [
                m.to(x.device).contiguous().view(torch.uint8).view(x.shape[0], 4 * self.cfg.num_topk) for m in meta
            ]
        return cols

    def _move(
        self, cols: list[torch.Tensor], dtype: torch.dtype, scales: torch.Tensor | None, state: HierRoute,
        recv_counts: list[int], call: RailCall | None = None, rail: Exchange | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """Rows over the rail, then forwarded inside the host. ``cols``: ``_hier_cols``'s (with the routing for a
        dispatch, which is then found from it and stored in ``state``; without for a cached dispatch, whose
        ``state`` holds it); ``call``: ``_hier_route``'s (None: no result slots, no rows straight into a result);
        ``rail``: the rail exchange with the messages staged (None: opened and staged here). Returns (recv_x,
        recv_scales, recv_idx int32, recv_w) in the flat order (the last two None without the routing)."""
        h, K, hy = self.cfg.hidden, self.cfg.num_topk, self.hy
        meta = len(cols) - (scales is not None) > 1
        widths = [c.shape[1] for c in cols]
        fw: list[Forward] = []
        if meta:
            state.hit = [None] * hy.num_hosts
        if rail is None:
            rail = hy.rail.exchange(hy.rail_region, tag="dispatch rail")
            self._stage(rail, cols, state, [0] * hy.num_hosts, None)

        def own_host() -> None:  # while the rail messages arrive: this host's own tokens, to every rank of the host
            here = hy.host
            if meta:
                state.hit[here] = self._hits(cols, state.host_tokens[here])
            fw.append(Forward(self, widths, state, recv_counts, meta, call and call.place))
            fw[0].source(here, cols, state.host_tokens[here], None)

        # Every receive posted before the headers arrive needs sizes every rank agreed on: a dispatch's come from the
        # layout agreement; a cached dispatch's from each rank's own x (its agreement compares the handles only).
        got = self._rail_receive(rail, cols, widths, state, call, own_host if call is not None else None)
        if call is None:
            own_host()
        for H, (fields_, rows, head) in enumerate(got):
            if hy.host != H:
                if meta:
                    state.hit[H] = self._hits(fields_, None)
                fw[0].source(H, fields_, rows, head)
        outs = fw[0].finish()
        rail.release()
        total = sum(recv_counts)
        recv_x = outs[0].view(dtype).view(total, h)
        recv_s = outs[1].view(torch.float32).view(total, scales.shape[1]) if scales is not None else None
        if not meta:
            return recv_x, recv_s, None, None
        recv_i, recv_w = (outs[-2 + i].view(dt).view(total, K) for i, dt in enumerate((torch.int32, torch.float32)))
        return recv_x, recv_s, recv_i, recv_w

    def _rail_layout(self, widths: list[int], n: int, k: int) -> tuple[list[int], int, list[int]]:
        """A rail message of ``n`` rows whose first part is the x rows of ``k`` (``rail_order``): the byte offsets of
        the field blocks after it (fewer x rows by ``k``; the mask last when ``0 < k < n``), its bytes, and the
        rows of each block."""
        mask = 0 < k < n
        rows = [n - k] + [n] * (len(widths) - 1) + ([1] if mask else [])
        offs, end = field_offsets(rows, widths + ([-(-n // 8)] if mask else []))
        return offs, end, rows

    def _stage(
        self, ex: Exchange, cols: list[torch.Tensor], state: HierRoute, k_out: list[int],
        masks: list[torch.Tensor | None] | None,
    ) -> None:  # fmt: skip
        """Each other host's tokens (``state.host_tokens``, in their message's order) for this rank's rail peer
        there, every field block by index_select into the staging region, and committed (a two-sided exchange sends
        nothing before its receive); this host's own tokens take no message (they are read where they are). A
        message with ``k_out[H]`` begins with the x rows of the peer's own tokens, as a part of its own that the
        peer receives straight into its result; the rest holds the other x rows, the other fields' rows and, when
        split, ``masks[H]``."""
        hy = self.hy
        N, here, widths = hy.num_hosts, hy.host, [c.shape[1] for c in cols]
        xb = widths[0]
        for step in range(1, N):
            H = (here + step) % N
            t = state.host_tokens[H].to(cols[0].device)
            n, k = t.numel(), k_out[H]
            offs, end, rows = self._rail_layout(widths, n, k)
            if n:
                region = ex.send_region(H)
                torch.index_select(cols[0], 0, t[:k], out=region[: k * xb].view(k, xb))
                body = region[k * xb :]
                for c, wd, o, m in zip(cols, widths, offs, rows):
                    torch.index_select(c, 0, t[n - m :], out=body[o : o + m * wd].view(m, wd))
                if 0 < k < n:
                    mask = masks[H] if masks is not None else None
                    assert mask is not None  # a split message has its mask
                    body[offs[-1] : offs[-1] + mask.numel()].copy_(mask)
            ex.commit(H, k * xb + end if n else 0, split=k * xb)
        ex.commit(here, 0)

    def _rail_receive(
        self, ex: Exchange, cols: list[torch.Tensor], widths: list[int], state: HierRoute, call: RailCall | None,
        meanwhile: Meanwhile,
    ) -> list[_Message]:  # fmt: skip
        """The staged rail exchange's messages (``meanwhile`` run while they move). Returns, per rail peer, ``(fields,
        rows, head)``: the received field views (``[rows, width]`` uint8 each; the x field without the rows in
        ``head``), None, and the x rows received straight into this rank's result (its slot; without one, memory
        of its own) or None; for this host the sender's fields, the row of each, None."""
        hy = self.hy
        N, here, xb = hy.num_hosts, hy.host, widths[0]
        k_in, counts = call.k_in if call is not None else [0] * N, state.rail_counts
        heads: list[torch.Tensor | None] = [None] * N
        for H, k in enumerate(k_in):
            slot, rows_from = call.place[hy.local] if call is not None and k else (-1, None)  # k > 0: from call
            if k and slot >= 0:  # where that source's rows start in this rank's result
                assert hy.result_slots is not None and rows_from is not None  # the slot is one of them
                heads[H] = hy.result_slots.area(hy.local, slot, 0, int(rows_from[: hy.rail_ranks[H]].sum()), k, xb)
            elif k:
                heads[H] = self.ctx.host_empty((k, xb), torch.uint8)
        lays = [self._rail_layout(widths, n, k) for n, k in zip(counts, k_in)]
        sizes = [k * xb + lay[1] if n and here != H else 0 for H, (lay, n, k) in enumerate(zip(lays, counts, k_in))]
        views = ex.receive(sizes, into=[None if h is None else h.view(-1) for h in heads], meanwhile=meanwhile)
        got: list[_Message] = []
        for H, (v, n, (offs, _, rows)) in enumerate(zip(views, counts, lays)):
            if here == H:
                got.append((cols, state.host_tokens[H], None))
                continue
            if 0 < k_in[H] < n:
                state.tok_order[H] = token_order(v[offs[-1] : offs[-1] + -(-n // 8)].cpu(), n)
            got.append(([v[o : o + m * wd].view(m, wd) for o, wd, m in zip(offs, widths, rows)], None, heads[H]))
        return got

    def _hits(self, fields_: list[torch.Tensor], rows: torch.Tensor | None) -> torch.Tensor:
        """``[rows, P]`` bool: which ranks of this host hold one of each of a rail message's rows' experts
        (``fields_``, ``rows``: as in ``_hier_rail_receive``'s result)."""
        hy, K, L = self.hy, self.cfg.num_topk, self.cfg.num_local_experts
        ids = fields_[-2] if rows is None else fields_[-2].index_select(0, rows.to(fields_[-2].device))
        ids = ids.view(torch.int32).view(-1, K).long()
        rank_of = torch.where(ids >= 0, ids // L, -1)
        return torch.stack([(rank_of == r).any(1) for r in hy.hosts[hy.host]], 1).cpu()

    def _forwarded_by(self, handle: DispatchHandle, lf: int) -> torch.Tensor:
        """The received rows (in the flat order) that rank ``lf`` of this host forwarded here: its rail's sources'."""
        starts = list(accumulate(handle.recv_counts, initial=0))
        return torch.cat([torch.arange(starts[g[lf]], starts[g[lf] + 1]) for g in self.hy.hosts])

    def _combine_plan(self, handle: DispatchHandle, plan: dict[str, Any]) -> None:
        """The combine's routing, from the handle alone (run while the handle agreement is under way): ``order``, per
        rail peer ``(src_of, row_of)`` ``[rows, P]`` into the rows each rank of this host sends back (this rank's own:
        rows of ``y``, unless expanded), and ``last``, the last sum's terms (``last_sum_layout``)."""
        hy, st = self.hy, handle.hier
        assert st is not None and st.in_host is not None  # a hierarchical dispatch's handle
        remap = None if handle.expand else self._forwarded_by(handle, hy.local)
        base = torch.zeros(hy.per_host, dtype=torch.int64)
        order = []
        for hit, to in zip(st.hits(), st.tok_order):  # each rank's rows came back in token order
            at = hit.long().cumsum(0) - 1 if to is None else hit.index_select(0, to).long().cumsum(0) - 1
            if to is not None:
                at = torch.empty_like(at).index_copy_(0, to, at)  # to the message's order
            row_of = (base + at).clamp(min=0)
            if remap is not None and remap.numel():  # this rank's own: rows of y
                row_of[:, hy.local] = remap[row_of[:, hy.local].clamp(max=remap.numel() - 1)]
            order.append((torch.where(hit, torch.arange(hy.per_host), -1), row_of))
            base = base + hit.long().sum(0)
        own = order[hy.host] if st.rail_counts[hy.host] else None
        plan["order"] = order
        plan["last"] = last_sum_layout(st.in_host, hy.host, hy.per_host, own, st.host_tokens)

    def _combine_intra(
        self, y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None
    ) -> tuple[Exchange, list[torch.Tensor]]:
        """Combine's first step: each rank's rows (expanded: its partial per received row, its local experts, k
        ascending, cast) to the rank that forwarded them; returns the open exchange and, per rank of this host,
        the ``[rows, hidden]`` rows it sent back here in this rank's forwarding order (this rank's own: ``y``
        itself, unless expanded)."""
        hy, h, portable = self.hy, self.cfg.hidden, self.cfg.portable
        rb = h * y.element_size()
        ex = hy.intra.exchange(hy.intra_region, tag="combine intra")
        y_bytes = y.view(torch.uint8).view(-1, rb)
        own: torch.Tensor | None = None
        for step in range(hy.per_host):
            lf = (hy.local + step) % hy.per_host
            rows = self._forwarded_by(handle, lf)
            m = rows.numel()
            if m and handle.expand:
                assert handle.expanded_slot is not None and weights is not None  # the expanded mode's
                out = self.ctx.host_empty((m, h), y.dtype) if lf == hy.local else ex.send_region(lf)[: m * rb]
                slot = handle.expanded_slot[rows]
                keep = torch.where(slot >= 0, 0, -1)
                sum_indexed_rows(
                    out.view(y.dtype).view(m, h), [y], keep, slot.clamp(min=0), weights[rows], portable=portable
                )
                own = out if lf == hy.local else own
            elif m and lf != hy.local:
                torch.index_select(y_bytes, 0, rows.to(y.device), out=ex.send_region(lf)[: m * rb].view(m, rb))
            elif lf == hy.local and not handle.expand:
                own = y
            ex.commit(lf, 0 if lf == hy.local else m * rb)
        assert handle.hier is not None  # a hierarchical dispatch's handle
        hits = handle.hier.hits()
        sizes = [0 if lp == hy.local else int(sum(hit[:, lp].sum() for hit in hits)) * rb for lp in range(hy.per_host)]
        views = ex.receive(sizes)
        sources = [v.view(y.dtype).view(-1, h) for v in views]
        sources[hy.local] = own if own is not None else y[:0]
        return ex, sources

    def _combine(
        self, y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None, biases: list[torch.Tensor],
        plan: dict[str, Any] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Rows back to their forwarders, host partials over the rail, the last sum at the source (the module
        docstring's order); ``weights``: the expanded mode's (None otherwise); ``plan``: ``_hier_combine_plan``'s
        (made here when empty)."""
        hy, st, h, N = self.hy, handle.hier, self.cfg.hidden, self.hy.num_hosts
        assert st is not None  # a hierarchical dispatch's handle
        y = y.contiguous()
        rb = h * y.element_size()
        plan = plan if plan else {}
        if not plan:
            self._combine_plan(handle, plan)
        order = plan["order"]
        ex, sources = self._combine_intra(y, handle, weights)
        rail = hy.rail.exchange(hy.rail_region, tag="combine rail")
        for step in range(1, N):  # the host partials of the other hosts' tokens, over the rail
            H = (hy.host + step) % N
            n = st.rail_counts[H]
            if n:  # this host's rows of each token, ranks ascending, float32, cast
                out = rail.send_region(H)[: n * rb].view(y.dtype).view(n, h)
                sum_indexed_rows(out, sources, order[H][0], order[H][1], portable=self.cfg.portable)
            rail.commit(H, n * rb)
        rail.commit(hy.host, 0)
        back = rail.receive([t.numel() * rb if hy.host != H else 0 for H, t in enumerate(st.host_tokens)])
        # The last sum, per token in host order: another host's partial as it came; this host's own rows as a group
        # (its partial cast in the sum, never written out: sum_indexed_rows's groups).
        rails = [H for H in range(N) if hy.host != H]
        parts = [back[H].view(y.dtype).view(-1, h) for H in rails] + sources
        src_of, row_of, groups = plan["last"]
        out = self.ctx.host_empty((handle.num_tokens, h), y.dtype)
        sum_indexed_rows(out, parts, src_of, row_of, None, biases, groups, self.cfg.portable)
        ex.release()  # the rows the peers sent back were read in place
        rail.release()
        return out
