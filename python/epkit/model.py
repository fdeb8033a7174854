"""A thin reference model: a DeepSeek-style MoE decoder run as DP attention + Wide-EP on epkit's ops.

It exists to prove the whole chain end to end, on CPU ranks as on GPUs, not to be fast. One
forward on every DP rank (each rank holds its own sequences; the EP group spans all ranks)::

    tokens -> Engram: hash_tokens -> ShardedEngramTable.fetch (ENP all-to-all, started before layer 0)
           -> embedding -> per layer:
        an Engram layer (``engram_layer_ids``): the fetched rows through EngramLayer, added to the stream
        RMSNorm -> attention over this rank's own sequences (no communication; KV cache per sequence)
        RMSNorm -> dense SwiGLU MLP (the first ``n_dense_layers``), or the MoE layer:
            replicated gate: sigmoid (or softmax) scores + correction bias, group-limited top-k
            -> logical_to_physical (redundant replicas; a replica on the token's own rank first)
            -> prefill "normal": dispatch (FP8, expand) -> expert_mlp (contiguous) -> combine
                                 (+ the shared expert as combine's bias)
               prefill "fused":  fused_moe (MegaMoE-style; bit for bit the "normal" result)
               decode "low_latency": low_latency_dispatch (FP8) -> expert_mlp (masked)
                                 -> low_latency_combine, + the shared expert
    -> RMSNorm -> LM head -> the last token's logits of every sequence.

:func:`generate` is the engine loop around it: :class:`epkit.lockstep.LockstepDriver` (one
all-reduce per step: liveness and the prefill vote), placeholder steps for idle ranks so every
rank enters every dispatch/combine, greedy decoding. :meth:`DPEPModel.rebalance` feeds the tokens
each expert received to :func:`epkit.eplb.rebalance_experts` and moves the experts.

:func:`forward_reference` is the specification: the same model in one process, float64, a plain
per-expert loop over every DP rank's sequences, with the parallel model's quantisation points
(bf16 MoE input, FP8 weights and activations) simulated, and the Engram tables whole. Context
parallelism is not part of this model (the source engine ships it disabled; ``epkit.cp_mirror`` and
``epkit.collectives.cp`` have their own end-to-end tests).

Run ``python -m epkit.model`` for the textbook experiment on CPU ranks.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epkit import eplb
from epkit._details.model_layers import (
    Batch,
    _attention,
    _check_batch,
    _logits,
    _rms_norm,
    _route,
    _swiglu_mlp,
)
from epkit.collectives.engram_table import ShardedEngramTable
from epkit.collectives.ep_buffer import EPBuffer
from epkit.collectives.ep_reference import reference_combine, reference_dispatch
from epkit.collectives.fused_moe import fused_moe
from epkit.engram import EngramConfig, hash_tokens
from epkit.engram_layer import EngramLayer
from epkit.experts import ExpertPlacement, logical_to_physical
from epkit.lockstep import LockstepDriver
from epkit.moe import expert_mlp
from epkit.quant import (
    dequant_per_block_fp8,
    dequant_per_token_group_fp8,
    per_block_cast_to_fp8,
    per_token_group_cast_to_fp8,
)

__all__ = ["ModelArgs", "Batch", "init_weights", "DPEPModel", "generate", "forward_reference"]


@dataclass(frozen=True)
class ModelArgs:
    """Sizes of the model (small defaults: a CPU test runs it in seconds).

    ``dim`` and ``moe_inter_dim`` are multiples of 128 (the FP8 groups); ``n_routed_experts`` is
    divisible by ``n_expert_groups``, of which the gate keeps the best ``n_limited_groups``.
    ``expert_format``: ``"fp8"`` (e4m3 weights, 128x128 block scales, FP8 dispatch) or ``"bf16"``.
    """

    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 3
    n_dense_layers: int = 1
    n_heads: int = 4
    head_dim: int = 32
    inter_dim: int = 512
    moe_inter_dim: int = 128
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    n_activated_experts: int = 4
    n_expert_groups: int = 4
    n_limited_groups: int = 2
    score_func: str = "sigmoid"
    route_scale: float = 2.5
    expert_format: str = "fp8"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = (1,)
    engram_max_ngram: int = 3
    engram_heads_per_ngram: int = 2
    engram_embed_per_ngram: int = 64
    engram_table_size: int = 1009
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "inter_dim", "moe_inter_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not 0 <= self.n_dense_layers < self.n_layers:
            raise ValueError(f"n_dense_layers must be in [0, n_layers={self.n_layers}), got {self.n_dense_layers}")
        if self.dim % 128 or self.moe_inter_dim % 128:
            raise ValueError(f"dim ({self.dim}) and moe_inter_dim ({self.moe_inter_dim}) must be multiples of 128")
        if self.n_expert_groups < 1 or self.n_routed_experts % self.n_expert_groups:
            raise ValueError(
                f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_expert_groups "
                f"({self.n_expert_groups})"
            )
        per_group = self.n_routed_experts // self.n_expert_groups
        if not 1 <= self.n_limited_groups <= self.n_expert_groups:
            raise ValueError(f"n_limited_groups must be in [1, {self.n_expert_groups}], got {self.n_limited_groups}")
        if not 1 <= self.n_activated_experts <= self.n_limited_groups * per_group:
            raise ValueError(
                f"n_activated_experts ({self.n_activated_experts}) must be in [1, {self.n_limited_groups * per_group}]"
                f" (the experts of n_limited_groups={self.n_limited_groups} groups)"
            )
        if self.n_expert_groups > 1 and per_group < 2:
            raise ValueError("group-limited routing scores a group by its best two experts: >= 2 per group")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"score_func must be 'sigmoid' or 'softmax', got {self.score_func!r}")
        if self.expert_format not in ("fp8", "bf16"):
            raise ValueError(f"expert_format must be 'fp8' or 'bf16', got {self.expert_format!r}")
        ids = tuple(self.engram_layer_ids)
        if len(set(ids)) != len(ids) or any(not 0 <= i < self.n_layers for i in ids):
            raise ValueError(f"engram_layer_ids must be distinct layers in [0, {self.n_layers}), got {ids}")
        object.__setattr__(self, "engram_layer_ids", tuple(sorted(ids)))
        if ids:
            engram_config(self)  # EngramConfig checks the Engram sizes

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers


def engram_config(args: ModelArgs) -> EngramConfig:
    """The :class:`epkit.EngramConfig` of the model's Engram layers (hashes of the raw token ids)."""
    return EngramConfig(
        vocab_size=args.vocab_size,
        max_ngram_size=args.engram_max_ngram,
        n_head_per_ngram=args.engram_heads_per_ngram,
        n_embed_per_ngram=args.engram_embed_per_ngram,
        layer_ids=args.engram_layer_ids,
        pad_id=min(2, args.vocab_size - 1),
        seed=args.seed,
        ngram_vocab_sizes=(args.engram_table_size,) * (args.engram_max_ngram - 1),
    )


