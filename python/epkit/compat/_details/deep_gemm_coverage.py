"""Which of DeepGEMM's public names ``epkit.compat.deep_gemm`` lacks, and the ``AttributeError`` a caller gets for
one: what the name is, whether epkit means to provide it, and what to install meanwhile.

The names are those ``import deep_gemm`` binds in DeepGEMM 2.6.1 (its ``deep_gemm/__init__.py``: the kernels,
runtime settings, the mega-MoE entry points and the submodules). Two tables, kept apart so that a caller can tell
a gap from a boundary:

- :data:`NOT_YET_PROVIDED`: GEMMs and helpers in epkit's scope (MoE GEMMs and what engines call around them) that
  epkit has not written yet (empty today: every in-scope name is provided; the table stays for DeepGEMM's next
  names);
- :data:`OUT_OF_SCOPE`: DeepGEMM's attention-indexer, hyper-connection and legacy kernels, which epkit does not mean
  to provide.

A name in neither table and not provided is not part of DeepGEMM's interface as epkit knows it; its
``AttributeError`` says so. ``epkit info`` lists the provided names and both tables (:func:`coverage`).
"""

from __future__ import annotations

import dis
import sys

__all__ = ["NOT_YET_PROVIDED", "OUT_OF_SCOPE", "PATHS", "INSTALL", "missing_name_error", "missing_name", "coverage"]

#: What to use for a kernel epkit does not provide.
INSTALL = "DeepGEMM itself (github.com/deepseek-ai/DeepGEMM, `import deep_gemm`) on an sm_90 or sm_100 GPU"

#: DeepGEMM's names in epkit's scope that epkit does not provide yet: name -> what it is in DeepGEMM.
NOT_YET_PROVIDED: dict[str, str] = {}

_KERNELS = "epkit's grouped GEMM kernels (Triton on CUDA, epkit's CPU path on CPU)"
_TORCH = "torch fallback on every device (float32 matmuls of dequantized operands)"
#: How each provided GEMM computes, by what the caller passes (the modules' docstrings say more).
PATHS: dict[str, str] = {
    "m_grouped_*, fp8_fp4_gemm_*/fp8_gemm_*, bf16_gemm_* (FP8 with 128x128 weight scales, FP8xFP4, BF16)": _KERNELS
    + "; FP8 K not a multiple of 128 zero-padded to one first (a copy)",
    "fp8_fp4_gemm_*/fp8_gemm_* with recipe=(1, 1, 128)": _TORCH,
    "k_grouped_fp8_gemm_nt_contiguous, k_grouped_fp8_gemm_tn_contiguous, k_grouped_bf16_gemm_tn_contiguous": _TORCH,
    "cublaslt_gemm_*": "torch: torch._scaled_mm with unit scales (FP8 on CUDA), else a float32 matmul",
    "einsum": "torch: float32 matmuls ('bmk,bnk->mn'), torch.einsum on the bf16 operands (the bhr/bhd forms)",
    "fp8_einsum": _KERNELS + " per head ('bhr,hdr->bhd', 'bhd,hdr->bhr'); " + _TORCH + " ('bhd,bhr->hdr')",
    "m_grouped_fp8_fp4_gemm_nt_contiguous with recipe=(1, 1, 32) (1x32 activation scales)": _TORCH,
    "fp8_fp4_mega_moe, bf16_mega_moe": "EPBuffer's expanded dispatch and unsummed combine (shm on CPU ranks, nvshmem "
    "on CUDA ranks, untested there), the m-grouped GEMMs above (FP8xFP4: the torch fallback), a torch SwiGLU",
}

_ATTENTION = "attention-indexer kernel"
#: DeepGEMM's names outside epkit's scope (not MoE GEMMs): name -> what it is in DeepGEMM.
OUT_OF_SCOPE: dict[str, str] = {
    "fp8_mqa_logits": f"{_ATTENTION} (FP8 MQA logits)",
    "fp8_paged_mqa_logits": f"{_ATTENTION} (FP8 MQA logits over a paged KV cache)",
    "fp8_fp4_mqa_logits": f"{_ATTENTION} (FP8/FP4 MQA logits)",
    "fp8_fp4_paged_mqa_logits": f"{_ATTENTION} (FP8/FP4 MQA logits over a paged KV cache)",
    "get_paged_mqa_logits_metadata": f"{_ATTENTION} scheduling metadata (paged MQA logits)",
    "fp8_gemm_nt_skip_head_mid": f"{_ATTENTION} (FP8 GEMM skipping the middle heads)",
    "tf32_hc_prenorm_gemm": "hyper-connection kernel (TF32 GEMM with the pre-norm)",
    "legacy": "Triton kernels for A100 (deep_gemm.legacy)",
}


def missing_name_error(module: str, name: str) -> AttributeError:
    """The ``AttributeError`` for ``module.name`` (a ``deep_gemm`` module of epkit's): what the name is in DeepGEMM and
    what to install for it, or that DeepGEMM has no such name as far as epkit knows. Dunder names get Python's own
    message (tools probe them)."""
    head = f"module {module!r} has no attribute {name!r}"
    if name.startswith("__") and name.endswith("__"):
        return AttributeError(head, name=name)
    if name in OUT_OF_SCOPE:
        why = (
            f"epkit does not provide {name}, DeepGEMM's {OUT_OF_SCOPE[name]}: it is outside epkit's scope (MoE "
            f"GEMMs). Install {INSTALL} for it"
        )
    elif name in NOT_YET_PROVIDED:
        why = (
            f"{name}, DeepGEMM's {NOT_YET_PROVIDED[name]}, is not yet provided by epkit. Until it is, install {INSTALL}"
        )
    else:
        why = "it is not part of DeepGEMM's interface as epkit knows it (`epkit info` lists what is provided)"
    return AttributeError(f"{head}: {why}", name=name)


def _from_import(depth: int) -> bool:
    """Whether the frame ``depth`` levels up is executing ``from module import name`` (CPython's IMPORT_FROM)."""
    frame = sys._getframe(depth + 1)
    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] == dis.opmap["IMPORT_FROM"]


def missing_name(module: str, name: str) -> AttributeError | ImportError:
    """What a ``deep_gemm`` module's ``__getattr__`` raises for a name it lacks: :func:`missing_name_error`, or, when
    the caller is a ``from module import name`` statement, an ``ImportError`` with that message (Python would
    otherwise replace it with its plain "cannot import name"; ``getattr`` and ``hasattr`` still see an
    ``AttributeError``)."""
    err = missing_name_error(module, name)
    if _from_import(2) and not (name.startswith("__") and name.endswith("__")):
        return ImportError(f"cannot import name {name!r} from {module!r}: {str(err).split(': ', 1)[1]}", name=module)
    return err


def coverage() -> dict[str, object]:
    """What ``epkit info`` reports of ``epkit.compat.deep_gemm``: the names it provides (its ``__all__``), how they
    compute (:data:`PATHS`) and the two tables of those it does not."""
    import epkit.compat.deep_gemm as deep_gemm  # here: that module imports this one

    return {
        "provided": sorted(deep_gemm.__all__),
        "not_yet_provided": dict(sorted(NOT_YET_PROVIDED.items())),
        "out_of_scope": dict(sorted(OUT_OF_SCOPE.items())),
        "paths": dict(PATHS),
        "install_for_the_rest": INSTALL,
    }
