"""DeepSpeed's learning-rate schedules (a config's ``scheduler`` section) as torch schedulers,
each step's rate the one DeepSpeed's own class gives (``deepspeed.runtime.lr_schedules``;
tests/test_from_deepspeed.py compares them step by step with DeepSpeed's, installed).

DeepSpeed's engine sets the rate of iteration -1 when the schedule is made and steps it
after each optimizer step, as Lightning steps a scheduler whose interval is ``"step"``; a
torch scheduler's ``last_epoch`` is one ahead of DeepSpeed's ``last_batch_iteration``
(torch steps once when made). The arithmetic is done in DeepSpeed's order, so that the
rates are the same floats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

_WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name} gives {len(value)} values for {len(optimizer.param_groups)} parameter groups")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


def _check_warmup(warmup_num_steps: Any, warmup_type: Any) -> None:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in _WARMUP_TYPES:
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")


class _Warmup(LRScheduler):
    """The warm-up shared by the schedules: a share of the way from the start to the top,
    rising as ``log(i + 1) / log(n)`` or ``i / n`` over ``n`` iterations (at least 2)."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int, warmup_type: str,
                 last_epoch: int = -1) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self._inverse_log = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer, last_epoch)

    def _rising(self, iteration: int) -> float:
        if self.warmup_type == "log":
            return self._inverse_log * math.log(iteration + 1)
        return iteration / self.warmup_num_steps

    def get_lr(self) -> list[float]:
        return self.rates(self.last_epoch - 1)  # DeepSpeed's iteration: one behind torch's count

    def rates(self, iteration: int) -> list[float]:
        raise NotImplementedError


class WarmupLR(_Warmup):
    """DeepSpeed's ``WarmupLR``: from ``warmup_min_lr`` to ``warmup_max_lr`` (default: each
    group's rate) over ``warmup_num_steps``, then flat."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_epoch: int = -1) -> None:
        top = [g["lr"] for g in optimizer.param_groups] if warmup_max_lr is None else warmup_max_lr
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, top, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_epoch)

    def _share(self, iteration: int) -> float:
        return self._rising(iteration) if iteration < self.warmup_num_steps else 1.0

    def rates(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        share = self._share(iteration)
        return [low + (delta * share) for low, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's ``WarmupDecayLR``: ``WarmupLR``'s rise, then a straight line down to 0 at
    ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: float | Sequence[float] = 0.0, warmup_max_lr: float | Sequence[float] = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1) -> None:
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def _share(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._rising(iteration)
        return max(0.0, float(self.total_num_steps - iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Warmup):
    """DeepSpeed's ``WarmupCosineLR``: each group's rate times a ratio rising from
    ``warmup_min_ratio`` to 1 over ``warmup_num_steps``, then falling along a cosine to
    ``cos_min_ratio`` at ``total_num_steps`` (0 before the first step, as DeepSpeed's)."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_epoch: int = -1) -> None:
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_epoch)

    def _ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + self._rising(iteration) * (1. - self.warmup_min_ratio)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1)
                       / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * cosine)

    def rates(self, iteration: int) -> list[float]:
        ratio = self._ratio(iteration)
        return [lr * ratio for lr in self.org_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
"""The ``scheduler.type`` names read (DeepSpeed's ``OneCycle`` and ``LRRangeTest`` are not yet)."""
