"""The local checks of every EP call (shapes, dtypes, devices, capacities: no data moves, nothing is agreed) and
the dispatch layout (which rank gets which token). Callers carry a check's error into their agreement step, so
that every rank raises it."""

from __future__ import annotations

import torch

from epkit.collectives.ep import ll_out
from epkit.collectives.ep.agreement import error_text
from epkit.collectives.ep.config import EPConfig
from epkit.collectives.ep.handles import DispatchHandle
from epkit.collectives.ep.ll_layout import LowLatencyHandle
from epkit.collectives.ep.ll_out import LLOut
from epkit.collectives.ep.rows import Bias, check_biases
from epkit.kernels.triton.ep_layout import check_aligned
from epkit.utils import check_topk_idx

__all__ = [
    "cached_dispatch_error",
    "num_sms_error",
    "check_combine",
    "dispatch_error",
    "check_ll_combine",
    "check_ll_dispatch",
    "check_topk",
    "dispatch_layout",
    "validate_dispatch",
]


def check_topk(cfg: EPConfig, topk_idx: torch.Tensor, num_tokens: int, check_values: bool = True) -> None:
    check_topk_idx(topk_idx, cfg.num_experts, cfg.num_topk, check_values)
    if topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx has shape {tuple(topk_idx.shape)}, expected ({num_tokens}, {cfg.num_topk})")


