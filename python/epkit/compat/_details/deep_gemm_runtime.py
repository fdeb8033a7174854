"""DeepGEMM's runtime settings for ``epkit.compat.deep_gemm`` (its ``csrc/apis/runtime.hpp`` and the alignment
setters of ``layout.hpp``): one record, :data:`SETTINGS`, and DeepGEMM's setters and getters over it.

In DeepGEMM these steer its JIT kernels (SM count, tensor-core utilisation, programmatic dependent launch, which
dims a kernel is compiled for, block sizes). epkit's GEMMs have none of those knobs: every setting here is
recorded and read back, and changes no result and no launch, except the M alignment of the contiguous layout,
which the GEMMs read (:func:`set_mk_alignment_for_contiguous_layout`). The settings DeepGEMM gives no getter for
(``ignore_compile_dims``, ``block_size_multiple_of``) are readable in :data:`SETTINGS`.
"""

from __future__ import annotations

import dataclasses
from typing import TypeGuard

import torch

from epkit.compat._details.deep_gemm_scales import DEFAULT_ALIGNMENT

__all__ = [
    "Settings",
    "SETTINGS",
    "reset_settings",
    "set_num_sms",
    "get_num_sms",
    "set_tc_util",
    "get_tc_util",
    "set_pdl",
    "get_pdl",
    "set_ignore_compile_dims",
    "set_block_size_multiple_of",
    "set_mk_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout",
    "get_theoretical_mk_alignment_for_contiguous_layout",
    "get_m_alignment_for_contiguous_layout",
    "get_k_alignment_for_contiguous_layout",
]


@dataclasses.dataclass
class Settings:
    """What the setters recorded; the defaults are DeepGEMM's."""

    num_sms: int | None = None  # None: the device's
    tc_util: int = 0  # 0: unset (get_tc_util reads 100)
    pdl: bool = False
    ignore_compile_dims: bool = False
    block_size_multiple_of: tuple[int, int] = (1, 1)  # (block M, block N)
    alignment: int = DEFAULT_ALIGNMENT  # the M alignment of the contiguous layouts


#: The process's settings (DeepGEMM's are process-wide too).
SETTINGS = Settings()


def reset_settings() -> None:
    """Every setting back to DeepGEMM's default."""
    for field in dataclasses.fields(Settings):
        setattr(SETTINGS, field.name, getattr(Settings(), field.name))


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _device_sms() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return torch.get_num_threads()  # CPU tensors: the threads torch computes with


def set_num_sms(new_num_sms: int) -> None:
    """Set the SM count :func:`get_num_sms` returns, in ``[0, the device's SMs]`` (on a machine without a GPU: the
    CPU threads torch uses); 0 resets it to the device's, as in DeepGEMM. Recorded only: epkit's kernels launch on
    every SM of the device."""
    top = _device_sms()
    if not _is_int(new_num_sms) or not 0 <= new_num_sms <= top:
        raise ValueError(
            f"set_num_sms: new_num_sms must be an int in [0, {top}] (this device; 0 resets), got {new_num_sms!r}"
        )
    SETTINGS.num_sms = new_num_sms or None


def get_num_sms() -> int:
    """The SM count set by :func:`set_num_sms`, else the device's (DeepGEMM's default)."""
    return SETTINGS.num_sms or _device_sms()


def set_tc_util(new_tc_util: int) -> None:
    """Set the tensor-core utilisation (percent, ``[0, 100]``; 0 unsets it) DeepGEMM's kernel heuristics aim at.
    Recorded only: epkit's GEMMs choose their launch configs without it."""
    if not _is_int(new_tc_util) or not 0 <= new_tc_util <= 100:
        raise ValueError(f"set_tc_util: new_tc_util must be an int in [0, 100] (percent), got {new_tc_util!r}")
    SETTINGS.tc_util = new_tc_util


def get_tc_util() -> int:
    """The tensor-core utilisation set by :func:`set_tc_util`, 100 while unset (DeepGEMM's reading)."""
    return SETTINGS.tc_util or 100


def set_pdl(new_enable_pdl: bool) -> None:
    """Enable or disable programmatic dependent launch (a kernel starting while the previous one finishes) for
    DeepGEMM's kernels. Recorded only: epkit's kernels launch without it either way."""
    if not isinstance(new_enable_pdl, bool):
        raise ValueError(f"set_pdl: new_enable_pdl must be a bool, got {new_enable_pdl!r}")
    SETTINGS.pdl = new_enable_pdl


def get_pdl() -> bool:
    """Whether :func:`set_pdl` enabled programmatic dependent launch (False unless set)."""
    return SETTINGS.pdl


def set_ignore_compile_dims(new_value: bool) -> None:
    """Make DeepGEMM's JIT ignore every call's ``compiled_dims`` (compile no dim in). Recorded only (in
    ``SETTINGS.ignore_compile_dims``; DeepGEMM has no getter): ``compiled_dims`` changes nothing in epkit anyway."""
    if not isinstance(new_value, bool):
        raise ValueError(f"set_ignore_compile_dims: new_value must be a bool, got {new_value!r}")
    SETTINGS.ignore_compile_dims = new_value


def set_block_size_multiple_of(new_value: int | tuple[int, int]) -> None:
    """Make DeepGEMM's heuristics pick block sizes in M and N that are multiples of ``new_value`` (one int for both,
    or ``(m, n)``). Recorded only (in ``SETTINGS.block_size_multiple_of`` as ``(m, n)``; DeepGEMM has no getter):
    epkit's GEMMs choose their blocks from their own configs."""
    pair: tuple[object, ...] = new_value if isinstance(new_value, tuple) else (new_value, new_value)
    m, n = pair if len(pair) == 2 else (0, 0)
    if not (_is_int(m) and _is_int(n) and m > 0 and n > 0):
        raise ValueError(
            f"set_block_size_multiple_of: new_value must be a positive int or a (m, n) tuple of them, got {new_value!r}"
        )
    SETTINGS.block_size_multiple_of = (m, n)


def set_mk_alignment_for_contiguous_layout(new_value: int) -> None:
    """Row alignment of each group in the contiguous layouts: a positive multiple of 128 (default 128). epkit's
    GEMMs read it (a psum layout's groups start at multiples of it)."""
    if not _is_int(new_value) or new_value <= 0 or new_value % DEFAULT_ALIGNMENT:
        raise ValueError(
            f"set_mk_alignment_for_contiguous_layout: new_value must be a positive multiple of {DEFAULT_ALIGNMENT} "
            f"(epkit's GEMMs read each {DEFAULT_ALIGNMENT}-row block's group from its first row), got {new_value!r}"
        )
    SETTINGS.alignment = new_value


def get_mk_alignment_for_contiguous_layout() -> int:
    """The row alignment of each group in the contiguous layouts (128 unless set)."""
    return SETTINGS.alignment


def get_theoretical_mk_alignment_for_contiguous_layout(expected_m: int | None = None) -> int:
    """The alignment epkit's contiguous GEMMs need, whatever ``expected_m`` (a hint):
    :func:`get_mk_alignment_for_contiguous_layout`."""
    if expected_m is not None and (not _is_int(expected_m) or expected_m < 0):
        raise ValueError(f"expected_m must be None or an int >= 0, got {expected_m!r}")
    return SETTINGS.alignment


get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout
get_k_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout
