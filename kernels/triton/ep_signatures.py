"""Ahead-of-time compile signatures of every dispatch/combine kernel (rung 3: compiled for sm_90 in CI).

``signatures(...)`` gives, per kernel name, ``(kernel, signature, constexprs)`` for
``epkit.testing.compile_triton``, with the constexprs of a launch at the given sizes (by default the issue's
target shapes: hidden 7168, 256 experts, top-8, 8 ranks, 128 low-latency tokens).
"""

from __future__ import annotations

import triton

from epkit.kernels.triton import ep_combine as cb
from epkit.kernels.triton import ep_low_latency as ll
from epkit.kernels.triton import ep_normal as nm
from epkit.kernels.triton import ep_normal_recv as nr
from epkit.kernels.triton.ep_common import row_words, signature

__all__ = ["signatures"]


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def signatures(hidden: int = 7168, num_experts: int = 256, num_topk: int = 8, world: int = 8, fp8: bool = True):
    """``{name: (kernel, signature, constexprs)}`` for every dispatch/combine kernel, as launched on a GPU (FP8
    rows in both dispatches when ``fp8``; bf16 combines)."""
    return {
        **_low_latency(hidden, num_experts, num_topk, world, fp8),
        **_normal(hidden, num_experts, num_topk, world, fp8),
    }


