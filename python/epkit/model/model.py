"""One rank of the reference model: :class:`DPEPModel`, DP attention + Wide-EP on epkit's ops.

Attention and the dense layers run on this rank's own sequences (:mod:`epkit.model.layers`); each
MoE layer is a collective over the EP group (EPBuffer's normal or low-latency dispatch/combine,
fused_moe, or the textbook exchange of :mod:`epkit.collectives.ep_reference`); the Engram rows come
from ENP-sharded tables (:class:`epkit.ShardedEngramTable`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epkit import eplb
from epkit.collectives.cp_group import CPGroup
from epkit.collectives.engram_table import ShardedEngramTable
from epkit.collectives.ep_buffer import EPBuffer
from epkit.collectives.ep_reference import reference_combine, reference_dispatch
from epkit.collectives.fused_moe import fused_moe
from epkit.engram import hash_tokens
from epkit.experts import ExpertPlacement, logical_to_physical
from epkit.model.args import ModelArgs, engram_config, engram_layer, init_weights, quantize_experts
from epkit.model.cp_prefill import cp_prefill
from epkit.model.layers import Batch, attention, check_batch, logits, rms_norm, route, swiglu_mlp
from epkit.model.profile import NULL_TIMER
from epkit.model.tbo import tbo_decode
from epkit.moe import expert_mlp
from epkit.quant import per_token_group_cast_to_fp8
from epkit.utils import ROW_ALIGN

__all__ = ["DPEPModel"]

#: Fewest rows an Engram layer runs on (see :meth:`DPEPModel.engram_apply`).
_ENGRAM_MIN_ROWS = 32


@dataclass
class _SeqCache:
    """What a running sequence keeps between steps: each layer's keys and values, and for the Engram
    layers the last ``N - 1`` token ids (the next n-grams) and the last rows of their inputs (the
    causal convolution's window)."""

    kv: list
    tokens: list
    engram: dict

    @classmethod
    def new(cls, num_layers: int) -> _SeqCache:
        return cls([None] * num_layers, [], {})

    def copy(self) -> _SeqCache:
        return _SeqCache(list(self.kv), list(self.tokens), dict(self.engram))


def _check_options(
    groups, prefill_moe: str, decode_moe: str, max_tokens_per_rank, max_decode_tokens_per_rank, expert_alignment
) -> None:
    """:class:`DPEPModel`'s argument checks, before anything is built."""
    if prefill_moe not in ("auto", "normal", "fused", "reference"):
        raise ValueError(f"prefill_moe must be 'auto', 'normal', 'fused' or 'reference', got {prefill_moe!r}")
    if decode_moe not in ("low_latency", "normal", "reference"):
        raise ValueError(f"decode_moe must be 'low_latency', 'normal' or 'reference', got {decode_moe!r}")
    for name, v in (
        ("max_tokens_per_rank", max_tokens_per_rank),
        ("max_decode_tokens_per_rank", max_decode_tokens_per_rank),
        ("expert_alignment", expert_alignment),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if groups.sizes["enp"] > groups.sizes["dp"] * groups.sizes["cp"]:
        raise ValueError(
            f"enp_size {groups.sizes['enp']} > dp_size * cp_size: the model has no ranks that only hold Engram rows"
        )


class DPEPModel:
    """The model on one rank of a DP attention + Wide-EP deployment.

    Parameters
    ----------
    args : ModelArgs
    groups : epkit.topology.ParallelGroups
        This rank's groups: ``ParallelGroups.create(dp_size=world // cp, cp_size=cp)``, EP over every rank,
        ENP any divisor of ``dp * cp``. With ``cp > 1`` a prefill runs context-parallel over the CP group
        (:func:`epkit.model.cp_prefill.cp_prefill`: every CP rank of an engine passes the same prompt batch); decode
        is never context-parallel (each CP rank decodes its own share of the engine's sequences, see
        :func:`generate`).
        Rows live on the EP buffer's device: CPU for ``shm`` / ``torch``, the current GPU for
        ``nvshmem`` (which also runs over gloo groups, e.g. ``device="cpu"`` groups on GPU ranks).
    weights : dict, optional
        :func:`init_weights` output (default: built from ``args.seed``). Each rank keeps the dense
        weights and its own experts on the rows' device, and every expert's quantized weights in host
        memory to reload after a rebalance.
    transport : str
        EPBuffer transport (``"auto"``: shm for CPU ranks on one host, nvshmem on GPUs).
    prefill_moe : {"auto", "normal", "fused", "reference"}
        ``auto``: ``fused`` where every EP peer is directly addressable, else ``normal``.
        ``reference``: the textbook exchange (:mod:`epkit.collectives.ep_reference`, two
        ``all_to_all_single`` per direction; bf16 rows on the wire, quantized at the experts), the
        same result as ``normal`` bit for bit: the peer the benchmark measures EPBuffer against.
    decode_moe : {"low_latency", "normal", "reference"}
    max_tokens_per_rank : int
        Prefill capacity: tokens one rank may bring to one forward.
    max_decode_tokens_per_rank : int
        Low-latency capacity: sequences one rank may decode in one step.
    min_num_extra_experts : int
        Redundant expert slots (padded so every rank holds as many; see
        :func:`epkit.experts.resolve_num_extra_experts`).
    expert_alignment : int
        Rows per expert group in the contiguous layout are padded to this.
    timeout : float
        Seconds any wait on a peer may take.
    tbo : bool
        Two-batch overlap in decode (:func:`epkit.model.tbo.tbo_decode`): each step's batch runs as two
        micro-batches whose low-latency dispatch / combine overlap the other's attention and experts; the
        outputs are bit for bit those without it. Needs ``decode_moe="low_latency"``.

    Every rank must construct it with the same arguments and call :meth:`forward` with the same
    ``is_prompt`` in the same steps (what :func:`generate` arranges): each MoE layer is a collective.
    """

    def __init__(
        self,
        args: ModelArgs,
        groups,
        *,
        weights: dict | None = None,
        transport: str = "auto",
        prefill_moe: str = "auto",
        decode_moe: str = "low_latency",
        max_tokens_per_rank: int = 256,
        max_decode_tokens_per_rank: int = 32,
        min_num_extra_experts: int = 0,
        expert_alignment: int = 128,
        timeout: float = 30.0,
        tbo: bool = False,
    ):
        if tbo and decode_moe != "low_latency":
            raise ValueError(f"tbo needs decode_moe='low_latency' (its receive hooks), got {decode_moe!r}")
        _check_options(
            groups, prefill_moe, decode_moe, max_tokens_per_rank, max_decode_tokens_per_rank, expert_alignment
        )
        self.args, self.groups = args, groups
        weights = init_weights(args) if weights is None else weights
        self.ep_size, self.ep_rank = groups.sizes["ep"], groups.ep_rank
        self.cp_size, self.cp_rank, self.tbo = groups.sizes["cp"], groups.cp_rank, tbo
        #: The CP group (:class:`epkit.collectives.cp_group.CPGroup`) when ``cp_size > 1``, else None.
        self.cp = CPGroup.from_parallel_groups(groups, timeout) if self.cp_size > 1 else None
        self.expert_alignment = expert_alignment
        self.max_decode_tokens_per_rank = max_decode_tokens_per_rank
        placement = ExpertPlacement.default(args.n_routed_experts, self.ep_size, min_num_extra_experts)
        self.placements = [placement] * args.n_moe_layers
        self.buffer = EPBuffer(
            groups.ep_group,
            args.dim,
            placement.num_physical,
            max_tokens_per_rank,
            args.n_activated_experts,
            transport=transport,
            num_max_dispatch_tokens_per_rank=max_decode_tokens_per_rank,
            timeout=timeout,
        )
        #: Where activations and weights live: the EP buffer's rows' device (the GPU for nvshmem,
        #: whatever the groups' backend; control messages always go over the gloo groups).
        self.device = self.buffer.device
        if "reference" in (prefill_moe, decode_moe) and self.device.type != "cpu":
            raise ValueError("the textbook exchange (prefill_moe / decode_moe 'reference') runs on CPU rows only")
        if prefill_moe == "auto":
            prefill_moe = "fused" if self.buffer.is_within_domain() else "normal"
        self.prefill_moe, self.decode_moe = prefill_moe, decode_moe
        experts = {}
        self.weights = {}
        for name, t in weights.items():
            if ".experts_" in name:
                experts[name] = t  # every logical expert: kept on the CPU to reload after a rebalance
            elif ".engram" not in name:
                self.weights[name] = t.to(self.device)
        self._init_engram(weights, timeout)
        self._all_experts = {n: quantize_experts(t, args.expert_format) for n, t in experts.items()}
        self._load_local_experts()
        #: Tokens this rank routed to each physical expert, per MoE layer, since the last rebalance
        #: (counted on the rows' device, no host sync; :meth:`expert_load` sums them over the EP group).
        self.routed_load = torch.zeros(args.n_moe_layers, placement.num_physical, dtype=torch.int64, device=self.device)
        #: Running sequences' state (``seq_id -> _SeqCache``); :meth:`release` drops one.
        self.cache: dict = {}
        #: Set True to keep each forward's gate choices in :attr:`last_routing` (logical ids, one
        #: ``[T, K]`` tensor per MoE layer), e.g. to replay them in :func:`forward_reference`.
        self.record_routing = False
        self.last_routing: list = []
        #: Where each forward reports its stages' time (:class:`epkit.model.profile.StepTimer`); by default
        #: nothing is timed.
        self.timer = NULL_TIMER

    def _init_engram(self, weights: dict, timeout: float) -> None:
        """Build the Engram layers and load this rank's part of each layer's table (collective over ENP)."""
        args = self.args
        #: Engram layers (by layer index) and their ENP-sharded tables (bf16 rows in CPU memory, as the
        #: source engine keeps its 400M-row tables; rows are fetched before the first layer).
        self.engram, self.engram_tables = {}, {}
        for i in args.engram_layer_ids:
            self.engram[i] = engram_layer(args, weights, i, torch.float32, self.device)
            full = weights[f"layers.{i}.engram_table"]
            table = ShardedEngramTable(full.shape[0], full.shape[1], group=self.groups, timeout=timeout)
            lo = min(table.row_start, full.shape[0])  # a part may hold padding rows only
            hi = min(table.row_start + table.num_per_part, full.shape[0])
            if lo < hi:
                table.load_rows(lo, full[lo:hi])
            self.engram_tables[i] = table
        self.engram_config = engram_config(args) if args.engram_layer_ids else None

    # experts

    def _load_local_experts(self) -> None:
        self.local_experts = []
        for m, placement in enumerate(self.placements):
            p = f"layers.{m + self.args.n_dense_layers}.experts_"
            ids = placement.local_experts(self.ep_rank).long()
            pair = []
            for kind in ("w13", "w2"):
                full = self._all_experts[p + kind]
                pair.append(
                    tuple(t[ids].to(self.device) for t in full)
                    if isinstance(full, tuple)
                    else full[ids].to(self.device)
                )
            self.local_experts.append(tuple(pair))
        self._placements_dev = [pl.to(self.device) for pl in self.placements]

    def expert_load(self) -> torch.Tensor:
        """Tokens routed to each logical expert since the last rebalance, ``[n_moe_layers, E]`` int64.

        Collective over the EP group: every rank's routed counts, summed (what each physical expert
        received), folded through each layer's ``phy2log``; equal on every rank.
        """
        physical = self.routed_load.to("cpu", copy=True)  # all_reduce works in place
        dist.all_reduce(physical, group=self.groups.cpu_groups["ep"])
        out = torch.zeros(self.args.n_moe_layers, self.args.n_routed_experts, dtype=torch.int64)
        for m, placement in enumerate(self.placements):
            out[m].index_add_(0, placement.phy2log.long(), physical[m])
        return out

    def rebalance(self) -> list[ExpertPlacement]:
        """EPLB: place the experts (and their replicas) by the load measured since the last rebalance.

        Collective over the EP group. Each layer's new placement comes from
        :func:`epkit.eplb.rebalance_experts` (one node, the gate's expert groups); every rank then
        holds the experts of its new slots. Returns the new placements.
        """
        load = self.expert_load()
        num_physical = self.placements[0].num_physical
        groups = self.args.n_expert_groups
        phy2log, _, _ = eplb.rebalance_experts(load, num_physical, groups, 1, self.ep_size)
        self.placements = [
            ExpertPlacement.from_phy2log(phy2log[m].to(torch.int32), self.args.n_routed_experts, self.ep_size)
            for m in range(self.args.n_moe_layers)
        ]
        self._load_local_experts()
        self.routed_load.zero_()
        return self.placements

    # forward

    def moe_route(self, m: int, x: torch.Tensor, count_load: bool):
        """MoE layer ``m``'s work before the dispatch: ``(physical ids [T, K], weights [T, K], shared expert
        output or None)``; the routed tokens are counted as load when ``count_load``."""
        args, p, w, timer = self.args, f"layers.{m + self.args.n_dense_layers}.", self.weights, self.timer
        with timer("gate"):
            idx, weights = route(args, x, w[p + "gate"], w[p + "gate_bias"])
        if self.record_routing:
            self.last_routing.append(idx)
        # the gate's ids are valid by construction: no check_index (it reads them on the host)
        with timer("logical_to_physical"):
            phys = logical_to_physical(
                idx, self._placements_dev[m], self.ep_rank, token_offset=self.ep_rank, check_index=False
            )
        if count_load:  # a placeholder's traffic is not load: EPLB would replicate experts for it
            flat = phys.reshape(-1).long()
            self.routed_load[m].index_add_(0, flat.clamp(min=0), (flat >= 0).long())
        with timer("shared_expert"):
            shared = swiglu_mlp(x, w[p + "shared_w13"], w[p + "shared_w2"]) if args.n_shared_experts else None
        return phys, weights, shared

    @property
    def uses_fp8(self) -> bool:
        """Whether the MoE input goes out as FP8 (FP8 and FP4 experts: FP4 ones take FP8 activations)."""
        return self.args.expert_format in ("fp8", "fp4")

    @staticmethod
    def add_shared(out: torch.Tensor, shared) -> torch.Tensor:
        """A low-latency combine's bf16 output plus the shared expert, rounded to bf16 once (as combine's bias
        is on the other paths), as float32."""
        out = out.float()
        return out if shared is None else (out + shared.to(torch.bfloat16).float()).to(torch.bfloat16).float()

    def moe(self, m: int, x: torch.Tensor, is_prompt: bool, count_load: bool) -> torch.Tensor:
        """MoE layer ``m`` on this rank's rows ``x [T, D]`` (collective over the EP group): float32 ``[T, D]``."""
        phys, weights, shared = self.moe_route(m, x, count_load)
        timer = self.timer
        xb = x.to(torch.bfloat16)
        w13, w2 = self.local_experts[m]
        fp8 = self.uses_fp8
        mode = self.prefill_moe if is_prompt else self.decode_moe
        if mode == "low_latency":
            n_max = self.max_decode_tokens_per_rank
            with timer("dispatch"):
                recv, count, handle, _ = self.buffer.low_latency_dispatch(xb, phys, n_max, use_fp8=fp8)
            with timer("experts"):
                y = expert_mlp(recv, "masked", w13, w2, masked_m=count, expected_m=max(1, n_max))
            with timer("combine"):
                out = self.buffer.low_latency_combine(y, phys, weights, handle)
            # the layer's output is bf16 on every path (combine adds the shared expert before rounding)
            return self.add_shared(out, shared)
        bias = None if shared is None else shared.to(torch.bfloat16)
        if mode == "fused":
            with timer("fused_moe"):
                a = self.expert_alignment
                out = fused_moe(xb, phys, weights, w13, w2, self.buffer, bias=bias, expert_alignment=a)
        elif mode == "reference":
            group, num_physical = self.buffer.group, self.buffer.num_experts
            with timer("dispatch"):
                st = reference_dispatch(
                    xb, phys, weights, num_physical, group, expand=True, expert_alignment=self.expert_alignment
                )
            with timer("experts"):
                y = expert_mlp(st["expanded_x"], "contiguous", w13, w2, m_indices=st["m_indices"])
            with timer("combine"):
                out = reference_combine(y, st, xb.shape[0], group, bias=bias, expand=True)
        else:
            with timer("dispatch"):
                inp = per_token_group_cast_to_fp8(xb) if fp8 else xb
                recv, _, _, _, handle = self.buffer.dispatch(
                    inp, phys, weights, expert_alignment=self.expert_alignment, expand=True
                )
            with timer("experts"):
                y = expert_mlp(recv, "contiguous", w13, w2, m_indices=EPBuffer.m_indices(handle))
            with timer("combine"):
                out = self.buffer.combine(y, handle, bias=bias)
        return out.float()

    def start_step(self, batch: Batch) -> None:
        """A step's checks and cache set-up: a prompt starts its sequence afresh, a decode row must continue
        a cached one."""
        check_batch(self.args, batch)
        cus = batch.cu_seqlens.tolist()
        for s, sid in enumerate(batch.seq_ids):
            if sid is None:
                continue
            if batch.is_prompt:
                self.cache[sid] = _SeqCache.new(self.args.n_layers)
                continue
            st = self.cache.get(sid)
            cached = st.kv[0][0].shape[0] if st is not None and st.kv[0] is not None else None
            if cached is None or int(batch.positions[cus[s]]) != cached:
                raise ValueError(
                    f"batch: decode of sequence {sid!r} at position {int(batch.positions[cus[s]])}, but this rank "
                    f"holds {'no prefill of it' if cached is None else f'{cached} cached tokens'}"
                )
        self.last_routing = []

    def run_layers(self, x: torch.Tensor, batch: Batch, engram, attend) -> torch.Tensor:
        """Every layer on this rank's rows ``x`` of ``batch``: ``engram(i, x)`` (an Engram layer's output) and
        ``attend(i, h)`` (attention's) are the caller's, so the CP prefill runs the same layers."""
        args, w, timer = self.args, self.weights, self.timer
        for i in range(args.n_layers):
            p = f"layers.{i}."
            if i in self.engram:
                x = x + engram(i, x)
            with timer("attention"):
                x = x + attend(i, rms_norm(x, w[p + "attn_norm"], args.norm_eps))
            h = rms_norm(x, w[p + "ffn_norm"], args.norm_eps)
            if i < args.n_dense_layers:
                with timer("dense_mlp"):
                    x = x + swiglu_mlp(h, w[p + "w13"], w[p + "w2"])
            else:
                x = x + self.moe(i - args.n_dense_layers, h, batch.is_prompt, not batch.is_placeholder)
        return x

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor:
        """One step on this rank (collective over the EP group; a CP prefill also over the CP group).

        Returns
        -------
        Tensor [S, vocab_size] float32: the logits of every sequence's last token.
        """
        self.start_step(batch)
        if batch.is_prompt and self.cp is not None and not batch.is_placeholder:
            return cp_prefill(self, batch)
        if self.tbo and not batch.is_prompt:
            return tbo_decode(self, batch)
        args, w, timer = self.args, self.weights, self.timer
        with timer("engram_fetch"):
            hooks = self.engram_fetch(batch)  # before the first layer: hashes need only the token ids

        def engram(i, x):
            with timer("engram_fetch"):
                rows = hooks[i]()
            with timer("engram_layer"):
                return self.engram_apply(i, x, rows, batch)

        x = w["embed"][batch.token_ids.to(self.device)]
        x = self.run_layers(x, batch, engram, lambda i, h: attention(args, w, f"layers.{i}.", h, batch, self.cache, i))
        with timer("head"):
            return logits(args, w, x, batch)

    # Engram

    def engram_fetch(self, batch: Batch, select: torch.Tensor | None = None) -> dict:
        """Hash every token's n-grams and start fetching its rows of each Engram layer's table:
        ``{layer: hook}``, ``hook()`` waits and gives the rows ``[T, ...]`` (of the tokens ``select`` only,
        when given: a CP rank's share).

        Collective over the ENP group (every rank fetches once per Engram layer, in layer order).
        Decode rows continue their sequence: their n-grams include the cached previous tokens.
        """
        if not self.engram:
            return {}
        cfg = self.engram_config
        ids, cus = batch.token_ids.tolist(), batch.cu_seqlens.tolist()
        toks, cu, keep = [], [0], []
        for s, sid in enumerate(batch.seq_ids):
            st = self.cache.get(sid) if sid is not None else None
            ctx = st.tokens if st is not None else []
            seq = ids[cus[s] : cus[s + 1]]
            keep.extend(range(len(toks) + len(ctx), len(toks) + len(ctx) + len(seq)))
            toks += ctx + seq
            cu.append(len(toks))
            if st is not None:
                st.tokens = (ctx + seq)[-(cfg.max_ngram_size - 1) :]
        rows = hash_tokens(torch.tensor(toks, dtype=torch.int32), torch.tensor(cu), cfg)[:, keep]
        if select is not None:
            rows = rows[:, select.cpu()]
        return {i: self.engram_tables[i].fetch(rows[li]) for li, i in enumerate(cfg.layer_ids)}

    def engram_apply(self, i: int, x: torch.Tensor, emb: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Layer ``i``'s Engram output for this step's rows; decode rows see their sequence's window. The rows
        are padded with a zero sequence to a multiple of ``ROW_ALIGN``, and to at least 32 rows (EngramLayer's
        reductions give other bits for 21..31 rows than for more, measured on the CPU), so a row's bits do not
        depend on the other sequences of the step (as :func:`~epkit.model.layers.linear`)."""
        layer = self.engram[i]
        span = (layer.kernel_size - 1) * layer.dilation  # earlier rows the causal convolution reads
        emb = emb.to(self.device, torch.float32)
        cus = batch.cu_seqlens.tolist()
        hs, es, cu, keep = [], [], [0], []
        for s, sid in enumerate(batch.seq_ids):
            lo, hi = cus[s], cus[s + 1]
            st = self.cache.get(sid) if sid is not None else None
            hist_h, hist_e = st.engram.get(i, (x[:0], emb[:0])) if st is not None else (x[:0], emb[:0])
            h_all, e_all = torch.cat((hist_h, x[lo:hi])), torch.cat((hist_e, emb[lo:hi]))
            keep.extend(range(cu[-1] + hist_h.shape[0], cu[-1] + h_all.shape[0]))
            hs.append(h_all)
            es.append(e_all)
            cu.append(cu[-1] + h_all.shape[0])
            if st is not None:
                keep_from = max(0, h_all.shape[0] - span)
                st.engram[i] = (h_all[keep_from:], e_all[keep_from:])
        pad = max(_ENGRAM_MIN_ROWS, cu[-1] + -cu[-1] % ROW_ALIGN) - cu[-1]
        if pad:
            hs.append(x.new_zeros((pad, *x.shape[1:])))
            es.append(emb.new_zeros((pad, *emb.shape[1:])))
            cu.append(cu[-1] + pad)
        out = layer(torch.cat(hs), embeddings=torch.cat(es), cu_seqlens=torch.tensor(cu))
        return out[torch.tensor(keep, dtype=torch.int64, device=out.device)]

    def release(self, seq_id) -> None:
        """Drop a finished sequence's state (KV cache, Engram window)."""
        self.cache.pop(seq_id, None)

    def close(self) -> None:
        """Free the EP buffer (collective on nvshmem)."""
        self.buffer.close()
