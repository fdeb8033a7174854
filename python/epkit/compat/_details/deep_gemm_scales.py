"""DeepGEMM's scale layouts and argument checks for ``epkit.compat.deep_gemm``: its TMA-aligned MN-major layouts
and packed UE8M0 scales, converted to the float32 / e8m0 scales of :mod:`epkit.grouped_gemm`.

Packed UE8M0: an int32 holds four exponent bytes, byte ``j`` (little-endian) for the ``j``-th of four
consecutive scale groups; the scale is the float32 whose exponent field is the byte (``byte << 23``: ``2 **
(byte - 127)``, and 0 for byte 0, as DeepGEMM's ``unpack_ue8m0_from_int`` reads it). All conversions are
device ops (no host read).
"""

from __future__ import annotations

import torch

from epkit.grouped_gemm import get_mk_alignment_for_contiguous_layout
from epkit.quant import FP8_BLOCK, MXFP4_BLOCK

__all__ = [
    "DEFAULT_ALIGNMENT",
    "get_tma_aligned_size",
    "get_mn_major_tma_aligned_tensor",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor",
    "transform_sf_into_required_layout",
    "unpack_ue8m0",
    "dequantize",
    "activation_scales",
    "fp8_weight_scales",
    "fp4_weights",
    "rows_of_psum",
    "check_flags",
]

