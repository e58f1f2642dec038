"""Which parameters go to the CPU, and how they are grouped into host buckets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from torch import Tensor

from lightning_fastopt.optim.base import check_range

T = TypeVar("T")


def choose_offloaded(params: Sequence[Tensor], fraction: float,
                     stays: Callable[[Tensor], bool] | None = None) -> list[bool]:
    """Which of ``params`` (in the order the model registers them) keep their master
    weights and optimizer state on the CPU: ``fraction`` of all elements, rounded up to
    whole tensors, taken from the end of the list, passing over those ``stays`` keeps on
    the device.

    Backward produces the gradients of the last layers first, so their device-to-host
    copies and CPU updates have the rest of backward to hide behind.  0 offloads nothing,
    1 everything.
    """
    check_range("offload_fraction", fraction, 0.0, 1.0)
    target = fraction * sum(p.numel() for p in params)
    chosen = [False] * len(params)
    taken = 0
    for i in reversed(range(len(params))):
        if taken >= target or target == 0:
            break
        if stays is not None and stays(params[i]):
            continue
        chosen[i] = True
        taken += params[i].numel()
    return chosen


def split_into_buckets(items: Sequence[T], sizes: Sequence[int], bucket_bytes: int) -> list[list[T]]:
    """Consecutive runs of ``items`` whose ``sizes`` (bytes) add up to at most
    ``bucket_bytes``; an item larger than that gets a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    buckets: list[list[T]] = []
    current: list[T] = []
    used = 0
    for item, size in zip(items, sizes):
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(item)
        used += size
    if current:
        buckets.append(current)
    return buckets
