"""Engram: hashed n-gram embeddings (hash ABI of DeepSeek's public Engram demo); the layer is in ``engram_layer``.

An Engram layer looks up, for every token, ``(N-1) * K`` rows of a large
embedding table: for each n-gram order ``n = 2..N`` and each of ``K`` heads, the
row is a multiplicative-XOR hash of the last ``n`` (compressed) token ids
modulo a per-head prime, plus the head's offset in the table. Hashes depend on
token ids only, so the lookup can start before the model's layers run.

Hash ABI (``hash_params``), per the public demo ``engram_demo_v1.py``:

* ``half_bound = max(1, (INT64_MAX // vocab_size) // 2)``; per layer,
  ``r = numpy.random.default_rng(seed + 10007 * layer_id).integers(0, half_bound, N, dtype=int64)``
  and ``multipliers = 2 * r + 1``;
* head table sizes are distinct primes: layers in order, orders ``n = 2..N``
  in order, the search starts at ``ngram_vocab_sizes[n-2] - 1`` and each head
  takes the next prime strictly above the start that no earlier head of any
  layer took; the start moves to that prime;
* offsets are the exclusive prefix sum of a layer's head sizes (order 2 first).

``engram_hash`` (the op, interface of TileKernels' ``engram_hash``)::

    h[l, t, k]  = XOR_{k' <= k} ids[t, k'] * multipliers[l, k']      (int64, wrapping)
    out[l, t, (k-1)*K + j] = h[l, t, k] mod vocab_sizes[l, k-1, j] + offsets[l, (k-1)*K + j]

for ``k >= 1``, where column ``k`` of ``ids`` is the token at ``t - k`` and
``mod`` is numpy's int64 ``%`` (floor-mod: the result is in ``[0, d)``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from epkit._details.engram_cpu import engram_hash_cpu, float_mod_table
from epkit._details.engram_params import INT32_MAX, check_ids, hash_params_np, is_prime, kernel_tables
from epkit.backends import ALL_BACKENDS_CUDA, OpSpec, register_op, select

__all__ = [
    "EngramConfig",
    "hash_params",
    "engram_hash",
    "engram_hash_reference",
    "hash_tokens",
    "DEMO_NGRAM_VOCAB_SIZE",
]

#: The demo's default table size per n-gram order: 5 x DeepSeek-V3's 129,280-token vocabulary.
DEMO_NGRAM_VOCAB_SIZE = 129280 * 5


# Configuration


@dataclasses.dataclass(frozen=True)
class EngramConfig:
    """Engram hashing configuration (field names and defaults of the public demo).

    Parameters
    ----------
    vocab_size : int
        Size of the (optionally compressed) token vocabulary the hash sees; ids
        fed to the hash are in ``[0, vocab_size)``.
    max_ngram_size : int
        ``N``: orders ``2..N`` are hashed. Default 3.
    n_head_per_ngram : int
        ``K``: hash heads per order. Default 8.
    n_embed_per_ngram : int
        Embedding width per order; each head row has ``n_embed_per_ngram // K`` values. Default 512.
    layer_ids : tuple of int
        Model layers that hold an Engram layer, in order. Default ``(1, 15)``.
    pad_id : int
        Token id (raw, before the lookup table) for positions before a sequence start. Default 2.
    seed : int
        Base seed of the multipliers. Default 0.
    ngram_vocab_sizes : tuple of int, optional
        Target table size per order (``N - 1`` values, the prime search starts
        just below each). Default: the demo's ``DEMO_NGRAM_VOCAB_SIZE``
        (``129280 * 5``) for every order.
    """

    vocab_size: int
    max_ngram_size: int = 3
    n_head_per_ngram: int = 8
    n_embed_per_ngram: int = 512
    layer_ids: tuple[int, ...] = (1, 15)
    pad_id: int = 2
    seed: int = 0
    ngram_vocab_sizes: tuple[int, ...] | None = None

    def __post_init__(self):
        def bad(name, value, want):
            raise ValueError(f"EngramConfig.{name} = {value!r}: expected {want}")

        for name in ("vocab_size", "max_ngram_size", "n_head_per_ngram", "n_embed_per_ngram", "pad_id", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                bad(name, v, "an int")
        if self.vocab_size < 1:
            bad("vocab_size", self.vocab_size, ">= 1")
        if self.max_ngram_size < 2:
            bad("max_ngram_size", self.max_ngram_size, ">= 2 (orders 2..N are hashed)")
        if self.n_head_per_ngram < 1:
            bad("n_head_per_ngram", self.n_head_per_ngram, ">= 1")
        if self.n_embed_per_ngram < 1 or self.n_embed_per_ngram % self.n_head_per_ngram:
            bad(
                "n_embed_per_ngram",
                self.n_embed_per_ngram,
                f"a positive multiple of n_head_per_ngram ({self.n_head_per_ngram})",
            )
        if self.pad_id < 0:
            bad("pad_id", self.pad_id, ">= 0")
        ids = tuple(int(i) for i in self.layer_ids)
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            bad("layer_ids", self.layer_ids, "a non-empty sequence of distinct non-negative ints")
        object.__setattr__(self, "layer_ids", ids)
        sizes = self.ngram_vocab_sizes
        if sizes is None:
            sizes = (DEMO_NGRAM_VOCAB_SIZE,) * (self.max_ngram_size - 1)
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != self.max_ngram_size - 1 or min(sizes) < 2:
            bad("ngram_vocab_sizes", self.ngram_vocab_sizes, f"{self.max_ngram_size - 1} ints >= 2 (one per order)")
        object.__setattr__(self, "ngram_vocab_sizes", sizes)

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_heads(self) -> int:
        """``(N - 1) * K``: table rows looked up per token and layer."""
        return (self.max_ngram_size - 1) * self.n_head_per_ngram

    @property
    def head_dim(self) -> int:
        return self.n_embed_per_ngram // self.n_head_per_ngram


def hash_params(config: EngramConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multipliers, per-head prime table sizes and row offsets of every Engram layer (the demo's ABI).

    Parameters
    ----------
    config : EngramConfig

    Returns
    -------
    multipliers : Tensor [L, N] int64
        Odd, per layer: ``2 * default_rng(seed + 10007 * layer_id).integers(0, half_bound, N) + 1``.
    vocab_sizes : Tensor [L, N-1, K] int32
        Distinct primes across all heads and layers (see the module docstring).
    offsets : Tensor [L, (N-1)*K] int32
        Exclusive prefix sum of each layer's head sizes (order 2 first).

    Raises
    ------
    ValueError
        A layer's total rows overflow int32 row ids.
    """
    mult, vocab, off = hash_params_np(config)
    return torch.from_numpy(mult.copy()), torch.from_numpy(vocab.copy()), torch.from_numpy(off.copy())