def validate_dispatch(
    cfg: EPConfig,
    device: torch.device,
    x: torch.Tensor,
    scales: torch.Tensor | None,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    capacity: int,
    check_values: bool = True,
) -> None:
    """Raise ValueError for dispatch inputs a buffer of ``cfg`` moving rows on ``device`` cannot take.
    ``check_values=False`` leaves the expert ids' range to the caller (the device kernels check it on the device:
    no host read).

    ``x [T, hidden]`` on ``device`` (bf16/fp16/fp32, or e4m3 with ``scales [T, ceil(hidden/128)]`` float32), at
    most ``capacity`` tokens; ``topk_idx [T, num_topk]`` in ``[-1, num_experts)``; ``topk_weights [T, num_topk]``
    or None.
    """
    h = cfg.hidden
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h:
        raise ValueError(f"x must be [num_tokens, {h}], got {tuple(getattr(x, 'shape', ()))}")
    if x.device != device:
        raise ValueError(f"x is on {x.device} but this EPBuffer moves rows on {device}")
    if x.dtype not in (torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn):
        raise ValueError(f"x dtype {x.dtype} is not supported (bfloat16, float16, float32, float8_e4m3fn)")
    if (x.dtype == torch.float8_e4m3fn) != (scales is not None):
        raise ValueError("FP8 x must come as (x_fp8, scales) with float32 scales [num_tokens, ceil(hidden/128)]")
    t = x.shape[0]
    if t > capacity:
        raise ValueError(f"{t} tokens exceed num_max_tokens_per_rank = {capacity}")
    if scales is not None and (scales.dtype != torch.float32 or tuple(scales.shape) != (t, -(-h // 128))):
        raise ValueError(f"scales must be float32 [{t}, {-(-h // 128)}], got {scales.dtype} {tuple(scales.shape)}")
    check_topk(cfg, topk_idx, t, check_values)
    if topk_weights is not None and tuple(topk_weights.shape) != (t, cfg.num_topk):
        raise ValueError(f"topk_weights must be [{t}, {cfg.num_topk}], got {tuple(topk_weights.shape)}")


def num_sms_error(num_sms: object) -> str | None:
    """The verdict on a call's ``num_sms`` (None, or an int >= 2: the programs of its kernels' multi-program
    launches on the device kernels, no effect elsewhere)."""
    if num_sms is None or (isinstance(num_sms, int) and not isinstance(num_sms, bool) and num_sms >= 2):
        return None
    return f"num_sms must be None or an int >= 2 (the programs of each device-kernel launch), got {num_sms!r}"


def dispatch_error(
    cfg: EPConfig, device: torch.device, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None, alignment: int, on_device: bool,
) -> str | None:  # fmt: skip
    """A dispatch's verdict on its own inputs: the error text every rank is to raise, or None. ``on_device``: the
    device kernels check the expert ids on the device, and need 16-byte aligned rows."""
    try:
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
            raise ValueError(f"expert_alignment must be an int >= 1, got {alignment!r}")
        validate_dispatch(cfg, device, x, scales, topk_idx, topk_weights, cfg.num_max_tokens_per_rank, not on_device)
        if on_device:
            check_aligned("x", x)
        if topk_weights is not None and not isinstance(topk_weights, torch.Tensor):
            raise ValueError(f"topk_weights must be a tensor, got {type(topk_weights).__name__}")
    except Exception as exc:  # noqa: BLE001 -- every rank must learn of it: no exception may skip the agreement
        return error_text(exc)
    return None


def cached_dispatch_error(
    cfg: EPConfig, device: torch.device, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle
) -> str | None:
    """A cached dispatch's verdict on its own inputs (``x`` and ``scales`` as a dispatch takes them, as many tokens
    as the handle's dispatch had): the error text, or None."""
    try:
        if not isinstance(handle, DispatchHandle):
            raise ValueError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"x must be [num_tokens, {cfg.hidden}]")
        no_routing = torch.zeros((x.shape[0], cfg.num_topk), dtype=torch.int64)
        validate_dispatch(cfg, device, x, scales, no_routing, None, cfg.num_max_tokens_per_rank, False)  # no ids
        if x.shape[0] != handle.num_tokens:
            raise ValueError(f"cached dispatch: x has {x.shape[0]} tokens, the handle was made for {handle.num_tokens}")
    except Exception as exc:  # noqa: BLE001 -- every rank must learn of it in the agreement
        return error_text(exc)
    return None


def order_error(order: object, handle: object, world: int, device: torch.device, on_device: bool) -> str | None:
    """The verdict on a combine's ``order`` (``EPBuffer.combine``): None when absent or ``[T, W]`` int32 on the
    buffer's device with the device kernels (its values are not read back)."""
    if order is None:
        return None
    if not on_device:
        return "order needs the device kernels (this buffer's normal mode is host-driven: use combine_unsummed)"
    t = handle.num_tokens if isinstance(handle, DispatchHandle) else None
    if (
        not isinstance(order, torch.Tensor)
        or order.dtype != torch.int32
        or tuple(order.shape) != (t, world)
        or order.device != device
    ):
        return f"order must be int32 [{t}, {world}] on {device}, got {order!r:.60}"
    return None


def check_combine(
    cfg: EPConfig,
    device: torch.device,
    y: torch.Tensor,
    handle: DispatchHandle,
    topk_weights: torch.Tensor | None,
    bias: Bias,
    on_device: bool,
) -> tuple[str | None, list[torch.Tensor], torch.Tensor | None]:
    """A combine's verdict on its own inputs: ``(error text or None, biases, weights)`` (the biases as a list, the
    expanded mode's weights, else None)."""
    h = cfg.hidden
    biases: list[torch.Tensor] = []
    weights: torch.Tensor | None = None
    try:
        if not isinstance(handle, DispatchHandle):
            hint = " (dispatch's fourth value, the per-expert counts; its fifth is)" * isinstance(handle, list)
            raise ValueError(f"handle must be the DispatchHandle of a dispatch, got {type(handle).__name__}{hint}")
        biases = check_biases(bias, handle.num_tokens, h)
        if handle.worst is not None:  # a worst-case dispatch's y is as padded as its outputs
            want_rows = handle.worst[1] if handle.expand else handle.worst[0]
        elif handle.expand:
            assert handle.expanded_rows is not None  # an expanded dispatch's handle holds its rows
            want_rows = handle.expanded_rows.numel()
        else:
            want_rows = sum(handle.recv_counts)
        if (
            not isinstance(y, torch.Tensor)
            or y.dim() != 2
            or tuple(y.shape) != (want_rows, h)
            or y.dtype not in (torch.bfloat16, torch.float32, torch.float16)
            or y.device != device
        ):
            raise ValueError(
                f"y must be bf16/fp16/fp32 [{want_rows}, {h}] on {device}, got {getattr(y, 'dtype', None)} "
                f"{tuple(getattr(y, 'shape', ()))} on {getattr(y, 'device', None)}"
            )
        if on_device:
            for what, t in (("y", y), *((f"bias {i}", b) for i, b in enumerate(biases))):
                check_aligned(what, t)
        if handle.expand:
            weights = handle.recv_topk_weights
            if topk_weights is not None:
                want = (handle.worst[0], cfg.num_topk) if handle.worst else tuple(handle.recv_topk_idx.shape)
                if tuple(topk_weights.shape) != want:
                    raise ValueError(f"topk_weights must be {want}, got {tuple(topk_weights.shape)}")
                weights = topk_weights.float()[: handle.recv_topk_idx.shape[0]]  # a host path's worst case: received
    except Exception as exc:  # noqa: BLE001 -- every rank must learn of it in the agreement
        return error_text(exc), biases, weights
    return None, biases, weights


def dispatch_layout(cfg: EPConfig, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(num_tokens_per_rank [W] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool)`` on
    ``topk_idx``'s device. Entries of -1 are skipped; a token counts once per rank however many of its experts
    live there."""
    check_topk(cfg, topk_idx, topk_idx.shape[0] if topk_idx.dim() == 2 else -1)
    dev, ids = topk_idx.device, topk_idx.cpu().long().contiguous()
    t, w = ids.shape[0], cfg.world_size
    in_rank = torch.empty((t, w), dtype=torch.bool)
    per_rank = torch.empty(w, dtype=torch.int32)
    per_expert = torch.empty(cfg.num_experts, dtype=torch.int32)
    from epkit import _C  # one pass over the routing (ids checked above)

    _C.dispatch_layout(
        ids.data_ptr(), t, ids.shape[1], cfg.num_local_experts, w, cfg.num_experts,
        in_rank.data_ptr(), per_rank.data_ptr(), per_expert.data_ptr(),
    )  # fmt: skip
    return per_rank.to(dev), per_expert.to(dev), in_rank.to(dev)


def check_ll_dispatch(
    cfg: EPConfig,
    device: torch.device,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    n_max: int,
    use_fp8: bool,
    out: LLOut,
    stream_ordered: bool,
) -> None:
    """A low-latency dispatch's checks that need no data (every path), then, on a host-checked path (not
    ``stream_ordered``), the expert ids' range."""
    h, cap = cfg.hidden, cfg.num_max_dispatch_tokens_per_rank
    if isinstance(n_max, bool) or not isinstance(n_max, int) or not 0 < n_max <= cap:
        raise ValueError(f"num_max_dispatch_tokens_per_rank must be in [1, {cap}], got {n_max!r}")
    ll_out.check_dispatch_out(out, cfg.num_local_experts, n_max * cfg.world_size, h, use_fp8, device)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h or x.dtype != torch.bfloat16:
        raise ValueError(
            f"x must be bfloat16 [num_tokens, {h}], got {getattr(x, 'dtype', None)} {tuple(getattr(x, 'shape', ()))}"
        )
    if x.device != device:
        raise ValueError(f"x is on {x.device} but this EPBuffer moves rows on {device}")
    if x.shape[0] > n_max:
        raise ValueError(f"{x.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank = {n_max}")
    if not isinstance(topk_idx, torch.Tensor) or tuple(topk_idx.shape) != (x.shape[0], cfg.num_topk):
        raise ValueError(
            f"topk_idx must be [{x.shape[0]}, {cfg.num_topk}], got {tuple(getattr(topk_idx, 'shape', ()))}"
        )
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if stream_ordered:
        if topk_idx.device != device:
            raise ValueError(f"topk_idx is on {topk_idx.device}; the low-latency path needs it on {device}")
    else:
        check_topk(cfg, topk_idx, x.shape[0])


def check_ll_combine(
    cfg: EPConfig,
    device: torch.device,
    y: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: LowLatencyHandle,
    out: torch.Tensor | None,
    stream_ordered: bool,
    on_device: bool,
) -> None:
    """A low-latency combine's local checks (ValueError): ``y`` in the dispatch's masked layout, the routing of the
    handle's size, ``out`` if given; ``stream_ordered``: the weights on ``device``; ``on_device``: the device kernels
    need 16-byte aligned rows."""
    w, L, K, h = cfg.world_size, cfg.num_local_experts, cfg.num_topk, cfg.hidden
    t_num, n_max = handle.num_tokens, handle.n_max
    want = (L, n_max * w, h)
    if not isinstance(y, torch.Tensor) or y.dtype != torch.bfloat16 or tuple(y.shape) != want or y.device != device:
        raise ValueError(
            f"y must be bfloat16 {want} on {device} (the dispatch's masked layout), got "
            f"{getattr(y, 'dtype', None)} {tuple(getattr(y, 'shape', ()))} on {getattr(y, 'device', None)}"
        )
    if tuple(topk_idx.shape) != (t_num, K) or tuple(topk_weights.shape) != (t_num, K):
        raise ValueError(f"topk_idx and topk_weights must be [{t_num}, {K}]")
    if stream_ordered and topk_weights.device != device:
        raise ValueError(f"topk_weights is on {topk_weights.device}; the low-latency path needs {device}")
    ll_out.check_combine_out(out, t_num, h, device)
    if on_device:
        check_aligned("y", y)
        check_aligned("out", out)
