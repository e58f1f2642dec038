"""What every fused optimizer shares: argument checks, state, bucketing, the step loop.

Subclasses are honest ``torch.optim.Optimizer``s (real ``defaults``, mutable
``param_groups``, LR schedulers work) whose state uses torch's names, so a
``state_dict`` moves between ours and the torch equivalent in both directions.  A
subclass declares its float32 state tensors (``state_keys``), whether it counts steps,
and implements ``_update`` for one bucket by calling a function of
:mod:`lightning_fastopt.functional`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.functional import grads_all_finite

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_range(name: str, value: Any, low: float, high: float = math.inf, *, low_open: bool = False,
                high_open: bool = False) -> None:
    """Raise a ValueError naming the argument and its allowed range."""
    v = float(value.item() if isinstance(value, Tensor) else value)
    ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok or math.isnan(v):
        lo = "(" if low_open else "["
        hi = ")" if high_open or high == math.inf else "]"
        raise ValueError(f"{name} must be in {lo}{low}, {high}{hi}, got {value}")


def check_betas(betas) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        check_range(f"betas[{i}]", b, 0.0, 1.0, high_open=True)


def check_lr(lr) -> None:
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"lr as a tensor must have one element, got shape {tuple(lr.shape)}")
    check_range("lr", lr, 0.0)


@dataclass
class Bucket:
    """Parameters of one group that are updated by one kernel call."""

    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    states: dict[str, list[Tensor]] = field(default_factory=dict)
    step: int = 1  # the step number after this update


class FusedOptimizer(torch.optim.Optimizer):
    state_keys: tuple[str, ...] = ()
    counts_steps: bool = True

    def __init__(self, params, defaults: dict[str, Any], *, foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False) -> None:
        name = type(self).__name__
        if differentiable:
            raise ValueError(f"{name} does not support differentiable=True (the kernels update in place "
                             "outside autograd); use the torch.optim optimizer for that")
        if capturable:
            raise ValueError(f"{name} does not support capturable=True yet (CUDA-graph capture needs the "
                             "CUDA kernels); use torch.optim with capturable=True")
        # foreach / fused choose torch's implementation; ours is always fused, so they have no effect.
        del foreach, fused
        super().__init__(params, defaults)
        self.skipped_steps = 0
        self.last_step_skipped = False

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group = self._normalize_group(dict(param_group))
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._validate_group(group)
        for p in group["params"]:
            if p.is_complex():
                raise TypeError(f"{type(self).__name__} does not support complex parameters")
            if p.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(f"{type(self).__name__} supports float32, float16 and bfloat16 parameters, "
                                f"got {p.dtype}")

    def _normalize_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """Translate our argument aliases into the stored keys (override)."""
        return group

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Raise ValueError for out-of-range hyperparameters (override)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A state dict from torch (or an older version) may lack our keys: use our defaults.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self.__dict__.setdefault("skipped_steps", 0)
        self.__dict__.setdefault("last_step_skipped", False)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        # Parameters of a group share one step tensor here; give each its own in the
        # saved copy, since torch's optimizers increment every parameter's step.
        for st in sd["state"].values():
            if isinstance(st.get("step"), Tensor):
                st["step"] = st["step"].detach().clone()
        return sd

    # ------------------------------------------------------------------ state
    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        """Create the float32 state of a parameter (override for non-zero initial values)."""
        for key in self.state_keys:
            state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def _buckets(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> list[Bucket]:
        """Split a group's parameters by device and by step count, creating missing state."""
        fresh_step: Tensor | None = None
        buckets: dict[tuple, Bucket] = {}
        step_tensors: dict[tuple, Tensor] = {}
        for p, g in zip(params, grads):
            state = self.state[p]
            if not state:
                self._init_state(group, p, state)
                if self.counts_steps:
                    if fresh_step is None:
                        fresh_step = torch.zeros((), dtype=torch.float32)
                    state["step"] = fresh_step
                first = True
            else:
                first = False
            if self.counts_steps:
                st = state["step"]
                if not isinstance(st, Tensor):
                    st = state["step"] = torch.tensor(float(st), dtype=torch.float32)
                key = (p.device, id(st))
                step_tensors.setdefault(key, st)
            else:
                key = (p.device, first)
            b = buckets.get(key)
            if b is None:
                b = buckets[key] = Bucket(states={k: [] for k in self._bucket_state_keys(group)})
                b.step = 1 if first else 2
            b.params.append(p)
            b.grads.append(g)
            for k in b.states:
                b.states[k].append(state[k])
        if self.counts_steps:
            buckets = self._merge_equal_steps(buckets, step_tensors)
        return list(buckets.values())

    def _merge_equal_steps(self, buckets: dict[tuple, Bucket], step_tensors: dict[tuple, Tensor]) -> dict:
        """Buckets whose step tensors hold the same count become one, sharing one tensor.

        After a load_state_dict every parameter has its own step tensor; this brings them
        back to one shared tensor per group, so the common case costs one increment."""
        merged: dict[tuple, Bucket] = {}
        shared: dict[tuple, Tensor] = {}
        for key, b in buckets.items():
            st = step_tensors[key]
            mkey = (key[0], float(st))
            if mkey in merged:
                m = merged[mkey]
                m.params += b.params
                m.grads += b.grads
                for k in m.states:
                    m.states[k] += b.states[k]
                for p in b.params:
                    self.state[p]["step"] = shared[mkey]
            else:
                merged[mkey] = b
                shared[mkey] = st
        for mkey, b in merged.items():
            st = shared[mkey]
            st.add_(1)
            b.step = int(st.item())
        return merged

    def _bucket_state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state tensors a bucket passes to the kernel (override when options add some)."""
        return self.state_keys

    # ------------------------------------------------------------------ step
    def _collect(self, group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
        params, grads = [], []
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided:
                raise ValueError(f"{type(self).__name__} does not support sparse gradients")
            if g.is_complex():
                raise TypeError(f"{type(self).__name__} does not support complex gradients")
            params.append(p)
            grads.append(g)
        return params, grads

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grad_scale: float | Tensor | None = None,
             check_finite: bool = False):
        """One optimizer step.

        grad_scale: divide the gradients by this (loss-scale unscaling, done in the kernel).
        check_finite: if any gradient is inf/NaN, update nothing, count the step in
        ``skipped_steps`` and set ``last_step_skipped``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        collected = [(group, *self._collect(group)) for group in self.param_groups]
        self.last_step_skipped = False
        if check_finite and not grads_all_finite([g for _, _, grads in collected for g in grads]):
            self.skipped_steps += 1
            self.last_step_skipped = True
            return loss
        context = self._step_context(collected, grad_scale)
        for group, params, grads in collected:
            if not params:
                continue
            for bucket in self._buckets(group, params, grads):
                self._update(group, bucket, grad_scale, context)
        return loss

    def _step_context(self, collected, grad_scale) -> Any:
        """Computed once per step before any update (LAMB: the global gradient norm)."""
        return None

    def _update(self, group: dict[str, Any], bucket: Bucket, grad_scale, context: Any) -> None:
        raise NotImplementedError
