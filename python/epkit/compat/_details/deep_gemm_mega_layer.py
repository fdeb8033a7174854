"""The body of ``epkit.compat.deep_gemm``'s Mega MoE layer (``fp8_fp4_mega_moe`` / ``bf16_mega_moe``), after the
call's checks and agreement: the composition whose bits DeepGEMM's fused kernel reproduces, on epkit's pieces.

1. Expanded dispatch (``EPBuffer.dispatch(expand=True)``): one row per (token, local expert), each expert's rows at an
   offset aligned to the contiguous layout's M alignment, and the psum layout (each expert's row end) of them;
   ``cumulative_local_expert_recv_stats`` gains each local expert's (unaligned) row count.
2. L1: the m-grouped GEMM with ``use_psum_layout=True`` (FP8xFP4 ``recipe=(1, 1, 32)``, or BF16), bf16 out.
3. The clamped SwiGLU with the top-k weight applied, requantized for L2 (``deep_gemm_mega_swiglu``), on the rows up to
   the last expert's end.
4. L2: the same GEMM, bf16 out.
5. Combine: every (token, top-k slot) row back to its source (``EPBuffer.combine_unsummed``, once per slot), summed
   there in float32 in slot order (slots whose expert is -1 skipped), rounded once to bf16; a token with no expert
   gets zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epkit.collectives.ep.rows import sum_indexed_rows
from epkit.collectives.ep_buffer import EPBuffer
from epkit.compat._details.deep_ep_layouts import carry_scales, restore_scales
from epkit.compat._details.deep_gemm_mega_layout import Weights
from epkit.compat._details.deep_gemm_mega_swiglu import swiglu_apply_weight
from epkit.compat._details.deep_gemm_runtime import SETTINGS
from epkit.compat._details.ep_unsummed import slot_rows_back

__all__ = ["LayerCall", "run_layer"]


@dataclass
class LayerCall:
    """One checked call: this rank's inputs (views of the symmetric buffer), the plain weights, the options."""

    x: torch.Tensor  # [T, H] bf16 or e4m3
    x_sf: torch.Tensor | None  # [T, H/128] packed UE8M0 int32 (FP8)
    topk_idx: torch.Tensor  # [T, K]
    topk_weights: torch.Tensor  # [T, K] float32
    l1: Weights  # [L, 2I, H]: gate rows, then up rows
    l2: Weights  # [L, H, I]
    stats: torch.Tensor | None  # [L] int32
    clamp: float | None


def _expert_gemm(a: torch.Tensor | tuple[torch.Tensor, torch.Tensor], w: Weights, psum: torch.Tensor) -> torch.Tensor:
    """``a @ w[expert].T`` per expert on the psum layout, bf16 ``[M, N]``: DeepGEMM's m-grouped GEMM as the composed
    path calls it (``recipe=(1, 1, 32)`` for FP8xFP4, ``compiled_dims=''`` for BF16)."""
    from epkit.compat import deep_gemm  # here: that package imports the Mega MoE module, which imports this one

    rows = a[0].shape[0] if isinstance(a, tuple) else a.shape[0]
    n = (w[0] if isinstance(w, tuple) else w).shape[1]
    dev = a[0].device if isinstance(a, tuple) else a.device
    d = torch.empty((rows, n), dtype=torch.bfloat16, device=dev)
    if isinstance(a, tuple):
        assert isinstance(w, tuple)
        deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous(a, w, d, psum, use_psum_layout=True, recipe=(1, 1, 32))
    else:
        assert isinstance(w, torch.Tensor)
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, w, d, psum, compiled_dims="", use_psum_layout=True)
    return d


def run_layer(ep: EPBuffer, call: LayerCall, y: torch.Tensor) -> None:
    """Steps 1-5 of the module docstring for this rank, the result written to ``y [T, H]`` bf16."""
    fp8 = call.x_sf is not None
    t_num, local = call.x.shape[0], ep.num_local_experts
    idx = call.topk_idx.long()
    if fp8:
        assert call.x_sf is not None
        words, cols, dtype = carry_scales(call.x_sf, t_num, ep.hidden)
        rows, _, _, _, handle = ep.dispatch((call.x, words), idx, call.topk_weights.float(), SETTINGS.alignment, True)
        act: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = (rows[0], restore_scales(rows[1], cols, dtype))
    else:
        bf16, _, _, _, handle = ep.dispatch(call.x, idx, call.topk_weights.float(), SETTINGS.alignment, True)
        assert isinstance(bf16, torch.Tensor)  # bf16 rows in, bf16 rows out
        act = bf16
    recv_idx = handle.recv_topk_idx.long()
    unaligned = torch.bincount(recv_idx[recv_idx >= 0], minlength=local)
    aligned = -(-unaligned // SETTINGS.alignment) * SETTINGS.alignment
    psum = (aligned.cumsum(0) - aligned + unaligned).to(torch.int32)
    if call.stats is not None:
        call.stats += unaligned.to(call.stats.device, call.stats.dtype)
    slot = handle.expanded_slot
    assert slot is not None and handle.expanded_rows is not None
    row_weights = torch.zeros(int(handle.expanded_rows.numel()), dtype=torch.float32)
    row_weights[slot[slot >= 0]] = handle.recv_topk_weights[slot >= 0].float()
    dev = ep.device
    l1_y = _expert_gemm(act, call.l1, psum.to(dev))
    avail = int(psum[-1]) if local else 0
    mid = swiglu_apply_weight(l1_y[:avail], row_weights[:avail].to(dev), call.clamp, fp8)
    l2_y = _expert_gemm(mid, call.l2, psum.to(dev))
    ids = idx.cpu()
    terms, src_of, row_of = slot_rows_back(ep, handle, l2_y, torch.where(ids >= 0, ids // local, -1))
    out = torch.zeros((t_num, ep.hidden), dtype=torch.bfloat16)
    if terms and t_num:
        sum_indexed_rows(out, terms, src_of, row_of)
    y.copy_(out.to(y.device))