# Reference


def engram_hash_reference(
    ngram_token_ids: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Readable specification in numpy int64 (wrapping products, floor-mod), one head at a time."""
    ids = ngram_token_ids.cpu().numpy().astype(np.int64)
    mult = multipliers.cpu().numpy()
    vocab = vocab_sizes.cpu().numpy().astype(np.int64)
    off = offsets.cpu().numpy().astype(np.int64)
    num_layers, orders, heads = vocab.shape
    out = np.empty((num_layers, ids.shape[0], orders * heads), dtype=np.int32)
    for layer in range(num_layers):
        mix = ids[:, 0] * mult[layer, 0]
        for k in range(1, orders + 1):
            mix = np.bitwise_xor(mix, ids[:, k] * mult[layer, k])
            for j in range(heads):
                col = (k - 1) * heads + j
                out[layer, :, col] = mix % vocab[layer, k - 1, j] + off[layer, col]
    return torch.from_numpy(out).to(ngram_token_ids.device)


# Implementation


def _validate_hash_args(ids, mult, vocab, off, out) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.int32 or ids.shape[1] < 2:
        raise ValueError(
            f"ngram_token_ids must be an int32 tensor [T, N] with N >= 2, got "
            f"{getattr(ids, 'dtype', type(ids).__name__)} of shape {tuple(getattr(ids, 'shape', ()))}"
        )
    n = ids.shape[1]
    if not isinstance(mult, torch.Tensor) or mult.dtype != torch.int64 or mult.dim() != 2:
        raise ValueError(
            f"multipliers must be int64 [L, N], got {getattr(mult, 'dtype', None)} {tuple(getattr(mult, 'shape', ()))}"
        )
    if mult.shape[1] != n:  # the parameters fix N (max_ngram_size); the ids are what the caller built
        raise ValueError(
            f"ngram_token_ids has N = {n} columns, but the hash parameters are for N = {mult.shape[1]} "
            f"(multipliers {tuple(mult.shape)}, max_ngram_size of the EngramConfig): ngram_token_ids must be "
            f"[T, {mult.shape[1]}], got {tuple(ids.shape)}"
        )
    num_layers = mult.shape[0]
    if (
        not isinstance(vocab, torch.Tensor)
        or vocab.dtype != torch.int32
        or vocab.dim() != 3
        or tuple(vocab.shape[:2]) != (num_layers, n - 1)
        or vocab.shape[2] < 1
    ):
        raise ValueError(
            f"vocab_sizes must be int32 [{num_layers}, {n - 1}, K>=1], got "
            f"{getattr(vocab, 'dtype', None)} {tuple(getattr(vocab, 'shape', ()))}"
        )
    num_heads = (n - 1) * vocab.shape[2]
    if not isinstance(off, torch.Tensor) or off.dtype != torch.int32 or tuple(off.shape) != (num_layers, num_heads):
        raise ValueError(
            f"offsets must be int32 [{num_layers}, {num_heads}], got "
            f"{getattr(off, 'dtype', None)} {tuple(getattr(off, 'shape', ()))}"
        )
    for name, t in (("multipliers", mult), ("vocab_sizes", vocab), ("offsets", off)):
        if t.device != ids.device:
            raise ValueError(f"{name} is on {t.device} but ngram_token_ids is on {ids.device}")
    sizes = vocab.reshape(-1).tolist()
    seen: dict[int, int] = {}
    for i, d in enumerate(sizes):
        if not is_prime(d):
            raise ValueError(f"vocab_sizes.flatten()[{i}] = {d} is not a prime (head table sizes must be primes)")
        if d in seen:
            raise ValueError(
                f"vocab_sizes.flatten()[{i}] = {d} repeats vocab_sizes.flatten()[{seen[d]}] "
                "(head sizes must be distinct)"
            )
        seen[d] = i
    last = off.to(torch.int64) + vocab.reshape(num_layers, num_heads).to(torch.int64)
    if num_layers and num_heads:
        if int(off.min()) < 0:
            i = int((off.reshape(-1) < 0).nonzero()[0])
            raise ValueError(f"offsets.flatten()[{i}] = {int(off.reshape(-1)[i])} is negative")
        if int(last.max()) > INT32_MAX + 1:
            i = int(last.reshape(-1).argmax())
            raise ValueError(
                f"offsets.flatten()[{i}] + vocab size = {int(last.reshape(-1)[i])} rows overflows int32 row ids "
                f"(at most {INT32_MAX + 1})"
            )
    if out is not None:
        want = (num_layers, ids.shape[0], num_heads)
        if tuple(out.shape) != want or out.dtype != torch.int32 or out.device != ids.device or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous int32 tensor {want} on {ids.device}, got {out.dtype} "
                f"{tuple(out.shape)} on {out.device}"
            )


def engram_hash(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Table row of every (layer, token, order, head): multiplicative-XOR n-gram hash mod a prime, plus offset.

    Parameters
    ----------
    ngram_token_ids : Tensor [T, N], int32
        Column ``k`` is the (compressed) token at ``t - k``, the pad id before a sequence start
        (see :func:`hash_tokens`).
    multipliers : Tensor [L, N], int64
    vocab_sizes : Tensor [L, N-1, K], int32
        Per-head table sizes: distinct primes (checked).
    offsets : Tensor [L, (N-1)*K], int32
        First row of each head's table; ``offsets + vocab_sizes`` must not exceed ``2**31`` (checked).
    out : Tensor [L, T, (N-1)*K], int32, optional
        Preallocated contiguous output.
    backend : str
        ``"auto"`` (default), ``"tilelang"``, ``"cpu"``, ``"triton"`` or ``"reference"``.

    Returns
    -------
    Tensor [L, T, (N-1)*K], int32
        ``out[l, t, (k-1)*K + j] = (XOR_{k'<=k} ids[t, k'] * multipliers[l, k']) mod vocab_sizes[l, k-1, j]
        + offsets[l, (k-1)*K + j]`` with int64 wrapping products and floor-mod (numpy's ``%``).

    Examples
    --------
    >>> cfg = EngramConfig(vocab_size=1000, ngram_vocab_sizes=(5000, 7000), n_head_per_ngram=2, layer_ids=(0,))
    >>> ids = torch.tensor([[5, 2, 2], [9, 5, 2]], dtype=torch.int32)
    >>> engram_hash(ids, *hash_params(cfg)).shape
    torch.Size([1, 2, 4])
    """
    _validate_hash_args(ngram_token_ids, multipliers, vocab_sizes, offsets, out)
    impl = select("engram_hash", ngram_token_ids.device, backend)
    num_layers, orders, heads = vocab_sizes.shape
    if impl == "reference":
        res = engram_hash_reference(ngram_token_ids, multipliers, vocab_sizes, offsets)
        return res if out is None else out.copy_(res)
    if out is None:
        out = torch.empty(
            (num_layers, ngram_token_ids.shape[0], orders * heads), dtype=torch.int32, device=ngram_token_ids.device
        )
    if out.numel() == 0:
        return out
    ids = ngram_token_ids.contiguous()
    if impl == "cpu":
        engram_hash_cpu(ids, multipliers, vocab_sizes, offsets, out)
        return out
    if impl == "tilelang" and ids.device.type == "cpu":
        from epkit.kernels.tilelang.engram import engram_hash_tokens_cpu

        engram_hash_tokens_cpu(ids, multipliers.contiguous(), float_mod_table(vocab_sizes, offsets), out)
        return out
    vocab64, inv, off64 = kernel_tables(vocab_sizes, offsets)
    if impl == "triton":
        from epkit.kernels.triton.engram import engram_hash_tokens
    else:
        from epkit.kernels.tilelang.engram import engram_hash_tokens
    engram_hash_tokens(ids, multipliers.contiguous(), vocab64, inv, off64, out)
    return out


# Token ids -> n-gram ids


def hash_tokens(
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: EngramConfig,
    lookup_table: torch.Tensor | None = None,
    prefix_tokens: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Engram table rows for a packed (varlen) batch of token ids, every layer of ``config``.

    Parameters
    ----------
    token_ids : Tensor [T], int32
        Raw token ids of ``B`` sequences packed back to back.
    cu_seqlens : Tensor [B+1], int32 or int64
        Sequence boundaries: ``0 = cu[0] <= cu[1] <= ... <= cu[B] = T``. N-grams never
        cross a boundary: positions before a sequence start take the pad id.
    config : EngramConfig
    lookup_table : Tensor [V_raw], int32, optional
        Tokenizer compression: raw id -> compressed id in ``[0, config.vocab_size)``.
        ``V_raw`` (the raw vocabulary) must be at least ``config.vocab_size`` and above
        ``config.pad_id``; the pad id is mapped through it too. Without it, ids are
        used as they are and must be below ``config.vocab_size``.
    prefix_tokens : Tensor [P], int32, optional, ``P <= N-1``
        Raw ids of the ``P`` tokens that precede ``token_ids[0]`` in its sequence (a
        context-parallel shard passes the tail of the previous shard), oldest first.
        They feed the first sequence only; positions before them take the pad id.
    backend : str
        Backend of :func:`engram_hash`.

    Returns
    -------
    Tensor [L, T, (N-1)*K], int32
        ``engram_hash(ngram_ids, *hash_params(config))`` where ``ngram_ids[t, k]`` is the
        compressed token at ``t - k`` in ``t``'s sequence, or the compressed pad id.
    """
    if not isinstance(config, EngramConfig):
        raise ValueError(f"config must be an EngramConfig, got {type(config).__name__}")
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.dtype != torch.int32:
        raise ValueError(
            f"token_ids must be a 1-D int32 tensor, got {getattr(token_ids, 'dtype', type(token_ids).__name__)} "
            f"of shape {tuple(getattr(token_ids, 'shape', ()))}"
        )
    device = token_ids.device
    cu = _check_cu_seqlens(cu_seqlens, token_ids.numel(), device)
    lookup_table, raw_vocab, pad = _compression(lookup_table, config, device)
    check_ids("token_ids", token_ids, raw_vocab, "the raw vocabulary")
    prefix_tokens = _check_prefix(prefix_tokens, config.max_ngram_size, raw_vocab, device)
    ngram_ids = _ngram_token_ids(token_ids, cu, config.max_ngram_size, pad, lookup_table, prefix_tokens)
    mult, vocab, off = (t.to(device) for t in hash_params(config))
    return engram_hash(ngram_ids, mult, vocab, off, backend=backend)


def _check_cu_seqlens(cu_seqlens, num_tokens: int, device) -> torch.Tensor:
    """``cu_seqlens`` as int64 on ``device`` once it is a valid ``[B+1]`` boundary list of ``num_tokens`` tokens."""
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.numel() < 1
        or cu_seqlens.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [B+1], got {cu_seqlens!r}")
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != num_tokens or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seqlens = {cu_seqlens.tolist()[:16]}... must start at 0, never decrease and end at T = {num_tokens}"
        )
    return cu


def _compression(lookup_table, config: EngramConfig, device):
    """``(lookup_table on device or None, raw vocabulary size, compressed pad id)`` after checking the table."""
    if lookup_table is None:
        if config.pad_id >= config.vocab_size:
            raise ValueError(f"pad_id = {config.pad_id} is outside [0, vocab_size = {config.vocab_size})")
        return None, config.vocab_size, config.pad_id
    if not isinstance(lookup_table, torch.Tensor) or lookup_table.dim() != 1 or lookup_table.dtype != torch.int32:
        raise ValueError(f"lookup_table must be a 1-D int32 tensor, got {getattr(lookup_table, 'dtype', None)}")
    raw_vocab = lookup_table.numel()
    if raw_vocab < config.vocab_size or raw_vocab <= config.pad_id:
        raise ValueError(
            f"lookup_table has length {raw_vocab}; expected the raw vocabulary size, at least vocab_size = "
            f"{config.vocab_size} and above pad_id = {config.pad_id}"
        )
    check_ids("lookup_table", lookup_table, config.vocab_size, "compressed ids must be below vocab_size")
    lookup_table = lookup_table.to(device)
    return lookup_table, raw_vocab, int(lookup_table[config.pad_id])


def _check_prefix(prefix_tokens, n: int, raw_vocab: int, device) -> torch.Tensor | None:
    """``prefix_tokens`` on ``device`` (or None) once it is at most ``n - 1`` raw ids."""
    if prefix_tokens is None:
        return None
    if not isinstance(prefix_tokens, torch.Tensor) or prefix_tokens.dim() != 1 or prefix_tokens.dtype != torch.int32:
        raise ValueError(f"prefix_tokens must be a 1-D int32 tensor, got {getattr(prefix_tokens, 'dtype', None)}")
    if prefix_tokens.numel() > n - 1:
        raise ValueError(f"prefix_tokens has {prefix_tokens.numel()} tokens; at most max_ngram_size - 1 = {n - 1}")
    check_ids("prefix_tokens", prefix_tokens, raw_vocab, "the raw vocabulary")
    return prefix_tokens.to(device)


def _ngram_token_ids(token_ids, cu, n, pad, lookup_table, prefix_tokens) -> torch.Tensor:
    """``[T, N]`` int32: column k = compressed token at t-k in t's sequence, else the pad id."""
    device, num_tokens = token_ids.device, token_ids.numel()
    ids = token_ids.long()
    if lookup_table is not None:
        ids = lookup_table.long()[ids]
    head = torch.full((n - 1,), pad, dtype=torch.int64, device=device)
    if prefix_tokens is not None and prefix_tokens.numel():
        pre = prefix_tokens.long()
        if lookup_table is not None:
            pre = lookup_table.long()[pre]
        head[n - 1 - pre.numel() :] = pre
    ext = torch.cat([head, ids])  # ext[t + n - 1] = token t
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    if prefix_tokens is not None:
        starts = torch.where(starts == 0, torch.full_like(starts, -(n - 1)), starts)
    t = torch.arange(num_tokens, device=device)
    k = torch.arange(n, device=device)
    src = t[:, None] - k[None, :]
    vals = ext[src + (n - 1)] if num_tokens else torch.empty((0, n), dtype=torch.int64, device=device)
    vals = torch.where(src >= starts[:, None], vals, torch.full_like(vals, pad))
    return vals.to(torch.int32).contiguous()


# Op table


def selfcheck_config() -> EngramConfig:
    """A small config (2 layers, N=3, K=3) for self-checks and the GPU check script."""
    return EngramConfig(
        vocab_size=977,
        n_head_per_ngram=3,
        n_embed_per_ngram=12,
        ngram_vocab_sizes=(1009, 2003),
        layer_ids=(0, 7),
        seed=3,
    )


def _selfcheck(backend: str, device: str = "cpu") -> None:
    """``engram_hash[backend]`` on 97 tokens of :func:`selfcheck_config` on ``device`` against the reference."""
    g = torch.Generator().manual_seed(5)
    cfg = selfcheck_config()
    mult, vocab, off = hash_params(cfg)
    ids = torch.randint(0, cfg.vocab_size, (97, cfg.max_ngram_size), generator=g, dtype=torch.int32)
    got = engram_hash(*(t.to(device) for t in (ids, mult, vocab, off)), backend=backend).cpu()
    want = engram_hash_reference(ids, mult, vocab, off)
    if not torch.equal(got, want):
        raise AssertionError(f"engram_hash[{backend}] differs from the reference")


_DOC = "Engram n-gram hash rows: XOR of id*multiplier, mod prime head sizes, plus offsets"
# The TileLang C kernel is the fastest CPU path here.
SPEC = register_op(
    OpSpec("engram_hash", ("tilelang", "cpu", "reference", "triton"), ALL_BACKENDS_CUDA, _DOC, _selfcheck)
)
