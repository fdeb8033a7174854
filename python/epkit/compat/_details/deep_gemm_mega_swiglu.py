"""The activation between Mega MoE's two expert GEMMs (DeepGEMM's semantics), for ``epkit.compat.deep_gemm``: a
clamped SwiGLU with each row's top-k weight applied before the second GEMM's input is quantized.

For one row of the first GEMM's output ``[gate | up]`` (bf16, read as float32) and its weight ``w`` (float32):

- with ``activation_clamp = c``: ``up = min(c, max(-c, up))``, ``gate = min(c, gate)`` (gate clamped above only);
- ``y = gate / (1 + exp(-gate)) * up * w``, evaluated left to right in float32;
- FP8 (``fp8_fp4_mega_moe``): each run of 32 values is scaled by a power of two, ``2 ** e`` with ``e`` the exponent of
  ``max(amax, 1e-4) / 448`` rounded up (its UE8M0 byte ``e + 127``), and cast to e4m3; the bytes are packed four to
  an int32 (byte ``j`` for the ``j``-th run: DeepGEMM's packed UE8M0 layout);
- BF16 (``bf16_mega_moe``): ``y`` rounded to bf16.

Torch ops on every device: the same shapes give the same bits (``exp`` is torch's, with or without ``fast_math``).
"""

from __future__ import annotations

import torch

__all__ = ["swiglu_apply_weight"]

_FP8_MAX = 448.0
_AMAX_MIN = 1e-4
_RUN = 32  # values per UE8M0 scale
_MANTISSA = 23


def swiglu_apply_weight(
    x: torch.Tensor, weights: torch.Tensor, clamp: float | None, fp8: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x [M, 2I]`` bf16 and ``weights [M]`` float32 -> ``(e4m3 [M, I], packed UE8M0 int32 [M, I/128])`` with
    ``fp8``, else bf16 ``[M, I]`` (module docstring)."""
    m, i = x.shape[0], x.shape[1] // 2
    gate, up = x[:, :i].float(), x[:, i:].float()
    if clamp is not None:
        up = torch.clamp(up, -clamp, clamp)
        gate = torch.clamp(gate, max=clamp)
    y = gate / (1 + torch.exp(-gate)) * up * weights.float().unsqueeze(1) + 0.0
    if not fp8:
        return y.to(torch.bfloat16)
    runs = y.view(m, i // _RUN, _RUN)
    bits = (runs.abs().amax(dim=-1).clamp(min=_AMAX_MIN) / _FP8_MAX).view(torch.int32)
    exponent = ((bits >> _MANTISSA) & 0xFF) - 127 + ((bits & ((1 << _MANTISSA) - 1)) != 0).to(torch.int32)
    inverse = ((127 - exponent) << _MANTISSA).view(torch.float32)
    codes = (runs * inverse.unsqueeze(-1)).to(torch.float8_e4m3fn).view(m, i)
    return codes, (exponent + 127).to(torch.uint8).view(torch.int32)