#: DeepGEMM's default M alignment of the contiguous layout, which epkit's GEMMs take (128).
DEFAULT_ALIGNMENT = get_mk_alignment_for_contiguous_layout()
_TMA_BYTES = 16  # TMA's alignment of a row stride


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """``x`` rounded up to a whole number of 16-byte units of ``element_size``-byte elements."""
    if element_size <= 0 or _TMA_BYTES % element_size:
        raise ValueError(f"element_size must divide {_TMA_BYTES}, got {element_size!r}")
    per = _TMA_BYTES // element_size
    return -(-x // per) * per


def _batched(sf: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(sf, torch.Tensor) or sf.dim() not in (2, 3) or sf.dtype != torch.float32:
        raise ValueError(f"{name}: sf must be a float32 [MN, K] or [G, MN, K] tensor, got {getattr(sf, 'dtype', sf)}")
    return sf if sf.dim() == 3 else sf.unsqueeze(0)


def get_mn_major_tma_aligned_tensor(sf: torch.Tensor) -> torch.Tensor:
    """``sf`` (float32 ``[MN, K]`` or ``[G, MN, K]``) in the MN-major layout TMA reads: the same values, strides ``(1,
    align(MN, 4))`` per group (itself when it already is)."""
    b = _batched(sf, "get_mn_major_tma_aligned_tensor")
    groups, mn, k = b.shape
    aligned = get_tma_aligned_size(mn, 4)
    if (b.stride(0) == aligned * k or sf.dim() == 2) and b.stride(1) == 1 and b.stride(2) == aligned:
        return sf
    out = torch.empty_strided((groups, mn, k), (aligned * k, 1, aligned), dtype=sf.dtype, device=sf.device)
    out.copy_(b)
    return out if sf.dim() == 3 else out.squeeze(0)


def get_mn_major_tma_aligned_packed_ue8m0_tensor(
    sf: torch.Tensor, psum_layout: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 power-of-two scales ``[..., MN, K]`` as packed UE8M0 int32 ``[..., MN, ceil(K/4)]`` in the MN-major TMA
    layout (the exponent byte of each scale, DeepGEMM's packing). ``psum_layout`` (which rows DeepGEMM may skip
    packing) is checked; every row is packed."""
    b = _batched(sf, "get_mn_major_tma_aligned_packed_ue8m0_tensor")
    if psum_layout is not None and (not isinstance(psum_layout, torch.Tensor) or psum_layout.dtype != torch.int32):
        raise ValueError("get_mn_major_tma_aligned_packed_ue8m0_tensor: psum_layout must be an int32 tensor or None")
    groups, mn, k = b.shape
    k4 = -(-k // 4) * 4
    exps = ((b.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    packed = torch.nn.functional.pad(exps, (0, k4 - k)).view(torch.int32)  # [G, MN, k4 / 4]
    aligned = get_tma_aligned_size(mn, 4)
    out = torch.empty_strided(
        (groups, mn, k4 // 4), (aligned * (k4 // 4), 1, aligned), dtype=torch.int32, device=sf.device
    )
    out.copy_(packed)
    return out if sf.dim() == 3 else out.squeeze(0)


def get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor(
    sf: torch.Tensor,
    grouped_layout: torch.Tensor,
    ks_cpu: list[int] | None,
    gran_k: int,
    k_alignment: int,
    use_psum_layout: bool = False,
) -> torch.Tensor:
    """The K-grouped GEMMs' float32 power-of-two scales ``sf [sum(ceil(k_g / gran_k)), MN]`` (each group's rows one
    after the other) as packed UE8M0 int32 ``[rows, MN]``: group ``g``'s ``ceil(k_g / gran_k)`` scale rows become
    ``ceil(k_g / (4 * gran_k))`` int32 rows (byte ``j`` of a row from its ``j``-th scale row, zero-padded), the
    groups' packed rows one after the other.

    The groups' K sizes are ``ks_cpu`` or, with ``use_psum_layout``, those of ``grouped_layout``'s cumulative ends
    (each group starting at the previous end rounded up to ``k_alignment``; read on the host). ``rows`` is the sum of
    ``ceil(k / (4 * gran_k))`` over ``ks_cpu`` when given (which may exceed the packed rows with a psum layout: the rest
    are zeros), else ``(sf rows + 3 * G) // 4`` (DeepGEMM's upper bound)."""
    from epkit.compat._details.deep_gemm_k_grouped import group_ranges  # here: that module imports this one

    fn = "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor"
    if gran_k not in (32, 128) or not isinstance(k_alignment, int) or k_alignment <= 0 or k_alignment % 32:
        raise ValueError(
            f"{fn}: gran_k must be 32 or 128 and k_alignment a positive multiple of 32, got {gran_k}, {k_alignment}"
        )
    if not isinstance(sf, torch.Tensor) or sf.dtype != torch.float32 or sf.dim() != 2:
        raise ValueError(f"{fn}: sf must be a float32 [sum(ceil(k_g / gran_k)), MN] tensor, got {sf!r:.80}")
    sf_k, mn = sf.shape
    given = list(ks_cpu) if ks_cpu else []
    if given and not use_psum_layout:
        ranges = group_ranges(fn, given, grouped_layout, False, 1)
    else:
        if not use_psum_layout:
            raise ValueError(f"{fn}: ks_cpu must list the groups' K sizes unless use_psum_layout")
        ranges = group_ranges(fn, given, grouped_layout, True, k_alignment)
    rows_sf = [-(-k // gran_k) for _, k in ranges]
    if not use_psum_layout and sum(rows_sf) != sf_k:
        raise ValueError(f"{fn}: sf has {sf_k} rows but ks_cpu {given} need {sum(rows_sf)} (ceil(k / {gran_k}) each)")
    if sum(rows_sf) > sf_k:
        raise ValueError(f"{fn}: sf has {sf_k} rows but the groups need {sum(rows_sf)} (ceil(k / {gran_k}) each)")
    total = sum(-(-k // (4 * gran_k)) for k in given) if given else (sf_k + 3 * len(ranges)) // 4
    exps = ((sf.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)  # [sf_k, MN]
    out = torch.zeros((max(total, 0), mn, 4), dtype=torch.uint8, device=sf.device)
    src = dst = 0
    for r in rows_sf:
        packed = -(-r // 4)
        block = torch.zeros((packed * 4, mn), dtype=torch.uint8, device=sf.device)
        block[:r] = exps[src : src + r]
        out[dst : dst + packed] = block.view(packed, 4, mn).transpose(1, 2)
        src, dst = src + r, dst + packed
    return out.view(torch.int32).squeeze(-1) if total else torch.empty((0, mn), dtype=torch.int32, device=sf.device)


def transform_sf_into_required_layout(
    sf: torch.Tensor,
    mn: int,
    k: int,
    recipe: tuple[int, int, int] | tuple[int, int],
    num_groups: int | None = None,
    is_sfa: bool | None = None,
    disable_ue8m0_cast: bool = False,
    psum_layout: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepGEMM's scale transform, with SM90's answers: float32 1x128 scales -> MN-major TMA-aligned; float32
    128x128 or 1x32 and int32 packed (1x32 / 1x128) -> themselves, after the shape check."""
    fn = "transform_sf_into_required_layout"
    if isinstance(recipe, tuple) and len(recipe) == 3:
        if is_sfa is None:
            raise ValueError(f"{fn}: a 3-tuple recipe needs is_sfa (which operand's granularity to take)")
        gran_mn, gran_k = (recipe[0] if is_sfa else recipe[1]), recipe[2]
    elif isinstance(recipe, tuple) and len(recipe) == 2:
        if is_sfa is not None:
            raise ValueError(f"{fn}: a 2-tuple recipe is one operand's: is_sfa must be None, got {is_sfa!r}")
        gran_mn, gran_k = recipe
    else:
        raise ValueError(f"{fn}: recipe must be a (mn, n, k) or (mn, k) tuple of granularities, got {recipe!r}")
    if not isinstance(sf, torch.Tensor) or sf.dtype not in (torch.float32, torch.int32):
        raise ValueError(f"{fn}: sf must be float32 or int32 (packed UE8M0), got {getattr(sf, 'dtype', sf)}")
    per = 1 if sf.dtype == torch.float32 else 4
    want = ((num_groups,) if num_groups is not None else ()) + (-(-mn // gran_mn), -(-k // (gran_k * per)))
    if tuple(sf.shape) != want:
        raise ValueError(f"{fn}: sf must have shape {want} for mn={mn}, k={k}, recipe {recipe}, got {tuple(sf.shape)}")
    if sf.dtype == torch.float32 and (gran_mn, gran_k) == (1, FP8_BLOCK):
        return get_mn_major_tma_aligned_tensor(sf)
    if (sf.dtype, gran_mn, gran_k) in ((torch.float32, FP8_BLOCK, FP8_BLOCK), (torch.float32, 1, MXFP4_BLOCK)) or (
        sf.dtype == torch.int32 and gran_mn == 1 and gran_k in (MXFP4_BLOCK, FP8_BLOCK)
    ):
        return sf
    raise ValueError(f"{fn}: no layout for {sf.dtype} scales of granularity ({gran_mn}, {gran_k}) (recipe {recipe})")


def _packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 4 * S]`` of int32 ``[..., S]``: byte ``j`` of each int32 (little-endian) at ``4 * i + j``. By
    shifts, not a dtype view: a view needs stride 1 along the last dim, which an MN-major ``[..., MN, 1]`` lacks."""
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).flatten(-2)


def unpack_ue8m0(packed: torch.Tensor, count: int) -> torch.Tensor:
    """float32 ``[..., count]`` scales of packed UE8M0 int32 ``[..., ceil(count / 4)]`` (any strides; byte 0 reads
    as 0.0)."""
    exps = _packed_bytes(packed)[..., :count]
    return (exps.to(torch.int32) << 23).view(torch.float32)


def dequantize(x: torch.Tensor, sf: torch.Tensor, gran_mn: int, gran_k: int) -> torch.Tensor:
    """float32 values of FP8 ``x [..., MN, K]`` with float32 scales ``sf [..., ceil(MN / gran_mn), ceil(K /
    gran_k)]``: each scale covers its ``gran_mn x gran_k`` block, a last partial block (K or MN not a multiple of the
    granularity) only the elements it has, as DeepGEMM's kernels read it. Any strides; the result is contiguous."""
    mn, k = x.shape[-2], x.shape[-1]
    s = sf.float().repeat_interleave(gran_k, dim=-1)[..., :k]
    if gran_mn != 1:
        s = s.repeat_interleave(gran_mn, dim=-2)[..., :mn, :]
    return x.float() * s


def activation_scales(fn: str, sfa: torch.Tensor, k: int) -> torch.Tensor:
    """float32 ``[..., K/128]`` activation scales from float32 ``[..., K/128]`` (any strides) or packed UE8M0 int32
    ``[..., ceil(K/512)]``."""
    groups = -(-k // FP8_BLOCK)
    if sfa.dtype == torch.int32:
        if sfa.shape[-1] != -(-groups // 4):
            raise ValueError(
                f"{fn}: a's packed UE8M0 scales need {-(-groups // 4)} int32 per row, got {tuple(sfa.shape)}"
            )
        return unpack_ue8m0(sfa, groups)
    if sfa.dtype != torch.float32:
        raise ValueError(f"{fn}: a's scales must be float32 or int32 (packed UE8M0), got {sfa.dtype}")
    return sfa.contiguous()


def fp8_weight_scales(fn: str, sfb: torch.Tensor) -> torch.Tensor:
    """float32 128x128 weight scales (contiguous); int32 (per-row 1x128, DeepGEMM's SM100 recipe) is refused."""
    if sfb.dtype != torch.float32:
        raise ValueError(
            f"{fn}: b's scales must be float32 128x128 block scales for FP8 weights (recipe (1, 128, 128)), got "
            f"{sfb.dtype}: per-row packed UE8M0 weight scales (recipe (1, 1, 128)) are not supported"
        )
    return sfb.contiguous()


def fp4_weights(
    fn: str, b: torch.Tensor, sfb: torch.Tensor, gran: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """epkit's MXFP4 weights ``(uint8 [..., N, K/2], e8m0 uint8 [..., N, K/32])`` from DeepGEMM's packed FP4 ``b``
    (int8, even element in the low nibble: the same bytes) and its scales: packed UE8M0 int32 ``[..., N, K/128]``
    (the same bytes) or float32 ``[..., N, K/32]`` (their exponent bytes)."""
    groups = b.shape[-1] * 2 // MXFP4_BLOCK
    if sfb.dtype == torch.int32:
        if sfb.shape[-1] * 4 != groups:
            raise ValueError(f"{fn}: b's packed UE8M0 scales need {groups // 4} int32 per row, got {tuple(sfb.shape)}")
        e8m0 = _packed_bytes(sfb)
    elif sfb.dtype == torch.float32:
        e8m0 = ((sfb.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    else:
        raise ValueError(f"{fn}: b's FP4 scales must be int32 (packed UE8M0) or float32, got {sfb.dtype}")
    return b.contiguous().view(torch.uint8), e8m0


def rows_of_psum(ends: torch.Tensor, m: int, align: int) -> torch.Tensor:
    """Per-row group ids ``[M]`` int32 (-1 padding) of cumulative row ends ``[G]`` whose groups start at the previous
    end rounded up to ``align`` (device ops: nothing is read on the host)."""
    ends = ends.long()
    prev = torch.cat([ends.new_zeros(1), ends[:-1]])
    starts = (prev + align - 1) // align * align
    rows = torch.arange(m, device=ends.device)
    group = torch.searchsorted(ends, rows, right=True)
    inside = (group < ends.numel()) & (rows >= starts[group.clamp(max=max(ends.numel() - 1, 0))])
    return torch.where(inside, group, -1).to(torch.int32)


def check_flags(
    fn: str,
    compiled_dims: object,
    disable_ue8m0_cast: object,
    use_psum_layout: object = False,
    ensure_zero_padding: object = True,
    expected_m_for_psum_layout: object = None,
) -> None:
    """The settings that change no result here (see ``epkit.compat.deep_gemm``) are still checked for type."""
    if not isinstance(compiled_dims, str) or set(compiled_dims) - set("mnk"):
        raise ValueError(
            f"{fn}: compiled_dims must be a string of m, n and k (e.g. 'nk', or '' for none), got {compiled_dims!r}"
        )
    for name, value in (
        ("disable_ue8m0_cast", disable_ue8m0_cast),
        ("use_psum_layout", use_psum_layout),
        ("ensure_zero_padding", ensure_zero_padding),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"{fn}: {name} must be a bool, got {value!r}")
    hint = expected_m_for_psum_layout
    if hint is not None and (isinstance(hint, bool) or not isinstance(hint, int) or hint < 0):
        raise ValueError(f"{fn}: expected_m_for_psum_layout must be None or an int >= 0, got {hint!r}")
