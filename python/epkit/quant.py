"""Quantization formats of the expert GEMMs: FP8 (e4m3) per token group / per block, MXFP4, NVFP4.

Conventions (DeepGEMM / OCP MX / NVIDIA NVFP4); every scale here is the
*decode* factor, ``x ~= q * scale``:

- FP8 per token group: ``scale = max(amax(|x|), 1e-4) * (1 / 448)`` per ``1 x group_size``
  group (optionally rounded up to a power of two, "UE8M0", by :func:`ceil_to_ue8m0`),
  ``q = e4m3(x / scale)``. The scale is the float32 product with the float32 reciprocal of 448 on every
  device, on purpose: that is what CUDA torch computes for ``amax / 448`` (it divides by a scalar as a
  multiply by the reciprocal), so the scales are the same bits on a CPU and a GPU and equal DeepGEMM's
  helpers run on a GPU; a true float32 division, as a CPU computes ``amax / 448``, differs from it by
  one ulp for some amax (for example 0.1, or 3.0).
- FP8 per block: the same over ``128 x 128`` blocks of a weight ``[.., N, K]``.
- MXFP4: e2m1 codes, two per byte (even element in the low nibble), one
  e8m0 scale byte ``2**(byte - 127)`` per 32 elements along K: the smallest power of two
  ``>= max(amax, amax_min) * (1 / 6)`` (so ``amax / scale <= 6``, nothing clips), the codes rounded to
  the nearest e2m1 value with ties to the even code (the OCP MX convention; ``ties="down"`` and
  ``amax_min=1e-4`` give DeepGEMM's ``per_token_cast_to_fp4(x, use_ue8m0=True, gran_k=32)`` instead).
- NVFP4: e2m1 codes, one e4m3 scale per 16 elements and one float32 global
  scale: ``x ~= e2m1 * float(block_scale) * global_scale`` with
  ``global_scale = amax(|x|) / (448 * 6)``.

All-zero groups get finite, positive scales (the amax is clamped). NaN or Inf
input raises ``ValueError`` (except during CUDA stream capture, where nothing can be read on the host: there
NaN/Inf pass into the codes and scales). The four quantizers are ``torch.ops.epkit`` custom ops
(``epkit.ops``); the dequantizers and :func:`ceil_to_ue8m0` are plain torch, which compiles as it is.
"""

from __future__ import annotations

import torch

from epkit.ops import custom_op, host_checks

__all__ = [
    "FP8_E4M3_MAX",
    "FP4_E2M1_MAX",
    "FP8_BLOCK",
    "MXFP4_BLOCK",
    "NVFP4_BLOCK",
    "ceil_to_ue8m0",
    "per_token_group_cast_to_fp8",
    "per_block_cast_to_fp8",
    "dequant_per_token_group_fp8",
    "dequant_per_block_fp8",
    "cast_to_mxfp4",
    "dequant_mxfp4",
    "cast_to_nvfp4",
    "dequant_nvfp4",
    "e2m1_to_float",
    "E2M1_TIES",
]

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
#: Elements per FP8 scale: ``1 x FP8_BLOCK`` activation groups along K, ``FP8_BLOCK x FP8_BLOCK`` weight blocks.
FP8_BLOCK = 128
#: Elements per MXFP4 e8m0 scale along K.
MXFP4_BLOCK = 32
#: Elements per NVFP4 e4m3 scale along K.
NVFP4_BLOCK = 16
# Scales are amax times this, on every device: torch on CUDA divides by a Python scalar as a multiply by its
# reciprocal, so amax / 448 gives other bits on a GPU than on the CPU.
_INV_FP8_MAX = 1.0 / FP8_E4M3_MAX
_AMAX_EPS = 1e-4
# e2m1 magnitudes by 3-bit code (sign is bit 3).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes.
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIES_UP = (0.75, 1.75, 3.5)  # midpoints whose upper neighbour has the even code
#: Tie rules of the e2m1 rounding: to the even code (OCP MX), or down to the smaller magnitude (DeepGEMM).
E2M1_TIES = ("even", "down")
_F32_MANTISSA = (1 << 23) - 1


