"""Tile configs of the Triton grouped GEMM (kernels/triton/grouped_gemm.py): heuristic, override hook, tuned tables.

A config is a dict of ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps`` and ``num_stages``; one with
``"kernel": "persistent"`` (and ``GROUP_M``, the M tiles per sweep of its L2-aware order; optionally
``CTAS_PER_SM``, programs per SM, default 1, and for FP8 x MXFP4 ``FP4_DECODE``) runs the persistent TMA kernel
(``grouped_gemm_persistent.py``), any other the tile-grid kernel (``grouped_gemm.py``).
:func:`get_config` picks one per call from the weight kind (``"fp8"``, ``"fp8_fp4"``, ``"bf16"``),
N, K, the expected rows per group and the device type: an installed override
(:func:`set_config_override`, or a table of ``bench/tune_grouped_gemm.py`` installed by
:func:`load_tuned_configs`) first, else the heuristic: the persistent kernel, with a tile per shape class
(:func:`m_bucket`). This module imports neither torch nor triton.
"""

from __future__ import annotations

import json

__all__ = [
    "SM90_MAX_SHARED",
    "GROUP_ALIGN",
    "set_config_override",
    "get_config",
    "persistent_config",
    "m_bucket",
    "load_tuned_configs",
    "check_config",
]

#: The fields of a config dict (the persistent kernel's add ``GROUP_M`` and ``"kernel": "persistent"``).
_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
#: Shared memory an sm_90 block may use (227 KiB, with the opt-in the launcher makes).
SM90_MAX_SHARED = 232448
#: Rows a group of the contiguous and psum layouts starts on a multiple of (DeepGEMM's, and the op's
#: ``get_mk_alignment_for_contiguous_layout``): the persistent kernel's BLOCK_M divides it.
GROUP_ALIGN = 128

_CONFIG_OVERRIDE = None


def set_config_override(fn) -> None:
    """Install ``fn(kind, n, k, m_hint, device_type) -> dict | None`` to replace the heuristic (None restores it).

    The dict holds ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K`` (128 for scaled kinds), ``num_warps`` and
    ``num_stages`` (see :func:`check_config` for what each kernel accepts), and for the persistent kernel
    ``"kernel": "persistent"`` and ``GROUP_M``; returning None falls back to the heuristic.
    """
    global _CONFIG_OVERRIDE
    _CONFIG_OVERRIDE = fn


def get_config(kind: str, n: int, k: int, m_hint: int, device_type: str) -> dict:
    """Kernel config for one call: the override's, else the persistent kernel's by shape class and kind."""
    if _CONFIG_OVERRIDE is not None:
        cfg = _CONFIG_OVERRIDE(kind, n, k, m_hint, device_type)
        if cfg is not None:
            return dict(cfg)
    return persistent_config(kind, m_hint, device_type)


def persistent_config(kind: str, m_hint: int, device_type: str) -> dict:
    """The persistent kernel's heuristic config (shared memory per stage: ``(BLOCK_M + BLOCK_N) * BLOCK_K``
    bytes for FP8, twice that for bf16; the FP8 x MXFP4 kernel keeps ``BLOCK_N = 64`` on 8 warps, where its
    in-register dequantisation fits the register file)."""
    block_k = 64 if kind == "bf16" else 128
    cfg = dict(kernel="persistent", BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8, num_warps=8, num_stages=4)
    if device_type != "cuda":  # interpreter: few Python-level programs, one stage
        return dict(cfg, BLOCK_M=64, BLOCK_N=64, GROUP_M=2, num_warps=4, num_stages=1)
    if kind == "fp8_fp4":
        return dict(cfg, BLOCK_N=64)
    if m_bucket(m_hint) == "decode":  # decode-sized groups: half-height tiles, one warpgroup, deeper pipeline
        return dict(cfg, BLOCK_M=64, num_warps=4, num_stages=6)
    return dict(cfg, num_stages=5 if kind == "fp8" else 4)


def m_bucket(m_hint: int) -> str:
    """Rows-per-group bucket that configs are chosen by: ``"decode"`` (<= 64) or ``"prefill"``."""
    return "decode" if m_hint <= 64 else "prefill"


def load_tuned_configs(path: str, device_type: str = "cuda") -> int:
    """Install the table written by ``bench/tune_grouped_gemm.py`` as the config override.

    Entries are keyed by (kind, N, K, :func:`m_bucket`); calls with other keys, or on another
    device type than ``device_type``, keep the heuristic. Returns the number of entries loaded.

    Raises
    ------
    ValueError
        The file is not such a table, or an entry's config is invalid for its kind.
    """
    with open(path) as f:
        table = json.load(f)
    entries = table.get("best") if isinstance(table, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: not a tuning table (expected a 'best' list, see bench/tune_grouped_gemm.py)")
    lookup = {}
    for e in entries:
        try:
            key = (e["kind"], int(e["n"]), int(e["k"]), e["bucket"])
            cfg = {name: int(e["config"][name]) for name in _CONFIG_KEYS}
            if e["config"].get("kernel") == "persistent":
                cfg.update(kernel="persistent", GROUP_M=int(e["config"]["GROUP_M"]))
                if "FP4_DECODE" in e["config"]:
                    cfg["FP4_DECODE"] = str(e["config"]["FP4_DECODE"])
                if "CTAS_PER_SM" in e["config"]:
                    cfg["CTAS_PER_SM"] = int(e["config"]["CTAS_PER_SM"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: malformed entry {e!r} ({exc})") from None
        check_config(cfg, key[0])
        lookup[key] = cfg

    def override(kind, n, k, m_hint, dev):
        return lookup.get((kind, n, k, m_bucket(m_hint))) if dev == device_type else None

    set_config_override(override)
    return len(lookup)


def check_config(cfg: dict, kind: str) -> None:
    """Raise ValueError unless the kernel can run ``cfg`` for ``kind``.

    Scaled kinds apply one scale per 128 x 128 weight block inside a K step, so they need
    ``BLOCK_K == 128`` and ``BLOCK_N`` dividing 128 (the persistent kernel also takes ``BLOCK_N = 256``,
    two weight blocks, for FP8). The persistent kernel finds a tile's group from its first row, so its
    ``BLOCK_M`` divides the 128-row group alignment; its ``GROUP_M`` is >= 1.
    """
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    persistent = cfg.get("kernel") == "persistent"
    wide = persistent and kind == "fp8" and bn == 256
    if kind != "bf16" and (bk != 128 or (128 % bn and not wide)):
        raise ValueError(f"scaled kinds need BLOCK_K == 128 and BLOCK_N dividing 128, got {cfg}")
    if persistent and (GROUP_ALIGN % cfg["BLOCK_M"] or cfg.get("GROUP_M", 0) < 1 or cfg.get("CTAS_PER_SM", 1) < 1):
        raise ValueError(
            f"the persistent kernel needs BLOCK_M dividing {GROUP_ALIGN}, GROUP_M >= 1 and CTAS_PER_SM >= 1, got {cfg}"
        )
