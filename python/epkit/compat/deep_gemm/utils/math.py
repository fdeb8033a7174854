"""DeepGEMM's ``deep_gemm.utils.math``: integer rounding, UE8M0 scale packing, and the casts to FP8 (e4m3) and FP4
(e2m1) that DeepGEMM's tests and engines quantize with. Names, parameters, defaults, shapes and dtypes are
DeepGEMM's, and so are the bits: the casts compute as DeepGEMM's do on a GPU, on any device.

The arithmetic, which fixes the bits:

- a group's scale is ``max(amax, 1e-4) * (1 / 448)`` (FP8) or ``max(amax, 1e-4) * (1 / 6)`` (FP4) in float32:
  what CUDA torch computes for DeepGEMM's ``amax / 448`` (it divides by a scalar as a multiply by the
  reciprocal; ``epkit.quant`` computes its scales so too). With ``use_ue8m0`` it is rounded up to a power of two
  (:func:`ceil_to_ue8m0`);
- values are multiplied by the float32 reciprocal of their scale, not divided by it (the two differ in the last
  bit of some float32 products, and so, rarely, in a rounded code), then rounded: to e4m3 by torch's cast
  (nearest, ties to even; up to 480 saturates at 448), to e2m1 by magnitude with ties to the smaller one.

``epkit.quant``'s casts give the same bits where their arithmetic is the same (power-of-two scales, the MXFP4
case); these keep DeepGEMM's formulation for the rest. Errors are ``ValueError`` naming the argument, where
DeepGEMM asserts.
"""

from __future__ import annotations

import torch

from epkit.compat._details.deep_gemm_scales import unpack_ue8m0
from epkit.quant import FP4_E2M1_MAX, FP8_E4M3_MAX, e2m1_to_float
from epkit.quant import ceil_to_ue8m0 as _ceil_pow2

__all__ = [
    "ceil_div",
    "align",
    "ceil_to_ue8m0",
    "pack_ue8m0_to_int",
    "unpack_ue8m0_from_int",
    "per_token_cast_to_fp8",
    "per_channel_cast_to_fp8",
    "per_block_cast_to_fp8",
    "per_custom_dims_cast_to_fp8",
    "per_token_cast_to_fp4",
    "transpose_packed_fp4",
    "cast_back_from_fp4",
]

_AMAX_FLOOR = 1e-4  # DeepGEMM's floor of a group's amax (an all-zero group gets a finite scale)
_UE8M0_TOP = 2.0**127  # the largest power of two DeepGEMM's ceil_to_ue8m0 gives (exponent byte 254)
_Pair = tuple[torch.Tensor, torch.Tensor]


def ceil_div(x: int, y: int) -> int:
    """``x / y`` rounded up (integers)."""
    return -(-x // y)


def align(x: int, y: int) -> int:
    """``x`` rounded up to a multiple of ``y``."""
    return ceil_div(x, y) * y


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``>= |x|`` (float32, same shape), in ``[2**-126, 2**127]``: zero and subnormals give
    ``2**-126``; above ``2**127``, infinities and NaN give ``2**127`` (DeepGEMM clamps the exponent byte to [1,
    254]). :func:`epkit.quant.ceil_to_ue8m0` with that top."""
    pow2 = _ceil_pow2(x)
    return torch.nan_to_num(pow2, nan=_UE8M0_TOP, posinf=_UE8M0_TOP).clamp(max=_UE8M0_TOP)


def pack_ue8m0_to_int(x: torch.Tensor) -> torch.Tensor:
    """float32 powers of two ``[..., 4 * S]`` as packed UE8M0 int32 ``[..., S]``: each scale's exponent byte, four
    per int32, the ``j``-th of four consecutive scales in byte ``j`` (little-endian). Reads ``x`` on the host to
    check it (DeepGEMM asserts the same)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() == 0 or x.shape[-1] % 4:
        raise ValueError(
            "pack_ue8m0_to_int: x must be float32 with a last dim that is a multiple of 4, got "
            f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}"
        )
    bits = x.contiguous().view(torch.int32)
    if x.numel() and not bool(((bits >= 0) & (bits & 0x7FFFFF == 0)).all()):
        raise ValueError("pack_ue8m0_to_int: x must hold non-negative powers of two (UE8M0 scales: no mantissa bits)")
    return (bits >> 23).to(torch.uint8).view(torch.int32)


