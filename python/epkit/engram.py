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

The ops (``epkit.ops``): ``torch.ops.epkit.engram_hash`` / ``engram_hash_out`` (the value checks of the head
sizes and offsets run inside, not during CUDA stream capture) and ``engram_ngram_ids``, the n-gram ids of
:func:`hash_tokens` (host preparation: it compiles, it is not for CUDA graphs).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from epkit._details.engram_cpu import checked_mod_table, engram_hash_cpu
from epkit._details.engram_ids import (
    check_compression,
    check_cu_seqlens,
    check_cu_seqlens_static,
    check_prefix,
    ngram_token_ids,
)
from epkit._details.engram_params import (
    check_hash_values,
    check_ids,
    hash_params_np,
    kernel_tables,
    validate_hash_args,
)
from epkit.backends import ALL_BACKENDS_CUDA, OpSpec, register_op, select
from epkit.ops import custom_op, host_checks

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
    validate_hash_args(ngram_token_ids, multipliers, vocab_sizes, offsets, out)
    args = (ngram_token_ids, multipliers, vocab_sizes, offsets)
    if _eager_on_cpu(*args, *(() if out is None else (out,))):  # the op's implementation, without the dispatcher
        out = _new_out(ngram_token_ids, vocab_sizes) if out is None else out
        _hash_into(*args, out, backend)
        return out
    if out is None:
        return _hash_op(ngram_token_ids, multipliers, vocab_sizes, offsets, backend)
    _hash_out_op(ngram_token_ids, multipliers, vocab_sizes, offsets, out, backend)
    return out


def _hash_into(ngram_token_ids, multipliers, vocab_sizes, offsets, out, backend: str) -> None:
    """Both ops' implementation: the value checks (outside CUDA stream capture; on CPU tensors once per distinct
    set of parameters, with the CPU kernels' table), then the selected backend."""
    on_cpu = ngram_token_ids.device.type == "cpu"
    table = checked_mod_table(vocab_sizes, offsets) if on_cpu else None
    if not on_cpu and host_checks(ngram_token_ids.device):
        check_hash_values(vocab_sizes, offsets)
    impl = select("engram_hash", ngram_token_ids.device, backend)
    if impl == "reference":
        out.copy_(engram_hash_reference(ngram_token_ids, multipliers, vocab_sizes, offsets))
        return
    if out.numel() == 0:
        return
    ids = ngram_token_ids.contiguous()
    if impl == "cpu":
        if not engram_hash_cpu(ids, multipliers, table, out):  # no epkit._C: the reference
            out.copy_(engram_hash_reference(ids, multipliers, vocab_sizes, offsets))
        return
    if impl == "tilelang" and on_cpu:
        from epkit.kernels.tilelang.engram import engram_hash_tokens_cpu

        engram_hash_tokens_cpu(ids, multipliers.contiguous(), table, out)
        return
    vocab64, inv, off64 = kernel_tables(vocab_sizes, offsets)
    if impl == "triton":
        from epkit.kernels.triton.engram import engram_hash_tokens
    else:
        from epkit.kernels.tilelang.engram import engram_hash_tokens
    engram_hash_tokens(ids, multipliers.contiguous(), vocab64, inv, off64, out)


def _eager_on_cpu(*tensors: torch.Tensor) -> bool:
    """Plain CPU tensors in eager mode, with no dispatch or function mode to see the op: :func:`engram_hash` may
    run the op's implementation directly. The dispatcher's round trip through the custom op costs more than
    the C++ hash of a few thousand tokens; compiled code, fake and meta tensors, and modes still get the op."""
    return (
        not torch.compiler.is_compiling()
        and all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)
        and not is_in_torch_dispatch_mode()
        and not torch.overrides.has_torch_function(tensors)
    )


def _new_out(ngram_token_ids: torch.Tensor, vocab_sizes: torch.Tensor) -> torch.Tensor:
    num_layers, orders, heads = vocab_sizes.shape
    shape = (num_layers, ngram_token_ids.shape[0], orders * heads)
    return torch.empty(shape, dtype=torch.int32, device=ngram_token_ids.device)


def _fake_hash(ngram_token_ids, multipliers, vocab_sizes, offsets, backend):
    num_layers, orders, heads = vocab_sizes.shape
    return ngram_token_ids.new_empty((num_layers, ngram_token_ids.shape[0], orders * heads))


@custom_op("engram_hash", _fake_hash)
def _hash_op(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    """``torch.ops.epkit.engram_hash``: :func:`engram_hash` into a new tensor."""
    out = _new_out(ngram_token_ids, vocab_sizes)
    _hash_into(ngram_token_ids, multipliers, vocab_sizes, offsets, out, backend)
    return out


def _fake_hash_out(ngram_token_ids, multipliers, vocab_sizes, offsets, out, backend):
    return None


@custom_op("engram_hash_out", _fake_hash_out, mutates_args=("out",))
def _hash_out_op(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    backend: str,
) -> None:
    """``torch.ops.epkit.engram_hash_out``: :func:`engram_hash` into ``out`` (written in place)."""
    _hash_into(ngram_token_ids, multipliers, vocab_sizes, offsets, out, backend)


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
    check_cu_seqlens_static(cu_seqlens)
    check_compression(lookup_table, config.vocab_size, config.pad_id)
    check_prefix(prefix_tokens, config.max_ngram_size)
    n, pad = config.max_ngram_size, config.pad_id
    ngram_ids = _ngram_op(token_ids, cu_seqlens, n, pad, config.vocab_size, lookup_table, prefix_tokens)
    mult, vocab, off = (t.to(token_ids.device) for t in _constant_params(config))
    return engram_hash(ngram_ids, mult, vocab, off, backend=backend)


def _constant_params(config: EngramConfig):
    """:func:`hash_params`, which a compiler takes as a constant of the config (it guards on the config)."""
    return hash_params(config)


# What ``torch.compiler.assume_constant_result`` sets, set without it: the decorator imports torch._dynamo, 1.5 s
# at every ``import epkit`` (every spawned rank). tests/test_custom_ops.py compiles hash_tokens with fullgraph=True.
_constant_params._dynamo_marked_constant = True


def _fake_ngram(token_ids, cu_seqlens, n, pad_id, vocab_size, lookup_table, prefix_tokens):
    return token_ids.new_empty((token_ids.shape[0], n))


@custom_op("engram_ngram_ids", _fake_ngram)
def _ngram_op(
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    n: int,
    pad_id: int,
    vocab_size: int,
    lookup_table: torch.Tensor | None,
    prefix_tokens: torch.Tensor | None,
) -> torch.Tensor:
    """``torch.ops.epkit.engram_ngram_ids``: the ``[T, N]`` n-gram ids of :func:`hash_tokens`, after the checks that
    read the boundaries and ids on the host (host-side preparation: it synchronizes, not for CUDA graphs)."""
    device = token_ids.device
    cu = check_cu_seqlens(cu_seqlens, token_ids.numel(), device)
    raw_vocab, pad = vocab_size, pad_id
    if lookup_table is not None:
        raw_vocab = lookup_table.numel()
        check_ids("lookup_table", lookup_table, vocab_size, "compressed ids must be below vocab_size")
        lookup_table = lookup_table.to(device)
        pad = int(lookup_table[pad_id])
    check_ids("token_ids", token_ids, raw_vocab, "the raw vocabulary")
    if prefix_tokens is not None:
        check_ids("prefix_tokens", prefix_tokens, raw_vocab, "the raw vocabulary")
        prefix_tokens = prefix_tokens.to(device)
    return ngram_token_ids(token_ids, cu, n, pad, lookup_table, prefix_tokens)


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
