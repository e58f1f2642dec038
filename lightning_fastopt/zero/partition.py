"""Which data-parallel rank owns which parameter (ZeRO)."""

from __future__ import annotations

from collections.abc import Sequence


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