def unpack_ue8m0_from_int(packed_sf: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., 4 * S]`` scales of packed UE8M0 int32 ``[..., S]`` (the inverse of :func:`pack_ue8m0_to_int`;
    a zero byte reads as 0.0)."""
    if not isinstance(packed_sf, torch.Tensor) or packed_sf.dtype != torch.int32 or packed_sf.dim() == 0:
        raise ValueError(f"unpack_ue8m0_from_int: packed_sf must be an int32 tensor, got {packed_sf!r:.80}")
    return unpack_ue8m0(packed_sf, 4 * packed_sf.shape[-1])


def _scales(amax: torch.Tensor, top: float, use_ue8m0: bool) -> torch.Tensor:
    """float32 scales of float32 group maxima (see the module docstring)."""
    sf = amax.clamp(min=_AMAX_FLOOR) * (1.0 / top)
    return ceil_to_ue8m0(sf) if use_ue8m0 else sf


def _fp8(x: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """e4m3 of ``x * (1 / sf)`` (``sf`` broadcast), the product in float32."""
    return (x.float() * torch.reciprocal(sf)).to(torch.float8_e4m3fn)


def _matrix(fn: str, x: torch.Tensor) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{fn}: x must be a 2-D floating-point tensor, got {x!r:.80}")
    return x.shape[0], x.shape[1]


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` zero-padded at the end of its two dims to ``[rows, cols]``."""
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128, use_packed_ue8m0: bool = False) -> _Pair:
    """``x [M, K]`` to e4m3 with one scale per ``1 x gran_k`` group of a row: ``(e4m3 [M, K], float32 [M,
    ceil(K / gran_k)])``, the scales packed (``use_packed_ue8m0``, which needs ``use_ue8m0`` and a multiple of 4
    groups) as int32 ``[M, ceil(K / gran_k) / 4]``."""
    m, k = _matrix("per_token_cast_to_fp8", x)
    groups = ceil_div(k, gran_k)
    xv = _padded(x, m, groups * gran_k).view(m, groups, gran_k)
    sf = _scales(xv.abs().float().amax(dim=2), FP8_E4M3_MAX, use_ue8m0)
    q = _fp8(xv, sf.unsqueeze(2)).view(m, groups * gran_k)[:, :k].contiguous()
    return q, (pack_ue8m0_to_int(sf) if use_packed_ue8m0 else sf)


def per_channel_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128) -> _Pair:
    """``x [M, K]`` (``M`` a multiple of ``gran_k``) to e4m3 with one scale per ``gran_k x 1`` group of a column:
    ``(e4m3 [M, K], float32 [M / gran_k, K])``."""
    m, k = _matrix("per_channel_cast_to_fp8", x)
    if m % gran_k:
        raise ValueError(f"per_channel_cast_to_fp8: x's rows ({m}) must be a multiple of gran_k = {gran_k}")
    xv = x.reshape(m // gran_k, gran_k, k)
    sf = _scales(xv.abs().float().amax(dim=1), FP8_E4M3_MAX, use_ue8m0)
    return _fp8(xv, sf.unsqueeze(1)).view(m, k), sf


def per_block_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128) -> _Pair:
    """``x [M, N]`` to e4m3 with one scale per ``gran_k x gran_k`` block: ``(e4m3 [M, N], float32 [ceil(M /
    gran_k), ceil(N / gran_k)])``."""
    m, n = _matrix("per_block_cast_to_fp8", x)
    mb, nb = ceil_div(m, gran_k), ceil_div(n, gran_k)
    xv = _padded(x, mb * gran_k, nb * gran_k).view(mb, gran_k, nb, gran_k)
    sf = _scales(xv.abs().float().amax(dim=(1, 3), keepdim=True), FP8_E4M3_MAX, use_ue8m0)
    q = _fp8(xv, sf).view(mb * gran_k, nb * gran_k)[:m, :n].contiguous()
    return q, sf.view(mb, nb)


