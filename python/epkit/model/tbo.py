"""Two-batch overlap (TBO) of a decode step, as ``004_*.txt`` describes it: the step's batch runs as two
micro-batches, and while one is in attention or its experts, the other's low-latency dispatch or combine
is on the wire.

Each micro-batch is a generator that runs its layers and yields right after it has *sent* a dispatch or a
combine (``EPBuffer.low_latency_dispatch`` / ``low_latency_combine`` with ``return_recv_hook=True``); the
two are resumed in turn. The buffer takes one exchange in flight at a time (a hook must be called before
the next collective on it), so the receive of one micro-batch's exchange is completed just before the other
sends its own. Per MoE layer every rank issues, in this order::

    A: attention, gate -> send dispatch(A)    B: attention, gate  (dispatch(A) in flight)
    B: recv dispatch(A), send dispatch(B)     A: experts          (dispatch(B) in flight)
    A: recv dispatch(B), send combine(A)      B: experts          (combine(A) in flight)
    B: recv combine(A), send combine(B)       A: next layer's attention (combine(B) in flight)

so each exchange overlaps the other micro-batch's compute. A dispatch's receive tensors stay the micro-batch's
while it holds them (the buffer's pool never hands out memory still in use): no copy. The micro-batches are
the first and second half of the step's sequences (a rank with one sequence sends an empty second one: every
rank enters every exchange). Nothing of the arithmetic changes: every row goes through the same ops as without
TBO, so the outputs are bit for bit the same (tested). The Engram fetch stays one per step, for the whole
batch.

Timing (:class:`~epkit.model.profile.StepTimer`): ``dispatch`` / ``combine`` are the exposed parts (the send,
and the wait in the receive), ``overlapped_comm`` the seconds exchanges spent in flight behind the other
micro-batch's compute.
"""

from __future__ import annotations

import time

import torch

from epkit.model.layers import Batch, attention, logits, rms_norm, swiglu_mlp
from epkit.moe import expert_mlp

__all__ = ["split_batch", "tbo_decode"]


def split_batch(batch: Batch) -> tuple[Batch, Batch]:
    """The two micro-batches of a decode batch: its first ``ceil(S / 2)`` sequences and the rest (maybe none)."""
    cu = batch.cu_seqlens
    half = (len(batch.seq_ids) + 1) // 2
    out = []
    for lo, hi in ((0, half), (half, len(batch.seq_ids))):
        t0, t1 = int(cu[lo]), int(cu[hi])
        out.append(
            Batch(
                batch.token_ids[t0:t1],
                batch.positions[t0:t1],
                cu[lo : hi + 1] - cu[lo],
                batch.seq_ids[lo:hi],
                batch.is_prompt,
                batch.is_placeholder,
            )  # fmt: skip
        )
    return out[0], out[1]


class _InFlight:
    """The one exchange in flight on the buffer: whose receive is still to be completed, and since when."""

    def __init__(self, timer):
        self.timer, self.pending = timer, None
        self.overlapped = 0.0

    def settle(self) -> None:
        """Complete the receive of the exchange in flight, if any (what must happen before the next one)."""
        if self.pending is None:
            return
        receive, kind, sent_at = self.pending
        self.pending = None
        self.overlapped += time.perf_counter() - sent_at
        with self.timer(kind):
            receive()

    def send(self, kind: str, start, receive) -> None:
        """Settle the exchange in flight, then ``start()`` a new one whose receive is ``receive()``."""
        self.settle()
        with self.timer(kind):
            start()
        self.pending = (receive, kind, time.perf_counter())


def _moe_overlapped(model, fly: _InFlight, m: int, h: torch.Tensor, count_load: bool):
    """MoE layer ``m`` of one micro-batch (a generator: it yields after each send); returns its float32 output."""
    phys, weights, shared = model.moe_route(m, h, count_load)
    n_max, buf, got = model.max_decode_tokens_per_rank, model.buffer, {}

    def dispatch():
        got["recv"], got["count"], got["handle"], got["hook"] = buf.low_latency_dispatch(
            h.to(torch.bfloat16), phys, n_max, use_fp8=model.uses_fp8, return_recv_hook=True
        )

    def received():
        got["hook"]()
        got["x"], got["n"] = got["recv"], got["count"]  # ours while held: the next dispatch takes other memory

    fly.send("dispatch", dispatch, received)
    yield
    if "x" not in got:
        fly.settle()
    w13, w2 = model.local_experts[m]
    with model.timer("experts"):
        y = expert_mlp(got["x"], "masked", w13, w2, masked_m=got["n"], expected_m=max(1, n_max))

    def combine():
        got["hook"] = buf.low_latency_combine(y, phys, weights, got["handle"], return_recv_hook=True)[1]

    fly.send("combine", combine, lambda: got.__setitem__("out", got["hook"]()))
    yield
    if "out" not in got:
        fly.settle()
    return model.add_shared(got["out"], shared)


def _micro_batch(model, fly: _InFlight, b: Batch, rows_of):
    """One micro-batch's forward (a generator, see :func:`_moe_overlapped`); returns its logits."""
    args, w, timer = model.args, model.weights, model.timer
    x = w["embed"][b.token_ids.to(model.device)]
    for i in range(args.n_layers):
        p = f"layers.{i}."
        if i in model.engram and b.seq_ids:
            rows = rows_of(i)
            with timer("engram_layer"):
                x = x + model.engram_apply(i, x, rows, b)
        h = rms_norm(x, w[p + "attn_norm"], args.norm_eps)
        with timer("attention"):
            x = x + attention(args, w, p, h, b, model.cache, i)
        h = rms_norm(x, w[p + "ffn_norm"], args.norm_eps)
        if i >= args.n_dense_layers:
            x = x + (yield from _moe_overlapped(model, fly, i - args.n_dense_layers, h, not b.is_placeholder))
            continue
        with timer("dense_mlp"):
            x = x + swiglu_mlp(h, w[p + "w13"], w[p + "w2"])
    with timer("head"):
        return logits(args, w, x, b)


def tbo_decode(model, batch: Batch) -> torch.Tensor:
    """One decode step of ``model`` (a :class:`~epkit.model.DPEPModel`, low-latency decode) as two overlapped
    micro-batches (collective over the EP group, like the step without TBO): the logits ``[S, vocab]``."""
    timer = model.timer
    halves = split_batch(batch)
    with timer("engram_fetch"):
        hooks = model.engram_fetch(batch)  # one fetch per Engram layer for the whole step
    fetched, cut = {}, halves[0].num_tokens

    def rows_of(k: int):
        def rows(i):
            if i not in fetched:
                with timer("engram_fetch"):
                    fetched[i] = hooks[i]()
            return fetched[i][:cut] if k == 0 else fetched[i][cut:]

        return rows

    fly = _InFlight(timer)
    runs = [_micro_batch(model, fly, b, rows_of(k)) for k, b in enumerate(halves)]
    out: list = [None, None]
    live = [0, 1]
    while live:
        for k in list(live):
            try:
                next(runs[k])
            except StopIteration as done:
                out[k] = done.value
                live.remove(k)
    fly.settle()
    for i in hooks:  # a step whose sequences are all in one half still completes every fetch
        rows_of(0)(i)
    timer.add("overlapped_comm", fly.overlapped)
    return torch.cat(out)
