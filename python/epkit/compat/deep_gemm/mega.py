"""DeepGEMM's Mega MoE interface (``deep_gemm.mega``: ``get_symm_buffer_for_mega_moe``, ``SymmBuffer``,
``transform_weights_for_mega_moe``, ``fp8_fp4_mega_moe``, ``bf16_mega_moe``) on epkit's pieces.

One call is a whole MoE layer over the buffer's EP group: expanded dispatch of the tokens the caller wrote into the
buffer (``x``, ``x_sf``, ``topk_idx``, ``topk_weights``), the two expert GEMMs with a clamped SwiGLU between them (the
top-k weight applied before the requantization), and the combine (a float32 top-k sum in slot order), written to
``y``. The bits are those of the composed path DeepGEMM's ``tests/test_mega_moe.py`` compares its kernel with:
DeepEP V2's expanded dispatch and combine (without multiple reduction), DeepGEMM's m-grouped GEMMs on the psum layout
(``recipe=(1, 1, 32)`` FP8xFP4, or BF16) and TileLang's ``swiglu_apply_weight_to_fp8``
(``epkit.compat._details.deep_gemm_mega_layer`` has the steps).

How it runs in epkit (not one fused kernel): the rows move through an :class:`~epkit.collectives.ep_buffer.EPBuffer`
(transport ``"auto"``: ``shm`` for CPU ranks on one host, ``nvshmem`` on CUDA ranks; its host-driven flat path, the
one whose rows come back unsummed), the GEMMs are ``epkit.compat.deep_gemm``'s (FP8xFP4 with 1x32 activation scales
on a torch fallback, BF16 on epkit's grouped GEMM) and the activation is torch ops. Tested on CPU ranks (shm); the
nvshmem path is the same code on CUDA tensors and has not been run (no GPU where it was written).
``fast_math`` is checked and changes nothing (torch's ``exp`` either way). Every call is checked on every rank, and
agreed (one small all-gather on the buffer's group) before any row moves: a bad call raises the same
``ValueError`` on every rank. The one exception: a ``sym_buffer`` that is not one (or was destroyed) gives its rank
no group to agree on, so only that rank raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epkit.collectives.ep_buffer import EPBuffer
from epkit.compat._details.deep_ep_agreement import CallAgreement
from epkit.compat._details.deep_gemm_mega_layer import LayerCall, run_layer
from epkit.compat._details.deep_gemm_mega_layout import Weights, plain_weights, transform_weights_for_mega_moe

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "SymmBuffer",
    "get_symm_buffer_for_mega_moe",
    "transform_weights_for_mega_moe",
    "fp8_fp4_mega_moe",
    "bf16_mega_moe",
]

_MMA_TYPES = ("fp8xfp4", "bf16xbf16")
_SF_GROUP = 128  # hidden values per packed UE8M0 int32 (four 1x32 scales)
_ALIGN = 16  # bytes: each input view starts so aligned
#: Seconds any wait of a layer call may take.
TIMEOUT = 30.0


def _positive(fn: str, **values: object) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{fn}: {name} must be a positive int, got {v!r}")


class SymmBuffer:
    """The buffer of a Mega MoE layer (DeepGEMM's ``SymmBuffer``): the inputs of one call, written by the caller, and
    the EP buffer the rows move through.

    Attributes
    ----------
    x : Tensor [num_max_tokens_per_rank, hidden], float8_e4m3fn (``fp8xfp4``) or bfloat16 (``bf16xbf16``)
    x_sf : Tensor [num_max_tokens_per_rank, hidden / 128] int32 (packed UE8M0 1x32 scales, four per int32), or None
        for ``bf16xbf16``
    topk_idx : Tensor [num_max_tokens_per_rank, num_topk] int64 (-1: no expert)
    topk_weights : Tensor [num_max_tokens_per_rank, num_topk] float32
    buffer : Tensor int8, the bytes the four views above live in (this rank's, not symmetric: the symmetric memory is
        ``ep_buffer``'s)
    ep_buffer : EPBuffer over ``group``
    group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden, mma_type : as given
    """

    def __init__(
        self, group: ProcessGroup, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
        intermediate_hidden: int, mma_type: str = "fp8xfp4", activation: str = "swiglu",
    ) -> None:  # fmt: skip
        fn = "get_symm_buffer_for_mega_moe"
        _positive(fn, num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank, num_topk=num_topk,
                  hidden=hidden, intermediate_hidden=intermediate_hidden)  # fmt: skip
        if mma_type not in _MMA_TYPES:
            raise ValueError(f"{fn}: mma_type must be one of {_MMA_TYPES}, got {mma_type!r}")
        if activation != "swiglu":
            raise ValueError(f"{fn}: only activation='swiglu' is supported, got {activation!r}")
        fp8 = mma_type == "fp8xfp4"
        if fp8 and (hidden % _SF_GROUP or intermediate_hidden % _SF_GROUP):
            raise ValueError(
                f"{fn}: fp8xfp4 needs hidden and intermediate_hidden multiples of {_SF_GROUP} (packed 1x32 scales), "
                f"got {hidden} and {intermediate_hidden}"
            )
        self.group, self.num_experts, self.num_topk = group, num_experts, num_topk
        self.num_max_tokens_per_rank, self.hidden, self.intermediate_hidden = (
            num_max_tokens_per_rank,
            hidden,
            intermediate_hidden,
        )
        self.mma_type = mma_type
        self.ep_buffer: EPBuffer | None = EPBuffer(
            group, hidden, num_experts, num_max_tokens_per_rank, num_topk, kernels="host", timeout=TIMEOUT
        )
        self.agreement = CallAgreement(group)
        n, dev = num_max_tokens_per_rank, self.ep_buffer.device
        x_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        views = [((n, hidden), x_dtype), ((n, hidden // _SF_GROUP if fp8 else 0), torch.int32)]
        views += [((n, num_topk), torch.int64), ((n, num_topk), torch.float32)]
        sizes = [-(-shape[0] * shape[1] * dtype.itemsize // _ALIGN) * _ALIGN for shape, dtype in views]
        self.buffer: torch.Tensor | None = torch.zeros(sum(sizes), dtype=torch.int8, device=dev)
        tensors, at = [], 0
        for (shape, dtype), size in zip(views, sizes):
            tensors.append(self.buffer[at : at + size].view(dtype)[: shape[0] * shape[1]].view(shape))
            at += size
        self.x: torch.Tensor | None = tensors[0]
        self.x_sf: torch.Tensor | None = tensors[1] if fp8 else None
        self.topk_idx: torch.Tensor | None = tensors[2]
        self.topk_weights: torch.Tensor | None = tensors[3]

    def destroy(self) -> None:
        """Release the EP buffer (every rank calls it, as DeepGEMM's); the views are dropped."""
        if self.ep_buffer is not None:
            self.ep_buffer.close()
        self.ep_buffer = self.buffer = self.x = self.x_sf = self.topk_idx = self.topk_weights = None


def get_symm_buffer_for_mega_moe(
    group: ProcessGroup,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate_hidden: int,
    use_fp8_dispatch: bool | None = None,
    mma_type: str = "fp8xfp4",
    activation: str = "swiglu",
) -> SymmBuffer:
    """A :class:`SymmBuffer` for a layer of ``num_experts`` experts over ``group`` (collective: every rank calls it),
    taking up to ``num_max_tokens_per_rank`` tokens of ``hidden`` values with ``num_topk`` experts each;
    ``mma_type`` ``"fp8xfp4"`` (FP8 tokens with 1x32 UE8M0 scales, FP4 weights) or ``"bf16xbf16"``.
    ``use_fp8_dispatch`` (DeepGEMM's older switch) must agree with ``mma_type`` when given."""
    if use_fp8_dispatch is not None and bool(use_fp8_dispatch) != (mma_type == "fp8xfp4"):
        raise ValueError(
            f"get_symm_buffer_for_mega_moe: use_fp8_dispatch={use_fp8_dispatch!r} contradicts mma_type={mma_type!r}"
        )
    return SymmBuffer(
        group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden, mma_type, activation
    )


def _checked_call(
    fn: str, recipe: object, y: object, l1_weights: Weights, l2_weights: Weights, buf: SymmBuffer, stats: object,
    activation: object, clamp: object, fast_math: object,
) -> LayerCall:  # fmt: skip
    """This rank's checks of a layer call (``ValueError``s, carried into the agreement), and the call in epkit's terms.
    ``recipe``: FP8xFP4's (None for BF16)."""
    fp8 = fn == "fp8_fp4_mega_moe"
    if fp8 and (not isinstance(recipe, tuple) or tuple(recipe) != (1, 1, 32)):
        raise ValueError(f"recipe must be (1, 1, 32) (1x32 UE8M0 scales on both operands), got {recipe!r}")
    if buf.ep_buffer is None or buf.x is None or buf.topk_idx is None or buf.topk_weights is None:
        raise ValueError("sym_buffer was destroyed")
    if buf.mma_type != ("fp8xfp4" if fp8 else "bf16xbf16"):
        raise ValueError(f"sym_buffer was made for mma_type={buf.mma_type!r}")
    if activation != "swiglu":
        raise ValueError(f"only activation='swiglu' is supported, got {activation!r}")
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not clamp >= 0):
        raise ValueError(f"activation_clamp must be None or a number >= 0, got {clamp!r}")
    if not isinstance(fast_math, bool):
        raise ValueError(f"fast_math must be a bool, got {fast_math!r}")
    h, n_max, local = buf.hidden, buf.num_max_tokens_per_rank, buf.ep_buffer.num_local_experts
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[1] != h or y.dtype != torch.bfloat16:
        raise ValueError(f"y must be a bfloat16 [num_tokens, {h}] tensor, got {y!r:.80}")
    t = y.shape[0]
    if t > n_max:
        raise ValueError(f"y has {t} tokens, more than the buffer's num_max_tokens_per_rank = {n_max}")
    l1, l2 = plain_weights(fn, l1_weights, l2_weights, fp8)
    i, k_div = buf.intermediate_hidden, 2 if fp8 else 1
    for name, w, want in (("l1_weights", l1, (local, 2 * i, h // k_div)), ("l2_weights", l2, (local, h, i // k_div))):
        got = tuple((w[0] if isinstance(w, tuple) else w).shape)
        if got != want:
            raise ValueError(
                f"{name} must be [num_local_experts, N, K{'/2' if fp8 else ''}] = {list(want)}, got {list(got)}"
            )
    if stats is not None and (
        not isinstance(stats, torch.Tensor) or stats.shape != (local,) or stats.dtype != torch.int32
    ):
        raise ValueError(f"cumulative_local_expert_recv_stats must be None or int32 [{local}], got {stats!r:.80}")
    idx = buf.topk_idx[:t]
    if bool(((idx < -1) | (idx >= buf.num_experts)).any()):
        raise ValueError(f"sym_buffer.topk_idx[:{t}] has expert ids outside [-1, {buf.num_experts})")
    x_sf = None if buf.x_sf is None else buf.x_sf[:t]
    return LayerCall(buf.x[:t], x_sf, idx, buf.topk_weights[:t], l1, l2, stats, None if clamp is None else float(clamp))


def _layer(fn: str, recipe: object, y: torch.Tensor, l1_weights: Weights, l2_weights: Weights, sym_buffer: SymmBuffer,
           stats: torch.Tensor | None, activation: str, clamp: float | None, fast_math: bool) -> None:  # fmt: skip
    """Check, agree, run (the module docstring); ``recipe`` None for BF16."""
    if not isinstance(sym_buffer, SymmBuffer):
        raise ValueError(f"{fn}: sym_buffer must be what get_symm_buffer_for_mega_moe returned, got {sym_buffer!r:.60}")
    if sym_buffer.ep_buffer is None:
        raise RuntimeError(f"{fn}: sym_buffer was destroyed; make a new one with get_symm_buffer_for_mega_moe")
    error, call = None, None
    try:
        call = _checked_call(fn, recipe, y, l1_weights, l2_weights, sym_buffer, stats, activation, clamp, fast_math)
    except ValueError as exc:
        error = str(exc)
    sym_buffer.agreement(fn, error, [], TIMEOUT)
    assert call is not None  # the agreement raised on every rank otherwise
    with sym_buffer.ep_buffer.retire_on_failure(fn):
        run_layer(sym_buffer.ep_buffer, call, y)


def fp8_fp4_mega_moe(
    y: torch.Tensor,
    l1_weights: tuple[torch.Tensor, torch.Tensor],
    l2_weights: tuple[torch.Tensor, torch.Tensor],
    sym_buffer: SymmBuffer,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    recipe: tuple[int, int, int] = (1, 1, 32),
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    fast_math: bool = True,
) -> None:
    """The MoE layer (module docstring) on FP8 tokens and FP4 weights: the first ``T = y.shape[0]`` tokens of
    ``sym_buffer`` (``x`` e4m3 with ``x_sf`` packed 1x32 UE8M0 scales, ``topk_idx``, ``topk_weights``) through this
    rank's experts ``l1_weights`` ``(int8 [L, 2I, H/2], scales)`` and ``l2_weights`` ``(int8 [L, H, I/2], scales)``
    (as :func:`transform_weights_for_mega_moe` returns them; scales packed UE8M0 int32 ``[L, N, K/128]`` or float32
    ``[L, N, K/32]``); the result in ``y [T, H]`` bf16. ``cumulative_local_expert_recv_stats [L]`` int32 gains the
    rows each local expert received; ``activation_clamp`` clamps gate above and up both ways before the SwiGLU;
    ``recipe`` must be ``(1, 1, 32)``. Collective: every rank of the buffer's group calls it."""
    stats = cumulative_local_expert_recv_stats
    _layer("fp8_fp4_mega_moe", recipe, y, l1_weights, l2_weights, sym_buffer, stats, activation, activation_clamp,
           fast_math)  # fmt: skip


def bf16_mega_moe(
    y: torch.Tensor,
    l1_weights: torch.Tensor,
    l2_weights: torch.Tensor,
    sym_buffer: SymmBuffer,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    fast_math: bool = True,
) -> None:
    """:func:`fp8_fp4_mega_moe` in BF16: ``sym_buffer.x`` bf16, ``l1_weights [L, 2I, H]`` and ``l2_weights [L, H, I]``
    bf16 (as :func:`transform_weights_for_mega_moe` returns them); the activation is rounded to bf16, not quantized."""
    _layer("bf16_mega_moe", None, y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats,
           activation, activation_clamp, fast_math)  # fmt: skip
