"""Which data-parallel rank owns which parameter (ZeRO)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from lightning_fastopt.offload.partition import split_into_buckets


def assign_owners(numels: Sequence[int], world_size: int) -> list[int]:
    """The owning rank of each parameter: contiguous runs, balanced by element count.

    A parameter belongs to the rank whose ideal share (``total / world_size`` elements)
    contains the parameter's middle element, so every rank's share is within one tensor
    of the ideal, ranks own consecutive parameters (rank order is model order), and the
    result depends only on the sizes: the same on every rank and in every run.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    total = sum(numels)
    owners = []
    start = 0
    for n in numels:
        middle = start + n / 2
        owners.append(min(world_size - 1, int(middle * world_size / total)) if total else 0)
        start += n
    return owners


def owner_buckets(params: Sequence[Tensor], owners: Sequence[int], bucket_bytes: int) -> list[tuple[int, list[Tensor]]]:
    """``(owner, parameters)`` buckets of one owner and one dtype, of at most
    ``bucket_bytes`` (a larger tensor alone), owners in order of first appearance and
    parameters in the given order: the same list on every rank."""
    buckets = []
    for owner in dict.fromkeys(owners):
        mine = [p for p, o in zip(params, owners) if o == owner]
        for dtype in sorted({p.dtype for p in mine}, key=str):
            same = [p for p in mine if p.dtype == dtype]
            for chunk in split_into_buckets(same, [p.numel() * p.element_size() for p in same], bucket_bytes):
                buckets.append((owner, chunk))
    return buckets
