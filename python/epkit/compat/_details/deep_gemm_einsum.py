"""DeepGEMM's einsums for ``epkit.compat.deep_gemm``: the fixed expressions its ``einsum`` (bf16) and ``fp8_einsum``
take, each a batched GEMM.

``einsum(expr, a, b, d, c=None, use_cublaslt=False)``, bf16 ``a`` and ``b``:

- ``"bmk,bnk->mn"``: ``d [M, N] = (c +) sum over b of a[b] @ b[b].T`` in float32 (``d`` float32 with ``c`` being
  ``d``, DeepGEMM's accumulating form, or bf16 without ``c``); computed as float32 matmuls over chunks of the batch;
- ``"bhr,hdr->bhd"`` and ``"bhd,hdr->bhr"``: ``d`` bf16 ``[B, H, D]`` / ``[B, H, R]``, no ``c``; computed by
  ``torch.einsum`` on the bf16 operands (any strides), so the result has torch's bits (DeepGEMM's tests compare it
  with ``torch.einsum`` to 1e-10). ``use_cublaslt`` picks DeepGEMM's cuBLASLt kernel there; the result is the same.

``fp8_einsum(expr, a, b, d, c=None, recipe=(1, 128, 128))``, FP8 ``(values, float32 scales)`` pairs:

- ``"bhr,hdr->bhd"``: ``a`` ``(e4m3 [B, H, R], [B, H, ceil(R/128)])``, ``b`` ``(e4m3 [H, D, R], [H, ceil(D/128),
  ceil(R/128)])``: per head, epkit's masked grouped FP8 GEMM (Triton on CUDA), R zero-padded to a multiple of 128
  when it is not one;
- ``"bhd,hdr->bhr"`` (an SM100 form in DeepGEMM): ``a`` ``(e4m3 [B, H, D], [B, H, ceil(D/128)])``, ``b`` ``(e4m3
  [H, D, R], [H, ceil(D/128), ceil(R/128)])``: likewise, ``b`` made K-major (a copy);
- ``"bhd,bhr->hdr"`` with ``recipe=(1, 1, 128)`` (an SM100 form in DeepGEMM, the weight gradient): ``a`` ``(e4m3
  [B, H, D], [ceil(B/128), H, D])``, ``b`` ``(e4m3 [B, H, R], [ceil(B/128), H, R])``, ``d [H, D, R]`` float32
  ``= c + sum over b``: a torch fallback (dequantized to float32, one batched matmul).

``d`` is bf16 or float32; with ``c`` (like ``d``; it may be ``d``) the sum is rounded once to ``d``'s dtype.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from epkit import grouped_gemm as gemm
from epkit.compat._details.deep_gemm_operands import Pair, Recipe, called_as
from epkit.compat._details.deep_gemm_scales import dequantize
from epkit.quant import FP8_BLOCK

__all__ = ["einsum", "fp8_einsum"]

_CHUNK_ELEMENTS = 1 << 24  # float32 elements of one operand chunk in "bmk,bnk->mn" (64 MiB)


def _tensor(fn: str, name: str, x: object, dims: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != dims or x.dtype not in dtypes:
        got = (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{fn}: {name} must be a {dims}-D {' or '.join(str(t) for t in dtypes)} tensor, got {got}")
    return x


def _check_c(fn: str, c: object, d: torch.Tensor) -> torch.Tensor | None:
    if c is not None and (not isinstance(c, torch.Tensor) or c.shape != d.shape or c.dtype != d.dtype):
        raise ValueError(f"{fn}: c must be None or a tensor like d ({d.dtype} {tuple(d.shape)}), got {c!r:.80}")
    return c


def _shape_check(fn: str, expr: str, want: Mapping[str, tuple[int, ...]], got: Mapping[str, torch.Tensor]) -> None:
    for name, shape in want.items():
        if tuple(got[name].shape) != shape:
            raise ValueError(
                f"{fn}({expr!r}): {name} must have shape {shape} for "
                + ", ".join(f"{k} {tuple(v.shape)}" for k, v in got.items() if k != name)
                + f", got {tuple(got[name].shape)}"
            )


def einsum(
    expr: str, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None,
    use_cublaslt: bool = False,
) -> torch.Tensor:  # fmt: skip
    """DeepGEMM's bf16 einsum (``"bmk,bnk->mn"``, ``"bhr,hdr->bhd"``, ``"bhd,hdr->bhr"``), written to ``d``; see
    :mod:`epkit.compat._details.deep_gemm_einsum` for shapes and paths."""
    fn = "einsum"
    if expr not in ("bmk,bnk->mn", "bhr,hdr->bhd", "bhd,hdr->bhr"):
        raise ValueError(
            f"{fn}: expression {expr!r} is not supported (DeepGEMM's: 'bmk,bnk->mn', 'bhr,hdr->bhd', 'bhd,hdr->bhr')"
        )
    a = _tensor(fn, "a", a, 3, (torch.bfloat16,))
    b = _tensor(fn, "b", b, 3, (torch.bfloat16,))
    c = _check_c(fn, c, _tensor(fn, "d", d, 2 if expr == "bmk,bnk->mn" else 3, (torch.bfloat16, torch.float32)))
    if not isinstance(use_cublaslt, bool):
        raise ValueError(f"{fn}: use_cublaslt must be a bool, got {use_cublaslt!r}")
    if expr == "bmk,bnk->mn":
        if use_cublaslt:
            raise ValueError(f"{fn}({expr!r}): use_cublaslt is not supported for this expression (as in DeepGEMM)")
        s, m, k = a.shape
        n = b.shape[1]
        _shape_check(fn, expr, {"b": (s, n, k), "d": (m, n)}, {"a": a, "b": b, "d": d})
        acc = torch.zeros((m, n), dtype=torch.float32, device=d.device) if c is None else c.float()
        step = max(1, _CHUNK_ELEMENTS // max(1, max(m, n) * k))
        for s0 in range(0, s, step):
            aa = a[s0 : s0 + step].permute(1, 0, 2).reshape(m, -1).float()
            bb = b[s0 : s0 + step].permute(1, 0, 2).reshape(n, -1).float()
            acc = torch.addmm(acc, aa, bb.T)
        d.copy_(acc)
        return d
    # "bhr,hdr->bhd" / "bhd,hdr->bhr"
    if c is not None:
        raise ValueError(f"{fn}({expr!r}): c is not supported for this expression (as in DeepGEMM)")
    bsz, h, x = a.shape
    if expr == "bhr,hdr->bhd":
        out_last = b.shape[1]
        _shape_check(fn, expr, {"b": (h, out_last, x), "d": (bsz, h, out_last)}, {"a": a, "b": b, "d": d})
    else:
        out_last = b.shape[2]
        _shape_check(fn, expr, {"b": (h, x, out_last), "d": (bsz, h, out_last)}, {"a": a, "b": b, "d": d})
    d.copy_(torch.einsum(expr, a, b))
    return d


def _pair(fn: str, name: str, x: object) -> Pair:
    if not (isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x)):
        raise ValueError(f"{fn}: {name} must be a (tensor, scales) pair, got {type(x).__name__}")
    if x[0].dtype != torch.float8_e4m3fn or x[1].dtype != torch.float32 or x[0].dim() != 3 or x[1].dim() != 3:
        raise ValueError(
            f"{fn}: {name} must be (3-D float8_e4m3fn values, 3-D float32 scales), got "
            f"({x[0].dtype} {tuple(x[0].shape)}, {x[1].dtype} {tuple(x[1].shape)})"
        )
    return x[0], x[1]


def _pad_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x [G, R, K]`` (any strides) as a contiguous ``[G, R, k]`` with zeros past K."""
    if x.shape[-1] == k:
        return x.contiguous()
    out = x.new_zeros((*x.shape[:-1], k))
    out[..., : x.shape[-1]] = x
    return out


