"""Expert MLP on the local experts: gate/up grouped GEMM -> SwiGLU -> FP8 re-quantization -> down GEMM.

Weight layout (NT: every GEMM computes ``x @ w[g].T``):
``w13 [G, 2*I, H]`` holds each expert's gate rows ``[0, I)`` then up rows
``[I, 2*I)``; ``w2 [G, H, I]``. :func:`pack_moe_weight` turns the
``(E * K, N)`` parameter of a routed linear into the expert-major ``[E, K, N]``
view whose ``.mT`` is the contiguous ``[E, N, K]`` that the GEMMs read
(the source engine's ``view(E, -1, N).mT.contiguous().mT`` repack).

Errors name :func:`expert_mlp`'s own arguments (``x``, ``w13``, ``w2``, ``m_indices``, ...): the shapes of
``x``, ``w13`` and ``w2`` are checked against each other first, and what a GEMM rejects is re-raised with
the argument its operand came from. :func:`expert_mlp` is ``torch.ops.epkit.expert_mlp`` (``epkit.ops``),
its two GEMMs their own ops. NaN/Inf are not looked for (a device synchronisation per call): a
non-finite token stays in its row, except that the FP8/FP4 path quantizes a bf16/float32 ``x`` with
:func:`~epkit.quant.per_token_group_cast_to_fp8`, which raises on it (README, "Using an op").
"""

from __future__ import annotations

import contextlib

import torch

from epkit import grouped_gemm as gemm
from epkit.ops import custom_op
from epkit.quant import FP8_BLOCK, cast_groups_to_fp8, per_token_group_cast_to_fp8

__all__ = [
    "expert_mlp",
    "check_expert_weights",
    "expert_mlp_reference",
    "pack_moe_weight",
    "unpack_moe_weight",
    "fuse_gate_up",
]


