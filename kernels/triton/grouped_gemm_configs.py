"""Tile configs of the Triton grouped GEMM (kernels/triton/grouped_gemm.py): heuristic, override hook, tuned tables.

A config is a dict of ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps`` and ``num_stages``.
:func:`get_config` picks one per call from the weight kind (``"fp8"``, ``"fp8_fp4"``, ``"bf16"``),
N, K, the expected rows per group and the device type: an installed override
(:func:`set_config_override`, or a table of ``bench/tune_grouped_gemm.py`` installed by
:func:`load_tuned_configs`) first, else a small heuristic table. This module imports neither
torch nor triton.
"""

from __future__ import annotations

import json

__all__ = ["set_config_override", "get_config", "m_bucket", "load_tuned_configs", "check_config"]

#: The fields of a config dict.
_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")

_CONFIG_OVERRIDE = None


def set_config_override(fn) -> None:
    """Install ``fn(kind, n, k, m_hint, device_type) -> dict | None`` to replace the heuristic (None restores it).

    The dict holds ``BLOCK_M``, ``BLOCK_N`` (<= 128, dividing 128), ``BLOCK_K`` (128 for
    scaled kinds), ``num_warps`` and ``num_stages``; returning None falls back to the table.
    """
    global _CONFIG_OVERRIDE
    _CONFIG_OVERRIDE = fn


def get_config(kind: str, n: int, k: int, m_hint: int, device_type: str) -> dict:
    """Kernel config for one call: tile sizes by rows-per-group bucket (``m_hint``) and kind."""
    if _CONFIG_OVERRIDE is not None:
        cfg = _CONFIG_OVERRIDE(kind, n, k, m_hint, device_type)
        if cfg is not None:
            return dict(cfg)
    block_k = 64 if kind == "bf16" else 128
    if device_type != "cuda":  # interpreter: big tiles mean fewer Python-level programs
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=1)
    if m_bucket(m_hint) == "decode":  # decode-sized groups
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=block_k, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, num_warps=8, num_stages=3 if kind != "bf16" else 4)


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
    ``BLOCK_K == 128`` and ``BLOCK_N`` dividing 128.
    """
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if kind != "bf16" and (bk != 128 or 128 % bn):
        raise ValueError(f"scaled kinds need BLOCK_K == 128 and BLOCK_N dividing 128, got {cfg}")
