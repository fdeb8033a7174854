"""DeepGEMM's ``deep_gemm.utils.dist``: the process-group helpers its multi-rank tests (``tests/test_mega_moe.py``)
call, for ``epkit.compat.deep_gemm``. On a machine without CUDA they use gloo on the CPU, so the same test runs on
CPU ranks; with CUDA, NCCL and one GPU per local rank, as DeepGEMM's do.
"""

from __future__ import annotations

import inspect
import os

import torch
import torch.distributed as dist

__all__ = ["init_dist", "uneven_all_gather", "dist_print"]

#: The local rank :func:`init_dist` was given in this process (``dist_print(once_in_node=True)`` prints on 0).
_LOCAL_RANK: int | None = None


def init_dist(local_rank: int, num_local_ranks: int) -> tuple[int, int, dist.ProcessGroup]:
    """Join the job as local rank ``local_rank`` of ``num_local_ranks`` on this node and return ``(rank, world size,
    a group of every rank)``. The rendezvous is ``tcp://MASTER_ADDR:MASTER_PORT`` (default ``127.0.0.1:8361``), nodes
    ``WORLD_SIZE`` (default 1) with this one ``RANK`` (default 0), global rank ``RANK * num_local_ranks +
    local_rank``. NCCL with CUDA (the default device then this rank's GPU), gloo on the CPU without."""
    global _LOCAL_RANK
    _LOCAL_RANK = local_rank
    addr, port = os.getenv("MASTER_ADDR", "127.0.0.1"), int(os.getenv("MASTER_PORT", "8361"))
    nodes, node = int(os.getenv("WORLD_SIZE", "1")), int(os.getenv("RANK", "0"))
    cuda = torch.cuda.is_available()
    kwargs: dict[str, object] = {}
    if cuda and "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        init_method=f"tcp://{addr}:{port}",
        world_size=nodes * num_local_ranks,
        rank=node * num_local_ranks + local_rank,
        **kwargs,  # type: ignore[arg-type]
    )
    if cuda:
        torch.set_default_device("cuda")
        torch.cuda.set_device(local_rank)
    group = dist.new_group(list(range(nodes * num_local_ranks)))
    return dist.get_rank(), dist.get_world_size(), group


def uneven_all_gather(tensor: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order, the ranks' sizes along ``dim`` free to differ
    (the other dims must agree)."""
    world = dist.get_world_size(group)
    size = torch.tensor([tensor.shape[dim]], dtype=torch.long, device=tensor.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    counts = [int(s.item()) for s in sizes]
    pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [0, max(counts) - tensor.shape[dim]]
    padded = (
        torch.nn.functional.pad(tensor, pad).contiguous() if max(counts) > tensor.shape[dim] else tensor.contiguous()
    )
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, c) for p, c in zip(parts, counts)], dim=dim)


def dist_print(s: str = "", once_in_node: bool = False) -> None:
    """Print ``s`` on every rank (``once_in_node``: on local rank 0 only), then wait for every rank (a barrier).
    Needs :func:`init_dist` first."""
    if _LOCAL_RANK is None:
        raise RuntimeError("dist_print: call init_dist first")
    if not once_in_node or _LOCAL_RANK == 0:
        print(s, flush=True)
    dist.barrier()
