"""DeepGEMM's cuBLASLt GEMMs for ``epkit.compat.deep_gemm``: ``cublaslt_gemm_{nt,nn,tn,tt}(a, b, d, c=None)``,
``d = a @ b.T (+ d after d = c)``, the baselines DeepGEMM's tests time its kernels against.

Operands in the layouts of :mod:`epkit.compat._details.deep_gemm_dense` (``a [M, K]`` or ``[K, M]``, ``b [N, K]`` or
``[K, N]``, any strides), bf16, float16, float32 or FP8 e4m3 (unscaled, as cuBLASLt takes them without scales);
``d [M, N]`` bf16 or float32. Computed over torch: FP8 on CUDA by ``torch._scaled_mm`` with unit scales, everything
else as a float32 matmul of the operands (TF32 where torch allows it, as cuBLASLt's fast-TF32 compute); with ``c``,
``c`` (in ``d``'s dtype) is added in float32 and the sum rounded once to ``d``'s dtype.
"""

from __future__ import annotations

import torch

from epkit.compat._details.deep_gemm_dense import check_c, early_return, layout_dims, nt_views

__all__ = ["cublaslt_gemm_nt", "cublaslt_gemm_nn", "cublaslt_gemm_tn", "cublaslt_gemm_tt"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def _cublaslt(
    fn: str, layout: str, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None
) -> torch.Tensor:
    m, n, k = layout_dims(fn, layout, a, b, d, d_dtypes=(torch.bfloat16, torch.float32))
    if a.dtype not in _DTYPES or b.dtype != a.dtype:
        raise ValueError(f"{fn}: a and b must share one of {[str(t) for t in _DTYPES]}, got {a.dtype} and {b.dtype}")
    check_c(fn, c, d)
    if early_return(m, n, k, d, c):
        return d
    a_nt, b_nt = nt_views(layout, a, b)
    if a.dtype == torch.float8_e4m3fn and a.is_cuda:
        one = torch.ones((), dtype=torch.float32, device=a.device)
        out = torch._scaled_mm(a_nt.contiguous(), b_nt.contiguous().T, one, one, out_dtype=torch.float32)
    else:
        out = a_nt.float() @ b_nt.float().T
    d.copy_(out if c is None else out + c.float())
    return d


def cublaslt_gemm_nt(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """``d = a @ b.T (+ c)``, ``a [M, K]``, ``b [N, K]`` (see :mod:`epkit.compat._details.deep_gemm_cublaslt`)."""
    return _cublaslt("cublaslt_gemm_nt", "nt", a, b, d, c)


def cublaslt_gemm_nn(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`cublaslt_gemm_nt` with ``b`` given as ``[K, N]``."""
    return _cublaslt("cublaslt_gemm_nn", "nn", a, b, d, c)


def cublaslt_gemm_tn(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`cublaslt_gemm_nt` with ``a`` given as ``[K, M]`` and ``b`` as ``[K, N]``."""
    return _cublaslt("cublaslt_gemm_tn", "tn", a, b, d, c)


def cublaslt_gemm_tt(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`cublaslt_gemm_nt` with ``a`` given as ``[K, M]``."""
    return _cublaslt("cublaslt_gemm_tt", "tt", a, b, d, c)
