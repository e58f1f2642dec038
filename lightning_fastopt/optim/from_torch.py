"""The fused optimizer that runs a ``torch.optim`` optimizer: ``torch.optim.Adam/AdamW/SGD/
Adagrad`` become ``FusedAdam``/``FusedSGD``/``FusedAdagrad`` with the same hyperparameters,
sharing the very same ``param_groups`` dicts, so LR schedulers bound to the user's
optimizer keep working; our own optimizers are used as they are; any other optimizer is
a clear error."""

from __future__ import annotations

from typing import Any

import torch

from lightning_fastopt.optim.adagrad import FusedAdagrad
from lightning_fastopt.optim.adam import FusedAdam
from lightning_fastopt.optim.base import FusedOptimizer
from lightning_fastopt.optim.sgd import FusedSGD

# torch optimizer class -> the fused class that runs it
_MAPPED = {
    torch.optim.Adam: FusedAdam,
    torch.optim.AdamW: FusedAdam,
    torch.optim.SGD: FusedSGD,
    torch.optim.Adagrad: FusedAdagrad,
}
_SUPPORTED_NAMES = ("torch.optim.Adam", "torch.optim.AdamW", "torch.optim.SGD", "torch.optim.Adagrad",
                    "lightning_fastopt.FusedAdam/CPUAdam/FusedLAMB/FusedSGD/FusedLars/FusedLion/FusedAdagrad")


def to_fused_optimizer(optimizer: torch.optim.Optimizer) -> FusedOptimizer:
    """The fused equivalent of a torch optimizer, sharing its param_groups (and state)."""
    if isinstance(optimizer, FusedOptimizer):
        return optimizer
    fused_cls = _MAPPED.get(type(optimizer))
    if fused_cls is None:
        raise ValueError(f"the fastopt strategies cannot run {type(optimizer).__module__}.{type(optimizer).__name__}; "
                         f"supported optimizers: {', '.join(_SUPPORTED_NAMES)}")
    for group in optimizer.param_groups:
        for flag in ("differentiable", "capturable"):
            if group.get(flag):
                raise ValueError(f"{type(optimizer).__name__}({flag}=True) cannot be mapped to {fused_cls.__name__}")
    placeholder = torch.nn.Parameter(torch.zeros(1))
    fused = fused_cls([placeholder], **_fused_kwargs(optimizer))
    # the same dict objects: a scheduler writing group["lr"] into the user's optimizer
    # reaches ours; our own keys get their defaults
    fused.param_groups = optimizer.param_groups
    for group in fused.param_groups:
        for key, value in fused.defaults.items():
            group.setdefault(key, value)
        fused._validate_group(group)
    # the state moves over as it is (not through load_state_dict, which would replace the
    # shared param_groups with copies); ours keeps float32 state
    fused.state.clear()
    for p, st in optimizer.state.items():
        fused.state[p] = {k: v if k == "step" or not torch.is_tensor(v) else v.float().contiguous()
                          for k, v in st.items()}
    return fused


def _fused_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    d = optimizer.defaults
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        decoupled = isinstance(optimizer, torch.optim.AdamW) or d.get("decoupled_weight_decay", False)
        return dict(lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                    amsgrad=d["amsgrad"], adamw_mode=bool(decoupled), maximize=d.get("maximize", False))
    if isinstance(optimizer, torch.optim.SGD):
        return dict(lr=d["lr"], momentum=d["momentum"], dampening=d["dampening"], weight_decay=d["weight_decay"],
                    nesterov=d["nesterov"], maximize=d.get("maximize", False))
    return dict(lr=d["lr"], lr_decay=d["lr_decay"], weight_decay=d["weight_decay"],
                initial_accumulator_value=d["initial_accumulator_value"], eps=d["eps"],
                maximize=d.get("maximize", False))
