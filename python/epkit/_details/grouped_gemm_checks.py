"""Checks of the grouped GEMMs' arguments (:mod:`epkit.grouped_gemm`): the static ones (types, dtypes, shapes,
devices), which the public functions run, and those reading the layout tensors' values (index ranges, the
128-row alignment, psum ends, counts), which the ops run outside CUDA stream capture.

Every message names the argument of the DeepGEMM-style signature (``a``, ``b``, ``d``, ``m_indices``,
``masked_m``, ``expected_m``) and what it must be.
"""

from __future__ import annotations

import torch

from epkit.quant import FP8_BLOCK, MXFP4_BLOCK

__all__ = [
    "ALIGN",
    "validate_operands",
    "check_layout_tensor",
    "layout_row_ids",
    "psum_to_m_indices",
    "check_masked_m",
    "check_masked_m_values",
]

#: Row alignment of each group in the contiguous layout (DeepGEMM's, and what the GPU kernels read).
ALIGN = 128


def _shape(t) -> tuple:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _want(name: str, t, dtypes: tuple, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype} of shape {_shape(t)}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {_shape(t)}")


def _unpack(x, name: str, scaled: bool):
    if scaled:
        if not (isinstance(x, (tuple, list)) and len(x) == 2):
            raise ValueError(f"{name} must be a (tensor, scales) pair, got {type(x).__name__}")
        return x[0], x[1]
    if isinstance(x, (tuple, list)):
        raise ValueError(f"{name} must be a single bf16 tensor for the bf16 GEMM, got a {type(x).__name__}")
    return x, None