def pack_moe_weight(w: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert-major repack of a routed linear's ``(E * K, N)`` weight.

    Parameters
    ----------
    w : Tensor [E * K, N], any dtype
    num_experts : int (E)

    Returns
    -------
    Tensor [E, K, N] (a view of a new contiguous ``[E, N, K]`` buffer: ``result.mT`` is contiguous).
    """
    if w.dim() != 2 or num_experts <= 0 or w.shape[0] % num_experts:
        raise ValueError(
            f"w must be [E * K, N] with num_experts = {num_experts} dividing the rows, got {tuple(w.shape)}"
        )
    return w.view(num_experts, -1, w.shape[1]).mT.contiguous().mT


def unpack_moe_weight(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_moe_weight`: ``[E, K, N]`` -> contiguous ``[E * K, N]``."""
    if w.dim() != 3:
        raise ValueError(f"w must be [E, K, N], got {tuple(w.shape)}")
    return w.contiguous().view(-1, w.shape[2])


def fuse_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Stack gate and up weights ``[G, I, H]`` each into the fused ``w13 [G, 2*I, H]`` (gate rows first)."""
    if w_gate.shape != w_up.shape or w_gate.dim() != 3:
        raise ValueError(f"w_gate and w_up must both be [G, I, H], got {tuple(w_gate.shape)} and {tuple(w_up.shape)}")
    return torch.cat((w_gate, w_up), dim=1).contiguous()


def _kind_of(w13) -> str:
    t = w13[0] if isinstance(w13, (tuple, list)) else w13
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"w13 must be a tensor or a (tensor, scales) pair, got {type(w13).__name__}")
    kinds = {torch.float8_e4m3fn: "fp8", torch.uint8: "fp8_fp4", torch.bfloat16: "bf16"}
    if t.dtype not in kinds:
        raise ValueError(f"w13 must be float8_e4m3fn, uint8 (MXFP4) or bfloat16, got {t.dtype}")
    return kinds[t.dtype]


def _swiglu(h: torch.Tensor, limit: float | None) -> torch.Tensor:
    inter = h.shape[-1] // 2
    gate, up = h[..., :inter], h[..., inter:]
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


def expert_mlp(
    x,
    layout: str,
    w13,
    w2,
    *,
    m_indices: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    expected_m: int | None = None,
    swiglu_limit: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Grouped expert MLP ``down(silu(gate(x)) * up(x))`` on the contiguous or masked layout.

    Parameters
    ----------
    x : Tensor [M, H] (contiguous) or [G, M_max, H] (masked), bfloat16/float32, or an already
        quantized ``(e4m3, float32 scales [..., H/128])`` pair for FP8/FP4 weights.
    layout : ``"contiguous"`` or ``"masked"``
    w13 : gate/up weights ``[G, 2*I, H]``: an FP8 pair ``(e4m3, float32 [G, 2I/128, H/128])``,
        an MXFP4 pair ``(uint8 [G, 2I, H/2], uint8 [G, 2I, H/32])``, or a bfloat16 tensor.
    w2 : down weights ``[G, H, I]`` in the same format.
    m_indices : Tensor [M] int32 (contiguous layout): expert per row, -1 for padding.
    masked_m, expected_m : Tensor [G] int32 and int (masked layout).
    swiglu_limit : float, optional
        Clamp gate to ``<= limit`` and up to ``[-limit, limit]`` before SwiGLU.
    backend : passed to the grouped GEMMs.

    Returns
    -------
    Tensor [M, H] or [G, M_max, H], bfloat16. Padding rows (contiguous) and rows beyond
    ``masked_m[g]`` (masked) are zeros.
    """
    if layout not in ("contiguous", "masked"):
        raise ValueError(f"layout must be 'contiguous' or 'masked', got {layout!r}")
    check_expert_weights(x, w13, w2)
    masked = layout == "masked"
    if masked and (masked_m is None or expected_m is None):
        raise ValueError("the masked layout needs masked_m and expected_m")
    if not masked and m_indices is None:
        raise ValueError("the contiguous layout needs m_indices")
    (x0, xs), (b13, s13), (b2, s2) = (_split(v, name) for v, name in ((x, "x"), (w13, "w13"), (w2, "w2")))
    return _expert_mlp_op(x0, xs, b13, s13, b2, s2, layout, m_indices, masked_m, expected_m, swiglu_limit, backend)


def check_expert_weights(x, w13, w2, num_groups: int | None = None) -> None:
    """The checks :func:`expert_mlp` makes of its weights against ``x [..., H]``, without running it: one format,
    ``w13 [G, 2*I, H]`` / ``w2 [G, H, I]`` shapes, ``I`` a multiple of 128 for the FP8/FP4 formats, and ``G`` equal
    to ``num_groups`` when given. ``fused_moe`` runs them on every rank before any row moves."""
    kind = _kind_of(w13)
    if _kind_of(w2) != kind:
        raise ValueError(f"w13 and w2 must use one format, got {kind} and {_kind_of(w2)}")
    two_i, _ = _check_weight_shapes(kind, x, w13, w2)
    if kind != "bf16" and two_i // 2 % FP8_BLOCK:
        raise ValueError(f"I = {two_i // 2} must be a multiple of {FP8_BLOCK} to re-quantize the intermediate to FP8")
    g = _body(w13).shape[0]
    if num_groups is not None and g != num_groups:
        raise ValueError(f"w13 and w2 must hold this rank's {num_groups} local experts (G), got G = {g}")


def _split(v, name: str):
    """``(tensor, scales or None)`` of an argument given as a tensor or a (tensor, scales) pair."""
    if isinstance(v, (tuple, list)):
        if len(v) != 2 or not all(isinstance(t, torch.Tensor) for t in v):
            raise ValueError(
                f"{name} must be a tensor or a (tensor, scales) pair, got a {type(v).__name__} of {len(v)}"
            )
        return v[0], v[1]
    return v, None


def _fake_expert_mlp(x, x_scales, w13, w13_scales, w2, w2_scales, layout, m_indices, masked_m, expected_m, *rest):
    hidden = w13.shape[2] * (2 if w13.dtype == torch.uint8 else 1)
    return x.new_empty((*x.shape[:-1], hidden), dtype=torch.bfloat16)


@custom_op("expert_mlp", _fake_expert_mlp)
def _expert_mlp_op(
    x: torch.Tensor,
    x_scales: torch.Tensor | None,
    w13: torch.Tensor,
    w13_scales: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scales: torch.Tensor | None,
    layout: str,
    m_indices: torch.Tensor | None,
    masked_m: torch.Tensor | None,
    expected_m: int | None,
    swiglu_limit: float | None,
    backend: str,
) -> torch.Tensor:
    """``torch.ops.epkit.expert_mlp``: :func:`expert_mlp` on its arguments' tensors (pairs given as a tensor and
    its scales, None for a bare tensor); the two GEMMs are their own ops."""
    kind = _kind_of(w13)
    two_i, hidden = w13.shape[1], w13.shape[2] * (2 if kind == "fp8_fp4" else 1)
    w13 = w13 if w13_scales is None else (w13, w13_scales)
    w2 = w2 if w2_scales is None else (w2, w2_scales)
    if x_scales is not None:
        xa = (x, x_scales)
    else:
        xa = x.to(torch.bfloat16) if kind == "bf16" else per_token_group_cast_to_fp8(x)
    x0 = xa[0] if isinstance(xa, tuple) else xa
    rows = tuple(x0.shape[:-1])
    h = torch.zeros((*rows, two_i), dtype=torch.float32, device=x0.device)
    out = torch.zeros((*rows, hidden), dtype=torch.bfloat16, device=x0.device)
    gemm_op = getattr(gemm, f"m_grouped_{kind}_gemm_nt_{layout}")
    layout_args = (masked_m, expected_m) if layout == "masked" else (m_indices,)
    with _naming("the gate/up GEMM x @ w13.T (its a = x, b = w13, d = [..., 2*I])"):
        gemm_op(xa, w13, h, *layout_args, backend=backend)
    act = _swiglu(h, swiglu_limit)
    # the intermediate is this op's own: quantized without per_token_group_cast_to_fp8's finiteness check,
    # which reads it on the host (a device sync on every masked-layout decode call)
    act_q = act.to(torch.bfloat16) if kind == "bf16" else cast_groups_to_fp8(act)
    with _naming("the down GEMM act @ w2.T (its a = the SwiGLU output [..., I], b = w2, d = the result)"):
        gemm_op(act_q, w2, out, *layout_args, backend=backend)
    return out


def _body(w):
    return w[0] if isinstance(w, (tuple, list)) else w


def _check_weight_shapes(kind: str, x, w13, w2) -> tuple[int, int]:
    """``(2*I, H)`` from ``w13 [G, 2*I, H]`` once ``x [..., H]`` and ``w2 [G, H, I]`` agree with it.

    The GEMMs check their own operands, but name them ``a``/``b`` and cannot tell a ``w2`` whose rows are
    not ``H`` (the output would silently take w2's width) or whose ``G`` differs from ``w13``'s.
    Packed MXFP4 bodies hold two values per byte along their last dim.
    """
    pack = 2 if kind == "fp8_fp4" else 1
    packed = " (MXFP4: two values per byte along the last dim)" if pack == 2 else ""
    b13, b2, x0 = _body(w13), _body(w2), _body(x)
    if b13.dim() != 3 or b13.shape[1] % 2:
        raise ValueError(f"w13 must be [G, 2*I, H] (gate rows, then up rows){packed}, got {tuple(b13.shape)}")
    g, two_i, hidden = b13.shape[0], b13.shape[1], b13.shape[2] * pack
    if not isinstance(x0, torch.Tensor) or x0.dim() < 1 or x0.shape[-1] != hidden:
        raise ValueError(
            f"x must have hidden size H = {hidden} (its last dim; w13 is [G, 2*I, H] = {tuple(b13.shape)}"
            f"{packed}), got {tuple(getattr(x0, 'shape', ())) or type(x0).__name__}"
        )
    want = (g, hidden, two_i // 2 // pack)
    if tuple(b2.shape) != want:
        raise ValueError(
            f"w2 must be [G, H, I] = {want}{packed} to match w13 {tuple(b13.shape)} (G = {g}, 2*I = {two_i}) and "
            f"x [..., H = {hidden}], got {tuple(b2.shape)}"
        )
    return two_i, hidden


@contextlib.contextmanager
def _naming(what: str):
    """Re-raise a GEMM's ValueError with the expert_mlp arguments its operands came from."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"expert_mlp: {what}: {exc}") from exc


# Reference


def expert_mlp_reference(x, w_gate, w_up, w_down, expert_of_row, swiglu_limit=None) -> torch.Tensor:
    """Per-expert plain-torch MLP in float32: ``x [M, H]``, ``w_gate/w_up [G, I, H]``, ``w_down [G, H, I]``.

    ``expert_of_row [M]`` gives each row's expert (-1: zero output row).
    """
    out = torch.zeros(x.shape[0], w_down.shape[1])
    for e in range(w_gate.shape[0]):
        sel = expert_of_row == e
        xe = x[sel].float()
        gate, up = xe @ w_gate[e].float().T, xe @ w_up[e].float().T
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        out[sel] = (torch.nn.functional.silu(gate) * up) @ w_down[e].float().T
    return out
