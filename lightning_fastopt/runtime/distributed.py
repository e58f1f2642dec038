"""Small torch.distributed helpers shared by the precision plugin and the ZeRO optimizer."""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size(group=None) -> int:
    """Processes in ``group`` (1 when torch.distributed is not initialized)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_reduce_scalar(value: float, op=None, group=None) -> float:
    """``value`` reduced over the ranks of ``group`` (SUM unless ``op`` says otherwise); as
    it is with one process.  The tensor lives where the backend needs it (CUDA for NCCL)."""
    if world_size(group) == 1:
        return value
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return float(t.item())


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """``t`` (on the CPU) summed over the ranks of ``group``, on the CPU; ``t`` itself with one
    process.  Moved to CUDA and back for NCCL."""
    if world_size(group) == 1:
        return t
    on = t.cuda() if dist.get_backend(group) == "nccl" else t
    dist.all_reduce(on, op=dist.ReduceOp.SUM, group=group)
    return on.cpu()


def global_rank(group, rank: int) -> int:
    """The global rank of ``rank`` within ``group`` (None: the whole world)."""
    return dist.get_global_rank(group, rank) if group is not None else rank