def _engram_layer(args: ModelArgs, w: dict, i: int, dtype: torch.dtype, device=None) -> EngramLayer:
    """Layer ``i``'s EngramLayer (no table: rows come from the sharded table) with the weights of ``w``."""
    device = torch.device("cpu") if device is None else torch.device(device)
    layer = torch.nn.utils.skip_init(
        EngramLayer, engram_config(args), i, args.dim, with_table=False, device=device, dtype=dtype
    )
    p = f"layers.{i}.engram."
    layer.load_state_dict({n: w[p + n].to(device=device, dtype=dtype) for n, _ in layer.named_parameters()})
    return layer


def init_weights(args: ModelArgs) -> dict[str, torch.Tensor]:
    """Every parameter, float32 on the CPU, from ``args.seed`` (equal on every rank, as in the textbook).

    Keys: ``embed [V, D]``, ``norm [D]``, ``head [V, D]``, and per layer ``i`` under ``layers.{i}.``:
    ``attn_norm``, ``ffn_norm [D]``, ``wq``, ``wk``, ``wv [H*hd, D]``, ``wo [D, H*hd]``; an Engram
    layer's ``engram.<parameter>`` (:class:`epkit.EngramLayer`'s) and ``engram_table [rows, head_dim]``
    (bf16 values); a dense layer
    ``w13 [2*inter, D]`` (gate rows first), ``w2 [D, inter]``; a MoE layer ``gate [E, D]``,
    ``gate_bias [E]``, ``shared_w13 [2*Is, D]``, ``shared_w2 [D, Is]`` (``Is = n_shared * moe_inter``),
    ``experts_w13 [E, 2*I, D]``, ``experts_w2 [E, D, I]``.
    """
    g = torch.Generator().manual_seed(args.seed)
    d, hd = args.dim, args.n_heads * args.head_dim

    def lin(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    def norm():
        return 1 + 0.1 * torch.randn(d, generator=g)

    w = {"embed": torch.randn(args.vocab_size, d, generator=g), "norm": norm(), "head": lin(args.vocab_size, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        w[p + "attn_norm"], w[p + "ffn_norm"] = norm(), norm()
        if i in args.engram_layer_ids:
            shape = EngramLayer(engram_config(args), i, d, with_table=False, device="meta")
            for name, t in shape.named_parameters():
                if name.endswith("norm.weight"):
                    v = 1 + 0.1 * torch.randn(t.shape, generator=g)
                elif name.endswith(".bias"):
                    v = 0.02 * torch.randn(t.shape, generator=g)
                elif name == "conv.weight":
                    v = 0.3 * torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
                else:
                    v = torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
                w[p + "engram." + name] = v
            # the table's rows are bf16 values (the table is stored in bf16)
            rows = torch.randn(shape.num_rows, shape.config.head_dim, generator=g)
            w[p + "engram_table"] = rows.to(torch.bfloat16).float()
        w[p + "wq"], w[p + "wk"], w[p + "wv"], w[p + "wo"] = lin(hd, d), lin(hd, d), lin(hd, d), lin(d, hd)
        if i < args.n_dense_layers:
            w[p + "w13"], w[p + "w2"] = lin(2 * args.inter_dim, d), lin(d, args.inter_dim)
            continue
        e, inter, shared = args.n_routed_experts, args.moe_inter_dim, args.n_shared_experts * args.moe_inter_dim
        w[p + "gate"], w[p + "gate_bias"] = lin(e, d), 0.1 * torch.randn(e, generator=g)
        if shared:
            w[p + "shared_w13"], w[p + "shared_w2"] = lin(2 * shared, d), lin(d, shared)
        w[p + "experts_w13"], w[p + "experts_w2"] = lin(e, 2 * inter, d), lin(e, d, inter)
    return w


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


class DPEPModel:
    """The model on one rank of a DP attention + Wide-EP deployment.

    Parameters
    ----------
    args : ModelArgs
    groups : epkit.topology.ParallelGroups
        This rank's groups (``ParallelGroups.create(dp_size=world)``: CP 1, EP over every rank).
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
    ):
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
        if groups.sizes["cp"] != 1:
            raise ValueError("the reference model runs without context parallelism (cp_size 1)")
        self.args, self.groups = args, groups
        weights = init_weights(args) if weights is None else weights
        self.ep_size, self.ep_rank = groups.sizes["ep"], groups.ep_rank
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
        #: Engram layers (by layer index) and their ENP-sharded tables (bf16 rows in CPU memory, as the
        #: source engine keeps its 400M-row tables; rows are fetched before the first layer).
        self.engram, self.engram_tables = {}, {}
        for i in args.engram_layer_ids:
            self.engram[i] = _engram_layer(args, weights, i, torch.float32, self.device)
            full = weights[f"layers.{i}.engram_table"]
            table = ShardedEngramTable(full.shape[0], full.shape[1], group=groups, timeout=timeout)
            lo = min(table.row_start, full.shape[0])  # a part may hold padding rows only
            hi = min(table.row_start + table.num_per_part, full.shape[0])
            if lo < hi:
                table.load_rows(lo, full[lo:hi])
            self.engram_tables[i] = table
        self.engram_config = engram_config(args) if args.engram_layer_ids else None
        self._all_experts = {n: _quantize_experts(t, args.expert_format) for n, t in experts.items()}
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

    def _moe(self, m: int, x: torch.Tensor, is_prompt: bool, count_load: bool) -> torch.Tensor:
        args, p = self.args, f"layers.{m + self.args.n_dense_layers}."
        w = self.weights
        idx, weights = _route(args, x, w[p + "gate"], w[p + "gate_bias"])
        if self.record_routing:
            self.last_routing.append(idx)
        # the gate's ids are valid by construction: no check_index (it reads them on the host)
        placement = self._placements_dev[m]
        phys = logical_to_physical(idx, placement, self.ep_rank, token_offset=self.ep_rank, check_index=False)
        if count_load:  # a placeholder's traffic is not load: EPLB would replicate experts for it
            flat = phys.reshape(-1).long()
            self.routed_load[m].index_add_(0, flat.clamp(min=0), (flat >= 0).long())
        shared = _swiglu_mlp(x, w[p + "shared_w13"], w[p + "shared_w2"]) if args.n_shared_experts else None
        xb = x.to(torch.bfloat16)
        w13, w2 = self.local_experts[m]
        fp8 = args.expert_format == "fp8"
        mode = self.prefill_moe if is_prompt else self.decode_moe
        if mode == "low_latency":
            n_max = self.max_decode_tokens_per_rank
            recv, count, handle, _ = self.buffer.low_latency_dispatch(xb, phys, n_max, use_fp8=fp8)
            y = expert_mlp(recv, "masked", w13, w2, masked_m=count, expected_m=max(1, n_max))
            out = self.buffer.low_latency_combine(y, phys, weights, handle).float()
            # the layer's output is bf16 on every path (combine adds the shared expert before rounding)
            return out if shared is None else (out + shared.to(torch.bfloat16).float()).to(torch.bfloat16).float()
        bias = None if shared is None else shared.to(torch.bfloat16)
        if mode == "fused":
            out = fused_moe(xb, phys, weights, w13, w2, self.buffer, bias=bias, expert_alignment=self.expert_alignment)
        elif mode == "reference":
            group, num_physical = self.buffer.group, self.buffer.num_experts
            st = reference_dispatch(
                xb, phys, weights, num_physical, group, expand=True, expert_alignment=self.expert_alignment
            )
            y = expert_mlp(st["expanded_x"], "contiguous", w13, w2, m_indices=st["m_indices"])
            out = reference_combine(y, st, xb.shape[0], group, bias=bias, expand=True)
        else:
            inp = per_token_group_cast_to_fp8(xb) if fp8 else xb
            recv, _, _, _, handle = self.buffer.dispatch(
                inp, phys, weights, expert_alignment=self.expert_alignment, expand=True
            )
            y = expert_mlp(recv, "contiguous", w13, w2, m_indices=EPBuffer.m_indices(handle))
            out = self.buffer.combine(y, handle, bias=bias)
        return out.float()

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor:
        """One step on this rank (collective over the EP group).

        Returns
        -------
        Tensor [S, vocab_size] float32: the logits of every sequence's last token.
        """
        _check_batch(self.args, batch)
        args, w = self.args, self.weights
        cus = batch.cu_seqlens.tolist()
        for s, sid in enumerate(batch.seq_ids):
            if sid is None:
                continue
            if batch.is_prompt:
                self.cache[sid] = _SeqCache.new(args.n_layers)  # a prompt starts its sequence afresh
                continue
            st = self.cache.get(sid)
            cached = st.kv[0][0].shape[0] if st is not None and st.kv[0] is not None else None
            if cached is None or int(batch.positions[cus[s]]) != cached:
                raise ValueError(
                    f"batch: decode of sequence {sid!r} at position {int(batch.positions[cus[s]])}, but this rank "
                    f"holds {'no prefill of it' if cached is None else f'{cached} cached tokens'}"
                )
        self.last_routing = []
        hooks = self._engram_fetch(batch)  # before the first layer: hashes need only the token ids
        x = w["embed"][batch.token_ids.to(self.device)]
        for i in range(args.n_layers):
            p = f"layers.{i}."
            if i in hooks:
                x = x + self._engram_apply(i, x, hooks[i](), batch)
            x = x + _attention(args, w, p, _rms_norm(x, w[p + "attn_norm"], args.norm_eps), batch, self.cache, i)
            h = _rms_norm(x, w[p + "ffn_norm"], args.norm_eps)
            if i < args.n_dense_layers:
                x = x + _swiglu_mlp(h, w[p + "w13"], w[p + "w2"])
            else:
                x = x + self._moe(i - args.n_dense_layers, h, batch.is_prompt, not batch.is_placeholder)
        return _logits(args, w, x, batch)

    # Engram

    def _engram_fetch(self, batch: Batch) -> dict:
        """Hash every token's n-grams and start fetching its rows of each Engram layer's table.

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
        return {i: self.engram_tables[i].fetch(rows[li]) for li, i in enumerate(cfg.layer_ids)}

    def _engram_apply(self, i: int, x: torch.Tensor, emb: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Layer ``i``'s Engram output for this step's rows; decode rows see their sequence's window."""
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
        out = layer(torch.cat(hs), embeddings=torch.cat(es), cu_seqlens=torch.tensor(cu))
        return out[torch.tensor(keep, dtype=torch.int64, device=out.device)]

    def release(self, seq_id) -> None:
        """Drop a finished sequence's state (KV cache, Engram window)."""
        self.cache.pop(seq_id, None)

    def close(self) -> None:
        """Free the EP buffer (collective on nvshmem)."""
        self.buffer.close()


def _quantize_experts(w: torch.Tensor, fmt: str):
    return per_block_cast_to_fp8(w) if fmt == "fp8" else w.to(torch.bfloat16)


def _agree(group, error: str | None, settings) -> None:
    """Every rank of ``group`` learns every rank's input error (and settings) before any step."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    reports = [(error, settings)]
    if world > 1:
        reports = [None] * world
        dist.all_gather_object(reports, (error, settings), group=group)
    bad = [f"rank {r}: {e}" for r, (e, _) in enumerate(reports) if e is not None]
    if bad:
        raise ValueError("generate rejected on every rank before the first step: " + "; ".join(bad))
    if len({tuple(st) for _, st in reports}) > 1:
        raise ValueError(f"generate: the ranks pass different prefill vote intervals: {[st for _, st in reports]}")


def generate(
    model: DPEPModel,
    prompts: list[list[int]],
    max_new_tokens,
    *,
    prefill_attempt_interval: int = 1,
    prefill_any_attempt_interval: int = 16,
    max_steps: int = 100_000,
) -> tuple[list[list[int]], dict]:
    """Greedy generation for this rank's prompts, in lockstep with every DP rank (collective).

    Each step, one all-reduce decides whether any rank still has work and whether the group
    prefills (:class:`epkit.lockstep.LockstepDriver`); a rank with nothing of that kind to run
    runs a placeholder batch, so every rank enters every dispatch/combine. A prefill step admits
    pending prompts while they fit the prefill capacity and the decode capacity (a rank whose
    decode slots are full does not ask for prefill). No end-of-sequence token: each prompt gets
    exactly its ``max_new_tokens``.

    Parameters
    ----------
    model : DPEPModel
    prompts : list of lists of token ids (this rank's requests; may be empty)
    max_new_tokens : int or list of int (per prompt), >= 1
    prefill_attempt_interval, prefill_any_attempt_interval : int
        The prefill vote's intervals (see :class:`epkit.lockstep.PrefillVote`).
    max_steps : int
        Safety bound on the number of steps.

    Returns
    -------
    (tokens, stats): the generated ids per prompt, and ``{"steps", "prefill_steps",
    "placeholder_steps", "tokens"}`` for this rank (``tokens``: the tokens of its real batches,
    which are what the expert load counts; placeholders excluded).

    Raises
    ------
    ValueError
        On every rank, before the first step, if any rank's prompts or ``max_new_tokens`` are
        invalid or the ranks pass different vote intervals (the message names the rank).
    """
    n = len(prompts)
    budget = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    cap = model.buffer.num_max_tokens_per_rank
    error = None
    try:
        if len(budget) != n or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budget):
            raise ValueError(f"max_new_tokens must be an int >= 1 or one per prompt, got {max_new_tokens!r}")
        vocab = model.args.vocab_size
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= cap:
                raise ValueError(f"prompt {i} has {len(p)} tokens; each must have 1..{cap} (the prefill capacity)")
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in p):
                raise ValueError(f"prompt {i} holds a token id outside [0, {vocab})")
    except (ValueError, TypeError) as exc:
        error = str(exc)
    _agree(model.groups.cpu_dp_group, error, (prefill_attempt_interval, prefill_any_attempt_interval))
    driver = LockstepDriver(model.groups.cpu_dp_group, prefill_attempt_interval, prefill_any_attempt_interval)
    pending, running = deque(range(n)), []
    out: list[list[int]] = [[] for _ in range(n)]
    stats = {"steps": 0, "prefill_steps": 0, "placeholder_steps": 0, "tokens": 0}
    decode_cap = model.max_decode_tokens_per_rank if model.decode_moe == "low_latency" else cap
    while True:
        plan = driver.next_step(
            has_unfinished=bool(pending or running),
            # only a prompt this rank could admit now counts: a full rank that voted for prefill could
            # hold every rank in prefill steps it cannot use while its own sequences never decode
            has_pending_prefill=bool(pending) and len(running) < decode_cap,
            has_running_decode=bool(running),
        )
        if plan is None:
            return out, stats
        stats["steps"] += 1
        if stats["steps"] > max_steps:
            raise RuntimeError(f"generate: more than max_steps={max_steps} steps")
        if plan.is_prefill:
            stats["prefill_steps"] += 1
            admitted, tokens = [], 0
            while pending and tokens + len(prompts[pending[0]]) <= cap and len(running) + len(admitted) < decode_cap:
                tokens += len(prompts[pending[0]])
                admitted.append(pending.popleft())
            batch = Batch.prefill([prompts[i] for i in admitted], admitted) if admitted else None
            active = admitted
        else:
            active = list(running)
            batch = (
                Batch.decode([out[i][-1] for i in active], [len(prompts[i]) + len(out[i]) - 1 for i in active], active)
                if active
                else None
            )
        if batch is None:
            stats["placeholder_steps"] += 1
            model.forward(Batch.placeholder(plan.is_prefill))  # its output is discarded
            continue
        stats["tokens"] += batch.num_tokens
        next_ids = model.forward(batch).argmax(-1).tolist()
        for i, t in zip(active, next_ids):
            out[i].append(int(t))
            if plan.is_prefill:
                running.append(i)
        for i in active:
            if len(out[i]) >= budget[i]:
                running.remove(i)
                model.release(i)


# Reference


def _fake_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """Activations through the grouped GEMM's FP8 format (per token, per 128), back to x's dtype."""
    q, s = per_token_group_cast_to_fp8(x.float())
    return dequant_per_token_group_fp8(q, s).to(x.dtype)


def _moe_reference(args: ModelArgs, w: dict, experts: dict, p: str, x: torch.Tensor, idx=None) -> torch.Tensor:
    idx, weights = _route(args, x, w[p + "gate"], w[p + "gate_bias"], idx)
    xe = x.to(torch.bfloat16).to(x.dtype)
    if args.expert_format == "fp8":
        xe = _fake_fp8_rows(xe)
    w13, w2 = experts[p + "experts_w13"], experts[p + "experts_w2"]
    out = torch.zeros_like(x)
    for e in range(args.n_routed_experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if not tok.numel():
            continue
        gate, up = (xe[tok] @ w13[e].T).chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        act = _fake_fp8_rows(act) if args.expert_format == "fp8" else _bf16(act)  # expert_mlp's intermediate
        y = _bf16(act @ w2[e].T)  # expert_mlp's output rows are bf16
        out[tok] += weights[tok, slot].to(x.dtype)[:, None] * y  # a token picks an expert at most once
    if args.n_shared_experts:
        out = out + _bf16(_swiglu_mlp(x, w[p + "shared_w13"], w[p + "shared_w2"]))
    return _bf16(out)  # combine returns bf16


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


@torch.no_grad()
def forward_reference(
    args: ModelArgs,
    sequences: list[list[int]],
    weights: dict | None = None,
    dtype: torch.dtype = torch.float64,
    routing: list | None = None,
) -> list[torch.Tensor]:
    """The specification: every sequence (all DP ranks') through the model in one process.

    Plain torch in ``dtype`` (default float64), a per-expert loop, no parallelism, the Engram
    tables whole (rows from ``table[hash_tokens(...)]``), each sequence in one pass. The expert
    weights are the parallel model's (FP8 block-quantized, or bf16), and the activations take the
    same quantisation points: the MoE input, each expert's output rows, the shared expert's output
    and the MoE layer's output through bf16 and, for FP8 experts, the expert inputs and the SwiGLU
    output through per-token FP8. Sums stay in ``dtype`` (the parallel model rounds partial sums
    and accumulates in float32: the two differ by rounding only).

    ``routing`` (optional, one entry per sequence: a list over MoE layers of ``[len(seq), K]``
    logical expert ids, e.g. gathered from :attr:`DPEPModel.last_routing`) replays the parallel
    model's gate choices. Top-k is discontinuous: where two experts' scores nearly tie, rounding
    alone can pick the other one, and replaying the choice keeps such a token comparable.

    Returns
    -------
    list of Tensor [len(seq), vocab_size] in ``dtype``: the logits at every position.
    """
    weights = init_weights(args) if weights is None else weights
    w, experts = {}, {}
    engram = {i: _engram_layer(args, weights, i, dtype) for i in args.engram_layer_ids}
    for name, t in weights.items():
        if ".experts_" in name:
            q = _quantize_experts(t, args.expert_format)
            experts[name] = (dequant_per_block_fp8(*q) if isinstance(q, tuple) else q.float()).to(dtype)
        else:
            w[name] = t.to(dtype)
    if routing is not None and len(routing) != len(sequences):
        raise ValueError(f"routing must have one entry per sequence ({len(sequences)}), got {len(routing)}")
    outs = []
    for si, seq in enumerate(sequences):
        batch = Batch.prefill([seq], [None])
        _check_batch(args, batch)
        x = w["embed"][batch.token_ids]
        if engram:
            rows = hash_tokens(batch.token_ids.to(torch.int32), batch.cu_seqlens, engram_config(args)).long()
        for i in range(args.n_layers):
            p = f"layers.{i}."
            if i in engram:
                table = w[p + "engram_table"]
                li = args.engram_layer_ids.index(i)
                x = x + engram[i](x, embeddings=table[rows[li]], cu_seqlens=batch.cu_seqlens)
            x = x + _attention(args, w, p, _rms_norm(x, w[p + "attn_norm"], args.norm_eps), batch, None, i)
            h = _rms_norm(x, w[p + "ffn_norm"], args.norm_eps)
            x = x + (
                _swiglu_mlp(h, w[p + "w13"], w[p + "w2"])
                if i < args.n_dense_layers
                else _moe_reference(
                    args, w, experts, p, h, None if routing is None else routing[si][i - args.n_dense_layers]
                )
            )
        outs.append(_rms_norm(x, w["norm"], args.norm_eps) @ w["head"].T)
    return outs


# ``python -m epkit.model``: the textbook experiment (epkit._details.model_demo)


def _main(argv=None) -> int:
    from epkit._details.model_demo import main

    return main(argv)


if __name__ == "__main__":
    raise SystemExit(_main())