def _bmm(
    fn: str, a: Pair, b: Pair, gran_b: int, d: torch.Tensor, c: torch.Tensor | None
) -> None:  # a [G, M, K], b [G, N, K] (nt views), d / c [G, M, N] views
    (a0, sfa), (b0, sfb) = a, b
    g, m, k = a0.shape
    if gran_b == FP8_BLOCK:
        kp = -(-k // FP8_BLOCK) * FP8_BLOCK
        out = torch.empty((g, m, b0.shape[1]), dtype=torch.float32, device=d.device)
        counts = torch.full((g,), m, dtype=torch.int32, device=a0.device)
        with called_as(fn):
            # epkit.grouped_gemm's wrappers are unannotated (that module is not held to strict typing yet)
            gemm.m_grouped_fp8_gemm_nt_masked(  # type: ignore[no-untyped-call]
                (_pad_k(a0, kp), sfa.contiguous()), (_pad_k(b0, kp), sfb.contiguous()), out, counts, max(m, 1)
            )
    else:
        out = torch.bmm(dequantize(a0, sfa, 1, FP8_BLOCK), dequantize(b0, sfb, 1, FP8_BLOCK).transpose(1, 2))
    d.copy_(out if c is None else out + c.float())


def fp8_einsum(
    expr: str, a: Pair, b: Pair, d: torch.Tensor, c: torch.Tensor | None = None, recipe: Recipe = (1, 128, 128)
) -> torch.Tensor:
    """DeepGEMM's FP8 einsum (``"bhr,hdr->bhd"``, ``"bhd,hdr->bhr"``, ``"bhd,bhr->hdr"``), written to ``d``; see
    :mod:`epkit.compat._details.deep_gemm_einsum` for shapes, recipes and paths."""
    fn = "fp8_einsum"
    (x, sfx), (y, sfy) = _pair(fn, "a", a), _pair(fn, "b", b)
    c = _check_c(fn, c, _tensor(fn, "d", d, 3, (torch.bfloat16, torch.float32)))
    want = {"bhd,bhr->hdr": (1, 1, 128)}.get(expr, (1, 128, 128))
    if tuple(recipe) != want:
        raise ValueError(f"{fn}({expr!r}): recipe must be {want} for this expression, got {recipe!r}")

    def ceil(v: int) -> int:
        return -(-v // FP8_BLOCK)

    if expr in ("bhr,hdr->bhd", "bhd,hdr->bhr"):
        bsz, h, k = x.shape
        n = y.shape[1] if expr == "bhr,hdr->bhd" else y.shape[2]
        y_shape = (h, n, k) if expr == "bhr,hdr->bhd" else (h, k, n)
        sfy_shape = (h, ceil(n), ceil(k)) if expr == "bhr,hdr->bhd" else (h, ceil(k), ceil(n))
        shapes = {"b": y_shape, "b's scales": sfy_shape, "a's scales": (bsz, h, ceil(k)), "d": (bsz, h, n)}
        _shape_check(fn, expr, shapes, {"a": x, "a's scales": sfx, "b": y, "b's scales": sfy, "d": d})
        if expr == "bhd,hdr->bhr":
            y, sfy = y.transpose(1, 2), sfy.transpose(1, 2)
        perm_c = None if c is None else c.permute(1, 0, 2)
        _bmm(fn, (x.permute(1, 0, 2), sfx.permute(1, 0, 2)), (y, sfy), FP8_BLOCK, d.permute(1, 0, 2), perm_c)
        return d
    if expr == "bhd,bhr->hdr":
        bsz, h, m = x.shape
        n = y.shape[2]
        shapes = {"b": (bsz, h, n), "a's scales": (ceil(bsz), h, m), "b's scales": (ceil(bsz), h, n), "d": (h, m, n)}
        _shape_check(fn, expr, shapes, {"a": x, "a's scales": sfx, "b": y, "b's scales": sfy, "d": d})
        aa = (x.permute(1, 2, 0), sfx.permute(1, 2, 0))
        bb = (y.permute(1, 2, 0), sfy.permute(1, 2, 0))
        _bmm(fn, aa, bb, 1, d, c)
        return d
    raise ValueError(
        f"{fn}: expression {expr!r} is not supported (DeepGEMM's: 'bhr,hdr->bhd', 'bhd,hdr->bhr', 'bhd,bhr->hdr')"
    )
