"""EPBuffer: DeepEP-style dispatch/combine (normal and low-latency) on symmetric memory.

The protocol is written once against :class:`~epkit.collectives.symm_buffer.SymmBuffer`'s
exchange; only the transport differs (``shm``: one-sided copies into peers'
shared memory, no staging; ``torch``: torch.distributed all-to-all).

Semantics (shared with DeepEP where it has them):
* experts are split evenly: expert ``e`` lives on rank ``e // num_local_experts``;
* each token goes once to each destination rank that holds one of its experts;
* received rows are ordered by source rank, then source token order (deterministic);
* ``recv_topk_idx`` holds local expert ids, ``-1`` where the expert lives elsewhere;
* ``expand=True`` gives one row per (token, local expert), grouped by expert, each
  group padded to ``expert_alignment`` with zero rows, plus the ``m_indices`` the
  contiguous grouped GEMM takes (``-1`` on padding rows);
* combine sums in a fixed order (see :mod:`epkit.collectives.ep_reference`), so
  results are bitwise equal across transports and runs.

Every input is validated on every rank before any row moves: a bad call on one
rank raises the same ``ValueError`` on all ranks. Every wait has a timeout and a
``TimeoutError`` names the silent peer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epkit._util import check_topk_idx
from epkit.collectives.symm_buffer import SymmBuffer, _all_on_one_host

__all__ = ["EPBuffer", "DispatchHandle", "LowLatencyHandle"]

_META_MSG = 192  # bytes of error text carried by the layout exchange
_ALIGN = 16


def _al(n: int, a: int = _ALIGN) -> int:
    return -(-n // a) * a


_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_ROW_DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn)


def reduce_rows(
    out: torch.Tensor,
    addrs: torch.Tensor,
    src_dtype: torch.dtype,
    weights: torch.Tensor | None = None,
    biases: list[torch.Tensor] = (),
) -> torch.Tensor:
    """``out[t] = cast(sum_k (w[t, k] *) row(addrs[t, k]) + sum biases)`` in float32, k ascending.

    ``addrs [T, K]`` int64 holds row addresses (0: no row) of ``src_dtype`` rows of
    ``out.shape[1]`` elements. Uses ``epkit._C.reduce_rows`` (multi-threaded, reads rows in
    place) for bf16/f32; other dtypes take the same formula in torch.
    """
    t_num, h = out.shape
    k = addrs.shape[1] if addrs.dim() == 2 else 0
    if t_num == 0:
        return out
    codes = (_DTYPE_CODE.get(out.dtype), _DTYPE_CODE.get(src_dtype))
    bias_code = {_DTYPE_CODE.get(b.dtype) for b in biases}
    if None not in codes and len(bias_code) <= 1 and None not in bias_code and out.is_contiguous():
        from epkit import _C

        addrs = addrs.contiguous()
        w = weights.float().contiguous() if weights is not None else None
        bs = [b.contiguous() for b in biases]
        _C.reduce_rows(
            out.data_ptr(),
            codes[0],
            addrs.data_ptr(),
            t_num,
            k,
            h,
            codes[1],
            w.data_ptr() if w is not None else 0,
            [b.data_ptr() for b in bs],
            next(iter(bias_code)) if bs else 0,
            torch.get_num_threads(),
        )
        return out
    # Same arithmetic in torch (fallback for other dtypes): rows are read through a byte view.
    es = torch.empty((), dtype=src_dtype).element_size()
    acc = torch.zeros((t_num, h), dtype=torch.float32)
    for kk in range(k):
        col = addrs[:, kk]
        for t in (col != 0).nonzero().flatten().tolist():
            import ctypes

            raw = (ctypes.c_uint8 * (h * es)).from_address(int(col[t]))
            row = torch.frombuffer(raw, dtype=torch.uint8).view(src_dtype).float()
            acc[t] += weights[t, kk].float() * row if weights is not None else row
    for b in biases:
        acc += b.float()
    return out.copy_(acc.to(out.dtype))


def _copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for 2-D byte tensors with contiguous rows of equal size.

    One multi-threaded memcpy per row in ``epkit._C`` (torch's index_copy_ moves uint8 rows element
    by element); indices are checked against both shapes first.
    """
    n = dst_rows.numel()
    if n == 0:
        return
    if dst.dtype != torch.uint8 or src.dtype != torch.uint8 or dst.device.type != "cpu" or src.device.type != "cpu":
        raise ValueError("_copy_rows: byte (uint8) tensors in CPU memory only")
    if src_rows.numel() != n or dst.shape[1] != src.shape[1] or dst.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError("_copy_rows: row lists and row sizes must match, rows contiguous")
    dst_rows, src_rows = dst_rows.long(), src_rows.long()
    if int(dst_rows.min()) < 0 or int(dst_rows.max()) >= dst.shape[0]:
        raise IndexError(f"_copy_rows: destination rows outside [0, {dst.shape[0]})")
    if int(src_rows.min()) < 0 or int(src_rows.max()) >= src.shape[0]:
        raise IndexError(f"_copy_rows: source rows outside [0, {src.shape[0]})")
    from epkit import _C

    dst_addrs = (dst.data_ptr() + dst_rows * dst.stride(0)).contiguous()
    src_addrs = (src.data_ptr() + src_rows * src.stride(0)).contiguous()
    _C.copy_rows_by_address(dst_addrs.data_ptr(), src_addrs.data_ptr(), n, dst.shape[1], torch.get_num_threads())


def _block_rows(counts: torch.Tensor, starts: torch.Tensor, slots_per_expert: int, rows_per_expert: int):
    """For one source rank: (slot index in its [L * slots] message, row index in the [L * rows] expert layout).

    Expert e holds ``counts[e]`` of this source's rows, at message slots ``e * slots + i``
    and layout rows ``e * rows + starts[e] + i`` for ``i < counts[e]``.
    """
    counts = counts.long()
    total = int(counts.sum())
    if total == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    experts = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    first = torch.cumsum(counts, 0) - counts
    i = torch.arange(total) - first[experts]
    return experts * slots_per_expert + i, experts * rows_per_expert + starts.long()[experts] + i