def _low_latency(hidden: int, num_experts: int, num_topk: int, world: int, fp8: bool) -> dict:
    h, e, k, w = hidden, num_experts, num_topk, world
    local = e // w
    header = -(-4 * (3 + local) // 16) * 16 + 192
    xb, sb = ll.row_bytes(h, fp8)
    block_t = max(1, 16 // _p2(k))
    out = {
        "ll_dispatch_send": signature(
            ll.KERNELS["ll_dispatch_send"],
            {"x_ptr": "*bf16", "idx_ptr": "*i64", "route_ptr": "*i32", "text_ptr": "*u8", "stage_table": "*i64",
             "ctrl_table": "*i64"},
            {"E": e, "L": local, "K": k, "H": h, "FP8": int(fp8), "HDR": header, "TEXT": 192, "BLOCK_T": block_t,
             "NP2": _p2(block_t * k), "E_P2": _p2(e), "L_P2": _p2(local), "G_P2": _p2(-(-h // 128))},
        ),
        "ll_dispatch_recv": signature(
            ll.KERNELS["ll_dispatch_recv"],
            {"counts_ptr": "*i64", "recv_count_ptr": "*i32", "load_ptr": "*i64"},
            {"L": local, "XB": xb, "SB": sb, "FP8": int(fp8), "HDR": header, "W_P2": _p2(w), "L_P2": _p2(local),
             "BLOCK_R": 4, "BW_X": min(1024, _p2(xb // 4)), "BW_S": min(1024, _p2(sb // 4)),
             "VEC_S": 16 if sb % 16 == 0 else 4, "HW_TIMER": True},
        ),
        "ll_combine_send": signature(
            ll.KERNELS["ll_combine_send"],
            {"counts_ptr": "*i64", "stage_table": "*i64", "ctrl_table": "*i64"},
            {"L": local, "ROW": 2 * h, "W_P2": _p2(w), "BLOCK_R": 4, "BW": min(1024, _p2(2 * h // 4))},
        ),
        "ll_combine_recv": signature(
            ll.KERNELS["ll_combine_recv"],
            {"out_ptr": "*bf16", "w_ptr": "*fp32", "route_ptr": "*i32"},
            {"K": k, "K_P2": _p2(k), "H": h, "W_P2": _p2(w), "BT": 1, "BLOCK_H": min(1024, _p2(h)), "HW_TIMER": True},
        ),
    }  # fmt: skip
    return out


def _normal(hidden: int, num_experts: int, num_topk: int, world: int, fp8: bool) -> dict:
    h, e, k, w = hidden, num_experts, num_topk, world
    local, t64 = e // w, "*i64"
    xb, sb = ll.row_bytes(h, fp8)
    z = {"K_P2": _p2(k), "W_P2": _p2(w), "E_P2": _p2(e), "L_P2": _p2(local), "P_P2": 128, "BT": max(1, 16 // _p2(w))}
    return {
        "layout": signature(
            nm.KERNELS["layout"], {"idx_ptr": t64, "counts_ptr": "*i32"},
            {"E": e, "L": local, "K": k, "BT": z["BT"], "K_P2": z["K_P2"], "W_P2": z["W_P2"], "E_P2": z["E_P2"]},
        ),
        "notify": signature(
            nm.KERNELS["notify"],
            {"counts_ptr": "*i32", "layout_ptr": t64, "text_ptr": "*u8", "notify_table": t64, "ctrl_table": t64},
            {"E": e, "L": local, "W_P2": z["W_P2"], "E_P2": z["E_P2"], "L_P2": z["L_P2"], "P_P2": z["P_P2"],
             "EB": 64, "TEXT": 192, "TEXT_P2": 256, "HW_TIMER": True},
        ),
        "dispatch_send": signature(
            nm.KERNELS["dispatch_send"],
            {"x_ptr": "*fp8e4nv" if fp8 else "*bf16", "s_ptr": "*fp32", "idx_ptr": t64, "w_ptr": "*fp32",
             "layout_ptr": t64, "send_pos_ptr": "*i32", "rows_table": t64, "ctrl_table": t64},
            {"E": e, "L": local, "K": k, "XB": xb, "SB": sb, "HAS_W": True, "BT": z["BT"], "K_P2": z["K_P2"],
             "W_P2": z["W_P2"], "E_P2": z["E_P2"], "P_P2": z["P_P2"], "BW_X": row_words(xb), "BW_S": row_words(sb)},
        ),
        "dispatch_recv": signature(
            nr.KERNELS["dispatch_recv"],
            {"out_idx_ptr": t64, "out_w_ptr": "*fp32", "exp_rows_ptr": t64, "slot_ptr": t64, "m_ptr": "*i32",
             "layout_ptr": t64},
            {"K": k, "K_P2": z["K_P2"], "XB": xb, "SB": sb, "EXPAND": True, "W_P2": z["W_P2"], "E_P2": z["E_P2"],
             "P_P2": z["P_P2"], "L_P2": z["L_P2"], "BLOCK_R": 4, "BW_X": row_words(xb),
             "BW_E": max(4, min(row_words(xb), 4096 // (4 * z["K_P2"]))), "BW_S": row_words(sb), "HW_TIMER": True},
        ),
        "agree": signature(
            cb.KERNELS["agree"], {"text_ptr": "*u8", "agree_table": t64, "ctrl_table": t64},
            {"W_P2": z["W_P2"], "TEXT": 192, "TEXT_P2": 256, "HW_TIMER": True},
        ),
        **{
            name: signature(
                cb.KERNELS["combine_send"],
                {"slot_ptr": t64, "w_ptr": "*fp32", "layout_ptr": t64, "rows_table": t64, "ctrl_table": t64},
                {"K": k, "K_P2": z["K_P2"], "H": h, "DT": 0, "EXPAND": expand, "W_P2": z["W_P2"], "BLOCK_R": 4,
                 "BLOCK_H": 256, "BW": row_words(2 * h)},
            )
            for name, expand in (("combine_send", False), ("combine_send_expand", True))
        },
        "combine_reduce": signature(
            cb.KERNELS["combine_reduce"],
            {"out_ptr": "*bf16", "send_pos_ptr": "*i32", "b1_ptr": "*bf16", "b2_ptr": "*bf16"},
            {"H": h, "DT": 0, "NB": 1, "BDT": 0, "BDT2": 0, "BLOCK_T": 1, "BLOCK_H": min(1024, _p2(h)),
             "HW_TIMER": True},
        ),
    }  # fmt: skip
