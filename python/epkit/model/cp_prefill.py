"""Context-parallel prefill of the reference model (``cp_size > 1``): the path the source engine keeps in
code but ships disabled (``000_*.txt``), here run and tested.

Layout: global ranks ``(replica dp cp)``, so an engine is ``cp`` adjacent ranks and ``world = dp * cp``
(``epkit run --ranks N --cp C`` runs ``DP = N / C`` engines; EP spans every rank). Every CP rank of an
engine holds the engine's whole prompt batch (the source's driver broadcasts it; here each CP rank builds
the same schedule) and computes only its zigzag share of the tokens:

- **model start**: :func:`epkit.prepare_cp_mirror` cuts each prompt into ``2 * cp`` blocks, this rank takes
  block ``r`` and block ``2 * cp - 1 - r``; its rows are picked from the batch by ``mirror_cp_index`` (a
  local index gather, as the source's ``gather(hidden_states, mirror_cp_index)``: the batch is already on
  every CP rank, nothing needs to travel);
- **attention**: this rank's keys and values are all-gathered on :class:`~epkit.collectives.cp_group.CPGroup`
  (one gather per layer, started before the query projection and waited for when the keys are needed)
  and put back in sequence order (:func:`epkit.from_mirror`); each local query attends to the keys that
  ``ke - ks`` of ratio 1 gives it. The model's attention is plain multi-head attention with **no KV
  compression**, so the only configured ratio is 1 (:data:`CP_RATIOS`): the compressed-attention ratios
  of the source's V4 attention have no layer here to use them;
- **Engram layers**: the causal convolution reads earlier rows of the sequence, which live on other CP
  ranks, so the layer's input and fetched rows are all-gathered (one gather per Engram layer) and the
  layer runs on the whole batch;
- **model end**: the final hidden states are all-gathered and restored to the original order, so every CP
  rank computes every sequence's logits.

Every CP rank ends the prefill holding the whole KV cache (and Engram window) of every sequence: decode
then continues without CP from the gathered KV, each sequence on one CP rank of its engine
(:func:`epkit.model.generate`). The prefill's logits are the ``cp = 1`` run's within float32 rounding.
"""

from __future__ import annotations

import torch

from epkit.cp_mirror import from_mirror, prepare_cp_mirror
from epkit.model.layers import Batch, attend, linear, logits, project

__all__ = ["CP_RATIOS", "cp_prefill", "cp_prefill_slots"]

#: The key compression ratios the CP key ranges are computed for: 1 only (the model has no compressed KV).
CP_RATIOS = (1,)


def cp_prefill_slots(prompt_len: int, cp_size: int) -> int:
    """Rows one CP rank brings to the prefill for a prompt of ``prompt_len`` tokens: ``2 * ceil(len / (2 cp))``
    (its two zigzag blocks, padding included, as the all-gathers carry them); ``prompt_len`` without CP."""
    return prompt_len if cp_size == 1 else 2 * -(-prompt_len // (2 * cp_size))


class _Shard:
    """This CP rank's share of a prefill batch and the all-gather that puts the shares back together."""

    def __init__(self, model, batch: Batch):
        cp = model.cp
        cu = batch.cu_seqlens.to(torch.int32)
        self.cp, self.batch = cp, batch
        self.mirror = m = prepare_cp_mirror(cu, cu, cp.size, cp.rank, CP_RATIOS)
        self.slots = (m.mirror_cp_index >= 0).nonzero()[:, 0]
        self.tokens = m.mirror_cp_index[self.slots].long()  # packed-batch token of each local row
        per_seq = m.seqlens_q_half.view(-1, 2).sum(1).long()
        self.local = Batch(
            token_ids=batch.token_ids[self.tokens],
            positions=batch.positions[self.tokens],
            cu_seqlens=torch.cat((torch.zeros(1, dtype=torch.int64), per_seq.cumsum(0))),
            seq_ids=batch.seq_ids,
            is_prompt=True,
        )
        self.visible = (m.ke[1] - m.ks[1])[self.slots].long()  # keys each local query sees (ratio 1)

    def gather(self, x: torch.Tensor):
        """Start all-gathering the local rows ``x [t, ...]`` (in mirror slots, zeros at padding); the returned
        callable waits and gives every row of the batch in its original order ``[T, ...]``."""
        buf = x.new_zeros((self.mirror.cp_mirror_len, *x.shape[1:]))
        buf[self.slots] = x
        wait = self.cp.all_gather(buf)
        return lambda: from_mirror(wait(), self.mirror)


def _attention(model, sh: _Shard, i: int, h: torch.Tensor) -> torch.Tensor:
    """Layer ``i``'s attention for the local rows ``h``: keys and values all-gathered on the CP group, the whole
    sequences' KV kept in the cache."""
    args, w, p = model.args, model.weights, f"layers.{i}."
    pos, hd = sh.local.positions.to(h.device), args.head_dim
    k, v = project(args, w, p, h, pos, "wk"), project(args, w, p, h, pos, "wv")
    wait_kv = sh.gather(torch.cat((k, v), dim=-1))  # started before the query projection
    q = project(args, w, p, h, pos, "wq")
    kv = wait_kv()
    out = torch.empty_like(q)
    cu, lcu = sh.batch.cu_seqlens.tolist(), sh.local.cu_seqlens.tolist()
    for s, sid in enumerate(sh.batch.seq_ids):
        ks, vs = kv[cu[s] : cu[s + 1], :, :hd], kv[cu[s] : cu[s + 1], :, hd:]
        model.cache[sid].kv[i] = (ks.contiguous(), vs.contiguous())  # a prompt starts its sequence: no prefix
        lo, hi = lcu[s], lcu[s + 1]
        out[lo:hi] = attend(q[lo:hi], ks, vs, sh.visible[lo:hi])
    return linear(out.reshape(h.shape[0], args.n_heads * hd), w[p + "wo"])


def cp_prefill(model, batch: Batch) -> torch.Tensor:
    """One context-parallel prefill step on this CP rank (collective over the CP and EP groups; every CP rank of
    the engine passes the same ``batch``): the logits ``[S, vocab]`` of every sequence's last token, on every
    CP rank. ``model`` is a :class:`~epkit.model.DPEPModel` with ``cp_size > 1``."""
    args, w, timer = model.args, model.weights, model.timer
    sh = _Shard(model, batch)
    d = args.dim
    with timer("engram_fetch"):
        hooks = model.engram_fetch(batch, select=sh.tokens)  # this rank's rows only

    def engram(i, x):
        with timer("engram_fetch"):
            rows = hooks[i]().to(x.device, torch.float32)  # bf16 values: exact in float32
        with timer("cp_all_gather"):
            full = sh.gather(torch.cat((x, rows.reshape(x.shape[0], -1)), dim=-1))()
        emb = full[:, d:].reshape(-1, *rows.shape[1:])
        with timer("engram_layer"):
            return model.engram_apply(i, full[:, :d], emb, batch)[sh.tokens.to(x.device)]

    x = w["embed"][sh.local.token_ids.to(model.device)]
    x = model.run_layers(x, sh.local, engram, lambda i, h: _attention(model, sh, i, h))
    with timer("cp_all_gather"):
        x = sh.gather(x)()
    with timer("head"):
        return logits(args, w, x, batch)