def _check_biases(bias, num_tokens: int, hidden: int) -> list[torch.Tensor]:
    """``bias`` as a list of at most two ``[num_tokens, hidden]`` tensors (the fused reduction reads T*H of each)."""
    biases = [] if bias is None else list(bias) if isinstance(bias, (tuple, list)) else [bias]
    if len(biases) > 2:
        raise ValueError(f"at most two bias tensors, got {len(biases)}")
    for b in biases:
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (num_tokens, hidden):
            raise ValueError(f"bias must be [{num_tokens}, {hidden}], got {tuple(getattr(b, 'shape', ()))}")
    return biases


@dataclass
class DispatchHandle:
    """State that combine (and a cached dispatch) needs. Returned by :meth:`EPBuffer.dispatch`."""

    send_tokens: list[torch.Tensor]  # per destination rank: source token indices, ascending
    recv_counts: list[int]  # rows received from each source rank
    num_tokens: int
    recv_topk_idx: torch.Tensor  # [R, K] local ids
    recv_topk_weights: torch.Tensor  # [R, K] float32
    expand: bool
    expert_alignment: int
    expanded_rows: torch.Tensor | None  # [X] received row per expanded row, -1 = padding
    expanded_slot: torch.Tensor | None  # [R, K] expanded row of (j, k), -1 if not local


@dataclass
class LowLatencyHandle:
    """State for :meth:`EPBuffer.low_latency_combine`."""

    num_tokens: int
    dst_of: torch.Tensor  # [T, K] destination rank per slot (-1: none)
    expert_of: torch.Tensor  # [T, K] local expert id on the destination
    pos_of: torch.Tensor  # [T, K] slot position within (source, expert) block
    counts: torch.Tensor  # [W, L] rows received from each source per local expert
    n_max: int = 0  # slots per (source, local expert) of the dispatch


