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

__all__ = ["SCHEDULES", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

_WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name} gives {len(value)} values for {len(optimizer.param_groups)} parameter groups")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_warmup(warmup_num_steps: Any, warmup_type: Any) -> None:
    _check_positive("warmup_num_steps", warmup_num_steps)
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
        _check_positive("total_num_steps", total_num_steps)
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
        _check_positive("total_num_steps", total_num_steps)
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


class OneCycle(LRScheduler):
    """DeepSpeed's ``OneCycle``: the rate rises from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` iterations and falls back over ``cycle_second_step_size``
    (default: the same), in ``cycle_*_stair_count`` flat stairs where given, then decays by
    ``decay_lr_rate`` every ``decay_step_size``; with ``cycle_momentum`` (where the optimizer
    has ``betas``) Adam's first beta moves the other way between ``cycle_max_mom`` and
    ``cycle_min_mom``, the second set to 0.99, as DeepSpeed's does."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float | Sequence[float],
                 cycle_max_lr: float | Sequence[float], decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_epoch: int = -1) -> None:
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0 or second < 0:
            raise ValueError(f"cycle_first_step_size must be positive and cycle_second_step_size not negative, got "
                             f"{cycle_first_step_size!r} and {cycle_second_step_size!r}")
        self.first_size, self.second_size, self.total_size = first, second, first + second
        self.step_ratio = first / self.total_size
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.decays_lr = not (math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0))
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        self.decay_mom_rate = decay_mom_rate
        self.decays_mom = not (math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0))
        for group, low in zip(optimizer.param_groups, self.min_lrs):
            group["lr"] = low  # as DeepSpeed's, before its first step
        super().__init__(optimizer, last_epoch)
        if self.cycle_momentum:
            for group, momentum in zip(optimizer.param_groups, self.min_moms):
                group["betas"] = momentum  # as DeepSpeed's, before its first step

    def _scale(self, iteration: int) -> float:
        done = iteration + 1
        cycle = math.floor(1 + done / self.total_size)
        x = 1. + done / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stairs
        if stairs > 0:
            within = done % self.total_size
            if within <= self.first_size:
                position = within * stairs / self.first_size
            else:
                position = (self.total_size - within) * stairs / self.second_size
            scale = math.floor(position) / stairs
        return scale

    def rates(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if not self.decays_lr:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [low / factor for low in self.min_lrs]

    def momenta(self, iteration: int) -> list[tuple[float, float]]:
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [(high[0] - (high[0] - low[0]) * scale, low[1]) for low, high in zip(self.min_moms, self.max_moms)]
        if not self.decays_mom:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [(beta0 * factor, beta1) for beta0, beta1 in self.max_moms]

    def get_lr(self) -> list[float]:
        return self.rates(self.last_epoch - 1)

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.cycle_momentum and self.last_epoch > 0:
            for group, momentum in zip(self.optimizer.param_groups, self.momenta(self.last_epoch - 1)):
                group["betas"] = momentum


class LRRangeTest(LRScheduler):
    """DeepSpeed's ``LRRangeTest``: ``lr_range_test_min_lr`` times ``1 + step_rate * i /
    step_size`` (``i`` the steps taken; whole intervals only with ``lr_range_test_staircase``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_epoch: int = -1) -> None:
        _check_positive("lr_range_test_step_size", lr_range_test_step_size)
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate = lr_range_test_step_size, lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        taken = float(self.last_epoch) / self.step_size  # DeepSpeed's iteration + 1
        increase = 1 + self.step_rate * (math.floor(taken) if self.staircase else taken)
        return [low * increase for low in self.min_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
             "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}
"""The ``scheduler.type`` names read: every schedule of DeepSpeed's."""
