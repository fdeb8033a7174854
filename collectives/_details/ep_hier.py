"""EPBuffer across hosts: hierarchical normal-mode dispatch and combine (CPU ranks: ``shm`` inside a host,
``torch`` between; CUDA ranks: ``nvshmem`` for both, peer views inside an NVLink domain, puts with signal between
domains; ``ep_hier_rows.PARTS``).

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
ranks the x and scale rows go straight into the receiver's result slot (``ep_result_slots``; the layout agreement
names each rank's slot and the rows each source sends each rank), the ids and weights through the region.
A cached dispatch moves the rows and scales only (the routing stays in the handle).

Combine: each rank sends its rows (expanded: its per-rank partial, cast to ``y.dtype``) back to the rank
that forwarded them; the forwarder sums, per rail row, its host's rows in ascending rank order in float32
and casts (the host partial: one row per (token, host) crosses hosts; its own host's stays where it is
summed); the source sums the host partials
in host order in float32, adds the biases, casts (``ep_reference``'s two-level order, see ``ep_hier_rows``).

Bytes across hosts (:meth:`HierarchyMixin.bytes_across_hosts`): every ``torch`` message carries a 24-byte
header; per remote rail peer a dispatch message is ``rows * (row bytes + scales + 8 * num_topk)`` plus at
most 15 bytes of padding per field block, a combine message ``rows * hidden * y.element_size()``; the
agreements cross hosts too (per remote rank: ``8 * (4 + world_size) + META_MSG`` bytes for the layout, 24 +
``META_MSG`` for a combine's or cached dispatch's handle agreement, plus a header each).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields

import torch

from epkit.collectives._details.ep_hier_rows import HIERARCHICAL, PARTS, field_offsets, last_sum_layout
from epkit.collectives._details.ep_normal import DispatchHandle
from epkit.collectives._details.ep_result_slots import ResultSlots, result_slot_count
from epkit.collectives._details.ep_rows import META_MSG, align_up, check_formats, format_code, reduce_indexed
from epkit.collectives.symm_buffer import SymmBuffer

__all__ = ["HierDispatchHandle", "Hierarchy", "HierarchyMixin", "flat_region"]


@dataclass
class HierDispatchHandle(DispatchHandle):
    """A :class:`DispatchHandle` of a hierarchical buffer; ``hier`` holds what this rank forwarded and sent:
    ``host_tokens`` (per host, the source tokens sent there), ``in_host`` ``[T, N]`` bool, ``rail_counts``
    (rows received from each rail peer) and ``hit`` (per rail peer, ``[rows, P]`` bool: which ranks of
    this host got each row)."""

    hier: dict | None = None


def flat_region(sizes, hidden: int, num_topk: int, num_local_experts: int, n_ll: int) -> int:
    """Region bytes of a hierarchical buffer's flat ``torch`` buffer: the low-latency messages and the
    agreements only (normal-mode rows travel through ``rail`` and ``intra``)."""
    ll = sizes.low_latency + align_up(4 * (3 + num_local_experts)) + META_MSG
    return align_up(max(ll, n_ll * num_topk * align_up(2 * hidden), 64 + META_MSG), 4096)


class Hierarchy:
    """The ``rail`` and ``intra`` buffers of one rank of a hierarchical EPBuffer (collective over ``group``), over
    the transports ``parts`` names (:data:`~epkit.collectives._details.ep_hier_rows.PARTS`: shm and torch for
    CPU rows, nvshmem for both on CUDA, where every rank of the group makes both buffers at once)."""

    def __init__(
        self, group, hosts: list[list[int]], hidden: int, num_topk: int, n: int, timeout: float, parts, hint=""
    ):
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
        #: the receiver's result (``ep_result_slots``), as the senders of a flat ``shm`` buffer do.
        self.result_slots = None
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

    def buffers(self):
        return (self.intra, self.rail)

    def close(self) -> None:
        for buf in self.buffers():
            buf.close()


class HierarchyMixin:
    """The hierarchical normal mode of :class:`~epkit.collectives.ep_buffer.EPBuffer` (``self._hier``: a
    :class:`Hierarchy`, or None on a flat buffer). Uses the buffer's ``buffer`` (the flat agreement
    exchanges), ``_agree_rows``, ``agree_on_handle``, ``_finish_dispatch``, ``_host_empty`` (result tensors)
    and ``validate_dispatch``."""

    def _open_buffers(self, group, transport: str, rows: str, sizes, kernels: str, timeout: float, hint: str):
        """Make ``self.buffer`` (``transport`` over the whole group; for :data:`HIERARCHICAL`, the flat transport
        of ``PARTS[rows]`` with regions for the agreements and the low-latency mode only) and ``self._hier``; set
        ``transport``, ``region_bytes`` and the device kernels' ``_kernel_mode`` / ``_kernel_layout``."""
        self._hier = None
        if transport == HIERARCHICAL:
            n_ll, n = self.num_max_dispatch_tokens_per_rank, self.num_max_tokens_per_rank
            self.region_bytes = flat_region(sizes, self.hidden, self.num_topk, self.num_local_experts, n_ll)
            parts = PARTS[rows]
            self._hier = Hierarchy(group, self.hosts, self.hidden, self.num_topk, n, timeout, parts, hint)
            transport = parts[0]
        try:
            self._kernel_mode, self._kernel_layout = self._kernel_area(kernels, transport, group)
            num_bytes = self.region_bytes * self.world_size + self._kernel_layout.get("total", 0)
            self.result_slots = None
            count = result_slot_count()
            if transport == "shm" and not self._kernel_layout and count:  # normal-mode results written by senders
                cap, h = self.world_size * self.num_max_tokens_per_rank, self.hidden
                self.result_slots = ResultSlots(num_bytes, count, cap, 4 * h, 4 * -(-h // 128))
                num_bytes += self.result_slots.nbytes
                hint += (
                    f"; {count} result slots add {self.result_slots.nbytes} bytes (every row a rank can receive, "
                    f"world_size * num_max_tokens_per_rank, each; EPKIT_RESULT_SLOTS=0 turns them off)"
                )
            self.buffer = SymmBuffer(group, num_bytes, transport=transport, timeout=timeout, memory_hint=hint)
            if self.result_slots is not None:
                self.result_slots.buffer = self.buffer
        except BaseException:
            if self._hier is not None:
                self._hier.close()
            raise
        if self._hier is not None:
            self.transport = f"{HIERARCHICAL}({self._hier.intra.transport}+{self._hier.rail.transport})"
        else:
            self.transport = self.buffer.transport

    def bytes_across_hosts(self) -> int:
        """Bytes this rank has sent to ranks on other hosts (NVLink domains) through this EPBuffer so far: the
        flat buffer's messages to ranks of other hosts and every rail message to another host - headers and
        payloads on ``torch``, the payloads put with a signal on ``nvshmem`` (its peer views stay inside a
        domain). 0 on ``shm``. Sum over the ranks for a job's."""
        host_of = {r: h for h, g in enumerate(self.hosts) for r in g}
        me = host_of[self.rank]
        sent = getattr(self.buffer.impl, "bytes_sent", None) or []
        total = sum(b for r, b in enumerate(sent) if host_of[r] != me)
        if self._hier is not None:
            total += sum(self._hier.rail.impl.bytes_sent)  # its own slot (a local copy) stays 0
        return total

    @contextlib.contextmanager
    def _hier_retire(self, what: str):
        """As ``retire_on_failure``, for the three buffers of a hierarchical call (the peers are told on each)."""
        try:
            yield
        except BaseException as exc:
            reason = f"{what} failed on rank {self.rank}: {type(exc).__name__}: {exc}"
            for buf in (self.buffer, *self._hier.buffers()):
                buf.mark_broken(reason, culprit=buf.rank)
            if type(exc) is TimeoutError:  # the sub-buffers name ranks by their place in them: say which those are
                hy = self._hier
                where = f"intra ranks are group ranks {hy.hosts[hy.host]}, rail ranks are group ranks {hy.rail_ranks}"
                raise TimeoutError(f"{exc} ({where})") from exc
            raise

    def _hier_dispatch(self, error, x, scales, topk_idx, topk_weights, alignment: int, expand: bool):
        """Normal dispatch through the hierarchy; ``error``: this rank's validation verdict (None: valid)."""
        hy, w, me = self._hier, self.world_size, self.rank
        rows, state = [], {}
        slots = hy.result_slots
        slot = slots.take() if slots is not None else -1
        try:  # until the agreement no row moves: the slot was never written, whatever fails
            if error is None:
                topk_idx = topk_idx.cpu()
                weights = torch.zeros(topk_idx.shape) if topk_weights is None else topk_weights.cpu()
                per_rank, _, in_rank = self.get_dispatch_layout(topk_idx)
                in_host = torch.stack([in_rank[:, g].any(1) for g in hy.hosts], 1)
                tokens = [in_rank[:, r].nonzero().flatten() for r in range(w)]
                state["host_tokens"] = [in_host[:, H].nonzero().flatten() for H in range(hy.num_hosts)]
                state["in_host"] = in_host
                fmt = format_code(x.dtype, scales is not None)
                per_rank, per_host = per_rank.tolist(), in_host.sum(0).tolist()
                rows = [torch.tensor([fmt, per_rank[r], per_host[hy.host_of[r]], slot, *per_rank]) for r in range(w)]
            # Word 1: rows for that rank, word 2: rows for its host (its rail peer's receive), word 3: the sender's
            # result slot (-1: none), then the rows it sends each rank (where a forwarder's rows start in a result).
            got = self._agree_rows(error, rows, 4 + w)  # a bad call fails here, on every rank
            check_formats([int(g[0]) for g in got])
        except BaseException:
            if slots is not None:
                slots.give_back(slot)
            raise
        recv_counts = [int(g[1]) for g in got]
        state["rail_counts"] = [int(got[r][2]) for r in hy.rail_ranks]
        matrix = torch.stack([g[4:] for g in got])  # [source, destination] rows
        place = [(int(got[r][3]), matrix[:, r]) for r in hy.hosts[hy.host]]  # per rank of this host
        meta = (topk_idx.to(torch.int32), weights.float())
        with self._hier_retire("dispatch"):  # peers may write into the announced slot now: a failure retires
            if matrix[:, me].tolist() != recv_counts:
                raise RuntimeError(f"rank {me}: the layout messages disagree on the rows sent here")
            recv_x, recv_s, recv_i, recv_w = self._hier_move(x, scales, meta, state, recv_counts, place)
        recv_i, recv_w = recv_i.cpu().to(topk_idx.dtype), recv_w.cpu()  # the routing stays on the host
        out = self._finish_dispatch(recv_x, recv_s, recv_i, recv_w, tokens, recv_counts, x.shape[0], expand, alignment)
        handle = out[4]
        handle = HierDispatchHandle(**{f.name: getattr(handle, f.name) for f in fields(handle)}, hier=state)
        return (*out[:4], handle)

    def _hier_dispatch_cached(self, x, scales, handle):
        """A dispatch along an earlier one's routing (``handle``): rows and scales only cross hosts."""
        error = None
        try:
            if not isinstance(handle, DispatchHandle):
                raise ValueError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
            t = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
            no_routing = torch.zeros((t, self.num_topk), dtype=torch.int64)
            self.validate_dispatch(x, scales, no_routing, None, self.num_max_tokens_per_rank)
            if t != handle.num_tokens:
                raise ValueError(f"cached dispatch: x has {t} tokens, the handle was made for {handle.num_tokens}")
        except Exception as exc:  # noqa: BLE001 -- every rank must learn of it in the agreement
            error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        self.agree_on_handle("cached dispatch", handle, error)  # a handle of another buffer is rejected here
        with self._hier_retire("cached dispatch"):
            recv_x, recv_s, _, _ = self._hier_move(x, scales, None, handle.hier, handle.recv_counts)
        if handle.expand:
            from epkit.gather import gather_rows

            picked = handle.expanded_rows.to(self.device)
            recv_x = gather_rows(recv_x, picked)
            recv_s = None if recv_s is None else gather_rows(recv_s, picked)
        ids = handle.recv_topk_idx
        per_expert = torch.bincount(ids[ids >= 0].long(), minlength=self.num_local_experts).tolist()
        a = handle.expert_alignment
        x_out = recv_x if recv_s is None else (recv_x, recv_s)
        aligned = [-(-c // a) * a for c in per_expert]
        return x_out, ids.to(self.device), handle.recv_topk_weights.to(self.device), aligned, handle

    def _hier_move(self, x, scales, meta, state: dict, recv_counts: list[int], place=None):
        """Rows over the rail, then forwarded inside the host. ``meta``: (global ids int32, weights float32)
        ``[T, K]`` of a dispatch (the routing is then found from them and stored in ``state``), or None for a
        cached dispatch (``state`` holds it); ``place``: per rank of this host, its result slot (-1: none) and
        the rows each source sends it (None: no slots). Returns (recv_x, recv_scales, recv_idx int32, recv_w)
        in the flat order (the last two None without ``meta``)."""
        h, K = self.hidden, self.num_topk
        xb = x.element_size() * h
        cols = [x.contiguous().view(torch.uint8).view(x.shape[0], xb)]
        if scales is not None:
            cols.append(scales.contiguous().view(torch.uint8).view(x.shape[0], 4 * scales.shape[1]))
        if meta is not None:  # the routing (host tensors) travels with the rows, in their memory
            cols += [m.to(x.device).contiguous().view(torch.uint8).view(x.shape[0], 4 * K) for m in meta]
        widths = [c.shape[1] for c in cols]
        rail, got = self._hier_rail_send(cols, widths, state)
        if meta is not None:
            state["hit"] = self._hier_hits(got)
        outs = self._hier_forward(got, widths, state, recv_counts, meta is not None, place)
        rail.release()
        total = sum(recv_counts)
        recv_x = outs[0].view(x.dtype).view(total, h)
        recv_s = outs[1].view(torch.float32).view(total, scales.shape[1]) if scales is not None else None
        if meta is None:
            return recv_x, recv_s, None, None
        recv_i, recv_w = (outs[-2 + i].view(dt).view(total, K) for i, dt in enumerate((torch.int32, torch.float32)))
        return recv_x, recv_s, recv_i, recv_w

    def _hier_rail_send(self, cols, widths: list[int], state: dict):
        """Each other host's tokens (``state["host_tokens"]``) to this rank's rail peer there, every field block
        by index_select into the staging region; this host's own tokens take no message (they are read where
        they are). Returns the open exchange and, per rail peer, ``(fields, rows)``: the received field views
        (``[rows, width]`` uint8 each) and None, or for this host the sender's fields and the row of each."""
        hy = self._hier
        ex = hy.rail.exchange(hy.rail_region, tag="dispatch rail")
        for step in range(1, hy.num_hosts):
            H = (hy.host + step) % hy.num_hosts
            t = state["host_tokens"][H].to(cols[0].device)
            n = t.numel()
            offs, end = field_offsets(n, widths)
            if n:
                region = ex.send_region(H)
                for c, wd, o in zip(cols, widths, offs):
                    torch.index_select(c, 0, t, out=region[o : o + n * wd].view(n, wd))
            ex.commit(H, end if n else 0)
        ex.commit(hy.host, 0)
        counts = state["rail_counts"]
        sizes = [field_offsets(n, widths)[1] if n and hy.host != H else 0 for H, n in enumerate(counts)]
        views = ex.receive(sizes)
        got = [
            (cols, state["host_tokens"][H])
            if hy.host == H
            else ([v[o : o + n * wd].view(n, wd) for o, wd in zip(field_offsets(n, widths)[0], widths)], None)
            for H, (v, n) in enumerate(zip(views, counts))
        ]
        return ex, got

    def _hier_hits(self, got) -> list[torch.Tensor]:
        """Per rail peer, ``[rows, P]`` bool: which ranks of this host hold one of each received row's experts."""
        hy, K, L = self._hier, self.num_topk, self.num_local_experts
        out = []
        for fields_, rows in got:
            ids = fields_[-2] if rows is None else fields_[-2].index_select(0, rows.to(fields_[-2].device))
            ids = ids.view(torch.int32).view(-1, K).long()
            rank_of = torch.where(ids >= 0, ids // L, -1)
            out.append(torch.stack([(rank_of == r).any(1) for r in hy.hosts[hy.host]], 1).cpu())
        return out

    def _hier_put(self, field, rows, sel, out, to_rank: int | None) -> None:
        """Received rows ``sel`` of one field (``rows``: None, or the field's row of each received row) into
        ``out`` (``[k, width]`` uint8); ``to_rank``: the global ids field becomes that rank's local ids (-1
        elsewhere); None: the bytes as they are."""
        if rows is not None:
            sel = rows.index_select(0, sel)
        sel = sel.to(field.device)
        if to_rank is None:
            torch.index_select(field, 0, sel, out=out)
            return
        K, L = self.num_topk, self.num_local_experts
        ids = field.view(torch.int32).view(-1, K).index_select(0, sel).long()
        loc = torch.where((ids >= 0) & (ids // L == to_rank), ids - to_rank * L, -1)
        out.view(torch.int32).view(-1, K).copy_(loc)

    def _hier_forward(self, got, widths: list[int], state: dict, recv_counts: list[int], with_meta: bool, place):
        """Forward the rail rows to the ranks of this host (``state["hit"]``), then place what this rank gets
        from every forwarder in the flat order (what it forwards to itself straight from the rail views, or from
        the sender's own fields for its own host's tokens: no region between); returns one ``[R, width]`` uint8
        tensor per field. A receiver with a result slot (``place``, see ``_hier_move``) gets the x and scale rows
        written straight into it, in the flat order; the other fields (and every field without a slot) travel
        through the region and are copied out."""
        hy = self._hier
        id_f = len(widths) - 2 if with_meta else -1
        n_rows = len(widths) - (2 if with_meta else 0)  # the x (and scale) fields: a slot takes these
        no_slot = (-1, None)
        ex = hy.intra.exchange(hy.intra_region, tag="dispatch intra")
        for step in range(1, hy.per_host):
            lp = (hy.local + step) % hy.per_host
            dst = hy.hosts[hy.host][lp]
            slot, rows_from = place[lp] if place is not None else no_slot
            in_region = list(range(n_rows if slot >= 0 else 0, len(widths)))
            sels = [hit[:, lp].nonzero().flatten() for hit in state["hit"]]
            m = sum(sel.numel() for sel in sels)
            offs, end = field_offsets(m, [widths[f] for f in in_region])
            region, row = (ex.send_region(lp) if m else None), 0
            for (src_fields, src_rows), sel, source in zip(got, sels, hy.rail_ranks):
                k = sel.numel()
                if rows_from is not None and k != int(rows_from[source]):
                    raise RuntimeError(
                        f"rank {self.rank}: forwards {k} rows of rank {source} to rank {dst}, the "
                        f"layout agreement said {int(rows_from[source])}"
                    )
                if not k:
                    continue
                first = int(rows_from[:source].sum()) if slot >= 0 else 0  # where source's rows start in dst's
                for f, wd in enumerate(widths):
                    if f < n_rows and slot >= 0:  # straight into dst's result
                        view = hy.result_slots.area(lp, slot, f, first, k, wd)
                    else:
                        o = offs[in_region.index(f)]
                        view = region[o + row * wd : o + (row + k) * wd].view(k, wd)
                    self._hier_put(src_fields[f], src_rows, sel, view, dst if f == id_f else None)
                row += k
            ex.commit(lp, end if m else 0)
        ex.commit(hy.local, 0)
        slot = place[hy.local][0] if place is not None else -1
        in_region = list(range(n_rows if slot >= 0 else 0, len(widths)))
        blocks = [[g[lf] for g in hy.hosts] for lf in range(hy.per_host)]  # forwarder lf's sources, by host
        sizes = [0 if lf == hy.local else sum(recv_counts[s] for s in b) for lf, b in enumerate(blocks)]
        views = ex.receive([field_offsets(m, [widths[f] for f in in_region])[1] if m else 0 for m in sizes])
        starts = [0]
        for c in recv_counts:
            starts.append(starts[-1] + c)
        outs = []  # with a slot: its x (and scale) rows first, then the fields that came through the regions
        if slot >= 0:
            sb = widths[1] if n_rows == 2 else 0
            outs = [o for o in hy.result_slots.results(slot, starts[-1], widths[0], sb) if o is not None]
        outs += [self._host_empty((starts[-1], widths[f]), torch.uint8) for f in in_region]
        for (src_fields, src_rows), hit, s in zip(got, state["hit"], blocks[hy.local]):  # this rank's own forwards
            sel = hit[:, hy.local].nonzero().flatten()
            for f, dst_t in enumerate(outs):
                to_rank = self.rank if f == id_f else None
                self._hier_put(src_fields[f], src_rows, sel, dst_t[starts[s] : starts[s + 1]], to_rank)
        for lf, (v, b, m) in enumerate(zip(views, blocks, sizes)):
            offs, _ = field_offsets(m, [widths[f] for f in in_region])
            row = 0
            for s in b if lf != hy.local else ():
                n = recv_counts[s]
                for f, o in zip(in_region, offs):
                    wd = widths[f]
                    outs[f][starts[s] : starts[s] + n].copy_(v[o + row * wd : o + (row + n) * wd].view(n, wd))
                row += n
        ex.release()
        return outs

    def _hier_combine_intra(self, y, handle, weights):
        """Combine's first step: each rank's rows (expanded: its partial per received row, its local experts, k
        ascending, cast) to the rank that forwarded them; returns the open exchange and, per rank of this host,
        the ``[rows, hidden]`` rows it sent back here in this rank's forwarding order, with ``remap`` (the rows of
        ``y`` standing for this rank's own, which take no region; None when they are a partial of their own)."""
        hy, h = self._hier, self.hidden
        rb = h * y.element_size()
        ex = hy.intra.exchange(hy.intra_region, tag="combine intra")
        starts = [0]
        for c in handle.recv_counts:
            starts.append(starts[-1] + c)
        y_bytes = y.view(torch.uint8).view(-1, rb)
        own = remap = None
        for step in range(hy.per_host):
            lf = (hy.local + step) % hy.per_host
            rows = torch.cat([torch.arange(starts[g[lf]], starts[g[lf] + 1]) for g in hy.hosts])
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
                own, remap = y, rows
            ex.commit(lf, 0 if lf == hy.local else m * rb)
        hits = handle.hier["hit"]
        sizes = [0 if lp == hy.local else int(sum(hit[:, lp].sum() for hit in hits)) * rb for lp in range(hy.per_host)]
        views = ex.receive(sizes)
        sources = [v.view(y.dtype).view(-1, h) for v in views]
        sources[hy.local] = own if own is not None else y[:0]
        return ex, sources, remap

    def _hier_combine(self, y, handle, weights, biases) -> torch.Tensor:
        """Rows back to their forwarders, host partials over the rail, the last sum at the source (the module
        docstring's order); ``weights``: the expanded mode's (None otherwise)."""
        hy, st, h, N = self._hier, handle.hier, self.hidden, self._hier.num_hosts
        y = y.contiguous()
        rb = h * y.element_size()
        ex, sources, remap = self._hier_combine_intra(y, handle, weights)
        rail = hy.rail.exchange(hy.rail_region, tag="combine rail")
        base = torch.zeros(hy.per_host, dtype=torch.int64)
        order = []  # per rail peer: (src_of, row_of) into the rows each rank of this host sent back
        for hit in st["hit"]:
            row_of = (base + hit.long().cumsum(0) - 1).clamp(min=0)
            if remap is not None and remap.numel():  # this rank's own: rows of y
                row_of[:, hy.local] = remap[row_of[:, hy.local].clamp(max=remap.numel() - 1)]
            order.append((torch.where(hit, torch.arange(hy.per_host), -1), row_of))
            base = base + hit.long().sum(0)
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
        own = order[hy.host] if st["rail_counts"][hy.host] else None
        src_of, row_of, groups = last_sum_layout(st["in_host"], hy.host, hy.per_host, own)
        out = self._host_empty((handle.num_tokens, h), y.dtype)
        reduce_indexed(out, parts, src_of, row_of, None, biases, groups)
        ex.release()  # the rows the peers sent back were read in place
        rail.release()
        return out