def per_custom_dims_cast_to_fp8(x: torch.Tensor, dims: tuple[int, ...], use_ue8m0: bool) -> _Pair:
    """``x`` to e4m3 with one scale per index of the dims in ``dims`` (the maximum taken over every other dim):
    ``(e4m3 of x's shape, float32 scales squeezed of every size-1 dim)``. As in DeepGEMM, only dims ``0 ..
    x.dim() - 1`` in ``dims`` count (a negative one keeps nothing), and with no dim left to reduce the maximum is
    over the whole tensor."""
    keep = set(dims)
    over = tuple(i for i in range(x.dim()) if i not in keep)
    sf = _scales(x.abs().float().amax(dim=over, keepdim=True), FP8_E4M3_MAX, use_ue8m0)
    return _fp8(x, sf), sf.squeeze()


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8) of float32 ``v``: the magnitude's code counts the midpoints between e2m1 values it
    exceeds (a value on a midpoint takes the smaller magnitude; past 6 it is 6), the sign bit 3 (never on zero)."""
    values = e2m1_to_float(torch.arange(8, dtype=torch.uint8))  # on the host: no device read for the midpoints
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for mid in ((values[:-1] + values[1:]) / 2).tolist():
        code += (mag > mid).to(torch.uint8)
    return code | (((v < 0) & (code > 0)).to(torch.uint8) << 3)


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 ``[..., n / 2]`` of uint8 codes ``[..., n]``: the even element in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def _codes_of(packed: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., 2 * n]`` of packed int8 ``[..., n]`` (inverse of :func:`_pack_codes`)."""
    b = packed.contiguous().view(torch.uint8)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)


def per_token_cast_to_fp4(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128, use_packed_ue8m0: bool = False) -> _Pair:
    """``x [M, K]`` (``K`` even) to e2m1 with one scale per ``1 x gran_k`` group: ``(int8 [M, K / 2]`` (two codes a
    byte, the even element in the low nibble), ``float32 [M, ceil(K / gran_k)])``. ``use_packed_ue8m0`` (needs
    ``use_ue8m0``) packs the scales as int32 ``[M, ceil(groups / 4)]``, the groups padded to a multiple of 4 with
    1.0 (covering no values)."""
    m, k = _matrix("per_token_cast_to_fp4", x)
    if k % 2:
        raise ValueError(f"per_token_cast_to_fp4: x's last dim ({k}) must be even (two codes a byte)")
    if use_packed_ue8m0 and not use_ue8m0:
        raise ValueError("per_token_cast_to_fp4: use_packed_ue8m0 needs use_ue8m0 (packed scales are powers of two)")
    groups = ceil_div(k, gran_k)
    xv = _padded(x, m, groups * gran_k).view(m, groups, gran_k)
    sf = _scales(xv.abs().float().amax(dim=2), FP4_E2M1_MAX, use_ue8m0)
    codes = _e2m1_codes(xv.float() * torch.reciprocal(sf).unsqueeze(2)).view(m, groups * gran_k)
    packed = _pack_codes(codes)[:, : k // 2].contiguous()
    if not use_packed_ue8m0:
        return packed, sf
    return packed, pack_ue8m0_to_int(torch.nn.functional.pad(sf, (0, align(groups, 4) - groups), value=1.0))


def transpose_packed_fp4(a: torch.Tensor) -> torch.Tensor:
    """The transpose of packed e2m1 codes: int8 ``[M, N / 2]`` (``M`` even) -> int8 ``[N, M / 2]``, repacked along
    the new rows."""
    if not isinstance(a, torch.Tensor) or a.dtype != torch.int8 or a.dim() != 2 or a.shape[0] % 2:
        raise ValueError(f"transpose_packed_fp4: a must be a 2-D int8 tensor with an even row count, got {a!r:.80}")
    return _pack_codes(_codes_of(a).t().contiguous()).contiguous()


def cast_back_from_fp4(
    packed: torch.Tensor, sf: torch.Tensor, gran_k: int = 128, use_packed_ue8m0: bool = False
) -> torch.Tensor:
    """float32 ``[M, K]`` of packed e2m1 codes ``int8 [M, K / 2]`` and their scales (float32 ``[M, >= K / gran_k]``,
    or packed UE8M0 int32 with ``use_packed_ue8m0``): each code's value times its group's scale (code 8, a
    negative zero, reads as +0.0, as in DeepGEMM)."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 2 or packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"cast_back_from_fp4: packed must be a 2-D int8 tensor, got {packed!r:.80}")
    scales = unpack_ue8m0_from_int(sf) if use_packed_ue8m0 else sf
    values = e2m1_to_float(_codes_of(packed)) + 0.0  # -0.0 + 0.0 is +0.0
    group = torch.arange(values.shape[1], device=packed.device) // gran_k
    return values * scales[:, group]