def validate_operands(kind: str, a, b, d, masked: bool, dense: bool = False, b_kn: bool = False):
    """Check dtypes/shapes of (a, sfa), (b, sfb), d; returns (a, sfa, b, sfb, G, M, N, K).

    So that a caller's errors quote the shapes it passed: ``dense`` (with ``masked=False``) takes the operands of
    one group without the group dim, a dense GEMM's (``b [N, K]`` and its scales; G is 1), and ``b_kn`` takes an
    FP8 or bf16 ``b`` as ``[..., K, N]`` (scales ``[..., K/128, N/128]``: DeepGEMM's nn layout).
    """
    scaled = kind != "bf16"
    a, sfa = _unpack(a, "a", scaled)
    b, sfb = _unpack(b, "b", scaled)
    a_dt = (torch.bfloat16,) if kind == "bf16" else (torch.float8_e4m3fn,)
    if not isinstance(a, torch.Tensor) or a.dim() != (3 if masked else 2):
        raise ValueError(f"a must be a {'[G, M_max, K]' if masked else '[M, K]'} tensor, got shape {_shape(a)}")
    if not isinstance(b, torch.Tensor) or b.dim() != (2 if dense else 3):
        dims = "K, N" if b_kn else f"N, K{'/2' if kind == 'fp8_fp4' else ''}"
        raise ValueError(f"b must be a [{'' if dense else 'G, '}{dims}] tensor, got shape {_shape(b)}")
    k = a.shape[-1]
    g, n = (1 if dense else b.shape[0]), b.shape[-1 if b_kn else -2]
    lead = () if dense else (g,)

    def mn_k(mn: int, kk: int) -> tuple:  # b's (or its scales') shape with these N and K extents
        return (*lead, kk, mn) if b_kn else (*lead, mn, kk)

    if masked and a.shape[0] != g:
        raise ValueError(f"a has {a.shape[0]} groups but b has {g} (a {_shape(a)}, b {_shape(b)})")
    _want("a", a, a_dt, tuple(a.shape))
    if scaled and k % FP8_BLOCK:
        raise ValueError(f"K = {k} (a {_shape(a)}) must be a multiple of the scale block {FP8_BLOCK}")
    rows = tuple(a.shape[:-1])
    if kind == "fp8":
        _want("b", b, (torch.float8_e4m3fn,), mn_k(n, k))
        _want("sfb", sfb, (torch.float32,), mn_k(-(-n // FP8_BLOCK), k // FP8_BLOCK))
    elif kind == "fp8_fp4":
        _want("b", b, (torch.uint8,), (*lead, n, k // 2))
        _want("sfb", sfb, (torch.uint8,), (*lead, n, k // MXFP4_BLOCK))
    else:
        _want("b", b, (torch.bfloat16,), mn_k(n, k))
    if scaled:
        _want("sfa", sfa, (torch.float32,), (*rows, k // FP8_BLOCK))
    _want("d", d, (torch.bfloat16, torch.float32), (*rows, n))
    if not d.is_contiguous():
        raise ValueError(f"d must be contiguous, got strides {d.stride()}")
    devs = {t.device for t in (a, sfa, b, sfb, d) if t is not None}
    if len(devs) > 1:
        raise ValueError(f"a, b, scales and d must share one device, got {sorted(str(x) for x in devs)}")
    return a, sfa, b, sfb, g, (a.shape[0] if not masked else a.shape[1]), n, k


def psum_to_m_indices(ends: torch.Tensor, m: int) -> torch.Tensor:
    """Per-row ids ``[M]`` int32 (-1 padding) of a psum layout's cumulative ends ``[G]``, which it checks (group
    ``g`` owns rows ``[align(end[g-1], 128), end[g])``); reads ``ends`` on the host."""
    ends64 = ends.long().cpu()
    g = ends64.numel()
    ids = torch.full((m,), -1, dtype=torch.int32)
    prev = 0
    for grp, end in enumerate(ends64.tolist()):  # loop over groups, not rows
        start = -(-prev // ALIGN) * ALIGN
        if end < prev or end > m or (prev < end < start):
            raise ValueError(
                f"m_indices (psum layout) must be non-decreasing cumulative ends <= M = {m}, with each group "
                f"starting at the previous end rounded up to {ALIGN}; group {grp} of {g} has end {end} "
                f"after previous end {prev} (aligned start {start})"
            )
        if end > start:
            ids[start:end] = grp
        prev = end
    return ids.to(ends.device)


def _check_row_ids(m_indices: torch.Tensor, g: int) -> None:
    """Per-row ids in ``[-1, G)``, each group's rows starting a 128-row block (they read the host's copy)."""
    if not m_indices.numel():
        return
    lo, hi = int(m_indices.min()), int(m_indices.max())
    if lo < -1 or hi >= g:
        bad = lo if lo < -1 else hi
        pos = int((m_indices == bad).nonzero()[0])
        raise ValueError(f"m_indices[{pos}] = {bad} is outside [-1, {g}) (b has G = {g} groups)")
    # each row's block's first id (an expand of the strided view: no index op over every row, which costs
    # milliseconds per call on a CPU with 2 threads)
    first = m_indices[::ALIGN].view(-1, 1).expand(-1, ALIGN).reshape(-1)[: m_indices.numel()]
    wrong = ((m_indices >= 0) & (m_indices != first)).nonzero()
    if wrong.numel():
        pos = int(wrong[0])
        blk = pos // ALIGN * ALIGN
        raise ValueError(
            f"m_indices[{pos}] = {int(m_indices[pos])} but the {ALIGN}-row block from row {blk} begins with "
            f"m_indices[{blk}] = {int(first[pos])}: each group's rows must start at a multiple of {ALIGN} "
            f"(get_mk_alignment_for_contiguous_layout()), followed by -1 padding up to the next one, as DeepGEMM "
            "and the GPU kernels read a block's group from its first row (build_m_indices makes such a layout)"
        )


def check_layout_tensor(m_indices, g: int, m: int, device, use_psum_layout: bool) -> None:
    """Static checks of the contiguous layout tensor: int32/int64 of shape ``[M]`` (or ``[G]`` cumulative ends
    with ``use_psum_layout``) on ``a``'s device."""
    want = (g,) if use_psum_layout else (m,)
    if not isinstance(m_indices, torch.Tensor) or m_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"m_indices must be an int32 tensor of shape {want}, got {getattr(m_indices, 'dtype', None)}")
    if tuple(m_indices.shape) != want:
        raise ValueError(
            f"m_indices must have shape {want} ({'[G] cumulative ends' if use_psum_layout else '[M]'}), "
            f"got {tuple(m_indices.shape)}"
        )
    if m_indices.device != device:
        raise ValueError(f"m_indices is on {m_indices.device} but a is on {device}")


def layout_row_ids(m_indices: torch.Tensor, g: int, m: int, use_psum_layout: bool) -> torch.Tensor:
    """The value checks of the layout (reading it on the host); returns the per-row ids (``m_indices`` itself, or
    the psum ends expanded)."""
    if use_psum_layout:
        return psum_to_m_indices(m_indices, m)
    _check_row_ids(m_indices, g)
    return m_indices


def check_masked_m(masked_m, g: int, device, expected_m) -> None:
    """Static checks of the masked layout's counts and hint: ``masked_m`` int32/int64 ``[G]`` on ``a``'s device,
    ``expected_m`` an int >= 0."""
    if not isinstance(masked_m, torch.Tensor) or masked_m.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"masked_m must be an int32 tensor of shape ({g},), got {getattr(masked_m, 'dtype', None)}")
    if tuple(masked_m.shape) != (g,):
        raise ValueError(f"masked_m must have shape ({g},) (one count per group), got {tuple(masked_m.shape)}")
    if masked_m.device != device:
        raise ValueError(f"masked_m is on {masked_m.device} but a is on {device}")
    if not isinstance(expected_m, int) or expected_m < 0:
        raise ValueError(f"expected_m must be an int >= 0 (a hint for the kernel config), got {expected_m!r}")


def check_masked_m_values(masked_m: torch.Tensor, m_max: int) -> None:
    """Every count in ``[0, M_max]`` (reads ``masked_m`` on the host; on a GPU the kernel clamps them instead)."""
    if masked_m.numel():
        lo, hi = int(masked_m.min()), int(masked_m.max())
        if lo < 0 or hi > m_max:
            bad = lo if lo < 0 else hi
            pos = int((masked_m == bad).nonzero()[0])
            raise ValueError(f"masked_m[{pos}] = {bad} is outside [0, M_max = {m_max}] (a has shape [G, M_max, K])")