def _check_float(x: torch.Tensor, name: str, min_dim: int = 1) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(x.shape)}")


def _check_finite(x: torch.Tensor, name: str) -> None:
    """Raise on NaN/Inf (reads ``x`` on the host: the quantizer ops run it outside CUDA stream capture only)."""
    if x.numel() and host_checks(x.device) and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} holds {bad} NaN/Inf value(s); quantization needs finite input")


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Round scales up to a power of two, the UE8M0 scale format: the smallest power of two ``>= |x|``.

    Computed on the float32 bits (the exponent, plus one when any mantissa bit is set), so it is exact:
    never below its input (``log2`` in float32 rounds ``2**-30 * (1 + 2**-23)`` to -30, which would give
    ``2**-30``; the result is ``2**-29``). The same bits as DeepGEMM's ``ceil_to_ue8m0`` wherever
    ``2**-126 <= |x| <= 2**127``.

    Parameters
    ----------
    x : Tensor, floating point (any shape); read as float32.

    Returns
    -------
    Tensor of the same shape, float32. Zero and subnormal inputs give ``2**-126``, the smallest normal
    float32 and UE8M0 byte 1 (DeepGEMM's floor; a scale is never zero); finite inputs above ``2**127``
    and infinities give ``inf`` (no finite power of two is above them; DeepGEMM clamps them to
    ``2**127``); NaN gives NaN.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    xf = x.float().abs()
    bits = xf.view(torch.int32)
    exp = (bits >> 23) + ((bits & _F32_MANTISSA) != 0).to(torch.int32)  # sign bit cleared by abs
    out = (exp.clamp(min=1, max=255) << 23).view(torch.float32)
    return torch.where(torch.isnan(xf), xf, out)


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def per_token_group_cast_to_fp8(
    x: torch.Tensor, group_size: int = FP8_BLOCK, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to e4m3 with one float32 scale per ``1 x group_size`` group.

    Parameters
    ----------
    x : Tensor [..., K], float32 / bfloat16 / float16
        Finite values (NaN/Inf raise ``ValueError``).
    group_size : int
        Elements per scale along K (default 128).
    ue8m0 : bool
        Round scales up to powers of two (the UE8M0 recipe).

    Returns
    -------
    q : Tensor [..., K], float8_e4m3fn
    scale : Tensor [..., ceil(K / group_size)], float32
        ``x ~= q * scale`` per group: ``max(amax, 1e-4) * (1 / 448)`` as float32 on every device (what a
        GPU computes for ``amax / 448``; a CPU division can differ by one ulp, see the module docstring),
        all-zero groups ``1e-4 * (1 / 448)``; with ``ue8m0`` that rounded up by :func:`ceil_to_ue8m0`.
    """
    _check_float(x, "x")
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    return _per_token_group_op(x, group_size, bool(ue8m0))


def _fake_per_token_group(x, group_size, ue8m0):
    scale = x.new_empty((*x.shape[:-1], -(-x.shape[-1] // group_size)), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), scale


@custom_op("per_token_group_cast_to_fp8", _fake_per_token_group)
def _per_token_group_op(x: torch.Tensor, group_size: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.epkit.per_token_group_cast_to_fp8``: the finiteness check (not during CUDA stream capture,
    where NaN/Inf pass into the codes and scales), then :func:`cast_groups_to_fp8`."""
    _check_finite(x, "x")
    return cast_groups_to_fp8(x, group_size, ue8m0)


def cast_groups_to_fp8(x: torch.Tensor, group_size: int = FP8_BLOCK, ue8m0: bool = False):
    """:func:`per_token_group_cast_to_fp8` without its checks, which read ``x`` on the host (a device sync).

    For stream-ordered callers (the low-latency dispatch); non-finite input gives unspecified rows.
    """
    k = x.shape[-1]
    groups = -(-k // group_size)
    xv = _pad_last(x.float(), group_size).reshape(*x.shape[:-1], groups, group_size)
    amax = xv.abs().amax(dim=-1).clamp(min=_AMAX_EPS)
    scale = amax * _INV_FP8_MAX  # not amax / 448: a GPU divides by a scalar as a multiply by 1/448
    if ue8m0:
        scale = ceil_to_ue8m0(scale)
    q = (xv / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*x.shape[:-1], groups * group_size)[..., :k].contiguous()
    return q, scale.contiguous()


def dequant_per_token_group_fp8(q: torch.Tensor, scale: torch.Tensor, group_size: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of :func:`per_token_group_cast_to_fp8`.

    Parameters
    ----------
    q : Tensor [..., K], float8_e4m3fn
    scale : Tensor [..., ceil(K / group_size)], float32
    group_size : int

    Returns
    -------
    Tensor [..., K], float32: ``q * scale`` per group.
    """
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q must be float8_e4m3fn, got {q.dtype}")
    k = q.shape[-1]
    groups = -(-k // group_size)
    if tuple(scale.shape) != (*q.shape[:-1], groups):
        raise ValueError(
            f"scale must have shape {(*q.shape[:-1], groups)} for q {tuple(q.shape)}, got {tuple(scale.shape)}"
        )
    s = scale.float().repeat_interleave(group_size, dim=-1)[..., :k]
    return q.float() * s


def per_block_cast_to_fp8(
    w: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK), ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights to e4m3 with one float32 scale per ``block`` of the last two dims.

    Parameters
    ----------
    w : Tensor [..., N, K], float32 / bfloat16 / float16
        Finite values; leading dims (e.g. experts) are kept.
    block : (int, int)
        Block shape along (N, K); default (128, 128).
    ue8m0 : bool
        Round scales up to powers of two.

    Returns
    -------
    q : Tensor [..., N, K], float8_e4m3fn
    scale : Tensor [..., ceil(N / block[0]), ceil(K / block[1])], float32
        ``max(amax, 1e-4) * (1 / 448)`` per block, as :func:`per_token_group_cast_to_fp8` computes it.
    """
    _check_float(w, "w", min_dim=2)
    bn, bk = block
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block must be two positive ints, got {block!r}")
    return _per_block_op(w, bn, bk, bool(ue8m0))


def _fake_per_block(w, bn, bk, ue8m0):
    *lead, n, k = w.shape
    scale = w.new_empty((*lead, -(-n // bn), -(-k // bk)), dtype=torch.float32)
    return w.new_empty(w.shape, dtype=torch.float8_e4m3fn), scale


@custom_op("per_block_cast_to_fp8", _fake_per_block)
def _per_block_op(w: torch.Tensor, bn: int, bk: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.epkit.per_block_cast_to_fp8``: the finiteness check (not during CUDA stream capture), then the
    block quantization of :func:`per_block_cast_to_fp8`."""
    _check_finite(w, "w")
    *lead, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    wp = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    wv = wp.reshape(*lead, nb, bn, kb, bk)
    amax = wv.abs().amax(dim=(-3, -1)).clamp(min=_AMAX_EPS)  # [..., nb, kb]
    scale = amax * _INV_FP8_MAX  # not amax / 448: a GPU divides by a scalar as a multiply by 1/448
    if ue8m0:
        scale = ceil_to_ue8m0(scale)
    q = (wv / scale[..., :, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous()
    return q, scale.contiguous()


def dequant_per_block_fp8(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
) -> torch.Tensor:
    """Inverse of :func:`per_block_cast_to_fp8`.

    Parameters
    ----------
    q : Tensor [..., N, K], float8_e4m3fn
    scale : Tensor [..., ceil(N / block[0]), ceil(K / block[1])], float32

    Returns
    -------
    Tensor [..., N, K], float32.
    """
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q must be float8_e4m3fn, got {q.dtype}")
    *lead, n, k = q.shape
    bn, bk = block
    want = (*lead, -(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale must have shape {want} for q {tuple(q.shape)}, got {tuple(scale.shape)}")
    s = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return q.float() * s


# FP4 (e2m1) codes


def _e2m1_encode(v: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """Round float32 values (already scaled into [-6, 6]) to 4-bit e2m1 codes (uint8); ``ties`` "even" or "down"."""
    mag = v.abs().clamp(max=FP4_E2M1_MAX)
    mids = torch.tensor(_E2M1_MIDS, dtype=torch.float32, device=v.device)
    code = torch.bucketize(mag, mids, right=False)  # exact midpoints go to the lower code
    if ties == "even":
        ties_up = torch.isin(mag, torch.tensor(_E2M1_TIES_UP, dtype=torch.float32, device=v.device))
        code = code + ties_up.to(code.dtype)
    code = code.to(torch.uint8)
    sign = (v < 0) & (code > 0)  # no negative zero
    return code | (sign.to(torch.uint8) << 3)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit e2m1 codes (uint8 values 0..15, sign in bit 3) to float32."""
    table = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def cast_to_mxfp4(
    w: torch.Tensor, *, ties: str = "even", amax_min: float = 2.0**-126
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to MXFP4: e2m1 codes with one e8m0 scale per 32 elements along the last dim.

    Parameters
    ----------
    w : Tensor [..., K], float32 / bfloat16 / float16, K a multiple of 32
        Finite values.
    ties : ``"even"`` (default) or ``"down"``
        How a value exactly between two e2m1 magnitudes rounds: to the even code (the OCP MX convention:
        0.75 -> 1, 1.75 -> 2, 3.5 -> 4 in units of the scale) or to the smaller magnitude (DeepGEMM's
        ``per_token_cast_to_fp4``: 0.75 -> 0.5, 1.75 -> 1.5, 3.5 -> 3). Only those three ties differ.
    amax_min : float
        Floor of each block's amax before its scale is chosen (default ``2**-126``, i.e. the block's own
        amax; DeepGEMM floors it at ``1e-4``, which changes the scales and codes of blocks below it).

    Returns
    -------
    packed : Tensor [..., K // 2], uint8
        Two codes per byte, the even element in the low nibble.
    scale : Tensor [..., K // 32], uint8
        e8m0 exponents: the block scale is ``2 ** (scale - 127)``, :func:`ceil_to_ue8m0` of
        ``max(amax, amax_min) * (1 / 6)`` (so ``amax / scale <= 6``; nothing clips).

    ``cast_to_mxfp4(w, ties="down", amax_min=1e-4)`` gives the codes and scales of DeepGEMM's
    ``per_token_cast_to_fp4(w, use_ue8m0=True, gran_k=32)`` on a GPU, bit for bit.
    """
    _check_float(w, "w")
    if ties not in E2M1_TIES:
        raise ValueError(f"ties must be one of {E2M1_TIES}, got {ties!r}")
    if not isinstance(amax_min, (int, float)) or not amax_min > 0:
        raise ValueError(f"amax_min must be a positive number, got {amax_min!r}")
    k = w.shape[-1]
    if k % MXFP4_BLOCK:
        raise ValueError(f"w's last dim K = {k} must be a multiple of {MXFP4_BLOCK} (the MXFP4 block)")
    return _mxfp4_op(w, ties, float(amax_min))


def _fake_mxfp4(w, ties, amax_min):
    k = w.shape[-1]
    return w.new_empty((*w.shape[:-1], k // 2), dtype=torch.uint8), w.new_empty(
        (*w.shape[:-1], k // MXFP4_BLOCK), dtype=torch.uint8
    )


@custom_op("cast_to_mxfp4", _fake_mxfp4)
def _mxfp4_op(w: torch.Tensor, ties: str, amax_min: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.epkit.cast_to_mxfp4``: the finiteness check (not during CUDA stream capture), then the MXFP4
    quantization of :func:`cast_to_mxfp4`."""
    _check_finite(w, "w")
    k = w.shape[-1]
    wv = w.float().reshape(*w.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = wv.abs().amax(dim=-1).clamp(min=amax_min)
    scale = ceil_to_ue8m0(amax * (1.0 / FP4_E2M1_MAX))  # as a GPU computes amax / 6; a power of two >= it
    codes = _e2m1_encode(wv / scale.unsqueeze(-1), ties).reshape(w.shape)
    return _pack_nibbles(codes), (scale.view(torch.int32) >> 23).to(torch.uint8).contiguous()


def _fp4_blocks(packed: torch.Tensor, scale: torch.Tensor, block: int) -> tuple[int, torch.Tensor]:
    """``(K, values [..., K // block, block] float32)`` of packed e2m1 codes, after checking ``scale``'s shape."""
    k = packed.shape[-1] * 2
    if k % block or tuple(scale.shape) != (*packed.shape[:-1], k // block):
        raise ValueError(f"scale must have shape {(*packed.shape[:-1], k // block)} for packed {tuple(packed.shape)}")
    return k, e2m1_to_float(_unpack_nibbles(packed)).reshape(*packed.shape[:-1], k // block, block)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`cast_to_mxfp4`.

    Parameters
    ----------
    packed : Tensor [..., K // 2], uint8
    scale : Tensor [..., K // 32], uint8 (e8m0)

    Returns
    -------
    Tensor [..., K], float32.
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    k, vals = _fp4_blocks(packed, scale, MXFP4_BLOCK)
    s = torch.pow(2.0, scale.float() - 127.0)
    return (vals * s.unsqueeze(-1)).reshape(*packed.shape[:-1], k)


def cast_to_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize to NVFP4: e2m1 codes, one e4m3 scale per 16 elements, one float32 global scale.

    Parameters
    ----------
    w : Tensor [..., K], float32 / bfloat16 / float16, K a multiple of 16
        Finite values.

    Returns
    -------
    packed : Tensor [..., K // 2], uint8 (even element in the low nibble)
    scale : Tensor [..., K // 16], float8_e4m3fn
    global_scale : Tensor [], float32
        ``w ~= e2m1 * float(scale) * global_scale``; ``global_scale = amax(|w|) / 2688``.
    """
    _check_float(w, "w")
    k = w.shape[-1]
    if k % NVFP4_BLOCK:
        raise ValueError(f"w's last dim K = {k} must be a multiple of {NVFP4_BLOCK} (the NVFP4 block)")
    return _nvfp4_op(w)


def _fake_nvfp4(w):
    k = w.shape[-1]
    packed = w.new_empty((*w.shape[:-1], k // 2), dtype=torch.uint8)
    scale = w.new_empty((*w.shape[:-1], k // NVFP4_BLOCK), dtype=torch.float8_e4m3fn)
    return packed, scale, w.new_empty((), dtype=torch.float32)


@custom_op("cast_to_nvfp4", _fake_nvfp4)
def _nvfp4_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.epkit.cast_to_nvfp4``: the finiteness check (not during CUDA stream capture), then the NVFP4
    quantization of :func:`cast_to_nvfp4`."""
    _check_finite(w, "w")
    k = w.shape[-1]
    wf = w.float()
    amax = wf.abs().amax() if wf.numel() else torch.zeros((), device=w.device)
    gscale = amax.clamp(min=_AMAX_EPS) * (1.0 / (FP8_E4M3_MAX * FP4_E2M1_MAX))  # as a GPU computes it
    wv = wf.reshape(*w.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    block = wv.abs().amax(dim=-1) / (FP4_E2M1_MAX * gscale)
    scale = block.clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    eff = scale.float() * gscale
    safe = torch.where(eff > 0, eff, torch.ones_like(eff))
    v = torch.where((eff > 0).unsqueeze(-1), wv / safe.unsqueeze(-1), torch.zeros_like(wv))
    codes = _e2m1_encode(v).reshape(w.shape)
    return _pack_nibbles(codes), scale.contiguous(), gscale.float().clone()


def dequant_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    """Inverse of :func:`cast_to_nvfp4`.

    Parameters
    ----------
    packed : Tensor [..., K // 2], uint8
    scale : Tensor [..., K // 16], float8_e4m3fn
    global_scale : Tensor [] float32 or float

    Returns
    -------
    Tensor [..., K], float32.
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"packed must be uint8 and scale float8_e4m3fn, got {packed.dtype} and {scale.dtype}")
    k, vals = _fp4_blocks(packed, scale, NVFP4_BLOCK)
    g = float(global_scale) if not isinstance(global_scale, torch.Tensor) else global_scale.float()
    return (vals * (scale.float() * g).unsqueeze(-1)).reshape(*packed.shape[:-1], k)