class EPBuffer:
    """Dispatch/combine for one EP group.

    Parameters
    ----------
    group : ProcessGroup
        The EP group (gloo for CPU ranks).
    hidden : int
        Hidden size of the rows moved.
    num_experts : int
        Routed (physical) experts; divisible by the group size.
    num_max_tokens_per_rank : int
        Capacity: the most tokens any rank dispatches in one call.
    num_topk : int
        Experts per token.
    transport : {"auto", "shm", "torch"}
        ``auto``: ``shm`` for CPU ranks on one host, else ``torch``. The dispatch/combine protocol runs
        on CPU tensors; GPU ranks (the ``nvshmem`` transport of :class:`SymmBuffer`) are not supported
        by EPBuffer yet and are rejected with a ValueError.
    num_max_dispatch_tokens_per_rank : int, optional
        Capacity of the low-latency mode (default: ``num_max_tokens_per_rank``).
    timeout : float
        Seconds any wait may take (default 30).
    """

    def __init__(
        self,
        group,
        hidden: int,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        transport: str = "auto",
        num_max_dispatch_tokens_per_rank: int | None = None,
        timeout: float = 30.0,
    ):
        w = dist.get_world_size(group)
        for name, v in (
            ("hidden", hidden),
            ("num_experts", num_experts),
            ("num_max_tokens_per_rank", num_max_tokens_per_rank),
            ("num_topk", num_topk),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if num_experts % w:
            raise ValueError(f"num_experts {num_experts} is not divisible by the EP group size {w}")
        if transport not in ("auto", "shm", "torch"):
            raise ValueError(
                f"EPBuffer transport must be 'auto', 'shm' or 'torch', got {transport!r} (the protocol runs on "
                f"CPU tensors; GPU dispatch/combine over nvshmem is not in this build)"
            )
        backend = str(dist.get_backend(group))
        if transport == "auto" and "nccl" in backend:
            if "gloo" not in backend:
                raise ValueError(
                    "EPBuffer runs its protocol on CPU tensors over a gloo group; this group uses NCCL only. Pass a "
                    "gloo group (e.g. dist.new_group(backend='gloo')); GPU dispatch/combine over nvshmem is not in "
                    "this build"
                )
            # A mixed cpu:gloo,cuda:nccl group: the CPU protocol runs over its gloo part.
            transport = "shm" if _all_on_one_host(group) else "torch"
        self.group, self.world_size, self.rank = group, w, dist.get_rank(group)
        self.hidden, self.num_experts, self.num_topk = hidden, num_experts, num_topk
        self.num_local_experts = num_experts // w
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank or num_max_tokens_per_rank
        self.timeout = timeout
        h, k, n = hidden, num_topk, num_max_tokens_per_rank
        # Normal-mode row: x (up to 4 bytes/elem) + FP8 scales + local ids + weights + source index.
        self._row_bytes = _al(4 * h) + _al(4 * -(-h // 128)) + _al(4 * k) + _al(4 * k) + _ALIGN
        region = max(_al(8 * (2 + self.num_local_experts)) + _META_MSG, n * self._row_bytes, n * _al(4 * h))
        ll = self.num_max_dispatch_tokens_per_rank * self.num_local_experts * (_al(2 * h) + _al(4 * -(-h // 128)))
        ll += _al(4 * self.num_local_experts)
        self._region = _al(max(region, ll, self.num_max_dispatch_tokens_per_rank * num_topk * _al(2 * h)), 4096)
        self.buffer = SymmBuffer(group, self._region * w, transport=transport, timeout=timeout)
        self.transport = self.buffer.transport
        #: Tokens received per local expert since the last reset (feeds EPLB's ExpertLoadCounter).
        self.recv_tokens_per_expert_total = torch.zeros(self.num_local_experts, dtype=torch.int64)
        self._ll_cache: dict = {}

    def is_within_domain(self) -> bool:
        return self.buffer.is_within_domain()

    @contextlib.contextmanager
    def _guard(self, what: str):
        """Any failure while rows move leaves the ranks' exchange counters out of step: retire the buffer."""
        try:
            yield
        except BaseException as exc:
            self.buffer.mark_broken(f"{what} failed on rank {self.rank}: {type(exc).__name__}: {exc}")
            raise

    def _reject_locally(self, what: str, exc: Exception):
        """A call with no agreement step failed validation on this rank only: peers will time out, so retire
        the buffer here too instead of letting the next call pair with their stale messages."""
        self.buffer.mark_broken(f"{what} rejected on rank {self.rank}: {exc}")
        raise exc

    def take_expert_load(self) -> torch.Tensor:
        """Tokens received per local (physical) expert since the last call, ``[num_local_experts]`` int64; resets.

        To feed :class:`epkit.eplb.ExpertLoadCounter` (logical experts), all-gather these
        over the EP group (rank-major = physical ids) and fold them through the
        placement's ``phy2log``: ``counts_logical.index_add_(0, phy2log, counts_physical)``.
        """
        out = self.recv_tokens_per_expert_total.clone()
        self.recv_tokens_per_expert_total.zero_()
        return out

    # layout

    def get_dispatch_layout(self, topk_idx: torch.Tensor):
        """``(num_tokens_per_rank [W] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool)``.

        Entries of -1 in ``topk_idx`` are skipped; a token counts once per rank however
        many of its experts live there.
        """
        self._check_topk(topk_idx, topk_idx.shape[0] if topk_idx.dim() == 2 else -1)
        valid = topk_idx >= 0
        ids = topk_idx.long()
        rank_of = torch.where(valid, ids // self.num_local_experts, torch.full_like(ids, self.world_size))
        in_rank = torch.zeros(topk_idx.shape[0], self.world_size + 1, dtype=torch.bool)
        in_rank.scatter_(1, rank_of, True)
        in_rank = in_rank[:, : self.world_size].contiguous()
        per_expert = torch.bincount(ids[valid], minlength=self.num_experts).to(torch.int32)
        return in_rank.sum(0).to(torch.int32), per_expert, in_rank

    # validation

    def _check_topk(self, topk_idx, num_tokens: int) -> None:
        check_topk_idx(topk_idx, self.num_experts, self.num_topk)
        if topk_idx.shape[0] != num_tokens:
            raise ValueError(f"topk_idx has shape {tuple(topk_idx.shape)}, expected ({num_tokens}, {self.num_topk})")

    def _validate_dispatch(self, x, scales, topk_idx, topk_weights, capacity: int) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [num_tokens, {self.hidden}], got {tuple(getattr(x, 'shape', ()))}")
        if x.dtype not in (torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn):
            raise ValueError(f"x dtype {x.dtype} is not supported (bfloat16, float16, float32, float8_e4m3fn)")
        if (x.dtype == torch.float8_e4m3fn) != (scales is not None):
            raise ValueError("FP8 x must come as (x_fp8, scales) with float32 scales [num_tokens, ceil(hidden/128)]")
        t = x.shape[0]
        if t > capacity:
            raise ValueError(f"{t} tokens exceed num_max_tokens_per_rank = {capacity}")
        if scales is not None and (scales.dtype != torch.float32 or tuple(scales.shape) != (t, -(-self.hidden // 128))):
            raise ValueError(
                f"scales must be float32 [{t}, {-(-self.hidden // 128)}], got {scales.dtype} {tuple(scales.shape)}"
            )
        self._check_topk(topk_idx, t)
        if topk_weights is not None and tuple(topk_weights.shape) != (t, self.num_topk):
            raise ValueError(f"topk_weights must be [{t}, {self.num_topk}], got {tuple(topk_weights.shape)}")

    # normal mode

    def dispatch(
        self,
        x,
        topk_idx=None,
        topk_weights=None,
        expert_alignment: int = 1,
        expand: bool = False,
        handle: DispatchHandle | None = None,
    ):
        """Send each token to every rank holding one of its experts.

        Parameters
        ----------
        x : Tensor [T, hidden] (bf16/fp16/fp32) or tuple (x_fp8 [T, hidden] e4m3, scales [T, ceil(hidden/128)] f32)
        topk_idx : Tensor [T, num_topk] int32/int64, values in [-1, num_experts)
        topk_weights : Tensor [T, num_topk] float32, optional (zeros if omitted)
        expert_alignment : int
            Per-expert counts (and expanded groups) are padded to a multiple of this.
        expand : bool
            Also return one row per (token, local expert), grouped by expert (see module doc).
        handle : DispatchHandle, optional
            Reuse a previous layout (cached dispatch): skips the layout exchange; topk come from it.

        Returns
        -------
        recv_x : Tensor [R, hidden] (or (fp8, scales)); with ``expand=True`` [X, hidden] expanded rows
        recv_topk_idx : Tensor [R, num_topk] local expert ids, -1 elsewhere
        recv_topk_weights : Tensor [R, num_topk] float32
        num_recv_tokens_per_expert : list[int], per local expert, aligned to ``expert_alignment``
        handle : DispatchHandle (``handle.m_indices`` when expanded: see :attr:`DispatchHandle`)
        """
        scales = None
        if isinstance(x, (tuple, list)):
            x, scales = x
        if handle is not None:
            return self._dispatch_cached(x, scales, handle)
        w, L = self.world_size, self.num_local_experts
        error = None
        try:
            if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment < 1:
                raise ValueError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
            self._validate_dispatch(x, scales, topk_idx, topk_weights, self.num_max_tokens_per_rank)
            if topk_weights is not None and not isinstance(topk_weights, torch.Tensor):
                raise ValueError(f"topk_weights must be a tensor, got {type(topk_weights).__name__}")
        except Exception as exc:  # every rank must learn of it: no exception may skip the agreement
            error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        meta_rows = []
        if error is None:
            # Word 0 of the layout message: the row format, which every rank must share.
            fmt = 1 + 2 * _ROW_DTYPES.index(x.dtype) + int(scales is not None)
            _, _, in_rank = self.get_dispatch_layout(topk_idx)
            tokens = [in_rank[:, r].nonzero().flatten() for r in range(w)]
            ids = topk_idx.long()
            for r in range(w):
                loc = ids[tokens[r]] - r * L
                counts = torch.bincount(loc[(loc >= 0) & (loc < L)], minlength=L)
                meta_rows.append(torch.cat([torch.tensor([fmt, tokens[r].numel()]), counts]))
        # The layout exchange doubles as the validation agreement: a bad call fails on every rank here.
        got = self._agree_rows(error, meta_rows, 2 + L)
        formats = [int(g[0]) for g in got]
        if len(set(formats)) != 1:  # every rank sees every rank's format, so every rank raises
            names = [
                f"rank {r}: {_ROW_DTYPES[(f - 1) // 2]}{' + FP8 scales' if (f - 1) % 2 else ''}"
                for r, f in enumerate(formats)
            ]
            raise ValueError("dispatch rows differ in format across ranks (" + "; ".join(names) + ")")
        recv_counts = [int(g[1]) for g in got]
        if topk_weights is None:
            topk_weights = torch.zeros(topk_idx.shape, dtype=torch.float32)
        with self._guard("dispatch"):
            recv = self._send_rows(x, scales, topk_idx, topk_weights.float(), tokens, recv_counts)
        recv_x, recv_scales, recv_idx, recv_w = recv
        recv_idx = recv_idx.to(topk_idx.dtype)
        return self._finish_dispatch(
            recv_x, recv_scales, recv_idx, recv_w, tokens, recv_counts, x.shape[0], expand, expert_alignment
        )

    def _agree_rows(self, error: str | None, rows: list[torch.Tensor], num_words: int) -> list[torch.Tensor]:
        """Send each destination its int64 meta row (or this rank's error); raise if any rank failed."""
        w = self.world_size
        nbytes = num_words * 8 + _META_MSG
        send = []
        for r in range(w):
            msg = torch.zeros(nbytes, dtype=torch.uint8)
            if error is None:
                msg[: num_words * 8].copy_(rows[r].view(torch.uint8))
            else:
                msg[:8].view(torch.int64)[0] = -1
                raw = error.encode()[: _META_MSG - 1]
                msg[num_words * 8 : num_words * 8 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
            send.append(msg)
        got = self.buffer.all_to_all(send, [nbytes] * w, self._region, tag="layout")
        errors = []
        for src, g in enumerate(got):
            if int(g[:8].view(torch.int64)[0]) == -1:
                text = bytes(g[num_words * 8 :].tolist()).rstrip(b"\0").decode(errors="replace")
                errors.append(f"rank {src}: {text}")
        if errors:
            raise ValueError("dispatch rejected on every rank before any data moved: " + "; ".join(errors))
        return [g[: num_words * 8].view(torch.int64) for g in got]

    def _send_rows(self, x, scales, topk_idx, topk_weights, tokens, recv_counts):
        """Move rows; returns (recv_x, recv_scales, recv_idx int32, recv_w float32), rows by source then token."""
        w, L, K, h = self.world_size, self.num_local_experts, self.num_topk, self.hidden
        xb, sb = x.element_size() * h, (4 * scales.shape[1] if scales is not None else 0)
        x_bytes = x.contiguous().view(torch.uint8).view(x.shape[0], xb)
        s_bytes = scales.contiguous().view(torch.uint8).view(x.shape[0], sb) if scales is not None else None
        ids = topk_idx.long()
        ex = self.buffer.exchange(self._region, tag="dispatch")

        def blocks(n):  # byte offsets of the field blocks of an n-row message
            o_x = 0
            o_s = _al(o_x + n * xb)
            o_i = _al(o_s + n * sb)
            o_w = _al(o_i + n * 4 * K)
            o_t = _al(o_w + n * 4 * K)
            return o_x, o_s, o_i, o_w, o_t, _al(o_t + n * 4)

        for step in range(w):
            dst = (self.rank + step) % w
            t = tokens[dst]
            n = t.numel()
            if n == 0:
                ex.commit(dst, 0)
                continue
            o_x, o_s, o_i, o_w, o_t, end = blocks(n)
            region = ex.send_region(dst)
            torch.index_select(x_bytes, 0, t, out=region[o_x : o_x + n * xb].view(n, xb))
            if s_bytes is not None:
                torch.index_select(s_bytes, 0, t, out=region[o_s : o_s + n * sb].view(n, sb))
            loc = ids[t] - dst * L
            loc = torch.where((ids[t] >= 0) & (loc >= 0) & (loc < L), loc, -1)
            region[o_i : o_i + n * 4 * K].view(torch.int32).view(n, K).copy_(loc)
            torch.index_select(topk_weights, 0, t, out=region[o_w : o_w + n * 4 * K].view(torch.float32).view(n, K))
            region[o_t : o_t + n * 4].view(torch.int32).copy_(t)
            ex.commit(dst, end)
        total = sum(recv_counts)
        recv_x = torch.empty((total, xb), dtype=torch.uint8)
        recv_s = torch.empty((total, sb), dtype=torch.uint8) if s_bytes is not None else None
        recv_i = torch.empty((total, K), dtype=torch.int32)
        recv_w = torch.empty((total, K), dtype=torch.float32)
        views = ex.receive([blocks(n)[5] if n else 0 for n in recv_counts])
        row = 0
        for src, v in enumerate(views):
            n = recv_counts[src]
            if n:
                o_x, o_s, o_i, o_w, _, _ = blocks(n)
                recv_x[row : row + n].copy_(v[o_x : o_x + n * xb].view(n, xb))
                if recv_s is not None:
                    recv_s[row : row + n].copy_(v[o_s : o_s + n * sb].view(n, sb))
                recv_i[row : row + n].copy_(v[o_i : o_i + n * 4 * K].view(torch.int32).view(n, K))
                recv_w[row : row + n].copy_(v[o_w : o_w + n * 4 * K].view(torch.float32).view(n, K))
            row += n
        ex.release()
        recv_x = recv_x.view(x.dtype).view(total, h)
        recv_s = recv_s.view(torch.float32).view(total, -1) if recv_s is not None else None
        return recv_x, recv_s, recv_i, recv_w

    def _finish_dispatch(
        self, recv_x, recv_scales, recv_idx, recv_w, tokens, recv_counts, num_tokens, expand, alignment
    ):
        L = self.num_local_experts
        valid = recv_idx >= 0
        counts = torch.bincount(recv_idx[valid].long(), minlength=L)
        self.recv_tokens_per_expert_total += counts
        aligned = [int(-(-c // alignment) * alignment) for c in counts.tolist()]
        rows = slot = None
        out_x, out_s = recv_x, recv_scales
        if expand:
            rows, slot = self._expanded_layout(recv_idx, counts, alignment)
            from epkit.gather import gather_rows

            out_x = gather_rows(recv_x, rows)
            out_s = gather_rows(recv_scales, rows) if recv_scales is not None else None
        handle = DispatchHandle(
            send_tokens=tokens,
            recv_counts=recv_counts,
            num_tokens=num_tokens,
            recv_topk_idx=recv_idx,
            recv_topk_weights=recv_w,
            expand=expand,
            expert_alignment=alignment,
            expanded_rows=rows,
            expanded_slot=slot,
        )
        x_out = (out_x, out_s) if out_s is not None else out_x
        return x_out, recv_idx, recv_w, aligned, handle

    def _expanded_layout(self, recv_idx: torch.Tensor, counts: torch.Tensor, alignment: int):
        """Rows per (received token, local expert), by expert then received order; groups padded with -1."""
        r, k = recv_idx.shape
        L = self.num_local_experts
        flat = recv_idx.long().reshape(-1)
        sel = (flat >= 0).nonzero().flatten()  # (j, k) pairs in (j, k) order
        order = torch.sort(flat[sel], stable=True).indices
        pairs = sel[order]  # grouped by expert, within by received row
        sizes = counts.tolist()
        padded = [-(-c // alignment) * alignment for c in sizes]
        starts = torch.tensor([0] + padded[:-1], dtype=torch.int64).cumsum(0) if L else torch.zeros(0)
        rows = torch.full((sum(padded),), -1, dtype=torch.int64)
        slot = torch.full((r * k,), -1, dtype=torch.int64)
        pos_in_group = torch.arange(pairs.numel()) - torch.repeat_interleave(
            torch.tensor([0] + sizes[:-1], dtype=torch.int64).cumsum(0), torch.tensor(sizes)
        )
        dest = starts[flat[pairs]] + pos_in_group
        rows[dest] = pairs // k
        slot[pairs] = dest
        return rows, slot.view(r, k)

    @staticmethod
    def m_indices(handle: DispatchHandle) -> torch.Tensor:
        """``[X] int32`` local expert id per expanded row, -1 on padding (the contiguous grouped GEMM's input)."""
        if not handle.expand:
            raise ValueError("m_indices needs a dispatch with expand=True")
        rows = handle.expanded_rows
        out = torch.full(rows.shape, -1, dtype=torch.int32)
        ok = handle.expanded_slot >= 0
        flat_slot = handle.expanded_slot[ok]
        out[flat_slot] = handle.recv_topk_idx[ok].to(torch.int32)
        return out

    def _dispatch_cached(self, x, scales, handle: DispatchHandle):
        try:
            if not isinstance(x, torch.Tensor) or x.dim() != 2:
                raise ValueError(f"x must be [num_tokens, {self.hidden}]")
            self._validate_dispatch(
                x,
                scales,
                torch.zeros((x.shape[0], self.num_topk), dtype=torch.int64),
                None,
                self.num_max_tokens_per_rank,
            )
            if x.shape[0] != handle.num_tokens:
                raise ValueError(
                    f"cached dispatch: x has {x.shape[0]} tokens, the handle was made for {handle.num_tokens}"
                )
        except ValueError as exc:
            self._reject_locally("cached dispatch", exc)
        dummy_idx = torch.full((x.shape[0], self.num_topk), -1, dtype=torch.int64)
        dummy_w = torch.zeros((x.shape[0], self.num_topk), dtype=torch.float32)
        with self._guard("cached dispatch"):
            recv_x, recv_s, _, _ = self._send_rows(
                x, scales, dummy_idx, dummy_w, handle.send_tokens, handle.recv_counts
            )
        out_x, out_s = recv_x, recv_s
        if handle.expand:
            from epkit.gather import gather_rows

            out_x = gather_rows(recv_x, handle.expanded_rows)
            out_s = gather_rows(recv_s, handle.expanded_rows) if recv_s is not None else None
        x_out = (out_x, out_s) if out_s is not None else out_x
        L, a = self.num_local_experts, handle.expert_alignment
        counts = torch.bincount(handle.recv_topk_idx[handle.recv_topk_idx >= 0].long(), minlength=L)
        aligned = [int(-(-c // a) * a) for c in counts.tolist()]
        return x_out, handle.recv_topk_idx, handle.recv_topk_weights, aligned, handle

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None, bias=None
    ) -> torch.Tensor:
        """Return every token's expert outputs to its source rank and sum them there.

        Parameters
        ----------
        y : Tensor [R, hidden] (normal: one row per received row, routing weights already applied)
            or [X, hidden] (``expand=True``: one row per expanded row; weighted here)
        handle : DispatchHandle from the matching dispatch
        topk_weights : Tensor [R, num_topk], optional
            Expanded mode: weights to apply (default: the weights carried in the handle).
        bias : Tensor [T, hidden] or a tuple of up to two, optional
            Added after the sum (e.g. the shared expert's output).

        Returns
        -------
        Tensor [T, hidden] of ``y.dtype``: float32 accumulation in a fixed order.
        """
        h = self.hidden
        try:
            biases = _check_biases(bias, handle.num_tokens, h)
            want_rows = handle.expanded_rows.numel() if handle.expand else sum(handle.recv_counts)
            if (
                not isinstance(y, torch.Tensor)
                or y.dim() != 2
                or tuple(y.shape) != (want_rows, h)
                or y.dtype not in (torch.bfloat16, torch.float32, torch.float16)
            ):
                raise ValueError(
                    f"y must be bf16/fp16/fp32 [{want_rows}, {h}], got {getattr(y, 'dtype', None)} "
                    f"{tuple(getattr(y, 'shape', ()))}"
                )
            weights = None
            if handle.expand:
                weights = handle.recv_topk_weights if topk_weights is None else topk_weights.float()
                if tuple(weights.shape) != tuple(handle.recv_topk_idx.shape):
                    raise ValueError(
                        f"topk_weights must be {tuple(handle.recv_topk_idx.shape)}, got {tuple(weights.shape)}"
                    )
        except ValueError as exc:
            self._reject_locally("combine", exc)
        with self._guard("combine"):
            return self._combine_rows(y, handle, weights, biases)

    def _combine_rows(self, y, handle: DispatchHandle, weights, biases) -> torch.Tensor:
        w, h = self.world_size, self.hidden
        y = y.contiguous()
        es = y.element_size()
        row_bytes = h * es
        ex = self.buffer.exchange(self._region, tag="combine")
        offs = [0]
        for c in handle.recv_counts:
            offs.append(offs[-1] + c)
        y_bytes = y.view(torch.uint8).view(-1, row_bytes)
        for step in range(w):
            dst = (self.rank + step) % w
            n = handle.recv_counts[dst]
            if n:
                region = ex.send_region(dst)[: n * row_bytes]
                if handle.expand:
                    # Expert side: the weighted sum over this rank's experts, written straight into dst's region.
                    slot = handle.expanded_slot[offs[dst] : offs[dst] + n]
                    addrs = torch.where(slot >= 0, y.data_ptr() + slot.clamp(min=0) * row_bytes, 0)
                    reduce_rows(region.view(y.dtype).view(n, h), addrs, y.dtype, weights[offs[dst] : offs[dst] + n])
                else:
                    region.view(n, row_bytes).copy_(y_bytes[offs[dst] : offs[dst] + n])
            ex.commit(dst, n * row_bytes)
        views = ex.receive([t.numel() * row_bytes for t in handle.send_tokens])
        # Source side: sum over destination ranks ascending, reading the received rows in place.
        addrs = torch.zeros((handle.num_tokens, w), dtype=torch.int64)
        for r in range(w):
            t = handle.send_tokens[r]
            if t.numel():
                addrs[t, r] = views[r].data_ptr() + torch.arange(t.numel(), dtype=torch.int64) * row_bytes
        out = torch.empty((handle.num_tokens, h), dtype=y.dtype)
        reduce_rows(out, addrs, y.dtype, None, biases)
        ex.release()
        return out

    # low-latency mode

    def _ll_row(self, use_fp8: bool) -> tuple[int, int]:
        """(x bytes, scale bytes) of one low-latency row."""
        h = self.hidden
        return (h, 4 * -(-h // 128)) if use_fp8 else (2 * h, 0)

    def _ll_header(self) -> int:
        """Header of a low-latency message: int32 [status, n_max, use_fp8, count per local expert], error text."""
        return _al(4 * (3 + self.num_local_experts)) + _META_MSG

    @staticmethod
    def _ll_errors(views, hdr: int, n_max: int | None, use_fp8: bool) -> list[str]:
        """Rejections and parameter mismatches seen in the received headers (identical on every rank)."""
        errors = []
        for src, v in enumerate(views):
            head = v[:12].view(torch.int32).tolist()
            if head[0] == -1:
                text = bytes(v[hdr - _META_MSG : hdr].tolist()).rstrip(b"\0").decode(errors="replace")
                errors.append(f"rank {src}: {text}")
            elif n_max is not None and (head[1] != n_max or head[2] != int(use_fp8)):
                errors.append(
                    f"rank {src} used num_max_dispatch_tokens_per_rank={head[1]}, use_fp8={bool(head[2])}"
                    f" but this rank {n_max}, {use_fp8}"
                )
        return errors

    def _ll_outputs(self, n_max: int, use_fp8: bool):
        """Persistent low-latency receive tensors (as DeepEP: valid until the next low-latency dispatch)."""
        key = (n_max, use_fp8)
        if key not in self._ll_cache:
            L, w, h = self.num_local_experts, self.world_size, self.hidden
            if use_fp8:
                recv_x = (
                    torch.zeros((L, n_max * w, h), dtype=torch.float8_e4m3fn),
                    torch.zeros((L, n_max * w, -(-h // 128)), dtype=torch.float32),
                )
            else:
                recv_x = torch.zeros((L, n_max * w, h), dtype=torch.bfloat16)
            self._ll_cache[key] = (recv_x, torch.zeros(L, dtype=torch.int32))
        return self._ll_cache[key]

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        use_fp8: bool = True,
        return_recv_hook: bool = False,
    ):
        """Fixed-slot dispatch into the masked layout (decode).

        Each (token, expert) pair goes to the expert's rank; every message has a
        fixed size, so shapes never depend on the routing.

        Parameters
        ----------
        x : Tensor [T, hidden] bfloat16, T <= num_max_dispatch_tokens_per_rank
        topk_idx : Tensor [T, num_topk] int32/int64 in [-1, num_experts)
        num_max_dispatch_tokens_per_rank : int
            Slots per (source rank, local expert); at most the buffer's capacity.
        use_fp8 : bool
            Send e4m3 rows with float32 per-128 scales (the grouped GEMM's activation format).
        return_recv_hook : bool
            Only send now; ``hook()`` waits and fills the outputs.

        Returns
        -------
        recv_x : Tensor [num_local_experts, N * W, hidden] bf16, or (e4m3 tensor, scales [L, N*W, hidden/128])
            Rows of expert e ordered by source rank, then source token order; rows past
            ``recv_count[e]`` are unspecified. Like DeepEP's, these tensors are owned by the
            buffer and reused: they stay valid until the next low-latency dispatch (clone to keep).
        recv_count : Tensor [num_local_experts] int32
        handle : LowLatencyHandle
        hook : callable; waits for the data (a no-op when ``return_recv_hook`` is False). Call it
            before the next collective on this buffer.
        """
        n_max = num_max_dispatch_tokens_per_rank
        w, L, K, h = self.world_size, self.num_local_experts, self.num_topk, self.hidden
        xb, sb = self._ll_row(use_fp8)
        hdr = self._ll_header()
        # Every message has the same size on every rank (the buffer's capacity, bf16 rows), so a rank that
        # rejects its input still takes part in the exchange, whatever it passed.
        msg_bytes = min(self._region, hdr + L * self.num_max_dispatch_tokens_per_rank * 2 * h)
        error = None
        try:
            if (
                isinstance(n_max, bool)
                or not isinstance(n_max, int)
                or not 0 < n_max <= self.num_max_dispatch_tokens_per_rank
            ):
                raise ValueError(
                    f"num_max_dispatch_tokens_per_rank must be in [1, "
                    f"{self.num_max_dispatch_tokens_per_rank}], got {n_max!r}"
                )
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h or x.dtype != torch.bfloat16:
                raise ValueError(
                    f"x must be bfloat16 [num_tokens, {h}], got {getattr(x, 'dtype', None)} "
                    f"{tuple(getattr(x, 'shape', ()))}"
                )
            if x.shape[0] > n_max:
                raise ValueError(f"{x.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank = {n_max}")
            self._check_topk(topk_idx, x.shape[0])
            t_num = x.shape[0]
            ids = topk_idx.long()
            flat = ids.reshape(-1)
            sel = (flat >= 0).nonzero().flatten()  # (t, k) pairs in token order
            order = torch.sort(flat[sel], stable=True).indices
            pairs = sel[order]  # grouped by expert, token order within
            e_sorted = flat[pairs]
            counts_e = torch.bincount(e_sorted, minlength=self.num_experts)
            if counts_e.numel() and int(counts_e.max()) > n_max:
                e = int(counts_e.argmax())
                raise ValueError(
                    f"expert {e} gets {int(counts_e[e])} (token, expert) pairs from this rank, more than "
                    f"its {n_max} slots (duplicate expert ids within a token?)"
                )
            if hdr + L * n_max * (xb + sb) > msg_bytes:
                raise ValueError(f"low-latency message exceeds the {self._region}-byte region")
        except Exception as exc:  # every rank must learn of it through the message header
            error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        ex = self.buffer.exchange(self._region, tag="ll_dispatch")
        if error is not None:
            for dst in range(w):  # tell every rank, finish the exchange so the counters stay in step, then fail
                region = ex.send_region(dst)
                region[:4].view(torch.int32)[0] = -1
                raw = error.encode()[: _META_MSG - 1]
                region[hdr - _META_MSG : hdr - _META_MSG + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
                ex.commit(dst, msg_bytes)
            errors = self._ll_errors(ex.receive([msg_bytes] * w), hdr, None, use_fp8)
            ex.release()
            raise ValueError("low-latency dispatch rejected on every rank: " + "; ".join(errors))
        starts = torch.cumsum(counts_e, 0) - counts_e
        pos_sorted = torch.arange(pairs.numel()) - starts[e_sorted]
        pos_of = torch.full((t_num * K,), -1, dtype=torch.int64)
        pos_of[pairs] = pos_sorted
        dst_of = torch.where(ids >= 0, ids // L, torch.full_like(ids, -1))
        expert_of = torch.where(ids >= 0, ids % L, torch.full_like(ids, -1))
        with self._guard("low-latency dispatch"):
            if use_fp8:
                from epkit.quant import per_token_group_cast_to_fp8

                xq, xs = per_token_group_cast_to_fp8(x, 128)
                x_bytes = xq.view(torch.uint8)
                s_bytes = xs.contiguous().view(torch.uint8).view(t_num, sb)
            else:
                x_bytes = x.contiguous().view(torch.uint8).view(t_num, xb)
                s_bytes = None
            tok_sorted = pairs // K
            counts_by_rank = counts_e.view(w, L)
            for step in range(w):
                dst = (self.rank + step) % w
                region = ex.send_region(dst)
                head = region[: 4 * (3 + L)].view(torch.int32)
                head[0], head[1], head[2] = 0, n_max, int(use_fp8)
                head[3:].copy_(counts_by_rank[dst])
                lo, hi = int(starts[dst * L]), int(starts[dst * L] + counts_by_rank[dst].sum())
                if hi > lo:
                    el = e_sorted[lo:hi] - dst * L
                    slot = el * n_max + pos_sorted[lo:hi]
                    rows = region[hdr : hdr + L * n_max * xb].view(L * n_max, xb)
                    _copy_rows(rows, slot, x_bytes, tok_sorted[lo:hi])
                    if s_bytes is not None:
                        base = hdr + L * n_max * xb
                        srows = region[base : base + L * n_max * sb].view(L * n_max, sb)
                        _copy_rows(srows, slot, s_bytes, tok_sorted[lo:hi])
                ex.commit(dst, msg_bytes)
        recv_x, recv_count = self._ll_outputs(n_max, use_fp8)
        handle = LowLatencyHandle(
            num_tokens=t_num,
            dst_of=dst_of,
            expert_of=expert_of,
            pos_of=pos_of.view(t_num, K),
            counts=torch.zeros((w, L), dtype=torch.int64),
            n_max=n_max,
        )
        state = {"done": False}

        def hook():
            if state["done"]:
                return
            with self._guard("low-latency dispatch receive"):
                views = ex.receive([msg_bytes] * w)
            errors = self._ll_errors(views, hdr, n_max, use_fp8)
            if errors:
                ex.release()
                raise ValueError("low-latency dispatch rejected on every rank: " + "; ".join(errors))
            counts = torch.stack([v[12 : 4 * (3 + L)].view(torch.int32).long() for v in views])  # [W, L]
            handle.counts = counts
            xv = recv_x[0] if use_fp8 else recv_x
            x_dst = xv.view(torch.uint8).view(L * n_max * w, xb)
            s_dst = recv_x[1].view(torch.uint8).view(L * n_max * w, sb) if use_fp8 else None
            starts = torch.cumsum(counts, 0) - counts  # [W, L]: where each source's rows start per expert
            for src in range(w):
                src_rows, dst_rows = _block_rows(counts[src], starts[src], n_max, n_max * w)
                if src_rows.numel():
                    v = views[src]
                    _copy_rows(x_dst, dst_rows, v[hdr : hdr + L * n_max * xb].view(L * n_max, xb), src_rows)
                    if s_dst is not None:
                        base = hdr + L * n_max * xb
                        _copy_rows(s_dst, dst_rows, v[base : base + L * n_max * sb].view(L * n_max, sb), src_rows)
            recv_count.copy_(counts.sum(0).to(torch.int32))
            ex.release()
            self.recv_tokens_per_expert_total += recv_count.long()
            state["done"] = True

        if not return_recv_hook:
            hook()
        return recv_x, recv_count, handle, hook

    def low_latency_combine(
        self,
        y: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        return_recv_hook: bool = False,
    ):
        """Send expert outputs back and reduce them at the source.

        Parameters
        ----------
        y : Tensor [num_local_experts, N * W, hidden] bfloat16 (the masked layout of the dispatch)
        topk_idx, topk_weights : Tensor [T, num_topk] as given to the dispatch (weights float32)
        handle : LowLatencyHandle

        Returns
        -------
        Tensor [T, hidden] bfloat16: ``sum over k ascending of w[t, k] * y_row(t, k)`` in float32
        (and the hook, if ``return_recv_hook``).
        """
        w, L, K, h = self.world_size, self.num_local_experts, self.num_topk, self.hidden
        t_num = handle.num_tokens
        n_max = handle.n_max
        try:
            want = (L, n_max * w, h)
            if not isinstance(y, torch.Tensor) or y.dtype != torch.bfloat16 or tuple(y.shape) != want:
                raise ValueError(
                    f"y must be bfloat16 {want} (the dispatch's masked layout), got "
                    f"{getattr(y, 'dtype', None)} {tuple(getattr(y, 'shape', ()))}"
                )
            if tuple(topk_idx.shape) != (t_num, K) or tuple(topk_weights.shape) != (t_num, K):
                raise ValueError(f"topk_idx and topk_weights must be [{t_num}, {K}]")
        except ValueError as exc:
            self._reject_locally("low-latency combine", exc)
        row = 2 * h
        msg_bytes = L * n_max * row
        with self._guard("low-latency combine"):
            return self._ll_combine(y, topk_weights, handle, msg_bytes, row, return_recv_hook)

    def _ll_combine(self, y, topk_weights, handle: LowLatencyHandle, msg_bytes: int, row: int, return_recv_hook):
        w, L, h = self.world_size, self.num_local_experts, self.hidden
        t_num, n_max = handle.num_tokens, handle.n_max
        ex = self.buffer.exchange(self._region, tag="ll_combine")
        yb = y.contiguous().view(torch.uint8).view(L, n_max * w, row)
        starts = torch.cumsum(handle.counts, 0) - handle.counts  # [W, L] offset of each source within expert rows
        y_rows = yb.view(L * n_max * w, row)
        for step in range(w):
            src = (self.rank + step) % w
            region = ex.send_region(src)[:msg_bytes].view(L * n_max, row)
            slots, rows = _block_rows(handle.counts[src], starts[src], n_max, n_max * w)
            if slots.numel():
                _copy_rows(region, slots, y_rows, rows)
            ex.commit(src, msg_bytes)
        out = {}

        def hook():
            if "y" in out:
                return out["y"]
            with self._guard("low-latency combine receive"):
                views = ex.receive([msg_bytes] * w)
                bases = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64)
                ok = handle.dst_of >= 0
                slot = handle.expert_of.clamp(min=0) * n_max + handle.pos_of.clamp(min=0)
                addrs = torch.where(ok, bases[handle.dst_of.clamp(min=0)] + slot * row, 0)
                res = torch.empty((t_num, h), dtype=torch.bfloat16)
                reduce_rows(res, addrs, torch.bfloat16, topk_weights.float())
                ex.release()
            out["y"] = res
            return out["y"]

        if return_recv_hook:
            return None, hook
        return hook()
